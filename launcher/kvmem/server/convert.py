"""Validated request bodies -> ``StepRequest``: messages, tools, sampling and KVMem overrides."""

from __future__ import annotations

from typing import Any

import msgspec

from kvmem import tools_format
from kvmem.output_parser import ChatFormat
from kvmem.server import formats
from kvmem.server import schemas as S
from kvmem.server.errors import invalid
from kvmem_core.config import KVMemConfig, parse_retrieval_heads
from kvmem_core.contract import SamplingParams, StepRequest
from kvmem_core.errors import ConfigError

_DEFAULT = SamplingParams()
EFFORT_BUDGETS = {"none": 0, "minimal": 256, "low": 1024, "medium": 4096}  # think tokens; high and above: no limit
_OVERRIDE_FIELDS = {
    "method": "method",
    "retrieval_method": "scorer",
    "budget": "budget",
    "gen_budget": "gen_budget",
    "sink_tokens": "sink_tokens",
    "recent_tokens": "recent_tokens",
    "retrieval_heads": "retrieval_heads",
    "groups": "groups",
    "relevance": "relevance",
    "speculative": "speculative",
}


def overrides(options: S.KVMemOptions | None, config: KVMemConfig, messages: int = 0, shift: int = 0) -> dict[str, Any]:
    """The request's ``kvmem`` object as config-field overrides, validated against ``config``, plus the
    diagnostic ``blocks`` and the engine's indexes of the ``pin``ned messages (``pins``)."""
    if options is None:
        return {}
    out: dict[str, Any] = {}
    for name, field in _OVERRIDE_FIELDS.items():
        value = getattr(options, name)
        if value is not None:
            out[field] = value
    try:
        if "retrieval_heads" in out:
            out["retrieval_heads"] = parse_retrieval_heads(out["retrieval_heads"])
        config.replace(**out).validate_view(config.view_tokens)
    except ConfigError as exc:
        raise invalid(str(exc), "kvmem", "invalid_kvmem_options") from None
    if options.blocks is not None:
        out["blocks"] = tuple(options.blocks)
    if options.pin:
        out["pin"] = pins(options.pin, messages, shift)
    return out


def pins(indexes: list[int], messages: int, shift: int) -> tuple[int, ...]:
    """``kvmem.pin``'s indexes into the request's ``messages`` as indexes into the engine's transcript, which
    has ``shift`` turns more in front (the tool definitions, for a template without tools and a request
    without a system message); 400 for an index past the request's messages."""
    bad = sorted({i for i in indexes if i >= messages})
    if bad:
        raise invalid(
            f"kvmem.pin names messages {bad} but the request has {messages} "
            f"({'indexes 0 to ' + str(messages - 1) if messages else 'a raw prompt has none'})",
            "kvmem.pin",
            "invalid_kvmem_options",
        )
    return tuple(i + shift for i in indexes)


def sampling(body: Any, max_tokens: int | None) -> SamplingParams:
    """Sampling knobs from any request body with the OpenAI field names; ``max_tokens`` None: until the model
    stops or the workspace is full."""
    stop = getattr(body, "stop", None) or getattr(body, "stop_sequences", None) or ()
    return SamplingParams(
        temperature=_pick(body.temperature, _DEFAULT.temperature),
        top_p=_pick(body.top_p, _DEFAULT.top_p),
        top_k=_pick(getattr(body, "top_k", None), _DEFAULT.top_k),
        seed=getattr(body, "seed", None),
        max_tokens=max_tokens,
        stop=(stop,) if isinstance(stop, str) else tuple(s for s in stop if s),
    )


def _pick(value: Any, default: Any) -> Any:
    return default if value is None else value


def text_content(content: str | list[Any] | None, where: str) -> str | None:
    """Join text parts; 400 on any non-text part (images are not served yet)."""
    if content is None or isinstance(content, str):
        return content
    texts = []
    for i, part in enumerate(content):
        if part.type not in ("text", "input_text", "output_text") or part.text is None:
            raise invalid(f"content part type {part.type!r} is not supported; send text", f"{where}.content[{i}]")
        texts.append(part.text)
    return "".join(texts)


def chat_messages(messages: list[S.ChatMessage]) -> list[dict[str, Any]]:
    """OpenAI chat dicts with string content; checks what the schema cannot."""
    out = []
    for i, msg in enumerate(messages):
        content = text_content(msg.content, f"messages[{i}]")
        if content is None and not (msg.role == "assistant" and msg.tool_calls):
            raise invalid(f"messages[{i}] ({msg.role}) needs content", f"messages[{i}].content")
        d: dict[str, Any] = {"role": "system" if msg.role == "developer" else msg.role, "content": content or ""}
        if msg.tool_calls:
            d["tool_calls"] = msgspec.to_builtins(msg.tool_calls)
        if msg.tool_call_id is not None:
            d["tool_call_id"] = msg.tool_call_id
        if msg.name is not None:
            d["name"] = msg.name
        if msg.reasoning_content and msg.role == "assistant":
            d["reasoning_content"] = msg.reasoning_content
        out.append(d)
    if all(m["role"] == "system" for m in out):
        raise invalid("messages need at least one user, assistant or tool turn", "messages")
    return out


def engine_transcript(
    messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None, fmt: ChatFormat
) -> tuple[tuple[dict[str, Any], ...], tuple[dict[str, Any], ...] | None]:
    """Messages and tools as the engine gets them: native when its template knows tools, else plain text."""
    if fmt.tools is not None:
        return tuple(tools_format.native_messages(messages, fmt.tools)), tuple(tools) if tools else None
    return tuple(tools_format.render_plain(messages, tools)), None


def tool_names(tools: list[dict[str, Any]] | None) -> list[str]:
    """The function names of chat-style ``tools``: the only calls an answer may make."""
    return [t["function"]["name"] for t in tools or ()]


def thinking(
    effort: str | None, kwargs: dict[str, Any] | None, budget: int | None
) -> tuple[dict[str, Any], int | None]:
    """A request's thinking controls as template kwargs and a think-token budget.

    ``effort`` reaches the template as ``reasoning_effort`` (templates without it ignore
    it); ``none`` also sets ``enable_thinking: false`` unless the request set it. Without an
    explicit ``budget``, thinking switched off gets 0 (a block the template opens anyway is
    closed at once) and an effort its ``EFFORT_BUDGETS`` entry.
    """
    kwargs = dict(kwargs or {})
    if effort is not None:
        kwargs.setdefault("reasoning_effort", effort)
        if effort == "none":
            kwargs.setdefault("enable_thinking", False)
    if budget is None:
        budget = 0 if kwargs.get("enable_thinking") is False else EFFORT_BUDGETS.get(effort or "")
    return kwargs, budget


def chat_tools(body: S.ChatRequest) -> list[dict[str, Any]] | None:
    """The tools a chat request offers the model (none under ``tool_choice: "none"``)."""
    return msgspec.to_builtins(body.tools) if body.tools and body.tool_choice != "none" else None


def chat_step(body: S.ChatRequest, config: KVMemConfig, fmt: ChatFormat, default_max: int | None = None) -> StepRequest:
    """The engine step for a chat completion request; ``default_max`` caps an answer the request sets no
    ``max_tokens`` for (None: the room left in the workspace, at most the model's trained context)."""
    tools = chat_tools(body)
    client = chat_messages(body.messages)
    messages, engine_tools = engine_transcript(client, tools, fmt)
    kwargs, budget = thinking(body.reasoning_effort, body.chat_template_kwargs, body.reasoning_budget_tokens)
    max_tokens = body.max_completion_tokens or body.max_tokens or default_max  # each at least 1 when set
    grammar, trigger = formats.grammar(formats.requested(body.response_format), tools, body.tool_choice, fmt.tools)
    return StepRequest(
        messages=messages,
        tools=engine_tools,
        template_kwargs=kwargs,
        reasoning_budget=budget,
        sampling=formats.constrained(sampling(body, max_tokens), grammar, trigger),
        overrides=overrides(body.kvmem, config, len(client), len(messages) - len(client)),
        cache_key=body.prompt_cache_key,
    )


def completion_step(body: S.CompletionRequest, config: KVMemConfig, default_max: int | None = None) -> StepRequest:
    """The engine step for a raw-prompt completion request (``default_max`` as for ``chat_step``)."""
    if body.echo:
        raise invalid("echo is not supported", "echo")
    prompt = body.prompt if isinstance(body.prompt, str) else body.prompt[0]
    if not prompt:
        raise invalid("prompt is empty", "prompt")
    return StepRequest(
        prompt=prompt, sampling=sampling(body, body.max_tokens or default_max), overrides=overrides(body.kvmem, config)
    )
