"""Retrieval-heads scoring time: numpy on the host vs torch with the index on the GPU or in pinned memory.

``python -m kvmem_bench.torch_scoring --tokens 262144,1048576`` on a random index shaped like
Qwen3.6-27B's (head dim 256, 3 retrieval heads on 3 kv heads, 64-token blocks as ``--kvmem-block-tokens``'
default) and the query rows a step scores with (``QUERY_WINDOW`` tokens). Prints one JSON line per size: median
seconds per score and the mirror's first sync (the upload of the whole index), and whether the scores and peaks
agree with numpy's.
"""

from __future__ import annotations

import argparse
import json
import time

import numpy as np
import torch

from kvmem_core.layout import BlockMeta
from kvmem_core.prompt import QUERY_WINDOW
from kvmem_core.retrieval import BlockIndex, QueryFeatures, make_scorer
from kvmem_torch import TorchRetrievalHeads

HEADS = ((10, 0), (20, 7), (30, 13))  # (layer, query head) on kv heads 0, 1, 2 of 6 query heads per kv head
N_LAYERS, N_HEADS, N_KV, DIM, B, QUERY = 32, 24, 4, 256, 64, QUERY_WINDOW


def random_index(n_tokens: int, seed: int = 0) -> BlockIndex:
    rng = np.random.default_rng(seed)
    pairs = np.asarray([(10, 0), (20, 1), (30, 2)], dtype=np.int16)
    index = BlockIndex(B)
    index.reserve(n_tokens // B)
    for i in range(n_tokens // B):
        keys = rng.standard_normal((len(pairs), B, DIM), dtype=np.float32).astype(np.float16)
        index.append([BlockMeta(str(i), "", np.zeros(B, np.int32), i * B, 0, {"head_keys": keys, "head_pairs": pairs})])
    return index


def timed(fn: object, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        torch.cuda.synchronize()
        t = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t)
    return float(np.median(times))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--tokens", default="262144,1048576")
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    q = QueryFeatures(np.random.default_rng(1).standard_normal((N_LAYERS, QUERY, N_HEADS, DIM), dtype=np.float32), N_KV)
    for n in map(int, args.tokens.split(",")):
        index = random_index(n)
        row = {"tokens": n, "index_mb": round(index.get("head_keys").nbytes / 2**20)}
        t = time.perf_counter()
        want = make_scorer("retrieval-heads", HEADS).score(q, index)
        row["numpy_s"] = time.perf_counter() - t
        for where, pinned in (("gpu", False), ("pinned", True)):
            scorer = TorchRetrievalHeads(HEADS, "cuda", pinned)
            row[f"{where}_first_s"] = timed(lambda: scorer.score(q, index), 1)
            row[f"{where}_s"] = timed(lambda: scorer.score(q, index), args.repeats)
            got = scorer.score(q, index)
            row[f"{where}_max_rel_err"] = float(
                np.max(np.abs(got.scores - want.scores) / np.maximum(want.scores, 1e-12))
            )
            row[f"{where}_peaks_equal"] = bool((got.peaks == want.peaks).all())
        print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
