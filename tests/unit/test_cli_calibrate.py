"""Retrieval-head profiles: the small test model's ships with the repository; ``kvmem calibrate`` writes one."""
from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from model_support import SMALL_MODEL, small_model

from kvmem_core.adapter import file_fingerprint
from test_cli_run import ROOT, kvmem

SHIPPED = ROOT / "adapters" / "kvmem_llamacpp" / "profiles"


def test_the_small_model_has_a_shipped_profile():
    from kvmem_core.retrieval import RetrievalProfile

    profile = RetrievalProfile.load(SHIPPED / f"{file_fingerprint(str(small_model()))}.json")
    assert len(profile.heads) == 3 and profile.n_docs == 8
    assert len(profile.scores) == 30 * 9 and all(0 <= layer < 30 and 0 <= head < 9 for layer, head in profile.heads)


@pytest.mark.llamacpp
@pytest.mark.slow
def test_calibrate_writes_a_profile_keyed_by_the_model_file(tmp_path):
    pytest.importorskip("llama_cpp")
    model = small_model()
    out = kvmem("calibrate", "--model", SMALL_MODEL, "--docs", "2", "--out", str(tmp_path))
    assert out.returncode == 0, out.stderr
    m = re.fullmatch(r"retrieval heads (\d+:\d+),(\d+:\d+),(\d+:\d+) \(2 documents\) -> (\S+)\n", out.stdout)
    assert m and Path(m.group(4)) == tmp_path / f"{file_fingerprint(str(model))}.json"
    data = json.loads(Path(m.group(4)).read_text())
    assert [f"{a}:{b}" for a, b in data["heads"]] == list(m.groups()[:3])
