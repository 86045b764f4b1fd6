"""``kvmem bench soak``: agent clients against one server for minutes while faults are injected.

``clients`` agent conversations run at once, each growing by a tool-output-sized message per
turn for ``turns`` turns (greedy, keyed by ``prompt_cache_key``), against one ``kvmem serve``
whose NVMe tier sits on a tmpfs of its own. Faults, each once, when a share of all turns is
served: the engine killed with SIGKILL (``kill_at``), the disk filled for ``disk_full_s``
seconds (``disk_at``; needs a tmpfs mount, so root: elsewhere the row says it was not
injected), and every ``disconnect_every``-th turn of a client first opened as a stream and
dropped after its first bytes. A turn refused (429, 503) or cut by a fault is sent again until
``turn_timeout_s``, ``--turn-timeout-s``; a conversation whose turn never gets through is lost.

Reported as JSON: turns served, retries, disconnects, engine restarts, the blocks of earlier
turns prefilled again (recomputed), the cache share, latency, the server's peak RSS and the
NVMe directory's peak size against the configured budgets, and the goals (no conversation
lost, RSS and disk within their budgets).
"""

from __future__ import annotations

import http.client
import json
import os
import signal
import statistics
import tempfile
import threading
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable

from kvmem.compute import THREADS_ENV
from kvmem.serve_process import ServeProcess
from kvmem_bench.api import Api, ApiError
from kvmem_bench.provenance import run_meta
from kvmem_bench.soak_watch import MIB, Watch, engine_metric, fill_disk, mount_tmpfs, unmount
from kvmem_bench.speed_replicas import MAX_TOKENS, TOOL_OUTPUT

RETRY_STATUS = (429, 503)
BLOCK_TOKENS = 64  # the store's block size, passed to the server so recomputed tokens count in whole blocks
NVME_RETRY_S = "5"  # how soon the NVMe tier tries writing again after a fault (the server's default is 30 s)
SERVER_METRICS = ("restarts_total", "store_nvme_faults", "store_evicted_workspaces", "store_corrupt")
Log = Callable[[str], None]


@dataclass(frozen=True)
class SoakPlan:
    """What a soak run does (see the module docstring); ``cpu_gb`` and ``nvme_gb`` are the server's tier budgets."""

    clients: int = 8
    turns: int = 50
    cpu_gb: float = 1.0
    nvme_gb: float = 1.0
    kill_at: float = 0.3
    disk_at: float = 0.6
    disk_full_s: float = 30.0
    disconnect_every: int = 10
    turn_timeout_s: float = 300.0


QUICK = SoakPlan(clients=2, turns=6, cpu_gb=0.5, nvme_gb=0.5, disconnect_every=3)


@dataclass
class Tally:
    """Counts shared by the client threads (take ``lock`` to change them)."""

    served: int = 0
    retries: int = 0
    disconnects: int = 0
    lost: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    blocks_recomputed: int = 0
    turns_recomputed: int = 0
    latencies: list[float] = field(default_factory=list)
    retry_causes: Counter[str] = field(default_factory=Counter)  # what made a turn be sent again
    errors: list[str] = field(default_factory=list)  # what lost a conversation
    lock: threading.Lock = field(default_factory=threading.Lock)

    def note(self, error: str) -> None:
        with self.lock:
            self.errors.append(error[:200])

    def retry(self, cause: str) -> None:
        with self.lock:
            self.retries += 1
            self.retry_causes[cause] += 1


def run(model: str | None, plan: SoakPlan, *, log: Log = print) -> dict[str, Any]:
    """One soak run against a fresh ``kvmem serve`` (stopped at the end) as a JSON-ready dict."""
    with tempfile.TemporaryDirectory(prefix="kvmem-soak-") as tmp:
        root = Path(tmp)
        disk, why_not = mount_tmpfs(root / "mnt", int(plan.nvme_gb * 1024 * 1.5) + 64)
        nvme = (disk or root) / "nvme"
        flags = ["--no-ui", "--max-queue", str(plan.clients), "--kvmem-block-tokens", str(BLOCK_TOKENS)]
        flags += ["--kvmem-nvme-dir", str(nvme), "--kvmem-nvme-gb", str(plan.nvme_gb)]
        flags += ["--kvmem-cpu-gb", str(plan.cpu_gb)]
        flags += ["--model", model] if model else []
        log(f"soak: kvmem serve {' '.join(flags)}")
        try:
            server = ServeProcess(root / "run", flags, env={"KVMEM_NVME_RETRY_S": NVME_RETRY_S}).start()
            try:
                result = _soak(server, plan, nvme, disk, why_not, log)
            finally:
                server.stop()
        finally:
            if disk is not None:
                unmount(disk)
    return {"model": model, "plan": asdict(plan), "flags": flags, "meta": meta(), **result}


def meta() -> dict[str, str]:
    """What produced the numbers: commit, machine, date, the engine threads asked for and the command."""
    return {**run_meta("soak"), "threads": os.environ.get(THREADS_ENV, "default")}


def _soak(server: ServeProcess, plan: SoakPlan, nvme: Path, disk: Path | None, why_not: str, log: Log) -> dict:
    api = Api(server.url, timeout=plan.turn_timeout_s)
    api.call("POST", "/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1})
    assert server.proc is not None
    watch = Watch(server.proc.pid, nvme).start()  # after a warm-up turn: weights paged in, compute buffers made
    tally = Tally()
    faults: dict[str, Any] = {"engine_kills": 0, "disk_fault": why_not or "injected"}
    stop = threading.Event()
    injector = threading.Thread(target=_inject, args=(server, plan, disk, tally, faults, stop, log), daemon=True)
    started = time.monotonic()
    injector.start()
    try:
        with ThreadPoolExecutor(plan.clients) as pool:
            list(pool.map(lambda i: _client(api, server.url, i, plan, tally), range(plan.clients)))
    finally:
        stop.set()
        injector.join()
        watch.stop()
    metrics = {name: engine_metric(server.url, name) for name in SERVER_METRICS}
    return summary(plan, tally, watch, faults, metrics, time.monotonic() - started)


def summary(
    plan: SoakPlan, tally: Tally, watch: Watch, faults: dict[str, Any], metrics: dict[str, float | None], wall: float
) -> dict[str, Any]:
    """The run's figures and goals. RSS is bounded by the server tree's RSS at the start plus ``cpu_gb`` (the
    host tier's budget), disk by ``nvme_gb``; no conversation is lost when every turn of every client was served."""
    lat = sorted(tally.latencies) or [0.0]
    total = plan.clients * plan.turns
    rss_budget = watch.rss_start_mb + plan.cpu_gb * 1024
    disk_budget = plan.nvme_gb * 1024
    return {
        "wall_s": round(wall, 1),
        "turns": total,
        "served": tally.served,
        "retries": tally.retries,
        "retry_causes": dict(tally.retry_causes),
        "disconnects": tally.disconnects,
        **faults,
        "engine_restarts": metrics.get("restarts_total"),
        "nvme_faults_since_restart": metrics.get("store_nvme_faults"),
        "evicted_workspaces_since_restart": metrics.get("store_evicted_workspaces"),
        "corrupt_blocks_since_restart": metrics.get("store_corrupt"),
        "lost_conversations": tally.lost,
        "blocks_recomputed": tally.blocks_recomputed,
        "turns_recomputed": tally.turns_recomputed,
        "cached_fraction": round(tally.cached_tokens / max(tally.prompt_tokens, 1), 4),
        "p50_turn_s": round(statistics.median(lat), 3),
        "p95_turn_s": round(lat[int(0.95 * (len(lat) - 1))], 3),
        "max_turn_s": round(lat[-1], 3),
        "rss_start_mb": round(watch.rss_start_mb),
        "peak_rss_mb": round(watch.peak_rss_mb),
        "rss_budget_mb": round(rss_budget),
        "peak_disk_mb": round(watch.peak_disk_mb, 1),
        "disk_budget_mb": round(disk_budget),
        "errors": tally.errors[:20],
        "goals": {
            "no_lost_conversation": tally.lost == 0 and tally.served == total,
            "rss_within_budget": watch.peak_rss_mb <= rss_budget,
            "disk_within_budget": watch.peak_disk_mb <= disk_budget,
        },
    }


def _client(api: Api, url: str, index: int, plan: SoakPlan, tally: Tally) -> None:
    """One agent conversation of ``plan.turns`` turns; it stops at the first turn that cannot be served (lost)."""
    messages = [{"role": "system", "content": f"Session {index}. You are a coding agent."}]
    stored = 0  # whole blocks of the previous turn's prompt: what this turn should find cached
    for turn in range(plan.turns):
        messages.append({"role": "user", "content": f"Tool output {turn}:\n{TOOL_OUTPUT}\nWhat next?"})
        body = {"messages": messages, "max_tokens": MAX_TOKENS, "temperature": 0, "prompt_cache_key": f"soak-{index}"}
        if plan.disconnect_every and turn % plan.disconnect_every == plan.disconnect_every - 1:
            _drop_stream(url, body, tally)
        started = time.monotonic()
        reply = _turn(api, body, started + plan.turn_timeout_s, tally)
        if reply is None:
            with tally.lock:
                tally.lost += 1
            return
        usage = reply["usage"]
        cached = usage["prompt_tokens_details"]["cached_tokens"]
        missing = max(0, stored - cached) // BLOCK_TOKENS
        with tally.lock:
            tally.served += 1
            tally.latencies.append(time.monotonic() - started)
            tally.prompt_tokens += usage["prompt_tokens"]
            tally.cached_tokens += cached
            tally.blocks_recomputed += missing
            tally.turns_recomputed += missing > 0
        stored = usage["prompt_tokens"] // BLOCK_TOKENS * BLOCK_TOKENS
        messages.append({"role": "assistant", "content": reply["choices"][0]["message"]["content"] or ""})


def _turn(api: Api, body: dict[str, Any], deadline: float, tally: Tally) -> dict[str, Any] | None:
    """The turn's reply, sent again after a refusal or a broken connection until ``deadline``; None past it or
    after an error that a retry would not mend."""
    while time.monotonic() < deadline:
        try:
            return api.call("POST", "/v1/chat/completions", body)
        except ApiError as exc:
            if exc.status not in RETRY_STATUS:
                tally.note(str(exc))
                return None
            tally.retry(f"HTTP {exc.status}")
        except (OSError, http.client.HTTPException) as exc:  # urllib's URLError is an OSError
            tally.retry(type(exc).__name__)
        time.sleep(1.0)
    tally.note("a turn was not served before its deadline")
    return None


def _drop_stream(url: str, body: dict[str, Any], tally: Tally) -> None:
    """Open the turn as a stream and hang up after its first bytes, as a client that goes away does."""
    host, port = url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=60)
    try:
        conn.request(
            "POST", "/v1/chat/completions", json.dumps({**body, "stream": True}), {"Content-Type": "application/json"}
        )
        conn.getresponse().read(1)
    except (OSError, http.client.HTTPException):
        pass  # refused or cut by a fault: the client went away all the same
    finally:
        conn.close()
    with tally.lock:
        tally.disconnects += 1


def _inject(
    server: ServeProcess,
    plan: SoakPlan,
    disk: Path | None,
    tally: Tally,
    faults: dict[str, Any],
    stop: threading.Event,
    log: Log,
) -> None:
    """Kill the engine once ``kill_at`` of the turns are served, fill the disk once ``disk_at`` are."""
    total = plan.clients * plan.turns
    pending = sorted([(plan.kill_at, "kill"), (plan.disk_at, "disk")])
    while pending and not stop.wait(0.2):
        share, fault = pending[0]
        if tally.served < share * total:
            continue
        pending.pop(0)
        if fault == "kill":
            try:
                os.kill(int(server.health()["engine_pid"]), signal.SIGKILL)
                faults["engine_kills"] += 1
                log(f"soak: engine killed after {tally.served} turns")
            except (OSError, ValueError, KeyError, TypeError) as exc:
                faults["engine_kill_error"] = f"{type(exc).__name__}: {exc}"
        elif disk is not None:
            log(f"soak: disk full for {plan.disk_full_s:.0f} s after {tally.served} turns")
            faults["disk_full"] = fill_disk(disk, plan.disk_full_s, stop, int(plan.nvme_gb * 1024 * 2) * MIB)
            log(f"soak: disk free again: {faults['disk_full']}")


def table(result: dict[str, Any]) -> str:
    """The result as ``key value`` lines, the goals last."""
    plan = result["plan"]
    lines = [f"soak: {plan['clients']} clients x {plan['turns']} turns ({result['model'] or 'default model'})"]
    hidden = ("model", "plan", "flags", "meta", "errors", "goals")
    lines += [f"{k:34s} {v}" for k, v in result.items() if k not in hidden]
    lines += [f"error  {e}" for e in result["errors"]]
    lines.append("goals  " + "  ".join(f"{k}: {'met' if v else 'MISSED'}" for k, v in result["goals"].items()))
    return "\n".join(lines)
