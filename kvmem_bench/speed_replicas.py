"""``kvmem bench speed --replicas N``: throughput of concurrent agent sessions on N engine replicas against one.

Each configuration is a fresh ``kvmem serve`` (``--replicas 1``, then ``--replicas N``) on a
shared NVMe directory of its own. ``sessions`` agent sessions run at once, each a keyed
conversation that grows by a tool-output-sized message per turn; a turn is one greedy
completion, sent again after a 429 (``Retry-After``), so every turn is eventually served.
On the CPU ``kvmem serve`` splits the cores between the replicas, so both configurations
use the same compute (``threads`` gives every engine that many instead); on GPUs
(``gpus``) each replica has its own.
Reported per configuration: wall time, turns per second, turn latency (p50, p95), the
fraction of prompt tokens served from the cache, and the 429s seen.
"""

from __future__ import annotations

import statistics
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Callable

from kvmem_bench.api import Api, ApiError
from kvmem.serve_process import ServeProcess

TOOL_OUTPUT = "def handler(event):\n    return {'status': 200, 'body': event.get('body', '')}\n" * 12
MAX_TOKENS = 16


def run(
    model: str | None,
    replicas: int,
    *,
    sessions: int,
    turns: int,
    gpus: list[int] | None = None,
    threads: int | None = None,
    log: Callable[[str], None] = print,
) -> dict[str, Any]:
    """Both configurations' figures and ``speedup`` (turns per second of N replicas over one) as a JSON-ready
    dict. ``threads``: every engine's CPU threads instead of the cores split between the replicas."""
    rows = [
        _configuration(model, count, sessions, turns, (gpus or [])[:count], threads, log) for count in (1, replicas)
    ]
    return {
        "model": model,
        "sessions": sessions,
        "turns": turns,
        "threads": threads,
        "rows": rows,
        "speedup": rows[1]["turns_per_s"] / rows[0]["turns_per_s"],
    }


def table(result: dict[str, Any]) -> str:
    """The result as aligned text, one row per configuration."""
    lines = [
        f"{result['sessions']} concurrent sessions x {result['turns']} turns ({result['model'] or 'default model'})",
        "replicas  wall s  turns/s  p50 turn s  p95 turn s  cached  429s",
    ]
    lines += [
        f"{r['replicas']:8d}  {r['wall_s']:6.1f}  {r['turns_per_s']:7.2f}  {r['p50_turn_s']:10.2f}  "
        f"{r['p95_turn_s']:10.2f}  {r['cached_fraction']:6.2f}  {r['refused']:4d}"
        for r in result["rows"]
    ]
    lines.append(f"speedup   {result['speedup']:.2f}x turns/s")
    return "\n".join(lines)


def _configuration(
    model: str | None,
    count: int,
    sessions: int,
    turns: int,
    gpus: list[int],
    threads: int | None,
    log: Callable[[str], None],
) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="kvmem-replicas-") as tmp:
        root = Path(tmp)
        flags = [
            "--no-ui",
            "--replicas",
            str(count),
            "--max-queue",
            str(sessions),
            "--kvmem-nvme-dir",
            str(root / "nvme"),
        ]
        flags += ["--model", model] if model else []
        flags += ["--gpus", ",".join(map(str, gpus))] if gpus else []
        flags += ["--threads", str(threads)] if threads else []
        log(f"replicas {count}: starting kvmem serve {' '.join(flags)}")
        server = ServeProcess(root, flags).start()
        try:
            _wait_all_ready(Api(server.url))
            row = _measure(Api(server.url), sessions, turns)
        finally:
            server.stop()
    row["replicas"] = count
    log(f"replicas {count}: {row['turns_per_s']:.2f} turns/s over {row['wall_s']:.1f} s")
    return row


def _wait_all_ready(api: Api, timeout: float = 600) -> None:
    """Until every replica is ready (``/health`` is ok as soon as one is)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        replicas = api.call("GET", "/health").get("replicas") or [{"state": "ready"}]  # one engine: ok is ready
        if all(r["state"] == "ready" for r in replicas):
            return
        time.sleep(0.5)
    raise TimeoutError("the replicas were not ready in time")


def _measure(api: Api, sessions: int, turns: int) -> dict[str, Any]:
    latencies: list[float] = []
    counts = {"prompt": 0, "cached": 0, "refused": 0}
    lock = threading.Lock()

    def session(index: int) -> None:
        messages = [{"role": "system", "content": f"Session {index}. You are a coding agent."}]
        for turn in range(turns):
            messages.append({"role": "user", "content": f"Tool output {turn}:\n{TOOL_OUTPUT}\nWhat next?"})
            started = time.monotonic()
            reply, refused = _turn(api, messages, f"session-{index}")
            usage = reply["usage"]
            with lock:
                latencies.append(time.monotonic() - started)
                counts["prompt"] += usage["prompt_tokens"]
                counts["cached"] += usage["prompt_tokens_details"]["cached_tokens"]
                counts["refused"] += refused
            messages.append({"role": "assistant", "content": reply["choices"][0]["message"]["content"]})

    started = time.monotonic()
    with ThreadPoolExecutor(sessions) as pool:
        list(pool.map(session, range(sessions)))
    wall = time.monotonic() - started
    ordered = sorted(latencies)
    return {
        "wall_s": wall,
        "turns_per_s": len(latencies) / wall,
        "p50_turn_s": statistics.median(ordered),
        "p95_turn_s": ordered[min(len(ordered) - 1, int(0.95 * len(ordered)))],
        "cached_fraction": counts["cached"] / max(counts["prompt"], 1),
        "refused": counts["refused"],
    }


def _turn(api: Api, messages: list[dict[str, str]], key: str) -> tuple[dict[str, Any], int]:
    """One completion, sent again after each 429; the reply and how many 429s it took."""
    body = {"messages": messages, "max_tokens": MAX_TOKENS, "temperature": 0, "prompt_cache_key": key}
    refused = 0
    while True:
        try:
            return api.call("POST", "/v1/chat/completions", body), refused
        except ApiError as exc:
            if exc.status != 429:
                raise
            refused += 1
            time.sleep(1.0)
