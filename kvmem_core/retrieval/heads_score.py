"""Retrieval-heads block scores: one implementation over numpy arrays or torch tensors.

For a query row (one query token of one query head) the softmax of q·k/√d runs over every
token of the history's blocks (content frame, pre-RoPE); a block's share of that mass is the
row's mass on it, and per head a block keeps the largest share any one query token gives it.
Calibration scores every head this way to choose the heads (``calibration.block_scores``);
``RetrievalHeadsScorer`` sums the chosen heads' scores from the index's int8 keys on the host;
``kvmem_torch``'s scorer runs the same code on a device mirror of those keys.

Keys stream through in chunks of blocks with a running log-sum-exp (block sums kept relative to
their chunk's row maxima, rescaled once at the end), so memory stays at one chunk of logits
whatever the workspace size. The backend follows the keys' type: numpy arrays, or torch tensors
on any device (torch is imported only then). Results come back as numpy arrays.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cache
from typing import Any, Callable, Sequence

import numpy as np

from kvmem_core.retrieval.base import BlockScores, QueryFeatures
from kvmem_core.threads import map_on

CHUNK_TOKENS = {
    "numpy": 2048,  # widening int8 keys to float32 bounds scoring on a CPU: a chunk's keys stay in cache
    "torch": 1 << 16,  # logits of one chunk on a device: rows x 64K float32
}

Array = Any  # np.ndarray, or torch.Tensor on the torch backend


@dataclass(frozen=True, eq=False)
class HeadKeys:
    """Keys of one (layer, kv head) over the history's blocks.

    ``keys`` [blocks, block tokens, dim]: float, or int8 with per-token ``scales`` [blocks, block
    tokens] (key = keys * scales); ``n_tokens`` [blocks]: a block's tokens, the rest padding.
    All three are numpy arrays or all torch tensors, on ``device`` or in host memory that is copied
    there per chunk (torch; None: the keys' device).
    """

    keys: Array
    n_tokens: Array
    scales: Array | None = None
    device: Any = None


@dataclass(frozen=True, eq=False)
class HeadMass:
    """Per head the largest mass one query token gives each block, float64 [heads, blocks]; and per
    block its strongest token over every row: log mass ``peak_log`` [blocks], offset ``peak_at`` [blocks]."""

    mass: np.ndarray
    peak_log: np.ndarray
    peak_at: np.ndarray


class NumpyOps:
    """The array operations the streaming softmax needs, on numpy."""

    name = "numpy"

    @staticmethod
    def rows(rows: np.ndarray, keys: HeadKeys) -> np.ndarray:
        return rows

    @staticmethod
    def logits(rows: np.ndarray, keys: np.ndarray, n_tokens: np.ndarray, scales: np.ndarray | None) -> np.ndarray:
        """rows [R, D] (pre-scaled) · keys [nb, B, D] (times ``scales`` [nb, B]) -> float32 [R, nb, B], padding -inf."""
        nb, width, dim = keys.shape
        # the scales go on the keys (nb*B*D products), not the logits (R*nb*B), and the GEMM writes the logits in
        # the layout the reductions read: a transposed copy of them cost a quarter of the scoring
        wide = (
            keys.astype(np.float32, copy=False)
            if scales is None
            else np.multiply(keys, scales[..., None], dtype=np.float32)
        )
        logits = (rows @ wide.reshape(nb * width, dim).T).reshape(len(rows), nb, width)
        if (n_tokens < width).any():
            logits[:, np.arange(width)[None, :] >= n_tokens[:, None]] = -np.inf
        return logits

    @staticmethod
    def max_arg(x: np.ndarray, axis: int) -> tuple[np.ndarray, np.ndarray]:
        arg = x.argmax(axis=axis)
        return np.take_along_axis(x, np.expand_dims(arg, axis), axis=axis).squeeze(axis), arg

    @staticmethod
    def exp_(x: np.ndarray) -> np.ndarray:
        return np.exp(x, out=x)

    @staticmethod
    def sum_last(x: np.ndarray) -> np.ndarray:
        """``x.sum(-1)`` as a product with ones: BLAS reduces a short last axis several times faster."""
        return (x.reshape(-1, x.shape[-1]) @ np.ones(x.shape[-1], dtype=x.dtype)).reshape(x.shape[:-1])

    @staticmethod
    def pick(x: np.ndarray, rows: np.ndarray) -> np.ndarray:
        """``x[rows[j], j]`` for every column j of ``x`` [R, C]."""
        return np.take_along_axis(x, rows[None], axis=0)[0]

    @staticmethod
    def new(like: np.ndarray, shape: tuple[int, ...], fill: float, dtype: str) -> np.ndarray:
        return np.full(shape, fill, dtype=dtype)

    @staticmethod
    def arange(like: np.ndarray, n: int) -> np.ndarray:
        return np.arange(n)

    stack = staticmethod(np.stack)
    exp = staticmethod(np.exp)
    log = staticmethod(np.log)
    float64 = staticmethod(lambda x: x.astype(np.float64))
    numpy = staticmethod(np.asarray)


@cache
def _torch_ops() -> type:
    import torch

    SPLIT = hasattr(torch.ops.aten.mm, "dtype")  # fp16 products with float32 results (torch 2.8 on)

    class TorchOps:
        """The same operations on torch tensors; keys in pinned host memory are copied per chunk."""

        name = "torch"

        @staticmethod
        def rows(rows: np.ndarray, keys: HeadKeys) -> torch.Tensor:
            """``rows`` on the keys' device; for int8 keys on a GPU with fp16 products that return float32 (torch
            2.8 on), as fp16 [2R, D]: each row's fp16 value, then what it leaves (``logits`` sums the two products:
            tensor cores, and within ~2^-22 of float32 rows, int8 keys being exact in fp16)."""
            device = keys.keys.device if keys.device is None else keys.device
            x = torch.from_numpy(rows).to(device)
            if x.device.type != "cuda" or keys.keys.dtype != torch.int8 or not SPLIT:
                return x
            return TorchOps.halves(x)

        @staticmethod
        def halves(x: torch.Tensor) -> torch.Tensor:
            """float32 rows [R, D] as fp16 [2R, D]: each row's fp16 value, then the fp16 remainder it leaves."""
            high = x.half()
            return torch.cat((high, (x - high.float()).half()))

        @staticmethod
        def logits(
            rows: torch.Tensor, keys: torch.Tensor, n_tokens: torch.Tensor, scales: torch.Tensor | None
        ) -> torch.Tensor:
            nb, width, dim = keys.shape
            keys = keys.to(rows.device, non_blocking=True).reshape(nb * width, dim)
            if rows.dtype == torch.float16:  # split rows (``rows``)
                r, k = len(rows) // 2, keys.half().T
                flat = torch.addmm(torch.mm(rows[:r], k, out_dtype=torch.float32), rows[r:], k, out_dtype=torch.float32)
            else:
                flat = rows @ keys.float().T
            logits = flat.view(-1, nb, width)
            count = n_tokens.to(rows.device, non_blocking=True)
            pad = torch.arange(width, device=rows.device)[None, :] >= count[:, None]
            bias = torch.zeros(pad.shape, device=rows.device).masked_fill_(pad, -torch.inf)  # [nb, width]: small
            if scales is None:
                return logits.add_(bias)
            return torch.addcmul(bias, logits, scales.to(rows.device, non_blocking=True), out=logits)

        @staticmethod
        def max_arg(x: torch.Tensor, axis: int) -> tuple[torch.Tensor, torch.Tensor]:
            values, arg = x.max(dim=axis)
            return values, arg

        @staticmethod
        def exp_(x: torch.Tensor) -> torch.Tensor:
            return x.exp_()

        @staticmethod
        def sum_last(x: torch.Tensor) -> torch.Tensor:
            return x.sum(-1)

        @staticmethod
        def pick(x: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
            return x.gather(0, rows[None])[0]

        @staticmethod
        def new(like: torch.Tensor, shape: tuple[int, ...], fill: float, dtype: str) -> torch.Tensor:
            return torch.full(shape, fill, dtype=getattr(torch, dtype), device=like.device)

        @staticmethod
        def arange(like: torch.Tensor, n: int) -> torch.Tensor:
            return torch.arange(n, device=like.device)

        stack = staticmethod(lambda xs, axis: torch.stack(xs, dim=axis))
        exp = staticmethod(torch.exp)
        log = staticmethod(torch.log)
        float64 = staticmethod(lambda x: x.double())
        numpy = staticmethod(lambda x: x.cpu().numpy())

    return TorchOps


def backend(x: Array) -> Any:
    """The operations for ``x``'s array type: numpy's, or torch's (imported on first use)."""
    if isinstance(x, np.ndarray):
        return NumpyOps
    if type(x).__module__.startswith("torch"):
        return _torch_ops()
    raise TypeError(f"retrieval-heads scoring takes numpy arrays or torch tensors, not {type(x).__name__}")


class StreamingMass:
    """Softmax mass per (row, block) over chunks of logits [rows, blocks, block tokens], on ``ops``' arrays.

    Block sums are kept relative to their chunk's row maxima and rescaled once in ``finish``. Chunks may be
    added in any order and from several threads at once (each writes only its own blocks and chunk slot).
    """

    def __init__(self, ops: Any, like: Array, n_rows: int, n_blocks: int, n_chunks: int) -> None:
        self._ops = ops
        self._block_sum = ops.new(like, (n_rows, n_blocks), 0.0, "float32")
        self._block_max = ops.new(like, (n_rows, n_blocks), -np.inf, "float32")
        self._block_arg = ops.new(like, (n_rows, n_blocks), 0, "int64")
        self._block_chunk = ops.new(like, (n_blocks,), 0, "int64")
        self._chunk_max: list[Array] = [None] * n_chunks
        self._chunk_sum: list[Array] = [None] * n_chunks

    def add(self, logits: Array, b0: int, chunk: int) -> None:
        """Take chunk number ``chunk`` of the logits [rows, blocks, block tokens], for blocks ``b0:``; overwrites
        it."""
        b1 = b0 + logits.shape[1]
        bmax, arg = self._ops.max_arg(logits, 2)
        m = self._ops.max_arg(bmax, 1)[0]
        logits -= m[:, None, None]
        sums = self._ops.sum_last(self._ops.exp_(logits))
        self._block_sum[:, b0:b1] = sums
        self._block_max[:, b0:b1] = bmax
        self._block_arg[:, b0:b1] = arg
        self._block_chunk[b0:b1] = chunk
        self._chunk_max[chunk] = m
        self._chunk_sum[chunk] = sums.sum(1)

    def finish(self) -> tuple[Array, Array, Array]:
        """Mass per (row, block) [rows, N] float64, and each block's peak (log mass [N], offset [N])."""
        ops = self._ops
        return normalized(
            ops,
            BlockStats(self._block_max, self._block_arg, self._block_sum),
            ops.stack(self._chunk_max, 1),
            ops.stack(self._chunk_sum, 1),
            self._block_chunk,
        )


@dataclass(frozen=True, eq=False)
class BlockStats:
    """Per (row, block) [rows, N]: the largest logit ``max`` (float32), its token offset ``arg`` (int64), and
    ``sum``, the block's exp-sum relative to a reference row maximum (its chunk's, or ``max`` itself)."""

    max: Array
    arg: Array
    sum: Array


def normalized(
    ops: Any, blocks: BlockStats, ref_max: Array, ref_sum: Array, ref_of: Array
) -> tuple[Array, Array, Array]:
    """Mass per (row, block) [rows, N] float64, and each block's peak (log mass [N], offset [N]), from ``blocks``'
    stats whose sums are relative to reference maxima ``ref_max`` [rows, refs] (block ``j``'s is ``ref_of[j]``),
    each reference's exp-sum being ``ref_sum`` [rows, refs]: the softmax over every token, in float64."""
    cmax = ops.float64(ref_max)
    top = ops.max_arg(cmax, 1)[0][:, None]
    weight = ops.exp(cmax - top)
    z = (ref_sum * weight).sum(1)[:, None]
    mass = blocks.sum * (weight / z)[:, ref_of]
    rel = blocks.max - (top + ops.log(z))
    peak, best = ops.max_arg(rel, 0)
    return mass, peak, ops.pick(blocks.arg, best)


def block_mass(ops: Any, blocks: BlockStats, n_query_tokens: int) -> HeadMass:
    """``head_block_mass``'s result from per-block stats whose sums are relative to each block's own maximum (what
    a fused kernel computes in one pass over the keys, e.g. ``kvmem_torch.score_kernel``)."""
    n_blocks = blocks.max.shape[1]
    mass, peak, arg = normalized(ops, blocks, blocks.max, blocks.sum, ops.arange(blocks.max, n_blocks))
    return _per_head(ops, mass, peak, arg, n_query_tokens)


def chunks(n_blocks: int, block_tokens: int, chunk_tokens: int) -> list[tuple[int, int]]:
    """Block ranges [b0, b1) of about ``chunk_tokens`` tokens each, covering ``n_blocks`` blocks."""
    step = max(1, chunk_tokens // block_tokens)
    return [(b0, min(n_blocks, b0 + step)) for b0 in range(0, n_blocks, step)]


def head_block_mass(rows: np.ndarray, keys: HeadKeys, n_query_tokens: int, workers: int = 1) -> HeadMass:
    """Retrieval-heads scores of the heads whose query rows are ``rows`` (float32 [heads * query tokens,
    dim], head-major, pre-scaled by 1/√d) over ``keys``, on ``keys``' backend; numpy results. On numpy, up to
    ``workers`` threads score chunks at once (the same arithmetic per chunk, so the same scores)."""
    ops = backend(keys.keys)
    n_blocks, width = keys.keys.shape[:2]
    rows_x = ops.rows(rows, keys)
    spans = chunks(n_blocks, width, CHUNK_TOKENS[ops.name])
    acc = StreamingMass(ops, rows_x, len(rows), n_blocks, len(spans))

    def add(chunk: int) -> None:
        b0, b1 = spans[chunk]
        scales = None if keys.scales is None else keys.scales[b0:b1]
        acc.add(ops.logits(rows_x, keys.keys[b0:b1], keys.n_tokens[b0:b1], scales), b0, chunk)

    map_on(workers if ops is NumpyOps else 1, add, range(len(spans)))  # numpy releases the GIL in its loops
    return _per_head(ops, *acc.finish(), n_query_tokens)


def _per_head(ops: Any, mass: Array, peak: Array, arg: Array, n_query_tokens: int) -> HeadMass:
    """Per head the largest mass one of its ``n_query_tokens`` rows gives each block; numpy results."""
    per_head = ops.max_arg(mass.reshape(-1, n_query_tokens, mass.shape[1]), 1)[0]
    return HeadMass(ops.numpy(per_head), ops.numpy(peak), ops.numpy(arg))


class PeakMerge:
    """Totals and the strongest peak per block over several accumulators."""

    def __init__(self, n_blocks: int) -> None:
        self.total = np.zeros(n_blocks, dtype=np.float64)
        self.best = np.full(n_blocks, -np.inf)
        self.peaks = np.full(n_blocks, -1, dtype=np.int32)

    def add(self, mass: np.ndarray, rel: np.ndarray, arg: np.ndarray) -> None:
        """Add block scores ``mass`` [N]; keep the peaks (log mass ``rel``, offset ``arg``) that beat the best."""
        self.total += mass
        better = rel > self.best
        self.best[better] = rel[better]
        self.peaks[better] = arg[better]


def head_rows(q: np.ndarray, heads: Sequence[int]) -> np.ndarray:
    """Query rows of ``heads`` from one layer's queries ``q`` [query tokens, query heads, dim]:
    float32 [heads * query tokens, dim], head-major, scaled by 1/√dim."""
    rows = q[:, list(heads)].transpose(1, 0, 2).reshape(-1, q.shape[-1])
    return np.ascontiguousarray(rows * np.float32(q.shape[-1] ** -0.5), dtype=np.float32)


def score_heads(
    heads: Sequence[tuple[int, int]],
    query: QueryFeatures,
    pairs: Sequence[tuple[int, int]],
    keys_of: Callable[[int, int], HeadKeys],
    n_blocks: int,
    workers: int = 1,
    mass_of: Callable[[np.ndarray, HeadKeys, int], HeadMass] | None = None,
) -> BlockScores:
    """Block scores summed over the (layer, query head) ``heads``, reading each (layer, kv head) of
    ``pairs`` through ``keys_of``; a block's peak is its strongest token over every head. ``workers``: threads
    per (layer, kv head) on numpy (``head_block_mass``). ``mass_of``: what scores one (layer, kv head)'s rows
    instead of ``head_block_mass`` (the same results, e.g. from a fused kernel)."""
    merge = PeakMerge(n_blocks)
    for layer, kv in pairs:
        picked = [h for l, h in heads if l == layer and h // query.group_size == kv]
        rows, keys = head_rows(query.q[layer], picked), keys_of(layer, kv)
        if mass_of is None:
            got = head_block_mass(rows, keys, query.n_query_tokens, workers)
        else:
            got = mass_of(rows, keys, query.n_query_tokens)
        merge.add(got.mass.sum(axis=0), got.peak_log, got.peak_at)
    return BlockScores(merge.total, merge.peaks)
