"""Token sampling that does not depend on how sequences are batched.

Each row draws with Gumbel-max noise from a counter-based hash of (sequence seed, token index,
vocabulary id): the same sequence gets the same tokens alone or in any batch, on any worker, and
the draw is exact (argmax of logp + Gumbel noise is a sample of softmax(logp)). The reported
logprob is of the processed distribution (temperature, then top-p), in float32."""
from __future__ import annotations

import torch

_MASK64 = (1 << 64) - 1


def _signed(value: int) -> int:
    """A 64-bit constant as torch's int64 holds it."""
    value &= _MASK64
    return value - (1 << 64) if value >= 1 << 63 else value


_GOLDEN, _MIX1, _MIX2 = _signed(0x9E3779B97F4A7C15), _signed(0xBF58476D1CE4E5B9), _signed(0x94D049BB133111EB)
_STEP = _signed(0xD1B54A32D192ED03)


def _shift_right(x: torch.Tensor, bits: int) -> torch.Tensor:
    """Logical right shift of int64 (torch's >> is arithmetic)."""
    return (x >> bits) & ((1 << (64 - bits)) - 1)


def _splitmix(x: torch.Tensor) -> torch.Tensor:
    x = x + _GOLDEN
    x = (x ^ _shift_right(x, 30)) * _MIX1
    x = (x ^ _shift_right(x, 27)) * _MIX2
    return x ^ _shift_right(x, 31)


def uniform_noise(seeds: torch.Tensor, counters: torch.Tensor, vocab: int) -> torch.Tensor:
    """[B, vocab] float64 uniforms in (0, 1), a pure function of (seed, counter, vocab id)."""
    key = _splitmix(_splitmix(seeds.long())[:, None] ^ (counters.long()[:, None] * _STEP))
    ids = torch.arange(vocab, device=seeds.device, dtype=torch.long)[None]
    bits = _shift_right(_splitmix(key + ids * _GOLDEN), 11)  # 53 random bits
    return (bits.double() + 0.5) / float(1 << 53)


def processed_logprobs(logits: torch.Tensor, temperature: torch.Tensor, top_p: torch.Tensor,
                       nucleus: bool | None = None) -> torch.Tensor:
    """log-probabilities after temperature and top-p, fp32 [B, V] (rows with temperature 0 keep
    temperature 1: they are decoded greedily). Top-p keeps the smallest prefix of the sorted
    distribution whose mass reaches top_p; the rest get -inf. `nucleus`: whether any row has
    top_p < 1, when the caller knows (else it is read from the device: a wait for its queue)."""
    t = torch.where(temperature > 0, temperature, torch.ones_like(temperature)).float()
    logp = torch.log_softmax(logits.float() / t[:, None], dim=-1)
    if bool((top_p < 1).any()) if nucleus is None else nucleus:
        sorted_logp, order = logp.sort(dim=-1, descending=True)
        p = sorted_logp.exp()
        drop = (p.cumsum(-1) - p) >= top_p.float()[:, None]
        sorted_logp = sorted_logp.masked_fill(drop, float("-inf"))
        logp = torch.full_like(logp, float("-inf")).scatter(-1, order, sorted_logp)
        logp = torch.log_softmax(logp, dim=-1)
    return logp


def sample_tokens(logits: torch.Tensor, temperature: torch.Tensor, top_p: torch.Tensor, seeds: torch.Tensor,
                  counters: torch.Tensor, nucleus: bool | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """One token per row: (tokens [B], logprobs [B] of the processed distribution; 0 for greedy rows).
    `nucleus` as in processed_logprobs."""
    logp = processed_logprobs(logits, temperature, top_p, nucleus)
    gumbel = -torch.log(-torch.log(uniform_noise(seeds, counters, logits.shape[-1])))
    drawn = (logp.double() + gumbel).argmax(-1)
    greedy = temperature <= 0
    tokens = torch.where(greedy, logits.argmax(-1), drawn)
    chosen = logp.gather(-1, tokens[:, None]).squeeze(-1)
    return tokens, torch.where(greedy, torch.zeros_like(chosen), chosen)
