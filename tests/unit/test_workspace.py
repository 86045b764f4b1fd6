"""WorkspaceRegistry: longest-prefix match by hash chain verified against token ids; continue or fork."""

from __future__ import annotations

import json

import numpy as np

from kvmem_core.layout import ROOT_HASH, BlockMeta
from kvmem_core.workspace import Route, Workspace, WorkspaceRegistry, block_hashes

B = 4


def metas_for(namespace: str, ids: np.ndarray) -> dict[str, BlockMeta]:
    hashes = block_hashes(namespace, ids, B)
    parents = [ROOT_HASH] + hashes[:-1]
    return {h: BlockMeta(h, p, ids[i * B : (i + 1) * B], i * B, 0) for i, (h, p) in enumerate(zip(hashes, parents))}


class World:
    """A registry plus the metas of every block its workspaces hold."""

    def __init__(self) -> None:
        self.now = 0.0
        self.reg = WorkspaceRegistry(B, clock=self.tick)
        self.metas: dict[str, BlockMeta] = {}

    def tick(self) -> float:
        self.now += 1.0
        return self.now

    def step(self, ids: list[int], namespace: str = "m", route: Route = Route()) -> tuple[Workspace, int, bool]:
        """Open a workspace for ``ids`` and append its unmatched whole blocks, as a step does."""
        ids_arr = np.asarray(ids)
        match = self.reg.find_prefix(namespace, ids_arr, self.metas.get, route)
        ws = self.reg.open(match)
        self.metas.update(metas_for(namespace, ids_arr))
        for h in match.hashes[len(ws.hashes) :]:
            self.reg.append(ws.id, h)
        return ws, match.matched_blocks, match.continues


def test_new_sequence_then_extension_continues_the_same_workspace():
    w = World()
    first, matched, _ = w.step(list(range(10)))  # two whole blocks, a partial tail
    assert matched == 0 and len(first.hashes) == 2
    again, matched, continues = w.step(list(range(13)))
    assert again.id == first.id and matched == 2 and continues and len(again.hashes) == 3


def test_divergence_forks_sharing_the_prefix_and_leaves_the_original_untouched():
    w = World()
    a, _, _ = w.step(list(range(16)))
    original = list(a.hashes)
    b, matched, continues = w.step(list(range(8)) + [99] * 8)
    assert b.id != a.id and matched == 2 and not continues
    assert a.hashes == original and b.hashes[:2] == original[:2] and b.hashes[2:] != original[2:]
    assert w.reg.owners(original[0]) == 2 and w.reg.owners(original[3]) == 1


def test_a_shorter_prefix_forks_rather_than_truncating():
    w = World()
    a, _, _ = w.step(list(range(16)))
    b, matched, continues = w.step(list(range(9)))
    assert b.id != a.id and matched == 2 and not continues and len(a.hashes) == 4


def test_the_longest_prefix_wins_across_workspaces():
    w = World()
    w.step(list(range(8)) + [50] * 8)
    longer, _, _ = w.step(list(range(12)) + [60] * 4)
    match = w.reg.find_prefix("m", np.array(list(range(12)) + [70] * 4), w.metas.get)
    assert match.matched_blocks == 3 and match.workspace_id is None and not match.continues
    fork = w.reg.open(match)
    assert fork.hashes == longer.hashes[:3]


def test_a_hash_hit_with_different_stored_tokens_does_not_match():
    w = World()
    w.step(list(range(8)))
    h0 = block_hashes("m", np.arange(8), B)[0]
    w.metas[h0] = BlockMeta(h0, ROOT_HASH, np.array([9, 9, 9, 9]), 0, 0)  # as after a hash collision
    match = w.reg.find_prefix("m", np.arange(8), w.metas.get)
    assert match.matched_blocks == 0 and match.workspace_id is None


def test_namespaces_do_not_share_blocks():
    w = World()
    a, _, _ = w.step(list(range(8)), namespace="model-a")
    b, matched, _ = w.step(list(range(8)), namespace="model-b")
    assert matched == 0 and a.id != b.id and set(a.hashes).isdisjoint(b.hashes)


def test_find_prefix_has_no_side_effects_and_delete_returns_freed_blocks():
    w = World()
    a, _, _ = w.step(list(range(8)))
    b, _, _ = w.step(list(range(4)) + [7] * 4)
    w.reg.take_dirty()
    before = (a.last_used, len(w.reg))
    w.reg.find_prefix("m", np.arange(8), w.metas.get)
    assert (a.last_used, len(w.reg)) == before and w.reg.take_dirty() == []
    assert w.reg.delete(a.id) == [a.hashes[1]]
    assert w.reg.delete(b.id) == b.hashes
    assert w.reg.take_dirty() == sorted([a.id, b.id])


def test_manifest_round_trip():
    ws = Workspace("ws-1", "m", ["a" * 32, "b" * 32], 1.0, 2.0, {"blocks": [0]}, key="chat-7", pinned=True)
    back = Workspace.from_manifest(json.loads(ws.to_manifest()))
    assert back == ws
    old = {k: v for k, v in json.loads(ws.to_manifest()).items() if k not in ("key", "pinned")}
    assert Workspace.from_manifest(old) == Workspace("ws-1", "m", ["a" * 32, "b" * 32], 1.0, 2.0, {"blocks": [0]})


def test_a_key_routes_many_conversations_and_never_rewinds_one():
    w = World()
    key = Route(key="chat-7")
    a, _, _ = w.step(list(range(12)), route=key)
    again, matched, continues = w.step(list(range(16)), route=key)
    assert again.id == a.id and continues and matched == 3 and len(a.hashes) == 4
    before = list(a.hashes)
    other, matched, continues = w.step(list(range(8)) + [5] * 8, route=key)  # a second history under the key
    assert other.id != a.id and matched == 2 and not continues and other.key == "chat-7"
    assert a.hashes == before and all(w.reg.owners(h) for h in before)  # the first keeps every block
    assert other.hashes[:2] == before[:2]  # the common prefix is shared
    back, _, continues = w.step(list(range(20)), route=key)
    assert back.id == a.id and continues  # each history continues its own workspace
    assert w.step(list(range(8)) + [5] * 12, route=key)[0].id == other.id


def test_keys_and_keyless_steps_never_continue_each_others_workspaces():
    w = World()
    plain, _, _ = w.step(list(range(8)))
    keyed, matched, continues = w.step(list(range(12)), route=Route(key="k1"))
    assert keyed.id != plain.id and matched == 2 and not continues and keyed.hashes[:2] == plain.hashes
    other, _, _ = w.step(list(range(12)), route=Route(key="k2"))
    keyless, _, continues = w.step(list(range(12)))
    assert len({plain.id, keyed.id, other.id, keyless.id}) == 4 and not continues
    assert keyless.hashes == keyed.hashes == other.hashes  # forks share the blocks, not the workspaces


def test_a_preferred_workspace_wins_among_equal_prefixes():
    w = World()
    first, _, _ = w.step(list(range(8)))
    twin = Workspace("ws-twin", "m", list(first.hashes), w.tick(), w.tick())  # as an import of first would hold
    w.reg.add(twin)
    newest, _, _ = w.step(list(range(10)))
    assert newest.id == twin.id  # the most recent, without a preference
    chosen, _, _ = w.step(list(range(12)), route=Route(prefer=first.id))
    assert chosen.id == first.id


def test_block_hashes_from_known_first_blocks_equal_them_hashed_whole() -> None:
    ids = np.random.default_rng(3).integers(0, 50_000, 23)
    whole = block_hashes("m", ids, B)
    assert len(whole) == 5 and whole[0] != whole[1]
    for known in range(6):
        assert block_hashes("m", ids, B, whole[:known]) == whole
        assert block_hashes("m", ids.tolist(), B, whole[:known]) == whole
    assert block_hashes("m", ids[:3], B) == [] and block_hashes("n", ids, B) != whole
