"""Request bodies as msgspec Structs: decoding a body is validating it.

Fields OpenAI clients send that KVMem does not use are accepted and ignored (clients send
many); the request-level ``kvmem`` object forbids unknown fields, since a misspelt knob
would silently compare the wrong thing. Checks a schema cannot express live in ``check_*``.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

import msgspec
from msgspec import Meta

from kvmem_core.prompt import MAX_MESSAGES

Temperature = Annotated[float, Meta(ge=0.0, le=2.0)]
TopP = Annotated[float, Meta(gt=0.0, le=1.0)]
TopK = Annotated[int, Meta(ge=0)]
PositiveInt = Annotated[int, Meta(ge=1)]
Stop = str | Annotated[list[str], Meta(max_length=16)]
Role = Literal["system", "developer", "user", "assistant", "tool"]
Effort = Literal["none", "minimal", "low", "medium", "high", "xhigh", "max"]
Budget = Annotated[int, Meta(ge=0)]
CacheKey = Annotated[str, Meta(min_length=1, max_length=1024)]


class KVMemOptions(msgspec.Struct, forbid_unknown_fields=True):
    """Per-request KVMem knobs; they override the server's defaults for this step only."""

    method: str | None = None
    retrieval_method: str | None = None
    budget: PositiveInt | None = None
    gen_budget: PositiveInt | None = None
    sink_tokens: Annotated[int, Meta(ge=0)] | None = None
    recent_tokens: Annotated[int, Meta(ge=0)] | None = None
    retrieval_heads: str | None = None
    blocks: list[Annotated[int, Meta(ge=0)]] | None = None  # diagnostic selection: these stored blocks first
    pin: list[Annotated[int, Meta(ge=0)]] | None = None  # message indexes kept in the view for this step
    groups: bool | None = None  # whole-message selection on or off for this step
    relevance: Annotated[float, Meta(ge=0, le=1)] | None = None  # share of the best score taken by score
    speculative: Literal["auto", "off", "lookup", "mtp"] | None = None  # speculative decoding (greedy, no format)


class ContentPart(msgspec.Struct):
    type: str
    text: str | None = None


class FunctionCall(msgspec.Struct):
    name: str
    arguments: str = "{}"


class ToolCall(msgspec.Struct):
    id: str
    function: FunctionCall
    type: Literal["function"] = "function"


class ChatMessage(msgspec.Struct):
    role: Role
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None
    reasoning_content: str | None = None  # an earlier answer's thinking, for templates that render it


class FunctionDef(msgspec.Struct):
    name: Annotated[str, Meta(min_length=1)]
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ChatTool(msgspec.Struct):
    function: FunctionDef
    type: Literal["function"] = "function"


class JsonSchema(msgspec.Struct):
    """Chat's ``response_format.json_schema``."""

    name: str = "response"
    schema: dict[str, Any] | None = None
    strict: bool | None = None
    description: str | None = None


class ResponseFormat(msgspec.Struct):
    """Chat's ``response_format``: plain ``text``, any JSON object, or JSON of a schema."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchema | None = None


class TextFormat(msgspec.Struct):
    """Responses' ``text.format`` (the schema's fields flat in it)."""

    type: Literal["text", "json_object", "json_schema"]
    name: str | None = None
    schema: dict[str, Any] | None = None
    strict: bool | None = None
    description: str | None = None


class TextOptions(msgspec.Struct):
    format: TextFormat | None = None
    verbosity: str | None = None


class StreamOptions(msgspec.Struct):
    include_usage: bool = False


class Sampling(msgspec.Struct, kw_only=True):
    model: str | None = None
    temperature: Temperature | None = None
    top_p: TopP | None = None
    top_k: TopK | None = None
    seed: int | None = None
    stop: Stop | None = None
    n: Annotated[int, Meta(ge=1, le=1)] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    kvmem: KVMemOptions | None = None


class ChatRequest(Sampling, kw_only=True):
    messages: Annotated[list[ChatMessage], Meta(min_length=1, max_length=MAX_MESSAGES)]
    max_tokens: PositiveInt | None = None
    max_completion_tokens: PositiveInt | None = None
    tools: list[ChatTool] | None = None
    tool_choice: str | dict[str, Any] | None = None
    response_format: ResponseFormat | None = None
    reasoning_effort: Effort | None = None
    reasoning_budget_tokens: Budget | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    prompt_cache_key: CacheKey | None = None


class CompletionRequest(Sampling, kw_only=True):
    prompt: str | Annotated[list[str], Meta(min_length=1, max_length=1)]
    max_tokens: PositiveInt | None = None
    echo: bool = False


class InputPart(msgspec.Struct):
    type: str
    text: str | None = None


class InputItem(msgspec.Struct):
    """One Responses input item: a message, a ``function_call``, a ``function_call_output`` or a ``reasoning``."""

    type: str = "message"
    role: Role | None = None
    content: str | list[InputPart] | None = None
    summary: list[InputPart] | None = None
    id: str | None = None
    call_id: str | None = None
    name: str | None = None
    arguments: str | None = None
    output: str | list[InputPart] | None = None


class ResponsesTool(msgspec.Struct):
    type: str
    name: str | None = None
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class Reasoning(msgspec.Struct):
    effort: Effort | None = None
    summary: str | None = None


class ResponsesRequest(msgspec.Struct, kw_only=True):
    model: str | None = None
    input: str | Annotated[list[InputItem], Meta(max_length=MAX_MESSAGES)]
    instructions: str | None = None
    previous_response_id: str | None = None
    store: bool = True
    stream: bool = False
    tools: list[ResponsesTool] | None = None
    tool_choice: str | dict[str, Any] | None = None
    max_output_tokens: PositiveInt | None = None
    text: TextOptions | None = None
    temperature: Temperature | None = None
    top_p: TopP | None = None
    top_k: TopK | None = None
    seed: int | None = None
    reasoning: Reasoning | None = None
    reasoning_budget_tokens: Budget | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    prompt_cache_key: CacheKey | None = None
    metadata: dict[str, str] | None = None
    kvmem: KVMemOptions | None = None


class TokenizeRequest(msgspec.Struct):
    content: str


class AnthropicBlock(msgspec.Struct):
    """A Messages content block: ``text``, ``thinking``, ``tool_use`` or ``tool_result`` (others are refused)."""

    type: str
    text: str | None = None
    thinking: str | None = None
    id: str | None = None
    name: str | None = None
    input: dict[str, Any] | None = None
    tool_use_id: str | None = None
    content: str | list[InputPart] | None = None
    is_error: bool | None = None


class AnthropicMessage(msgspec.Struct):
    role: Literal["user", "assistant"]
    content: str | list[AnthropicBlock]


class AnthropicTool(msgspec.Struct):
    name: Annotated[str, Meta(min_length=1)]
    description: str | None = None
    input_schema: dict[str, Any] | None = None
    type: str | None = None
    strict: bool | None = None


class OutputFormat(msgspec.Struct):
    """Messages' ``output_format``: JSON of a schema."""

    type: Literal["json_schema"]
    schema: dict[str, Any] | None = None


class AnthropicThinking(msgspec.Struct):
    type: Literal["enabled", "disabled"]
    budget_tokens: Budget | None = None


class CountTokensRequest(msgspec.Struct, kw_only=True):
    model: str | None = None
    messages: Annotated[list[AnthropicMessage], Meta(min_length=1, max_length=MAX_MESSAGES)]
    system: str | list[InputPart] | None = None
    tools: list[AnthropicTool] | None = None
    tool_choice: dict[str, Any] | None = None
    thinking: AnthropicThinking | None = None


class MessagesRequest(CountTokensRequest, kw_only=True):
    """The Anthropic Messages subset: text, system, tools, stream."""

    max_tokens: PositiveInt
    stop_sequences: Annotated[list[str], Meta(max_length=16)] | None = None
    temperature: Annotated[float, Meta(ge=0.0, le=1.0)] | None = None
    top_p: TopP | None = None
    top_k: TopK | None = None
    stream: bool = False
    metadata: dict[str, Any] | None = None
    output_format: OutputFormat | None = None
    kvmem: KVMemOptions | None = None


def openapi_components() -> dict[str, Any]:
    """JSON schemas of the request bodies, for ``/openapi.json``."""
    _, components = msgspec.json.schema_components(
        [ChatRequest, CompletionRequest, ResponsesRequest, TokenizeRequest, MessagesRequest, CountTokensRequest],
        ref_template="#/components/schemas/{name}",
    )
    return components
