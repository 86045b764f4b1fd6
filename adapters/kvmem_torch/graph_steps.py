"""A ``Runner``'s CUDA graphs: decode (and draft verification) graphs per view-size bucket, and whole prefill forwards.

**Prefill graphs.** A prefill forward of a few hundred tokens costs the host more than the GPU (~100 kernel
launches a layer through Python), so a forward of a padded length and view-size bucket
seen before replays a CUDA graph of the whole forward, captured on its second sighting: the view's keys are
read to the bucket's end and flash attention stops at the true count (``layers.flash_prefill``). A forward handing
out snapshots of the recurrent state (a turn's checkpoint marks) is keyed by their number, not their offsets: the
graph reads the offsets from its inputs (``deltanet.tiled``). A forward's rows are padded to a multiple of
``PAD_ROWS``: the padding's K/V go to a cache block of their own (``scratch``), attention computes only the forward's
own queries, the recurrent layers skip the padding (``deltanet._stopped_at``) and the logits are its last own row's,
so a turn's last, shorter forward and the one capturing the query's rows replay graphs too.

A prefill graph's key is (padded rows, view bucket, number of snapshots, whether it captures the queries).
"""

from __future__ import annotations

import logging
from typing import Sequence

import torch

from kvmem_torch.graph_io import Captured, GraphInputs
from kvmem_torch.layers import SMALL_QUERY
from kvmem_torch.model import Model, RecurrentState
from kvmem_torch.paged import PagedKV

# whole prefill forwards kept as graphs, the first keys met twice: a turn's full-length forwards share a length and a
# view bucket, a view filling up meets one bucket a forward; none is evicted, since keys met in a cycle longer than
# the room would each be captured again at every meeting
PREFILL_GRAPHS = 8
PAD_ROWS = 64  # a prefill graph's rows: a forward's, rounded up to a multiple of this
SEEN_KEYS = 1024  # prefill keys remembered from one meeting to the next
log = logging.getLogger("kvmem.engine")


class GraphSteps:
    """The graph half of ``Runner``: what it captures and replays. The view's bookkeeping (cells, positions, slots,
    ``view_free``, ``_take_slots``, ``_sync``) and the attributes below are ``Runner``'s."""

    model: Model
    cache: PagedKV
    state: RecurrentState
    B: int
    cells: list[int]
    positions: list[int]
    synced: int
    slots_dev: torch.Tensor
    scratch: list[int]
    inputs: dict[int, GraphInputs]
    graphs: dict[tuple[int, int], Captured]
    graph_prefill: bool
    graph_snapshots: bool
    prefill_graphs: dict[tuple[int, int, int, bool], Captured | None]
    prefill_seen: set[tuple[int, int, int, bool]]
    _pool: tuple[int, int] | None
    _warm_up_stream: torch.cuda.Stream | None

    def _bucket(self, n: int) -> int:
        """Keys a decode graph attends to: n rounded up to an eighth of its power-of-two octave."""
        octave = self.B
        while octave < n:
            octave *= 2
        step = max(self.B, octave // 8)
        return min(-(-n // step) * step, self.max_view_tokens)

    def _replays_prefill(self, n: int, snapshots: int = 0, capture: bool = False) -> bool:
        """Whether a prefill forward of ``n`` tokens handing out ``snapshots`` states (and capturing its queries)
        goes through a graph (module docstring): lengths past ``SMALL_QUERY`` (flash attention) whose attention
        does not go through cuDNN's kernel (``Model.cudnn_prefill``), a (padded length,
        bucket, snapshots, capture) met before whose capture has not failed, while there is room for its graph
        (``PREFILL_GRAPHS``)."""
        if not self.graph_prefill or n <= SMALL_QUERY or n > self.view_free():
            return False
        if self.model.cudnn_prefill(n, len(self.cells) + n):  # eager: its split needs the exact key count
            return False
        if (snapshots or _padded(n) != n) and not self.graph_snapshots:
            return False
        key = self.prefill_key(n, snapshots, capture)
        if key in self.prefill_graphs:
            return self.prefill_graphs[key] is not None
        if len(self.prefill_graphs) >= PREFILL_GRAPHS:
            return False
        if key in self.prefill_seen:
            return True
        if len(self.prefill_seen) >= SEEN_KEYS:  # a long-running server meets many one-off lengths
            self.prefill_seen.clear()
        self.prefill_seen.add(key)
        return False

    def prefill_key(self, n: int, snapshots: int, capture: bool) -> tuple[int, int, int, bool]:
        """The graph key of a prefill forward of ``n`` tokens appended to the view as it is now (module docstring)."""
        return _padded(n), self._bucket(len(self.cells) + n), snapshots, capture

    def _graph_step(self, tokens: Sequence[int], positions: Sequence[int]) -> torch.Tensor:
        """Append and run ``tokens`` (1 or ``VERIFY_ROWS``) through the graph of their row count and the view's size
        bucket, capturing it the first time. -> the graph's logits [rows, vocab], rewritten by its next replay."""
        rows = len(tokens)
        s = self._send(tokens, positions, rows)
        bucket = self._bucket(len(self.cells))
        if (rows, bucket) not in self.graphs:
            self.graphs[rows, bucket] = self._capture(bucket, s)
        captured = self.graphs[rows, bucket]
        captured.graph.replay()
        self.model.hidden = captured.hidden
        return captured.out

    def _prefill_step(
        self,
        tokens: Sequence[int],
        positions: Sequence[int],
        snapshots: Sequence[tuple[int, RecurrentState]],
        capture: bool,
    ) -> tuple[torch.Tensor, dict[int, torch.Tensor] | None]:
        """``forward`` of a prefill through the graph of its key (``_replays_prefill``), capturing it the first time;
        one whose capture failed runs the same forward eagerly. -> (logits [1, vocab], the captured queries by
        layer, or None), rewritten by the graph's next replay."""
        n, key = len(tokens), self.prefill_key(len(tokens), len(snapshots), capture)
        s = self._send(tokens, positions, key[0], [n, *(offset for offset, _ in snapshots)])
        if key not in self.prefill_graphs:
            self.prefill_graphs[key] = self._capture_prefill(key, s)
        captured, states = self.prefill_graphs[key], [state for _, state in snapshots]
        if captured is None:
            with torch.inference_mode():
                logits, queries = self._static_forward(s, len(self.cells), True, states, capture, padded=True)
        else:
            captured.graph.replay()
            for state, written in zip(states, captured.snapshots):
                state.restore(written)
            logits, queries = captured.out, captured.queries
        return logits, None if queries is None else {layer: q[:n] for layer, q in queries.items()}

    def _send(
        self, tokens: Sequence[int], positions: Sequence[int], rows: int, limits: Sequence[int] = ()
    ) -> dict[str, torch.Tensor]:
        """Append ``tokens`` at ``positions`` as cells and queue them as a graph's inputs of ``rows`` rows (past the
        tokens: the last one again, the positions after it, ``scratch`` slots), ``limits`` in its "lim" row. ->
        the inputs' static tensors."""
        assert not self.positions or positions[0] > self.positions[-1], "new positions must follow the view"
        pad, slots = rows - len(tokens), self._take_slots(len(tokens))
        self._sync()
        first = len(self.cells)
        self.cells.extend(slots)
        self.positions.extend(positions)
        if rows not in self.inputs:
            self.inputs[rows] = GraphInputs(rows, self.model.device)
        after = range(positions[-1] + 1, positions[-1] + 1 + pad)
        padded = ([*tokens, *[tokens[-1]] * pad], [*positions, *after], [*slots, *self.scratch[:pad]])
        self.inputs[rows].send(*padded, first, limits)
        self.synced = len(self.cells)  # the graph mirrors the new slots itself
        return self.inputs[rows].static

    def drop_graphs(self) -> None:
        """Forget the captured graphs and their memory pool (after the model's decode path changed)."""
        self.graphs.clear()
        self.prefill_graphs.clear()
        self._pool = None

    def _static_forward(
        self,
        s: dict[str, torch.Tensor],
        bucket: int,
        last_only: bool,
        snapshots: Sequence[RecurrentState] = (),
        capture: bool = False,
        padded: bool = False,
    ) -> tuple[torch.Tensor, dict[int, torch.Tensor] | None]:
        """The forward of the rows in graph inputs ``s`` over the view's first ``bucket`` slots (what a graph runs);
        ``padded``: a prefill's, whose own rows and snapshot offsets ``s`` holds ("lim"), ``snapshots`` receiving
        the states after them. -> (logits, the captured queries or None)"""
        self.slots_dev.index_copy_(0, s["q"], s["slot"])
        ctx = self.model.static_context(self.cache, s["slot"], self.slots_dev[:bucket], s["q"], s["pos"], capture)
        if padded:  # keys up to the forward's own last row
            ctx.rows, ctx.n_keys = s["lim"][:1], s["q"][:1] + s["lim"][:1]
        ctx.snapshots = tuple((s["lim"][1 + i], state) for i, state in enumerate(snapshots))
        return self.model.forward(s["tok"], ctx, self.cache, self.state, last_only=last_only), ctx.capture

    def _capture_prefill(self, key: tuple[int, int, int, bool], s: dict[str, torch.Tensor]) -> Captured | None:
        """``_capture`` of a prefill graph; None (logged) where it fails."""
        try:
            return self._capture(key[1], s, last_only=True, snapshots=key[2], capture=key[3], padded=True)
        except Exception as exc:  # any: the eager forward that follows raises whatever the forward itself raises
            name, rows = type(exc).__name__, key[0]
            log.warning("a prefill forward of %d rows cannot be captured (%s: %s); it runs eagerly", rows, name, exc)
            return None

    def _capture(
        self,
        bucket: int,
        s: dict[str, torch.Tensor],
        last_only: bool = False,
        snapshots: int = 0,
        capture: bool = False,
        padded: bool = False,
    ) -> Captured:
        """Run the rows of ``s`` once on a side stream (warm-up), put the recurrent state back, then capture the
        same forward (nothing runs until a replay), its ``snapshots`` written to states of the graph's own. Other
        threads may use the device meanwhile (thread-local capture); the DeltaNet layers call their rule directly
        inside it. On failure the state is put back."""
        snap, states = self.state.snapshot(), tuple(self.model.new_state() for _ in range(snapshots))
        args = (s, bucket, last_only, states, capture, padded)
        try:
            with torch.inference_mode(), self.model.rule_graphs.inside_capture():
                if self._warm_up_stream is None:
                    self._warm_up_stream = torch.cuda.Stream()
                side = self._warm_up_stream
                side.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(side):
                    self._static_forward(*args)
                torch.cuda.current_stream().wait_stream(side)
                self.state.restore(snap)  # warm-up advanced the state; the replay must start from here
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=self._pool, capture_error_mode="thread_local"):
                    out, queries = self._static_forward(*args)
                self._pool = graph.pool()
        except Exception:
            self.state.restore(snap)
            raise
        return Captured(graph, out, self.model.hidden, states, queries)


def _padded(n: int) -> int:
    return -(-n // PAD_ROWS) * PAD_ROWS
