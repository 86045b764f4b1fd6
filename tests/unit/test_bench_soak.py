"""The soak bench's parts that run without a model: the goals, the client's retry and recompute counts, the
watch on a real process tree and directory, the disk filler on a real (tmpfs) filesystem, and the command."""

from __future__ import annotations

import errno
import http.server
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest
from disk_support import small_tmpfs

from kvmem.cli import main
from kvmem_bench import soak, soak_watch
from kvmem_bench.api import ApiError
from kvmem_bench.soak_watch import MIB, Watch, fill_disk


def watch_of(rss_start: float, peak_rss: float, peak_disk: float) -> Watch:
    watch = Watch(0, Path("/nonexistent"))
    watch.rss_start_mb, watch.peak_rss_mb, watch.peak_disk_mb = rss_start, peak_rss, peak_disk
    return watch


def test_the_goals_hold_only_with_every_turn_served_and_both_peaks_in_budget():
    plan = soak.SoakPlan(clients=2, turns=3, cpu_gb=0.5, nvme_gb=0.25)
    served = soak.Tally(served=6, latencies=[1.0] * 6)
    result = soak.summary(plan, served, watch_of(800, 800 + 512, 256), {}, {"restarts_total": 1.0}, 10.0)
    assert result["goals"] == {"no_lost_conversation": True, "rss_within_budget": True, "disk_within_budget": True}
    assert result["rss_budget_mb"] == 1312 and result["disk_budget_mb"] == 256 and result["engine_restarts"] == 1.0
    lost = soak.Tally(served=5, lost=1, latencies=[1.0] * 5)
    over = soak.summary(plan, lost, watch_of(800, 800 + 513, 256.5), {}, {}, 10.0)["goals"]
    assert over == {"no_lost_conversation": False, "rss_within_budget": False, "disk_within_budget": False}
    short = soak.summary(plan, soak.Tally(served=5, latencies=[1.0] * 5), watch_of(1, 1, 1), {}, {}, 1.0)
    assert not short["goals"]["no_lost_conversation"]  # a turn neither served nor counted lost is still missing


class ScriptedApi:
    """Answers completions from a script of outcomes per call: an int is an HTTP error status, a dict the usage
    of a served turn (prompt and cached tokens)."""

    def __init__(self, script: list[Any]) -> None:
        self.script, self.bodies = list(script), []

    def call(self, method: str, path: str, body: dict[str, Any] | None = None) -> dict[str, Any]:
        self.bodies.append(body)
        outcome = self.script.pop(0)
        if isinstance(outcome, int):
            raise ApiError(outcome, {"message": f"status {outcome}"})
        usage = {"prompt_tokens": outcome["prompt"], "prompt_tokens_details": {"cached_tokens": outcome["cached"]}}
        return {"usage": usage, "choices": [{"message": {"content": "ok"}}]}


def run_client(script: list[Any], turns: int) -> tuple[soak.Tally, ScriptedApi]:
    api, tally = ScriptedApi(script), soak.Tally()
    plan = soak.SoakPlan(clients=1, turns=turns, disconnect_every=0, turn_timeout_s=30)
    soak._client(api, "http://127.0.0.1:1", 0, plan, tally)  # type: ignore[arg-type]
    return tally, api


def test_a_refused_turn_is_retried_and_a_turn_that_finds_less_cached_counts_its_blocks(monkeypatch):
    monkeypatch.setattr(soak.time, "sleep", lambda s: None)
    turns = [{"prompt": 200, "cached": 0}, 503, 429, {"prompt": 400, "cached": 192}, {"prompt": 600, "cached": 0}]
    tally, api = run_client(turns, turns=3)
    assert tally.served == 3 and tally.retries == 2 and tally.lost == 0 and tally.errors == []
    assert tally.retry_causes == {"HTTP 503": 1, "HTTP 429": 1}
    assert tally.blocks_recomputed == 6 and tally.turns_recomputed == 1  # turn 3 found none of turn 2's 384 tokens
    assert tally.prompt_tokens == 1200 and tally.cached_tokens == 192
    assert len(api.bodies[-1]["messages"]) == 1 + 3 * 2 and api.bodies[-1]["prompt_cache_key"] == "soak-0"


def test_a_turn_refused_for_good_loses_its_conversation(monkeypatch):
    monkeypatch.setattr(soak.time, "sleep", lambda s: None)
    tally, _ = run_client([{"prompt": 200, "cached": 0}, 400], turns=3)
    assert tally.served == 1 and tally.lost == 1 and tally.errors == ["HTTP 400: status 400"]


ALLOCATES = "import subprocess, sys; subprocess.run([sys.executable, '-c', sys.argv[1]])"
HOLDS = "import sys, time; data = b'x' * (96 * 2**20); sys.stdout.write('ready\\n'); sys.stdout.flush(); time.sleep(60)"


def test_the_watch_sees_a_grandchilds_memory_and_a_file_that_came_and_went(tmp_path: Path):
    parent = subprocess.Popen([sys.executable, "-c", ALLOCATES, HOLDS], stdout=subprocess.PIPE)
    try:
        watch = Watch(parent.pid, tmp_path, period=0.05).start()
        assert parent.stdout is not None and parent.stdout.readline() == b"ready\n"
        (tmp_path / "sub").mkdir()
        (tmp_path / "sub" / "block.kvb").write_bytes(b"\1" * (3 * MIB))
        time.sleep(0.3)
        (tmp_path / "sub" / "block.kvb").unlink()
        watch.stop()
    finally:
        parent.kill()
        parent.wait()
    assert watch.peak_rss_mb >= watch.rss_start_mb + 90  # the grandchild's 96 MiB
    assert watch.peak_disk_mb >= 3 and watch.disk_start_mb == 0 and watch.samples >= 3
    assert soak_watch.tree_rss_bytes(parent.pid) == 0


def test_fill_disk_stops_at_its_limit_and_removes_its_file(tmp_path: Path):
    started = time.monotonic()
    filled = fill_disk(tmp_path, 0.2, threading.Event(), 3 * MIB)
    assert filled["filled_mb"] == 3.0 and not filled["full"] and filled["held_s"] >= 0.2
    assert not list(tmp_path.iterdir()) and time.monotonic() - started < 5


def test_a_filled_tmpfs_refuses_other_writes_until_the_filler_lets_go(tmp_path: Path):
    with small_tmpfs(tmp_path / "mnt", "4m") as mount:
        stop, outcome = threading.Event(), {}
        filler = threading.Thread(target=lambda: outcome.update(fill_disk(mount, 30, stop, 64 * MIB)))
        filler.start()
        try:
            while not (mount / soak_watch.FILL_NAME).exists() or soak_watch.disk_bytes(mount) < 3 * MIB:
                time.sleep(0.05)
            time.sleep(0.2)
            with pytest.raises(OSError) as refused:
                (mount / "block.kvb").write_bytes(b"\1" * MIB)
            assert refused.value.errno == errno.ENOSPC
        finally:
            stop.set()
            filler.join()
        assert outcome["full"] and 3 <= outcome["filled_mb"] <= 4 and outcome["held_s"] < 30
        (mount / "block.kvb").write_bytes(b"\1" * MIB)  # room again once the filler is gone


def test_without_root_the_disk_fault_says_it_was_not_injected(tmp_path: Path, monkeypatch):
    monkeypatch.setattr(soak_watch.os, "geteuid", lambda: 1000)
    assert soak_watch.mount_tmpfs(tmp_path / "mnt", 16) == (None, "not injected: mounting a tmpfs needs root")


def test_the_command_is_registered_and_refuses_a_bad_plan_in_one_line(capsys):
    with pytest.raises(SystemExit) as done:
        main(["bench", "soak", "--help"])
    assert done.value.code == 0 and "faults injected" in capsys.readouterr().out
    assert main(["bench", "soak", "--quick", "--clients", "0"]) == 2
    assert capsys.readouterr().err == "kvmem: --clients and --turns take counts of 1 or more\n"
    assert main(["bench", "soak", "--quick", "--turn-timeout-s", "0"]) == 2
    assert capsys.readouterr().err == "kvmem: --turn-timeout-s takes a number of seconds above 0\n"


def test_the_run_names_the_checkouts_commit():
    head = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, check=True).stdout
    assert head.startswith(soak.meta()["commit"].removesuffix("-dirty"))


class MetricsPage(http.server.BaseHTTPRequestHandler):
    def do_GET(self) -> None:
        body = (
            b"# TYPE kvmem_engine_restarts counter\nkvmem_engine_restarts_total 2.0\nkvmem_engine_store_corrupt 0.0\n"
        )
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: object) -> None:
        pass


def test_engine_metrics_are_read_from_the_prometheus_text_and_missing_ones_are_none():
    with http.server.ThreadingHTTPServer(("127.0.0.1", 0), MetricsPage) as page:
        threading.Thread(target=page.serve_forever, daemon=True).start()
        url = f"http://127.0.0.1:{page.server_address[1]}"
        assert soak_watch.engine_metric(url, "restarts_total") == 2.0
        assert soak_watch.engine_metric(url, "store_corrupt") == 0.0
        assert soak_watch.engine_metric(url, "store_nvme_faults") is None
        page.shutdown()
    assert soak_watch.engine_metric(url, "restarts_total") is None  # nothing answers any more
