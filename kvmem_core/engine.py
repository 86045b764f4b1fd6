"""``KVMemEngine``: one KVMem step per request over any ``EngineAdapter``.

Render and tokenize, match the stored workspace, prefill the new suffix in chunks while
archiving completed blocks, select blocks for the query, materialize them, replay the
query, decode into the generation reserve, commit. When the whole prompt fits in the
budget nothing is selected or replayed, so the result equals the plain engine's. Where the
adapter can, the query window is probed rather than prefilled and replayed
(``kvmem_core.archive``): the same selection for less compute.
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from typing import Any, Callable, Mapping, Sequence

import numpy as np

from kvmem_core.adapter import EngineAdapter, StagedSummaries
from kvmem_core.checkpoints import Checkpoints
from kvmem_core.config import KVMemConfig, check_heads
from kvmem_core.contract import OnStart, OnText, StepRequest, StepResult
from kvmem_core.decoding import DecodeOps
from kvmem_core.archive import ArchiveOps, Probe
from kvmem_core.draft_budget import ForwardCosts
from kvmem_core.errors import CorruptBlockError
from kvmem_core.groups import Span, block_groups, overlapping
from kvmem_core.layout import BlockKV, BlockMeta
from kvmem_core.prompt import Prompt, admit, build_prompt, check_request
from kvmem_core.reasoning import thinking_for
from kvmem_core.retrieval import (
    BlockIndex,
    BlockScores,
    BlockSpans,
    QueryFeatures,
    Selector,
    StoredSpans,
    SummaryOptions,
    make_scorer,
)
from kvmem_core.planner import ViewBlock, ViewEntry, plan_view
from kvmem_core.prefill import PrefillOps
from kvmem_core.sampling import within
from kvmem_core.speculative import check_mode
from kvmem_core.step import ViewState, materialize, refill, reset, truncate
from kvmem_core.store import BlockStore
from kvmem_core.structured import Formats
from kvmem_core.workspace import Route, Workspace
from kvmem_core.workspace_ops import WorkspaceOps

log = logging.getLogger("kvmem.engine")
MAX_RECOMPUTES = 16  # a step starts over at most this often for lost blocks; each time the store lost one more


class KVMemEngine(ArchiveOps, PrefillOps, DecodeOps, WorkspaceOps):
    """A loaded adapter plus KVMem memory; implements ``kvmem_core.contract.Engine`` (its workspace calls come
    from ``WorkspaceOps``, its prefill from ``PrefillOps``, its decode phase from ``DecodeOps``).

    ``heads`` are the retrieval heads (layer, query head) whose full keys every stored
    block indexes. ``last_logits`` holds the logits the first generated token of the last
    step was sampled from (tests and benchmarks compare them).
    """

    def __init__(
        self,
        adapter: EngineAdapter,
        config: KVMemConfig,
        *,
        heads: Sequence[tuple[int, int]] = (),
        store: BlockStore | None = None,
    ) -> None:
        config.validate_view(adapter.caps.max_view_tokens)
        config = config.sized_to(adapter.layout)
        check_mode(config.speculative, adapter)
        self.adapter, self.config, self.layout = adapter, config, adapter.layout
        self.model_id = adapter.model_id
        self.heads = tuple(config.retrieval_heads or heads)
        check_heads(self.heads, adapter.layout)  # at load: a bad head would otherwise fail every request
        self.store = store or BlockStore.from_config(config, adapter.layout)
        self.namespace = f"{adapter.fingerprint}:{adapter.layout.layout_hash()}"
        self.view = ViewState(adapter.layout.block_tokens)
        adapter.clear_view()
        self.checkpoints = (
            Checkpoints.open(adapter, config.nvme_dir, self.namespace, self.store)
            if adapter.caps.recurrent_state
            else None
        )
        self.summary_opts = SummaryOptions.for_layout(adapter.layout, prototypes=config.scorer == "key-direction")
        if isinstance(adapter, StagedSummaries):
            adapter.summarize_staged(self.heads, self.summary_opts)
        self.last_logits: np.ndarray | None = None
        self.formats = Formats(adapter)
        self.prefill_progress: Callable[[int, int], None] | None = None  # (done, total) after each chunk
        self.decode_alive: Callable[[], bool] | None = None  # after each decoded token; False: the client left
        self.forward_costs = ForwardCosts()
        self._indexes: dict[str, BlockIndex] = {}
        self._stored_spans: dict[str, StoredSpans] = {}
        self._view_ws: str | None = None
        self._counts: Counter[str] = Counter(
            blocks_recomputed=0, blocks_loaded=0, blocks_dropped=0, blocks_moved=0, draft_tokens=0, draft_accepted=0
        )  # listed from the start

    # ---- the Engine contract ------------------------------------------------------------

    def tokenize(self, text: str) -> list[int]:
        return self.adapter.tokenize(text)

    def count_tokens(self, request: StepRequest) -> int:
        """Prompt tokens ``request`` renders to (what ``step`` would report as ``prompt_tokens``)."""
        check_request(request, self.config)
        return len(build_prompt(self.adapter, request).tokens)

    def step(self, request: StepRequest, on_text: OnText, on_start: OnStart | None = None) -> StepResult:
        """Run one KVMem step (see module docstring); stream text through ``on_text``; ``on_start`` learns
        the workspace id once the prefix match has chosen it.

        Bad input raises a ``KVMemError`` before anything changes. A stored block (or recurrent
        checkpoint) found lost before decoding is recomputed: the store cuts the workspace back
        to the blocks before it and the step starts over, prefilling from there
        (``blocks_recomputed``). A step that fails otherwise empties the view (stored blocks
        stay), so the next step starts from a known state.
        """
        t0 = time.perf_counter()  # the step's clock includes rendering and tokenizing
        cfg, prompt, oracle = admit(self.adapter, self.config, request, bool(self.summary_opts.prototypes))
        attempt = 0
        while True:
            try:
                return self._run(cfg, prompt, request, on_text, None if attempt else on_start, oracle, t0)
            except CorruptBlockError as exc:
                self._abandon()
                lost = self._take_store_events()
                self._counts["blocks_recomputed"] += lost
                attempt += 1
                if attempt > MAX_RECOMPUTES:
                    raise
                log.warning("the step starts over to recompute %d lost blocks: %s", lost, exc)
            except BaseException:
                self._abandon()
                raise

    def _abandon(self) -> None:
        reset(self.view, self.adapter)
        self._view_ws = None

    def _take_store_events(self) -> int:
        """Drop the engine-side state of workspaces the store evicted; return how many blocks it found lost."""
        events = self.store.take_events()
        self._forget(*(e["workspace"] for e in events if e["event"] == "evicted_workspace"))
        return sum(e["event"] == "corrupt_block" for e in events)

    def _run(
        self,
        cfg: KVMemConfig,
        prompt: Prompt,
        request: StepRequest,
        on_text: OnText,
        on_start: OnStart | None,
        oracle: Sequence[int] | None,
        t0: float,
    ) -> StepResult:
        fits = len(prompt.tokens) <= cfg.budget
        scoring = not fits and cfg.method == "retrieval" and oracle is None
        limit = min(len(prompt.tokens) - 1, prompt.query_from if scoring else len(prompt.tokens))
        if not scoring and self.view.replayed_from is not None:  # that KV saw a selection, not this step's view
            limit = min(limit, self.view.replayed_from)
        ws, cached = self._open(prompt, limit, Route(request.cache_key, request.workspace_id))
        if on_start is not None:
            on_start(ws.id)
        mode = self._mode(cfg)
        self._setup_view(cfg, mode, fits, cached)
        probe = self._probe_plan(cfg, mode, prompt, cached) if scoring else None
        logits, queries = self._prefill(cfg, mode, fits, ws, prompt, cached, probe)
        t1 = time.perf_counter()
        selection: dict[str, Any] = {"method": "full" if fits else cfg.method, "position_mode": mode}
        if not fits:
            logits, selection = self._select(cfg, mode, ws, prompt, queries, logits, oracle, probe)
        t2 = time.perf_counter()
        steer = thinking_for(self.adapter, request, prompt.tokens)
        sampling = within(request.sampling, min(cfg.ctx - len(prompt.tokens), self.adapter.caps.trained_ctx))
        text, ids, finish, completed, drafts = self._decode(cfg, ws, sampling, logits, on_text, steer, prompt.tokens)
        t3 = time.perf_counter()
        self._archive(ws, completed)
        if self.checkpoints is not None:
            self.checkpoints.take(self.view.token_array(), ws.id)
        self.store.set_selection(ws.id, selection)
        self._take_store_events()
        t4 = time.perf_counter()
        timings = {
            "prefill_s": t1 - t0,
            "select_s": t2 - t1,
            "decode_s": t3 - t2,
            "archive_s": t4 - t3,
            "prefill_tokens": float(len(prompt.tokens) - cached),
            "decode_tokens": float(len(ids)),
            "reasoning_tokens": float(steer.spent if steer else 0),
            **{k: float(v) for k, v in drafts.items()},
        }
        self._counts.update(
            steps=1,
            prompt_tokens=len(prompt.tokens),
            cached_tokens=cached,
            decode_tokens=len(ids),
            prefill_seconds=timings["prefill_s"],
            decode_seconds=timings["decode_s"],
            **drafts,
        )
        return StepResult(text, tuple(ids), finish, len(prompt.tokens), cached, ws.id, selection, timings)

    @property
    def chat_template(self) -> str:
        return self.adapter.chat_template

    def metrics(self) -> dict[str, float]:
        out = {f"store_{k}": float(v) for k, v in self.store.metrics().items()}
        out.update({k: float(v) for k, v in self._counts.items()})
        return out

    def close(self) -> None:
        if self._archive_pool is not None:
            self._archive_pool.shutdown()
        if self.checkpoints is not None:
            self.checkpoints.close()
        self.store.close()
        self.adapter.close()

    # ---- step phases --------------------------------------------------------------------

    def _mode(self, cfg: KVMemConfig) -> str:
        """``cfg.positions``; ``auto`` is compact: within the trained context too, the default model answers better
        from a renumbered view than from one with the gaps of the original positions (docs/benchmarks.md)."""
        return "compact" if cfg.positions == "auto" else cfg.positions

    def _open(self, prompt: Prompt, limit: int, route: Route) -> tuple[Workspace, int]:
        """Match stored blocks and the view; keep what is reusable; return (workspace, cached tokens).
        ``route`` places the step in a keyed or preferred workspace (``kvmem_core.workspace``).

        At most ``limit`` tokens count as cached: a step that scores recomputes its query,
        even when the same prompt was seen before, so the query features come from it.

        Hybrid models also need the recurrent state after the cached tokens: their checkpoint,
        or the latest earlier one (then fewer tokens count as cached and the rest is prefilled).
        """
        live = self.view.token_array()  # the tokens the recurrent state has consumed (read-only)
        ids = prompt.tokens
        ws, match = self.store.open_workspace(self.namespace, ids, route)
        bt, hit = self.layout.block_tokens, match.matched_blocks
        reuse = min(self.view.common_prefix(ids), hit * bt + bt - 1, limit)
        if reuse >= hit * bt:
            cached = truncate(self.view, self.adapter, reuse)
        else:
            truncate(self.view, self.adapter, reuse // bt * bt)
            cached = min(hit * bt, limit // bt * bt)
            self.view.assign(ids[:cached].tolist(), ids[:cached])  # blocks past the view's prefix load from the store
        self._view_ws = ws.id
        if self.checkpoints is not None:
            cached = self.checkpoints.resume(live, ids, cached, lambda m: truncate(self.view, self.adapter, m))
            self.checkpoints.take(ids[:cached], ws.id)
        return ws, cached

    def _materialize(
        self,
        mode: str,
        target: Sequence[int],
        n_blocks: int,
        held: Mapping[int, tuple[BlockMeta, BlockKV]] | None = None,
    ) -> int:
        """Make the view hold ``target`` blocks at their ``mode`` positions, the tail right after; blocks that load
        come from ``held`` (a probe's, not stored yet) or the store."""
        bt = self.layout.block_tokens
        current = [ViewEntry(str(b), p, bt) for b, p in self.view.blocks.items()]
        plan = plan_view(current, [ViewBlock(str(b), b * bt, bt) for b in target], mode)
        positions = {int(e.block_id): e.pos for e in plan.slots}
        tail_pos = n_blocks * bt if mode == "original" else plan.next_pos
        loaded, dropped, moved = materialize(
            self.view, self.adapter, positions, tail_pos, lambda bs: self._load(bs, held)
        )
        self._counts.update(blocks_loaded=loaded, blocks_dropped=dropped, blocks_moved=moved)
        return loaded + dropped + moved

    def _select(
        self,
        cfg: KVMemConfig,
        mode: str,
        ws: Workspace,
        prompt: Prompt,
        queries: np.ndarray | None,
        logits: np.ndarray | None,
        oracle: Sequence[int] | None,
        probe: Probe | None = None,
    ) -> tuple[np.ndarray, dict[str, Any]]:
        """Score and select blocks, materialize them, replay the query; return its logits and the selection.
        A ``probe``'s held blocks are candidates as the stored ones are, and stored once the window is computed."""
        metas = self.store.workspace_view(ws.id)
        stored, held = len(metas), self._held_blocks(ws, probe, prompt.mandatory) if probe is not None else {}
        metas = metas.plus([meta for meta, _ in held.values()])
        n, bt = len(prompt.tokens), self.layout.block_tokens
        scores, method = None, cfg.method
        if oracle is not None:
            scores, method = (
                BlockScores(np.isin(np.arange(len(metas)), oracle) * 1.0, np.full(len(metas), -1)),
                "retrieval",
            )
        elif cfg.method == "retrieval":
            assert queries is not None, "retrieval needs the query's features"
            index = self._index(ws.id, metas)
            scorer = self._scorer(cfg.scorer, cfg.retrieval_heads or self.heads)
            try:
                scores = scorer.score(QueryFeatures(queries, self.layout.n_kv_heads), index)
            finally:
                index.truncate(stored)  # held summaries are the probe's: the stored ones are indexed next step
        r0 = self._replay_start(cfg, prompt)
        kept = self.checkpoints.replay_from(prompt.tokens, r0, cfg.recurrent) if self.checkpoints is not None else r0
        recompute = kept is None
        r0 = r0 if recompute else kept
        spans = self._spans(cfg, prompt, ws.id, metas, ((r0 - 1, r0),) if r0 > 0 and not recompute else ())
        sel = Selector.from_config(cfg).select(spans, scores, n - len(metas) * bt, method)
        target = sorted(set(sel.blocks) | set(range(r0 // bt, len(metas))))  # the replayed tokens stay resident
        changed = self._materialize(mode, target, len(metas), held)
        replayed = n - r0 if changed else 0
        if recompute:
            logits = refill(self.view, self.adapter, lambda: self.checkpoints.restore(()))
            replayed = len(self.view.blocks) * bt + self.view.next_pos - self.view.tail_pos
            self.view.replayed_from = 0
        elif changed or probe is not None:  # a probed window is computed in full only now
            logits = self._replay(r0)
            if changed:
                self.view.replayed_from = r0
        if probe is not None:
            self._store_held(ws, probe, held)
        out = {
            **sel.to_dict(),
            "position_mode": mode,
            "replayed_tokens": replayed,
            "candidate_blocks": len(metas),
            "groups": cfg.groups,
            "probed_tokens": n - probe.start if probe else 0,
        }
        if self.checkpoints is not None:
            out["recurrent"] = "recompute" if recompute else "keep"
        if oracle is not None:
            out["oracle_blocks"] = sorted(oracle)
        return logits, out

    def _spans(
        self, cfg: KVMemConfig, prompt: Prompt, ws_id: str, metas: Sequence[BlockMeta], keep: Sequence[Span]
    ) -> BlockSpans:
        """The stored blocks' spans plus this step's: mandatory ranges (system, tool definitions, pinned
        messages, ``keep``; stored tags know only what was mandatory when a block was stored) and, with
        ``cfg.groups``, the message groups of the transcript (``kvmem_core.groups``). ``keep`` holds the token
        before the replay start: the replay's first position must follow a resident one (llama.cpp rejects a
        forward that does not continue its sequence), and when the replay starts on a block edge the recent
        window does not hold that token."""
        n, bt = len(metas), self.layout.block_tokens
        turns = block_groups(prompt.groups, n, bt) if cfg.groups else None
        mandatory = overlapping([*prompt.mandatory, *prompt.pinned, *keep], n, bt)
        return self._stored_spans.setdefault(ws_id, StoredSpans()).spans(metas).for_step(mandatory, turns)

    def _scorer(self, name: str, heads: Sequence[tuple[int, int]]) -> Any:
        """The adapter's own scorer for ``name`` (``make_scorer``, e.g. on its GPU), else the core's."""
        own = getattr(self.adapter, "make_scorer", None)
        return (own(name, heads) if own else None) or make_scorer(name, heads, key_source=self)

    def content_keys(self, block_hash: str) -> np.ndarray:
        """Pre-RoPE keys of a stored block (the ``per-token`` scorer's key source; loads its KV)."""
        kv = self.stored_kv(block_hash)
        return self.adapter.content_keys(kv.k, self.store.lookup(block_hash).start_pos)

    def _index(self, ws_id: str, metas: Sequence[BlockMeta]) -> BlockIndex:
        """``ws_id``'s index holding ``metas``; reserved for a whole ``--ctx`` workspace (it never copies itself)."""
        if ws_id not in self._indexes:
            bt = self.layout.block_tokens
            self._indexes[ws_id] = BlockIndex(bt)
            self._indexes[ws_id].reserve(-(-self.config.ctx // bt))
        index = self._indexes[ws_id]
        index.sync(metas)
        return index
