"""The runner's position-ordered view: block round trips, reordering, compaction, drops, snapshots."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")

from kvmem_torch.model import Model  # noqa: E402
from kvmem_torch.paged import View  # noqa: E402
from kvmem_torch.graph_steps import PREFILL_GRAPHS, SEEN_KEYS  # noqa: E402
from kvmem_torch.runner import Runner  # noqa: E402
from torch_tiny import tiny_hf_model, tiny_spec_weights  # noqa: E402

B = 16


@pytest.fixture(scope="module", params=("llama", "qwen35"))
def model(request: pytest.FixtureRequest) -> Model:
    torch.set_num_threads(1)
    return Model(*tiny_spec_weights(tiny_hf_model(request.param, seed=2)))


def ids(n: int, seed: int = 0) -> list[int]:
    return torch.randint(0, 160, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def prefilled(model: Model, n: int = 50) -> tuple[Runner, list[int]]:
    r, toks = Runner(model, 12, B), ids(n + 1)
    r.prefill(toks[:n], list(range(n)), chunk=20)
    return r, toks


def test_prefill_decode_matches_block_table_path(model: Model) -> None:
    r, toks = prefilled(model)
    got, _ = r.forward(toks[50:], [50])
    cache, view, state = model.new_cache(12, B), View(), model.new_state()
    model.run(torch.tensor(toks[:50]), torch.arange(50), cache, view, state)
    ref = model.run(torch.tensor(toks[50:]), torch.tensor([50]), cache, view, state)
    assert (got - ref).abs().max().item() <= 1e-4  # different chunk cuts: fp32 rounding only


def test_blocks_read_out_and_written_back_in_any_order_are_bit_exact(model: Model) -> None:
    r, toks = prefilled(model)
    snap = r.state.snapshot()
    expected, _ = r.forward(toks[50:], [50])
    r.drop(50, 51)
    blocks = [(p, *r.read_cells(p, min(B, 50 - p))) for p in range(0, 50, B)]
    blocks = [(p, k.clone(), v.clone()) for p, k, v in blocks]
    r.clear()
    assert r.length == 0 and r.cache.num_free == r.cache.num_blocks
    for p, k, v in reversed(blocks):
        r.insert_block(k, v, list(range(p, p + k.shape[1])))
    r.state.restore(snap)
    got, _ = r.forward(toks[50:], [50])
    assert torch.equal(got, expected)


def test_compacted_positions_equal_the_shifted_run(model: Model) -> None:
    r, toks = prefilled(model)
    snap = r.state.snapshot()
    expected, _ = r.forward(toks[50:], [50])
    r.drop(50, 51)
    blocks = [(p, *(x.clone() for x in r.read_cells(p, min(B, 50 - p)))) for p in range(0, 50, B)]
    r.clear()
    for p, k, v in blocks:
        r.insert_block(k, v, list(range(1000 + p, 1000 + p + k.shape[1])))
    r.state.restore(snap)
    got, _ = r.forward(toks[50:], [1050])
    assert (got - expected).abs().max().item() <= 1e-4


@pytest.mark.parametrize(
    "moves",
    (
        ((32, 16, B), (48, 32, 2)),  # block 1 dropped: block 2 and the tail close the gap (compact)
        ((0, 100, B), (32, 0, B), (48, 120, 2)),  # at once: block 2 takes block 0's old positions
    ),
)
def test_cells_moved_in_place_equal_blocks_written_back_at_the_new_positions(model: Model, moves) -> None:
    r, toks = prefilled(model)
    snap = r.state.snapshot()
    r.drop(16, 32)
    kept = [] if any(src == 0 for src, _, _ in moves) else [(0, 0, B)]  # block 0 where it stays
    out = [(dst, *(x.clone() for x in r.read_cells(src, n))) for src, dst, n in (*kept, *moves)]
    r.move_cells(moves)
    assert sorted(r.positions) == r.positions and r.length == 34
    end = max(dst + n for _, dst, n in moves)
    got, _ = r.forward(toks[50:], [end])
    r.clear()
    for dst, k, v in out:
        r.insert_block(k, v, list(range(dst, dst + k.shape[1])))
    r.state.restore(snap)
    expected, _ = r.forward(toks[50:], [end])
    assert torch.equal(got, expected)


def test_dropping_a_block_equals_a_view_without_it(model: Model) -> None:
    r, toks = prefilled(model, 48)
    free = r.view_free()
    cache, view, state = r.cache, View(), r.state.snapshot()
    view.table = [r.cells[0] // B, r.cells[32] // B]
    r.drop(16, 32)
    assert r.view_free() == free + B and r.length == 32
    got, _ = r.forward(toks[48:], [48])
    view.length = 32
    ref = model.run(torch.tensor(toks[48:]), torch.tensor([48]), cache, view, state)
    assert (got - ref).abs().max().item() <= 1e-6


def test_snapshots_taken_during_prefill_restore_the_state_at_that_point(model: Model) -> None:
    if not model.spec.deltanet_layers:
        pytest.skip("attention-only model has no recurrent state")
    r, toks = Runner(model, 12, B), ids(40, seed=3)
    _, snaps = r.prefill(toks, list(range(40)), chunk=16, snapshot_at=[25])
    fresh = Runner(model, 12, B)
    fresh.prefill(toks[:25], list(range(25)), chunk=16)  # the same chunk cuts: 0, 16, 25
    assert torch.equal(snaps[25].rec, fresh.state.rec) and torch.equal(snaps[25].conv, fresh.state.conv)
    assert not torch.equal(snaps[25].rec, r.state.rec)


def test_capture_returns_pre_rope_queries(model: Model) -> None:
    r = Runner(model, 12, B)
    _, q = r.forward(ids(20), list(range(20)), capture=True)
    spec = model.spec
    assert sorted(q) == list(spec.attention_layers)
    assert q[spec.attention_layers[0]].shape == (20, spec.n_heads, spec.head_dim)


def test_cells_dropped_from_part_of_a_block_are_reused_and_attend_as_before(model: Model) -> None:
    r, toks = prefilled(model, 48)
    state = r.state.snapshot()
    kept = [(p0, *r.read_cells(p0, n)) for p0, n in ((0, 16), (16, 4), (40, 8))]
    r.drop(20, 40)  # blocks 1 and 2 keep 4 and 8 live cells: their freed slots are not lost
    assert r.view_free() == r.max_view_tokens - r.length == 12 * B - 28
    extra = ids(r.view_free(), seed=3)
    got, _ = r.forward(extra[:30], list(range(48, 78)))  # fills the freed slots of blocks 1 and 2 first
    assert all(c // B in (1, 2) for c in r.cells[-30:-10])
    ref_runner = Runner(model, 12, B)  # the same cells, each in a block of its own
    for p0, k, v in kept:
        ref_runner.insert_block(k, v, list(range(p0, p0 + k.shape[1])))
    ref_runner.state.restore(state)
    ref, _ = ref_runner.forward(extra[:30], list(range(48, 78)))
    assert (got - ref).abs().max().item() <= 1e-6
    r.forward(extra[30:], list(range(78, 78 + len(extra) - 30)))  # every slot in use, none twice
    assert r.view_free() == 0 and len(set(r.cells)) == r.length == 12 * B


def test_every_live_cell_carries_the_rope_rows_of_its_position(model: Model) -> None:
    """The cache's per-slot cos/sin rows (what attention rotates keys by) follow prefill, decode and blocks
    placed at other positions, against float64 angles."""
    r, toks = prefilled(model)
    k, v = (t.clone() for t in r.read_cells(0, B))
    r.drop(0, B)
    r.insert_block(k, v, list(range(1000, 1000 + B)))  # moved past the decoded token below (compact-style)
    r.forward(toks[50:], [2000])
    slots, positions = torch.tensor(r.cells), torch.tensor(r.positions, dtype=torch.float64)
    rd = r.cache.cos.shape[1]
    theta = model.spec.rope_theta
    angles = positions[:, None] * (1.0 / theta ** (torch.arange(0, rd, 2, dtype=torch.float64) / rd))
    angles = torch.cat([angles, angles], -1)
    assert (r.cache.cos[slots].double() - angles.cos()).abs().max().item() <= 1e-3  # fp32 angles up to 2000 rad
    assert (r.cache.sin[slots].double() - angles.sin()).abs().max().item() <= 1e-3


def test_a_prefill_graph_is_asked_for_on_the_second_meeting_of_its_length_and_bucket(model: Model) -> None:
    """The bookkeeping of ``Runner._replays_prefill`` (the CPU has no graphs; the replays:
    tests/gpu/test_torch_prefill_graphs_cuda.py): a length over 64 (rounded up to a multiple of 64), a view bucket, a
    number of snapshots and whether queries are captured, met once, run eagerly, met again through a graph;
    snapshots and padding only where the recurrent layers take their limits on the device; a failed capture's key
    and short forwards stay eager; once ``PREFILL_GRAPHS`` keys hold graphs a new key stays eager (no eviction: keys
    met in a cycle would be captured at every meeting); keys met once are forgotten once too many are met."""
    r = Runner(model, 12, B)
    assert not r.graph_prefill and not r.graph_snapshots and not r.scratch  # CPU: off, no scratch block
    assert r.max_view_tokens == 12 * B
    r.graph_prefill, r.scratch = True, list(range(B))
    assert [r._replays_prefill(128) for _ in range(2)] == [False, True]
    assert [r._replays_prefill(64) for _ in range(2)] == [False, False]
    assert [r._replays_prefill(100) for _ in range(2)] == [False, False]  # padded: needs limits on the device
    assert [r._replays_prefill(128, 1) for _ in range(2)] == [False, False]
    r.graph_snapshots = True
    assert [r._replays_prefill(100) for _ in range(2)] == [False, True]  # padded to 128
    assert [r._replays_prefill(128, 1) for _ in range(2)] == [False, True]
    assert [r._replays_prefill(120, 2, True) for _ in range(2)] == [False, True]
    r.prefill_graphs[(128, r._bucket(128), 0, False)] = None  # its capture failed
    assert not r._replays_prefill(128) and r._replays_prefill(128, 1)
    r.prefill_seen.update((n, 0, 0, False) for n in range(SEEN_KEYS))
    assert not r._replays_prefill(192) and r.prefill_seen == {(192, r._bucket(192), 0, False)}
    r.prefill_graphs.update({(n, 0, 0, False): None for n in range(PREFILL_GRAPHS)})
    assert [r._replays_prefill(256) for _ in range(2)] == [False, False]


def test_long_forwards_through_cudnn_stay_eager(model: Model, monkeypatch: pytest.MonkeyPatch) -> None:
    """cuDNN's prefill attention is off for a bare ``Model`` and cannot go on on the CPU; where it is on (set by hand
    here: no cuDNN on the CPU), a forward whose queries x keys reach ``CUDNN_MIN_PAIRS_SHORT`` (lowered to this view's
    size; these forwards are short)
    stays eager and is not remembered for a graph, while shorter ones keep the graph bookkeeping."""
    from kvmem_torch import layers

    r = Runner(model, 12, B)
    assert not model.use_cudnn_prefill(True) and not model.cudnn_prefill(1 << 20, 1 << 20)
    monkeypatch.setattr(layers, "CUDNN_MIN_PAIRS_SHORT", 128 * 128)
    attention = [m for m in (mixer for _, mixer, _ in model.layers) if hasattr(m, "cudnn")]
    r.graph_prefill, r.scratch = True, list(range(B))
    try:
        for m in attention:
            m.cudnn = True
        assert [r._replays_prefill(128) for _ in range(2)] == [False, False] and not r.prefill_seen
        assert [r._replays_prefill(100, 0) for _ in range(2)] == [False, False]  # padded, no device limits: eager
        r.graph_snapshots = True
        assert [r._replays_prefill(100) for _ in range(2)] == [False, True]  # 100 x 100 pairs: flash, graphs
    finally:
        model.use_cudnn_prefill(False)
    assert not any(m.cudnn for m in attention)


def test_flash_prefill_is_for_nvidia_gpus_in_half_precision(monkeypatch: pytest.MonkeyPatch) -> None:
    """The CPU, fp32 and ROCm (a stand-in version string: no AMD GPU here) keep ``causal_attention``, and so do the
    prefill graphs, which need flash attention's stop at a device key count."""
    from kvmem_torch import layers

    assert not layers.flash_varlen_usable(torch.bfloat16, 256, torch.device("cpu"))
    assert not layers.flash_varlen_usable(torch.float32, 256, torch.device("cuda"))
    layers._ampere.cache_clear()
    monkeypatch.setattr(torch.version, "hip", "6.2")
    try:
        assert not layers.flash_varlen_usable(torch.bfloat16, 256, torch.device("cuda"))
    finally:
        layers._ampere.cache_clear()
