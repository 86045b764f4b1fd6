"""Blocks that left the view come back bit-exact: from the host tier, and from NVMe after a restart; a lost
one is recomputed and the answer stays the same."""

from __future__ import annotations

import shutil
from typing import Callable

import numpy as np
import pytest

from kvmem_core.config import KVMemConfig
from kvmem_core.contract import StepResult
from kvmem_core.engine import KVMemEngine
from llamacpp_support import N_BATCH, PARAGRAPH, Plain, chat, model_path

pytestmark = pytest.mark.llamacpp
CFG = KVMemConfig(ctx=4096, budget=2048, gen_budget=512, block_tokens=64, sink_tokens=64, recent_tokens=256)
A1 = [
    {"role": "system", "content": "You keep harbour records."},
    {"role": "user", "content": PARAGRAPH * 5 + "What did the ledger note?"},
]
B1 = [{"role": "system", "content": "Answer in one word."}, {"role": "user", "content": "Name a colour of the sea."}]


@pytest.fixture(scope="module")
def adapter():
    from kvmem_llamacpp import create_adapter

    a = create_adapter(str(model_path()), CFG, n_batch=N_BATCH)
    yield a
    a.close()


def second_turn(r1_text: str) -> list[dict[str, str]]:
    return A1 + [{"role": "assistant", "content": r1_text}, {"role": "user", "content": "Who kept it?"}]


@pytest.fixture(scope="module")
def plain():
    return Plain(model_path())


def check_against_plain(engine: KVMemEngine, plain: Plain, r1, r2) -> None:
    ids1 = engine.tokenize(engine.adapter.render_chat(A1))
    _, tokens1 = plain.run(ids1, 0, 8)
    assert list(r1.token_ids) == tokens1
    first, tokens2 = plain.run(engine.tokenize(engine.adapter.render_chat(second_turn(r1.text))), r2.cached_tokens, 8)
    assert np.array_equal(engine.last_logits, first)
    assert list(r2.token_ids) == tokens2


def host_round_trip(adapter, plain: Plain, cfg: KVMemConfig) -> None:
    """A1, B1 (it takes the view), A1's second turn from the host tier: answers as ``plain``."""
    engine = KVMemEngine(adapter, cfg, heads=((17, 3),))
    r1 = engine.step(chat(A1), lambda piece: True)
    engine.step(chat(B1), lambda piece: True)  # another conversation takes the view
    loaded = engine.metrics()["blocks_loaded"]
    r2 = engine.step(chat(second_turn(r1.text)), lambda piece: True)
    assert engine.metrics()["blocks_loaded"] - loaded == r2.cached_tokens // cfg.block_tokens >= 2
    check_against_plain(engine, plain, r1, r2)


def nvme_round_trip(adapter, plain: Plain, cfg: KVMemConfig) -> None:
    """A1, a restart that finds its blocks on NVMe only (``cfg.nvme_dir``), its second turn: answers as ``plain``."""
    cfg = cfg.replace(cpu_gb=0.01)
    first = KVMemEngine(adapter, cfg, heads=((17, 3),))
    r1 = first.step(chat(A1), lambda piece: True)
    first.store.close()
    engine = KVMemEngine(adapter, cfg, heads=((17, 3),))  # a restart: the index is rebuilt from disk
    hashes = [h for ws in engine.store.workspaces.all() for h in ws.hashes]
    assert hashes and all(engine.store.tier(h) == "nvme" for h in hashes)
    r2 = engine.step(chat(second_turn(r1.text)), lambda piece: True)
    assert r2.cached_tokens >= len(hashes) * cfg.block_tokens - cfg.block_tokens
    assert engine.metrics()["blocks_loaded"] == r2.cached_tokens // cfg.block_tokens
    check_against_plain(engine, plain, r1, r2)
    engine.store.close()


def test_host_tier_round_trip_is_bit_identical(adapter, plain):
    host_round_trip(adapter, plain, CFG)


def test_nvme_round_trip_after_restart_is_bit_identical(adapter, plain, tmp_path):
    nvme_round_trip(adapter, plain, CFG.replace(nvme_dir=tmp_path))


def turns_with_a_lost_block(engine: KVMemEngine, lose: Callable[[str], None]) -> tuple[StepResult, StepResult]:
    """A1, then B1 (it takes the view), then ``lose`` one of A1's stored blocks (by hash), then A1's second turn."""
    r1 = engine.step(chat(A1), lambda piece: True)
    engine.step(chat(B1), lambda piece: True)
    lose(engine.store.workspaces.get(r1.workspace_id).hashes[1])
    return r1, engine.step(chat(second_turn(r1.text)), lambda piece: True)


def test_a_block_dropped_from_the_host_tier_is_recomputed_and_the_answer_is_unchanged(adapter, plain):
    _, clean = turns_with_a_lost_block(KVMemEngine(adapter, CFG, heads=((17, 3),)), lambda h: None)
    engine = KVMemEngine(adapter, CFG, heads=((17, 3),))
    r1, r2 = turns_with_a_lost_block(engine, engine.store.host.pop)
    assert engine.metrics()["blocks_recomputed"] == 1 and r2.workspace_id == r1.workspace_id
    assert r2.cached_tokens == CFG.block_tokens < clean.cached_tokens  # prefilled again from the lost block on
    assert (r2.text, r2.token_ids) == (clean.text, clean.token_ids)
    check_against_plain(engine, plain, r1, r2)


def test_a_block_corrupted_on_disk_is_recomputed_and_the_answer_is_unchanged(adapter, plain, tmp_path):
    from kvmem_core.blockfile import SUFFIX

    cfg = CFG.replace(nvme_dir=tmp_path / "nvme", cpu_gb=0.01)
    first = KVMemEngine(adapter, cfg, heads=((17, 3),))
    r1 = first.step(chat(A1), lambda piece: True)
    first.store.close()
    shutil.copytree(tmp_path / "nvme", tmp_path / "clean")
    clean = KVMemEngine(adapter, cfg.replace(nvme_dir=tmp_path / "clean"), heads=((17, 3),))
    expected = clean.step(chat(second_turn(r1.text)), lambda piece: True)
    clean.store.close()
    victim = sorted((tmp_path / "nvme").rglob("*" + SUFFIX))[0]
    data = bytearray(victim.read_bytes())
    data[-100] ^= 0xFF  # one payload byte
    victim.write_bytes(bytes(data))
    engine = KVMemEngine(adapter, cfg, heads=((17, 3),))  # a restart: the damage is found when the block loads
    r2 = engine.step(chat(second_turn(r1.text)), lambda piece: True)
    assert engine.metrics()["blocks_recomputed"] == 1 and engine.metrics()["store_corrupt"] == 1
    assert r2.cached_tokens < expected.cached_tokens  # the damaged block and those after it were computed again
    assert (r2.text, r2.token_ids) == (expected.text, expected.token_ids)
    check_against_plain(engine, plain, r1, r2)
    engine.store.close()
