"""Agent frameworks, unchanged, against a live ``kvmem serve`` on the small test model: openai-agents,
langchain-openai, pydantic-ai and litellm, through chat, streaming, tools, the Responses API and structured output
(``output_type``, ``with_structured_output``). A ``WireTap`` between each library and the server checks every
reply and stream event against the openai SDK's own types: a protocol error fails the test. What the small model
answers is not judged, and a library's own stop when a repeating model never finishes its tool loop (a max-turns
error), or when a sampled answer runs to the token limit (openai-agents refuses an incomplete Responses stream),
is not a protocol error. One quick pattern per library runs by default; the rest are ``slow``."""

from __future__ import annotations

import asyncio
import os
from typing import Any, Iterator, Literal

import pytest
from pydantic import BaseModel
from model_support import SMALL_MODEL
from serving import LiveServer
from wire_tap import WireTap

from kvmem.models import DEFAULT

pytestmark = pytest.mark.llamacpp
os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")  # litellm would fetch its price list at import
MODEL = "agent-model"  # --served-model-name: what every library asks for
ASK = "Name one planet of the solar system."


class City(BaseModel):
    name: str
    country: str
    climate: Literal["cold", "mild", "hot"]


def get_weather(city: str) -> str:
    """The weather in a city."""
    return f"It is sunny in {city}."


@pytest.fixture(scope="module", params=[SMALL_MODEL, pytest.param(DEFAULT.name, marks=pytest.mark.slow)])
def server(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    """The test model by default; the default model (which writes calls in its template's own syntax) with --slow."""
    live = LiveServer(
        tmp_path_factory.mktemp("clients"),
        "--no-ui",
        "--ctx",
        "4096",
        "--max-tokens-default",
        "256",
        "--served-model-name",
        MODEL,
        "--model",
        request.param,
    ).start()
    yield live
    live.stop()


@pytest.fixture
def tap(server: LiveServer) -> Iterator[WireTap]:
    wire = WireTap(server.url)
    yield wire
    wire.close()
    assert wire.problems == [], "\n".join(wire.problems)


def checked(tap: WireTap, *routes: str) -> None:
    """The test's traffic went through ``routes`` (so the tap saw and checked it)."""
    assert all(tap.seen.get(route) for route in routes), tap.seen


# ---- openai-agents -----------------------------------------------------------------------------------------


def agents_model(tap: WireTap, responses: bool) -> Any:
    import agents
    from openai import AsyncOpenAI

    agents.set_tracing_disabled(True)
    client = AsyncOpenAI(base_url=tap.url + "/v1", api_key="none", max_retries=0)
    if responses:
        return agents.OpenAIResponsesModel(model=MODEL, openai_client=client)
    return agents.OpenAIChatCompletionsModel(model=MODEL, openai_client=client)


def run_agent(agent: Any, *asks: tuple[str, bool]) -> list[Any]:
    """Each (ask, streamed) through ``Runner.run`` or ``run_streamed`` (drained), in one event loop (the client's);
    the final outputs, None where the library stopped a repeating model or one whose answer reached the limit."""
    import agents

    async def one(ask: str, streamed: bool) -> Any:
        try:
            if not streamed:
                return (await agents.Runner.run(agent, ask, max_turns=3)).final_output
            run = agents.Runner.run_streamed(agent, ask, max_turns=3)
            async for _ in run.stream_events():
                pass
            return run.final_output
        except agents.MaxTurnsExceeded:
            return None
        except agents.ModelBehaviorError as exc:  # the library's stop when a sampled answer ran to the token limit
            if "max_output_tokens" not in str(exc):  # (the Responses stream's ``response.incomplete``, as OpenAI's)
                raise
            return None

    async def all_of() -> list[Any]:
        return [await one(ask, streamed) for ask, streamed in asks]

    return asyncio.run(all_of())


@pytest.mark.parametrize("responses", [False, True], ids=["chat", "responses"])
def test_openai_agents_output_type(tap: WireTap, responses: bool) -> None:
    import agents

    agent = agents.Agent(
        name="geo", instructions="Describe the city.", model=agents_model(tap, responses), output_type=City
    )
    assert all(isinstance(out, City) for out in run_agent(agent, ("Oslo", False), ("Lima", True)))
    checked(tap, "/v1/responses" if responses else "/v1/chat/completions")


@pytest.mark.slow
@pytest.mark.parametrize("responses", [False, True], ids=["chat", "responses"])
def test_openai_agents_tools_and_streaming(tap: WireTap, responses: bool) -> None:
    import agents

    agent = agents.Agent(
        name="helper",
        instructions="Answer briefly; use tools when they help.",
        model=agents_model(tap, responses),
        tools=[agents.function_tool(get_weather)],
    )
    run_agent(agent, ("What is the weather in Oslo?", False), ("What is the weather in Lima?", True), (ASK, True))
    checked(tap, "/v1/responses" if responses else "/v1/chat/completions")


# ---- langchain-openai --------------------------------------------------------------------------------------


def chat_model(tap: WireTap, **extra: Any) -> Any:
    from langchain_openai import ChatOpenAI

    return ChatOpenAI(model=MODEL, base_url=tap.url + "/v1", api_key="none", temperature=0, max_retries=0, **extra)


def test_langchain_with_structured_output(tap: WireTap) -> None:
    assert isinstance(chat_model(tap).with_structured_output(City).invoke("Describe Lima."), City)
    checked(tap, "/v1/chat/completions")


@pytest.mark.slow
def test_langchain_invoke_stream_tools_and_responses(tap: WireTap) -> None:
    llm = chat_model(tap)
    assert isinstance(llm.invoke(ASK).content, str)
    assert "".join(str(chunk.content) for chunk in llm.stream(ASK))
    llm.bind_tools([get_weather]).invoke("What is the weather in Oslo?")
    llm.bind_tools([get_weather], tool_choice="get_weather").invoke("What is the weather in Oslo?").tool_calls[0]
    responses = chat_model(tap, use_responses_api=True)
    assert responses.invoke(ASK).content is not None
    assert isinstance(responses.with_structured_output(City).invoke("Describe Lima."), City)
    checked(tap, "/v1/chat/completions", "/v1/responses")


# ---- pydantic-ai -------------------------------------------------------------------------------------------


def pydantic_model(tap: WireTap, responses: bool) -> Any:
    from pydantic_ai.models.openai import OpenAIChatModel, OpenAIResponsesModel
    from pydantic_ai.providers.openai import OpenAIProvider

    provider = OpenAIProvider(base_url=tap.url + "/v1", api_key="none")
    return (OpenAIResponsesModel if responses else OpenAIChatModel)(MODEL, provider=provider)


def run_pydantic(agent: Any, ask: str) -> Any:
    """``Agent.run_sync``'s output; None when the library gave up on a repeating model (too many retries)."""
    from pydantic_ai.exceptions import UnexpectedModelBehavior, UsageLimitExceeded

    try:
        return agent.run_sync(ask).output
    except (UnexpectedModelBehavior, UsageLimitExceeded):
        return None


def test_pydantic_ai_text(tap: WireTap) -> None:
    from pydantic_ai import Agent

    assert isinstance(run_pydantic(Agent(pydantic_model(tap, False)), ASK), str)
    checked(tap, "/v1/chat/completions")


@pytest.mark.slow
@pytest.mark.parametrize("responses", [False, True], ids=["chat", "responses"])
def test_pydantic_ai_output_type_and_tools(tap: WireTap, responses: bool) -> None:
    from pydantic_ai import Agent, NativeOutput

    model = pydantic_model(tap, responses)
    assert isinstance(run_pydantic(Agent(model, output_type=NativeOutput(City)), "Describe Oslo."), City)
    run_pydantic(Agent(model, output_type=City), "Describe Oslo.")  # a tool call the model may or may not make
    run_pydantic(Agent(model, tools=[get_weather]), "What is the weather in Oslo?")
    checked(tap, "/v1/responses" if responses else "/v1/chat/completions")


# ---- litellm -----------------------------------------------------------------------------------------------


def litellm_args(tap: WireTap) -> dict[str, Any]:
    return {"model": f"openai/{MODEL}", "api_base": tap.url + "/v1", "api_key": "none", "temperature": 0}


def test_litellm_completion_and_stream(tap: WireTap) -> None:
    import litellm

    messages = [{"role": "user", "content": ASK}]
    assert litellm.completion(messages=messages, **litellm_args(tap)).choices[0].message.content
    assert "".join(
        c.choices[0].delta.content or ""
        for c in litellm.completion(messages=messages, stream=True, **litellm_args(tap))
    )
    checked(tap, "/v1/chat/completions")


@pytest.mark.slow
def test_litellm_tools_responses_and_json_schema(tap: WireTap) -> None:
    import litellm

    tools = [
        {
            "type": "function",
            "function": {
                "name": "get_weather",
                "description": "The weather in a city",
                "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
            },
        }
    ]
    ask = [{"role": "user", "content": "What is the weather in Oslo?"}]
    litellm.completion(messages=ask, tools=tools, **litellm_args(tap))
    done = litellm.completion(messages=ask, tools=tools, tool_choice="required", **litellm_args(tap))
    assert done.choices[0].message.tool_calls[0].function.name == "get_weather"
    parsed = litellm.completion(
        messages=[{"role": "user", "content": "Describe Lima."}], response_format=City, **litellm_args(tap)
    )
    City.model_validate_json(parsed.choices[0].message.content)
    assert litellm.responses(input=ASK, **litellm_args(tap)).output
    checked(tap, "/v1/chat/completions", "/v1/responses")
