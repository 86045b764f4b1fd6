"""Random operation sequences against BlockStore on real files: nothing lost, duplicated or over capacity."""

from __future__ import annotations

import tempfile
from pathlib import Path

import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvmem_bench.store import synthetic_chain
from kvmem_core.blockfile import encode_header
from kvmem_core.errors import CapacityError
from kvmem_core.layout import BlockLayout
from kvmem_core.store import BlockStore

LAYOUT = BlockLayout(n_layers=1, n_kv_heads=1, head_dim=4, n_heads=2, block_tokens=16)
BLOCK = LAYOUT.kv_bytes_per_block
FILE = encode_header(synthetic_chain(LAYOUT, np.arange(16), "ns")[0][0], LAYOUT).file_size + 64

OPS = st.one_of(
    st.tuples(st.just("new"), st.integers(1, 3)),
    st.tuples(st.just("extend"), st.integers(0, 7), st.integers(1, 3)),
    st.tuples(st.just("fork"), st.integers(0, 7), st.integers(0, 3)),
    st.tuples(st.just("delete"), st.integers(0, 7)),
    st.tuples(st.just("pin"), st.integers(0, 7)),
    st.tuples(st.just("complete"), st.integers(0, 7)),
    st.tuples(st.just("touch"), st.integers(0, 7)),
    st.tuples(st.just("flush")),
    st.tuples(st.just("restart")),
)


class Run:
    """Drives a store and a model of what it must hold."""

    def __init__(self, root: Path | None, retention: str) -> None:
        self.root, self.retention = root, retention
        self.store = self._open()
        self.tokens: dict[str, np.ndarray] = {}
        self.kv: dict[str, object] = {}
        self.tickets: list = []
        self.fresh = 0

    def _open(self) -> BlockStore:
        if self.root is None:
            return BlockStore(LAYOUT, cpu_bytes=6 * BLOCK, retention=self.retention)
        return BlockStore(
            LAYOUT, cpu_bytes=3 * BLOCK, nvme_dir=self.root, nvme_bytes=8 * FILE, retention=self.retention, fsync=False
        )

    def new_ids(self, n_blocks: int) -> np.ndarray:
        self.fresh += 1
        return np.arange(n_blocks * 16) + self.fresh * 100_000

    def pick(self, i: int) -> str | None:
        ids = sorted(w["id"] for w in self.store.list_workspaces())
        return ids[i % len(ids)] if ids else None

    def step(self, ids: np.ndarray) -> None:
        ws, _ = self.store.open_workspace("ns", ids)
        self.tokens[ws.id] = ids[: len(ws.hashes) * 16]
        for meta, kv in synthetic_chain(LAYOUT, ids, "ns", seed=self.fresh)[len(ws.hashes) :]:
            known = self.store.lookup(meta.chain_hash) is not None
            try:
                self.store.append(ws.id, meta, kv)
            except CapacityError:
                return
            self.kv.setdefault(meta.chain_hash, kv) if known else self.kv.__setitem__(meta.chain_hash, kv)
            self.tokens[ws.id] = ids[: meta.end_pos]

    def apply(self, op: tuple) -> None:
        kind, ws_id = op[0], self.pick(op[1]) if len(op) > 1 else None
        if kind == "new":
            self.step(self.new_ids(op[1]))
        elif kind == "extend" and ws_id:
            self.step(np.concatenate([self.tokens[ws_id], self.new_ids(op[2])]))
        elif kind == "fork" and ws_id:
            self.step(np.concatenate([self.tokens[ws_id][: op[2] * 16], self.new_ids(1)]))
        elif kind == "delete" and ws_id:
            assert self.store.delete_workspace(ws_id)
        elif kind == "pin" and ws_id:
            hashes = self.store.workspaces.get(ws_id).hashes
            in_host = [h for h in hashes if self.store.tier(h) in ("host", "host+nvme")]
            self.tickets.append((self.store.prepare_load(hashes), in_host))
        elif kind == "complete" and self.tickets:
            self.complete(self.tickets.pop(op[1] % len(self.tickets))[0])
        elif kind == "touch" and ws_id:
            self.store.touch(self.store.workspaces.get(ws_id).hashes)
        elif kind == "flush":
            self.store.flush()
            self.check_disk()
        elif kind == "restart" and self.root is not None:
            while self.tickets:
                self.complete(self.tickets.pop()[0])
            before = {w.id: list(w.hashes) for w in self.store.workspaces.all()}
            self.store.close()
            self.store = self._open()
            assert self.store.metrics()["corrupt"] == 0
            assert {w.id: w.hashes for w in self.store.workspaces.all()} == before

    def complete(self, ticket) -> None:
        result = self.store.complete_load(ticket)
        assert result.missing == ()
        for h, kv in result.blocks.items():
            assert kv.k.tobytes() == self.kv[h].k.tobytes() and kv.v.tobytes() == self.kv[h].v.tobytes()

    def check(self) -> None:
        s = self.store
        assert s.host.used <= s.host.capacity
        assert s.host.used == sum(s.host.get(h).nbytes for h in s.host.hashes())
        stored = set(s._metas)
        referenced = {h for w in s.workspaces.all() for h in w.hashes}
        pinned = {h for t, _ in self.tickets for h in t.pinned}
        assert referenced | pinned >= stored, "a stored block nobody references"
        assert all(s.tier(h) is not None for h in referenced | pinned), "a referenced or pinned block was lost"
        assert set(s.host.hashes()) <= stored
        for _, in_host in self.tickets:
            assert all(s.tier(h) in ("host", "host+nvme") for h in in_host), "a pinned block left the host"
        if s.nvme is not None:
            assert s.nvme.used <= s.nvme.capacity
            assert s.nvme.used == sum(s.nvme.sizes.values()) + sum(r for _, r in s._writing.values())

    def check_disk(self) -> None:
        s = self.store
        if s.nvme is not None:
            on_disk = {p.stem for p in s.nvme.blocks_dir.iterdir()}
            assert on_disk == set(s.nvme.sizes) == set(s._metas), "disk and index disagree after flush"


def run(ops: list[tuple], root: Path | None, retention: str) -> None:
    r = Run(root, retention)
    try:
        for op in ops:
            r.apply(op)
            r.check()
        while r.tickets:
            r.complete(r.tickets.pop()[0])
        r.store.flush()
        r.check_disk()
    finally:
        r.store.close()


SETTINGS = settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@SETTINGS
@given(st.lists(OPS, max_size=30), st.sampled_from(["evict-idle", "keep-all"]))
def test_nvme_store_invariants(ops, retention):
    with tempfile.TemporaryDirectory() as d:
        run(ops, Path(d), retention)


@SETTINGS
@given(st.lists(OPS, max_size=30), st.sampled_from(["evict-idle", "keep-all"]))
def test_host_store_invariants(ops, retention):
    run(ops, None, retention)
