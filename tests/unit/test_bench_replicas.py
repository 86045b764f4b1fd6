"""The replica throughput bench on a stand-in server: every turn counted, 429s retried and counted, the table."""

from __future__ import annotations

import threading
from typing import Any

from kvmem_bench import speed_replicas
from kvmem_bench.api import ApiError


class FakeApi:
    """Answers every completion with 10 prompt tokens, 4 of them cached; refuses the first call with 429."""

    def __init__(self) -> None:
        self.calls = 0
        self.lock = threading.Lock()

    def call(self, method: str, path: str, body: dict[str, Any] | None = None) -> dict[str, Any]:
        with self.lock:
            self.calls += 1
            first = self.calls == 1
        if first:
            raise ApiError(429, {"message": "busy"})
        assert body is not None and body["prompt_cache_key"].startswith("session-")
        return {
            "usage": {"prompt_tokens": 10, "prompt_tokens_details": {"cached_tokens": 4}},
            "choices": [{"message": {"content": "ok"}}],
        }


def test_every_turn_is_served_and_refusals_are_counted():
    api = FakeApi()
    row = speed_replicas._measure(api, sessions=3, turns=2)  # type: ignore[arg-type]
    assert api.calls == 3 * 2 + 1 and row["refused"] == 1
    assert row["cached_fraction"] == 0.4 and row["turns_per_s"] > 0 and row["p95_turn_s"] >= row["p50_turn_s"]


def test_the_table_has_a_row_per_configuration_and_the_speedup():
    rows = [
        {
            "replicas": n,
            "wall_s": 10.0 / n,
            "turns_per_s": 0.5 * n,
            "p50_turn_s": 1.0,
            "p95_turn_s": 2.0,
            "cached_fraction": 0.5,
            "refused": 0,
        }
        for n in (1, 2)
    ]
    text = speed_replicas.table({"model": "m", "sessions": 4, "turns": 2, "rows": rows, "speedup": 2.0})
    assert text.splitlines()[2].split()[0] == "1" and text.splitlines()[3].split()[0] == "2"
    assert text.endswith("speedup   2.00x turns/s")
