"""``kvmem models``: every known model, whether it is here, the default first; it installs and assembles nothing."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvmem.cli import main
from kvmem.models import DEFAULT, KNOWN
from test_cli_run import kvmem


def test_json_lists_every_known_model_default_first(tmp_path: Path) -> None:
    out = kvmem("models", "--json", env={"KVMEM_CACHE_DIR": str(tmp_path)})
    assert out.returncode == 0, out.stderr
    rows = json.loads(out.stdout)
    assert [row["name"] for row in rows] == [DEFAULT.name, *(m.name for m in KNOWN if m is not DEFAULT)]
    assert [row["default"] for row in rows] == [True] + [False] * (len(KNOWN) - 1)
    for row in rows:
        assert row["state"] in ("installed", "assembled", "missing")
        assert (row["path"] is None) == (row["size"] is None) == (row["state"] == "missing")
    qwen = rows[0]
    assert qwen["aliases"] == ["qwen2.5-coder:0.5b"] and qwen["state"] != "assembled"  # an empty cache
    if qwen["state"] == "installed":
        assert qwen["path"] == str(tmp_path / "models" / "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf")
        assert qwen["size"] == 491_400_064
    assert not any(tmp_path.iterdir())


def test_table_marks_the_default_and_shows_where_each_is(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("KVMEM_CACHE_DIR", str(tmp_path))
    assert main(["models"]) == 0
    header, *lines = capsys.readouterr().out.splitlines()
    assert header.split() == ["NAME", "ALIASES", "MODEL", "STATE", "SIZE", "WHERE"]
    assert len(lines) == len(KNOWN) and lines[0].startswith(f"{DEFAULT.name} (default) ")
    for line, model in zip(lines, sorted(KNOWN, key=lambda m: m is not DEFAULT)):
        seen = model.availability()
        assert line.startswith(model.name) and f" {seen.state} " in line and seen.note in line
        assert seen.path is None or str(seen.path) in line
