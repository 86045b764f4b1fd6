"""``DecodeOps``: the decode phase of a ``KVMemEngine`` step (a mixin; the engine supplies the view, the adapter,
``_archive``, ``_make_room`` and ``_mode``).

Tokens are sampled into the generation reserve one at a time, or, for greedy steps where it is lossless, with
drafts (prompt lookup or the model's MTP layers) verified in one forward (``kvmem_core.speculative``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable, Sequence, cast

import numpy as np

from kvmem_core.adapter import EngineAdapter
from kvmem_core.config import KVMemConfig
from kvmem_core.contract import OnText, SamplingParams
from kvmem_core.draft_budget import ForwardCosts
from kvmem_core.reasoning import Thinking
from kvmem_core.sampling import decode
from kvmem_core.speculative import ViewVerifier, speculative_advance
from kvmem_core.step import ViewState, append_computed
from kvmem_core.structured import Formats
from kvmem_core.workspace import Workspace


class DecodeOps:
    """The decode phase; mixed into ``KVMemEngine``."""

    adapter: EngineAdapter
    view: ViewState
    formats: Formats
    last_logits: np.ndarray | None
    decode_alive: Callable[[], bool] | None
    forward_costs: ForwardCosts  # the engine's timed forwards by row count, for lookup's draft lengths

    if TYPE_CHECKING:  # the engine's, which this phase calls

        def _mode(self, cfg: KVMemConfig) -> str: ...
        def _archive(self, ws: Workspace, blocks: Sequence[int]) -> None: ...
        def _make_room(self, cfg: KVMemConfig, mode: str, n: int) -> None: ...

    def _decode(
        self,
        cfg: KVMemConfig,
        ws: Workspace,
        sampling: SamplingParams,
        logits: np.ndarray,
        on_text: OnText,
        steer: Thinking | None,
        history: Sequence[int] | np.ndarray,
    ) -> tuple[str, list[int], str, list[int], dict[str, int]]:
        """Sample into the generation reserve (``steer`` ends think blocks on budget); every decoded token joins
        the workspace (commit). Returns the text, ids, finish reason and the blocks completed but not yet
        archived: exporting a block is kept off the token path (the caller archives them once the answer is out),
        except where the view must make room, which drops only archived blocks; and the tokens drafted and accepted
        (empty unless ``cfg.speculative`` drafted: lookup from ``history``, the transcript, or mtp from the model's
        MTP layers, where that is lossless: ``kvmem_core.speculative``)."""
        self.last_logits = logits.copy()  # the adapter's logits live until its next forward
        mode, adapter = self._mode(cfg), self.adapter
        pending: list[int] = []

        def room(n: int) -> int:
            if adapter.view_free() < n:
                self._archive(ws, pending)
                pending.clear()
                self._make_room(cfg, mode, n)
            return adapter.view_free()

        def advance(token: int) -> Callable[[], np.ndarray]:
            room(1)
            out = adapter.forward([token], [self.view.next_pos])
            pending.extend(append_computed(self.view, [token]))
            return lambda: cast(np.ndarray, out.logits)  # asked for: never None

        constraint = self.formats.constraint(sampling, logits.size)
        spec = speculative_advance(
            cfg.speculative,
            adapter,
            sampling,
            constraint is not None,
            history,
            lambda: ViewVerifier(adapter, self.view, room, pending),
            self.forward_costs,
        )
        try:
            text, ids, finish = decode(
                sampling,
                logits,
                adapter.token_bytes,
                adapter.is_eog,
                spec or advance,
                on_text,
                steer,
                constraint,
                self.decode_alive,
            )
        finally:
            if spec is not None:
                spec.close()
        drafts = {} if spec is None else {"draft_tokens": spec.stats.drafted, "draft_accepted": spec.stats.accepted}
        return text, ids, finish, pending, drafts
