"""Retrieval-head profiles: run the synthetic calibration on a model and cache the result.

A profile is looked up by the model file's fingerprint: first in the user cache
(``kvmem_core.paths.cache_root()``, under ``profiles/``), then among the profiles
shipped next to the adapter package, then next to every other installed adapter package;
missing all, the calibration runs (a few minutes for a 0.5B model on one CPU thread) and
its result is cached. A profile measured at another block size is passed over (version-1
profiles record none and fit any). Documents are sized to the model's tokenizer and view: each is grown
or shrunk (in filler lines) until it measures about ``DOC_TOKENS`` tokens and fits. A profile holds
(attention layer, query head) pairs of the weights, so it serves every backend that loads the same
file: both engines number
attention layers and heads alike, and a permutation inside a head (llama.cpp's rotary row
order) changes no q·k product.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import logging
import sys
from pathlib import Path
from typing import Any

from kvmem_core.adapter import EngineAdapter
from kvmem_core.errors import ConfigError
from kvmem_core.paths import cache_root
from kvmem_core.retrieval import CalibrationDoc, RetrievalProfile, calibrate
from kvmem_core.synthetic import ENTITIES, SyntheticDoc, make_doc

N_DOCS = 16  # a quarter of them held out to measure how the chosen heads transfer
N_HEADS = 4
DOC_TOKENS = 1536  # per document, when the view allows: about 24 blocks of 64 tokens
MIN_DOC_TOKENS = 384
LINES_PER_DISTRACTOR = 5

log = logging.getLogger("kvmem.profiles")


def cache_dir() -> Path:
    return cache_root() / "profiles"


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
    """The first cached or shipped profile of the adapter's model file measured at the adapter's block size
    (a version-1 profile, which records none, fits any), if any; one for another block size is passed over."""
    for folder in (cache_dir(), shipped_dir(adapter), *installed_dirs()):
        path = folder / f"{adapter.fingerprint}.json"
        if path.is_file():
            profile = RetrievalProfile.load(path)
            if fits_block_size(profile, adapter.layout.block_tokens, path):
                return profile
    return None


def fits_block_size(profile: RetrievalProfile, block_tokens: int, path: Path) -> bool:
    """Whether ``profile`` was calibrated at ``block_tokens`` per block (0: not recorded, taken as fitting)."""
    if profile.block_tokens in (0, block_tokens):
        return True
    log.warning(
        "retrieval profile %s was calibrated at %d-token blocks, this run uses %d: not used",
        path,
        profile.block_tokens,
        block_tokens,
    )
    return False


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
    """Capture per-head queries and keys on synthetic documents and choose the heads (view is cleared)."""
    target = min(DOC_TOKENS, adapter.caps.max_view_tokens - 64)
    if target < MIN_DOC_TOKENS:
        raise ConfigError(
            f"calibrating retrieval heads needs a view of at least {MIN_DOC_TOKENS + 64} tokens; "
            "raise --kvmem-budget for the first run or pass --kvmem-retrieval-heads"
        )
    docs = [sized_doc(adapter, seed, target) for seed in range(n_docs)]
    bar = _bar(n_docs, progress)
    captured = []
    try:
        for doc in docs:
            captured.append(capture_doc(adapter, doc))
            bar.update(1)
    finally:
        bar.close()
        adapter.clear_view()
    return calibrate(captured, adapter.fingerprint, n_heads=N_HEADS, block_tokens=adapter.layout.block_tokens)


def sized_doc(adapter: EngineAdapter, seed: int, target: int) -> SyntheticDoc:
    """Document ``seed`` with as many filler lines (and a distractor per ``LINES_PER_DISTRACTOR``) as keep
    its rendering at or under ``target`` tokens, measured with the model's tokenizer; at least 8 lines."""
    per_line = doc_tokens(adapter, _doc(seed, 16)) / 16  # an overestimate: it carries the fixed overhead
    lines = max(8, int(target / per_line))
    doc = _doc(seed, lines)
    while lines > 8 and doc_tokens(adapter, doc) > target:
        lines = max(8, int(lines * 0.9))
        doc = _doc(seed, lines)
    return doc


def _doc(seed: int, lines: int) -> SyntheticDoc:
    return make_doc(
        seed, filler_lines=lines, n_distractors=min(len(ENTITIES) - 1, max(3, lines // LINES_PER_DISTRACTOR))
    )


def doc_tokens(adapter: EngineAdapter, doc: SyntheticDoc) -> int:
    return len(adapter.tokenize(adapter.render_chat([{"role": "user", "content": f"{doc.text}\n\n{doc.question}"}])))


def capture_doc(adapter: EngineAdapter, doc: SyntheticDoc) -> CalibrationDoc:
    """Run one document plus its question through the model; keep the question's q and all content keys."""
    text = adapter.render_chat([{"role": "user", "content": f"{doc.text}\n\n{doc.question}"}])
    body = text.index(doc.text)
    fact = (body + doc.fact_span[0], body + doc.fact_span[1])
    ids = adapter.tokenize(text)
    f0, f1 = (len(adapter.tokenize(text[:c])) for c in fact)
    q0 = len(adapter.tokenize(text[: text.rindex(doc.question)]))
    if len(ids) > adapter.caps.max_view_tokens:
        raise ConfigError(
            f"a calibration document of {len(ids)} tokens does not fit the view of "
            f"{adapter.caps.max_view_tokens}; raise --kvmem-budget or pass --kvmem-retrieval-heads"
        )
    adapter.clear_view()
    out = adapter.forward(ids, list(range(len(ids))), want_logits=False, capture_from=q0)
    k = adapter.content_keys(adapter.read_block(0, len(ids)).k, 0)
    adapter.clear_view()
    return CalibrationDoc(out.queries, k, (max(0, f0 - 1), min(len(ids), f1 + 1)))


def _bar(total: int, enabled: bool) -> Any:
    from tqdm import tqdm

    return tqdm(
        total=total,
        desc="kvmem: calibrating retrieval heads",
        unit="doc",
        disable=not enabled,
        file=sys.stderr,
        leave=False,
    )
