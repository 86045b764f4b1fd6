"""``--served-model-name``: the aliases a client may send as ``model``, and what ``/v1/models`` lists."""

from __future__ import annotations

import argparse
import json
from typing import Iterator

import pytest
from serving import AppClient

from kvmem import cmd_serve

ALIASES = ("gpt-4o-mini", "coder")
ENGINE_ID = "SmolLM2-135M-Instruct-Q4_1"


def chat(model: str) -> dict[str, object]:
    return {"model": model, "messages": [{"role": "user", "content": "hi"}]}


@pytest.fixture(scope="module")
def client() -> Iterator[AppClient]:
    c = AppClient(model_names=ALIASES)
    c.engine.model_id = ENGINE_ID  # as if the engine had loaded; steps still get 503, the model check runs first
    yield c
    c.close()


def test_models_lists_the_aliases_first(client: AppClient) -> None:
    status, _, body = client.request("GET", "/v1/models")
    assert status == 200 and [m["id"] for m in json.loads(body)["data"]] == [*ALIASES, ENGINE_ID]


@pytest.mark.parametrize(
    "path, body",
    [
        ("/v1/chat/completions", chat),
        ("/v1/completions", lambda m: {"model": m, "prompt": "x"}),
        ("/v1/responses", lambda m: {"model": m, "input": "x"}),
        ("/v1/messages", lambda m: {**chat(m), "max_tokens": 4}),
    ],
)
def test_every_alias_and_the_engine_id_are_served_and_others_are_404(client: AppClient, path: str, body) -> None:
    for model in (*ALIASES, ENGINE_ID, ""):
        status, _, reply = client.request("POST", path, json=body(model))
        assert status == 503, (model, reply)  # past the model check: no engine runs here
    status, _, reply = client.request("POST", path, json=body("gpt-9"))
    assert status == 404 and b"gpt-4o-mini" in reply


def test_without_aliases_only_the_engine_id_is_served() -> None:
    c = AppClient()
    try:
        c.engine.model_id = ENGINE_ID
        assert [m["id"] for m in json.loads(c.request("GET", "/v1/models")[2])["data"]] == [ENGINE_ID]
        assert c.request("POST", "/v1/chat/completions", json=chat("gpt-4o-mini"))[0] == 404
    finally:
        c.close()


def parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    cmd_serve.register(parser.add_subparsers())
    return parser.parse_args(["serve", *argv])


def test_the_flag_takes_commas_repeats_and_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    assert parse().served_model_name == []
    assert parse("--served-model-name", "a, b", "--served-model-name", "c").served_model_name == ["a", "b", "c"]
    monkeypatch.setenv("KVMEM_SERVED_MODEL_NAME", "x,y")
    assert parse().served_model_name == ["x", "y"]
    assert parse("--served-model-name", "z").served_model_name == ["z"]  # the flag replaces the env's list
