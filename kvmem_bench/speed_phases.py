"""Where a KVMem turn's time to first token goes, phase by phase (``kvmem bench speed --backend torch``).

``PhaseClock`` wraps one engine's step phases (instance attributes over its bound methods, as
``speed_session.ForwardClock`` wraps the adapter's ``forward``) and times, up to the first decoded token of
every step: the prefill and select phases as wholes (``_prefill``, ``_select``), materialization
(``_materialize``: the streaming view before the prefill, room made during it, the selected view after it),
recurrent-state checkpoints (taken and restored), and the host time of archiving (``_archive``; on a GPU it
overlaps the next chunk's forward). Forwards and archiving are left as the engine runs them, so the turn's TTFT
is the product's; materialization and checkpoints end with the device idle (their copies waited for), so what
they queue is billed to them. ``phase_figures`` turns a step's record and the forward clock's replay into a
point's keys.
"""

from __future__ import annotations

import time
from typing import Any, Callable

import torch

from kvmem_bench.speed_common import ratio

OUTER = {"_prefill": "prefill_phase_s", "_select": "select_phase_s"}
INNER = {"_materialize": "materialize_s"}
# the goal for selection + replay + materialization, as a share of TTFT: 10% up to 64K tokens, 15% past
SHARE_GOALS = ((131072, 0.10), (1 << 62, 0.15))


class PhaseClock:
    """Seconds per phase of each step's time to first token; ``records``: (prompt tokens, phases) per step. A
    phase inside the prefill or select phase is also counted under ``inner_<outer key>``."""

    def __init__(self, engine: Any) -> None:
        self.records: list[tuple[int, dict[str, float]]] = []
        self._phases: dict[str, float] = {}
        self._active = False
        self._outer: str | None = None
        adapter = engine.adapter
        self._stager = getattr(adapter, "stager", None)
        self._cuda = getattr(getattr(adapter, "model", None), "device", torch.device("cpu")).type == "cuda"
        for name, key in OUTER.items():
            setattr(engine, name, self._timed(getattr(engine, name), key, outer=True))
        for name, key in INNER.items():
            setattr(engine, name, self._timed(getattr(engine, name), key, settle=True))
        engine._archive = self._timed(engine._archive, "archive_s")
        if engine.checkpoints is not None:
            for name in ("take", "restore"):
                setattr(
                    engine.checkpoints,
                    name,
                    self._timed(getattr(engine.checkpoints, name), "checkpoint_s", settle=True),
                )
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

    def _add(self, key: str, sec: float) -> None:
        self._phases[key] = self._phases.get(key, 0.0) + sec

    def _timed(self, fn: Callable[..., Any], key: str, outer: bool = False, settle: bool = False) -> Callable[..., Any]:
        def timed(*args: Any, **kwargs: Any) -> Any:
            if not self._active:
                return fn(*args, **kwargs)
            around = self._outer
            if outer:
                self._outer = key
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                if settle or outer:
                    self._settle()
                sec = time.perf_counter() - t0
                self._outer = around
                self._add(key, sec)
                if around is not None and key != "archive_s":  # archiving stays in the prefill's own time
                    self._add(f"inner_{around}", sec)

        return timed

    def _until_decode(self, decode: Callable[..., Any]) -> Callable[..., Any]:
        def until(*args: Any, **kwargs: Any) -> Any:
            self._active = False
            return decode(*args, **kwargs)

        return until

    def _recorded(self, step: Callable[..., Any]) -> Callable[..., Any]:
        def recorded(*args: Any, **kwargs: Any) -> Any:
            self._phases, self._active, self._outer = {}, True, None
            try:
                result = step(*args, **kwargs)
            finally:
                self._active = False
            self.records.append((result.prompt_tokens, self._phases))
            return result

        return recorded


def phase_figures(point: dict[str, Any], phases: dict[str, float]) -> dict[str, Any]:
    """A point's TTFT split (seconds, and shares of ``reuse_ttft_s``), the parts adding up to it:
    ``suffix_prefill_s`` (the prefill phase less its materialization and checkpoints: the new tokens' forwards
    with whatever archiving they do not hide), ``selection_s`` (the select phase less its materialization,
    checkpoint restore and replay: index sync, scoring, top-k), ``replay_s``, ``materialize_s``, ``checkpoint_s``
    and ``host_other_s`` (the rest: prompt rendering and tokenizing, the prefix match, ...); besides them
    ``archive_host_s`` (the host's time in archiving, inside ``suffix_prefill_s``), ``engine_prefill_tok_s``
    (new tokens over ``suffix_prefill_s``), and ``select_replay_materialize_share`` with its goal
    (``SHARE_GOALS``)."""
    ttft, replay = point["reuse_ttft_s"], point.get("replay_s", 0.0)
    prefill = phases.get("prefill_phase_s", 0.0) - phases.get("inner_prefill_phase_s", 0.0)
    select = phases.get("select_phase_s", 0.0) - phases.get("inner_select_phase_s", 0.0) - replay
    parts = {
        "suffix_prefill_s": prefill,
        "selection_s": max(0.0, select),
        "replay_s": replay,
        "materialize_s": phases.get("materialize_s", 0.0),
        "checkpoint_s": phases.get("checkpoint_s", 0.0),
    }
    parts["host_other_s"] = max(0.0, ttft - sum(parts.values()))
    out: dict[str, Any] = {
        "phases": parts,
        "phase_shares": {k[:-2]: ratio(v, ttft) for k, v in parts.items()},
        "archive_host_s": phases.get("archive_s", 0.0),
    }
    share = ratio(parts["selection_s"] + replay + parts["materialize_s"], ttft)
    limit = next(goal for size, goal in SHARE_GOALS if point["workspace_tokens"] < size)
    out.update(
        engine_prefill_tok_s=ratio(point["prefill_tokens"], prefill),
        select_replay_materialize_share=share,
        select_replay_materialize_goal=limit,
    )
    return out
