"""``kvmem bench speed``'s thread sweep and its decode-vs-plain goal, on a stand-in adapter."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Sequence

import numpy as np

from kvmem_bench.speed_common import goals
from kvmem_bench.speed_threads import measure, thread_counts
from kvmem_bench.speed_threads_busy import busy_rows, candidates, one_core_busy
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


def test_busy_rows_run_every_candidate_each_round_in_a_rotated_order_and_rate_the_default() -> None:
    calls: list[str] = []
    speed = {"auto": (40.0, 18.0), "2": (42.0, 9.0), "1": (20.0, 19.0)}

    def child(model: str, env: dict[str, str], *, decode: int) -> dict:
        label = next(label for label, e in candidates(2) if e == env)
        calls.append(label)
        quiet, busy = speed.get(label, (10.0, 5.0))
        return {"as is": quiet, "one core busy": busy, "load_1min": {"as is": 0.5, "one core busy": 1.5}}

    busy = busy_rows("m.gguf", decode=2, rounds=2, cores=2, run_child=child)
    labels = [label for label, _ in candidates(2)]
    assert calls == labels + labels[1:] + labels[:1]  # the second round starts one later
    assert [(r["condition"], r["threads"]) for r in busy["rows"]] == [
        (c, t) for c in ("as is", "one core busy") for t in labels
    ]
    quiet_auto = busy["rows"][0]
    assert quiet_auto["decode_tok_s"] == [40.0, 40.0] and quiet_auto["load_1min"] == [0.5, 0.5]
    assert busy["default_vs_best_fixed"] == {"as is": round(40 / 42, 3), "one core busy": round(18 / 19, 3)}
    text = thread_table({"device": "cpu", "model": "m.gguf", "usable_cores": 2, "rows": [], "busy": busy["rows"]})
    assert text.splitlines()[-1].split()[:4] == ["one", "core", "busy", "1"]


def test_the_default_is_compared_with_fixed_counts_and_libgomps_own_spin() -> None:
    found = dict(candidates(4))
    assert found["auto"] == {} and found["4"] == {"KVMEM_THREADS": "4"} and found["1"] == {"KVMEM_THREADS": "1"}
    assert found["auto, spin 300000"] == {"GOMP_SPINCOUNT": "300000"}
    assert found["4, passive"] == {"KVMEM_THREADS": "4", "OMP_WAIT_POLICY": "passive"}
    assert [label for label, _ in candidates(1)].count("1") == 1  # one core: every core is one


def test_one_core_busy_runs_a_spinning_process_only_inside_the_block() -> None:
    with one_core_busy() as spinner:
        assert spinner.poll() is None
        time.sleep(0.2)
        assert spinner.poll() is None and Path(f"/proc/{spinner.pid}/stat").read_text().split()[2] in "RS"
    assert spinner.poll() is not None


def test_a_sweep_on_a_backend_not_installed_is_skipped_with_its_reason(monkeypatch) -> None:
    """From a source tree on PYTHONPATH no backend's entry point is registered: the sweep says so and the bench's
    other figures stand (it used to end the run with exit code 2)."""
    import kvmem.engines as engines
    from kvmem_bench import speed_threads

    monkeypatch.setattr(engines.importlib.metadata, "entry_points", lambda group: [])
    logged: list[str] = []
    result = speed_threads.run("torch", str(Path(__file__)), {}, quick=True, log=logged.append)
    assert result == {"model": Path(__file__).name, "skipped": "unknown backend 'torch'; installed: none"}
    assert logged == ["threads: not measured (unknown backend 'torch'; installed: none)"]
