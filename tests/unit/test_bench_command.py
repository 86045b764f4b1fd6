"""``kvmem bench``: without the kvmem_bench package (an install without it), one line that names what to install;
``speed --plot-from`` draws earlier runs together."""

from __future__ import annotations

import json
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


def test_plot_from_draws_earlier_runs_together_and_a_bad_file_is_one_line(tmp_path, capsys):
    for size in (65536, 131072):
        point = {"workspace_tokens": size, "reuse_ttft_s": 0.5, "reprefill_ttft_s": 3.0, "kvmem_tok_s": 150.0}
        (tmp_path / f"{size}.json").write_text(json.dumps({"backend": "torch", "points": [point]}))
    runs = [str(tmp_path / "131072.json"), str(tmp_path / "65536.json")]
    assert main(["bench", "speed", "--plot-from", *runs, "--out", str(tmp_path / "plots")]) == 0
    out = capsys.readouterr().out.splitlines()
    assert [line.split()[0] for line in out[1:3]] == ["65536", "131072"]
    assert sorted(p.name for p in (tmp_path / "plots").iterdir()) == ["decode.png", "ttft.png"]
    assert main(["bench", "speed", "--plot-from", str(tmp_path / "missing.json")]) == 2
    _, err = capsys.readouterr()
    assert err.startswith("kvmem: --plot-from: ") and "missing.json: not a kvmem bench speed result" in err
    assert err.count("\n") == 1
