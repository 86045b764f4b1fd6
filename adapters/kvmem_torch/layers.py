"""Token-mixing and feed-forward layers over the paged cache: RMSNorm, RoPE, MLP, attention.

Shapes carry no batch dimension: one sequence per forward, ``T`` new tokens, ``S`` key
slots (the view's blocks, flattened). Every layer works in the run dtype; norms and the
softmax accumulate in fp32.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.nn.attention.bias import causal_lower_right

from kvmem_torch import attention_kernels, kernels
from kvmem_torch.gemv import NormedSum, output_projection, project
from kvmem_torch.paged import PagedKV
from kvmem_torch.spec import ModelSpec


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x / rms(x) * weight (the effective multiplier, kept in fp32), computed in fp32."""
    return F.rms_norm(x.float(), (x.shape[-1],), weight, eps).to(x.dtype)


def rope_inv_freq(spec: ModelSpec, device: torch.device | str) -> torch.Tensor:
    """Rotary frequencies, divided by the spec's rope-scaling factors when it has them."""
    rd = spec.rotary_dim
    inv = 1.0 / (spec.rope_theta ** (torch.arange(0, rd, 2, dtype=torch.float32, device=device) / rd))
    if spec.rope_factors:
        inv = inv / torch.tensor(spec.rope_factors, dtype=torch.float32, device=device)
    return inv


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate the first ``rotary_dim`` dims of x [N, heads, head_dim]; the rest pass through."""
    rd = cos.shape[-1]
    xr, xp = x[..., :rd], x[..., rd:]
    half = rd // 2
    rotated = torch.cat([-xr[..., half:], xr[..., :half]], dim=-1)
    out = xr * cos[:, None, :] + rotated * sin[:, None, :]
    return torch.cat([out, xp], dim=-1) if xp.shape[-1] else out


@dataclass
class StepContext:
    """Where one forward's tokens go and what they attend to (tensors, so decode can be graph-captured)."""

    new_slots: torch.Tensor  # [T] cache slot of each new token
    key_slots: torch.Tensor  # [S] the view's slots, in view order
    q_cos: torch.Tensor  # [T, rd]
    q_sin: torch.Tensor
    n_keys: torch.Tensor  # [1] keys up to the last new token (a graph's key_slots run on past them)
    torch_ops: TorchOpsKeys | None = None  # for layers on torch ops; None when every layer runs the kernels
    capture: dict[int, torch.Tensor] | None = None  # layer -> pre-RoPE q [T, heads, hd] without its bias
    # (offset, state) pairs: the recurrent layers copy their state after that many new tokens into the state
    snapshots: tuple[tuple[Any, Any], ...] = ()
    rows: torch.Tensor | None = None  # [1] a padded forward's own rows (a prefill graph's, ``Runner``); the rest pad
    exact_keys: bool = False  # key_slots are exactly the view's keys, the new tokens last (an eager forward)


@dataclass
class TorchOpsKeys:
    """What attention over torch ops gathers by: rows (``PagedKV.base_rows``) and RoPE tables in view order."""

    new_rows: torch.Tensor  # [T] base row of each new token
    key_rows: torch.Tensor  # [S] base rows of the view's slots
    k_cos: torch.Tensor  # [S, rd]
    k_sin: torch.Tensor
    mask: torch.Tensor | None  # [group * T, S] True where the query may attend (rows repeat per GQA group
    # member); None for more than SMALL_QUERY new tokens, which are the view's last and attend causally


_PREFILL_BACKENDS = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]
SMALL_QUERY = 64


def masked_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Few query rows (decode, short forwards), GQA folded into the rows: [1, kv, rows, hd] x [1, kv, S, hd].
    Two matmuls that read K and V once."""
    scores = (q @ k.transpose(-1, -2)).float() * q.shape[-1] ** -0.5
    probs = torch.softmax(scores.masked_fill(~mask, float("-inf")), dim=-1).to(v.dtype)
    return probs @ v


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """q [1, heads, T, hd] are the last T of the S keys [1, kv, S, hd]: causal attention aligned to the last
    key, with no mask tensor, so CUDA runs flash (bf16/fp16) or memory-efficient attention. K/V are widened to
    the query heads first: flash's lower-right causal path takes equal head counts."""
    group = q.shape[1] // k.shape[1]
    if group > 1:
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    bias = causal_lower_right(q.shape[2], k.shape[2])
    if not q.is_cuda:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=bias)
    with sdpa_kernel(_PREFILL_BACKENDS):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=bias)


def flash_varlen_usable(dtype: torch.dtype, head_dim: int, device: torch.device) -> bool:
    """Whether ``flash_prefill`` runs for queries of this dtype and head size on ``device``: flash attention's
    kernels (an NVIDIA GPU of compute capability 8 or later, half precision, a head size they cover). ROCm keeps
    ``causal_attention``: its flash attention's variable-length entry is not checked here (no AMD GPU)."""
    return dtype in (torch.float16, torch.bfloat16) and head_dim % 8 == 0 and head_dim <= 256 and _ampere(device)


@functools.cache
def _ampere(device: torch.device) -> bool:
    return device.type == "cuda" and torch.version.hip is None and torch.cuda.get_device_capability(device)[0] >= 8


def flash_prefill(
    q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, n_keys: torch.Tensor, rows: torch.Tensor | None = None
) -> torch.Tensor:
    """q [T, heads, hd] are the last T of the first ``n_keys`` (a one-element device tensor) of ``keys``/``values``
    [S, kv, hd]: causal attention aligned to that last key, with GQA in the kernel (no K/V widening). Rows past
    ``n_keys`` are never read, so a CUDA graph can pass a key buffer padded to a bucket (``Runner``); nothing is read
    back to the host. ``rows`` (a one-element device tensor): only the first ``rows`` queries are real, the last of
    them aligned to the last key; the output's rows past them are left unwritten. -> [T, heads, hd]"""
    T, S = q.shape[0], keys.shape[0]
    cu_q = torch.arange(0, 2 * T, T, dtype=torch.int32, device=q.device) if rows is None else F.pad(rows.int(), (1, 0))
    cu_k = F.pad(n_keys.to(torch.int32), (1, 0))  # [0, n_keys]
    return torch.ops.aten._flash_attention_forward(q, keys, values, cu_q, cu_k, T, S, 0.0, True, False)[0]


CUDNN_MIN_PAIRS = 1 << 23  # query-key pairs from which cuDNN's calls beat flash attention's one (docs/torch.md)
CUDNN_LONG_ROWS = 2048  # a forward this long is GPU-bound: eager costs it nothing against its prefill graph
CUDNN_MIN_PAIRS_SHORT = 1 << 25  # shorter, host-bound forwards lose their graph too: more pairs must pay for that
CUDNN_ROW_BUCKET = 256  # cuDNN builds and keeps a plan per shape (for good, per thread): rows padded to a multiple
CUDNN_KEY_BUCKET = 4096  # and the keys before the causal call taken in whole buckets


def cudnn_pays(n_new: int, n_keys: int) -> bool:
    """Whether an eager forward of ``n_new`` tokens attending over ``n_keys`` keys (theirs included) goes faster
    through ``cudnn_prefill`` than through ``flash_prefill`` (and, for a short forward, its prefill graph): its
    attention ran 2.0-2.3x flash's rate at 4K queries over 4K-64K keys and at 640 over 16K, 0.8x at 640 over 3.2K,
    and forwards of 640 tokens over 17.5K keys lost (their graphs) where 640 over 67.6K won (9B shape, H100;
    docs/torch.md)."""
    pairs = n_new * n_keys
    return pairs >= CUDNN_MIN_PAIRS if n_new >= CUDNN_LONG_ROWS else pairs >= CUDNN_MIN_PAIRS_SHORT


def cudnn_prefill(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """q [T, heads, hd] are the last T of exactly S keys/values [S, kv, hd]: causal attention aligned to the last
    key through cuDNN's attention, GQA in the kernel. cuDNN aligns its causal mask top-left, so the keys before the
    new tokens' go in whole ``CUDNN_KEY_BUCKET``s through one call without a mask, and the rest (the remainder, r
    keys, and the T x T diagonal) through one causal call whose first r query rows are zeros, so that the new tokens'
    rows align with their keys; the two merge by their log-sum-exps. Every call's rows are padded with zeros to a
    multiple of ``CUDNN_ROW_BUCKET`` (padded rows come last and are dropped; no real row sees a padded key), which
    bounds the shapes cuDNN keeps a plan for. -> [T, heads, hd]"""
    T, S = q.shape[0], keys.shape[0]
    base = (S - T) // CUDNN_KEY_BUCKET * CUDNN_KEY_BUCKET
    r = S - T - base
    tail = _round_up(r + T, CUDNN_ROW_BUCKET) - r - T
    qc, kc, vc = (
        _bhsd(F.pad(x, (0, 0, 0, 0, front, tail))) for x, front in ((q, r), (keys[base:], 0), (values[base:], 0))
    )
    out, lse = (x[:, :, r : r + T] for x in _cudnn_attention(qc, kc, vc, causal=True))
    if base:
        qb = _bhsd(F.pad(q, (0, 0, 0, 0, 0, _round_up(T, CUDNN_ROW_BUCKET) - T)))
        before, lse_before = (
            x[:, :, :T] for x in _cudnn_attention(qb, _bhsd(keys[:base]), _bhsd(values[:base]), False)
        )
        share = torch.sigmoid(lse_before - lse)  # the earlier keys' part of each row's softmax mass
        out = torch.lerp(out.float(), before.float(), share).to(q.dtype)
    return out[0].transpose(0, 1)


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def _bhsd(x: torch.Tensor) -> torch.Tensor:
    """[rows, heads, hd] -> a [1, heads, rows, hd] view"""
    return x.transpose(0, 1)[None]


def _cudnn_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """cuDNN's fused attention [1, heads, T, hd] over [1, kv, S, hd] -> (out, natural-log sum-exp [1, heads, T, 1])"""
    out, lse = torch.ops.aten._scaled_dot_product_cudnn_attention(q, k, v, None, True, 0.0, causal)[:2]
    return out, lse


@functools.cache
def cudnn_prefill_usable(dtype: torch.dtype, head_dim: int, device: torch.device) -> bool:
    """Whether ``cudnn_prefill`` runs here and agrees with ``flash_prefill``: tried once per device, dtype and head
    size on three small problems (no keys before the new tokens, a remainder of them, a bucket and a remainder),
    since cuDNN's coverage of GPUs and head sizes varies by version."""
    if not flash_varlen_usable(dtype, head_dim, device):
        return False
    gen = torch.Generator(device).manual_seed(0)
    q = torch.randn(96, 4, head_dim, device=device, generator=gen).to(dtype)
    most = CUDNN_KEY_BUCKET + 224
    keys, values = (torch.randn(most, 2, head_dim, device=device, generator=gen).to(dtype) for _ in range(2))
    for n in (96, 224, most):
        want = flash_prefill(q, keys[:n], values[:n], torch.tensor([n], device=device))
        try:
            got = cudnn_prefill(q, keys[:n], values[:n])
        except RuntimeError:
            return False
        if not torch.allclose(got.float(), want.float(), atol=2e-2, rtol=0):
            return False
    return True


def mlp(x: torch.Tensor, w: dict[str, torch.Tensor], fused: bool = False) -> torch.Tensor:
    """SwiGLU over the interleaved gate/up projection (``interleave_rows``); ``fused``: silu(gate) * up in one
    kernel."""
    gate_up = F.linear(x, w["gate_up"])
    if fused:
        return F.linear(kernels.silu_mul(gate_up), w["down"])
    gate, up = gate_up.unflatten(-1, (-1, 2)).unbind(-1)
    return F.linear(F.silu(gate) * up, w["down"])


def interleave_rows(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """One matrix whose rows alternate gate, up: a one-token projection finds each output's pair side by side
    and applies silu(gate) * up as it stores (``gemv``)."""
    return torch.stack([gate, up], 1).flatten(0, 1)


def fuse(w: dict[str, torch.Tensor], names: tuple[str, ...], fused: str) -> list[int]:
    """Replace projections that read the same input by one stacked matrix (one GEMM); -> output sizes."""
    sizes = [w[n].shape[0] for n in names]
    w[fused] = torch.cat([w.pop(n) for n in names])
    return sizes


class Attention:
    """GQA attention over the paged cache; qwen2 adds q/k/v biases, qwen35 q/k norms and a sigmoid output gate."""

    def __init__(self, spec: ModelSpec, w: dict[str, torch.Tensor], cache_layer: int, layer: int) -> None:
        self.w, self.cache_layer, self.layer = w, cache_layer, layer
        self.n_heads, self.n_kv, self.hd = spec.n_heads, spec.n_kv_heads, spec.head_dim
        self.gated, self.eps = spec.gated_attention, spec.rms_eps
        self.sizes = fuse(w, ("q", "k", "v"), "qkv_fused")
        # Retrieval reads the query projection without its bias (as llama.cpp's capture does): the bias adds
        # one vector to every query, a pull toward the same keys (the sink) whatever the question asks.
        self.q_bias = w["q_bias"].view(self.n_heads, self.hd) if "q_bias" in w and not self.gated else None
        if "q_bias" in w:
            fuse(w, ("q_bias", "k_bias", "v_bias"), "qkv_bias")
        self.can_fuse = self.fused = kernels.eligible(w["qkv_fused"].device, self.hd, spec.rotary_dim)
        self.flash = flash_varlen_usable(w["qkv_fused"].dtype, self.hd, w["qkv_fused"].device)  # prefill attention
        self.cudnn = False  # long eager forwards through ``cudnn_prefill`` (``Model.use_cudnn_prefill``)

    def __call__(self, x: torch.Tensor | NormedSum, ctx: StepContext, cache: PagedKV) -> torch.Tensor:
        w = self.w
        qkv = project(x, w["qkv_fused"], w.get("qkv_bias"))
        T = qkv.shape[0]
        if self.decodes_in_kernels(T, ctx.capture is not None):
            return output_projection(self.decode_fused(qkv[0], ctx, cache)[None], w["o"])
        q, k, v = qkv.split(self.sizes, dim=-1)
        gate = None
        if self.gated:
            q, gate = q.view(T, self.n_heads, 2 * self.hd).split(self.hd, dim=-1)
            gate = gate.reshape(T, -1)
        q = q.reshape(T, self.n_heads, self.hd)
        k, v = k.reshape(T, self.n_kv, self.hd), v.reshape(T, self.n_kv, self.hd)
        if "q_norm" in w:
            q, k = rms_norm(q, w["q_norm"], self.eps), rms_norm(k, w["k_norm"], self.eps)
        if ctx.capture is not None:
            ctx.capture[self.layer] = q if self.q_bias is None else q - self.q_bias
        new_rows = ctx.torch_ops.new_rows
        cache.write_rows(new_rows + cache.k_offset(self.cache_layer), k)
        cache.write_rows(new_rows + cache.v_offset(self.cache_layer), v)
        out = self.attend(q, ctx, cache).reshape(T, -1)
        if ctx.rows is not None:  # padding rows were never written: zeroed (not scaled: they may hold NaN)
            out = torch.where(torch.arange(T, device=out.device)[:, None] < ctx.rows, out, 0)
        if gate is not None:
            out = out * torch.sigmoid(gate)
        return F.linear(out, w["o"])

    def decodes_in_kernels(self, n_new: int, capture: bool) -> bool:
        """Whether a forward of ``n_new`` tokens runs this layer through the decode kernels (one token, the
        kernels on, no query capture); they stop at ``StepContext.n_keys`` and need no mask."""
        return n_new == 1 and self.fused and not capture

    def decode_fused(self, qkv: torch.Tensor, ctx: StepContext, cache: PagedKV) -> torch.Tensor:
        """One token from its projection row to the gated attention output [heads * hd], in three kernels."""
        q = attention_kernels.attention_prologue(
            qkv,
            self.w.get("q_norm"),
            self.w.get("k_norm"),
            ctx.q_cos[0],
            ctx.q_sin[0],
            cache,
            self.cache_layer,
            ctx.new_slots,
            self.eps,
            self.n_heads,
            self.gated,
        )
        gate = qkv[self.hd :] if self.gated else None
        out = attention_kernels.decode_attention(q, cache, self.cache_layer, ctx.key_slots, ctx.n_keys, gate)
        return out.reshape(-1)

    def attend(self, q: torch.Tensor, ctx: StepContext, cache: PagedKV) -> torch.Tensor:
        """softmax(q·k/√d) v over the view's keys, RoPE applied at each slot's stored position."""
        at = ctx.torch_ops
        keys = cache.read_rows(at.key_rows + cache.k_offset(self.cache_layer))  # [S, kv, hd]
        values = cache.read_rows(at.key_rows + cache.v_offset(self.cache_layer))
        T, g = q.shape[0], self.n_heads // self.n_kv
        q = apply_rope(q, ctx.q_cos, ctx.q_sin)
        keys = apply_rope(keys, at.k_cos, at.k_sin)
        if at.mask is None and self.cudnn and ctx.exact_keys and cudnn_pays(T, keys.shape[0]):
            return cudnn_prefill(q, keys, values)
        if at.mask is None and self.flash:
            return flash_prefill(q, keys, values, ctx.n_keys, ctx.rows)
        keys, values = (x.transpose(0, 1)[None] for x in (keys, values))  # [1, kv, S, hd]
        if at.mask is None:
            return causal_attention(q.transpose(0, 1)[None], keys, values)[0].transpose(0, 1)
        # GQA folded into the query length: each kv head serves its group's queries, K/V are not expanded
        q = q.view(T, self.n_kv, g, self.hd).permute(1, 2, 0, 3).reshape(1, self.n_kv, g * T, self.hd)
        out = masked_attention(q, keys, values, at.mask)  # [1, kv, g*T, hd]
        return out.view(self.n_kv, g, T, self.hd).permute(2, 0, 1, 3).reshape(T, self.n_heads, self.hd)
