"""Inference caches: per-layer state that a forward with `use_cache=True` returns.

KDA layers carry an O(1) recurrent state and the short-conv window; MLA/DSA layers carry the
compressed latent KV of every past token plus a key-valid mask. With NoPE, attention never looks
at absolute positions, so rows of different lengths can be batched by padding the key axis with
invalid (masked) slots; a gap in the middle of a row changes nothing.

Caches are values: forwards return a new ModelCache and never mutate the one passed in, so a
cache can be forked with `select` and reused.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

Tensor = torch.Tensor


def _index(t: Tensor | None, idx: Tensor) -> Tensor | None:
    return None if t is None else t.index_select(0, idx)


@dataclass
class KDACache:
    state: Tensor  # [B, HV, K, V] float32
    conv: Tensor  # [B, W - 1, C_q + C_k + C_v]: the last W-1 projected inputs, oldest first

    @property
    def batch_size(self) -> int:
        return self.state.shape[0]

    def select(self, idx: Tensor) -> "KDACache":
        return KDACache(self.state.index_select(0, idx), self.conv.index_select(0, idx))

    def clone(self) -> "KDACache":
        return KDACache(self.state.clone(), self.conv.clone())

    @staticmethod
    def concat(caches: Sequence["KDACache"]) -> "KDACache":
        return KDACache(torch.cat([c.state for c in caches]), torch.cat([c.conv for c in caches]))


@dataclass
class SlotKDAView:
    """A batch's KDA cache inside a serving engine's slot pool (policy/slot_cache.py): rows `slots`
    of the pool's states and conv windows. A forward updates the states in place (a decode step
    reads and writes each one where it lies, no copy out and back) and returns the view with the
    batch's new conv windows in `new_conv`, for the pool's owner to write back."""

    state_pool: Tensor  # [N, HV, K, V] float32: every slot's state
    conv_pool: Tensor  # [N, W - 1, C]
    slots: Tensor  # [B] long
    new_conv: Tensor | None = None  # [B, W - 1, C], after a forward

    @property
    def batch_size(self) -> int:
        return self.slots.shape[0]

    @property
    def conv(self) -> Tensor:
        return self.conv_pool.index_select(0, self.slots)


@dataclass
class MLACache:
    latent: Tensor  # [B, S, kv_lora_rank]: normalised compressed KV
    k_rope: Tensor  # [B, S, qk_rope_head_dim]: the shared (unrotated) key part
    valid: Tensor  # [B, S] bool: which key slots hold a real token
    index_k: Tensor | None = None  # [B, S, index_head_dim]: DSA indexer keys

    @property
    def batch_size(self) -> int:
        return self.latent.shape[0]

    @property
    def seq_len(self) -> int:
        return self.latent.shape[1]

    def select(self, idx: Tensor) -> "MLACache":
        return MLACache(self.latent.index_select(0, idx), self.k_rope.index_select(0, idx),
                        self.valid.index_select(0, idx), _index(self.index_k, idx))

    def clone(self) -> "MLACache":
        return MLACache(self.latent.clone(), self.k_rope.clone(), self.valid.clone(),
                        None if self.index_k is None else self.index_k.clone())

    def append(self, latent: Tensor, k_rope: Tensor, index_k: Tensor | None,
               valid: Tensor | None = None) -> "MLACache":
        """A new cache with T new tokens appended to every row (all valid unless `valid` [B, T] says)."""
        B, T = latent.shape[:2]
        ones = torch.ones(B, T, dtype=torch.bool, device=latent.device) if valid is None else valid.to(torch.bool)
        ik = None
        if index_k is not None:
            ik = index_k if self.index_k is None else torch.cat([self.index_k, index_k], 1)
        return MLACache(torch.cat([self.latent, latent], 1), torch.cat([self.k_rope, k_rope], 1),
                        torch.cat([self.valid, ones], 1), ik)

    def compact(self) -> "MLACache":
        """Pack each row's real keys to the front (order kept) and drop all-invalid tail slots.
        Exact: every cached key is visible to every new token, and softmax does not care about
        slot order (DSA's tie-break prefers earlier keys, and the order of real keys is kept)."""
        n_valid = self.valid.sum(1)
        S = int(n_valid.max()) if n_valid.numel() else 0
        if S == self.seq_len and bool(self.valid.all()):
            return self
        order = torch.sort((~self.valid).to(torch.int8), dim=1, stable=True).indices[:, :S]  # real keys first

        def take(t: Tensor | None) -> Tensor | None:
            if t is None:
                return None
            return t.gather(1, order.reshape(*order.shape, *([1] * (t.dim() - 2))).expand(-1, -1, *t.shape[2:]))

        return MLACache(take(self.latent), take(self.k_rope), take(self.valid), take(self.index_k))

    @staticmethod
    def concat(caches: Sequence["MLACache"]) -> "MLACache":
        """Batch rows of different lengths: rows are compacted, shorter rows get invalid slots
        at the end (so repeated select/concat never grows the key axis past the longest row)."""
        caches = [c.compact() for c in caches]
        S = max(c.seq_len for c in caches)

        def pad(t: Tensor, value: float | bool = 0) -> Tensor:
            extra = S - t.shape[1]
            if extra == 0:
                return t
            fill = t.new_full((t.shape[0], extra, *t.shape[2:]), value)
            return torch.cat([t, fill], 1)

        has_index = [c.index_k is not None for c in caches]
        if any(has_index) and not all(has_index):
            raise ValueError("MLACache.concat: some caches carry DSA indexer keys and some do not")
        return MLACache(
            torch.cat([pad(c.latent) for c in caches]),
            torch.cat([pad(c.k_rope) for c in caches]),
            torch.cat([pad(c.valid, False) for c in caches]),
            torch.cat([pad(c.index_k) for c in caches]) if all(has_index) else None,
        )


class PagedMLAKeys:
    """An MLA layer's keys for one forward of a paged cache (policy/slot_cache.py), left where they
    are: row b's key t at row index[b, t] of the pools (the past's, then the new tokens' just
    written there). The decode kernel reads them through the index (kimi_kernels.mla_decode_paged);
    `latent` / `k_rope` gather the past and append the new tokens as given (MLACache's layout, for
    prefills and the reference path) on first use only."""

    def __init__(self, pool_latent: Tensor, pool_rope: Tensor, past_index: Tensor, new_index: Tensor,
                 new_latent: Tensor, new_rope: Tensor, valid: Tensor, index_k: Tensor | None) -> None:
        self.pool_latent, self.pool_rope = pool_latent, pool_rope  # [N, kv_lora_rank], [N, qk_rope_head_dim]
        self._past_index, self._new_index = past_index, new_index  # [B, P], [B, T]
        self._new_latent, self._new_rope = new_latent, new_rope
        self.valid = valid  # [B, S] bool
        self.index_k = index_k  # [B, S, index_head_dim] (DSA), gathered
        # made on first use (not functools.cached_property: torch.compile breaks its graph on it)
        self._index: Tensor | None = None
        self._latent: Tensor | None = None
        self._k_rope: Tensor | None = None

    @property
    def batch_size(self) -> int:
        return self._past_index.shape[0]

    @property
    def seq_len(self) -> int:
        return self._past_index.shape[1] + self._new_index.shape[1]

    @property
    def index(self) -> Tensor:
        """[B, S]: each key's row in the pools."""
        if self._index is None:
            self._index = torch.cat([self._past_index, self._new_index], 1)
        return self._index

    @property
    def latent(self) -> Tensor:
        if self._latent is None:
            self._latent = self._past_then_new(self.pool_latent, self._new_latent)
        return self._latent

    @property
    def k_rope(self) -> Tensor:
        if self._k_rope is None:
            self._k_rope = self._past_then_new(self.pool_rope, self._new_rope)
        return self._k_rope

    def _past_then_new(self, pool: Tensor, new: Tensor) -> Tensor:
        return torch.cat([pool[self._past_index].to(new.dtype), new], 1)


LayerCache = KDACache | SlotKDAView | MLACache | PagedMLAKeys


class ModelCache:
    """One cache per decoder layer plus the number of tokens each row has consumed."""

    def __init__(self, layers: list[LayerCache], lengths: Tensor) -> None:
        self.layers = layers
        self.lengths = lengths  # [B] long

    @property
    def batch_size(self) -> int:
        return int(self.lengths.shape[0])

    def __len__(self) -> int:
        return len(self.layers)

    def __getitem__(self, i: int) -> LayerCache:
        return self.layers[i]

    def select(self, index: Tensor | Sequence[int]) -> "ModelCache":
        """Rows reordered / repeated / dropped (e.g. fork one prompt into a group). New object."""
        idx = torch.as_tensor(index, dtype=torch.long, device=self.lengths.device).reshape(-1)
        if idx.numel() and (int(idx.min()) < 0 or int(idx.max()) >= self.batch_size):
            raise IndexError(f"ModelCache.select: index out of range for batch size {self.batch_size}")
        return ModelCache([c.select(idx.to(_device(c))) for c in self.layers], self.lengths.index_select(0, idx))

    def clone(self) -> "ModelCache":
        return ModelCache([c.clone() for c in self.layers], self.lengths.clone())

    def compact(self) -> "ModelCache":
        """Drop the invalid key slots that batching left in the MLA caches (exact)."""
        return ModelCache([c.compact() if isinstance(c, MLACache) else c for c in self.layers], self.lengths)

    @staticmethod
    def concat(caches: Sequence["ModelCache"]) -> "ModelCache":
        """Batch caches along rows; they may have consumed different numbers of tokens."""
        if not caches:
            raise ValueError("ModelCache.concat: need at least one cache")
        n = len(caches[0])
        if any(len(c) != n for c in caches):
            raise ValueError(f"ModelCache.concat: caches have different layer counts {[len(c) for c in caches]}")
        layers: list[LayerCache] = []
        for i in range(n):
            kinds = {type(c.layers[i]) for c in caches}
            if len(kinds) != 1:
                raise ValueError(f"ModelCache.concat: layer {i} mixes cache kinds {sorted(k.__name__ for k in kinds)}")
            layers.append(kinds.pop().concat([c.layers[i] for c in caches]))
        return ModelCache(layers, torch.cat([c.lengths for c in caches]))


def _device(c: LayerCache) -> torch.device:
    if isinstance(c, SlotKDAView):
        return c.state_pool.device
    return c.state.device if isinstance(c, KDACache) else c.latent.device
