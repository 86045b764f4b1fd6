"""BlockStore: exact capacity, eviction order, pins, sharing, loads and restarts on real files."""

from __future__ import annotations

import numpy as np
import pytest

from kvmem_bench.store import synthetic_chain
from kvmem_core.errors import CapacityError
from kvmem_core.layout import BlockLayout
from kvmem_core.policy import LRUPolicy, plan_workspace_eviction
from kvmem_core.store import BlockStore
from kvmem_core.workspace import Route, Workspace

LAYOUT = BlockLayout(n_layers=2, n_kv_heads=1, head_dim=4, n_heads=1, block_tokens=16)
BLOCK = LAYOUT.kv_bytes_per_block  # 512 bytes


class Clock:
    """A clock that advances one second per reading, so recency is exact."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        self.now += 1.0
        return self.now


def tokens(n_blocks: int, offset: int = 0) -> np.ndarray:
    return np.arange(offset, offset + n_blocks * LAYOUT.block_tokens, dtype=np.int32)


def fill(store: BlockStore, ids: np.ndarray, namespace: str = "ns", seed: int = 0) -> tuple[str, list]:
    """Open a workspace for ``ids`` and append every block not yet matched; return its id and blocks."""
    ws, _ = store.open_workspace(namespace, ids)
    blocks = synthetic_chain(LAYOUT, ids, namespace, seed)
    for meta, kv in blocks[len(ws.hashes) :]:
        store.append(ws.id, meta, kv)
    return ws.id, blocks


def host_store(retention: str = "keep-all") -> BlockStore:
    return BlockStore(LAYOUT, cpu_bytes=4 * BLOCK, retention=retention, clock=Clock())


def nvme_store(path, cpu_blocks: int = 4, nvme_bytes: int = 1 << 20, retention: str = "evict-idle") -> BlockStore:
    return BlockStore(
        LAYOUT, cpu_bytes=cpu_blocks * BLOCK, nvme_dir=path, nvme_bytes=nvme_bytes, retention=retention, clock=Clock()
    )


def test_keep_all_refuses_the_fifth_block_and_keeps_the_four():
    store = host_store("keep-all")
    ws_id, blocks = fill(store, tokens(4))
    ws, _ = store.open_workspace("ns", tokens(5))
    with pytest.raises(CapacityError, match="--kvmem-cpu-gb"):
        store.append(ws.id, *synthetic_chain(LAYOUT, tokens(5), "ns")[4])
    assert [store.tier(m.chain_hash) for m, _ in blocks] == ["host"] * 4
    assert store.metrics()["host_bytes"] == 4 * BLOCK
    assert store.workspaces.get(ws.id).hashes == [m.chain_hash for m, _ in blocks]


def test_evict_idle_drops_whole_workspaces_oldest_first_never_the_one_in_use():
    store = host_store("evict-idle")
    a, _ = fill(store, tokens(1, 1000))
    b, _ = fill(store, tokens(1, 2000))
    c, _ = fill(store, tokens(2, 3000))
    d, _ = fill(store, tokens(1, 4000))  # needs one block: evicts a (oldest)
    assert [w["id"] for w in store.list_workspaces()] == [d, c, b]
    e, _ = fill(store, tokens(2, 5000))  # needs two: evicts b then c
    assert [(w["id"], w["in_use"]) for w in store.list_workspaces()] == [(e, True), (d, False)]
    events = [e["workspace"] for e in store.take_events()]
    assert events == [a, b, c]
    assert store.metrics()["evicted_workspaces"] == 3


def test_evict_idle_refuses_when_idle_workspaces_free_too_little_and_evicts_nothing():
    store = host_store("evict-idle")
    a, _ = fill(store, tokens(4))
    b, _ = fill(store, tokens(2))  # a fork holding only blocks shared with a
    assert a != b
    with pytest.raises(CapacityError, match="would not free enough.*--kvmem-cpu-gb"):
        fill(store, tokens(5))  # continues a; evicting b would free nothing
    assert {w["id"] for w in store.list_workspaces()} == {a, b}
    assert store.metrics()["evicted_workspaces"] == 0 and store.metrics()["blocks"] == 4


def test_host_cache_evicts_least_recently_used_clean_block(tmp_path):
    store = nvme_store(tmp_path)
    _, blocks = fill(store, tokens(4))
    h = [m.chain_hash for m, _ in blocks]
    store.flush()
    store.touch([h[0]])
    assert store.lookup(h[1]) is blocks[1][0]  # lookup changes no recency
    ws, _ = store.open_workspace("ns", tokens(4))
    more = synthetic_chain(LAYOUT, tokens(6), "ns")
    store.append(ws.id, *more[4])
    store.flush()
    store.append(ws.id, *more[5])
    assert [store.tier(x) for x in h] == ["host+nvme", "nvme", "nvme", "host+nvme"]
    assert store.metrics()["evictions"] == 2


def test_pinned_blocks_stay_in_host_until_completed(tmp_path):
    store = nvme_store(tmp_path, cpu_blocks=2)
    _, blocks = fill(store, tokens(2))
    store.flush()
    h0 = blocks[0][0].chain_hash
    ticket = store.prepare_load([h0])
    ws, _ = store.open_workspace("ns", tokens(2))
    for meta, kv in synthetic_chain(LAYOUT, tokens(5), "ns")[2:]:
        store.append(ws.id, meta, kv)
        store.flush()
        assert store.tier(h0) == "host+nvme"
    result = store.complete_load(ticket)
    assert result.missing == () and np.array_equal(result.blocks[h0].k, blocks[0][1].k)
    last = synthetic_chain(LAYOUT, tokens(5), "ns")[4][0].chain_hash
    assert [store.tier(h0), store.tier(last)] == ["host+nvme", "host+nvme"]
    pins = store.prepare_load([h0, last])
    with pytest.raises(CapacityError, match="full of pinned blocks; raise --kvmem-cpu-gb"):
        fill(store, tokens(6))
    assert len(store.complete_load(pins).blocks) == 2
    fill(store, tokens(6))
    assert store.tier(h0) == "nvme"


def test_shared_prefix_is_stored_once_and_freed_with_its_last_owner(tmp_path):
    store = nvme_store(tmp_path)
    a, blocks_a = fill(store, tokens(3))
    forked = np.concatenate([tokens(2), tokens(1, 9000)])
    b, blocks_b = fill(store, forked)
    assert a != b and store.metrics()["blocks"] == 4
    assert store.workspaces.get(a).hashes == [m.chain_hash for m, _ in blocks_a]
    store.delete_workspace(a)
    store.flush()
    assert store.tier(blocks_a[2][0].chain_hash) is None
    assert [store.tier(m.chain_hash) for m, _ in blocks_b] == ["host+nvme"] * 3
    assert store.delete_workspace(b) and not store.delete_workspace(b)
    store.flush()
    assert store.metrics()["blocks"] == 0 and store.metrics()["nvme_bytes"] == 0
    assert list(store.nvme.blocks_dir.iterdir()) == []


def test_loads_from_disk_are_bit_exact_and_count_misses(tmp_path):
    store = nvme_store(tmp_path, cpu_blocks=1)
    _, blocks = fill(store, tokens(3))
    store.flush()
    ticket = store.prepare_load([m.chain_hash for m, _ in blocks] + ["f" * 32])
    result = store.complete_load(ticket)
    assert result.missing == ("f" * 32,)
    for meta, kv in blocks:
        assert result.blocks[meta.chain_hash].k.tobytes() == kv.k.tobytes()
        assert result.blocks[meta.chain_hash].v.tobytes() == kv.v.tobytes()
    assert store.metrics()["misses"] == 1 and store.metrics()["pinned_blocks"] == 0


def test_restart_finds_blocks_workspaces_and_selection(tmp_path):
    store = nvme_store(tmp_path)
    a, blocks = fill(store, tokens(3))
    b, _ = fill(store, np.concatenate([tokens(1), tokens(2, 7000)]))
    store.set_selection(a, {"blocks": [0, 2]})
    store.close()
    again = nvme_store(tmp_path)
    assert {w["id"] for w in again.list_workspaces()} == {a, b}
    assert again.workspace_info(a)["last_selection"] == {"blocks": [0, 2]}
    assert again.metrics()["blocks"] == 5
    meta = again.lookup(blocks[1][0].chain_hash)
    assert meta.summary["mean_k"].tobytes() == blocks[1][0].summary["mean_k"].tobytes()
    assert np.array_equal(meta.token_ids, blocks[1][0].token_ids)
    ws, match = again.open_workspace("ns", tokens(4))
    assert ws.id == a and match.continues and match.matched_blocks == 3


def test_workspace_info_reports_ranges_tiers_and_totals(tmp_path):
    store = nvme_store(tmp_path, cpu_blocks=2)
    ws_id, _ = fill(store, tokens(3))
    store.flush()
    info = store.workspace_info(ws_id)
    assert [(b["start"], b["end"], b["tier"]) for b in info["blocks"]] == [
        (0, 16, "nvme"),
        (16, 32, "host+nvme"),
        (32, 48, "host+nvme"),
    ]
    store.append(ws_id, *synthetic_chain(LAYOUT, tokens(4), "ns")[3])
    info = store.workspace_info(ws_id)
    assert [b["tier"] for b in info["blocks"]] == ["nvme", "nvme", "host+nvme", "host"]
    assert info["totals"] == {"blocks": 4, "tokens": 64, "host_blocks": 2, "nvme_blocks": 3, "missing_blocks": 0}
    assert store.workspace_info("nope") is None


def test_lru_policy_order_and_eviction_plan_counts_shared_blocks_once():
    lru = LRUPolicy()
    for h in "abcd":
        lru.insert(h)
    lru.touch("a")
    lru.remove("c")
    assert list(lru.candidates()) == ["b", "d", "a"]
    owners = {"s": 2, "x": 1, "y": 1}
    idle = [("w1", ["s", "x"]), ("w2", ["s", "y"])]
    size = {"s": 100, "x": 10, "y": 10}.__getitem__
    assert plan_workspace_eviction(idle, owners.__getitem__, size, 10) == ["w1"]
    assert plan_workspace_eviction(idle, owners.__getitem__, size, 11) == ["w1", "w2"]  # s frees with its last owner
    assert plan_workspace_eviction(idle, owners.__getitem__, size, 121) is None


def test_a_block_lost_from_the_host_tier_cuts_every_workspace_holding_it():
    store = host_store("evict-idle")
    ws_a, blocks = fill(store, tokens(3))
    ws_b, _ = fill(store, np.concatenate([tokens(2), tokens(1, offset=500)]))  # shares blocks 0 and 1
    lost = blocks[1][0].chain_hash
    store.host.pop(lost)
    result = store.complete_load(store.prepare_load([m.chain_hash for m, _ in blocks]))
    assert result.missing == (lost,) and store.metrics()["corrupt"] == 1
    assert store.workspaces.get(ws_a).hashes == store.workspaces.get(ws_b).hashes == [blocks[0][0].chain_hash]
    assert (
        store.tier(blocks[2][0].chain_hash) is None and store.metrics()["host_bytes"] == BLOCK
    )  # only block 0 is held
    ws, match = store.open_workspace("ns", tokens(3))
    assert match.matched_blocks == 1 and ws.id in (ws_a, ws_b)


def test_a_pinned_workspace_is_never_evicted():
    store = host_store("evict-idle")
    a, _ = fill(store, tokens(2, 1000))
    b, _ = fill(store, tokens(1, 2000))
    assert store.set_pinned(a, True) and not store.set_pinned("ws-unknown", True)
    c, _ = fill(store, tokens(2, 3000))  # one block too many: a is the oldest, but pinned
    d, _ = fill(store, tokens(1, 4000))
    assert {w["id"]: w["pinned"] for w in store.list_workspaces()} == {a: True, d: False}
    with pytest.raises(CapacityError, match="unpinned"):
        fill(store, tokens(3, 5000))
    assert store.workspaces.get(a) is not None and [e["workspace"] for e in store.take_events()] == [b, c, d]


def test_a_second_history_under_a_key_forks_and_frees_nothing():
    store = host_store("evict-idle")
    ws, _ = store.open_workspace("ns", tokens(3), Route(key="k"))
    for meta, kv in synthetic_chain(LAYOUT, tokens(3), "ns"):
        store.append(ws.id, meta, kv)
    other, match = store.open_workspace("ns", np.concatenate([tokens(1), tokens(2, 500)]), Route(key="k"))
    assert other.id != ws.id and match.matched_blocks == 1 and store.metrics()["blocks"] == 3
    assert {w["id"]: (w["key"], w["blocks"]) for w in store.list_workspaces()} == {ws.id: ("k", 3), other.id: ("k", 1)}


def test_an_added_workspace_arrives_whole_or_not_at_all():
    store = host_store("keep-all")
    kept = Workspace("ws-" + "a" * 16, "ns", [], 1.0, 2.0, {}, key="k", pinned=True)
    store.add_workspace(kept, synthetic_chain(LAYOUT, tokens(3), "ns"))
    too_big = Workspace("ws-" + "b" * 16, "ns", [], 1.0, 2.0)
    with pytest.raises(CapacityError):
        store.add_workspace(too_big, synthetic_chain(LAYOUT, tokens(3, 100), "ns"))
    (only,) = store.list_workspaces()
    assert (only["id"], only["blocks"], only["key"], only["pinned"]) == (kept.id, 3, "k", True)
    assert store.metrics()["blocks"] == 3
