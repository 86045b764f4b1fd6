"""Per-block scoring summaries, computed once when a block is stored.

Input is the block's content-frame (pre-RoPE) keys, float32 [layers, tokens, kv heads, head dim].
Output is ``BlockMeta.summary``: small float16 arrays the scorers read, so scoring never loads KV.

- ``mean_k``      [layers, kv heads, dim]              block mean key
- ``sub_mean_k``  [layers, kv heads, sub blocks, dim]  means of equal token runs
- ``protos``      [layers, kv heads, 4, dim]           unit key directions (1, 2 or 4 distinct;
                                                       unused slots repeat used ones)
- ``head_keys``   [pairs, tokens, dim]                 full-resolution keys of the retrieval
                                                       heads' (layer, kv head) pairs
- ``head_pairs``  [pairs, 2] int16                     which (layer, kv head) pairs those are
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np

from kvmem_core.layout import BlockLayout

MAX_PROTOS = 4


@dataclass(frozen=True)
class SummaryOptions:
    """What ``summarize_block`` computes; ``group_size`` maps query heads to kv heads (GQA)."""

    group_size: int = 1
    sub_blocks: int = 4
    prototypes: bool = True
    proto_gain: float = 0.25
    kmeans_iters: int = 6

    @classmethod
    def for_layout(cls, layout: BlockLayout, **changes: object) -> SummaryOptions:
        return cls(group_size=layout.group_size, **changes)  # type: ignore[arg-type]


def index_pairs(heads: Sequence[tuple[int, int]], group_size: int) -> tuple[tuple[int, int], ...]:
    """Sorted unique (layer, kv head) pairs that the (layer, query head) ``heads`` read."""
    return tuple(sorted({(layer, head // group_size) for layer, head in heads}))


def summarize_block(
    k_content: np.ndarray, profile_heads: Sequence[tuple[int, int]], opts: SummaryOptions
) -> dict[str, np.ndarray]:
    """Every summary of one block (see the module docstring); arrays are float16 except ``head_pairs``."""
    k = np.asarray(k_content, dtype=np.float32)
    assert k.ndim == 4, "k_content must be [layers, tokens, kv heads, head dim]"
    out = {
        "mean_k": k.mean(axis=1).astype(np.float16),
        "sub_mean_k": sub_block_means(k, opts.sub_blocks).astype(np.float16),
    }
    if opts.prototypes:
        out["protos"] = key_prototypes(k, opts.proto_gain, opts.kmeans_iters).astype(np.float16)
    pairs = index_pairs(profile_heads, opts.group_size)
    if pairs:
        out["head_keys"] = np.stack([k[layer, :, kv] for layer, kv in pairs]).astype(np.float16)
        out["head_pairs"] = np.asarray(pairs, dtype=np.int16)
    return out


def sub_block_means(k: np.ndarray, n_sub: int) -> np.ndarray:
    """Means of ``n_sub`` near-equal token runs: [layers, kv heads, n_sub, dim]."""
    runs = np.array_split(np.arange(k.shape[1]), n_sub)
    return np.stack([k[:, run].mean(axis=1) for run in runs], axis=2)


def key_prototypes(k: np.ndarray, gain: float, iters: int) -> np.ndarray:
    """Unit key directions per (layer, kv head) slice: [layers, kv heads, 4, dim].

    A slice gets 2 prototypes when splitting cuts its cosine residual by at least ``gain``
    (a fraction), and 4 when splitting again cuts it by ``gain`` once more.
    """
    n_layers, n_tok, n_kv, dim = k.shape
    units = _normalize(k.transpose(0, 2, 1, 3).reshape(n_layers * n_kv, n_tok, dim))
    fits = [_spherical_kmeans(units, n, iters) for n in (1, 2, 4)]
    (c1, r1), (c2, r2), (c4, r4) = fits
    use2 = (r1 - r2) >= gain * r1
    use4 = use2 & ((r2 - r4) >= gain * np.maximum(r2, 1e-12))
    protos = np.repeat(c1, MAX_PROTOS, axis=1)
    protos[use2] = np.tile(c2[use2], (1, 2, 1))
    protos[use4] = c4[use4]
    return protos.reshape(n_layers, n_kv, MAX_PROTOS, dim)


def _spherical_kmeans(units: np.ndarray, n: int, iters: int) -> tuple[np.ndarray, np.ndarray]:
    """Batched cosine k-means over slices [S, T, D]: centroids [S, n, D] and residual [S]."""
    cents = _farthest_point_init(units, n)
    for _ in range(iters if n > 1 else 0):
        assign = _sims(units, cents).argmax(axis=2)
        onehot = (assign[:, :, None] == np.arange(n)).astype(np.float32)
        sums = np.matmul(onehot.transpose(0, 2, 1), units)
        empty = onehot.sum(axis=1) == 0
        cents = np.where(empty[:, :, None], cents, _normalize(sums))
    sims = _sims(units, cents).max(axis=2)
    return cents, (1.0 - sims).sum(axis=1)


def _farthest_point_init(units: np.ndarray, n: int) -> np.ndarray:
    """First centroid: the mean direction; each next one: the token least like those chosen."""
    cents = [_normalize(units.mean(axis=1))]
    for _ in range(n - 1):
        best = _sims(units, np.stack(cents, axis=1)).max(axis=2)
        far = best.argmin(axis=1)
        cents.append(units[np.arange(len(units)), far])
    return np.stack(cents, axis=1)


def _sims(units: np.ndarray, cents: np.ndarray) -> np.ndarray:
    """Cosines of tokens [S, T, D] with centroids [S, n, D]: [S, T, n]."""
    return np.matmul(units, cents.transpose(0, 2, 1))


def _normalize(x: np.ndarray) -> np.ndarray:
    return x / np.maximum(np.linalg.norm(x, axis=-1, keepdims=True), 1e-12)
