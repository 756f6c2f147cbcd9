"""The learner's optimizer step against an independent computation: two supervised steps of a tiny
transformers Llama through the learner (DeepSpeed, packed rows, blockwise logprobs, the CPU's fused
AdamW) leave the weights that plain transformers logits, the global-norm clip and AdamW's update
written out give."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from rl.config import TrainConfig
from tiny_hf_models import VOCAB, save_tiny

TRAIN = dict(lr=1e-2, betas=(0.9, 0.99), adam_eps=1e-3, weight_decay=0.1, grad_clip=0.5, micro_batches=2,
             cpu_matmul_dtype="float32")


def examples() -> list[dict[str, list[int]]]:
    rng = np.random.default_rng(0)
    out = []
    for n in (14, 20, 9, 17):
        tokens = rng.integers(3, VOCAB, n).tolist()
        out.append({"tokens": tokens, "loss_mask": [0] * 5 + [1] * (n - 5)})
    return out


def written_out_steps(model: torch.nn.Module, batch: list[dict[str, list[int]]], steps: int) -> dict[str, torch.Tensor]:
    """`steps` supervised steps: token-sum cross-entropy over the batch's trained tokens, one clip
    coefficient for every gradient, then AdamW (decoupled weight decay, bias-corrected moments)."""
    cfg = TrainConfig(**TRAIN)
    (b1, b2), params = cfg.betas, dict(model.named_parameters())
    m = {n: torch.zeros_like(p) for n, p in params.items()}
    v = {n: torch.zeros_like(p) for n, p in params.items()}
    trained = sum(sum(e["loss_mask"][1:]) for e in batch)
    for t in range(1, steps + 1):
        model.zero_grad()
        loss = 0.0
        for e in batch:
            ids = torch.tensor([e["tokens"]])
            logp = torch.log_softmax(model(ids).logits[0, :-1].double(), -1).gather(1, ids[0, 1:, None])[:, 0]
            loss = loss - (logp * torch.tensor(e["loss_mask"][1:])).sum() / trained
        loss.backward()
        norm = torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in params.values()]))
        scale = min(1.0, cfg.grad_clip / (float(norm) + 1e-6))
        with torch.no_grad():
            for n, p in params.items():
                g = p.grad * scale
                m[n] = b1 * m[n] + (1 - b1) * g
                v[n] = b2 * v[n] + (1 - b2) * g * g
                p.mul_(1 - cfg.lr * cfg.weight_decay)
                p.sub_(cfg.lr * (m[n] / (1 - b1 ** t)) / ((v[n] / (1 - b2 ** t)).sqrt() + cfg.adam_eps))
    return {n: p.detach().clone() for n, p in params.items()}


# whether a freed 64 MiB block stays in the process's resident memory (run where the process is)
FREED_BLOCK_PROBE = """
import numpy as np
def resident_mib():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096 / 2**20
block = np.ones(2**23)
before = resident_mib()
del block
stays = resident_mib() > before - 32
"""


def test_a_freed_block_leaves_memory_unless_the_heap_keeps_it():
    """glibc unmaps a large block when it is freed; after keep_freed_memory() it stays for reuse."""
    import subprocess
    import sys

    repo = str(Path(__file__).parents[2])
    keep_it = "from rl.learner.heap import keep_freed_memory\nassert keep_freed_memory()\n"
    for keep, expected in (("", "False"), (keep_it, "True")):
        script = keep + FREED_BLOCK_PROBE + "print(stays)\n"
        out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True,
                             cwd=repo).stdout.split()
        assert out[-1] == expected, (keep, out)


def test_two_supervised_steps_move_the_weights_as_adamw_written_out(ray_session, tmp_path):
    import ray
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from rl.learner import LearnerGroup

    path = save_tiny("llama", tmp_path / "llama")
    group = LearnerGroup({"hf_path": str(path)}, TrainConfig(**TRAIN), 64, 1.0, 0, 0, [{"num_cpus": 0.25}])
    try:
        for _ in range(2):
            group.sft_step(examples(), TRAIN["lr"])
        learned = ray.get(group.get_weights())
        # the CPU learner keeps what a step frees for the next (rl/learner/heap.py): a freed 64 MiB
        # block stays in its memory, where glibc's default would unmap it
        stays = ray.get(group.actors[0].__ray_call__.remote(lambda _, src: exec(src, scope := {}) or scope["stays"],
                                                            FREED_BLOCK_PROBE))
        assert stays
    finally:
        group.shutdown()
    expected = written_out_steps(AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32), examples(), 2)
    start = load_file(str(path / "model.safetensors"))
    assert learned.keys() == expected.keys()
    for name, weight in expected.items():
        torch.testing.assert_close(learned[name], weight, rtol=0, atol=2e-5, msg=lambda s: f"{name}: {s}")
        assert float((weight - start[name]).abs().max()) > 1e-2, name  # moved far beyond the tolerance
