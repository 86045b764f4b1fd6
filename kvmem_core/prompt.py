"""Render a request with the model's chat template, tokenize it, and mark its spans.

Where each message ends, in characters and then in tokens, is ``kvmem_core.marks``'s (one
pass over the text, carried over from the last request where the two agree). The *query* is the last user message
(where retrieval looks from); system and developer messages and the tool definitions are
*mandatory* history, and so, for one step, are the messages a request pins (``kvmem.pin``).
Messages also fall into semantic groups (``kvmem_core.groups``) the selector keeps together.
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass, replace
from typing import Any, Sequence

import numpy as np

from kvmem_core.adapter import EngineAdapter
from kvmem_core.config import KVMemConfig, check_heads
from kvmem_core.contract import StepRequest
from kvmem_core.errors import BudgetError, ConfigError, ContextLengthError, KVMemError, LimitError, TemplateError
from kvmem_core.groups import Span, covered, token_groups
from kvmem_core.layout import BlockLayout
from kvmem_core.marks import Render, token_marks
from kvmem_core.speculative import check_mode
from kvmem_core.tokens import read_only

RAW_QUERY_TOKENS = 64  # a raw prompt's query: its last tokens
MAX_QUERY_TOKENS = 512
QUERY_WINDOW = 128  # retrieval scores with the question's last tokens only: its cost grows with rows x workspace
MAX_MESSAGES = 65536  # per request: a 256K-token agent transcript holds thousands (the quality bench sends over 4,096);
# a 1M-token one of short turns tens of thousands; past that, a flood of tiny messages only ties up the engine
RESERVED_KWARGS = ("messages", "tools", "add_generation_prompt", "bos_token", "eos_token")


@dataclass(frozen=True, eq=False)
class Prompt:
    """Token ids of a rendered request (``tokens``, a read-only int64 array), where its query starts, and token
    ranges: the mandatory ones (system, developer, tool definitions), each message's, each semantic group's, and
    the ones pinned for this step only."""

    tokens: np.ndarray
    query_start: int
    mandatory: tuple[Span, ...] = ()
    messages: tuple[Span, ...] = ()
    groups: tuple[Span, ...] = ()
    pinned: tuple[Span, ...] = ()

    def __post_init__(self) -> None:
        """``tokens`` given as a list (or a writeable array) is held as a read-only int64 array."""
        if not isinstance(self.tokens, np.ndarray) or self.tokens.flags.writeable or self.tokens.dtype != np.int64:
            object.__setattr__(self, "tokens", read_only(np.array(self.tokens, dtype=np.int64)))

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Prompt):
            return NotImplemented
        spans = (self.query_start, self.mandatory, self.messages, self.groups, self.pinned)
        theirs = (other.query_start, other.mandatory, other.messages, other.groups, other.pinned)
        return spans == theirs and np.array_equal(self.tokens, other.tokens)

    __hash__ = None  # type: ignore[assignment]

    @functools.cached_property
    def ids(self) -> list[int]:
        """``tokens`` as a list, made on first use (at a million tokens that costs milliseconds: the step's own
        path reads ``tokens``)."""
        return self.tokens.tolist()

    @property
    def query_from(self) -> int:
        """First token of the step's query (the last user turn, at most ``MAX_QUERY_TOKENS``): prefilled every
        step, never reused from the cache."""
        return max(self.query_start, len(self.tokens) - MAX_QUERY_TOKENS)

    @property
    def scored_from(self) -> int:
        """First token whose query features retrieval scores with: the query's last ``QUERY_WINDOW`` tokens (an
        agent's turn may be a long tool result; what it asks is at its end)."""
        return max(self.query_from, len(self.tokens) - QUERY_WINDOW)


def build_prompt(adapter: EngineAdapter, request: StepRequest) -> Prompt:
    """Render (chat) or take (raw) the request's text and tokenize it with span marks.

    Costs one render and one tokenization plus work linear in the transcript. A template
    that fails on the request raises ``TemplateError``, as do ``chat_template_kwargs``
    naming a variable KVMem sets itself (``RESERVED_KWARGS``).
    """
    if request.messages is None:
        tokens = adapter.token_array(request.prompt or "")
        return Prompt(tokens, max(0, len(tokens) - RAW_QUERY_TOKENS))
    messages = [_plain(m) for m in request.messages]
    render = _renderer(adapter, request)
    text = render(messages, True)
    tokens = adapter.token_array(text)
    schemas = (
        _tool_schemas(render, _renderer(adapter, replace(request, tools=None)), messages, text) if request.tools else ()
    )
    marks = token_marks(adapter, render, request, messages, text, tokens, schemas)
    ends, schema = marks[: len(messages)], marks[len(messages) :]
    starts = [0] + ends[:-1]
    users = [i for i, m in enumerate(messages) if m.get("role") == "user"]
    query_start = starts[users[-1]] if users else starts[-1] if messages else 0
    mandatory = tuple((starts[i], ends[i]) for i, m in enumerate(messages) if m.get("role") in ("system", "developer"))
    schema_span = ((schema[0], schema[1]),) if schema else ()
    return Prompt(
        tokens,
        min(query_start, max(0, len(tokens) - 1)),
        mandatory + schema_span,
        tuple(zip(starts, ends)),
        token_groups(messages, starts, ends),
    )


def _tool_schemas(render: Render, bare: Render, messages: Sequence[dict[str, Any]], text: str) -> tuple[int, ...]:
    """Character range ``(start, end)`` of the tool definitions in ``text``, or ``()``: where the first
    message rendered alone with tools (``render``) and without (``bare``) differ. Templates write the
    definitions into the system turn or the first user turn; one that writes them further on (before
    the last user turn, say) renders a transcript that does not start with that message, and they
    are left to the selection like any history."""
    if not messages:
        return ()
    try:
        with_tools, without = render(messages[:1], False), bare(messages[:1], False)
    except TemplateError:
        return ()
    if with_tools == without or not text.startswith(with_tools):
        return ()
    head = len(os.path.commonprefix([with_tools, without]))
    tail = min(len(os.path.commonprefix([with_tools[::-1], without[::-1]])), len(without) - head)
    return head, len(with_tools) - tail


def _plain(message: dict[str, Any]) -> dict[str, Any]:
    content = message.get("content")
    if isinstance(content, list):  # OpenAI content parts: keep the text parts
        content = "".join(p.get("text", "") for p in content if isinstance(p, dict))
    return {**message, "content": content if content is not None else ""}


def _renderer(adapter: EngineAdapter, request: StepRequest) -> Render:
    """``render(messages, add_generation_prompt)`` with the request's tools and template kwargs; any failure
    of the template is a ``TemplateError`` (a bad request, never an engine fault)."""
    reserved = sorted(set(RESERVED_KWARGS) & set(request.template_kwargs))
    if reserved:
        raise TemplateError(f"chat_template_kwargs may not set {', '.join(reserved)}: KVMem sets them itself")
    kwargs = dict(request.template_kwargs)

    def render(messages: Sequence[dict[str, Any]], add_generation_prompt: bool) -> str:
        try:
            text = adapter.render_chat(
                messages, tools=request.tools, add_generation_prompt=add_generation_prompt, **kwargs
            )
        except KVMemError:
            raise
        except Exception as exc:  # jinja2 errors, and whatever a template's filters raise on odd values
            raise TemplateError(f"chat template: {type(exc).__name__}: {exc}") from exc
        if not isinstance(text, str):
            raise TemplateError("chat template: it did not render text")
        return text

    return render


def admit(
    adapter: EngineAdapter, config: KVMemConfig, request: StepRequest, has_prototypes: bool
) -> tuple[KVMemConfig, Prompt, tuple[int, ...] | None]:
    """A step's config (the engine's with the request's overrides), prompt and diagnostic oracle blocks
    (``kvmem.blocks``: these, then the newest), after every check that may refuse it: nothing has
    changed when one raises. The messages ``kvmem.pin`` names are the prompt's ``pinned`` ranges."""
    check_request(request, config)
    knobs = dict(request.overrides)
    oracle = knobs.pop("blocks", None)
    pins = knobs.pop("pin", ())
    cfg = config.replace(**knobs) if knobs else config
    check_mode(cfg.speculative, adapter)
    prompt = pin(build_prompt(adapter, request), pins)
    check_prompt(cfg, prompt, adapter.layout, adapter.caps.max_view_tokens, has_prototypes)
    if oracle is not None and not all(0 <= b < len(prompt.tokens) // adapter.layout.block_tokens for b in oracle):
        raise ConfigError(f"kvmem.blocks {list(oracle)} names blocks outside this prompt's stored history")
    return cfg, prompt, None if oracle is None else tuple(oracle)


def pin(prompt: Prompt, indexes: Sequence[int]) -> Prompt:
    """``prompt`` with the token ranges of messages ``indexes`` pinned; ConfigError for an index it has no
    message for (a raw prompt has none)."""
    bad = [i for i in indexes if not 0 <= i < len(prompt.messages)]
    if bad:
        raise ConfigError(
            f"kvmem.pin names messages {bad} but the request has {len(prompt.messages)} "
            f"(indexes 0 to {len(prompt.messages) - 1})"
        )
    return replace(prompt, pinned=tuple(prompt.messages[i] for i in sorted(set(indexes)))) if indexes else prompt


def check_request(request: StepRequest, cfg: KVMemConfig) -> None:
    """Refuse a request over the per-request limits with ``LimitError``, before any work: more than
    ``MAX_MESSAGES`` messages, or ``max_tokens`` over ``--ctx`` (no answer can be longer than the workspace)."""
    if request.messages is not None and len(request.messages) > MAX_MESSAGES:
        raise LimitError(f"the request has {len(request.messages)} messages; at most {MAX_MESSAGES} are served")
    if (request.sampling.max_tokens or 0) > cfg.ctx:
        raise LimitError(
            f"max_tokens is {request.sampling.max_tokens} but --ctx is {cfg.ctx}; ask for at most {cfg.ctx}"
        )


def check_prompt(
    cfg: KVMemConfig, prompt: Prompt, layout: BlockLayout, max_view_tokens: int, has_prototypes: bool
) -> None:
    """Refuse a step that cannot run as configured, before anything changes: an empty or too long prompt,
    retrieval heads outside the model, key-direction scoring without prototypes, mandatory spans (or
    ``full``) over the budget."""
    n = len(prompt.tokens)
    cfg.validate_view(max_view_tokens)
    if n == 0:
        raise ContextLengthError("the prompt is empty")
    if n > cfg.ctx:
        raise ContextLengthError(
            f"the prompt has {n} tokens but --ctx is {cfg.ctx}; raise --ctx (its default, auto, is what "
            "--kvmem-cpu-gb, or --kvmem-nvme-gb with --kvmem-nvme-dir, holds)"
        )
    check_heads(cfg.retrieval_heads or (), layout)
    if cfg.method == "retrieval" and cfg.scorer == "key-direction" and not has_prototypes:
        raise ConfigError(
            "key-direction scoring needs prototypes: start the engine with --kvmem-retrieval-method key-direction"
        )
    sink = cfg.sink_tokens if cfg.method != "recent" else 0
    mandatory = covered(prompt.mandatory + prompt.pinned) + min(sink + cfg.recent_tokens, n)
    if n > cfg.budget and cfg.method != "full" and mandatory > cfg.budget:
        raise BudgetError(
            f"mandatory spans (system prompt, tool definitions, pinned messages, sink, recent window) "
            f"need {mandatory} tokens but --kvmem-budget is {cfg.budget}; raise the budget, pin fewer "
            "messages or shorten the system prompt"
        )
    if cfg.method == "full" and n > cfg.budget:
        raise BudgetError(f"method full needs {n} tokens but --kvmem-budget is {cfg.budget}; raise it or use retrieval")
