"""``/v1/messages`` and ``/v1/messages/count_tokens``: the Anthropic Messages subset.

Text, ``system``, tools (``tool_use`` / ``tool_result`` blocks) and streaming over the same
engine step as chat. Usage follows Anthropic's split: ``input_tokens`` counts only the
tokens not read from the cache, ``cache_read_input_tokens`` the prefix hits.
"""

from __future__ import annotations

import json
import uuid
from typing import Any, Awaitable, Callable

from aiohttp import web

from kvmem.output_parser import OutputParser, Parsed, parse_output
from kvmem.server import convert, formats, sse
from kvmem.server import schemas as S
from kvmem.server.chat import first_item, kvmem_info, read_body
from kvmem.server.errors import APIError, invalid, to_api_error
from kvmem.server.state import STATE, ServerState
from kvmem.tool_syntax import Item
from kvmem_core.contract import StepRequest, StepResult

STOP_REASONS = {"length": "max_tokens", "stop": "end_turn", "abort": "end_turn"}


def stop_reason(result: StepResult, called: bool) -> str:
    """Anthropic's stop reason: ``max_tokens`` whenever the limit cut the answer (a tool use in it may be cut
    short), else ``tool_use`` for an answer that calls tools."""
    return "tool_use" if called and result.finish_reason != "length" else STOP_REASONS[result.finish_reason]


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
    texts, thoughts, calls, results = [], [], [], []
    for j, block in enumerate(blocks):
        at = f"{where}.content[{j}]"
        if block.type == "text" and block.text is not None:
            texts.append(block.text)
        elif block.type == "thinking" and role == "assistant" and block.thinking is not None:
            thoughts.append(block.thinking)
        elif block.type == "tool_use" and role == "assistant" and block.id and block.name:
            calls.append(
                {
                    "id": block.id,
                    "type": "function",
                    "function": {"name": block.name, "arguments": json.dumps(block.input or {})},
                }
            )
        elif block.type == "tool_result" and role == "user" and block.tool_use_id:
            content = convert.text_content(block.content, at) if block.content is not None else ""
            results.append({"role": "tool", "tool_call_id": block.tool_use_id, "content": content})
        else:
            raise invalid(f"{at}: a {block.type!r} block is not supported in a {role} turn", at)
    turn: list[dict[str, Any]] = []
    if texts or calls:
        turn.append(
            {
                "role": role,
                "content": "".join(texts),
                **({"tool_calls": calls} if calls else {}),
                **({"reasoning_content": "".join(thoughts)} if thoughts else {}),
            }
        )
    return results + turn


def chat_tools(body: S.CountTokensRequest) -> list[dict[str, Any]] | None:
    if not body.tools or (body.tool_choice or {}).get("type") == "none":
        return None
    return [
        {
            "type": "function",
            "function": {
                k: v
                for k, v in (
                    ("name", t.name),
                    ("description", t.description),
                    ("parameters", t.input_schema),
                    ("strict", t.strict),
                )
                if v is not None
            },
        }
        for t in body.tools
    ]


def step_of(body: S.CountTokensRequest, state: ServerState) -> StepRequest:
    """The engine step for a Messages body (``count_tokens`` bodies carry no sampling)."""
    turns = chat_messages(body)
    messages, tools = convert.engine_transcript(turns, chat_tools(body), state.engine.chat_format)
    kwargs, budget = convert.thinking(
        None, thinking_kwargs(body.thinking), body.thinking and body.thinking.budget_tokens
    )
    if isinstance(body, S.MessagesRequest):
        knobs = convert.overrides(body.kvmem, state.config, len(turns), len(messages) - len(turns))
        offered = chat_tools(body)
        grammar, trigger = formats.grammar(
            formats.requested(body.output_format),
            offered,
            anthropic_choice(body.tool_choice),
            state.engine.chat_format.tools,
        )
        return StepRequest(
            messages=messages,
            tools=tools,
            template_kwargs=kwargs,
            reasoning_budget=budget,
            sampling=formats.constrained(convert.sampling(body, body.max_tokens), grammar, trigger),
            overrides=knobs,
        )
    return StepRequest(messages=messages, tools=tools, template_kwargs=kwargs)


def anthropic_choice(choice: dict[str, Any] | None) -> str | dict[str, Any] | None:
    """Messages' ``tool_choice`` in chat's terms: ``any`` is ``required``, ``tool`` names one function."""
    kind = (choice or {}).get("type")
    if kind == "any":
        return "required"
    return {"type": "function", "function": {"name": choice.get("name")}} if kind == "tool" and choice else None


def thinking_kwargs(thinking: S.AnthropicThinking | None) -> dict[str, Any]:
    """Anthropic's ``thinking`` switch as the template's ``enable_thinking`` (unset when the request has none)."""
    return {} if thinking is None else {"enable_thinking": thinking.type == "enabled"}


def usage(result: StepResult) -> dict[str, Any]:
    return {
        "input_tokens": result.prompt_tokens - result.cached_tokens,
        "output_tokens": result.completion_tokens,
        "cache_read_input_tokens": result.cached_tokens,
        "cache_creation_input_tokens": 0,
    }


def tool_block(call: dict[str, Any]) -> dict[str, Any]:
    """A parsed tool call as a ``tool_use`` block."""
    fn = call["function"]
    args = json.loads(fn["arguments"]) if fn["arguments"].strip().startswith("{") else {}
    return {"type": "tool_use", "id": "toolu_" + call["id"].removeprefix("call_"), "name": fn["name"], "input": args}


def content_blocks(out: Parsed) -> list[dict[str, Any]]:
    """A whole answer's blocks: its thinking, its text (also an empty one, unless it only calls tools), its tool
    uses."""
    blocks = [{"type": "thinking", "thinking": out.reasoning, "signature": ""}] if out.reasoning else []
    if out.content or not out.calls:
        blocks.append({"type": "text", "text": out.content})
    return blocks + [tool_block(c) for c in out.calls]


async def create_message(request: web.Request) -> web.StreamResponse:
    state = request.app[STATE]
    body: S.MessagesRequest = await read_body(request, S.MessagesRequest)
    step = step_of(body, state)
    model = state.served_model(body.model)
    tools = chat_tools(body)
    parser = state.engine.chat_format.parser(with_tools=tools is not None, declared=convert.tool_names(tools))
    head = {"id": "msg_" + uuid.uuid4().hex, "type": "message", "role": "assistant", "model": model}
    if body.stream:
        return await _stream(request, state, step, head, parser)
    result = await state.run(step)
    out = parse_output(result.text, parser)
    return web.json_response(
        {
            **head,
            "content": content_blocks(out),
            "stop_sequence": None,
            "stop_reason": stop_reason(result, bool(out.calls)),
            "usage": usage(result),
            "kvmem": kvmem_info(result),
        }
    )


async def count_tokens(request: web.Request) -> web.Response:
    state = request.app[STATE]
    body: S.CountTokensRequest = await read_body(request, S.CountTokensRequest)
    step = step_of(body, state)
    state.served_model(body.model)
    return web.json_response({"input_tokens": await state.engine.call("count_tokens", request=step)})


class Blocks:
    """Streams content blocks as the parser's items arrive: a thinking or text block opens with its first
    piece and stops when another kind begins; a tool use is sent whole once its call is complete."""

    DELTAS = {"thinking": ("thinking_delta", "thinking"), "text": ("text_delta", "text")}

    def __init__(self, send: Callable[..., Awaitable[None]]) -> None:
        self.send = send
        self.count = 0
        self.open: str | None = None
        self.calls = 0
        self.answered = False  # a text block or a tool use was sent

    async def write(self, item: Item) -> None:
        kind, value = item
        if kind == "call":
            await self._stop()
            block = tool_block(value)
            await self.send("content_block_start", index=self.count, content_block={**block, "input": {}})
            await self.send(
                "content_block_delta",
                index=self.count,
                delta={"type": "input_json_delta", "partial_json": json.dumps(block["input"])},
            )
            await self.send("content_block_stop", index=self.count)
            self.count, self.calls, self.answered = self.count + 1, self.calls + 1, True
            return
        kind = "thinking" if kind == "reasoning" else "text"
        if self.open != kind:
            await self._stop()
            start = {"type": kind, kind: "", **({"signature": ""} if kind == "thinking" else {})}
            await self.send("content_block_start", index=self.count, content_block=start)
            self.open, self.answered = kind, self.answered or kind == "text"
        delta_type, field = self.DELTAS[kind]
        await self.send("content_block_delta", index=self.count, delta={"type": delta_type, field: value})

    async def close(self) -> None:
        if not self.answered:  # an answer without calls has a text block, be it empty
            await self.write(("content", ""))
        await self._stop()

    async def _stop(self) -> None:
        if self.open is not None:
            await self.send("content_block_stop", index=self.count)
            self.open, self.count = None, self.count + 1


async def _stream(
    request: web.Request, state: ServerState, step: StepRequest, head: dict[str, Any], parser: OutputParser
) -> web.StreamResponse:
    gen = state.stream(step)
    first = await first_item(gen)
    resp = await sse.open_stream(request)

    async def send(kind: str, **fields: Any) -> None:
        await resp.write(sse.frame({"type": kind, **fields}, event=kind))

    start_usage = {"input_tokens": 0, "output_tokens": 0}
    await send(
        "message_start",
        message={**head, "content": [], "stop_reason": None, "stop_sequence": None, "usage": start_usage},
    )
    blocks = Blocks(send)
    try:
        item = await sse.relay(gen, first, blocks.write, parser)
        await blocks.close()
        stop = stop_reason(item, bool(blocks.calls))
        await send("message_delta", delta={"stop_reason": stop, "stop_sequence": None}, usage=usage(item))
        await send("message_stop")
    except (ConnectionResetError, ConnectionError):
        return resp
    except Exception as exc:
        await resp.write(sse.frame(anthropic_error(to_api_error(exc)), event="error"))
    return resp


def anthropic_error(err: APIError) -> dict[str, Any]:
    """Anthropic's error body for an API error (``to_api_error`` maps exceptions once, logging a 500 once)."""
    kind = {413: "request_too_large", 503: "overloaded_error"}.get(
        err.status, err.type if err.status < 500 else "api_error"
    )
    return {"type": "error", "error": {"type": kind, "message": err.message, "code": err.code}}


def error_response(exc: BaseException) -> web.Response:
    err = to_api_error(exc)
    return web.json_response(anthropic_error(err), status=err.status, headers=err.headers)
