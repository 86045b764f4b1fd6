"""The torch speed bench's fair baselines and TTFT split (kvmem_bench.speed_torch_baselines, speed_phases) on a
tiny random qwen35: what each baseline keeps resident, what it prefills, and the goals' thresholds."""

from __future__ import annotations

import pytest
import torch

from kvmem_bench import speed_torch_baselines as baselines
from kvmem_bench.speed_phases import phase_figures
from kvmem_bench.speed_torch_baselines import point_goals, suffix_ttft, synthesize_view, turn_baselines
from kvmem_core.errors import ConfigError
from kvmem_bench.torch_device import qwen35_spec
from kvmem_torch.model import Model
from kvmem_torch.runner import Runner
from kvmem_bench.torch_weights import random_weights

B = 16


@pytest.fixture(scope="module")
def model() -> Model:
    torch.set_num_threads(1)
    spec = qwen35_spec("tiny")
    return Model(spec, random_weights(spec, torch.float32, "cpu", 0))


def ids(n: int, seed: int = 0) -> list[int]:
    return torch.randint(0, 4000, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def baselines_of(model: Model, transcript: list[int], previous: list[int], view_tokens: int = 64) -> dict:
    """``turn_baselines`` with KVMem's forwards of 32 tokens and the plain engine's of 48."""
    return turn_baselines(
        model,
        transcript,
        previous,
        chunk=32,
        plain_chunk=48,
        block_tokens=B,
        view_tokens=view_tokens,
        log=lambda line: None,
    )


def test_a_synthesized_view_holds_its_tokens_at_their_positions_and_a_suffix_follows_it(model: Model) -> None:
    runner = Runner(model, 8, B)
    synthesize_view(runner, 40)  # two whole blocks and half of one
    assert runner.positions == list(range(40)) and runner.length == 40
    logits, _ = runner.prefill(ids(20), list(range(40, 60)), chunk=8)
    assert runner.positions == list(range(60)) and torch.isfinite(logits).all()


def test_the_baselines_prefill_only_the_suffix_past_the_previous_prompt(model: Model) -> None:
    transcript = ids(120)
    previous = transcript[:90] + ids(5, seed=1)  # the previous prompt ended in a generation prompt, then differs
    out = baselines_of(model, transcript, previous)
    assert out["new_tokens"] == 30 and out["view_resident_tokens"] == 64 - 32  # the view less one of KVMem's forwards
    for key in ("suffix_floor_s", "prefix_ttft_s", "view_prefill_s"):
        assert out[key] > 0
    assert out["prefix_cache"] == "resident on the device"
    assert out["plain_prefill_tok_s"] == pytest.approx(30 / out["suffix_floor_s"])
    assert out["view_prefill_vs_plain"] == pytest.approx(out["suffix_floor_s"] / out["view_prefill_s"])


def test_the_floor_and_the_prefix_cache_run_the_plain_engines_forward_length(
    model: Model, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A user's engine prefills the suffix in its own forwards; KVMem's forward path after a view in KVMem's."""
    chunks: dict[int, int] = {}
    real = baselines.suffix_ttft

    def timed(m: Model, new: list[int], resident: int, chunk: int, block_tokens: int, **kw: int) -> float | str:
        chunks[resident] = chunk
        return real(m, new, resident, chunk, block_tokens, rounds=1, **kw)

    monkeypatch.setattr(baselines, "suffix_ttft", timed)
    transcript = ids(120)
    baselines_of(model, transcript, transcript[:90])
    assert chunks == {0: 48, 64 - 32: 32, 90: 48}  # the floor, the view, the dense prefix cache


def test_a_view_larger_than_the_prefix_keeps_only_the_prefix_resident(model: Model) -> None:
    transcript = ids(50)
    out = baselines_of(model, transcript, transcript[:40], view_tokens=512)
    assert out["new_tokens"] == 10 and out["view_resident_tokens"] == 40


def test_a_prefix_cache_that_does_not_fit_is_reported_not_run(model: Model, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(
        baselines, "_does_not_fit", lambda m, n_blocks, bt: "does not fit: test" if n_blocks > 6 else None
    )
    transcript = ids(200)
    out = baselines_of(model, transcript, transcript[:180])
    assert out["prefix_ttft_s"] is None and out["prefix_cache"] == "does not fit: test"
    assert out["suffix_floor_s"] > 0 and out["view_prefill_s"] > 0  # the view (64 tokens) fits


def test_the_suffix_timing_leaves_the_view_and_state_as_it_found_them(model: Model) -> None:
    assert isinstance(suffix_ttft(model, ids(24), 32, chunk=8, block_tokens=B, rounds=2), float)


def test_a_streaming_view_stays_within_its_size_keeps_its_sink_and_starts_each_round_full(
    model: Model, monkeypatch: pytest.MonkeyPatch
) -> None:
    """KVMem's forwards over its streaming view: room made before each forward by dropping the oldest blocks after
    the sink, as the engine's ``_make_room`` does; every round starts from the same resident view."""
    monkeypatch.setattr(baselines, "SINK_TOKENS", B)
    runner = Runner(model, 64 // B + 2, B)
    seen: list[tuple[int, int, list[int]]] = []
    forward = runner.forward

    def spied(tokens: list[int], positions: list[int], *a: object, **kw: object) -> object:
        seen.append((runner.length, len(tokens), runner.positions[:B]))
        return forward(tokens, positions, *a, **kw)

    monkeypatch.setattr(runner, "forward", spied)
    synthesize_view(runner, 32)
    start = runner.state.snapshot()
    for _ in range(2):
        assert baselines._prefill_s(runner, ids(100), 32, 32, start, view_tokens=64) > 0
        assert runner.positions == list(range(32))  # the view it started from
    assert len(seen) == 2 * 4 and all(length + n <= 64 for length, n, _ in seen)
    assert all(sink == list(range(B)) for _, _, sink in seen)
    assert [length for length, _, _ in seen[:4]] == [32, 32, 32, 48]  # before each forward: full less its length


def point(**kw: float | None) -> dict:
    base = {
        "workspace_tokens": 16896,
        "reuse_ttft_s": 1.0,
        "suffix_floor_s": 0.75,
        "ttft_vs_prefix_cache": 1.2,
        "view_prefill_vs_plain": 0.8,
        "engine_prefill_vs_plain": 0.79,
        "select_replay_materialize_share": 0.1,
        "select_replay_materialize_goal": 0.1,
    }
    return {**base, **kw}


def test_the_goals_hold_at_their_thresholds_and_fail_past_them() -> None:
    goals = point_goals(point())
    assert goals == {
        "ttft<=1.25x(suffix_floor+50ms)": True,
        "ttft_vs_prefix_cache<=1.2": True,
        "view_prefill_vs_plain>=0.8": True,
        "engine_prefill_vs_plain>=0.8": False,
        "select_replay_materialize_share<=0.1": True,
    }
    worse = point_goals(point(suffix_floor_s=0.74, ttft_vs_prefix_cache=1.21, select_replay_materialize_share=0.11))
    assert not any(
        worse[k]
        for k in ("ttft<=1.25x(suffix_floor+50ms)", "ttft_vs_prefix_cache<=1.2", "select_replay_materialize_share<=0.1")
    )
    assert point_goals(point(ttft_vs_prefix_cache=None))["ttft_vs_prefix_cache<=1.2"] is None  # did not fit


def test_the_ttft_split_adds_up_and_each_phase_excludes_what_it_contains() -> None:
    p = {"workspace_tokens": 300000, "reuse_ttft_s": 2.0, "select_s": 0.5, "replay_s": 0.2, "prefill_tokens": 2400}
    phases = {
        "prefill_phase_s": 1.3,
        "inner_prefill_phase_s": 0.1,
        "select_phase_s": 0.5,
        "inner_select_phase_s": 0.15,
        "materialize_s": 0.25,
        "checkpoint_s": 0.05,
        "archive_s": 0.3,
    }
    out = phase_figures(p, phases)
    parts = out["phases"]
    assert parts["suffix_prefill_s"] == pytest.approx(1.2) and out["engine_prefill_tok_s"] == pytest.approx(2000)
    assert parts["selection_s"] == pytest.approx(0.5 - 0.15 - 0.2)
    assert sum(parts.values()) == pytest.approx(2.0) and parts["host_other_s"] == pytest.approx(0.15)
    assert out["archive_host_s"] == 0.3 and "archive_s" not in parts  # inside the prefill's time, not beside it
    assert out["select_replay_materialize_share"] == pytest.approx((0.15 + 0.2 + 0.25) / 2.0)
    assert out["select_replay_materialize_goal"] == 0.15  # past 128K tokens: the 1M goal


def test_sizes_flag_takes_positive_token_counts() -> None:
    from kvmem.cmd_bench import _sizes

    assert _sizes("16384, 65536") == [16384, 65536] and _sizes(None) is None
    for bad in ("16k", "0,4", ","):
        with pytest.raises(ConfigError):
            _sizes(bad)


def test_default_knobs_give_the_plan_the_view_a_user_gets_and_sizes_replace_the_plans() -> None:
    from kvmem_bench.speed_torch import PLANS, resolve_plan, session_config
    from kvmem_core.config import KVMemConfig

    plan = resolve_plan(PLANS["quick"], [262144, 131072], default_knobs=True)
    config, user = session_config(plan, bytes_per_token=1024), KVMemConfig()
    assert plan["sizes"] == (131072, 262144) and plan["lines"] == PLANS["quick"]["lines"]
    view = (config.budget, config.gen_budget, config.recent_tokens)
    assert view == (user.budget, user.gen_budget, user.recent_tokens)
    assert resolve_plan(PLANS["quick"], None, default_knobs=False) == PLANS["quick"]  # the plan's own 16K view
    assert config.cpu_gb == user.with_host_tier().cpu_gb  # the default host tier holds 262K tokens of 1 KiB
    huge = session_config(plan, bytes_per_token=1 << 30)  # ... and is raised where it does not hold the session
    assert huge.cpu_gb > user.with_host_tier().cpu_gb
