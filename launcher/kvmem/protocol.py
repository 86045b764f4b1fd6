"""The wire between the API server and the engine process: typed msgspec Structs over ZMQ.

Every frame is one msgpack-encoded message of the ``Message`` union, tagged by its class
name and stamped with ``PROTOCOL_VERSION``; a frame of another version or shape raises
``ProtocolError`` instead of being guessed at. No pickle: only plain data crosses.

Server -> engine: ``Step``, ``Call``, ``Abort``, ``Shutdown``.
Engine -> server: ``Ready``, ``Text``, ``Done``, ``Reply``, ``Failed``, ``Dead``.
"""

from __future__ import annotations

from typing import Any, Union

import msgspec

from kvmem.output_parser import ChatFormat
from kvmem_core.config import KVMemConfig
from kvmem_core.contract import SamplingParams, StepRequest, StepResult
from kvmem_core.reasoning import ThinkTags

PROTOCOL_VERSION = 2
CALL_OPS = (
    "tokenize",
    "count_tokens",
    "list_workspaces",
    "workspace_info",
    "delete_workspace",
    "pin_workspace",
    "unpin_workspace",
    "export_workspace",
    "import_workspace",
    "metrics",
)


class ProtocolError(Exception):
    """A frame that is not a message of this protocol version."""


class _Msg(msgspec.Struct, tag=True, kw_only=True):
    v: int = PROTOCOL_VERSION


class WireSampling(msgspec.Struct):
    temperature: float
    top_p: float
    top_k: int
    seed: int | None
    max_tokens: int | None
    stop: list[str]
    grammar: str | None = None
    grammar_trigger: str | None = None


class WireStepRequest(msgspec.Struct):
    messages: list[dict[str, Any]] | None
    prompt: str | None
    tools: list[dict[str, Any]] | None
    template_kwargs: dict[str, Any]
    sampling: WireSampling
    overrides: dict[str, Any]
    reasoning_budget: int | None = None
    cache_key: str | None = None
    workspace_id: str | None = None


class WireChatFormat(msgspec.Struct):
    """``kvmem.output_parser.ChatFormat``: the tool syntax and think tags of the model's template."""

    tools: str | None = None
    think: tuple[str, str] | None = None


class WireStepResult(msgspec.Struct):
    text: str
    token_ids: list[int]
    finish_reason: str
    prompt_tokens: int
    cached_tokens: int
    workspace_id: str
    selection: dict[str, Any]
    timings: dict[str, float]


class EngineSpec(msgspec.Struct):
    """What the engine process loads: passed to it as JSON on its command line."""

    backend: str
    model: str | None
    config: dict[str, Any]
    opts: dict[str, Any] = {}


# server -> engine
class Step(_Msg):
    id: str
    request: WireStepRequest


class Call(_Msg):
    """A non-generating engine call; ``op`` is one of ``CALL_OPS`` (``count_tokens`` takes ``request``; the export
    and import of a workspace a file ``path`` on this machine)."""

    id: str
    op: str
    arg: str | None = None
    request: WireStepRequest | None = None
    path: str | None = None


class Abort(_Msg):
    id: str


class Shutdown(_Msg):
    pass


# engine -> server
class Ready(_Msg):
    model_id: str
    pid: int
    ctx: int  # the workspace's token limit (``--ctx``, an ``auto`` one sized to the storage tier)
    chat_format: WireChatFormat
    metrics: dict[str, float]


class Started(_Msg):
    """A step's workspace is known (sent before prefill)."""

    id: str
    workspace_id: str


class Text(_Msg):
    id: str
    text: str


class Done(_Msg):
    """A step finished (also after an abort); ``metrics`` is the engine's snapshot after it."""

    id: str
    result: WireStepResult
    metrics: dict[str, float]


class Reply(_Msg):
    id: str
    value: Any


class Failed(_Msg):
    """A request failed without harming the engine; fields feed the OpenAI error JSON."""

    id: str
    status: int
    code: str
    message: str


class Dead(_Msg):
    """The engine hit a fatal error and exits right after this frame."""

    message: str


Message = Union[Step, Call, Abort, Shutdown, Ready, Started, Text, Done, Reply, Failed, Dead]


def _enc_hook(obj: Any) -> Any:
    """Engines may report numpy numbers or paths in their dicts: send them as plain values."""
    return obj.tolist() if hasattr(obj, "tolist") else str(obj)


_encoder = msgspec.msgpack.Encoder(enc_hook=_enc_hook)
_decoder = msgspec.msgpack.Decoder(Message)


def encode(msg: _Msg) -> bytes:
    """One frame for ``msg``."""
    return _encoder.encode(msg)


def decode(frame: bytes) -> Message:
    """The message in ``frame``; ProtocolError on a foreign version or malformed frame."""
    try:
        msg = _decoder.decode(frame)
    except msgspec.DecodeError as exc:
        raise ProtocolError(f"bad frame: {exc}") from None
    if msg.v != PROTOCOL_VERSION:
        raise ProtocolError(f"protocol version {msg.v}, expected {PROTOCOL_VERSION}")
    return msg


def to_wire_request(req: StepRequest) -> WireStepRequest:
    s = req.sampling
    return WireStepRequest(
        messages=list(req.messages) if req.messages is not None else None,
        prompt=req.prompt,
        tools=list(req.tools) if req.tools is not None else None,
        template_kwargs=dict(req.template_kwargs),
        sampling=WireSampling(
            s.temperature, s.top_p, s.top_k, s.seed, s.max_tokens, list(s.stop), s.grammar, s.grammar_trigger
        ),
        overrides=dict(req.overrides),
        reasoning_budget=req.reasoning_budget,
        cache_key=req.cache_key,
        workspace_id=req.workspace_id,
    )


def from_wire_request(w: WireStepRequest) -> StepRequest:
    s = w.sampling
    return StepRequest(
        messages=tuple(w.messages) if w.messages is not None else None,
        prompt=w.prompt,
        tools=tuple(w.tools) if w.tools is not None else None,
        template_kwargs=w.template_kwargs,
        sampling=SamplingParams(
            s.temperature, s.top_p, s.top_k, s.seed, s.max_tokens, tuple(s.stop), s.grammar, s.grammar_trigger
        ),
        overrides=w.overrides,
        reasoning_budget=w.reasoning_budget,
        cache_key=w.cache_key,
        workspace_id=w.workspace_id,
    )


def to_wire_result(r: StepResult) -> WireStepResult:
    return WireStepResult(
        r.text,
        list(r.token_ids),
        r.finish_reason,
        r.prompt_tokens,
        r.cached_tokens,
        r.workspace_id,
        dict(r.selection),
        {k: float(v) for k, v in r.timings.items()},
    )


def from_wire_result(w: WireStepResult) -> StepResult:
    return StepResult(
        w.text,
        tuple(w.token_ids),
        w.finish_reason,
        w.prompt_tokens,
        w.cached_tokens,
        w.workspace_id,
        w.selection,
        w.timings,
    )


def to_wire_format(fmt: ChatFormat) -> WireChatFormat:
    return WireChatFormat(fmt.tools, (fmt.think.open, fmt.think.close) if fmt.think else None)


def from_wire_format(w: WireChatFormat) -> ChatFormat:
    return ChatFormat(w.tools, ThinkTags(*w.think) if w.think else None)


def config_to_wire(config: KVMemConfig) -> dict[str, Any]:
    """A plain dict of the config's values (``describe`` is for people: it shows an auto ``ctx`` as ``auto``);
    ``config_from_wire`` rebuilds an equal config."""
    return msgspec.to_builtins(config, enc_hook=str)  # a Path (nvme_dir) as its text


def config_from_wire(data: dict[str, Any]) -> KVMemConfig:
    data = dict(data)
    if data.get("retrieval_heads") is not None:
        data["retrieval_heads"] = tuple(tuple(pair) for pair in data["retrieval_heads"])
    return KVMemConfig(**data)
