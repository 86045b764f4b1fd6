"""The user cache folder: KVMEM_CACHE_DIR first, then XDG_CACHE_HOME, then ~/.cache."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvmem_core.paths import cache_root


@pytest.fixture
def env(monkeypatch, tmp_path):
    monkeypatch.delenv("KVMEM_CACHE_DIR", raising=False)
    monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    return monkeypatch


def test_default_is_home_cache(env, tmp_path):
    assert cache_root() == tmp_path / "home" / ".cache" / "kvmem"


def test_xdg_cache_home(env, tmp_path):
    env.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert cache_root() == tmp_path / "xdg" / "kvmem"


def test_kvmem_cache_dir_wins(env, tmp_path):
    env.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    env.setenv("KVMEM_CACHE_DIR", str(tmp_path / "mine"))
    assert cache_root() == tmp_path / "mine"


def test_empty_variables_count_as_unset(env, tmp_path):
    env.setenv("XDG_CACHE_HOME", "")
    env.setenv("KVMEM_CACHE_DIR", "")
    assert cache_root() == tmp_path / "home" / ".cache" / "kvmem"


def test_every_cache_user_goes_through_it(env, tmp_path):
    from kvmem import cmd_serve, models, profiles
    from kvmem_llamacpp import gate

    env.delenv("KVMEM_RUN_DIR", raising=False)
    env.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert profiles.cache_dir() == tmp_path / "xdg" / "kvmem" / "profiles"
    assert gate.cache_dir() == tmp_path / "xdg" / "kvmem" / "native"
    assert cmd_serve.pidfile(8000) == tmp_path / "xdg" / "kvmem" / "serve-8000.json"
    assert Path(models.DEFAULT.target()).parent == tmp_path / "xdg" / "kvmem" / "models"
