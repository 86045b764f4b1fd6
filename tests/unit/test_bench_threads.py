"""``kvmem bench speed``'s thread sweep and its decode-vs-plain goal, on a stand-in adapter."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Sequence

import numpy as np
import pytest

from kvmem_bench.speed_common import goals
from kvmem_bench.speed_threads import busy_rows, measure, one_core_busy, thread_counts
from kvmem.cmd_bench import thread_table
from kvmem_core.adapter import ForwardOut
from kvmem_core.threads import Threads


class FakeAdapter:
    """Records the thread counts and forwards it is given."""

    def __init__(self) -> None:
        self.threads: list[Threads] = []
        self.forwards: list[tuple[int, int]] = []
        self.reads: list[int] = []
        self.cleared = 0

    def set_threads(self, threads: Threads) -> None:
        self.threads.append(threads)

    def tokenize(self, text: str) -> list[int]:
        return list(range(len(text.split())))

    def forward(self, tokens: Sequence[int], positions: Sequence[int]) -> ForwardOut:
        """A forward whose logits, like a GPU's, are only waited for when read (``reads`` counts that)."""
        assert len(tokens) == len(positions)
        self.forwards.append((len(tokens), positions[0]))
        return ForwardOut(read=lambda: self.reads.append(positions[0]) or np.zeros(8, dtype=np.float32))

    def clear_view(self) -> None:
        self.cleared += 1


def test_counts_double_up_to_the_usable_cores() -> None:
    assert thread_counts(1) == [1]
    assert thread_counts(2) == [1, 2]
    assert thread_counts(12) == [1, 2, 4, 8, 12]
    assert thread_counts(16) == [1, 2, 4, 8, 16]


def test_measure_prefills_then_decodes_after_the_prompt_with_the_count_set() -> None:
    adapter = FakeAdapter()
    row = measure(adapter, 4, prompt=32, decode=3, rounds=2)
    assert adapter.threads == [Threads(4, 4)]
    assert adapter.forwards == [(32, 0), (1, 32), (1, 33), (1, 34)] * 2
    assert adapter.reads == [0, 32, 33, 34] * 2  # every forward timed until its logits are out
    assert adapter.cleared == 3  # before each round and after the last
    assert row["threads"] == 4 and row["prefill_tok_s"] > 0 and row["decode_tok_s"] > 0
    assert (row["prompt_tokens"], row["decode_tokens"]) == (32, 3)


def test_thread_table_has_one_row_per_count() -> None:
    rows = [{"threads": n, "prefill_tok_s": 100.0 * n, "decode_tok_s": 10.0 * n} for n in (1, 2)]
    text = thread_table({"device": "cpu", "model": "m.gguf", "usable_cores": 2, "rows": rows})
    assert text.splitlines()[2].split() == ["1", "100.0", "10.0"] and len(text.splitlines()) == 4


def test_decode_vs_plain_is_a_goal_only_where_it_was_measured() -> None:
    base = {"ttft_speedup": 12.0, "decode_flatness": 1.0, "nvme_vs_raw": 0.9}
    assert "decode_vs_plain>=0.95" not in goals(base, quick=True)
    assert goals({**base, "decode_vs_plain": 0.97}, quick=True)["decode_vs_plain>=0.95"] is True
    assert goals({**base, "decode_vs_plain": 0.90}, quick=True)["decode_vs_plain>=0.95"] is False


def test_thread_table_says_why_a_sweep_was_skipped() -> None:
    text = thread_table({"model": "tok.gguf", "skipped": "tok.gguf holds no weights (a tokenizer-only GGUF)"})
    assert text == "threads  not measured: tok.gguf holds no weights (a tokenizer-only GGUF)"


def test_busy_rows_compare_the_default_with_each_count_as_is_and_with_a_core_busy(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr("kvmem_bench.speed_threads.usable_cores", lambda: 2)
    adapter = FakeAdapter()
    rows = busy_rows(adapter, decode=2, repeats=2)
    assert [(r["condition"], r["threads"]) for r in rows] == [
        (c, t) for c in ("as is", "one core busy") for t in ("auto", "1", "2")
    ]
    assert adapter.threads[:6] == [Threads(2, 2, auto=True)] * 2 + [Threads(1, 1)] * 2 + [Threads(2, 2)] * 2
    assert all(len(r["decode_tok_s"]) == 2 for r in rows)
    text = thread_table({"device": "cpu", "model": "m.gguf", "usable_cores": 2, "rows": [], "busy": rows})
    assert text.splitlines()[-1].split()[:4] == ["one", "core", "busy", "2"]


def test_one_core_busy_runs_a_spinning_process_only_inside_the_block() -> None:
    with one_core_busy() as spinner:
        assert spinner.poll() is None
        time.sleep(0.2)
        assert spinner.poll() is None and Path(f"/proc/{spinner.pid}/stat").read_text().split()[2] in "RS"
    assert spinner.poll() is not None
