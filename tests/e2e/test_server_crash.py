"""A live ``kvmem serve`` with an NVMe directory whose engine is killed with SIGKILL mid-conversation, at a
different point of a turn each time (prefill, archive and NVMe writes, decode): after the engine restarts the
conversation goes on, every answered turn's blocks reused from disk, no stored block failing its check, no
orphan file left behind."""

from __future__ import annotations

import json
import os
import random
import signal
import threading
import time
from pathlib import Path
from typing import Any

import openai
import pytest
import requests
from serving import LiveServer

pytestmark = [pytest.mark.llamacpp, pytest.mark.slow]
BLOCK = 64
KILLS = 3


def metric(server: LiveServer, name: str) -> float:
    text = requests.get(server.url + "/metrics", timeout=5).text
    return next((float(ln.rsplit(" ", 1)[1]) for ln in text.splitlines() if ln.startswith(f"{name} ")), 0.0)


def on_disk(nvme: Path, ws_id: str, blocks: int, timeout: float = 30) -> None:
    """Wait until the workspace's manifest on disk names ``blocks`` blocks and their files are there: what an
    answered turn leaves for a restart (the writes run in the background, so a kill in the moment after an
    answer may still cost its last blocks, recomputed then)."""
    deadline = time.monotonic() + timeout
    while True:
        manifest = next(nvme.glob(f"*/workspaces/{ws_id}.json"), None)
        hashes = json.loads(manifest.read_text())["hashes"] if manifest is not None else []
        if len(hashes) >= blocks and all(next(nvme.glob(f"*/blocks/{h}.kvb"), None) for h in hashes):
            return
        assert time.monotonic() < deadline, f"{len(hashes)} of {blocks} blocks on disk"
        time.sleep(0.2)


def answer(client: openai.OpenAI, messages: list[dict[str, str]], deadline: float) -> tuple[Any, int]:
    """The turn's answer, asked again while the engine restarts (503 with Retry-After); and how many asks failed."""
    failed = 0
    while True:
        try:
            return client.chat.completions.create(model="", messages=messages, max_tokens=8, temperature=0), failed
        except (openai.APIStatusError, openai.APIConnectionError) as exc:
            failed += 1
            if isinstance(exc, openai.APIStatusError):
                assert exc.status_code == 503 and exc.response.headers["Retry-After"], exc
            assert time.monotonic() < deadline, "the engine did not come back"
            time.sleep(0.3)


def kill_point(rng: random.Random, kill: int, turn_s: float) -> float:
    """Seconds into a turn for kill ``kill`` (0-based) of ``KILLS``: one in each of ``KILLS`` equal slices of 5-90 %
    of a turn's time, so early kills land in the prefill and late ones in decode and the writes after it; the
    later turns, with more history, take no less time than the first (``turn_s``)."""
    return (0.05 + 0.85 * (kill + rng.random()) / KILLS) * turn_s


def kill_later(pid: int, delay: float) -> threading.Timer:
    timer = threading.Timer(delay, os.kill, (pid, signal.SIGKILL))
    timer.start()
    return timer


def test_an_engine_killed_mid_conversation_comes_back_with_every_answered_turn(tmp_path: Path) -> None:
    nvme = tmp_path / "nvme"
    live = LiveServer(
        tmp_path / "run", "--no-ui", "--ctx", "8192", "--kvmem-budget", "4096", "--kvmem-nvme-dir", str(nvme)
    ).start()
    rng = random.Random(32)
    try:
        client = openai.OpenAI(base_url=live.url + "/v1", api_key="none", max_retries=0, timeout=120)
        messages = [{"role": "system", "content": "You are a build agent. Answer in one short line."}]
        answered = 0  # prompt tokens of the last answered turn: all of it is the conversation's stored history
        turn_s = 0.0  # how long the first turn took, unkilled: each kill lands inside a later turn
        for turn in range(KILLS + 1):
            note = " ".join(f"Log {turn}.{i}: step {i} of the build wrote {i * 7} files." for i in range(40))
            messages.append({"role": "user", "content": note})
            pid = live.health()["engine_pid"]
            timer = kill_later(pid, kill_point(rng, turn - 1, turn_s)) if turn else None
            started = time.monotonic()
            reply, failed = answer(client, messages, started + 180)
            turn_s = turn_s if turn else time.monotonic() - started
            if timer is not None:
                timer.join()
                assert failed, f"kill {turn} landed after its turn's answer: it tests nothing"
            cached = reply.usage.prompt_tokens_details.cached_tokens
            assert cached >= answered // BLOCK * BLOCK > 0 or turn == 0, (turn, cached, answered)
            messages.append({"role": "assistant", "content": reply.choices[0].message.content})
            answered = reply.usage.prompt_tokens
            on_disk(nvme, reply.model_extra["kvmem"]["workspace_id"], answered // BLOCK)
        assert metric(live, "kvmem_engine_restarts_total") == KILLS
        assert metric(live, "kvmem_engine_store_corrupt") == 0
    finally:
        live.stop()
    blocks = {p.stem for p in nvme.glob("*/blocks/*")}
    named = {h for p in nvme.glob("*/workspaces/*.json") for h in json.loads(p.read_text())["hashes"]}
    assert blocks == named  # no orphan and no temp file left once the last engine stopped
