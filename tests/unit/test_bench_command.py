"""``kvmem bench`` without the kvmem_bench package (an install without it): one line that names what to install."""

from __future__ import annotations

import sys
from importlib.abc import MetaPathFinder

import pytest

from kvmem.cli import main


class HideBenchmarks(MetaPathFinder):
    """Finds no ``kvmem_bench``, as an environment where it is not installed."""

    def find_spec(self, fullname, path, target=None):
        if fullname.split(".")[0] == "kvmem_bench":
            raise ModuleNotFoundError(f"No module named {fullname!r}", name=fullname)
        return None


@pytest.fixture
def no_benchmarks(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in [n for n in sys.modules if n.split(".")[0] == "kvmem_bench"]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setattr(sys, "meta_path", [HideBenchmarks(), *sys.meta_path])


@pytest.mark.parametrize("argv", [["bench", "speed"], ["bench", "quality", "--quick"]])
def test_a_bench_without_the_package_says_what_to_install(no_benchmarks, argv, capsys):
    assert main(argv) == 2
    out, err = capsys.readouterr()
    assert out == "" and err == "kvmem: kvmem bench needs the kvmem_bench package (pip install 'kvmem[bench]')\n"
