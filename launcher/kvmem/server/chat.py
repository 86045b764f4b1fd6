"""``/v1/chat/completions`` and ``/v1/completions``: JSON replies and SSE chunk streams."""

from __future__ import annotations

import time
import uuid
from typing import Any, Awaitable, Callable

import msgspec
from aiohttp import web

from kvmem.output_parser import OutputParser, parse_output
from kvmem.server import convert, sse
from kvmem.server import schemas as S
from kvmem.server.errors import to_api_error
from kvmem.server.state import STATE, ServerState
from kvmem.tool_syntax import Item
from kvmem_core.contract import StepResult


def usage(result: StepResult) -> dict[str, Any]:
    """Chat usage with the prefix-cache hits in both spellings clients look for."""
    return {
        "prompt_tokens": result.prompt_tokens,
        "completion_tokens": result.completion_tokens,
        "total_tokens": result.prompt_tokens + result.completion_tokens,
        "prompt_tokens_details": {"cached_tokens": result.cached_tokens, "cache_write_tokens": cache_writes(result)},
        "completion_tokens_details": {"reasoning_tokens": reasoning_tokens(result)},
        "prompt_cache_hit_tokens": result.cached_tokens,
        "prompt_cache_miss_tokens": result.prompt_tokens - result.cached_tokens,
    }


def cache_writes(result: StepResult) -> int:
    """Prompt tokens this step computed and stored for later steps: all but the cache hits."""
    return result.prompt_tokens - result.cached_tokens


def finish_reason(result: StepResult, called: bool) -> str:
    """OpenAI's finish reason: ``length`` whenever ``max_tokens`` cut the answer (a tool call in it may be cut
    short), else ``tool_calls`` for an answer that calls tools, else the engine's."""
    return "tool_calls" if called and result.finish_reason != "length" else result.finish_reason


def reasoning_tokens(result: StepResult) -> int:
    """Generated tokens inside think blocks, their closing tags included (the engine counts them)."""
    return int(result.timings.get("reasoning_tokens", 0))


def kvmem_info(result: StepResult) -> dict[str, Any]:
    """The ``kvmem`` object of a response: workspace, selection stats, step timings."""
    return {"workspace_id": result.workspace_id, "selection": result.selection, "timings": result.timings}


async def read_body(request: web.Request, schema: type[Any]) -> Any:
    """Decode and validate the JSON body (errors go through ``errors.to_api_error``)."""
    return msgspec.json.decode(await request.read(), type=schema)


async def chat_completions(request: web.Request) -> web.StreamResponse:
    state = request.app[STATE]
    body: S.ChatRequest = await read_body(request, S.ChatRequest)
    fmt = state.engine.chat_format
    step = convert.chat_step(body, state.config, fmt, state.max_tokens_default)
    model = state.served_model(body.model)
    offered = convert.tool_names(convert.chat_tools(body))
    parser = fmt.parser(with_tools=bool(offered), declared=offered)
    base = {
        "id": "chatcmpl-" + uuid.uuid4().hex,
        "created": int(time.time()),
        "model": model,
        "system_fingerprint": state.fingerprint,
    }
    if body.stream:
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        return await _stream_chat(request, state, step, base, parser, include_usage)
    result = await state.run(step)
    out = parse_output(result.text, parser)
    message: dict[str, Any] = {"role": "assistant", "content": out.content or (None if out.calls else "")}
    if out.reasoning:
        message["reasoning_content"] = out.reasoning
    if out.calls:
        message["tool_calls"] = out.calls
    choice = {"index": 0, "message": message, "logprobs": None, "finish_reason": finish_reason(result, bool(out.calls))}
    return web.json_response(
        {**base, "object": "chat.completion", "choices": [choice], "usage": usage(result), "kvmem": kvmem_info(result)}
    )


def call_deltas(index: int, call: dict[str, Any]) -> list[dict[str, Any]]:
    """A complete tool call as the two deltas OpenAI streams: id and name first, then the arguments."""
    fn = call["function"]
    head = {"index": index, "id": call["id"], "type": "function", "function": {"name": fn["name"], "arguments": ""}}
    return [{"tool_calls": [head]}, {"tool_calls": [{"index": index, "function": {"arguments": fn["arguments"]}}]}]


async def _stream_chat(
    request: web.Request, state: ServerState, step: Any, base: dict[str, Any], parser: OutputParser, include_usage: bool
) -> web.StreamResponse:
    chunk = {**base, "object": "chat.completion.chunk"}
    extra = {"usage": None} if include_usage else {}

    def delta(d: dict[str, Any], finish: str | None = None, **more: Any) -> bytes:
        choice = {"index": 0, "delta": d, "logprobs": None, "finish_reason": finish}
        return sse.frame({**chunk, "choices": [choice], **extra, **more})

    started: dict[str, str] = {}
    gen = state.stream(step, lambda ws_id: started.setdefault("workspace_id", ws_id))
    first = await first_item(gen)
    resp = await sse.open_stream(request)
    # the workspace id rides on the first chunk too, so a client that stops the answer early still has it
    await resp.write(delta({"role": "assistant", "content": ""}, kvmem=started))
    calls: list[dict[str, Any]] = []

    async def emit(item: Item) -> None:
        kind, value = item
        if kind != "call":
            await resp.write(delta({"reasoning_content" if kind == "reasoning" else "content": value}))
            return
        calls.append(value)
        for d in call_deltas(len(calls) - 1, value):
            await resp.write(delta(d))

    async def chunks() -> None:
        result = await sse.relay(gen, first, emit, parser)
        await resp.write(delta({}, finish_reason(result, bool(calls))))
        if include_usage:
            await resp.write(sse.frame({**chunk, "choices": [], "usage": usage(result), "kvmem": kvmem_info(result)}))

    return await openai_stream(resp, chunks)


async def openai_stream(resp: web.StreamResponse, chunks: Callable[[], Awaitable[None]]) -> web.StreamResponse:
    """Write an OpenAI stream's chunks, then ``[DONE]``; an error mid-stream becomes an error chunk,
    a client that went away ends it quietly."""
    try:
        await chunks()
    except (ConnectionResetError, ConnectionError):
        return resp
    except Exception as exc:
        await resp.write(sse.frame(to_api_error(exc).body()))
    await resp.write(sse.DONE)
    return resp


async def first_item(gen: Any) -> Any:
    """The stream's first item, so errors before any output (queue full, context too long) are plain HTTP errors."""
    try:
        return await gen.__anext__()
    except BaseException:
        await gen.aclose()
        raise


async def completions(request: web.Request) -> web.StreamResponse:
    state = request.app[STATE]
    body: S.CompletionRequest = await read_body(request, S.CompletionRequest)
    step = convert.completion_step(body, state.config, state.max_tokens_default)
    model = state.served_model(body.model)
    base = {"id": "cmpl-" + uuid.uuid4().hex, "object": "text_completion", "created": int(time.time()), "model": model}
    if not body.stream:
        result = await state.run(step)
        choice = {"index": 0, "text": result.text, "logprobs": None, "finish_reason": result.finish_reason}
        return web.json_response({**base, "choices": [choice], "usage": usage(result), "kvmem": kvmem_info(result)})
    include_usage = bool(body.stream_options and body.stream_options.include_usage)
    gen = state.stream(step)
    first = await first_item(gen)
    resp = await sse.open_stream(request)

    def piece(text: str, finish: str | None = None) -> bytes:
        return sse.frame({**base, "choices": [{"index": 0, "text": text, "logprobs": None, "finish_reason": finish}]})

    async def chunks() -> None:
        result = await sse.relay(gen, first, lambda item: resp.write(piece(item[1])))
        await resp.write(piece("", result.finish_reason))
        if include_usage:
            await resp.write(sse.frame({**base, "choices": [], "usage": usage(result), "kvmem": kvmem_info(result)}))

    return await openai_stream(resp, chunks)
