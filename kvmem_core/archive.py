"""How ``KVMemEngine`` moves blocks between its view and the store, and the query window's probe.

Archiving exports each block the view completes into the store (``_archive``), in order,
with its scoring summaries; ``_load`` brings stored blocks back for materialization.

**The probe.** A step that scores needs the query's features before it selects, and the query's tokens must then be
computed against the selected view. Without a probe the whole query window (the replayed tokens, ``_replay_start``
on) is prefilled against the streaming view and then replayed: computed twice. Retrieval-heads scoring reads
queries and keys of a few layers only, so where the adapter can stop a forward after a layer (``caps.probe``), the
window (its part in the last prefill chunk) is *probed* instead: computed up to the deepest retrieval layer, which
yields the same queries and the same K and V in those layers, then computed once in full against the selected view.
The prefill keeps its chunks and the room it makes for each (the probe only splits the last one), so every token
sees the same view as without a probe. The blocks the window completes are *held* meanwhile and stored afterwards,
layers up to the probe's from the probe (what the store held before) and deeper layers from the full forward (what
the view holds too), at the positions they were probed at; in compact position mode the selected view may move them
first (they load from the probe, ``_load``, and their deeper layers are moved back to be stored, ``MovedBlocks``).
Every step's scores read only layers up to the probe's, and those are the same everywhere as without a probe, so
every selection is the same. So are the answers, until a step loads a held block back from the store: its deeper
layers were computed against the selected view, where without a probe they were computed against the streaming
view, so that step's logits may differ slightly.
``tests/reference/test_probe_engines.py`` checks scores, selections and answers on a real model.
"""

from __future__ import annotations

import dataclasses
import functools
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Mapping, Sequence, cast

import numpy as np

from kvmem_core.adapter import EngineAdapter, MovedBlocks, StagedReads, StagedSummaries
from kvmem_core.config import KVMemConfig
from kvmem_core.errors import CorruptBlockError
from kvmem_core.groups import Span, overlapping
from kvmem_core.layout import ROOT_HASH, BlockKV, BlockLayout, BlockMeta, chain_hash
from kvmem_core.prompt import MAX_QUERY_TOKENS, Prompt
from kvmem_core.retrieval import MANDATORY_TAG, BlockIndex
from kvmem_core.step import ViewState, chunk_cuts
from kvmem_core.store import BlockStore
from kvmem_core.workspace import Workspace

ARCHIVE_WORKERS = 4  # threads that checksum and summarize a chunk's blocks


@dataclass
class Probe:
    """One step's probe of its query window: tokens ``start:`` computed up to layer ``stop_after``; ``held``
    maps each block the window completed to its KV as the probe left it (valid up to ``stop_after``)."""

    start: int
    stop_after: int
    held: dict[int, BlockKV] = field(default_factory=dict)


def _digest(kv: BlockKV, summarize: Callable[[], dict[str, np.ndarray]]) -> tuple[int, dict[str, Any]]:
    """A block's checksum and scoring summaries (``summarize``)."""
    return kv.checksum(), summarize()


def _known(summary: dict[str, np.ndarray]) -> Callable[[], dict[str, np.ndarray]]:
    """A summarizer for ``_digest`` that returns ``summary``, computed already (``StagedSummaries``)."""
    return lambda: summary


def deep_layers(kv: BlockKV, stop_after: int) -> BlockKV:
    """The layers of ``kv`` past ``stop_after`` (views, not copies)."""
    return BlockKV(kv.k[stop_after + 1 :], kv.v[stop_after + 1 :])


def merge_layers(probed: BlockKV, deep: BlockKV, stop_after: int) -> BlockKV:
    """A held block's stored KV: layers up to ``stop_after`` from ``probed``, then ``deep`` (the full forward's
    layers past it, ``deep_layers``); a new array, neither input written to."""
    s = stop_after + 1
    return BlockKV(np.concatenate((probed.k[:s], deep.k)), np.concatenate((probed.v[:s], deep.v)))


class ArchiveOps:
    """Block export, load and the probe; mixed into ``KVMemEngine`` (see the module docstring)."""

    adapter: EngineAdapter
    layout: BlockLayout
    namespace: str
    heads: tuple[tuple[int, int], ...]
    store: BlockStore
    view: ViewState
    checkpoints: Any
    _view_ws: str | None
    _indexes: dict[str, BlockIndex]
    _counts: Any
    _summarize: Callable[[BlockKV, int], dict[str, np.ndarray]]
    _archive_pool: ThreadPoolExecutor | None = None  # made on first use (``_digests``)
    _prefill_chunk: Callable[[KVMemConfig], int]

    def _archive(
        self, ws: Workspace, blocks: Sequence[int], mandatory: Sequence[Span] = (), staged: dict[int, int] | None = None
    ) -> None:
        """Export newly completed blocks from the view into the store (host tier, NVMe by policy); those
        overlapping the ``mandatory`` token ranges are tagged so. ``staged``: the view positions of blocks whose
        reads ``_stage`` took (they may have left the view since)."""
        bt = self.layout.block_tokens
        tagged = overlapping(mandatory, max(blocks, default=-1) + 1, bt)
        todo = [b for b in blocks if b >= len(ws.hashes)]  # the others are stored (a fully cached prompt recomputes
        assert todo == list(range(len(ws.hashes), len(ws.hashes) + len(todo))), "blocks must be archived in order"
        positions = [self.view.blocks[b] if staged is None else staged[b] for b in todo]  # its last block)
        summaries = self._staged_summaries(positions) if staged is not None else [None] * len(positions)
        reads = [self.adapter.read_block(pos, bt) for pos in positions]
        for b, pos, kv, digest in zip(todo, positions, reads, self._digests(reads, positions, summaries)):
            self._put(
                ws, self._block_meta(ws.hashes[-1] if ws.hashes else ROOT_HASH, b, kv, tagged[b], pos, digest), kv
            )

    def _digests(
        self, reads: Sequence[BlockKV], positions: Sequence[int], summaries: Sequence[dict[str, np.ndarray] | None]
    ) -> Iterator[tuple[int, dict[str, Any]]]:
        """Each block's checksum and scoring summaries (those not in ``summaries`` already), in order. Where the
        model computes on a device (``caps.async_copies``), on ``ARCHIVE_WORKERS`` threads of the otherwise idle host
        (CRC32 and numpy release the GIL; ~10 ms of host work per 27B-shape block); on the CPU one after another,
        within the engine's threads."""
        work = [
            functools.partial(
                _digest, kv, functools.partial(self._summarize, kv, pos) if known is None else _known(known)
            )
            for kv, pos, known in zip(reads, positions, summaries)
        ]
        if len(work) < 2 or not self.adapter.caps.async_copies:
            return (job() for job in work)
        if self._archive_pool is None:
            self._archive_pool = ThreadPoolExecutor(ARCHIVE_WORKERS, thread_name_prefix="kvmem-archive")
        return (f.result() for f in [self._archive_pool.submit(job) for job in work])

    def _staged_summaries(self, positions: Sequence[int]) -> list[dict[str, np.ndarray] | None]:
        """The summaries the adapter computed for the blocks staged at view ``positions``, None where it did not."""
        if not isinstance(self.adapter, StagedSummaries):
            return [None] * len(positions)
        return [self.adapter.staged_summary(pos, self.layout.block_tokens) for pos in positions]

    def _stage(self, ws: Workspace, blocks: Sequence[int], mandatory: Sequence[Span]) -> dict[int, int]:
        """Archive ``blocks`` now, or, where the adapter stages reads (``caps.staged_reads``), take their reads
        now and return their positions, for ``_archive`` once the next forward is under way (its host work then
        overlaps the device's). Either way the store receives the same blocks in the same order."""
        if not self.adapter.caps.staged_reads:
            self._archive(ws, blocks, mandatory)
            return {}
        staged = {b: self.view.blocks[b] for b in blocks if b >= len(ws.hashes)}
        cast(StagedReads, self.adapter).stage_reads(list(staged.values()), self.layout.block_tokens)
        return staged

    def _block_meta(
        self,
        parent: str,
        b: int,
        kv: BlockKV,
        mandatory: bool,
        pos: int | None = None,
        digest: tuple[int, dict[str, Any]] | None = None,
    ) -> BlockMeta:
        """The meta of view block ``b`` (KV ``kv``, resident at its view position, or ``pos``) chained after
        ``parent``; ``digest``: its checksum and summaries when they are already computed (``_digests``)."""
        bt, pos = self.layout.block_tokens, self.view.blocks[b] if pos is None else pos
        ids = np.asarray(self.view.tokens[b * bt : (b + 1) * bt], dtype=np.int32)
        tags = frozenset({MANDATORY_TAG}) if mandatory else frozenset()
        checksum, summary = digest or _digest(kv, functools.partial(self._summarize, kv, pos))
        return BlockMeta(chain_hash(self.namespace, parent, ids), parent, ids, pos, checksum, summary, tags)

    def _put(self, ws: Workspace, meta: BlockMeta, kv: BlockKV) -> None:
        """Store a block at the end of ``ws`` and index it where ``ws`` has an index already: a step's new blocks
        are indexed as they are archived (on a GPU, while the next forward computes), not when it scores."""
        self.store.append(ws.id, meta, kv)
        self._counts["blocks_stored"] += 1
        if ws.id in self._indexes:
            self._indexes[ws.id].follow(self.store.meta(meta.chain_hash))

    def _load(
        self, blocks: Sequence[int], held: Mapping[int, tuple[BlockMeta, BlockKV]] | None = None
    ) -> list[tuple[BlockMeta, BlockKV]]:
        """Each of ``blocks``' meta and KV: from ``held`` (a probe's blocks, not stored yet), else from the store."""
        held = held or {}
        stored = [b for b in blocks if b not in held]
        if not stored:
            return [held[b] for b in blocks]
        assert self._view_ws is not None, "blocks load into a workspace's view"
        hashes = [self.store.workspaces[self._view_ws].hashes[b] for b in stored]
        result = self.store.complete_load(self.store.prepare_load(hashes))
        if result.missing:
            raise CorruptBlockError(
                f"{len(result.missing)} selected blocks failed their checks or are gone from the "
                "store; the step prefills them again"
            )
        loaded = {b: (self.store.meta(h), result.blocks[h]) for b, h in zip(stored, hashes)}
        return [held[b] if b in held else loaded[b] for b in blocks]

    # ---- the query window: replayed, or probed -----------------------------------------------

    def _replay_start(self, cfg: KVMemConfig, prompt: Prompt) -> int:
        """First token replayed against the selected view: the query, the recent window, at most MAX_QUERY_TOKENS."""
        n = len(prompt.tokens)
        return min(max(prompt.query_start, n - cfg.recent_tokens, n - MAX_QUERY_TOKENS), n - 1)

    def _replay(self, r0: int) -> np.ndarray:
        """Recompute tokens ``r0:`` of the view in place so they attend to the new history."""
        v, bt = self.view, self.layout.block_tokens
        p0 = v.tail_pos + r0 - v.tail_start if r0 >= v.tail_start else v.blocks[r0 // bt] + r0 % bt
        tokens = v.tokens[r0:]
        self.adapter.drop(p0, v.next_pos)
        if self.checkpoints is not None:
            self.checkpoints.restore(v.token_array()[:r0])
        out = self.adapter.forward(tokens, list(range(p0, p0 + len(tokens))))
        assert out.logits is not None
        return out.logits

    def _probe_plan(self, cfg: KVMemConfig, mode: str, prompt: Prompt, cached: int) -> Probe | None:
        """The probe of a step that prefills ``prompt.tokens[cached:]``, where it is exact and saves work: the adapter
        stops forwards early, retrieval-heads scoring (it reads only its heads' layers) with heads above the last
        layer, no recurrent state, and original positions (held blocks stay where they are) or an adapter that
        moves blocks (``MovedBlocks``: compaction moves held blocks, which are stored at their probed positions).
        It covers the query window's part in the last prefill chunk (room is made once per chunk, before anything
        is held, so no held block is dropped). None otherwise: prefill and replay as before."""
        heads = cfg.retrieval_heads or self.heads
        if (
            not self.adapter.caps.probe
            or self.checkpoints is not None
            or (mode != "original" and not isinstance(self.adapter, MovedBlocks))
            or not heads
            or cfg.scorer != "retrieval-heads"
        ):
            return None
        stop, n = max(layer for layer, _ in (*heads, *self.heads)), len(prompt.tokens)  # summaries index self.heads
        start = max(self._replay_start(cfg, prompt), chunk_cuts(cached, n, self._prefill_chunk(cfg))[-2])
        return Probe(start, stop) if stop < self.layout.n_layers - 1 else None

    def _hold(self, probe: Probe, blocks: Sequence[int]) -> None:
        """Keep the probed KV of the blocks a probe chunk completed (they are stored after the full forward)."""
        for b in blocks:
            probe.held[b] = self.adapter.read_block(self.view.blocks[b], self.layout.block_tokens)

    def _held_blocks(
        self, ws: Workspace, probe: Probe, mandatory: Sequence[Span]
    ) -> dict[int, tuple[BlockMeta, BlockKV]]:
        """The held blocks not stored yet, by view block in order, each with its meta chained after the stored
        ones: what selection sees of them (their summaries' retrieval-head keys are the stored ones' to be; deeper
        layers are not read) and the probed KV a view loads them from."""
        todo = sorted(b for b in probe.held if b >= len(ws.hashes))
        assert todo == list(range(len(ws.hashes), len(ws.hashes) + len(todo))), "held blocks follow the stored ones"
        tagged = overlapping(mandatory, max(todo, default=-1) + 1, self.layout.block_tokens)
        out: dict[int, tuple[BlockMeta, BlockKV]] = {}
        parent = ws.hashes[-1] if ws.hashes else ROOT_HASH
        for b in todo:
            meta = self._block_meta(parent, b, probe.held[b], tagged[b])
            out[b], parent = (meta, probe.held[b]), meta.chain_hash
        return out

    def _store_held(self, ws: Workspace, probe: Probe, held: Mapping[int, tuple[BlockMeta, BlockKV]]) -> None:
        """Store the ``held`` blocks once the full forward has computed their deeper layers (``merge_layers``), at
        the positions they were probed at (their summaries' and the store's; compaction may have moved them since)."""
        for b, (meta, probed) in held.items():
            assert len(ws.hashes) == b, "held blocks follow the stored ones"
            pos = self.view.blocks[b]
            deep = deep_layers(self.adapter.read_block(pos, self.layout.block_tokens), probe.stop_after)
            if pos != meta.start_pos:  # only the layers the probe did not compute move back
                deep = cast(MovedBlocks, self.adapter).moved(deep, pos, meta.start_pos)
            kv = merge_layers(probed, deep, probe.stop_after)
            self._put(
                ws, dataclasses.replace(meta, checksum=kv.checksum(), summary=self._summarize(kv, meta.start_pos)), kv
            )
