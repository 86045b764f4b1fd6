"""Retrieval-head profiles: the small test model's ships with the repository; ``kvmem calibrate`` writes one."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from model_support import SMALL_MODEL, small_model

from kvmem_core.adapter import file_fingerprint
from kvmem_core.retrieval import RetrievalProfile
from test_cli_run import ROOT, kvmem

SHIPPED = ROOT / "adapters" / "kvmem_llamacpp" / "profiles"


def test_the_small_model_has_a_shipped_profile():

    profile = RetrievalProfile.load(SHIPPED / f"{file_fingerprint(str(small_model()))}.json")
    assert len(profile.heads) == 3 and profile.n_docs == 8  # a version-1 profile (see docs/retrieval.md)
    assert len(profile.scores) == 30 * 9 and all(0 <= layer < 30 and 0 <= head < 9 for layer, head in profile.heads)


def test_the_default_model_ships_a_profile_for_the_default_block_size():
    from kvmem.models import resolve_model
    from kvmem.profiles import N_HEADS
    from kvmem_core.config import KVMemConfig
    from kvmem_core.errors import ModelNotFoundError

    try:
        path = resolve_model(None)
    except ModelNotFoundError as exc:
        pytest.skip(str(exc))
    profile = RetrievalProfile.load(SHIPPED / f"{file_fingerprint(str(path))}.json")
    assert len(profile.heads) == N_HEADS and profile.block_tokens == KVMemConfig().block_tokens
    assert profile.n_docs >= 8 and profile.n_holdout >= 2 and profile.holdout_hit_rate >= 0.75


@pytest.mark.llamacpp
@pytest.mark.slow
def test_calibrate_writes_a_profile_keyed_by_the_model_file(tmp_path):
    pytest.importorskip("llama_cpp")
    model = small_model()
    out = kvmem("calibrate", "--model", SMALL_MODEL, "--docs", "4", "--out", str(tmp_path))
    assert out.returncode == 0, out.stderr
    m = re.fullmatch(
        r"retrieval heads ((?:\d+:\d+,?)+) \(found the fact in \d+% of \d+ documents, "
        r"\d+% of (\d+) held out\) -> (\S+)\n",
        out.stdout,
    )
    assert m and Path(m.group(3)) == tmp_path / f"{file_fingerprint(str(model))}.json"
    data = json.loads(Path(m.group(3)).read_text())
    assert ",".join(f"{a}:{b}" for a, b in data["heads"]) == m.group(1)
