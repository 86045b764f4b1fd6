"""The two boundaries every backend meets.

``Engine`` is what the engine process serves (the server and CLI talk only to it): one
KVMem step per request, token text streamed through a callback, workspace inspection.
``EngineAdapter`` is what an engine binding (llama.cpp, torch) implements so that the
backend-neutral step in ``kvmem_core`` can drive it; it is modelled on llama.cpp's
memory interface (plan, then apply) and vLLM's KV connector (batched, two-phase).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Protocol, runtime_checkable

from kvmem_core.config import KVMemConfig


@dataclass(frozen=True)
class SamplingParams:
    """Decoding knobs; ``temperature == 0`` is greedy. ``top_k == 0`` disables top-k. ``max_tokens`` None:
    until the model stops, the workspace is full (``--ctx`` less the prompt) or the answer is as long as the model's
    trained context. ``grammar``: Lark text (llguidance's dialect) the answer must follow, from its start or, with
    ``grammar_trigger``, from each place the text ends with the trigger (``kvmem_core.structured``)."""

    temperature: float = 0.8
    top_p: float = 0.95
    top_k: int = 40
    seed: int | None = None
    max_tokens: int | None = 256
    stop: tuple[str, ...] = ()
    grammar: str | None = None
    grammar_trigger: str | None = None


@dataclass(frozen=True)
class StepRequest:
    """One generation. Exactly one of ``messages`` (chat) or ``prompt`` (raw text) is set.

    ``overrides`` carries a request's own KVMem knobs (method, scorer, budget, ...), already
    validated against ``KVMemConfig``; they apply to this step only. ``reasoning_budget``:
    at most this many tokens inside a think block before its closing tag is forced (None:
    no limit; see ``kvmem_core.reasoning``). ``cache_key`` (a client's ``prompt_cache_key``)
    names the workspace the step runs in; ``workspace_id`` is preferred among those that
    hold exactly the matched prefix (``kvmem_core.workspace.Route``).
    """

    messages: tuple[dict[str, Any], ...] | None = None
    prompt: str | None = None
    tools: tuple[dict[str, Any], ...] | None = None
    template_kwargs: dict[str, Any] = field(default_factory=dict)
    sampling: SamplingParams = SamplingParams()
    overrides: dict[str, Any] = field(default_factory=dict)
    reasoning_budget: int | None = None
    cache_key: str | None = None
    workspace_id: str | None = None


@dataclass(frozen=True)
class StepResult:
    """What one step produced and what it cost; ``selection`` feeds the response's ``kvmem`` object."""

    text: str
    token_ids: tuple[int, ...]
    finish_reason: str  # "stop" | "length" | "abort"
    prompt_tokens: int
    cached_tokens: int
    workspace_id: str
    selection: dict[str, Any] = field(default_factory=dict)
    timings: dict[str, float] = field(default_factory=dict)

    @property
    def completion_tokens(self) -> int:
        return len(self.token_ids)


OnText = Callable[[str], bool]
"""Called with each new piece of text; returning False aborts the step (client gone)."""

OnStart = Callable[[str], None]
"""Called once per step with its workspace id, as soon as the prefix match has chosen it (before prefill)."""


@runtime_checkable
class Engine(Protocol):
    """A loaded model plus KVMem memory; requests are serialized by the caller."""

    model_id: str
    chat_template: str  # the model's chat template source (what its answers look like follows from it)
    config: KVMemConfig  # as loaded: ``ctx`` is set (an ``auto`` one sized to the storage tier)

    def tokenize(self, text: str) -> list[int]: ...

    def count_tokens(self, request: StepRequest) -> int: ...

    def step(self, request: StepRequest, on_text: OnText, on_start: OnStart | None = None) -> StepResult: ...

    def list_workspaces(self) -> list[dict[str, Any]]: ...

    def workspace_info(self, workspace_id: str) -> dict[str, Any] | None: ...

    def delete_workspace(self, workspace_id: str) -> bool: ...

    def pin_workspace(self, workspace_id: str, pinned: bool) -> dict[str, Any] | None: ...

    def export_workspace(self, workspace_id: str, path: str) -> dict[str, Any] | None: ...

    def import_workspace(self, path: str) -> dict[str, Any]: ...

    def metrics(self) -> dict[str, float]: ...

    def close(self) -> None: ...
