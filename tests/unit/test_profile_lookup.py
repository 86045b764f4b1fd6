"""Profile lookup: a profile measured at another block size is passed over, one without a size fits."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from kvmem import profiles
from kvmem_core.retrieval import RetrievalProfile


class StubAdapter:
    def __init__(self, block_tokens: int) -> None:
        self.fingerprint = "0123456789abcdef"
        self.layout = SimpleNamespace(block_tokens=block_tokens)


@pytest.fixture
def cached(monkeypatch, tmp_path):
    monkeypatch.setenv("KVMEM_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(profiles, "installed_dirs", lambda: [])

    def put(block_tokens: int) -> None:
        profile = RetrievalProfile("0123456789abcdef", ((1, 2),), block_tokens=block_tokens)
        profiles.save_profile(profile, profiles.cache_dir())

    return put


@pytest.mark.parametrize("stored", [64, 0])
def test_profile_at_the_same_or_no_recorded_size_is_used(cached, stored):
    cached(stored)
    assert profiles.find_profile(StubAdapter(64)).heads == ((1, 2),)


def test_profile_at_another_block_size_is_passed_over(cached, caplog):
    cached(128)
    assert profiles.find_profile(StubAdapter(64)) is None
    assert "128-token blocks" in caplog.text
