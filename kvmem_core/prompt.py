"""Render a request with the model's chat template, tokenize it, and mark its spans.

Message ``i`` ends where the rendering of messages ``[:i+1]`` ends. That rendering is a
prefix of the whole transcript's, so the ends are found in one pass instead of rendering
and tokenizing every prefix: each message rendered by itself ends with exactly the text
the whole rendering continues with at the previous message's end (whatever a template adds
before a lone message, such as a default system turn, is a head the match skips). Where a
template renders a message differently alone (or refuses to), that one end comes from
rendering its prefix. One tokenization of the whole text then maps the character offsets
to token indices through the tokens' byte lengths. The *query* is the last user message
(where retrieval looks from); system and developer messages and the tool definitions are
*mandatory* history, and so, for one step, are the messages a request pins (``kvmem.pin``).
Messages also fall into semantic groups (``kvmem_core.groups``) the selector keeps together.
"""

from __future__ import annotations

import functools
import json
import os
import weakref
from collections import OrderedDict
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Sequence

import numpy as np

from kvmem_core.adapter import EngineAdapter
from kvmem_core.config import KVMemConfig, check_heads
from kvmem_core.contract import StepRequest
from kvmem_core.errors import BudgetError, ConfigError, ContextLengthError, KVMemError, LimitError, TemplateError
from kvmem_core.groups import Span, covered, token_groups
from kvmem_core.layout import BlockLayout
from kvmem_core.speculative import check_mode
from kvmem_core.tokens import TokenIds

RAW_QUERY_TOKENS = 64  # a raw prompt's query: its last tokens
MAX_QUERY_TOKENS = 512
QUERY_WINDOW = 128  # retrieval scores with the question's last tokens only: its cost grows with rows x workspace
MAX_MESSAGES = 65536  # per request: a 256K-token agent transcript holds thousands (the quality bench sends over 4,096);
# a 1M-token one of short turns tens of thousands; past that, a flood of tiny messages only ties up the engine
RESERVED_KWARGS = ("messages", "tools", "add_generation_prompt", "bos_token", "eos_token")
PROBE_CHARS = 32
LONE_RENDERS = 16384  # messages rendered alone kept per adapter (``_lone_renderer``)
Render = Callable[[Sequence[dict[str, Any]], bool], str]
_piece_lengths: weakref.WeakKeyDictionary[Any, np.ndarray] = weakref.WeakKeyDictionary()
_lone_renders: weakref.WeakKeyDictionary[Any, OrderedDict[tuple[str, str], str]] = weakref.WeakKeyDictionary()


@dataclass(frozen=True)
class Prompt:
    """Token ids of a rendered request, where its query starts, and token ranges: the mandatory ones
    (system, developer, tool definitions), each message's, each semantic group's, and the ones pinned
    for this step only."""

    ids: list[int]
    query_start: int
    mandatory: tuple[Span, ...] = ()
    messages: tuple[Span, ...] = ()
    groups: tuple[Span, ...] = ()
    pinned: tuple[Span, ...] = ()
    tokens: np.ndarray = field(default=None, repr=False, compare=False)  # type: ignore[arg-type]

    def __post_init__(self) -> None:
        """``tokens``: ``ids`` as a read-only int64 array, converted once per prompt (given, or from ``ids``)."""
        if self.tokens is None:
            object.__setattr__(self, "tokens", read_only(np.asarray(self.ids, dtype=np.int64)))

    @property
    def query_from(self) -> int:
        """First token of the step's query (the last user turn, at most ``MAX_QUERY_TOKENS``): prefilled every
        step, never reused from the cache."""
        return max(self.query_start, len(self.ids) - MAX_QUERY_TOKENS)

    @property
    def scored_from(self) -> int:
        """First token whose query features retrieval scores with: the query's last ``QUERY_WINDOW`` tokens (an
        agent's turn may be a long tool result; what it asks is at its end)."""
        return max(self.query_from, len(self.ids) - QUERY_WINDOW)


def build_prompt(adapter: EngineAdapter, request: StepRequest) -> Prompt:
    """Render (chat) or take (raw) the request's text and tokenize it with span marks.

    Costs one render and one tokenization plus work linear in the transcript. A template
    that fails on the request raises ``TemplateError``, as do ``chat_template_kwargs``
    naming a variable KVMem sets itself (``RESERVED_KWARGS``).
    """
    if request.messages is None:
        ids = adapter.tokenize(request.prompt or "")
        return Prompt(ids, max(0, len(ids) - RAW_QUERY_TOKENS))
    messages = [_plain(m) for m in request.messages]
    render = _renderer(adapter, request)
    text = render(messages, True)
    ids = adapter.tokenize(text)
    tokens = read_only(ids.array if isinstance(ids, TokenIds) else np.asarray(ids, dtype=np.int64))
    schemas = (
        _tool_schemas(render, _renderer(adapter, replace(request, tools=None)), messages, text) if request.tools else ()
    )
    char_ends = message_ends(render, messages, text, _lone_renderer(adapter, request, render))
    marks = _token_indices(adapter, text, tokens, [*char_ends, *schemas])
    ends, schema = marks[: len(messages)], marks[len(messages) :]
    starts = [0] + ends[:-1]
    users = [i for i, m in enumerate(messages) if m.get("role") == "user"]
    query_start = starts[users[-1]] if users else starts[-1] if messages else 0
    mandatory = tuple((starts[i], ends[i]) for i, m in enumerate(messages) if m.get("role") in ("system", "developer"))
    schema_span = ((schema[0], schema[1]),) if schema else ()
    return Prompt(
        ids,
        min(query_start, max(0, len(ids) - 1)),
        mandatory + schema_span,
        tuple(zip(starts, ends)),
        token_groups(messages, starts, ends),
        tokens=tokens,
    )


def read_only(array: np.ndarray) -> np.ndarray:
    """``array``, no longer writeable (what may be shared between a step's phases without copies)."""
    array.flags.writeable = False
    return array


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


def message_ends(
    render: Render, messages: Sequence[dict[str, Any]], text: str, lone: Callable[[dict[str, Any]], str] | None = None
) -> list[int]:
    """Character offset in ``text`` (the whole transcript rendered) where each message's rendering ends; ``lone``
    renders a message alone (default: ``render``, "" where the template refuses it)."""
    lone = lone or functools.partial(_alone, render)
    ends, pos = [], 0
    for i, message in enumerate(messages):
        n = _continued(lone(message), text, pos)
        pos = pos + n if n else _prefix_end(render, messages[: i + 1], text, pos)
        ends.append(pos)
    return ends


def _alone(render: Render, message: dict[str, Any]) -> str:
    try:
        return render([message], False)
    except TemplateError:  # e.g. a template that wants turns to alternate from a user turn
        return ""


def _lone_renderer(adapter: EngineAdapter, request: StepRequest, render: Render) -> Callable[[dict[str, Any]], str]:
    """``_alone`` remembered per adapter by the message, the request's tools and template kwargs (the most recent
    ``LONE_RENDERS``): an agent's turn renders alone only its new messages. What a lone rendering is used for is
    checked against the whole text (``_continued``), so a template whose output changes (a date) costs a fallback,
    never a wrong mark."""
    kept = _lone_renders.setdefault(adapter, OrderedDict())
    setting = json.dumps([request.tools, request.template_kwargs], sort_keys=True, default=repr)

    def lone(message: dict[str, Any]) -> str:
        key = (setting, _frozen(message))
        text = kept.get(key)
        if text is None:
            text = kept[key] = _alone(render, message)
            while len(kept) > LONE_RENDERS:
                kept.popitem(last=False)
        else:
            kept.move_to_end(key)
        return text

    return lone


def _frozen(value: Any) -> Any:
    """``value`` (a message, or anything in one) as a hashable key that tells apart exactly what JSON would: dicts by
    their sorted items, lists item by item, other values with their type (``1``, ``1.0`` and ``True`` are three).
    Hashing a transcript's messages this way costs a sixth of serializing them (~2 ms against ~12 ms at 1M tokens)."""
    if isinstance(value, dict):
        return tuple(sorted(((str(k), _frozen(v)) for k, v in value.items()), key=lambda item: item[0]))
    if isinstance(value, (list, tuple)):
        return (list, *(_frozen(v) for v in value))
    return value if type(value) is str else (type(value).__name__, repr(value))


def _continued(alone: str, text: str, pos: int) -> int:
    """Length of the longest tail of ``alone`` that ``text`` continues with at ``pos`` (0: none)."""
    probe = text[pos : pos + PROBE_CHARS]
    if not probe:
        return 0
    j = alone.find(probe)
    while j >= 0:  # tails at least a probe long
        if text.startswith(alone[j:], pos):
            return len(alone) - j
        j = alone.find(probe, j + 1)
    for j in range(max(0, len(alone) - len(probe) + 1), len(alone)):  # shorter tails
        if text.startswith(alone[j:], pos):
            return len(alone) - j
    return 0


def _prefix_end(render: Render, prefix: Sequence[dict[str, Any]], text: str, pos: int) -> int:
    """Where ``prefix``'s own rendering ends in ``text``; ``pos`` when it does not render as a prefix of it."""
    try:
        head = render(prefix, False)
    except TemplateError:
        return pos
    return max(pos, len(head)) if text.startswith(head) else pos


def _token_indices(
    adapter: EngineAdapter, text: str, ids: Sequence[int] | np.ndarray, offsets: Sequence[int]
) -> list[int]:
    """For each character offset into ``text`` (in any order), how many of its tokens ``ids`` end at or before it.

    Token byte lengths accumulate to byte offsets; bytes the tokenizer adds in front of the
    text (a BOS it inserts, a leading space) come before offset 0.
    """
    ends = np.cumsum(_lengths(adapter, np.asarray(ids, dtype=np.int64)))
    total = int(ends[-1]) if len(ends) else 0
    lead = total - (len(text) if text.isascii() else len(text.encode("utf-8", "surrogatepass")))
    return np.searchsorted(ends, lead + _byte_offsets(text, offsets), side="right").tolist()


def _byte_offsets(text: str, offsets: Sequence[int]) -> np.ndarray:
    """UTF-8 byte offset of each character offset into ``text`` (a lone surrogate counts its three bytes)."""
    at = np.asarray(offsets, dtype=np.int64)
    if text.isascii():
        return at
    order = np.argsort(at, kind="stable")
    sizes, prev = np.empty(len(at), dtype=np.int64), 0
    for i, k in enumerate(order.tolist()):
        sizes[i] = len(text[prev : offsets[k]].encode("utf-8", "surrogatepass"))
        prev = offsets[k]
    out = np.empty_like(at)
    out[order] = np.cumsum(sizes)
    return out


def _lengths(adapter: EngineAdapter, ids: np.ndarray) -> np.ndarray:
    """Byte length of each token's text, from a table kept per adapter (token bytes cost a call into the engine:
    only ids not seen before make one)."""
    table = _piece_lengths.get(adapter)
    top = int(ids.max()) + 1 if len(ids) else 0
    if table is None or len(table) < top:
        grown = np.full(max(top, 2 * len(table) if table is not None else 0), -1, dtype=np.int64)
        if table is not None:
            grown[: len(table)] = table
        table = _piece_lengths[adapter] = grown
    lengths = table[ids]
    unseen = np.unique(ids[lengths < 0]).tolist()
    for t in unseen:
        table[t] = len(adapter.token_bytes(t))
    return table[ids] if unseen else lengths


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
    if oracle is not None and not all(0 <= b < len(prompt.ids) // adapter.layout.block_tokens for b in oracle):
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
    n = len(prompt.ids)
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
