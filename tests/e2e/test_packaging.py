"""A built wheel carries every module, the web UI and the retrieval profiles, and an installed server
finds its UI through ``importlib.resources`` without the checkout."""

from __future__ import annotations

import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from kvmem.server.app import installed_ui_dir

ROOT = Path(__file__).resolve().parents[2]
# source folder -> where its files land in the wheel
INSTALLED_AS = {
    "kvmem_core": "kvmem_core",
    "adapters/kvmem_llamacpp": "kvmem_llamacpp",
    "adapters/kvmem_torch": "kvmem_torch",
    "launcher/kvmem": "kvmem",
    "webui": "kvmem_webui",
}
UI_FILES = ("index.html", "style.css", "js/*.js", "vendor/*")


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """``pip wheel`` of a copy of the checkout's files (tracked and new, not ignored)."""
    src, out = tmp_path_factory.mktemp("src"), tmp_path_factory.mktemp("wheel")
    listed = (
        subprocess.run(
            ["git", "ls-files", "-co", "--exclude-standard", "-z"], cwd=ROOT, capture_output=True, check=True
        )
        .stdout.decode()
        .split("\0")
    )
    for name in filter(None, listed):
        if (ROOT / name).is_file():
            (src / name).parent.mkdir(parents=True, exist_ok=True)
            (src / name).write_bytes((ROOT / name).read_bytes())
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", ".", "-w", str(out)],
        cwd=src,
        check=True,
        capture_output=True,
        timeout=300,
    )
    return next(out.glob("kvmem-*.whl"))


def expected(folder: str, patterns: tuple[str, ...]) -> set[str]:
    """Wheel paths of the files under ``folder`` that match ``patterns``."""
    base = ROOT / folder
    return {
        f"{INSTALLED_AS[folder]}/{p.relative_to(base)}"
        for pattern in patterns
        for p in base.glob(pattern)
        if p.is_file() and "__pycache__" not in p.parts
    }


def test_the_wheel_holds_every_module_the_ui_and_the_profiles(wheel: Path) -> None:
    names = set(zipfile.ZipFile(wheel).namelist())
    for folder in INSTALLED_AS:
        missing = expected(folder, ("**/*.py",)) - names
        assert not missing, f"not in the wheel (add the package to pyproject.toml): {sorted(missing)}"
    ui = expected("webui", UI_FILES)
    assert "kvmem_webui/index.html" in ui and "kvmem_webui/vendor/purify.js" in ui and ui <= names
    profiles = expected("adapters/kvmem_llamacpp", ("profiles/*.json",))
    assert profiles and profiles <= names


def test_an_installed_server_serves_the_packaged_ui(wheel: Path, tmp_path: Path) -> None:
    site = tmp_path / "site"
    zipfile.ZipFile(wheel).extractall(site)
    env = {**os.environ, "PYTHONPATH": str(site), "KVMEM_RUN_DIR": str(tmp_path)}
    done = subprocess.run(
        [sys.executable, "-m", "kvmem", "serve", "--dry-run", "--backend", "llama.cpp"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    ui_line = next(line for line in done.stdout.splitlines() if line.startswith("web UI"))
    assert ui_line.split()[-1] == str(site / "kvmem_webui")


def test_the_checkout_serves_its_own_webui_folder() -> None:
    assert installed_ui_dir() == ROOT / "webui"
