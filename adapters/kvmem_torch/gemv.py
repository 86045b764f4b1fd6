"""One token's projections with the op before them folded into the weight stream.

At one token every projection is a matrix-vector product bound by reading its weights. Between
them sit ops that touch a few kilobytes: the residual add with the next RMS norm before each
sublayer, silu(gate) * up before the MLP's down projection. As kernels of their own they are
about 190 launches per token at the Qwen3.6-27B shape (a few microseconds each plus the gap
between kernels). Here the projection derives its input as it streams its rows of the weight:
every program recomputes the input chunk by chunk from the small vectors (they stay in L2) and
reads each weight row once. The RMS norm's scale, which needs the whole sum, multiplies the dot
products at the end: rms_norm(s) * w . W = rsqrt(mean(s^2) + eps) * ((s * w) . W).
The MLP's activation rides in the gate/up projection's stores instead: its rows are interleaved
(gate, up) pairs (``layers.interleave_rows``), so a program holds both halves of its outputs and
stores silu(gate) * up. Recomputed in every program of the down projection, the sigmoid made that
projection 25% slower than over a plain input (an H200, 61.8 against 49.5 us).

``NormedSum`` stands for a sublayer input not yet computed (the residual stream plus a
sublayer's output, normed); ``project`` is ``F.linear`` for a tensor or for a ``NormedSum``.
Used for single-token forwards on CUDA (``kernels.eligible``); ``TRITON_INTERPRET=1`` runs it on
the CPU for the unit tests.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kvmem_torch.kernels import dependent_launch, triton

if triton is not None:
    import triton.language as tl

    from kvmem_torch.kernels import let_next_start, swiglu, wait_previous

# launch shape (rows of the weight per program, columns per load, warps, pipeline stages), measured on an H200 at
# the Qwen3.6-27B shape with dependent launches (docs/torch.md): decode 14.61-14.69 ms a token; the down
# projection at (4, 512) 14.99, (2, 2048) 15.01; every projection at (2, 2048) 17.2, (1, 2048) 20.8.
# Triton's interpreter runs programs one after another, so the unit tests run it with wide programs.
LAUNCH_SHAPE = (2, 1024, 4, 3)
# gate/up storing SwiGLU, two (gate, up) pairs per program: decode 14.03-14.08 ms against 14.25-14.32 at the shape
# above; (8, 1024) 14.08, (8, 512) 14.15, (4, 2048) 15.0, 8 warps 14.7; (4, 1024) for the other projections slower
SWIGLU_SHAPE = (4, 1024, 4, 3)
INTERPRETED_SHAPE = (128, 512, 4, 3)

if triton is not None:

    @triton.jit
    def _input_chunk(x_ptr, h_ptr, norm_ptr, total_ptr, k, k_mask, write, NORM: tl.constexpr):
        """Columns ``k`` of the input as fp32, rounded as the eager ops round, and their squares for the norm:
        ``NORM`` rms_norm(x + h) * norm before its scale (x + h stored where ``write``), else x."""
        dt = x_ptr.dtype.element_ty
        if NORM:
            s = (
                tl.load(x_ptr + k, mask=k_mask, other=0.0).to(tl.float32)
                + tl.load(h_ptr + k, mask=k_mask, other=0.0).to(tl.float32)
            ).to(dt)
            tl.store(total_ptr + k, s, mask=k_mask & write)
            s = s.to(tl.float32)
            return (s * tl.load(norm_ptr + k, mask=k_mask, other=0.0)).to(dt).to(tl.float32), s * s
        x = tl.load(x_ptr + k, mask=k_mask, other=0.0).to(tl.float32)
        return x, x

    @triton.jit
    def _gemv_kernel(
        w_ptr,
        x_ptr,
        h_ptr,
        norm_ptr,
        bias_ptr,
        out_ptr,
        total_ptr,
        N,
        K,
        eps,
        NORM: tl.constexpr,
        HAS_BIAS: tl.constexpr,
        SWIGLU: tl.constexpr,
        ROWS: tl.constexpr,
        COLS: tl.constexpr,
        PDL: tl.constexpr,
    ):
        # rows [pid * ROWS, +ROWS) of out = W . input; program 0 also writes the residual sum (NORM). Each
        # iteration loads the next chunk of weight rows, so the first is in flight before the wait for the
        # previous kernel (weights have no producer)
        pid = tl.program_id(0)
        n = pid * ROWS + tl.arange(0, ROWS)
        n_mask = n < N
        rows = w_ptr + n.to(tl.int64)[:, None] * K
        k = tl.arange(0, COLS)
        w = tl.load(
            rows + k[None, :], mask=n_mask[:, None] & (k < K)[None, :], other=0.0, eviction_policy="evict_first"
        )
        wait_previous(PDL)
        acc = tl.zeros((ROWS, COLS), tl.float32)
        squares = tl.zeros((COLS,), tl.float32)
        for k0 in range(0, K, COLS):
            k = k0 + tl.arange(0, COLS)
            write = (k * 0 + pid) == 0  # built from the block: a scalar-derived mask is not a valid store mask
            x, sq = _input_chunk(x_ptr, h_ptr, norm_ptr, total_ptr, k, k < K, write, NORM)
            acc += w.to(tl.float32) * x[None, :]
            squares += sq
            w = tl.load(
                rows + COLS + k[None, :],
                mask=n_mask[:, None] & (k + COLS < K)[None, :],
                other=0.0,
                eviction_policy="evict_first",
            )
        let_next_start(PDL)
        out = tl.sum(acc, 1)
        if NORM:
            out = out * tl.rsqrt(tl.sum(squares, 0) / K + eps)
        if HAS_BIAS:
            out += tl.load(bias_ptr + n, mask=n_mask, other=0.0).to(tl.float32)
        dt = out_ptr.dtype.element_ty
        if SWIGLU:  # rows are (gate, up) pairs: store silu(gate) * up, rounded where the eager ops round
            gate, up = tl.split(tl.reshape(out.to(dt).to(tl.float32), (ROWS // 2, 2)))
            half = pid * (ROWS // 2) + tl.arange(0, ROWS // 2)
            tl.store(out_ptr + half, swiglu(gate, up, dt), mask=half < N // 2)
        else:
            tl.store(out_ptr + n, out.to(dt), mask=n_mask)


def _gemv(
    weight: torch.Tensor,
    x: torch.Tensor,
    h: torch.Tensor | None = None,
    norm: torch.Tensor | None = None,
    eps: float = 0.0,
    bias: torch.Tensor | None = None,
    total: torch.Tensor | None = None,
    swiglu: bool = False,
) -> torch.Tensor:
    """out [1, N] = weight [N, K] . input: rms_norm(x + h) * norm with ``total`` = x + h written when ``norm`` is
    given, else x. ``swiglu``: the weight's rows are interleaved (gate, up) pairs and out [1, N/2] is
    silu(gate) * up."""
    n, k = weight.shape
    rows, cols, warps, stages = (
        INTERPRETED_SHAPE if weight.device.type == "cpu" else SWIGLU_SHAPE if swiglu else LAUNCH_SHAPE
    )
    out = torch.empty(1, n // 2 if swiglu else n, dtype=weight.dtype, device=weight.device)
    pdl = dependent_launch(weight.device)
    _gemv_kernel[(triton.cdiv(n, rows),)](
        weight,
        x,
        x if h is None else h,
        x if norm is None else norm,
        x if bias is None else bias,
        out,
        x if total is None else total,
        n,
        k,
        eps,
        NORM=norm is not None,
        HAS_BIAS=bias is not None,
        SWIGLU=swiglu,
        ROWS=rows,
        COLS=cols,
        PDL=pdl,
        num_warps=warps,
        num_stages=stages,
        launch_pdl=pdl,
    )
    return out


class NormedSum:
    """A sublayer input not yet materialized: ``rms_norm(x + delta) * weight`` for one token [1, H], whose
    ``x + delta`` is the next residual stream. ``linear`` computes a projection of it in one kernel and fills
    ``total`` (x + delta, rounded to the run dtype) as it goes; ``total`` is valid once a projection ran."""

    def __init__(self, x: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, eps: float) -> None:
        assert x.shape[0] == 1, "a single token"
        self.x, self.delta, self.weight, self.eps = x.contiguous(), delta.contiguous(), weight, eps
        self.total = torch.empty_like(self.x)

    def linear(self, w: torch.Tensor, bias: torch.Tensor | None = None, swiglu: bool = False) -> torch.Tensor:
        """F.linear(rms_norm(x + delta) * weight, w, bias) -> [1, N], with ``total`` written; ``swiglu``: w's rows
        are interleaved (gate, up) pairs and the result [1, N/2] is silu(gate) * up."""
        return _gemv(w, self.x, self.delta, self.weight, self.eps, bias, self.total, swiglu=swiglu)


def project(x: torch.Tensor | NormedSum, w: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear(x, w, bias)`` for a tensor, or for a ``NormedSum`` materialized inside the product."""
    return x.linear(w, bias) if isinstance(x, NormedSum) else F.linear(x, w, bias)


def output_projection(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """``F.linear(x, w)`` for a mixer's output, one token [1, K], on the GEMV: it launches as a dependent of the
    kernel before it, as cuBLAS cannot (measured on an H200: as fast as cuBLAS alone, 0.3 ms a token faster
    in the dependent chain)."""
    return _gemv(w, x.contiguous())
