"""Kept quality runs (``docs/results``): outcomes compressed out of ``quality.json`` and read back unchanged."""

from __future__ import annotations

import json
from pathlib import Path

from kvmem_bench import report
from kvmem_bench.results import OUTCOMES, keep_run, read_outcomes

ROOT = Path(__file__).resolve().parents[2]
OUTCOME_ROWS = [{"session": i, "size": 4096, "view": 512, "method": "recent", "correct": i % 2 == 0} for i in range(5)]


def _run(folder: Path, *, outcomes_inside: bool) -> dict:
    folder.mkdir()
    detail = {"meta": {"model": "m"}, "results": [], "summary": {"n": 5}}
    (folder / "quality.json").write_text(
        json.dumps({**detail, "outcomes": OUTCOME_ROWS} if outcomes_inside else detail)
    )
    (folder / "outcomes.jsonl").write_text("".join(json.dumps(o) + "\n" for o in OUTCOME_ROWS))
    (folder / "accuracy_vs_size.png").write_bytes(b"\x89PNG plot")
    return detail


def test_a_kept_run_holds_the_summary_plots_and_every_outcome_compressed(tmp_path: Path) -> None:
    detail = _run(tmp_path / "run", outcomes_inside=True)
    keep_run(tmp_path / "run", tmp_path / "kept")
    assert json.loads((tmp_path / "kept" / "quality.json").read_text()) == detail
    assert read_outcomes(tmp_path / "kept" / OUTCOMES) == OUTCOME_ROWS
    assert (tmp_path / "kept" / "accuracy_vs_size.png").read_bytes() == b"\x89PNG plot"
    first = (tmp_path / "kept" / OUTCOMES).read_bytes()
    keep_run(tmp_path / "run", tmp_path / "kept")
    assert (tmp_path / "kept" / OUTCOMES).read_bytes() == first  # the same run, the same bytes


def test_a_run_kept_in_place_takes_its_outcomes_from_the_journal(tmp_path: Path) -> None:
    detail = _run(tmp_path / "run", outcomes_inside=False)
    keep_run(tmp_path / "run", tmp_path / "run")
    assert json.loads((tmp_path / "run" / "quality.json").read_text()) == detail
    assert read_outcomes(tmp_path / "run" / OUTCOMES) == OUTCOME_ROWS


def test_the_kept_report_run_outcomes_give_its_results_table() -> None:
    kept = ROOT / "docs" / "results" / "quality-report-2026-12-03"
    outcomes = read_outcomes(kept / OUTCOMES)
    assert len(outcomes) == 1300
    assert report.rows(outcomes) == json.loads((kept / "quality.json").read_text())["results"]


def test_no_kept_run_holds_its_outcomes_uncompressed() -> None:
    for path in (ROOT / "docs" / "results").rglob("quality.json"):
        assert "outcomes" not in json.loads(path.read_text()), path


def test_kept_json_is_a_summary_and_larger_output_is_compressed() -> None:
    """Raw output past a summary's size (100 KB) is kept gzip-compressed, so the repository stays small."""
    large = [
        str(path.relative_to(ROOT))
        for path in (ROOT / "docs" / "results").rglob("*")
        if path.suffix in (".json", ".jsonl") and path.stat().st_size > 100_000
    ]
    assert large == [], large
