"""Every ``python -m MODULE`` that README.md and docs/ (kept runs' READMEs included) tell a reader to run names a
module of this tree, so a command stays runnable after code moves (the benchmarks moved into kvmem_bench)."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGE_DIRS = {
    "kvmem_core": ROOT,
    "kvmem_bench": ROOT,
    "kvmem": ROOT / "launcher",
    "kvmem_torch": ROOT / "adapters",
    "kvmem_llamacpp": ROOT / "adapters",
}
RUN_MODULE = re.compile(r"python3? -m ([A-Za-z_][\w.]*)")


def _module_exists(name: str) -> bool:
    """Whether ``name`` is a module file or package folder of this tree (found without importing it)."""
    path = PACKAGE_DIRS[name.split(".")[0]].joinpath(*name.split("."))
    return path.with_suffix(".py").is_file() or (path / "__main__.py").is_file()


def _project_commands() -> list[tuple[str, str]]:
    """(document, module) for each ``python -m`` of one of this tree's packages in the Markdown documents."""
    documents = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
    return [
        (str(doc.relative_to(ROOT)), name)
        for doc in documents
        for name in RUN_MODULE.findall(doc.read_text())
        if name.split(".")[0] in PACKAGE_DIRS
    ]


def test_the_documents_run_project_modules():
    assert any(name.startswith("kvmem_bench.") for _, name in _project_commands())


def test_every_documented_module_exists():
    missing = sorted({f"{doc}: python -m {name}" for doc, name in _project_commands() if not _module_exists(name)})
    assert missing == [], "\n".join(missing)
