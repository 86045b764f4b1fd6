"""How ``KVMemEngine`` prefills a step's new tokens into its view.

Before the prefill the view holds all history when the prompt fits, else the sink and recent blocks
(``_setup_view``). The new tokens then go through the model in chunks of ``_prefill_chunk`` tokens; before each,
the oldest non-sink blocks leave the view until the chunk fits (``_make_room``), and the blocks a chunk completes
are archived while the next one computes (``ArchiveOps._stage``).

**Checkpoints inside a chunk.** A hybrid model needs its recurrent state after a few given tokens (the query's
start, the replay start, the last block edge: ``_checkpoint_marks``). Where the adapter can hand out the state
after given tokens of a forward (``caps.snapshots``), those tokens do not end a forward: a chunk is one forward
whatever marks fall inside it, and the states come back with it. Elsewhere a chunk is cut at each mark, as
``chunk_cuts`` does, and the live state is taken after each piece. The recurrent layers compute the same either
way (they split their work at the marks, ``kvmem_torch.deltanet``), so the checkpoints are the same; what the
fewer, larger forwards change is only how the other layers' arithmetic is grouped.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import numpy as np

from kvmem_core.adapter import PREFILL_CHUNK, EngineAdapter, ForwardOut
from kvmem_core.archive import Probe
from kvmem_core.config import KVMemConfig
from kvmem_core.groups import Span
from kvmem_core.layout import BlockLayout
from kvmem_core.prompt import Prompt
from kvmem_core.step import ViewState, append_computed, chunk_cuts
from kvmem_core.workspace import Workspace


class PrefillOps:
    """The streaming view and the chunked prefill; mixed into ``KVMemEngine`` (see the module docstring)."""

    adapter: EngineAdapter
    layout: BlockLayout
    view: ViewState
    checkpoints: Any
    prefill_progress: Callable[[int, int], None] | None
    _counts: Any
    _materialize: Callable[[str, Sequence[int], int], int]
    _archive: Callable[..., None]
    _stage: Callable[[Workspace, Sequence[int], Sequence[Span]], dict[int, int]]
    _hold: Callable[[Probe, Sequence[int]], None]
    _replay_start: Callable[[KVMemConfig, Prompt], int]

    def _setup_view(self, cfg: KVMemConfig, mode: str, fits: bool, cached: int) -> None:
        """Before the prefill: all history when it fits, else sink + recent blocks."""
        n_blocks = cached // self.layout.block_tokens
        if fits:
            target = list(range(n_blocks))
        else:
            target = self._streaming_blocks(cfg, n_blocks)
        self._materialize(mode, target, n_blocks)

    def _streaming_blocks(self, cfg: KVMemConfig, n_blocks: int) -> list[int]:
        bt = self.layout.block_tokens
        sink = -(-cfg.sink_tokens // bt)
        recent = max(1, (cfg.view_tokens - self._prefill_chunk(cfg) - cfg.sink_tokens) // bt - 1)
        return sorted(set(range(min(sink, n_blocks))) | set(range(max(0, n_blocks - recent), n_blocks)))

    def _checkpoint_marks(self, cfg: KVMemConfig, prompt: Prompt) -> tuple[int, ...]:
        """Tokens after which a hybrid model's state is checkpointed: the query's start, the replay start and the
        last block edge (none without recurrent state)."""
        if self.checkpoints is None:
            return ()
        edge = len(prompt.tokens) // self.layout.block_tokens * self.layout.block_tokens
        return (prompt.query_start, self._replay_start(cfg, prompt), edge)

    def _prefill_cuts(self, cfg: KVMemConfig, cached: int, n: int, marks: Sequence[int]) -> list[int]:
        """Forward boundaries of a prefill of ``[cached, n)``: every ``_prefill_chunk`` tokens, and at each mark
        unless the adapter takes states inside a forward (``caps.snapshots``)."""
        inside = () if self.adapter.caps.snapshots else marks
        return chunk_cuts(cached, n, self._prefill_chunk(cfg), inside)

    def _prefill(
        self,
        cfg: KVMemConfig,
        mode: str,
        fits: bool,
        ws: Workspace,
        prompt: Prompt,
        cached: int,
        probe: Probe | None = None,
    ) -> tuple[np.ndarray | None, np.ndarray | None]:
        """Prefill ``ids[cached:]`` in chunks, archiving completed blocks; return last logits and query q. With a
        ``probe``, its window is probed (no logits) and the blocks it completes are held, not archived. Captured
        queries and the states forwards hand out at checkpoint marks are read once the last chunk is issued (an
        adapter may still be copying them: a read between forwards would wait for the device there)."""
        ids, q0 = prompt.tokens, prompt.scored_from
        captured: list[ForwardOut] = []
        snapshots: list[tuple[list[int], ForwardOut]] = []  # marks inside a forward, and the forward's states
        out = None
        marks = self._checkpoint_marks(cfg, prompt)
        cuts = self._prefill_cuts(cfg, cached, len(ids), marks)
        room = {s: e - s for s, e in zip(cuts, cuts[1:])}  # a probe splits a chunk, not the room made for it
        cuts = sorted({*cuts, probe.start}) if probe else cuts
        staged: dict[int, int] = {}  # the previous chunk's blocks, read but not archived yet (``_stage``)
        for s, e in zip(cuts, cuts[1:]):
            chunk = ids[s:e].tolist()
            if not fits and s in room:
                if self._renumbers(cfg, mode, room[s]):  # renumbering loads every resident block from the store
                    self._archive(ws, sorted(staged), prompt.mandatory, staged)
                    staged = {}
                self._make_room(cfg, mode, room[s])
            pos = list(range(self.view.next_pos, self.view.next_pos + len(chunk)))
            wants_q = not fits and cfg.method == "retrieval" and e > q0
            capture = max(0, q0 - s) if wants_q else None
            probing = probe if probe is not None and s >= probe.start else None  # the probe this chunk runs
            inside = sorted(m for m in set(marks) if s < m < e)  # only with caps.snapshots (``_prefill_cuts``)
            extra: dict[str, Any] = {"stop_after": probing.stop_after} if probing else {}  # adapters without caps lack
            if inside:  # the kwargs
                extra["snapshot_at"] = [m - s for m in inside]
            out = self.adapter.forward(chunk, pos, want_logits=e == len(ids), capture_from=capture, **extra)
            self._archive(ws, sorted(staged), prompt.mandatory, staged)
            if capture is not None:
                captured.append(out)
            done = append_computed(self.view, chunk)
            if probing:
                self._hold(probing, done)
            staged = {} if probing else self._stage(ws, done, prompt.mandatory)
            if inside:
                snapshots.append((inside, out))
            if e in marks:
                self.checkpoints.take(prompt.tokens[:e], ws.id)
            if self.prefill_progress is not None:
                self.prefill_progress(e - cached, len(ids) - cached)
        self._archive(ws, sorted(staged), prompt.mandatory, staged)
        for inside, forward in snapshots:
            for m, state in zip(inside, forward.states or ()):
                self.checkpoints.take(prompt.tokens[:m], ws.id, state)
        if len(self.view.tokens) == len(ids):  # the computed tokens are the prompt's: its array serves as theirs, so
            self.view.assign(self.view.tokens, ids)  # the step's checkpoint keys see one array (``PrefixKeys``)
        assert out is not None and (probe is not None or out.logits is not None)
        queries = [o.queries for o in captured if o.queries is not None]
        return out.logits, np.concatenate(queries, axis=1) if queries else None

    def _prefill_chunk(self, cfg: KVMemConfig) -> int:
        """Tokens per prefill forward: ``PREFILL_CHUNK``, or what the adapter asks for up to a quarter of the view
        (whole blocks), so a streaming prefill still sees most of the recent history; never more than
        ``_make_room`` can always free (the view less its sink blocks and a partial tail block). Blocks are
        archived and progress reported between forwards."""
        bt = self.layout.block_tokens
        asked = max(PREFILL_CHUNK, min(self.adapter.caps.prefill_chunk, cfg.view_tokens // 4 // bt * bt))
        room = cfg.view_tokens - (-(-cfg.sink_tokens // bt) + 1) * bt
        return max(1, min(asked, room))

    def _renumbers(self, cfg: KVMemConfig, mode: str, n: int) -> bool:
        """Whether ``_make_room(cfg, mode, n)`` re-compacts the view: compact positions, and ``n`` more tokens plus
        the generation reserve would pass the model's trained context."""
        return mode == "compact" and self.view.next_pos + n + cfg.gen_budget > self.adapter.caps.trained_ctx

    def _make_room(self, cfg: KVMemConfig, mode: str, n: int) -> None:
        """Drop the oldest resident non-sink blocks until ``n`` tokens fit; re-compact positions when needed (every
        resident block must be stored by then)."""
        bt = self.layout.block_tokens
        sink = -(-cfg.sink_tokens // bt)
        if self._renumbers(cfg, mode, n):
            self._materialize(mode, sorted(self.view.blocks), len(self.view.tokens) // bt)
        droppable = sorted(b for b in self.view.blocks if b >= sink)
        while self.adapter.view_free() < n and droppable:
            b = droppable.pop(0)
            pos = self.view.blocks.pop(b)
            self.adapter.drop(pos, pos + bt)
            self._counts["blocks_dropped"] += 1
