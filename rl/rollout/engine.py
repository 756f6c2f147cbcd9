"""The in-process PyTorch generation engine: prefill once per prompt, fork the cache for the group,
decode the active rows together, and extend rows with environment tokens (token-in, token-out).

The engine records, for every generated token, the logprob of the distribution it was actually
sampled from (after temperature and top-p, fp32) and, optionally, the experts every MoE layer
chose for every token it fed to the model (routing replay)."""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from policy import ModelCache


@dataclass
class Row:
    """One sequence being generated: its tokens so far and what the cache has not seen yet."""

    tokens: list[int]
    loss_mask: list[int]
    logprobs: list[float]
    pending: list[int] = field(default_factory=list)  # tokens appended but not yet fed to the model
    routing: list[np.ndarray] = field(default_factory=list)  # per fed token: [n_moe_layers, top_k]
    finished: bool = False


@dataclass
class TurnResult:
    new_tokens: list[int]
    stopped: bool  # ended on a stop token (False: ran out of budget)


def sample_token(
    logits: torch.Tensor, temperature: float, top_p: float, generator: torch.Generator | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sample one token per row; return (tokens [B], logprobs [B]) of the processed distribution."""
    logits = logits.float()
    if temperature == 0:
        token = logits.argmax(-1)
        return token, torch.zeros_like(token, dtype=torch.float32)
    logp = torch.log_softmax(logits / temperature, dim=-1)
    if top_p < 1.0:
        sorted_logp, order = logp.sort(dim=-1, descending=True)
        cum = sorted_logp.exp().cumsum(-1)
        drop = cum - sorted_logp.exp() >= top_p  # keep the smallest prefix whose mass reaches top_p
        sorted_logp = sorted_logp.masked_fill(drop, float("-inf"))
        logp = torch.full_like(logp, float("-inf")).scatter(-1, order, sorted_logp)
        logp = torch.log_softmax(logp, dim=-1)
    token = torch.multinomial(logp.exp(), 1, generator=generator).squeeze(-1)
    return token, logp.gather(-1, token[:, None]).squeeze(-1)


class TorchEngine:
    def __init__(self, model: torch.nn.Module, record_routing: bool = True, seed: int = 0) -> None:
        self.model = model.eval()
        self.record_routing = record_routing
        self.generator = torch.Generator().manual_seed(seed)
        self.rows: list[Row] = []
        self._cache: ModelCache | None = None  # one row per entry of self.rows
        self._next_logits: torch.Tensor | None = None

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        self.model.load_state_dict(state)

    @torch.no_grad()
    def start(self, prompt: list[int], n: int) -> None:
        """Prefill `prompt` once and fork it into `n` rows."""
        ids = torch.tensor([prompt])
        out = self.model(ids, use_cache=True, return_routing=self.record_routing)
        fork = torch.zeros(n, dtype=torch.long)
        self._cache = out.cache.select(fork)
        self._next_logits = out.logits[:, -1].expand(n, -1).clone()
        prompt_routing = self._routing_rows(out, 0)
        self.rows = [
            Row(tokens=list(prompt), loss_mask=[0] * len(prompt), logprobs=[0.0] * len(prompt),
                routing=list(prompt_routing))
            for _ in range(n)
        ]

    def extend(self, row_index: int, tokens: list[int]) -> None:
        """Append environment tokens to a row (never trained on); fed to the model lazily."""
        row = self.rows[row_index]
        row.tokens.extend(tokens)
        row.loss_mask.extend([0] * len(tokens))
        row.logprobs.extend([0.0] * len(tokens))
        row.pending.extend(tokens)

    def _routing_rows(self, out, row: int) -> list[np.ndarray]:
        if not self.record_routing or out.routing is None:
            return []
        return list(out.routing[row].to(torch.int16).numpy())

    @torch.no_grad()
    def _feed_pending(self, active: list[int]) -> None:
        """Run each active row's pending tokens through the model (rows differ in length: B = 1)."""
        assert self._cache is not None and self._next_logits is not None
        for i in active:
            row = self.rows[i]
            if not row.pending:
                continue
            ids = torch.tensor([row.pending])
            out = self.model(ids, cache=self._cache.select(torch.tensor([i])), use_cache=True,
                             return_routing=self.record_routing)
            row.routing.extend(self._routing_rows(out, 0))
            row.pending = []
            self._replace_row(i, out.cache, out.logits[0, -1])

    def _replace_row(self, i: int, row_cache: ModelCache, logits: torch.Tensor) -> None:
        n = len(self.rows)
        parts = []
        if i > 0:
            parts.append(self._cache.select(torch.arange(0, i)))
        parts.append(row_cache)
        if i + 1 < n:
            parts.append(self._cache.select(torch.arange(i + 1, n)))
        self._cache = ModelCache.concat(parts) if len(parts) > 1 else parts[0]
        self._next_logits[i] = logits

    @torch.no_grad()
    def generate_turn(
        self, active: list[int], max_new_tokens: int, stop_ids: set[int], temperature: float, top_p: float
    ) -> dict[int, TurnResult]:
        """Generate one assistant turn for each active row, together, until a stop token or the budget."""
        self._feed_pending(active)
        results = {i: TurnResult([], False) for i in active}
        live = list(active)
        for _ in range(max_new_tokens):
            if not live:
                break
            index = torch.tensor(live)
            tokens, logprobs = sample_token(self._next_logits[index], temperature, top_p, self.generator)
            for j, i in enumerate(live):
                tok = int(tokens[j])
                row = self.rows[i]
                row.tokens.append(tok)
                row.loss_mask.append(1)
                row.logprobs.append(float(logprobs[j]))
                results[i].new_tokens.append(tok)
                if tok in stop_ids:
                    results[i].stopped = True
            still = [i for i in live if not results[i].stopped and len(results[i].new_tokens) < max_new_tokens]
            for i in live:
                if i not in still:
                    # The last sampled token is not fed yet; it is fed with the next turn's input.
                    self.rows[i].pending.append(self.rows[i].tokens[-1])
            if not still:
                break
            feed = torch.tensor([[self.rows[i].tokens[-1]] for i in still])
            sub_cache = self._cache.select(torch.tensor(still))
            out = self.model(feed, cache=sub_cache, use_cache=True, return_routing=self.record_routing)
            for j, i in enumerate(still):
                self.rows[i].routing.extend(self._routing_rows(out, j))
            self._scatter(still, out.cache, out.logits[:, -1])
            live = still
        return results

    def _scatter(self, rows: list[int], sub_cache: ModelCache, logits: torch.Tensor) -> None:
        """Write the advanced cache rows back in place of the old ones (others keep theirs)."""
        n = len(self.rows)
        if rows == list(range(n)):
            self._cache = sub_cache
        else:
            position = {i: j for j, i in enumerate(rows)}
            others = [i for i in range(n) if i not in position]
            merged = ModelCache.concat([sub_cache, self._cache.select(torch.tensor(others))])
            # merged holds rows in the order rows + others; put them back in 0..n-1 order.
            order = rows + others
            inverse = torch.empty(n, dtype=torch.long)
            inverse[torch.tensor(order)] = torch.arange(n)
            self._cache = merged.select(inverse)
        self._next_logits[torch.tensor(rows)] = logits

    def routing_array(self, row_index: int, length: int) -> np.ndarray | None:
        """Experts per token for the whole row, padded for tokens never fed (the final one)."""
        row = self.rows[row_index]
        if not row.routing:
            return None
        per_token = np.stack(row.routing)[:length]
        if per_token.shape[0] < length:
            fill = np.broadcast_to(np.arange(per_token.shape[2], dtype=np.int16),
                                   (length - per_token.shape[0],) + per_token.shape[1:])
            per_token = np.concatenate([per_token, fill])
        return per_token
