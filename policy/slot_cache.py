"""Cache memory for a serving engine: many sequences, each in a slot, none copied to change another.

KDA layers keep a fixed-size recurrent state and short-conv window per slot (preallocated
[max_slots, ...] tensors). MLA/DSA layers keep their latent keys in fixed-size blocks of a shared
pool; each slot has a block table (vLLM's paged layout). A forward over some slots reads a
`ModelCache` view (`view`): its KDA layers update the slots' states where they lie and its MLA
layers write the new keys straight into the slots' blocks; `commit` then writes the new conv
windows and advances the lengths.

Forking (one prompt, a GRPO group of continuations) shares the prompt's full blocks between the
slots (reference counts) and copies only the last, partly filled block: a slot only ever writes at
positions past its own length, so a shared full block is never written again.

Besides `max_slots` slots and `num_blocks` blocks the cache holds one scratch slot and one scratch
block that no sequence owns: padding tokens write their keys into the scratch block, and padding
rows of a fixed-size decode batch (rl/rollout/decode_graphs.py) read and write the scratch slot.
Every write is then a plain scatter, with no data-dependent shape (no host sync, and capturable
in a CUDA graph).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from .cache import KDACache, ModelCache, PagedMLAKeys, SlotKDAView
from .config import ModelConfig
from .transfer import to_device

Tensor = torch.Tensor
BLOCK_SIZE = 16  # tokens per block of latent keys


@dataclass
class _MLAPool:
    latent: Tensor  # [n_blocks * block, kv_lora_rank]
    k_rope: Tensor  # [n_blocks * block, rope_dim]
    index_k: Tensor | None  # [n_blocks * block, index_head_dim] (DSA)


class PagedMLAView:
    """One MLA layer's keys for the rows of a forward: their past (each row's keys at the front of
    its index into the blocks, shorter rows padded with invalid slots) and, on `append`, the new
    tokens, whose real ones are written into the blocks (the keys then stay there: PagedMLAKeys)."""

    def __init__(self, pool: _MLAPool, past_index: Tensor, past_valid: Tensor, write_index: Tensor,
                 new_valid: Tensor, scratch: int) -> None:
        self.pool = pool
        self.past_index = past_index  # [B, P] flat pool positions (any position where invalid)
        self.past_valid = past_valid  # [B, P] bool
        self.write_index = write_index  # [B, T] flat pool positions of the new tokens (scratch for padding)
        self.new_valid = new_valid  # [B, T] bool: the new tokens that are real
        self.scratch = scratch  # a flat position of the scratch block

    @property
    def seq_len(self) -> int:
        return self.past_index.shape[1]

    @property
    def batch_size(self) -> int:
        return self.past_index.shape[0]

    def append(self, latent: Tensor, k_rope: Tensor, index_k: Tensor | None,
               valid: Tensor | None = None) -> PagedMLAKeys:
        real = self.new_valid if valid is None else self.new_valid & valid
        where = torch.where(real, self.write_index, self.scratch)  # padding: into the scratch block

        def write(pool: Tensor, new: Tensor) -> None:
            pool.index_copy_(0, where.reshape(-1), new.reshape(-1, new.shape[-1]).to(pool.dtype))

        write(self.pool.latent, latent)
        write(self.pool.k_rope, k_rope)
        if index_k is not None and self.pool.index_k is not None:
            write(self.pool.index_k, index_k)

        ik = None
        if index_k is not None:
            ik = torch.cat([self.pool.index_k[self.past_index].to(index_k.dtype), index_k], 1)
        return PagedMLAKeys(self.pool.latent, self.pool.k_rope, self.past_index, where, latent, k_rope,
                            torch.cat([self.past_valid, real], 1), ik)


class CacheFull(RuntimeError):
    """No free slot or block for what was asked (the engine waits or preempts)."""


class SlotCache:
    def __init__(self, model: torch.nn.Module, max_slots: int, num_blocks: int, block_size: int = BLOCK_SIZE,
                 device: torch.device | str | None = None, dtype: torch.dtype | None = None) -> None:
        if max_slots < 1 or num_blocks < 1 or block_size < 1:
            raise ValueError(f"SlotCache: max_slots, num_blocks and block_size must be >= 1, "
                             f"got {max_slots}, {num_blocks}, {block_size}")
        ref = model.lm_head.weight
        device = ref.device if device is None else torch.device(device)
        dtype = ref.dtype if dtype is None else dtype
        self.max_slots, self.num_blocks, self.block_size = max_slots, num_blocks, block_size
        self.device, self.dtype = device, dtype
        self.layers = list(model.model.layers)
        self._has_mla = any(layer.kind != "kda" for layer in self.layers)
        self._kda: dict[int, KDACache] = {}
        self._mla: dict[int, _MLAPool] = {}
        self._allocate()
        self.lengths = [0] * max_slots  # tokens each slot's cache holds
        self.tables: list[list[int]] = [[] for _ in range(max_slots)]
        # the block tables again as one array, for vectorised position lookups in `indices`: as wide
        # as the longest table so far, not the pool (a budget-sized pool has millions of blocks)
        self._table_np = np.zeros((max_slots, 1), dtype=np.int64)
        self.refs = [0] * num_blocks
        self._free_blocks = list(range(num_blocks - 1, -1, -1))
        self._free_slots = list(range(max_slots - 1, -1, -1))

    @property
    def scratch_slot(self) -> int:
        return self.max_slots

    def _allocate(self) -> None:
        for i, layer in enumerate(self.layers):
            mixer = layer.self_attn
            if layer.kind == "kda":
                self._kda[i] = mixer.empty_cache(self.max_slots + 1, self.device, self.dtype)  # + the scratch slot
            else:
                rows = (self.num_blocks + 1) * self.block_size  # + the scratch block
                ik = (torch.zeros(rows, mixer.indexer.head_dim, device=self.device, dtype=self.dtype)
                      if mixer.sparse else None)
                self._mla[i] = _MLAPool(torch.zeros(rows, mixer.kv_lora, device=self.device, dtype=self.dtype),
                                        torch.zeros(rows, mixer.rope, device=self.device, dtype=self.dtype), ik)

    @property
    def released(self) -> bool:
        return not (self._kda or self._mla)

    def release(self) -> int:
        """Drop the state and key tensors while no slot is in use (the memory goes back to the
        allocator; on CUDA, `torch.cuda.empty_cache` returns it to the device). The next `alloc`
        allocates them again. Returns the bytes dropped; a ValueError while a slot is in use."""
        if self.free_slots != self.max_slots:
            raise ValueError(f"SlotCache.release: {self.max_slots - self.free_slots} slot(s) in use")
        freed = self.nbytes
        self._kda, self._mla = {}, {}
        return freed

    # ---- sizing ------------------------------------------------------------------------------
    @staticmethod
    def bytes_per_slot(cfg: ModelConfig, dtype: torch.dtype) -> int:
        """Fixed memory of one slot: every KDA layer's recurrent state (float32) and short-conv window."""
        state = cfg.num_v_heads * cfg.linear_head_dim * cfg.v_dim * 4
        channels = 2 * cfg.linear_num_heads * cfg.linear_head_dim + cfg.num_v_heads * cfg.v_dim
        conv = (cfg.linear_conv_kernel_dim - 1) * channels * dtype.itemsize
        return cfg.layer_types.count("kda") * (state + conv)

    @staticmethod
    def bytes_per_token(cfg: ModelConfig, dtype: torch.dtype) -> int:
        """Memory one cached token takes: every MLA/DSA layer's latent and rope keys (and DSA's index key)."""
        per_layer = {"kda": 0, "mla": cfg.kv_lora_rank + cfg.qk_rope_head_dim,
                     "dsa": cfg.kv_lora_rank + cfg.qk_rope_head_dim + cfg.index_head_dim}
        return sum(per_layer[t] for t in cfg.layer_types) * dtype.itemsize

    def tensor_ids(self) -> tuple[int, ...]:
        """The addresses of the state and key tensors: what a captured CUDA graph reads and writes
        (they change when a released cache is allocated again)."""
        tensors = [t for c in self._kda.values() for t in (c.state, c.conv)]
        tensors += [t for p in self._mla.values() for t in (p.latent, p.k_rope, p.index_k) if t is not None]
        return tuple(t.data_ptr() for t in tensors)

    @property
    def nbytes(self) -> int:
        """Memory the cache's states and key pools hold (the scratch slot and block included)."""
        tensors = [t for c in self._kda.values() for t in (c.state, c.conv)]
        tensors += [t for p in self._mla.values() for t in (p.latent, p.k_rope, p.index_k) if t is not None]
        return sum(t.numel() * t.element_size() for t in tensors)

    # ---- slots and blocks --------------------------------------------------------------------
    @property
    def free_slots(self) -> int:
        return len(self._free_slots)

    @property
    def free_blocks(self) -> int:
        return len(self._free_blocks)

    def blocks_needed(self, slot: int, length: int) -> int:
        """Blocks `slot` must still take to hold `length` tokens."""
        if not self._has_mla:
            return 0
        return max(0, -(-length // self.block_size) - len(self.tables[slot]))

    def alloc(self) -> int:
        if not self._free_slots:
            raise CacheFull("no free slot")
        if self.released:
            self._allocate()
        slot = self._free_slots.pop()
        self.lengths[slot] = 0
        for c in self._kda.values():
            c.state[slot].zero_()
            c.conv[slot].zero_()
        return slot

    def free(self, slot: int) -> None:
        for block in self.tables[slot]:
            self._unref(block)
        self.tables[slot] = []
        self.lengths[slot] = 0
        self._free_slots.append(slot)

    def _set_table(self, slot: int, table: list[int]) -> None:
        self.tables[slot] = table
        width = self._table_np.shape[1]
        if len(table) > width:  # widened by doubling, so rarely
            grown = np.zeros((self.max_slots, max(len(table), 2 * width) - width), dtype=np.int64)
            self._table_np = np.concatenate([self._table_np, grown], 1)
        if table:
            self._table_np[slot, :len(table)] = table

    def _unref(self, block: int) -> None:
        self.refs[block] -= 1
        if self.refs[block] == 0:
            self._free_blocks.append(block)

    def _take_block(self) -> int:
        if not self._free_blocks:
            raise CacheFull("no free cache block")
        block = self._free_blocks.pop()
        self.refs[block] = 1
        return block

    def reserve(self, slot: int, length: int) -> None:
        """Make `slot` able to hold `length` tokens (raises CacheFull, taking nothing, if it cannot)."""
        need = self.blocks_needed(slot, length)
        if need > len(self._free_blocks):
            raise CacheFull(f"slot needs {need} blocks, {len(self._free_blocks)} free")
        if need:
            self._set_table(slot, self.tables[slot] + [self._take_block() for _ in range(need)])

    def fork(self, src: int, dst: int) -> None:
        """Make slot `dst` a copy of `src` (same length and state; full blocks shared)."""
        for i, c in self._kda.items():
            c.state[dst].copy_(c.state[src])
            c.conv[dst].copy_(c.conv[src])
        for block in self.tables[dst]:
            self._unref(block)
        n = self.lengths[src]
        full = n // self.block_size
        table = list(self.tables[src][:full])
        for block in table:
            self.refs[block] += 1
        if n % self.block_size and self._mla:  # the last block is still being written: a private copy
            block = self._take_block()
            a, b = self.tables[src][full] * self.block_size, block * self.block_size
            for pool in self._mla.values():
                for t in (pool.latent, pool.k_rope, pool.index_k):
                    if t is not None:
                        t[b:b + self.block_size] = t[a:a + self.block_size]
            table.append(block)
        self._set_table(dst, table)
        self.lengths[dst] = n

    # ---- forward views -----------------------------------------------------------------------
    def view(self, slots: list[int], n_new: list[int], width: int) -> ModelCache:
        """The cache of `slots` for a forward of `width` new tokens per row, of which row b's first
        n_new[b] are real (the rest padding). Blocks for them must be reserved."""
        past_index, past_valid, write_index, real = (to_device(torch.from_numpy(a), self.device)
                                                     for a in self.indices(slots, n_new, width))
        lengths = to_device(torch.tensor([self.lengths[s] for s in slots], dtype=torch.long), self.device)
        return self.view_of(to_device(torch.tensor(slots), self.device), past_index, past_valid, write_index, real,
                            lengths)

    def indices(self, slots: list[int], n_new: list[int], width: int, past_width: int | None = None
                ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """On the host (numpy: a decode step calls it every token, and torch's per-op cost on small
        CPU tensors would be most of the step), for the MLA layers: past_index / past_valid [B, P]
        (each row's past keys at the front; P the longest row's length, or `past_width` if given),
        write_index / new_valid [B, width] (where the new tokens go; padding goes to the scratch block)."""
        lens = np.array([self.lengths[s] for s in slots], dtype=np.int64)
        bs = self.block_size
        P = int(lens.max(initial=0)) if past_width is None else past_width
        tables = self._table_np[slots]
        last = tables.shape[1] - 1  # positions past a row's table (invalid, padding, no MLA layer) read any block
        pos = np.arange(P)
        past_valid = pos[None] < lens[:, None]  # [B, P]
        past_index = tables[:, np.minimum(pos // bs, last)] * bs + pos % bs  # rows' keys at the front
        return (past_index, past_valid) + self._new_indices(lens, tables, n_new, width)

    def new_indices(self, slots: list[int], n_new: list[int], width: int) -> tuple[np.ndarray, np.ndarray]:
        """`indices`' write_index / new_valid alone (on the host): [B, width] each."""
        lens = np.array([self.lengths[s] for s in slots], dtype=np.int64)
        return self._new_indices(lens, self._table_np[slots], n_new, width)

    def _new_indices(self, lens: np.ndarray, tables: np.ndarray, n_new: list[int], width: int
                     ) -> tuple[np.ndarray, np.ndarray]:
        bs = self.block_size
        last = tables.shape[1] - 1
        new_pos = lens[:, None] + np.arange(width)[None]  # [B, width]
        real = np.arange(width)[None] < np.array(n_new)[:, None]
        blocks = np.take_along_axis(tables, np.minimum(new_pos // bs, last), 1)
        write_index = np.where(real, blocks * bs + new_pos % bs, self.num_blocks * bs)
        return write_index, real

    def block_tables(self, slots: list[int], n_blocks: int) -> np.ndarray:
        """[len(slots), n_blocks]: each slot's first n_blocks blocks (on the host), 0 past its table
        (keys there are invalid: read, then masked). What `past_from_tables` turns into key indices."""
        tables = self._table_np[slots, :n_blocks]
        if tables.shape[1] < n_blocks:
            tables = np.pad(tables, ((0, 0), (0, n_blocks - tables.shape[1])))
        return tables

    def past_from_tables(self, tables: Tensor, lengths: Tensor) -> tuple[Tensor, Tensor]:
        """`indices`' past_index / past_valid [B, keys] for keys = the tables' width x block_size,
        computed where `tables` [B, n_blocks] (block_tables) and `lengths` [B] are: a step's inputs on
        a GPU are then the tables, a block_size-th of the keys, instead of two [B, keys] arrays built
        on the host every step."""
        pos = torch.arange(tables.shape[1] * self.block_size, device=tables.device)
        blocks = tables.index_select(1, pos // self.block_size)  # [B, keys]
        return blocks * self.block_size + pos % self.block_size, pos[None] < lengths[:, None]

    def view_of(self, slots: Tensor, past_index: Tensor, past_valid: Tensor, write_index: Tensor,
                new_valid: Tensor, lengths: Tensor) -> ModelCache:
        """The view `view` builds, from its index tensors (on the cache's device): slots [B], and for
        the MLA layers past_index / past_valid [B, P], write_index / new_valid [B, T] (see
        PagedMLAView). Fixed-size tensors give a forward of fixed shapes (a CUDA graph's)."""
        scratch = self.num_blocks * self.block_size
        layers = []
        for i in range(len(self.layers)):
            if i in self._kda:
                c = self._kda[i]
                layers.append(SlotKDAView(c.state, c.conv, slots))
            else:
                layers.append(PagedMLAView(self._mla[i], past_index, past_valid, write_index, new_valid, scratch))
        return ModelCache(layers, lengths)

    def commit(self, slots: list[int], out: ModelCache, n_new: list[int]) -> None:
        """After the forward: the slots' new conv windows, and their lengths grown by n_new."""
        self.write_states(to_device(torch.tensor(slots), self.device), out)
        self.advance(slots, n_new)

    def write_states(self, slots: Tensor, out: ModelCache) -> None:
        """The forward's new KDA conv windows into `slots` [B] (on the cache's device); the forward
        itself updated their states in the pool (SlotKDAView)."""
        for i, c in self._kda.items():
            c.conv.index_copy_(0, slots, out.layers[i].new_conv.to(c.conv.dtype))

    def advance(self, slots: list[int], n_new: list[int]) -> None:
        """The slots' lengths grown by the tokens a forward fed them."""
        for s, n in zip(slots, n_new):
            self.lengths[s] += n
