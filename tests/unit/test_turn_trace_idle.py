"""``kvmem_bench.turn_trace``'s idle accounting on a hand-made Chrome trace: the device work a range launched, its
busy time with overlaps counted once, the idle time inside its span, and the device's idle gaps with the host ranges
open when the work after each was launched, checked against sums done by hand."""

from __future__ import annotations

from kvmem_bench.turn_trace import Trace, gap_lines, idle_table


def _range(name: str, ts: float, dur: float) -> dict:
    return {"ph": "X", "cat": "user_annotation", "name": name, "ts": ts, "dur": dur}


def _launch(corr: int, ts: float) -> dict:
    return {
        "ph": "X",
        "cat": "cuda_runtime",
        "name": "cudaLaunchKernel",
        "ts": ts,
        "dur": 5,
        "args": {"correlation": corr},
    }


def _kernel(corr: int, ts: float, dur: float, cat: str = "kernel") -> dict:
    return {"ph": "X", "cat": cat, "name": f"k{corr}", "ts": ts, "dur": dur, "args": {"correlation": corr}}


def _rows(events: list[dict]) -> dict[str, list[float]]:
    lines = idle_table(Trace.of(events))
    assert lines[0].split() == ["range", "calls", "host_ms", "device_busy_ms", "device_span_ms", "device_idle_ms"]
    return {line.split()[0]: [float(x) for x in line.split()[1:]] for line in lines[1:]}


def _events() -> list[dict]:
    return [
        _range("kvmem._prefill", 0, 10_000),
        _range("kvmem.adapter.forward", 0, 2_000),
        _range("kvmem.adapter.forward", 6_000, 2_000),
        _launch(1, 100),
        _kernel(1, 1_000, 3_000),  # 1.0-4.0 ms
        _launch(2, 200),
        _kernel(2, 2_000, 1_000, "gpu_memcpy"),  # inside kernel 1: counted once
        _launch(3, 6_500),
        _kernel(3, 7_000, 2_000),  # 7.0-9.0 ms: 3 ms idle between
        _launch(4, 12_000),  # launched after every range: charged to none
        _kernel(4, 12_500, 1_000),
    ]


def test_idle_time_is_the_span_of_a_ranges_work_less_its_busy_time():
    rows = _rows(_events())
    assert rows["kvmem._prefill"] == [1, 10.0, 5.0, 8.0, 3.0]
    assert rows["kvmem.adapter.forward"] == [2, 4.0, 5.0, 5.0, 0.0]
    assert list(rows) == ["kvmem._prefill", "kvmem.adapter.forward"]  # by host time


def test_a_range_that_launched_nothing_is_all_host_time():
    rows = _rows([_range("kvmem._select", 0, 1_500), _range("other", 0, 9_000)])
    assert rows == {"kvmem._select": [1, 1.5, 0.0, 0.0, 0.0]}


def test_each_gap_names_the_ranges_that_launched_the_work_after_it_and_the_waits_inside_it():
    events = [*_events(), {"ph": "X", "cat": "cuda_runtime", "name": "cudaStreamSynchronize", "ts": 4_500, "dur": 900}]
    lines = gap_lines(Trace.of(events), min_us=500)
    assert lines[0] == "device idle gaps of 500 us or more (ms from the turn's start)"
    # 0-1 ms before the first kernel (launched inside both ranges), 4-7 ms between kernels 1 and 3; the turn ends
    # with the last range at 10 ms, so kernel 4 (12.5 ms) and the gap before it are outside it
    assert lines[1].split() == ["+0.00", "1.00", "k1", "[_prefill/adapter.forward]"]
    assert lines[2].split() == ["+4.00", "3.00", "k3", "[_prefill/adapter.forward]", "cudaStreamSynchronize", "0.90"]
    assert lines[3:] == ["", "idle ms by the ranges open at the next launch", "4.00  _prefill/adapter.forward"]


def test_a_trace_without_labelled_ranges_has_no_gaps():
    assert gap_lines(Trace.of([_launch(1, 0), _kernel(1, 10, 10)])) == []
