"""One sequence's view over the paged cache: cells in position order, recurrent state, decode graphs.

The view is a list of cells (slots) sorted by position; attention is causal in that order.
New tokens append (their positions exceed every position in the view); stored blocks can
be inserted anywhere by position and cells dropped by position range, so any chronological
subset of history can be attended. A device mirror of the slot list feeds attention; on
CUDA, decode and prefill forwards replay CUDA graphs (``graph_steps``).
"""

from __future__ import annotations

import bisect
from typing import Sequence

import torch

from kvmem_core.lookup import DRAFT_TOKENS
from kvmem_core.step import chunk_cuts
from kvmem_torch.graph_io import Captured, GraphInputs
from kvmem_torch.graph_steps import GraphSteps
from kvmem_torch.layers import flash_varlen_usable
from kvmem_torch.model import ATTENTION, Model, RecurrentState

VERIFY_ROWS = 1 + DRAFT_TOKENS  # a verification graph's rows: the token and the longest lookup draft


class Runner(GraphSteps):
    """The model plus one view (paged KV cells), its recurrent state and decode graphs."""

    def __init__(
        self, model: Model, num_blocks: int, block_tokens: int, cuda_graphs: bool | None = None, kv_fp8: bool = False
    ) -> None:
        self.model = model
        self.use_graphs = model.device.type == "cuda" if cuda_graphs is None else cuda_graphs
        self.graph_prefill = (
            self.use_graphs
            and model.mtp is None
            and flash_varlen_usable(model.dtype, model.spec.head_dim, model.device)
        )
        self.view_blocks = num_blocks
        self.cache = model.new_cache(num_blocks + int(self.graph_prefill), block_tokens, kv_fp8)
        # the K/V of a prefill graph's padding rows: a block of their own, never in the view
        self.scratch = _block_slots(self.cache.allocate(1)[0], block_tokens) if self.graph_prefill else []
        self.state = model.new_state()
        self.B = block_tokens
        self.cells: list[int] = []  # slots, view order
        self.positions: list[int] = []  # ascending, parallel to cells
        self.live: dict[int, int] = {}  # block -> live cells in it
        self.tail: list[int] = []  # free slots of the block new tokens fill
        self.holes: set[int] = set()  # free slots in blocks that still hold live cells: filled before the tail
        self.slots_dev = torch.zeros(self.cache.num_blocks * block_tokens, dtype=torch.long, device=model.device)
        self.synced = 0  # cells[:synced] are mirrored in slots_dev
        model.rule_graphs.enabled = self.use_graphs
        self.graphs: dict[tuple[int, int], Captured] = {}  # decode and verification graphs by (rows, bucket)
        # rejected draft tokens roll back by dropping cells: a recurrent state (and an MTP head's hidden rows,
        # only on such models) takes the eager path
        self.graph_verify = self.use_graphs and not model.spec.deltanet_layers and model.mtp is None
        rows = (1, VERIFY_ROWS) if self.graph_verify else (1,)
        self.inputs = {n: GraphInputs(n, model.device) for n in rows} if self.use_graphs else {}
        self._pool = None
        # warm-ups before captures run on one stream: the allocator reuses a freed block only on its own stream, so a
        # fresh stream per warm-up would keep each warm-up's activations cached (as ``rule_graphs`` found)
        self._warm_up_stream: torch.cuda.Stream | None = None
        # snapshots and padding in a graph: the recurrent layers read their limits on the device, which fla's form
        # of the rule does (``deltanet.tiled``)
        self.graph_snapshots = self.graph_prefill and all(m.fla for kind, m, _ in model.layers if kind != ATTENTION)
        # (padded rows, bucket, snapshots, captures queries) -> its graph, or None where its capture failed
        self.prefill_graphs: dict[tuple[int, int, int, bool], Captured | None] = {}
        self.prefill_seen: set[tuple[int, int, int, bool]] = set()  # keys met once: the second meeting captures

    @property
    def max_view_tokens(self) -> int:
        return self.view_blocks * self.B

    @property
    def length(self) -> int:
        return len(self.cells)

    def view_free(self) -> int:
        """Cells that can still be appended: every slot no live cell holds (dropping part of a block leaves
        its freed slots usable, so the view never loses room to fragmentation)."""
        return len(self.holes) + len(self.tail) + self.cache.num_free * self.B

    def _take_slots(self, n: int) -> list[int]:
        assert n <= self.view_free(), f"view full: {n} cells wanted, {self.view_free()} free"
        out = [self.holes.pop() for _ in range(min(n, len(self.holes)))]  # which slot a cell takes changes nothing
        while len(out) < n:
            if not self.tail:
                block = self.cache.allocate(1)[0]
                self.tail = _block_slots(block, self.B)
            take, self.tail = self.tail[: n - len(out)], self.tail[n - len(out) :]
            out.extend(take)
        for s in out:
            self.live[s // self.B] = self.live.get(s // self.B, 0) + 1
        return out

    def _sync(self) -> None:
        if self.synced < len(self.cells):
            new = torch.tensor(self.cells[self.synced :], dtype=torch.long)
            self.slots_dev[self.synced : len(self.cells)].copy_(new, non_blocking=True)
            self.synced = len(self.cells)

    def forward(
        self,
        tokens: Sequence[int],
        positions: Sequence[int],
        last_only: bool = True,
        capture: bool = False,
        snapshots: Sequence[tuple[int, RecurrentState]] = (),
    ) -> tuple[torch.Tensor, dict[int, torch.Tensor] | None]:
        """Append tokens at ``positions`` (all beyond the view's last) and run them. -> (logits, pre-RoPE q)
        ``snapshots``: (offset, state) pairs, ascending offsets inside the tokens: each state receives the
        recurrent state after that many of them (as a forward cut there would leave it)."""
        assert not self.positions or positions[0] > self.positions[-1], "new positions must follow the view"
        assert all(0 < o < len(tokens) for o, _ in snapshots), "a snapshot falls inside the forward"
        if len(tokens) == 1 and self.use_graphs and not capture:
            return self._graph_step(tokens, positions), None
        if last_only and self._replays_prefill(len(tokens), len(snapshots), capture):
            logits, queries = self._prefill_step(tokens, positions, snapshots, capture)
            return logits.clone(), queries
        dev, start = self.model.device, len(self.cells)
        slots = self._take_slots(len(tokens))
        self.cells.extend(slots)
        self.positions.extend(positions)
        self._sync()
        with torch.inference_mode():
            ctx = self.model.static_context(
                self.cache,
                self.slots_dev[start : start + len(tokens)],
                self.slots_dev[: len(self.cells)],
                torch.arange(start, len(self.cells), device=dev),
                _to_device(positions, dev),
                capture,
            )
            ctx.snapshots, ctx.exact_keys = tuple(snapshots), True
            logits = self.model.forward(_to_device(tokens, dev), ctx, self.cache, self.state, last_only)
        return logits, ctx.capture

    def prefill(
        self, tokens: Sequence[int], positions: Sequence[int], chunk: int = 512, snapshot_at: Sequence[int] = ()
    ) -> tuple[torch.Tensor, dict[int, RecurrentState]]:
        """Chunked prefill; snapshots of the recurrent state after ``i`` tokens for each ``i`` in ``snapshot_at``."""
        cuts = chunk_cuts(0, len(tokens), chunk, snapshot_at)
        snaps, logits = {}, None
        for a, b in zip(cuts, cuts[1:]):
            logits, _ = self.forward(tokens[a:b], positions[a:b])
            if b in snapshot_at:
                snaps[b] = self.state.snapshot()
        return logits, snaps

    def forward_all(self, tokens: Sequence[int], positions: Sequence[int]) -> torch.Tensor:
        """``forward`` with the logits of every token [len(tokens), vocab] (a draft's verification). On CUDA, up to
        ``VERIFY_ROWS`` tokens on a model without recurrent layers replay a graph captured per view-size bucket for
        ``VERIFY_ROWS`` rows: fewer tokens are padded with copies of the last at the positions after it, whose
        cells leave the view after the replay (their logits are not returned)."""
        n = len(tokens)
        if not self.graph_verify or not 1 < n <= VERIFY_ROWS or self.view_free() < VERIFY_ROWS:
            return self.forward(tokens, positions, last_only=False)[0]
        pad = VERIFY_ROWS - n
        padded = [*positions, *range(positions[-1] + 1, positions[-1] + 1 + pad)]
        logits = self._graph_step([*tokens, *[tokens[-1]] * pad], padded)
        if pad:
            self.drop(padded[n], 1 << 62)
        return logits[:n]

    def insert_block(self, k: torch.Tensor, v: torch.Tensor, positions: Sequence[int]) -> None:
        """Write a block's pre-RoPE K/V [layers, >= n, kv, hd] into a new block; its first n = len(positions)
        tokens become cells at ``positions``."""
        self.insert_blocks([(k, v, positions)])

    def insert_blocks(self, blocks: Sequence[tuple[torch.Tensor, torch.Tensor, Sequence[int]]]) -> None:
        """``insert_block`` of each (K, V, positions), their positions and RoPE rows written in one go."""
        ids, padded = self.cache.allocate(len(blocks)), []
        for block, (k, v, positions) in zip(ids, blocks):
            n = len(positions)
            if k.shape[1] < self.B:
                k, v = _pad_tokens(k, self.B), _pad_tokens(v, self.B)
            self.cache.write_kv(block, k, v)
            padded += [*positions, *[0] * (self.B - n)]
            self.live[block] = n
            self.holes.update(range(block * self.B + n, (block + 1) * self.B))
            i = bisect.bisect_left(self.positions, positions[0])
            self.cells[i:i] = list(range(block * self.B, block * self.B + n))
            self.positions[i:i] = list(positions[:n])
            self.synced = min(self.synced, i)
        self.cache.set_positions(ids, _to_device(padded, self.model.device))

    def move_cells(self, moves: Sequence[tuple[int, int, int]]) -> None:
        """For each (src, dst, n), at once: the ``n`` cells from position ``src`` take the positions from ``dst``.
        Only positions and their RoPE rows are written (K is pre-RoPE); no KV moves."""
        moved: dict[int, int] = {}  # slot -> its new position
        for src, dst, n in moves:
            i, j = self.cells_at(src, src + n)
            assert j - i == n, f"view holds {j - i} cells in [{src}, {src + n})"
            moved.update(zip(self.cells[i:j], range(dst, dst + n)))
        if not moved:
            return
        first = bisect.bisect_left(self.positions, min(min(src, dst) for src, dst, _ in moves))
        cells = sorted((moved.get(c, p), c) for p, c in zip(self.positions[first:], self.cells[first:]))
        self.positions[first:], self.cells[first:] = [p for p, _ in cells], [c for _, c in cells]
        assert all(a < b for a, b in zip(self.positions[first:], self.positions[first + 1 :])), "positions collide"
        self.synced = min(self.synced, first)
        device = self.model.device
        self.cache.place(_to_device(list(moved), device), _to_device(list(moved.values()), device))

    def cells_at(self, p0: int, p1: int) -> tuple[int, int]:
        """Index range of the cells with positions in ``[p0, p1)``."""
        return bisect.bisect_left(self.positions, p0), bisect.bisect_left(self.positions, p1)

    def read_cells(self, p0: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K, V [layers, n, kv heads, head dim] (pre-RoPE; 8-bit caches: their packed rows, ``fp8``) of the ``n``
        cells from position ``p0``."""
        return self.read_runs([p0], n)

    def read_runs(self, starts: Sequence[int], n: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``read_cells`` of the ``n`` cells from each of ``starts``, run after run along the token axis
        ([layers, len(starts) * n, ...]), in one gather per layer."""
        cells: list[int] = []
        for p0 in starts:
            i, j = self.cells_at(p0, p0 + n)
            assert j - i == n, f"view holds {j - i} cells in [{p0}, {p0 + n})"
            cells += self.cells[i:j]
        rows = self.cache.base_rows(_to_device(cells, self.model.device))
        L = self.cache.n_layers
        k = torch.stack([self.cache.rows.index_select(0, rows + self.cache.k_offset(l)) for l in range(L)])
        v = torch.stack([self.cache.rows.index_select(0, rows + self.cache.v_offset(l)) for l in range(L)])
        return k, v

    def drop(self, p0: int, p1: int) -> None:
        """Remove cells with positions in ``[p0, p1)``; blocks left without live cells are freed."""
        i, j = self.cells_at(p0, p1)
        for s in self.cells[i:j]:
            self.live[s // self.B] -= 1
        self.holes.update(self.cells[i:j])
        del self.cells[i:j], self.positions[i:j]
        self.synced = min(self.synced, i)
        self._free_dead()

    def _free_dead(self) -> None:
        tail_block = self.tail[0] // self.B if self.tail else None
        dead = [b for b, n in self.live.items() if n == 0 and b != tail_block]
        for b in dead:
            del self.live[b]
            self.holes.difference_update(range(b * self.B, (b + 1) * self.B))
        self.cache.release(dead)

    def clear(self) -> None:
        """Empty the view and reset the recurrent state."""
        self.drop(-(1 << 62), 1 << 62)
        if self.tail:
            block = self.tail[0] // self.B
            self.live.pop(block, None)
            self.cache.release([block])
            self.tail = []
        self.holes.clear()
        self.state.reset()


def _block_slots(block: int, block_tokens: int) -> list[int]:
    return list(range(block * block_tokens, (block + 1) * block_tokens))


def _to_device(values: Sequence[int], device: torch.device) -> torch.Tensor:
    """A long tensor of ``values`` on ``device``, sent without waiting for the device's queued work (a blocking
    copy would first wait for it, and the host could not queue the next forward while the last one runs)."""
    return torch.tensor(values, dtype=torch.long).to(device, non_blocking=True)


def _pad_tokens(x: torch.Tensor, n: int) -> torch.Tensor:
    """Pad dim 1 (tokens) of [layers, tokens, heads, dim] with zeros up to ``n``."""
    return torch.nn.functional.pad(x, (0, 0, 0, 0, 0, n - x.shape[1]))
