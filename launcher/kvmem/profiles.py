"""Retrieval-head profiles: run the synthetic calibration on a model and cache the result.

A profile is looked up by the model file's fingerprint: first in the user cache
(``$KVMEM_CACHE_DIR`` or ``~/.cache/kvmem``, under ``profiles/``), then among the profiles
shipped next to the adapter package, then next to every other installed adapter package;
missing all, the calibration runs (about a minute for the embedded model on one CPU
thread) and its result is cached. A profile holds (attention layer, query head) pairs of
the weights, so it serves every backend that loads the same file: both engines number
attention layers and heads alike, and a permutation inside a head (llama.cpp's rotary row
order) changes no q·k product.
"""
from __future__ import annotations

import importlib.metadata
import importlib.util
import os
import sys
from pathlib import Path
from typing import Any

from kvmem_core.adapter import EngineAdapter
from kvmem_core.errors import ConfigError
from kvmem_core.retrieval import CalibrationDoc, RetrievalProfile, calibrate
from kvmem_core.synthetic import SyntheticDoc, make_docs

N_DOCS = 8
N_HEADS = 3
FILLER_LINES = 40  # lines of surrounding text per document when the view allows
TOKENS_PER_LINE = 42  # the longest surrounding's lines, measured on SmolLM2's tokenizer
DOC_OVERHEAD = 160  # template, fact line and question


def cache_dir() -> Path:
    return Path(os.environ.get("KVMEM_CACHE_DIR", Path.home() / ".cache" / "kvmem")) / "profiles"


def shipped_dir(adapter: EngineAdapter) -> Path:
    """``profiles/`` inside the adapter's package (data shipped with the repository)."""
    return Path(sys.modules[type(adapter).__module__].__file__).parent / "profiles"


def installed_dirs() -> list[Path]:
    """``profiles/`` of every installed adapter package (found without importing them)."""
    out = []
    for ep in importlib.metadata.entry_points(group="kvmem.adapters"):
        spec = importlib.util.find_spec(ep.value.partition(":")[0].partition(".")[0])
        if spec is not None and spec.submodule_search_locations:
            out.append(Path(next(iter(spec.submodule_search_locations))) / "profiles")
    return out


def find_profile(adapter: EngineAdapter) -> RetrievalProfile | None:
    """The cached or shipped profile of the adapter's model file, if any."""
    for folder in (cache_dir(), shipped_dir(adapter), *installed_dirs()):
        path = folder / f"{adapter.fingerprint}.json"
        if path.is_file():
            return RetrievalProfile.load(path)
    return None


def retrieval_heads(adapter: EngineAdapter, *, progress: bool = False) -> tuple[tuple[int, int], ...]:
    """The model's retrieval heads, calibrating (and caching) first when no profile exists."""
    profile = find_profile(adapter)
    if profile is None:
        profile = run_calibration(adapter, progress=progress)
        save_profile(profile, cache_dir())
    return profile.heads


def save_profile(profile: RetrievalProfile, folder: Path) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{profile.fingerprint}.json"
    profile.save(path)
    return path


def run_calibration(adapter: EngineAdapter, *, n_docs: int = N_DOCS, progress: bool = False) -> RetrievalProfile:
    """Capture per-head queries and keys on synthetic documents and rank the heads (view is cleared)."""
    lines = min(FILLER_LINES, (adapter.caps.max_view_tokens - DOC_OVERHEAD) // TOKENS_PER_LINE)
    if lines < 4:
        raise ConfigError(f"calibrating retrieval heads needs a view of at least {DOC_OVERHEAD + 4 * TOKENS_PER_LINE} "
                          "tokens; raise --kvmem-budget for the first run or pass --kvmem-retrieval-heads")
    docs = make_docs(n_docs, filler_lines=lines)
    bar = _bar(n_docs, progress)
    captured = []
    try:
        for doc in docs:
            captured.append(capture_doc(adapter, doc))
            bar.update(1)
    finally:
        bar.close()
        adapter.clear_view()
    return calibrate(captured, adapter.fingerprint, n_heads=N_HEADS)


def capture_doc(adapter: EngineAdapter, doc: SyntheticDoc) -> CalibrationDoc:
    """Run one document plus its question through the model; keep the question's q and all content keys."""
    text = adapter.render_chat([{"role": "user", "content": f"{doc.text}\n\n{doc.question}"}])
    body = text.index(doc.text)
    fact = (body + doc.fact_span[0], body + doc.fact_span[1])
    ids = adapter.tokenize(text)
    f0, f1 = (len(adapter.tokenize(text[:c])) for c in fact)
    q0 = len(adapter.tokenize(text[:text.rindex(doc.question)]))
    if len(ids) > adapter.caps.max_view_tokens:
        raise ConfigError(f"a calibration document of {len(ids)} tokens does not fit the view of "
                          f"{adapter.caps.max_view_tokens}; raise --kvmem-budget or pass --kvmem-retrieval-heads")
    adapter.clear_view()
    out = adapter.forward(ids, list(range(len(ids))), want_logits=False, capture_from=q0)
    k = adapter.content_keys(adapter.read_block(0, len(ids)).k, 0)
    adapter.clear_view()
    return CalibrationDoc(out.queries, k, (max(0, f0 - 1), min(len(ids), f1 + 1)))


def _bar(total: int, enabled: bool) -> Any:
    from tqdm import tqdm

    return tqdm(total=total, desc="kvmem: calibrating retrieval heads", unit="doc", disable=not enabled,
                file=sys.stderr, leave=False)
