"""Core benchmark: ``python -m kvmem_bench.core --json``.

Times scoring + selection per scorer on synthetic workspaces (summaries are synthesized
directly, no KV needed) of two shapes, then the storage tiers through
``kvmem_bench.store``. The last line with ``--json`` is one JSON object:
``{"workspace_1m": {"select_ms": {...}}, "workspace_64k": {"select_ms": {...}},
"nvme": {"write_ratio": x, "read_ratio": y}, "host_copy_GBps": z}``.
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
import time
from dataclasses import dataclass

import numpy as np

from kvmem_bench.store import measure_host_copy, measure_nvme
from kvmem_core.config import SCORERS
from kvmem_core.layout import BlockMeta
from kvmem_core.retrieval import BlockIndex, BlockSpans, QueryFeatures, Selector, make_scorer
from kvmem_core.retrieval.index import quantize_int8
from kvmem_core.retrieval.summaries import MAX_PROTOS

_SUMMARY = {
    "retrieval-heads": "head_keys",
    "mean-k": "mean_k",
    "sub-block-mean-k": "sub_mean_k",
    "key-direction": "protos",
}


@dataclass(frozen=True)
class Shape:
    """A workspace to score: model shape, size, query and budget."""

    n_blocks: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    heads: tuple[tuple[int, int], ...]
    budget: int
    per_token: bool
    block_tokens: int = 128
    query_tokens: int = 16
    sub_blocks: int = 4


QWEN_27B_1M = Shape(8192, 16, 24, 4, 256, ((3, 0), (7, 9), (11, 14), (15, 23)), 32768, per_token=False)
SMOLLM2_64K = Shape(512, 30, 9, 3, 64, ((10, 2), (17, 4), (24, 8)), 2048, per_token=True)


class _SyntheticKeys:
    """Full keys for ``per-token``: float16 in RAM, float32 out."""

    def __init__(self, shape: Shape, rng: np.random.Generator) -> None:
        dims = (shape.n_layers, shape.block_tokens, shape.n_kv_heads, shape.head_dim)
        self._keys = {
            _hash(i): rng.standard_normal(dims, dtype=np.float32).astype(np.float16) for i in range(shape.n_blocks)
        }

    def content_keys(self, chain_hash: str) -> np.ndarray:
        return self._keys[chain_hash].astype(np.float32)


def _hash(i: int) -> str:
    return f"{i:032x}"


def _summary_shape(shape: Shape, name: str) -> tuple[int, ...]:
    lk = (shape.n_layers, shape.n_kv_heads)
    return {
        "mean_k": (*lk, shape.head_dim),
        "sub_mean_k": (*lk, shape.sub_blocks, shape.head_dim),
        "protos": (*lk, MAX_PROTOS, shape.head_dim),
        "head_keys": (len(shape.heads), shape.block_tokens, shape.head_dim),
    }[name]


def synth_index(shape: Shape, name: str, rng: np.random.Generator, batch: int = 256) -> BlockIndex:
    """A BlockIndex whose blocks carry one random summary ``name`` (plus head pairs)."""
    pairs = np.array([(layer, head // (shape.n_heads // shape.n_kv_heads)) for layer, head in shape.heads], np.int16)
    index = BlockIndex(shape.block_tokens)
    index.reserve(shape.n_blocks)
    ids = np.zeros(shape.block_tokens, dtype=np.int32)
    for b0 in range(0, shape.n_blocks, batch):
        n = min(batch, shape.n_blocks - b0)
        values = rng.standard_normal((n, *_summary_shape(shape, name)), dtype=np.float32).astype(np.float16)
        if name == "protos":
            values /= np.linalg.norm(values, axis=-1, keepdims=True)
        metas = [
            BlockMeta(
                _hash(b0 + i),
                _hash(b0 + i - 1),
                ids,
                (b0 + i) * shape.block_tokens,
                0,
                {name: values[i], "head_pairs": pairs},
            )
            for i in range(n)
        ]
        index.append(metas)
    return index


def bench_query(shape: Shape) -> QueryFeatures:
    rng = np.random.default_rng(1)
    q = rng.standard_normal((shape.n_layers, shape.query_tokens, shape.n_heads, shape.head_dim), dtype=np.float32)
    return QueryFeatures(q, shape.n_kv_heads)


def plant_needle(shape: Shape, index: BlockIndex) -> int:
    """Write one key matching a query row of the first retrieval head into a middle block; its index."""
    layer, head = shape.heads[0]
    target = shape.n_blocks * 5 // 8
    u = bench_query(shape).q[layer, 3, head]
    codes, scale = quantize_int8(6 * u / np.linalg.norm(u) * np.sqrt(shape.head_dim))
    index.get("head_keys")[0, target, 77] = codes
    index.get("head_scale")[0, target, 77] = scale
    return target


def time_select(
    shape: Shape,
    scorer_name: str,
    index: BlockIndex,
    key_source: object = None,
    repeats: int = 3,
    max_s: float = 15.0,
    needle: int | None = None,
) -> tuple[float, float]:
    """Best wall time and best process CPU time, in ms, of scoring + selection over ``repeats``
    runs (fewer, but at least one, once ``max_s`` seconds are spent); asserts that the
    ``needle`` block, when given, is selected."""
    query = bench_query(shape)
    scorer = make_scorer(scorer_name, shape.heads, key_source)  # type: ignore[arg-type]
    spans = BlockSpans.uniform(shape.n_blocks, shape.block_tokens)
    selector = Selector(shape.budget)
    wall = cpu = float("inf")
    start = time.perf_counter()
    for _ in range(repeats):
        if wall < float("inf") and time.perf_counter() - start > max_s:
            break
        t0, c0 = time.perf_counter(), time.process_time()
        selection = selector.select(spans, scorer.score(query, index), tail_tokens=query.n_query_tokens)
        wall, cpu = min(wall, time.perf_counter() - t0), min(cpu, time.process_time() - c0)
        assert selection.tokens + selection.tail_tokens <= shape.budget
        assert needle is None or needle in selection.blocks, f"{scorer_name} missed the planted block {needle}"
    return round(wall * 1000, 1), round(cpu * 1000, 1)


def bench_workspace(shape: Shape, repeats: int, log: bool) -> dict[str, float | None]:
    """select_ms (best wall time) per scorer; ``per-token`` is None where full keys do not fit in RAM."""
    rng = np.random.default_rng(0)
    out: dict[str, float | None] = {}
    for name in SCORERS:
        if name == "per-token" and not shape.per_token:
            out[name] = None
            continue
        keys = _SyntheticKeys(shape, rng) if name == "per-token" else None
        index = synth_index(shape, _SUMMARY.get(name, "mean_k"), rng)
        needle = plant_needle(shape, index) if name == "retrieval-heads" else None
        out[name], cpu = time_select(shape, name, index, keys, repeats=1 if keys else repeats, needle=needle)
        del index, keys
        gc.collect()
        if log:
            tokens = shape.n_blocks * shape.block_tokens
            print(f"{tokens} tokens, {name}: {out[name]} ms wall, {cpu} ms cpu", file=sys.stderr, flush=True)
    return out


def bench_storage(log: bool) -> tuple[dict[str, float], float]:
    """NVMe tier throughput over plain file I/O, and host-tier copy GB/s (kvmem_bench.store)."""
    nvme = measure_nvme()
    if log:
        print(f"nvme: {json.dumps(nvme)}", file=sys.stderr, flush=True)
    return {"write_ratio": round(nvme["write_ratio"], 3), "read_ratio": round(nvme["read_ratio"], 3)}, round(
        measure_host_copy(), 2
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kvmem_bench.core", description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true", help="print the result as one JSON line last")
    parser.add_argument("--skip-1m", action="store_true", help="skip the 1M-token workspace (needs 2.5 GiB of RAM)")
    args = parser.parse_args(argv)
    result: dict[str, object] = {}
    result["workspace_1m"] = {"select_ms": None if args.skip_1m else bench_workspace(QWEN_27B_1M, 5, True)}
    result["workspace_64k"] = {"select_ms": bench_workspace(SMOLLM2_64K, 10, True)}
    nvme, host = bench_storage(True)
    result["nvme"] = nvme
    result["host_copy_GBps"] = host
    print(json.dumps(result) if args.json else json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
