"""Where a KVMem turn's time to first token goes, phase by phase (``kvmem bench speed --backend torch``).

``PhaseClock`` wraps one engine's step phases (instance attributes over its bound methods, as
``speed_llamacpp.ForwardClock`` wraps the adapter's ``forward``) and times, up to the first decoded
token of every step: materialization (``_materialize``: the streaming view before the prefill, room made
during it, the selected view after it), archiving (``_archive``: completed blocks copied out and stored),
recurrent-state checkpoints (taken and restored) and the ``_select`` phase as a whole. On a GPU every timed
call, and every forward of several tokens, ends with the device idle (pending block copies and kernels
waited for), so work queued by one phase is not billed to the next; the engine's own forwards wait for the
previous one's work when they start, so the syncs cost a prefill little. One-token forwards (decode) are
left alone. ``phase_figures`` turns a step's record and the forward clock's split into a point's keys.
"""
from __future__ import annotations

import time
from typing import Any, Callable

import torch

from kvmem_bench.speed_common import ratio

TIMED = {"_materialize": "materialize_s", "_archive": "archive_s", "_select": "select_phase_s"}
# the goal for selection + replay + materialization, as a share of TTFT: 10% up to 64K tokens, 15% past
SHARE_GOALS = ((131072, 0.10), (1 << 62, 0.15))


class PhaseClock:
    """Seconds per phase of each step's time to first token; ``records``: (prompt tokens, phases) per step."""

    def __init__(self, engine: Any) -> None:
        self.records: list[tuple[int, dict[str, float]]] = []
        self._phases: dict[str, float] = {}
        self._active = False
        self._in_select = False
        adapter = engine.adapter
        self._stager = getattr(adapter, "stager", None)
        self._cuda = getattr(getattr(adapter, "model", None), "device", torch.device("cpu")).type == "cuda"
        for name, key in TIMED.items():
            setattr(engine, name, self._timed(getattr(engine, name), key))
        if engine.checkpoints is not None:
            for name in ("take", "restore"):
                setattr(engine.checkpoints, name, self._timed(getattr(engine.checkpoints, name), "checkpoint_s"))
        adapter.forward = self._settled(adapter.forward)
        engine._decode = self._until_decode(engine._decode)
        engine.step = self._recorded(engine.step)

    def for_prompt(self, prompt_tokens: int) -> dict[str, float]:
        """The phases of the first step whose prompt had ``prompt_tokens`` tokens (a measured turn; the repeats
        of it that time decode come after it)."""
        return next(phases for n, phases in self.records if n == prompt_tokens)

    def _settle(self) -> None:
        """Wait for the device: copies queued by the stager, then every kernel."""
        if self._cuda:
            if self._stager is not None:
                self._stager.wait()
            torch.cuda.synchronize()

    def _timed(self, fn: Callable[..., Any], key: str) -> Callable[..., Any]:
        def timed(*args: Any, **kwargs: Any) -> Any:
            if not self._active:
                return fn(*args, **kwargs)
            outer = key == "select_phase_s"
            self._in_select |= outer
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self._settle()
                sec = time.perf_counter() - t0
                self._phases[key] = self._phases.get(key, 0.0) + sec
                if self._in_select and not outer:
                    self._phases["select_inner_s"] = self._phases.get("select_inner_s", 0.0) + sec
                self._in_select &= not outer
        return timed

    def _settled(self, forward: Callable[..., Any]) -> Callable[..., Any]:
        def settled(tokens: Any, *args: Any, **kwargs: Any) -> Any:
            out = forward(tokens, *args, **kwargs)
            if self._active and len(tokens) > 1:
                self._settle()
            return out
        return settled

    def _until_decode(self, decode: Callable[..., Any]) -> Callable[..., Any]:
        def until(*args: Any, **kwargs: Any) -> Any:
            self._active = False
            return decode(*args, **kwargs)
        return until

    def _recorded(self, step: Callable[..., Any]) -> Callable[..., Any]:
        def recorded(*args: Any, **kwargs: Any) -> Any:
            self._phases, self._active, self._in_select = {}, True, False
            try:
                result = step(*args, **kwargs)
            finally:
                self._active = False
            self.records.append((result.prompt_tokens, self._phases))
            return result
        return recorded


def phase_figures(point: dict[str, Any], phases: dict[str, float]) -> dict[str, Any]:
    """A point's TTFT split (seconds and shares of ``reuse_ttft_s``): ``suffix_forward_s`` (the forwards that
    compute the new tokens once), ``selection_s`` (the select phase less its materialization, checkpoint
    restore and replay: index sync, scoring, top-k), ``replay_s``, ``materialize_s``, ``archive_s`` and
    ``checkpoint_s`` (all of the turn's, before and after the prefill), ``host_other_s`` (the rest: prompt
    rendering and tokenizing, the prefix match, ...), ``engine_prefill_tok_s`` (new tokens over the suffix
    forwards), and ``select_replay_materialize_share`` with its goal (``SHARE_GOALS``)."""
    ttft, replay = point["reuse_ttft_s"], point.get("replay_s", 0.0)
    forward = ttft - point["overhead_s"]
    select = point["select_s"] - phases.get("select_inner_s", 0.0) - replay
    parts = {"suffix_forward_s": forward, "selection_s": max(0.0, select), "replay_s": replay,
             "materialize_s": phases.get("materialize_s", 0.0), "archive_s": phases.get("archive_s", 0.0),
             "checkpoint_s": phases.get("checkpoint_s", 0.0)}
    parts["host_other_s"] = max(0.0, ttft - sum(parts.values()))
    out: dict[str, Any] = {"phases": parts, "phase_shares": {k[:-2]: ratio(v, ttft) for k, v in parts.items()}}
    share = ratio(parts["selection_s"] + replay + parts["materialize_s"], ttft)
    limit = next(goal for size, goal in SHARE_GOALS if point["workspace_tokens"] < size)
    out.update(engine_prefill_tok_s=ratio(point["prefill_tokens"], forward), select_replay_materialize_share=share,
               select_replay_materialize_goal=limit)
    return out
