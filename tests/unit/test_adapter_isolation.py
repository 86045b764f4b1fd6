"""Each engine adapter stands alone: no package under adapters/ imports another adapter's package."""
from __future__ import annotations

import ast
from pathlib import Path

ADAPTERS = Path(__file__).resolve().parents[2] / "adapters"


def _adapter_packages() -> list[str]:
    return sorted(p.name for p in ADAPTERS.iterdir() if (p / "__init__.py").is_file())


def _imported_roots(path: Path) -> set[str]:
    """Top-level package names a file imports, lazy imports inside functions included."""
    roots = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            roots.update(a.name.split(".")[0] for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            roots.add(node.module.split(".")[0])
    return roots


def test_no_adapter_imports_another_adapter():
    packages = _adapter_packages()
    assert len(packages) >= 2
    bad = []
    for own in packages:
        for path in sorted((ADAPTERS / own).rglob("*.py")):
            bad += [f"{path.relative_to(ADAPTERS)} imports {o}" for o in _imported_roots(path) & set(packages) - {own}]
    assert bad == [], "\n".join(bad)
