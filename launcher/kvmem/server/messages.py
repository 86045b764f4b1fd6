"""``/v1/messages`` and ``/v1/messages/count_tokens``: the Anthropic Messages subset.

Text, ``system``, tools (``tool_use`` / ``tool_result`` blocks) and streaming over the same
engine step as chat. Usage follows Anthropic's split: ``input_tokens`` counts only the
tokens not read from the cache, ``cache_read_input_tokens`` the prefix hits.
"""
from __future__ import annotations

import json
import uuid
from typing import Any

from aiohttp import web

from kvmem import tools_format
from kvmem.server import convert, sse
from kvmem.server import schemas as S
from kvmem.server.chat import first_item, kvmem_info, read_body
from kvmem.server.errors import APIError, invalid, to_api_error
from kvmem.server.state import STATE, ServerState
from kvmem_core.contract import StepRequest, StepResult

STOP_REASONS = {"length": "max_tokens", "stop": "end_turn", "abort": "end_turn"}


def chat_messages(body: S.CountTokensRequest) -> list[dict[str, Any]]:
    """The system prompt and Messages turns as OpenAI chat dicts."""
    out: list[dict[str, Any]] = []
    if body.system:
        out.append({"role": "system", "content": convert.text_content(body.system, "system")})
    for i, msg in enumerate(body.messages):
        if isinstance(msg.content, str):
            out.append({"role": msg.role, "content": msg.content})
        else:
            out += _turn(msg.role, msg.content, f"messages[{i}]")
    return out


def _turn(role: str, blocks: list[S.AnthropicBlock], where: str) -> list[dict[str, Any]]:
    texts, calls, results = [], [], []
    for j, block in enumerate(blocks):
        at = f"{where}.content[{j}]"
        if block.type == "text" and block.text is not None:
            texts.append(block.text)
        elif block.type == "tool_use" and role == "assistant" and block.id and block.name:
            calls.append({"id": block.id, "type": "function",
                          "function": {"name": block.name, "arguments": json.dumps(block.input or {})}})
        elif block.type == "tool_result" and role == "user" and block.tool_use_id:
            content = convert.text_content(block.content, at) if block.content is not None else ""
            results.append({"role": "tool", "tool_call_id": block.tool_use_id, "content": content})
        else:
            raise invalid(f"{at}: a {block.type!r} block is not supported in a {role} turn", at)
    turn: list[dict[str, Any]] = []
    if texts or calls:
        turn.append({"role": role, "content": "".join(texts), **({"tool_calls": calls} if calls else {})})
    return results + turn


def chat_tools(body: S.CountTokensRequest) -> list[dict[str, Any]] | None:
    if not body.tools or (body.tool_choice or {}).get("type") == "none":
        return None
    return [{"type": "function", "function": {k: v for k, v in (("name", t.name), ("description", t.description),
                                                                  ("parameters", t.input_schema)) if v is not None}}
            for t in body.tools]


def step_of(body: S.CountTokensRequest, state: ServerState) -> StepRequest:
    """The engine step for a Messages body (``count_tokens`` bodies carry no sampling)."""
    messages, tools = convert.engine_transcript(chat_messages(body), chat_tools(body), state.engine.supports_tools)
    if isinstance(body, S.MessagesRequest):
        return StepRequest(messages=messages, tools=tools, sampling=convert.sampling(body, body.max_tokens),
                           overrides=convert.overrides(body.kvmem, state.config))
    return StepRequest(messages=messages, tools=tools)


def usage(result: StepResult) -> dict[str, Any]:
    return {"input_tokens": result.prompt_tokens - result.cached_tokens, "output_tokens": result.completion_tokens,
            "cache_read_input_tokens": result.cached_tokens, "cache_creation_input_tokens": 0}


def tool_blocks(calls: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Parsed tool calls as ``tool_use`` blocks."""
    blocks = []
    for call in calls:
        fn = call["function"]
        args = json.loads(fn["arguments"]) if fn["arguments"].strip().startswith("{") else {}
        blocks.append({"type": "tool_use", "id": "toolu_" + call["id"].removeprefix("call_"), "name": fn["name"], "input": args})
    return blocks


def content_blocks(text: str, calls: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return ([{"type": "text", "text": text}] if text or not calls else []) + tool_blocks(calls)


async def create_message(request: web.Request) -> web.StreamResponse:
    state = request.app[STATE]
    body: S.MessagesRequest = await read_body(request, S.MessagesRequest)
    step = step_of(body, state)
    model = state.served_model(body.model)
    has_tools = chat_tools(body) is not None
    head = {"id": "msg_" + uuid.uuid4().hex, "type": "message", "role": "assistant", "model": model}
    if body.stream:
        return await _stream(request, state, step, head, has_tools)
    result = await state.run(step)
    text, calls = tools_format.parse_tool_calls(result.text) if has_tools else (result.text, [])
    return web.json_response({**head, "content": content_blocks(text, calls), "stop_sequence": None,
                              "stop_reason": "tool_use" if calls else STOP_REASONS[result.finish_reason],
                              "usage": usage(result), "kvmem": kvmem_info(result)})


async def count_tokens(request: web.Request) -> web.Response:
    state = request.app[STATE]
    body: S.CountTokensRequest = await read_body(request, S.CountTokensRequest)
    step = step_of(body, state)
    state.served_model(body.model)
    return web.json_response({"input_tokens": await state.engine.call("count_tokens", request=step)})


async def _stream(request: web.Request, state: ServerState, step: StepRequest, head: dict[str, Any],
                  has_tools: bool) -> web.StreamResponse:
    gen = state.stream(step)
    first = await first_item(gen)
    resp = await sse.open_stream(request)

    async def send(kind: str, **fields: Any) -> None:
        await resp.write(sse.frame({"type": kind, **fields}, event=kind))

    start_usage = {"input_tokens": 0, "output_tokens": 0}
    await send("message_start", message={**head, "content": [], "stop_reason": None, "stop_sequence": None, "usage": start_usage})
    await send("content_block_start", index=0, content_block={"type": "text", "text": ""})
    tool_filter = tools_format.ToolCallFilter() if has_tools else None
    try:
        item, calls = await sse.relay(
            gen, first, lambda text: send("content_block_delta", index=0, delta={"type": "text_delta", "text": text}), tool_filter)
        await send("content_block_stop", index=0)
        for index, block in enumerate(tool_blocks(calls), start=1):
            await send("content_block_start", index=index, content_block={**block, "input": {}})
            await send("content_block_delta", index=index, delta={"type": "input_json_delta", "partial_json": json.dumps(block["input"])})
            await send("content_block_stop", index=index)
        stop = "tool_use" if calls else STOP_REASONS[item.finish_reason]
        await send("message_delta", delta={"stop_reason": stop, "stop_sequence": None}, usage=usage(item))
        await send("message_stop")
    except (ConnectionResetError, ConnectionError):
        return resp
    except Exception as exc:
        await resp.write(sse.frame(anthropic_error(to_api_error(exc)), event="error"))
    return resp


def anthropic_error(err: APIError) -> dict[str, Any]:
    """Anthropic's error body for an API error (``to_api_error`` maps exceptions once, logging a 500 once)."""
    kind = {413: "request_too_large", 503: "overloaded_error"}.get(err.status, err.type if err.status < 500 else "api_error")
    return {"type": "error", "error": {"type": kind, "message": err.message, "code": err.code}}


def error_response(exc: BaseException) -> web.Response:
    err = to_api_error(exc)
    return web.json_response(anthropic_error(err), status=err.status, headers=err.headers)
