"""``kvmem bench speed``'s ``sampling`` row (``kvmem_bench.speed_sampling``): the host's time to draw a token at the
server's default sampling and greedily, over a real vocabulary's size, and its share of a decode step."""

from __future__ import annotations

from kvmem_bench.speed_sampling import sampling_cost, sampling_line, step_ms


def test_the_row_times_both_samplers_and_their_share_of_a_step() -> None:
    row = sampling_cost(151_936, step_ms([{"kvmem_tok_s": 50.0}]), draws=20)
    assert row["vocab"] == 151_936 and row["draws"] == 20
    assert row["default_ms_per_token"] > row["greedy_ms_per_token"] > 0
    assert row["default_share"] == round(row["default_ms_per_token"] / 20.0, 4)
    assert sampling_line(row).startswith(f"sampling at the server's defaults: {row['default_ms_per_token']} ms")


def test_without_a_decode_rate_the_share_is_none() -> None:
    assert step_ms([]) is None and step_ms([{"kvmem_tok_s": None}]) is None
    assert sampling_cost(1000, None, draws=3)["default_share"] is None
    assert sampling_cost(None, 20.0)["default_ms_per_token"] is None  # the engine computed no logits
