"""Token log-probabilities straight from the last hidden states, without the full logits.

An RL learner needs log p(token) for the sampled tokens (and the entropy for monitoring), not
the [tokens, vocab] logits: at K3's 163,840-entry vocabulary those are 5.4 GB of float32 per 8K
tokens, plus as much again for log_softmax and its gradient. `linear_token_logprobs` computes
the head GEMM a block of rows at a time, keeps one log-sum-exp per row, and recomputes each
block's logits in the backward pass:

    z = scale * h W^T,  logp_i = z_i[t_i] - logsumexp(z_i),  H_i = logsumexp(z_i) - sum_j p_ij z_ij
    d logp_i / d z_i = onehot(t_i) - p_i  ->  dh = scale * dz W,  dW = scale * dz^T h

Peak extra memory is one block of float32 logits instead of several full copies, plus, where
they fit `KEEP_LOGITS_BYTES`, the head's output in h's dtype kept from the forward so the backward
need not run the head's GEMM again (a quarter of the head's FLOPs; 2.7 GB at 8K tokens of K3's
vocabulary in bf16, where a 64K-token row's 21 GB is recomputed instead). What a block does between
its GEMMs (the log-sum-exp, the target's logit, the entropy; the logits' gradient) is one pass of a
Triton kernel over each row on CUDA (kimi_kernels/logit_rows.py), which writes the gradient over the
logits in place; there a kept output is one block: one GEMM each way over all rows, instead of a
read and a write of the whole [V, d] gradient per block. Op by op, as on the CPU, a block streams a
float32 copy of its logits through memory about ten times a pass.
"""
from __future__ import annotations

import torch

from . import logit_rows
from .fusion import fusion_enabled

__all__ = ["linear_token_logprobs"]

Tensor = torch.Tensor

# logits per block, ~256 MiB at a time: op by op a block holds float32 copies of its logits, 2^26
# elements (409 rows at a 163,840 vocabulary); with the row kernels it holds only its logits in h's
# dtype (the gradient is written over them), so twice the rows fit
_BLOCK_ELEMENTS = 1 << 26
_KERNEL_BLOCK_ELEMENTS = 1 << 27
# the kernels' backward blocks where nothing is kept, larger: each adds its part of dW into the whole
# [V, d] gradient, a read and a write of it per block
_KERNEL_GRAD_BLOCK_ELEMENTS = 1 << 29
# the most bytes of head output a gradient-taking call keeps for its backward instead of recomputing it
KEEP_LOGITS_BYTES = 4 << 30


def _uses_kernels(h: Tensor) -> bool:
    return fusion_enabled() and logit_rows.available(h)


def _block_rows(h: Tensor, vocab: int, block_rows: int | None, kernels: bool, keep: bool) -> tuple[int, int]:
    """Rows a block of the forward and of the backward: `block_rows` for both where given; all rows at
    once where the kernels run on a kept output."""
    if block_rows is not None:
        return block_rows, block_rows
    if kernels and keep:
        return max(1, h.shape[0]), max(1, h.shape[0])
    if kernels:
        return max(1, _KERNEL_BLOCK_ELEMENTS // vocab), max(1, _KERNEL_GRAD_BLOCK_ELEMENTS // vocab)
    rows = max(1, _BLOCK_ELEMENTS // vocab)
    return rows, rows


def _acc(x: Tensor) -> torch.dtype:
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def _scaled(z: Tensor, scale: float) -> Tensor:
    """z in the accumulation dtype, times scale; z itself where both are no-ops (never written to)."""
    z = z.to(_acc(z))
    return z if scale == 1.0 else z * scale


def block_statistics(z: Tensor, targets: Tensor, scale: float) -> tuple[Tensor, Tensor, Tensor]:
    """A block's head output z [r, V] (h's dtype) and its targets [r]: (logsumexp, log p(target),
    entropy) of softmax(scale * z), each [r] in the accumulation dtype. Op by op: each pass over the
    block streams it through memory, so the probabilities are made and weighted in place."""
    z = _scaled(z, scale)
    lse = torch.logsumexp(z, dim=-1)
    logp = z.gather(1, targets[:, None]).squeeze(1) - lse
    pz = torch.sub(z, lse[:, None]).exp_().mul_(z)  # p * z
    return lse, logp, lse - pz.sum(-1)


def block_logit_grad(z: Tensor, lse: Tensor, targets: Tensor, grad_logp: Tensor, scale: float) -> Tensor:
    """The gradient of sum_i grad_logp_i * log p_i(target_i) with respect to a block's head output z
    [r, V]: scale * grad_logp_i * (onehot(target_i) - p_i), in z's dtype (-g p over the block, in
    place, then +g at each row's target)."""
    g = grad_logp.to(_acc(z)) * scale
    dz = torch.sub(_scaled(z, scale), lse[:, None]).exp_().mul_(-g[:, None])
    rows = torch.arange(z.shape[0], device=z.device)
    dz[rows, targets] += g
    return dz.to(z.dtype)


class _LinearTokenLogprobs(torch.autograd.Function):
    @staticmethod
    def forward(ctx, h: Tensor, weight: Tensor, targets: Tensor, scale: float, block_rows: int | None,
                grad_dtype: torch.dtype | None) -> tuple[Tensor, Tensor]:
        acc = _acc(h)
        n = h.shape[0]
        kernels = _uses_kernels(h)
        keep = any(ctx.needs_input_grad[:2]) and n * weight.shape[0] * h.element_size() <= KEEP_LOGITS_BYTES
        rows, grad_rows = _block_rows(h, weight.shape[0], block_rows, kernels, keep)
        logp = torch.empty(n, dtype=acc, device=h.device)
        entropy = torch.empty(n, dtype=acc, device=h.device)
        lse = torch.empty(n, dtype=acc, device=h.device)
        kept = h.new_empty(n, weight.shape[0]) if keep else None
        statistics = logit_rows.row_statistics if kernels else block_statistics
        for a in range(0, n, rows):
            hb = h[a:a + rows]
            z = hb @ weight.t() if kept is None else torch.mm(hb, weight.t(), out=kept[a:a + rows])
            lse[a:a + rows], logp[a:a + rows], entropy[a:a + rows] = statistics(z, targets[a:a + rows], scale)
        ctx.save_for_backward(h, weight, targets, lse, kept)
        ctx.scale, ctx.rows, ctx.kernels, ctx.grad_dtype = scale, grad_rows, kernels, grad_dtype
        ctx.kept_overwritten = False
        ctx.mark_non_differentiable(entropy)
        return logp, entropy

    @staticmethod
    def backward(ctx, grad_logp: Tensor, _grad_entropy: Tensor) -> tuple[Tensor | None, ...]:
        h, weight, targets, lse, kept = ctx.saved_tensors
        scale, rows = ctx.scale, ctx.rows
        if ctx.kept_overwritten:  # a second backward (retain_graph): the kernels wrote the first one's over it
            kept = None
        dh = torch.empty_like(h) if ctx.needs_input_grad[0] else None
        # blocks add into dW in place (a temporary [V, d] per block would cost a full weight's memory);
        # each block's GEMM accumulates in fp32, the sum over blocks is in the weight's dtype
        dw = torch.empty_like(weight) if ctx.needs_input_grad[1] else None
        # grad_dtype: the two gradient GEMMs' operands in it (a CPU's bf16 is several times faster); the
        # forward, and so the log-probabilities, keep h's dtype
        low = ctx.grad_dtype if ctx.grad_dtype not in (None, h.dtype) else None
        weight_low = weight.to(low) if low is not None else weight
        for a in range(0, h.shape[0], rows):
            hb = h[a:a + rows]
            z = hb @ weight.t() if kept is None else kept[a:a + rows]
            if ctx.kernels:  # the gradient over z: a kept output is spent
                dz = logit_rows.logit_grad_(z, lse[a:a + rows], targets[a:a + rows], grad_logp[a:a + rows], scale)
            else:
                dz = block_logit_grad(z, lse[a:a + rows], targets[a:a + rows], grad_logp[a:a + rows], scale)
            if low is not None:
                dz, hb = dz.to(low), hb.to(low)
            if dh is not None:
                dh[a:a + rows] = dz @ weight_low
            if dw is not None and a == 0:
                dw.copy_(dz.t() @ hb) if low is not None else torch.mm(dz.t(), hb, out=dw)
            elif dw is not None:
                dw.add_(dz.t() @ hb) if low is not None else dw.addmm_(dz.t(), hb)
        ctx.kept_overwritten = ctx.kept_overwritten or (kept is not None and ctx.kernels)
        return dh, dw, None, None, None, None


def linear_token_logprobs(h: Tensor, weight: Tensor, targets: Tensor, scale: float = 1.0,
                          block_rows: int | None = None, grad_dtype: torch.dtype | None = None
                          ) -> tuple[Tensor, Tensor]:
    """h: [N, d] hidden states; weight: [V, d] (the LM head); targets: [N] token ids.
    Returns (log p(targets) [N], entropy [N]) of softmax(scale * h W^T), float32 (float64 for
    float64 inputs); the entropy carries no gradient. Equal to log_softmax of the full logits.
    grad_dtype: the backward's GEMMs in this dtype (bf16 on a CPU: mixed precision's gradients); the
    gradients are returned in h's and weight's dtypes."""
    if h.dim() != 2 or weight.dim() != 2 or h.shape[1] != weight.shape[1]:
        raise ValueError(f"linear_token_logprobs: need h [N, d] and weight [V, d], got {tuple(h.shape)} "
                         f"and {tuple(weight.shape)}")
    if targets.shape != h.shape[:1] or targets.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"linear_token_logprobs: targets must be integer [N={h.shape[0]}], "
                         f"got {targets.dtype} {tuple(targets.shape)}")
    return _LinearTokenLogprobs.apply(h, weight, targets.long(), float(scale), block_rows, grad_dtype)
