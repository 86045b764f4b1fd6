"""Triton kernels for one decode token: what the decode kernels share (the launch; reading and writing the
paged cache's rows, 8-bit ones as e4m3 codes and a scale), and the fused MLP activation and residual norm.

The attention kernels are in ``attention_kernels``, the Gated DeltaNet step's in ``deltanet_kernels``.
``add_rms_norm`` and ``silu_mul`` fuse the residual add with the next norm and the MLP's activation for
forwards of several tokens; at one token both ride in the next projection (``gemv``).

On Hopper and later every decode kernel (``attention_kernels``, ``gemv``, ``deltanet_kernels``) launches as a
programmatic dependent of the kernel before it: its programs are placed while the previous
kernel's last ones run and wait for its results at
``wait_previous``. What a program reads that no kernel of the step writes (a projection's first weight chunk,
a DeltaNet layer's state, which only its own step kernel writes) it loads before that wait.

Used on CUDA when Triton is importable (``TRITON_INTERPRET=1`` runs it on the CPU, which is
how the unit tests check it against the eager path).
"""

from __future__ import annotations

import functools
import os

import torch

try:
    import triton
    import triton.language as tl
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
except ImportError:  # the eager path serves when Triton is absent
    triton = None


def eligible(device: torch.device, *dims: int) -> bool:
    """Whether the kernels can serve a layer: Triton present, on CUDA (or its interpreter), power-of-two
    head dims of at least 16 (Triton's block and matmul shapes)."""
    on_device = device.type == "cuda" or os.environ.get("TRITON_INTERPRET") == "1"
    return triton is not None and on_device and all(d >= 16 and d & (d - 1) == 0 for d in dims)


DEPENDENT_LAUNCH = True  # off: every kernel waits for the previous one to finish before it starts (A/B runs)


@functools.cache
def _hopper_or_later(index: int) -> bool:
    """An NVIDIA GPU of compute capability 9 or more (ROCm reports its own architecture numbers there)."""
    return torch.version.hip is None and torch.cuda.get_device_capability(index)[0] >= 9


def dependent_launch(device: torch.device) -> bool:
    """Whether the kernels on ``device`` launch as programmatic dependents of the kernel before them (Hopper
    and later): their programs start while the previous kernel's last ones run and wait for its results in
    ``wait_previous``, so the launch gap and the previous kernel's tail overlap the next one's start."""
    return DEPENDENT_LAUNCH and device.type == "cuda" and _hopper_or_later(device.index or 0)


if triton is not None:

    @triton.jit
    def let_next_start(PDL: tl.constexpr):
        """Under a dependent launch, let the next kernel launch once every program of this one passed here (its
        programs then take the SMs this kernel's last ones leave and wait in ``wait_previous``). Called after a
        program's main loop: triggered at the start, the next kernel's waiting programs held the SMs for long and
        decode ran 17% slower on an H200. A kernel that never calls it lets the next one launch as it ends."""
        if PDL:
            gdc_launch_dependents()

    @triton.jit
    def swiglu(gate, up, dt: tl.constexpr):
        """silu(gate) * up in ``dt`` from fp32 gate and up, rounded where the eager ops round (silu, then the
        product)."""
        return ((gate * tl.sigmoid(gate)).to(dt).to(tl.float32) * up).to(dt)

    @triton.jit
    def wait_previous(PDL: tl.constexpr):
        """Under a dependent launch, wait until the previous kernel finished and its writes are visible. Every
        program passes here before it reads anything an earlier kernel wrote and before its first store (a kernel
        that finished waited for its own predecessor, so every earlier kernel is done too)."""
        if PDL:
            gdc_wait()

    @triton.jit
    def slot_row(slot, B: tl.constexpr, block_rows):
        """Row of a slot's layer-0 K in the cache's rows (``PagedKV.base_rows``)."""
        return (slot // B) * block_rows + slot % B

    @triton.jit
    def codes_to_f32(x, FP8: tl.constexpr):
        """Loaded cache values as float32: 8-bit rows' bytes are e4m3 codes."""
        if FP8:
            return x.to(tl.float8e4nv, bitcast=True).to(tl.float32)
        return x.to(tl.float32)

    @triton.jit
    def row_scale(at, valid, HD: tl.constexpr, FP8: tl.constexpr):
        """[n, 1] scales of the rows starting at ``at`` [n, 1] (their float32 after the HD codes); 1 unless FP8."""
        if FP8:
            scale = tl.load((at + HD).to(tl.pointer_type(tl.float32)), mask=valid[:, None], other=0.0)
        else:  # one return of one type: compiled Triton refuses a function returning a block or a scalar
            scale = tl.full(at.shape, 1.0, tl.float32)
        return scale

    @triton.jit
    def round_to_e4m3(x):
        """float32 x (|x| <= 448) rounded to the nearest e4m3 value (ties to even), as torch's conversion rounds;
        still float32. Triton's interpreter rounds values just below a power of two down a binade."""
        bits = x.to(tl.int32, bitcast=True)
        normal = ((bits + 0x7FFFF + ((bits >> 20) & 1)) & -0x100000).to(tl.float32, bitcast=True)
        subnormal = ((x * 512.0 + 12582912.0) - 12582912.0) / 512.0  # multiples of 2^-9, by the float32 rounding
        return tl.where(tl.abs(x) >= 0.015625, normal, subnormal)

    @triton.jit
    def store_row(at, x, HD: tl.constexpr, FP8: tl.constexpr):
        """Store one head's row x [HD] at ``at``: as it is, or (FP8) as e4m3 codes of x / scale then the float32
        scale (amax / 448), as ``fp8.quantize``."""
        d = tl.arange(0, HD)
        if FP8:
            x = x.to(tl.float32)
            scale = tl.max(tl.abs(x), 0) / 448.0
            scale = tl.where(scale > 0, scale, 1.0)
            codes = round_to_e4m3(x / scale).to(tl.float8e4nv)  # exact: every backend stores the same codes
            tl.store(at + d, codes.to(tl.uint8, bitcast=True))
            tl.store((at + HD).to(tl.pointer_type(tl.float32)), scale)
        else:
            tl.store(at + d, x.to(at.dtype.element_ty))

    @triton.jit
    def _silu_mul_kernel(gate_up_ptr, out_ptr, n, BLOCK: tl.constexpr):
        row = tl.program_id(1).to(tl.int64)
        gate_up_ptr, out_ptr = gate_up_ptr + row * 2 * n, out_ptr + row * n
        i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        mask = i < n
        dt = out_ptr.dtype.element_ty
        gate = tl.load(gate_up_ptr + 2 * i, mask=mask, other=0.0).to(tl.float32)
        up = tl.load(gate_up_ptr + 2 * i + 1, mask=mask, other=0.0).to(tl.float32)
        tl.store(out_ptr + i, swiglu(gate, up, dt), mask=mask)


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up for fused MLP projections [T, 2n] (gate and up interleaved, ``layers.interleave_rows``),
    rounded as the torch path."""
    T, n = gate_up.shape[0], gate_up.shape[-1] // 2
    out = torch.empty(T, n, dtype=gate_up.dtype, device=gate_up.device)
    _silu_mul_kernel[(triton.cdiv(n, 1024), T)](gate_up.contiguous(), out, n, BLOCK=1024, num_warps=4)
    return out


if triton is not None:

    @triton.jit
    def _add_rms_norm_kernel(x_ptr, h_ptr, w_ptr, sum_ptr, out_ptr, n, eps, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64) * n
        x_ptr, h_ptr, sum_ptr, out_ptr = x_ptr + row, h_ptr + row, sum_ptr + row, out_ptr + row
        i = tl.arange(0, BLOCK)
        mask = i < n
        s = tl.load(x_ptr + i, mask=mask, other=0.0) + tl.load(h_ptr + i, mask=mask, other=0.0)
        tl.store(sum_ptr + i, s, mask=mask)
        s = s.to(tl.float32)
        normed = s * tl.rsqrt(tl.sum(s * s, 0) / n + eps) * tl.load(w_ptr + i, mask=mask, other=0.0)
        tl.store(out_ptr + i, normed.to(out_ptr.dtype.element_ty), mask=mask)


def add_rms_norm(
    x: torch.Tensor, h: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(x + h, rms_norm(x + h) * weight) for hidden rows [T, H]: the residual add and the next norm in one
    kernel, a program per row. The sum is rounded to the run dtype, the norm computed in fp32, as the torch path."""
    x, h = x.contiguous(), h.contiguous()
    total, normed = torch.empty_like(x), torch.empty_like(x)
    _add_rms_norm_kernel[(x.shape[0],)](
        x, h, weight, total, normed, x.shape[-1], eps, BLOCK=triton.next_power_of_2(x.shape[-1]), num_warps=8
    )
    return total, normed
