"""Faults against a live server: client disconnects, a killed engine, a flood of clients."""

from __future__ import annotations

import concurrent.futures as cf
import os
import signal
import time
from typing import Iterator

import openai
import pytest
import requests
from disk_support import small_tmpfs
from serving import LiveServer, get_json

pytestmark = pytest.mark.llamacpp
SYSTEM = "You are a careful assistant. " + " ".join(f"Rule {i}: answer in plain words." for i in range(40))


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    root = tmp_path_factory.mktemp("faults")
    live = LiveServer(
        root,
        "--no-ui",
        "--max-queue",
        "4",
        "--ctx",
        "4096",
        "--kvmem-budget",
        "1024",
        "--kvmem-recent-tokens",
        "256",
        "--kvmem-nvme-dir",
        str(root / "nvme"),
    ).start()
    yield live
    live.stop()


@pytest.fixture(scope="module")
def client(server: LiveServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0)


def engine_metric(server: LiveServer, name: str) -> float:
    text = requests.get(server.url + "/metrics", timeout=5).text
    return next(
        (float(ln.rsplit(" ", 1)[1]) for ln in text.splitlines() if ln.startswith(f"kvmem_engine_{name} ")), 0.0
    )


def long_answer_stream(server: LiveServer) -> requests.Response:
    body = {
        "messages": [{"role": "user", "content": "Tell me a very long story about a dragon."}],
        "max_tokens": 400,
        "temperature": 0,
        "stream": True,
    }
    resp = requests.post(server.url + "/v1/chat/completions", json=body, stream=True, timeout=60)
    assert resp.status_code == 200
    return resp


def test_client_disconnect_aborts_the_step(server: LiveServer, client: openai.OpenAI) -> None:
    engine_pid = server.health()["engine_pid"]
    resp = long_answer_stream(server)
    lines = resp.iter_lines()
    for _ in range(6):
        next(lines)
    resp.close()
    started = time.monotonic()
    done = client.chat.completions.create(
        model="", messages=[{"role": "user", "content": "Hi"}], max_tokens=4, temperature=0
    )
    assert done.choices[0].message.content
    assert time.monotonic() - started < 4.0  # the 400-token answer alone would take ~9 s
    assert server.health()["engine_pid"] == engine_pid


def test_a_plain_request_abandoned_by_its_client_is_aborted(server: LiveServer, client: openai.OpenAI) -> None:
    body = {
        "messages": [{"role": "user", "content": "Tell me a very long story about a cat."}],
        "max_tokens": 400,
        "temperature": 0,
    }
    with pytest.raises(requests.exceptions.Timeout):
        requests.post(server.url + "/v1/chat/completions", json=body, timeout=1.0)
    started = time.monotonic()
    client.chat.completions.create(model="", messages=[{"role": "user", "content": "Hi"}], max_tokens=4, temperature=0)
    assert time.monotonic() - started < 4.0


def test_a_client_gone_during_prefill_frees_the_engine_within_a_chunk_and_keeps_its_blocks(
    server: LiveServer, client: openai.OpenAI
) -> None:
    notes = " ".join(f"Remark {i}: build step {i} failed twice." for i in range(210))  # ~3K tokens, 6 chunks of 512
    body = {"messages": [{"role": "user", "content": "Summarize. " + notes}], "max_tokens": 4, "temperature": 0}
    stored_before = engine_metric(server, "blocks_stored")
    with pytest.raises(requests.exceptions.Timeout):
        requests.post(server.url + "/v1/chat/completions", json=body, timeout=0.5)  # gone during the prefill
    client.chat.completions.create(model="", messages=[{"role": "user", "content": "Hi"}], max_tokens=2, temperature=0)
    stored_by_abort = engine_metric(server, "blocks_stored") - stored_before
    text_tokens = requests.post(
        server.url + "/v1/tokenize", json={"content": body["messages"][0]["content"]}, timeout=30
    )
    prompt_blocks = len(text_tokens.json()["tokens"]) // 64
    assert 8 <= stored_by_abort < prompt_blocks - 8  # the chunks done stay stored; the rest was never prefilled
    workspaces = get_json(server.url + "/v1/kvmem/workspaces")[1]["data"]
    assert any(w["tokens"] == stored_by_abort * 64 for w in workspaces)  # in the conversation's workspace


def test_killed_engine_fails_the_stream_restarts_and_reuses_nvme_kv(server: LiveServer, client: openai.OpenAI) -> None:
    turn1 = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Say yes."}]
    first = client.chat.completions.create(model="", messages=turn1, max_tokens=4, temperature=0)
    ws_id = first.model_extra["kvmem"]["workspace_id"]
    deadline = time.monotonic() + 60  # 10 s ran out once, on a loaded VM
    while get_json(f"{server.url}/v1/kvmem/workspaces/{ws_id}")[1]["totals"]["nvme_blocks"] == 0:
        assert time.monotonic() < deadline, "no block reached the NVMe tier"
        time.sleep(0.2)
    old_pid = server.health()["engine_pid"]
    stream = client.chat.completions.create(
        model="",
        messages=[{"role": "user", "content": "Tell me a very long story."}],
        max_tokens=400,
        temperature=0,
        stream=True,
    )
    with pytest.raises(openai.APIError, match="exited"):
        for i, _ in enumerate(stream):
            if i == 3:
                os.kill(old_pid, signal.SIGKILL)
    statuses = []
    deadline = time.monotonic() + 120
    while True:
        try:
            turn2 = turn1 + [
                {"role": "assistant", "content": first.choices[0].message.content},
                {"role": "user", "content": "Say no."},
            ]
            second = client.chat.completions.create(model="", messages=turn2, max_tokens=4, temperature=0)
            break
        except openai.APIStatusError as exc:
            statuses.append(exc.status_code)
            assert exc.status_code == 503 and exc.response.headers["Retry-After"]
            assert time.monotonic() < deadline
            time.sleep(0.3)
    health = server.health()
    assert health["engine_pid"] != old_pid and health["status"] == "ok"
    assert second.usage.prompt_tokens_details.cached_tokens >= 128
    text = requests.get(server.url + "/metrics", timeout=5).text
    assert "kvmem_engine_restarts_total 1.0" in text.splitlines()


def test_32_clients_on_a_queue_of_4(server: LiveServer, client: openai.OpenAI) -> None:
    def ask(i: int) -> int:
        try:
            client.chat.completions.create(
                model="", messages=[{"role": "user", "content": f"Number {i}?"}], max_tokens=4
            )
            return 200
        except openai.APIStatusError as exc:
            assert exc.response.headers.get("Retry-After") == "1"
            return exc.status_code

    before = requests.get(server.url + "/metrics", timeout=5).text
    with cf.ThreadPoolExecutor(32) as pool:
        codes = list(pool.map(ask, range(32)))
    assert len(codes) == 32 and set(codes) <= {200, 429}
    assert codes.count(200) >= 5 and codes.count(429) >= 1
    after = requests.get(server.url + "/metrics", timeout=5).text
    key = 'kvmem_requests_total{route="/v1/chat/completions",status="429"}'

    def count(text: str) -> float:
        return next((float(ln.rsplit(" ", 1)[1]) for ln in text.splitlines() if ln.startswith(key)), 0.0)

    assert count(after) - count(before) == codes.count(429)


def test_stored_responses_and_their_kv_outlive_a_server_restart(tmp_path) -> None:
    flags = ("--no-ui", "--ctx", "4096", "--kvmem-budget", "1024", "--kvmem-nvme-dir", str(tmp_path / "nvme"))
    first_server = LiveServer(tmp_path / "a", *flags).start()
    try:
        client = openai.OpenAI(base_url=first_server.url + "/v1", api_key="none", max_retries=0)
        first = client.responses.create(model="", input="Name one ocean. " + SYSTEM, max_output_tokens=6, temperature=0)
    finally:
        first_server.stop()
    second_server = LiveServer(tmp_path / "b", *flags).start()
    try:
        client = openai.OpenAI(base_url=second_server.url + "/v1", api_key="none", max_retries=0)
        assert client.responses.retrieve(first.id).output_text == first.output_text
        second = client.responses.create(
            model="", input="Another one?", previous_response_id=first.id, max_output_tokens=6, temperature=0
        )
        assert second.usage.input_tokens_details.cached_tokens >= 256  # the first turn's blocks, read from disk
        client.responses.delete(first.id)
        with pytest.raises(openai.NotFoundError):
            client.responses.retrieve(first.id)
    finally:
        second_server.stop()


def test_a_full_disk_turns_the_nvme_tier_off_and_every_turn_is_answered(tmp_path) -> None:
    """The fault of the issue on a real small filesystem: an agent conversation of 7 growing turns on a disk that
    fills up. Every turn is answered by the same engine, the tier counts its fault; once space returns the
    waiting blocks land, and after a restart the conversation's KV is read from disk."""
    with small_tmpfs(tmp_path / "mnt", "24m") as mount:
        ballast = mount / "ballast"
        ballast.write_bytes(b"\0" * (20 << 20))  # 4 MB left: two or three SmolLM2 blocks
        flags = ("--no-ui", "--ctx", "4096", "--kvmem-budget", "1024", "--kvmem-nvme-dir", str(mount / "nvme"))
        live = LiveServer(tmp_path / "a", *flags, env={"KVMEM_NVME_RETRY_S": "1"}).start()
        try:
            client = openai.OpenAI(base_url=live.url + "/v1", api_key="none", max_retries=0, timeout=60)
            pid = live.health()["engine_pid"]
            messages = [{"role": "system", "content": SYSTEM}]
            for turn in range(7):
                messages.append({"role": "user", "content": f"Step {turn}: " + "list the files again. " * 12})
                answer = client.chat.completions.create(model="", messages=messages, max_tokens=4, temperature=0)
                messages.append({"role": "assistant", "content": answer.choices[0].message.content})
            assert live.health()["engine_pid"] == pid
            assert engine_metric(live, "store_nvme_faults") >= 1  # off, or retrying every second meanwhile
            ballast.unlink()
            time.sleep(1.1)
            client.chat.completions.create(model="", messages=[{"role": "user", "content": "Hi"}], max_tokens=2)
            deadline = time.monotonic() + 30
            while engine_metric(live, "store_nvme_waiting_blocks") > 0:  # refreshed by each answer
                assert time.monotonic() < deadline, "the waiting blocks never reached the disk"
                client.chat.completions.create(model="", messages=[{"role": "user", "content": "Hi"}], max_tokens=2)
            assert engine_metric(live, "store_nvme_offline") == 0 and live.health()["engine_pid"] == pid
        finally:
            live.stop()
        again = LiveServer(tmp_path / "b", *flags).start()
        try:
            client = openai.OpenAI(base_url=again.url + "/v1", api_key="none", max_retries=0, timeout=60)
            reply = client.chat.completions.create(model="", messages=messages[:-1], max_tokens=4, temperature=0)
            assert reply.usage.prompt_tokens_details.cached_tokens >= reply.usage.prompt_tokens - 128
        finally:
            again.stop()
