"""Rollout state per sequence at 1K, 8K and 32K tokens of context: the native engine's slot cache
beside transformers' `KimiLinearForCausalLM` cache, for the same model shapes (a memory count, not
a timing: it can run alongside anything).

- ours: `SlotCache.bytes_per_slot` (every KDA layer's float32 recurrent state and W-1 short-conv
  columns) plus the context rounded up to 16-token blocks times `SlotCache.bytes_per_token` (every
  MLA/DSA layer's latent and rope keys, and DSA's index key), from the model config alone;
  tests/rl/test_rl_rollout_engine.py checks that these figures are what a SlotCache allocates.
- transformers: the storages of the tensors in `past_key_values` after a prefill of one sequence,
  each storage counted once. Measured per layer at 64, 128 and 192 tokens; each layer's bytes must
  be a + b * tokens on the three (else the script stops), then scaled to the context and, for the
  presets, to their layer counts.

Models: the Kimi-Linear-shaped toy of benchmarks/rollout_engines_cpu.py (3 KDA + 1 MLA, float32 as on CPU;
measured whole, and also prefilled at --prefill lengths to check the extrapolation), and presets
of policy/config.py in bfloat16 (as on GPU). A preset is measured on a stand-in of 1 KDA + 1 MLA
layer with its attention shapes and hidden size, experts and vocabulary cut (no cache tensor
depends on those), so nothing of the preset's size is allocated. transformers has no DSA layer:
for DSA presets its column is an MLA cache of the same shapes.

    .venv/bin/python benchmarks/rollout_cache_bytes.py --json /tmp/cache_bytes.json
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.bench_common import log, write_json  # noqa: E402
from benchmarks.rollout_engines_cpu import kimi_linear  # noqa: E402
from policy.config import ModelConfig, get_config  # noqa: E402
from policy.slot_cache import BLOCK_SIZE, SlotCache  # noqa: E402

CONTEXTS = (1024, 8192, 32768)
PROBES = (64, 128, 192)  # prefill lengths the per-layer fit is measured at
MIB = 1 << 20


def ours(cfg: ModelConfig, dtype: torch.dtype, tokens: int) -> int:
    blocks = -(-tokens // BLOCK_SIZE)
    return SlotCache.bytes_per_slot(cfg, dtype) + blocks * BLOCK_SIZE * SlotCache.bytes_per_token(cfg, dtype)


def storage_bytes(obj: Any, seen: set[int]) -> int:
    """Bytes of the storages of the tensors in `obj` (nested dicts, lists, tuples), each storage once."""
    if isinstance(obj, torch.Tensor):
        storage = obj.untyped_storage()
        if storage.nbytes() == 0 or storage.data_ptr() in seen:
            return 0
        seen.add(storage.data_ptr())
        return storage.nbytes()
    if isinstance(obj, dict):
        obj = list(obj.values())
    if isinstance(obj, (list, tuple)):
        return sum(storage_bytes(x, seen) for x in obj)
    return 0


@torch.no_grad()
def cache_bytes_per_layer(hf_model, tokens: int) -> list[int]:
    ids = torch.randint(10, hf_model.config.vocab_size, (1, tokens), generator=torch.Generator().manual_seed(0))
    cache = hf_model(ids, use_cache=True, logits_to_keep=1).past_key_values
    seen: set[int] = set()
    return [storage_bytes(vars(layer), seen) for layer in cache.layers]


def fit_by_kind(hf_model) -> dict[str, tuple[int, int]]:
    """(bytes at 0 tokens, bytes per token) of each kind of layer ("linear_attention", "full_attention")."""
    measured = [cache_bytes_per_layer(hf_model, t) for t in PROBES]
    fits: dict[str, tuple[int, int]] = {}
    for i, kind in enumerate(hf_model.config.layer_types):
        y0, y1, y2 = (m[i] for m in measured)
        step = PROBES[1] - PROBES[0]
        if y2 - y1 != y1 - y0 or (y1 - y0) % step or PROBES[2] - PROBES[1] != step:
            raise RuntimeError(f"layer {i} ({kind}): {list(zip(PROBES, (y0, y1, y2)))} bytes is not linear in tokens")
        per_token = (y1 - y0) // step
        fit = (y0 - per_token * PROBES[0], per_token)
        if fits.setdefault(kind, fit) != fit:
            raise RuntimeError(f"layers of kind {kind} hold different caches: {fits[kind]} and {fit}")
    return fits


def hf_total(fits: dict[str, tuple[int, int]], cfg: ModelConfig, tokens: int) -> int:
    n_kda = cfg.layer_types.count("kda")
    counts = {"linear_attention": n_kda, "full_attention": cfg.num_hidden_layers - n_kda}
    return sum(counts[kind] * (a + b * tokens) for kind, (a, b) in fits.items())


def stand_in(cfg: ModelConfig, dtype: torch.dtype):
    """transformers' KimiLinear with `cfg`'s attention shapes: 1 KDA + 1 MLA layer, the rest cut."""
    from transformers import KimiLinearConfig, KimiLinearForCausalLM

    if cfg.num_v_heads != cfg.linear_num_heads or cfg.v_dim != cfg.linear_head_dim:
        raise ValueError(f"{cfg.name}: transformers' KDA has as many value heads and dims as key ones")
    hf = KimiLinearConfig(
        vocab_size=512, hidden_size=64, intermediate_size=64, num_hidden_layers=2,
        layer_types=["linear_attention", "full_attention"], mlp_layer_types=["dense", "dense"],
        num_attention_heads=cfg.num_attention_heads, num_key_value_heads=cfg.num_attention_heads,
        kv_lora_rank=cfg.kv_lora_rank, q_lora_rank=None, qk_rope_head_dim=cfg.qk_rope_head_dim,
        qk_nope_head_dim=cfg.qk_nope_head_dim, v_head_dim=cfg.v_head_dim, linear_head_dim=cfg.linear_head_dim,
        linear_num_heads=cfg.linear_num_heads, linear_conv_kernel_dim=cfg.linear_conv_kernel_dim,
        pad_token_id=0, bos_token_id=1, eos_token_id=2)
    return KimiLinearForCausalLM(hf).to(dtype).eval()


def row(name: str, cfg: ModelConfig, dtype: torch.dtype, fits: dict[str, tuple[int, int]]) -> dict[str, Any]:
    n_kda = cfg.layer_types.count("kda")
    r: dict[str, Any] = {
        "model": name, "dtype": str(dtype).removeprefix("torch."), "kda_layers": n_kda,
        "global_layers": cfg.num_hidden_layers - n_kda, "global_kind": "dsa" if "dsa" in cfg.layer_types else "mla",
        "ours_per_sequence": SlotCache.bytes_per_slot(cfg, dtype),
        "ours_per_token": SlotCache.bytes_per_token(cfg, dtype),
        "transformers_per_sequence": hf_total(fits, cfg, 0),
        "transformers_per_token": hf_total(fits, cfg, 1) - hf_total(fits, cfg, 0),
        "transformers_layer_fits": fits}
    for t in CONTEXTS:
        r[f"ours_{t}"], r[f"transformers_{t}"] = ours(cfg, dtype, t), hf_total(fits, cfg, t)
    return r


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--presets", nargs="*", default=["small", "kimi-linear-48b", "k3", "k3.1-pro"])
    parser.add_argument("--prefill", type=int, nargs="*", default=[1024, 8192],
                        help="also prefill the toy this long, to check the extrapolation")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    from policy.checkpoint import config_from_hf

    results: dict[str, Any] = {"args": vars(args), "rows": [], "toy_prefill_checks": []}
    toy = kimi_linear(vocab=2048, hidden=256, seed=0)
    toy_cfg = config_from_hf(toy.config.to_dict())
    fits = fit_by_kind(toy)
    results["rows"].append(row("toy (benchmarks/rollout_engines_cpu.py)", toy_cfg, torch.float32, fits))
    for t in args.prefill:
        measured = sum(cache_bytes_per_layer(toy, t))
        check = {"tokens": t, "measured": measured, "extrapolated": hf_total(fits, toy_cfg, t)}
        results["toy_prefill_checks"].append(check)
        log(f"toy prefilled with {t} tokens: transformers' cache {measured:,} B, "
            f"extrapolated {check['extrapolated']:,} B")
    write_json(results, args.json)
    for preset in args.presets:
        cfg = get_config(preset)
        results["rows"].append(row(preset, cfg, torch.bfloat16, fit_by_kind(stand_in(cfg, torch.bfloat16))))
        log(f"{preset}: measured")
        write_json(results, args.json)

    def mib(n: int) -> str:
        x = n / MIB
        return f"{x:,.0f}" if x >= 100 else f"{x:.2f}" if x >= 1 else f"{x:.3f}"

    print("\nCache per sequence, ours / transformers (fixed: held whatever the length)\n")
    print("| model | dtype | layers | fixed MiB | per token B | " + " | ".join(f"{t // 1024}K MiB" for t in CONTEXTS)
          + " | ours / transformers at 32K |")
    print("|---|---|---|---|---|" + "---|" * len(CONTEXTS) + "---|")
    for r in results["rows"]:
        cells = [f"{mib(r[f'ours_{t}'])} / {mib(r[f'transformers_{t}'])}" for t in CONTEXTS]
        layers = f"{r['kda_layers']} KDA + {r['global_layers']} {r['global_kind'].upper()}"
        print(f"| {r['model']} | {r['dtype']} | {layers} "
              f"| {mib(r['ours_per_sequence'])} / {mib(r['transformers_per_sequence'])} "
              f"| {r['ours_per_token']:,} / {r['transformers_per_token']:,} | " + " | ".join(cells)
              + f" | {r['ours_32768'] / r['transformers_32768']:.3f} |")


if __name__ == "__main__":
    main()
