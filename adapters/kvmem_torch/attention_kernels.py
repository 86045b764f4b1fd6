"""Triton kernels for one decode token's attention over the paged cache.

Attention (split-K "flash decoding" over the paged cache): one new token attends to the view's
``S`` slots. The eager path gathers every K/V row into a contiguous copy, rotates all keys and
runs two matmuls: about five passes over the view.
This kernel reads each K and V row once, applies RoPE to the keys in registers from the
cache's per-slot cos/sin rows, and keeps an online softmax per split of the keys; a second
kernel merges the splits. Queries of one GQA group share a program, so K/V rows
are read once per KV head.

Around it, ``attention_prologue`` does one token's q/k norms, query RoPE and cache writes in one
kernel, and the split merge applies the output gate in the same kernel: about 25 small torch
kernels per attention layer become three.

They launch as dependents of the kernel before them, as the other decode kernels do (``kernels``);
``TRITON_INTERPRET=1`` runs them on the CPU, which is how the unit tests check them against the eager path.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from kvmem_torch.kernels import dependent_launch, triton

if TYPE_CHECKING:
    from kvmem_torch.paged import PagedKV

if triton is not None:
    import triton.language as tl

    from kvmem_torch.kernels import codes_to_f32, row_scale, slot_row, store_row, wait_previous

# launch shapes (measured on an H200 at the Qwen3.6-27B shape: docs/torch.md)
BLOCK_N = 32  # keys per attention tile
MIN_SPLIT = 512  # keys per attention program, at least
MAX_PROGRAMS = 1024  # attention programs per layer, at most
ATTENTION_WARPS, ATTENTION_STAGES = 4, 2
MERGE_DIMS = 64  # head dims per merge program


if triton is not None:

    @triton.jit
    def _split_kernel(
        q_ptr,
        rows_ptr,
        slots_ptr,
        cos_ptr,
        sin_ptr,
        n_keys_ptr,
        out_ptr,
        m_ptr,
        l_ptr,
        k_off,
        v_off,
        block_rows,
        scale,
        S,
        SPLIT: tl.constexpr,
        IEEE: tl.constexpr,
        KV: tl.constexpr,
        G: tl.constexpr,
        G_PAD: tl.constexpr,
        HD: tl.constexpr,
        RD: tl.constexpr,
        B: tl.constexpr,
        BLOCK: tl.constexpr,
        ROW: tl.constexpr,
        FP8: tl.constexpr,
        PDL: tl.constexpr,
    ):
        # FP8: rows of ROW = HD + 4 bytes, e4m3 codes then a float32 scale (``fp8``), dequantized as they are read
        # scores = q_pass·k (dims >= RD, straight from the cache) + q_rot·rope(k[:RD]) (a narrow fp32 tile),
        # so only the rotary dims are widened and rotated
        wait_previous(PDL)
        head, part = tl.program_id(0), tl.program_id(1)
        n_splits = tl.num_programs(1)
        g, d, r = tl.arange(0, G_PAD), tl.arange(0, HD), tl.arange(0, RD)
        q_rows = q_ptr + (head * G + g)[:, None] * HD
        q_mask = (g < G)[:, None]
        q_rot = tl.load(q_rows + r[None, :], mask=q_mask, other=0.0)
        q_pass = tl.load(q_rows + d[None, :], mask=q_mask & (d >= RD)[None, :], other=0.0)
        half = RD // 2
        partner = tl.where(r < half, r + half, r - half)
        sign = tl.where(r < half, -1.0, 1.0)
        n_keys = tl.minimum(tl.load(n_keys_ptr), S)
        start = part * SPLIT
        stop = tl.minimum(start + SPLIT, n_keys)
        m_i = tl.full((G_PAD,), float("-inf"), tl.float32)
        l_i = tl.zeros((G_PAD,), tl.float32)
        acc = tl.zeros((G_PAD, HD), tl.float32)
        for n0 in range(0, SPLIT, BLOCK):  # a constant trip count; the view's end is a mask
            n = start + n0 + tl.arange(0, BLOCK)
            valid = n < stop
            slot = tl.load(slots_ptr + n, mask=valid, other=0)
            base = slot_row(slot, B, block_rows)
            k_at = rows_ptr + (((base + k_off) * KV + head) * ROW)[:, None]
            v_at = rows_ptr + (((base + v_off) * KV + head) * ROW)[:, None]
            k_scale = row_scale(k_at, valid, HD, FP8)
            k_r = codes_to_f32(tl.load(k_at + r[None, :], mask=valid[:, None], other=0), FP8) * k_scale
            k_p = codes_to_f32(tl.load(k_at + partner[None, :], mask=valid[:, None], other=0), FP8) * k_scale
            cs = slot[:, None] * RD + r[None, :]
            cos = tl.load(cos_ptr + cs, mask=valid[:, None], other=1.0).to(tl.float32)
            sin = tl.load(sin_ptr + cs, mask=valid[:, None], other=0.0).to(tl.float32)
            k_r = k_r * cos + sign[None, :] * k_p * sin
            v = tl.load(v_at + d[None, :], mask=valid[:, None], other=0)
            if FP8:  # values widened to the query's dtype, as the eager path dequantizes them
                v = (codes_to_f32(v, FP8) * row_scale(v_at, valid, HD, FP8)).to(q_rot.dtype)
            if IEEE:  # fp32 caches: exact products, as the eager path
                s = tl.dot(q_rot, tl.trans(k_r), input_precision="ieee")
            else:  # rotated keys and probabilities rounded to the cache dtype, as the eager path
                s = tl.dot(q_rot, tl.trans(k_r.to(q_rot.dtype)))
            if RD < HD:
                k = tl.load(k_at + d[None, :], mask=valid[:, None] & (d >= RD)[None, :], other=0)
                if FP8:
                    k = (codes_to_f32(k, FP8) * k_scale).to(q_pass.dtype)
                if IEEE:
                    s += tl.dot(q_pass, tl.trans(k), input_precision="ieee")
                else:
                    s += tl.dot(q_pass, tl.trans(k))
            s = tl.where(valid[None, :], s * scale, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))
            m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)  # a tile past the view's end adds nothing
            alpha = tl.exp(m_i - m_ref)
            p = tl.exp(s - m_ref[:, None])
            if IEEE:
                acc = acc * alpha[:, None] + tl.dot(p, v, input_precision="ieee")
            else:
                acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
            l_i = l_i * alpha + tl.sum(p, 1)
            m_i = m_new
        at = (head * n_splits + part) * G_PAD + g
        real = g < G  # the padding rows of the group stay unwritten: the merge never reads them
        tl.store(out_ptr + at[:, None] * HD + d[None, :], acc, mask=real[:, None])
        tl.store(m_ptr + at, m_i, mask=real)
        tl.store(l_ptr + at, l_i, mask=real)


def _splits(S: int, n_kv: int) -> tuple[int, int]:
    """(number of splits, keys per split): ``MIN_SPLIT`` keys per program, doubled until at most
    ``MAX_PROGRAMS`` programs; powers of two keep the kernel's compiled variants few."""
    split = MIN_SPLIT
    while -(-S // split) * n_kv > MAX_PROGRAMS:
        split *= 2
    return -(-S // split), split


def decode_attention(
    q: torch.Tensor,
    cache: PagedKV,
    layer: int,
    key_slots: torch.Tensor,
    n_keys: torch.Tensor,
    gate: torch.Tensor | None = None,
) -> torch.Tensor:
    """softmax(q·R(pos)k/√d) v for one token over the first ``n_keys`` of the view's slots.

    q [heads, hd] already rotated; ``cache`` holds the keys pre-RoPE and each slot's cos/sin row; key_slots
    [S] the view's slots, attention layer ``layer``'s K/V read at each; n_keys a one-element integer tensor
    (device-side, so a captured graph can vary it); gate (qwen35's output gate): head h's gate at
    ``gate[h * 2 * hd:]`` (the fused projection's layout), applied as ``out * sigmoid(gate)``.
    -> [heads, hd] in q's dtype.
    """
    n_heads, hd = q.shape
    n_kv, S, rd = cache.rows.shape[1], key_slots.shape[0], cache.cos.shape[1]
    G = n_heads // n_kv
    G_PAD = max(16, triton.next_power_of_2(G))
    n_splits, split = _splits(S, n_kv)
    pdl = dependent_launch(q.device)
    acc = torch.empty(n_kv, n_splits, G_PAD, hd, dtype=torch.float32, device=q.device)
    m = torch.empty(n_kv, n_splits, G_PAD, dtype=torch.float32, device=q.device)
    l = torch.empty_like(m)
    _split_kernel[(n_kv, n_splits)](
        q.contiguous(),
        cache.rows,
        key_slots,
        cache.cos,
        cache.sin,
        n_keys,
        acc,
        m,
        l,
        cache.k_offset(layer),
        cache.v_offset(layer),
        cache.block_rows,
        hd**-0.5,
        S,
        SPLIT=split,
        IEEE=q.dtype == torch.float32,
        KV=n_kv,
        G=G,
        G_PAD=G_PAD,
        HD=hd,
        RD=rd,
        B=cache.block_tokens,
        BLOCK=BLOCK_N,
        ROW=cache.rows.shape[2],
        FP8=cache.fp8,
        PDL=pdl,
        num_warps=ATTENTION_WARPS,
        num_stages=ATTENTION_STAGES,
        launch_pdl=pdl,
    )
    out = torch.empty(n_heads, hd, dtype=q.dtype, device=q.device)
    dims = min(MERGE_DIMS, hd)
    _merge_kernel[(n_heads, hd // dims)](
        acc,
        m,
        l,
        q if gate is None else gate,
        out,
        n_splits,
        G=G,
        G_PAD=G_PAD,
        HD=hd,
        DB=dims,
        GATE_STRIDE=2 * hd,
        GATED=gate is not None,
        SB=16,
        PDL=pdl,
        num_warps=4,
        launch_pdl=pdl,
    )
    return out


if triton is not None:

    @triton.jit
    def _merge_kernel(
        acc_ptr,
        m_ptr,
        l_ptr,
        gate_ptr,
        out_ptr,
        n_splits,
        G: tl.constexpr,
        G_PAD: tl.constexpr,
        HD: tl.constexpr,
        DB: tl.constexpr,
        GATE_STRIDE: tl.constexpr,
        GATED: tl.constexpr,
        SB: tl.constexpr,
        PDL: tl.constexpr,
    ):
        # one query head's dims [c*DB, (c+1)*DB): its splits' partials weighed by exp(m - max m) (a split that saw
        # no key has m = -inf and weighs nothing), then the sigmoid output gate, rounded where the torch path rounds
        wait_previous(PDL)
        hq, c = tl.program_id(0), tl.program_id(1)
        kv, g = hq // G, hq % G
        d, s = c * DB + tl.arange(0, DB), tl.arange(0, SB)
        m_max = tl.full((SB,), float("-inf"), tl.float32)
        for s0 in range(0, n_splits, SB):
            at = (kv * n_splits + s0 + s) * G_PAD + g
            m_max = tl.maximum(m_max, tl.load(m_ptr + at, mask=s0 + s < n_splits, other=float("-inf")))
        m_ref = tl.max(m_max, 0)
        num = tl.zeros((DB,), tl.float32)
        den = tl.zeros((SB,), tl.float32)
        for s0 in range(0, n_splits, SB):
            valid = s0 + s < n_splits
            at = (kv * n_splits + s0 + s) * G_PAD + g
            w = tl.exp(tl.load(m_ptr + at, mask=valid, other=float("-inf")) - m_ref)
            den += tl.load(l_ptr + at, mask=valid, other=0.0) * w
            num += tl.sum(
                tl.load(acc_ptr + at[:, None] * HD + d[None, :], mask=valid[:, None], other=0.0) * w[:, None], 0
            )
        out = num / tl.sum(den, 0)
        if GATED:
            dt = out_ptr.dtype.element_ty
            gate = tl.sigmoid(tl.load(gate_ptr + hq * GATE_STRIDE + d).to(tl.float32)).to(dt).to(tl.float32)
            out = out.to(dt).to(tl.float32) * gate
        tl.store(out_ptr + hq * HD + d, out.to(out_ptr.dtype.element_ty))

    @triton.jit
    def _prologue_kernel(
        qkv_ptr,
        q_norm_ptr,
        k_norm_ptr,
        cos_ptr,
        sin_ptr,
        rows_ptr,
        new_slot_ptr,
        q_out_ptr,
        k_off,
        v_off,
        block_rows,
        eps,
        NH: tl.constexpr,
        KV: tl.constexpr,
        HD: tl.constexpr,
        RD: tl.constexpr,
        Q_STRIDE: tl.constexpr,
        NORM: tl.constexpr,
        B: tl.constexpr,
        ROW: tl.constexpr,
        FP8: tl.constexpr,
        PDL: tl.constexpr,
    ):
        # programs [0, NH): one query head, RMS-normed (qwen35) and rotated into q_out, rounded where the torch
        # path rounds; [NH, NH + KV): one kv head, K normed and K/V written to the new token's cache rows
        # (K pre-RoPE, as the cache holds it)
        wait_previous(PDL)
        i = tl.program_id(0)
        d = tl.arange(0, HD)
        dt = q_out_ptr.dtype.element_ty
        if i < NH:
            half = RD // 2
            rot = d < RD
            partner = tl.where(rot, tl.where(d < half, d + half, d - half), d)
            x = tl.load(qkv_ptr + i * Q_STRIDE + d).to(tl.float32)
            x_p = tl.load(qkv_ptr + i * Q_STRIDE + partner).to(tl.float32)
            if NORM:
                r = tl.rsqrt(tl.sum(x * x, 0) / HD + eps)
                x = (x * r * tl.load(q_norm_ptr + d)).to(dt).to(tl.float32)
                x_p = (x_p * r * tl.load(q_norm_ptr + partner)).to(dt).to(tl.float32)
            cos = tl.load(cos_ptr + d, mask=rot, other=1.0).to(tl.float32)
            sin = tl.load(sin_ptr + d, mask=rot, other=0.0).to(tl.float32)
            sign = tl.where(d < half, -1.0, 1.0)
            rotated = (x * cos).to(dt).to(tl.float32) + (sign * x_p * sin).to(dt).to(tl.float32)
            tl.store(q_out_ptr + i * HD + d, tl.where(rot, rotated, x).to(dt))
        else:
            h = i - NH
            row = slot_row(tl.load(new_slot_ptr), B, block_rows)
            k = tl.load(qkv_ptr + NH * Q_STRIDE + h * HD + d).to(tl.float32)
            if NORM:
                k = (k * tl.rsqrt(tl.sum(k * k, 0) / HD + eps) * tl.load(k_norm_ptr + d)).to(dt)
            v = tl.load(qkv_ptr + NH * Q_STRIDE + (KV + h) * HD + d)
            store_row(rows_ptr + ((row + k_off) * KV + h) * ROW, k, HD, FP8)
            store_row(rows_ptr + ((row + v_off) * KV + h) * ROW, v, HD, FP8)


def attention_prologue(
    qkv: torch.Tensor,
    q_norm: torch.Tensor | None,
    k_norm: torch.Tensor | None,
    cos: torch.Tensor,
    sin: torch.Tensor,
    cache: PagedKV,
    layer: int,
    new_slot: torch.Tensor,
    eps: float,
    n_heads: int,
    gated: bool,
) -> torch.Tensor:
    """One token's attention inputs from its fused projection row ``qkv`` (q heads, each followed by its gate
    when ``gated``; then k, v): q/k RMS norms when given (both or neither), RoPE of q (cos/sin [rd] at its
    position), K (pre-RoPE) and V written to attention layer ``layer``'s rows of cache slot ``new_slot``
    (one-element tensor). -> rotated q [n_heads, hd] in qkv's dtype."""
    n_kv, hd = cache.rows.shape[1], cache.head_dim
    q = torch.empty(n_heads, hd, dtype=qkv.dtype, device=qkv.device)
    norm, pdl = q_norm is not None, dependent_launch(qkv.device)
    _prologue_kernel[(n_heads + n_kv,)](
        qkv,
        q_norm if norm else qkv,
        k_norm if norm else qkv,
        cos,
        sin,
        cache.rows,
        new_slot,
        q,
        cache.k_offset(layer),
        cache.v_offset(layer),
        cache.block_rows,
        eps,
        NH=n_heads,
        KV=n_kv,
        HD=hd,
        RD=cos.shape[-1],
        Q_STRIDE=(2 if gated else 1) * hd,
        NORM=norm,
        B=cache.block_tokens,
        ROW=cache.rows.shape[2],
        FP8=cache.fp8,
        PDL=pdl,
        num_warps=4,
        launch_pdl=pdl,
    )
    return q
