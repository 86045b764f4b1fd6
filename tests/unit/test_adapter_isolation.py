"""Each engine adapter stands alone: no package under adapters/ imports another adapter's package; the product
(kvmem_core, the adapters, the launcher) never imports the benchmarks, but ``kvmem bench`` inside its functions."""

from __future__ import annotations

import ast
from pathlib import Path
from typing import Iterable

ROOT = Path(__file__).resolve().parents[2]
ADAPTERS = ROOT / "adapters"
PRODUCT = ("kvmem_core", "adapters", "launcher")
BENCH_COMMAND = ROOT / "launcher" / "kvmem" / "cmd_bench.py"


def _adapter_packages() -> list[str]:
    return sorted(p.name for p in ADAPTERS.iterdir() if (p / "__init__.py").is_file())


def _imported_roots(path: Path, *, lazy: bool = True) -> set[str]:
    """Top-level package names a file imports; with ``lazy``, imports inside functions too, and the names passed
    to ``importlib.import_module`` as a literal or f-string."""
    tree = ast.parse(path.read_text(), filename=str(path))
    if not lazy:
        return {name.split(".")[0] for name in _modules(tree.body)}
    return {name.split(".")[0] for name in _modules(ast.walk(tree))} | _dynamic_roots(tree)


def _imported_modules(path: Path) -> set[str]:
    """Full module names a file imports, lazy imports inside functions included."""
    return _modules(ast.walk(ast.parse(path.read_text(), filename=str(path))))


def _modules(nodes: Iterable[ast.AST]) -> set[str]:
    names = set()
    for node in nodes:
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module)
    return names


def _dynamic_roots(tree: ast.AST) -> set[str]:
    """Roots of ``import_module("pkg...")`` / ``import_module(f"pkg...")`` calls."""
    roots = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and getattr(node.func, "attr", getattr(node.func, "id", "")) == "import_module":
            first = node.args[0] if node.args else None
            if isinstance(first, ast.JoinedStr) and first.values:
                first = first.values[0]
            if isinstance(first, ast.Constant) and isinstance(first.value, str):
                roots.add(first.value.split(".")[0])
    return roots


def test_no_adapter_imports_another_adapter():
    packages = _adapter_packages()
    assert len(packages) >= 2
    bad = []
    for own in packages:
        for path in sorted((ADAPTERS / own).rglob("*.py")):
            bad += [f"{path.relative_to(ADAPTERS)} imports {o}" for o in _imported_roots(path) & set(packages) - {own}]
    assert bad == [], "\n".join(bad)


def test_the_product_never_imports_the_benchmarks():
    bad = []
    for folder in PRODUCT:
        for path in sorted((ROOT / folder).rglob("*.py")):
            roots = _imported_roots(path, lazy=path != BENCH_COMMAND)
            bad += [f"{path.relative_to(ROOT)} imports kvmem_bench"] if "kvmem_bench" in roots else []
    assert bad == [], "\n".join(bad)
    assert "kvmem_bench" in _imported_roots(BENCH_COMMAND), "the check must see cmd_bench's lazy import"


def test_the_benchmarks_use_only_each_engines_public_api():
    """kvmem_bench imports an adapter's package itself (its public names), never a module inside it."""
    packages = _adapter_packages()
    bad = [
        f"{path.relative_to(ROOT)} imports {name}"
        for path in sorted((ROOT / "kvmem_bench").rglob("*.py"))
        for name in _imported_modules(path)
        if name.split(".")[0] in packages and "." in name
    ]
    assert bad == [], "\n".join(bad)
