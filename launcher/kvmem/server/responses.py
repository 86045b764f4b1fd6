"""``/v1/responses``: the Responses API over the same engine step as chat.

A stored response keeps its full transcript (``instructions`` excluded, as the API says), so
a request with ``previous_response_id`` sends only the new input: the server rebuilds the
transcript, which renders to the same tokens as before, and the engine reuses their KV in
the previous response's workspace (and under its ``prompt_cache_key``, unless the request
names another).
"""

from __future__ import annotations

import time
import uuid
from typing import Any

import msgspec
from aiohttp import web

from kvmem.output_parser import Parsed, parse_output
from kvmem.server import convert, formats, sse
from kvmem.server import schemas as S
from kvmem.server.chat import cache_writes, first_item, kvmem_info, read_body, reasoning_tokens
from kvmem.server.errors import APIError, invalid, to_api_error
from kvmem.server.response_items import Events, OutputWriter, output_items
from kvmem.server.state import STATE, ServerState
from kvmem_core.contract import StepRequest, StepResult


def input_messages(items: str | list[S.InputItem]) -> list[dict[str, Any]]:
    """Responses input items as chat messages: function calls become assistant ``tool_calls``, function call
    outputs ``tool`` messages, and a reasoning item the ``reasoning_content`` of the assistant turn after it."""
    if isinstance(items, str):
        return [{"role": "user", "content": items}]
    out: list[dict[str, Any]] = []
    thought = ""
    for i, item in enumerate(items):
        if item.type == "reasoning":
            thought += "".join(
                p.text or "" for p in (item.content if isinstance(item.content, list) else item.summary or [])
            )
            continue
        msg = _input_message(item, f"input[{i}]", out)
        if msg is None:
            continue
        if thought and msg["role"] == "assistant":
            msg["reasoning_content"], thought = thought, ""
        out.append(msg)
    return out


def _input_message(item: S.InputItem, where: str, out: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The chat message of one input item; None when it joined the previous message (a parallel call)."""
    if item.type == "message":
        if item.role is None or item.role == "tool":
            raise invalid(f"{where} needs a role of user, assistant, system or developer", f"{where}.role")
        content = convert.text_content(item.content, where)
        if content is None:
            raise invalid(f"{where} needs content", f"{where}.content")
        return {"role": "system" if item.role == "developer" else item.role, "content": content}
    if item.type == "function_call":
        if not item.call_id or not item.name:
            raise invalid(f"{where}: a function_call needs call_id and name", where)
        call = {
            "id": item.call_id,
            "type": "function",
            "function": {"name": item.name, "arguments": item.arguments or "{}"},
        }
        if out and out[-1]["role"] == "assistant" and out[-1].get("tool_calls"):
            out[-1]["tool_calls"].append(call)
            return None
        return {"role": "assistant", "content": "", "tool_calls": [call]}
    if item.type == "function_call_output":
        output = convert.text_content(item.output, where) if item.output is not None else None
        if not item.call_id or output is None:
            raise invalid(f"{where}: a function_call_output needs call_id and output", where)
        return {"role": "tool", "tool_call_id": item.call_id, "content": output}
    raise invalid(f"{where}: input item type {item.type!r} is not supported", f"{where}.type")


def check_answered(history: list[dict[str, Any]]) -> None:
    """400, as OpenAI answers, when a function call of the conversation (a previous response's included) has no
    ``function_call_output``: the model would answer as if the call had run."""
    answered = {m.get("tool_call_id") for m in history if m["role"] == "tool"}
    for msg in history:
        for call in msg.get("tool_calls") or ():
            if call["id"] not in answered:
                raise invalid(f"No tool output found for function call {call['id']}.", "input", "missing_tool_output")


def chat_tools(tools: list[S.ResponsesTool] | None) -> list[dict[str, Any]] | None:
    """Flat Responses function tools as nested chat tools; hosted tools are refused."""
    if not tools:
        return None
    out = []
    for i, tool in enumerate(tools):
        if tool.type != "function" or not tool.name:
            raise invalid(f"tools[{i}]: only function tools with a name are supported", f"tools[{i}]")
        fn = {"name": tool.name, "description": tool.description, "parameters": tool.parameters, "strict": tool.strict}
        out.append({"type": "function", "function": {k: v for k, v in fn.items() if v is not None}})
    return out


class Turn:
    """One Responses request resolved against the store: transcript, step and the response skeleton."""

    def __init__(self, body: S.ResponsesRequest, state: ServerState) -> None:
        previous = state.responses.get(body.previous_response_id) if body.previous_response_id else None
        if body.previous_response_id and previous is None:
            raise APIError(
                404,
                f"previous response {body.previous_response_id!r} not found (was it stored?)",
                "previous_response_not_found",
                "previous_response_id",
            )
        self.body = body
        new = input_messages(body.input)
        if not new:
            raise invalid("input is empty", "input")
        self.history = (previous["transcript"] if previous else []) + new
        check_answered(self.history)
        self.tools = chat_tools(body.tools) if body.tool_choice != "none" else None
        head = [{"role": "system", "content": body.instructions}] if body.instructions else []
        transcript = head + self.history
        messages, engine_tools = convert.engine_transcript(transcript, self.tools, state.engine.chat_format)
        knobs = convert.overrides(body.kvmem, state.config, len(transcript), len(messages) - len(transcript))
        effort = body.reasoning.effort if body.reasoning else None
        kwargs, budget = convert.thinking(effort, body.chat_template_kwargs, body.reasoning_budget_tokens)
        before = previous["response"] if previous else {}
        self.cache_key = body.prompt_cache_key or before.get("prompt_cache_key")  # a chain keeps its key
        self.format = body.text.format if body.text else None
        grammar, trigger = formats.grammar(
            formats.requested(self.format), self.tools, body.tool_choice, state.engine.chat_format.tools
        )
        sampling = convert.sampling(body, body.max_output_tokens or state.max_tokens_default)
        self.step = StepRequest(
            messages=messages,
            tools=engine_tools,
            template_kwargs=kwargs,
            reasoning_budget=budget,
            sampling=formats.constrained(sampling, grammar, trigger),
            overrides=knobs,
            cache_key=self.cache_key,
            workspace_id=before.get("kvmem", {}).get("workspace_id"),
        )
        self.model = state.served_model(body.model)
        self.parser = state.engine.chat_format.parser(
            with_tools=self.tools is not None, declared=convert.tool_names(self.tools)
        )
        self.id = "resp_" + uuid.uuid4().hex
        self.created = time.time()

    def response(self, status: str, output: list[dict[str, Any]], result: StepResult | None) -> dict[str, Any]:
        b = self.body
        out = {
            "id": self.id,
            "object": "response",
            "created_at": self.created,
            "status": status,
            "model": self.model,
            "output": output,
            "parallel_tool_calls": True,
            "tool_choice": b.tool_choice or "auto",
            "tools": _builtins(b.tools),
            "error": None,
            "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
            "instructions": b.instructions,
            "metadata": b.metadata or {},
            "temperature": b.temperature,
            "top_p": b.top_p,
            "max_output_tokens": b.max_output_tokens,
            "previous_response_id": b.previous_response_id,
            "store": b.store,
            "text": {"format": echoed(self.format)},
            "truncation": "disabled",
            "usage": None,
            "prompt_cache_key": self.cache_key,
        }
        if result is not None:
            out["usage"] = {
                "input_tokens": result.prompt_tokens,
                "input_tokens_details": {
                    "cached_tokens": result.cached_tokens,
                    "cache_write_tokens": cache_writes(result),
                },
                "output_tokens": result.completion_tokens,
                "output_tokens_details": {"reasoning_tokens": reasoning_tokens(result)},
                "total_tokens": result.prompt_tokens + result.completion_tokens,
            }
            out["kvmem"] = kvmem_info(result)
        return out

    def finish(
        self, state: ServerState, result: StepResult, out: Parsed, output: list[dict[str, Any]]
    ) -> dict[str, Any]:
        """The final response object; stores it (with the grown transcript) when ``store`` is set."""
        status = "incomplete" if result.finish_reason == "length" else "completed"
        response = self.response(status, output, result)
        if self.body.store:
            reply: dict[str, Any] = {"role": "assistant", "content": out.content}
            if out.reasoning:
                reply["reasoning_content"] = out.reasoning
            if out.calls:
                reply["tool_calls"] = out.calls
            state.responses.put(self.id, response, self.history + [reply])
        return response


def echoed(fmt: S.TextFormat | None) -> dict[str, Any]:
    """``text.format`` as the response echoes it (a JSON schema format always with a name and a schema)."""
    if fmt is None:
        return {"type": "text"}
    out = {k: v for k, v in msgspec.to_builtins(fmt).items() if v is not None}
    if fmt.type == "json_schema":
        out = {"name": "response", "schema": {}, **out}
    return out


def _builtins(tools: list[S.ResponsesTool] | None) -> list[dict[str, Any]]:
    return msgspec.to_builtins(tools or [])


async def create_response(request: web.Request) -> web.StreamResponse:
    state = request.app[STATE]
    turn = Turn(await read_body(request, S.ResponsesRequest), state)
    if turn.body.stream:
        return await stream_response(request, state, turn)
    result = await state.run(turn.step)
    out = parse_output(result.text, turn.parser)
    return web.json_response(turn.finish(state, result, out, output_items(out)))


async def get_response(request: web.Request) -> web.Response:
    stored = request.app[STATE].responses.get(request.match_info["response_id"])
    if stored is None:
        raise _not_found(request.match_info["response_id"])
    return web.json_response(stored["response"])


async def delete_response(request: web.Request) -> web.Response:
    response_id = request.match_info["response_id"]
    if not request.app[STATE].responses.delete(response_id):
        raise _not_found(response_id)
    return web.json_response({"id": response_id, "object": "response", "deleted": True})


def _not_found(response_id: str) -> APIError:
    return APIError(404, f"response {response_id!r} not found", "response_not_found")


async def stream_response(request: web.Request, state: ServerState, turn: Turn) -> web.StreamResponse:
    """The SSE stream of one response: lifecycle events around its output items as they form."""
    gen = state.stream(turn.step)
    first = await first_item(gen)
    ev = Events(await sse.open_stream(request))
    await ev.send("response.created", response=turn.response("in_progress", [], None))
    await ev.send("response.in_progress", response=turn.response("in_progress", [], None))
    writer = OutputWriter(ev)
    try:
        result = await sse.relay(gen, first, writer.write, turn.parser)
        output = await writer.close()
        response = turn.finish(state, result, writer.parsed, output)
        await ev.send(f"response.{response['status']}", response=response)  # completed, or incomplete as OpenAI's
    except (ConnectionResetError, ConnectionError):
        return ev.resp
    except Exception as exc:
        err = to_api_error(exc)
        await ev.send("error", message=err.message, code=err.code, param=err.param, **err.body())
    return ev.resp
