"""Paged attention KV: fixed-size blocks of slots, block-major so one block is one contiguous copy.

Storage is ``kv[num_blocks, 2, layers, block_tokens, kv_heads, head_dim]``: K then V of
every attention layer of a block sit together, so moving a block between host and GPU is
a single memcpy. K is stored **pre-RoPE** (after the k norm); each slot also keeps its
position and that position's RoPE cos/sin row, and attention rotates keys by it when reading
them, so a block can be placed at any position (``compact`` mode) without touching its bytes,
and what is read out of the cache is exactly what KVMem stores. The tables are written when a
slot's position is, so a decode step reads them instead of rebuilding one row per key.

With ``fp8`` the rows hold 8-bit codes and their scales (``fp8``): ``write_rows`` quantizes and
``read_rows`` dequantizes to the compute dtype, and blocks move as the same raw bytes.

Slot ``s`` is token ``s % B`` of block ``s // B``. A ``View`` is a sequence's logical token
order: the concatenation of its blocks in table order.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

import torch

from kvmem_torch import fp8


@dataclass
class View:
    """A sequence's block table and logical length (tokens written so far)."""

    table: list[int] = field(default_factory=list)
    length: int = 0

    def slots(self, start: int, stop: int, block_tokens: int) -> list[int]:
        """Physical slot of each view index in ``[start, stop)``."""
        return [self.table[i // block_tokens] * block_tokens + i % block_tokens for i in range(start, stop)]


def rope_cos_sin(
    positions: torch.Tensor, inv_freq: torch.Tensor, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [N, rotary_dim] for NeoX-style (rotate-half) RoPE at the given positions."""
    freqs = positions.float()[:, None] * inv_freq[None, :]
    emb = torch.cat([freqs, freqs], dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


class PagedKV:
    """K/V/position storage for ``num_blocks`` blocks of ``block_tokens`` slots, with a free list; ``inv_freq``
    the rotary frequencies (``rotary_dim / 2``) of the slots' RoPE tables. ``dtype`` is the compute dtype;
    ``kv_fp8`` stores K/V as 8-bit rows (``fp8``) instead of in it."""

    def __init__(
        self,
        n_layers: int,
        num_blocks: int,
        block_tokens: int,
        n_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device | str,
        inv_freq: torch.Tensor,
        kv_fp8: bool = False,
    ) -> None:
        self.fp8, self.dtype, self.head_dim = kv_fp8, dtype, head_dim
        row, store = (fp8.row_bytes(head_dim), torch.uint8) if kv_fp8 else (head_dim, dtype)
        self.kv = torch.zeros(num_blocks, 2, n_layers, block_tokens, n_kv_heads, row, dtype=store, device=device)
        self.rows = self.kv.view(-1, n_kv_heads, row)  # row r: see ``base_rows``
        self.pos = torch.zeros(num_blocks * block_tokens, dtype=torch.long, device=device)
        self.inv_freq = inv_freq.to(device)
        self.cos, self.sin = rope_cos_sin(self.pos, self.inv_freq, dtype)  # [slots, rotary_dim]
        self.n_layers, self.block_tokens, self.num_blocks = n_layers, block_tokens, num_blocks
        self.free: list[int] = list(range(num_blocks))

    @property
    def num_free(self) -> int:
        return len(self.free)

    @property
    def block_nbytes(self) -> int:
        return self.kv[0].nbytes

    @property
    def block_rows(self) -> int:
        """Rows of ``rows`` per block: slot s's layer-0 K is row ``(s // B) * block_rows + s % B``."""
        return 2 * self.n_layers * self.block_tokens

    def base_rows(self, slots: torch.Tensor) -> torch.Tensor:
        """Row of each slot's layer-0 K in ``rows``; layer l's K is ``+ l*B``, its V ``+ (L + l)*B``."""
        B = self.block_tokens
        return (slots // B) * self.block_rows + slots % B

    def place(self, slots: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Give ``slots`` these positions and their RoPE rows. -> (cos, sin) [len(slots), rotary_dim]"""
        cos, sin = rope_cos_sin(positions, self.inv_freq, self.cos.dtype)
        self.pos.index_copy_(0, slots, positions)
        self.cos.index_copy_(0, slots, cos)
        self.sin.index_copy_(0, slots, sin)
        return cos, sin

    def write_rows(self, rows: torch.Tensor, x: torch.Tensor) -> None:
        """Store x [n, kv heads, head dim] (compute dtype) at ``rows``, quantized when the cache is 8-bit."""
        self.rows.index_copy_(0, rows, fp8.quantize(x) if self.fp8 else x)

    def read_rows(self, rows: torch.Tensor) -> torch.Tensor:
        """Rows [n, kv heads, head dim] in the compute dtype (8-bit rows dequantized)."""
        out = self.rows.index_select(0, rows)
        return fp8.dequantize(out, self.dtype) if self.fp8 else out

    def k_offset(self, layer: int) -> int:
        return layer * self.block_tokens

    def v_offset(self, layer: int) -> int:
        return (self.n_layers + layer) * self.block_tokens

    def can_allocate(self, n: int) -> bool:
        return n <= len(self.free)

    def allocate(self, n: int) -> list[int]:
        """Take ``n`` free blocks; the caller checked ``can_allocate``."""
        assert self.can_allocate(n), f"{n} blocks wanted, {len(self.free)} free"
        taken, self.free = self.free[:n], self.free[n:]
        return taken

    def release(self, blocks: list[int]) -> None:
        assert not set(blocks) & set(self.free), "double free"
        self.free.extend(blocks)

    def reserve(self, view: View, n_tokens: int) -> bool:
        """Grow ``view``'s table so ``n_tokens`` more tokens fit; False (nothing taken) if no room."""
        need = -(-(view.length + n_tokens) // self.block_tokens) - len(view.table)
        if need <= 0:
            return True
        if not self.can_allocate(need):
            return False
        view.table.extend(self.allocate(need))
        return True

    def block_slots(self, block: int) -> slice:
        return slice(block * self.block_tokens, (block + 1) * self.block_tokens)

    def read_block(self, block: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(K, V, positions) of one block: K/V [layers, block_tokens, kv heads, head dim], pre-RoPE (views)."""
        return self.kv[block, 0], self.kv[block, 1], self.pos[self.block_slots(block)]

    def write_kv(self, block: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Place a block's pre-RoPE K/V [layers, block_tokens, kv heads, head dim] at ``block`` (copies queued on the
        current stream; a page-locked host source is read asynchronously)."""
        self.kv[block, 0].copy_(k, non_blocking=True)
        self.kv[block, 1].copy_(v, non_blocking=True)

    def set_positions(self, blocks: Sequence[int], positions: torch.Tensor) -> None:
        """Give every slot of ``blocks`` a position (``positions``: ``block_tokens`` per block, any values, e.g.
        compacted) and its RoPE rows; K stays pre-RoPE, so this is all a block's (re)placement takes."""
        B = self.block_tokens
        first = torch.tensor(blocks, dtype=torch.long).to(self.pos.device, non_blocking=True) * B
        slots = (first[:, None] + torch.arange(B, device=self.pos.device)).flatten()
        self.place(slots, positions.to(self.pos.device))
