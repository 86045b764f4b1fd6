"""Side data (recurrent checkpoints) in the store's budgets: counted in its tier, room made by evicting idle
workspaces with their side data, else shedding older side data, refused without room, dropped with its workspace
(the owner told at once)."""

from __future__ import annotations

from test_store import BLOCK, fill, host_store, nvme_store, tokens


def test_host_side_data_evicts_an_idle_workspace_with_its_own_and_is_refused_without_room():
    store = host_store("evict-idle")  # 4 blocks of RAM
    dropped: list[str] = []
    store.on_side_dropped = dropped.append
    a, _ = fill(store, tokens(1, 1000))
    assert store.keep_side("host", "a0", a, BLOCK)
    b, _ = fill(store, tokens(1, 2000))
    assert store.metrics()["host_bytes"] == 3 * BLOCK and store.metrics()["side_host_bytes"] == BLOCK
    assert store.keep_side("host", "b0", b, 2 * BLOCK)  # a goes, with its side data
    assert [w["id"] for w in store.list_workspaces()] == [b] and dropped == [a]
    assert store.metrics()["side_host_bytes"] == 2 * BLOCK and store.metrics()["host_bytes"] == 3 * BLOCK
    shed: list[tuple[str, str]] = []
    store.on_side_shed = lambda tier, key: shed.append((tier, key))
    assert store.keep_side("host", "b1", b, 2 * BLOCK)  # b is in use: its older side data makes room
    assert shed == [("host", "b0")] and store.metrics()["side_host_bytes"] == 2 * BLOCK
    assert not store.keep_side("host", "b2", b, 4 * BLOCK)  # more than the tier: refused, nothing counted
    assert not store.keep_side("host", "x", "ws-unknown", 1)
    assert store.metrics()["side_host_bytes"] == 2 * BLOCK
    store.drop_side("host", "b1")
    assert store.metrics()["host_bytes"] == BLOCK


def test_nvme_side_data_counts_on_disk_and_goes_with_a_deleted_workspace(tmp_path):
    store = nvme_store(tmp_path, nvme_bytes=1 << 14)
    dropped: list[str] = []
    store.on_side_dropped = dropped.append
    a, _ = fill(store, tokens(2, 1000))
    used = store.metrics()["nvme_bytes"]
    assert store.keep_side("nvme", "a0", a, 4096) and store.keep_side("host", "a0", a, BLOCK)
    assert store.metrics()["nvme_bytes"] == used + 4096 and store.metrics()["side_nvme_bytes"] == 4096
    b, _ = fill(store, tokens(1, 3000))
    assert not store.keep_side("nvme", "b0", b, 1 << 14)  # evicting a would not free enough: refused
    assert [w["id"] for w in store.list_workspaces()][-1] == a
    store.delete_workspace(a)
    assert dropped == [a] and store.metrics()["side_nvme_bytes"] == store.metrics()["side_host_bytes"] == 0
    store.close()


def test_blocks_that_find_no_other_room_shed_side_data_instead_of_failing():
    store = host_store("keep-all")  # nothing is evicted: without shedding the third block would be refused
    shed: list[tuple[str, str]] = []
    store.on_side_shed = lambda tier, key: shed.append((tier, key))
    a, _ = fill(store, tokens(2, 1000))
    assert store.keep_side("host", "a0", a, BLOCK) and store.keep_side("host", "a1", a, BLOCK)
    fill(store, tokens(3, 1000))
    assert shed == [("host", "a0")] and store.metrics()["side_host_bytes"] == BLOCK
    assert store.metrics()["host_bytes"] == 4 * BLOCK
