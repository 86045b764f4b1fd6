"""Triton kernels for one decode token through a Gated DeltaNet layer's mixer.

DeltaNet: the eager recurrent step is about forty small kernels (conv, norms, gates, three
batched matmuls, the gated norm); ``deltanet_step`` is two: the step itself, a program per slice
of a head's value columns (the delta rule is independent per value column) reading and writing that
slice of the fp32 state once, then the gated norm, which needs the whole head. The conv tails move on
in place: a value channel's in the step (one program reads it), a key head's q/k channels' in the gated
norm (every program of the key head reads them in the step).

They launch as dependents of the kernel before them, as the other decode kernels do (``kernels``);
``TRITON_INTERPRET=1`` runs them on the CPU for the unit tests.
"""

from __future__ import annotations

import torch

from kvmem_torch.kernels import dependent_launch, triton

if triton is not None:
    import triton.language as tl

    from kvmem_torch.kernels import wait_previous

# launch shape (measured on an H200 at the Qwen3.6-27B shape: docs/torch.md)
DELTANET_COLUMNS, DELTANET_WARPS = 32, 4  # value columns of one head's state per program

if triton is not None:

    @triton.jit
    def _conv_tails(conv_ptr, ch, KC: tl.constexpr, TP: tl.constexpr):
        """The conv tails of channels ``ch`` as a [channels, TP] tile (TP >= KC - 1, the padding zero)."""
        t = tl.arange(0, TP)
        return tl.load(conv_ptr + ch[:, None] * (KC - 1) + t[None, :], mask=(t < KC - 1)[None, :], other=0.0)

    @triton.jit
    def _shift_tails(conv_ptr, ch, tails, x, KC: tl.constexpr, TP: tl.constexpr):
        """Move the tails of channels ``ch`` on by the new values ``x``, in place. Threads of a program hold
        copies of the same channels, so every load of the program comes before its first store (a barrier)."""
        t = tl.arange(0, TP)
        tl.debug_barrier()
        tl.store(conv_ptr + ch[:, None] * (KC - 1) + t[None, :] - 1, tails, mask=((t >= 1) & (t < KC - 1))[None, :])
        tl.store(conv_ptr + ch * (KC - 1) + KC - 2, x.to(conv_ptr.dtype.element_ty))

    @triton.jit
    def _conv_silu(mixed_ptr, conv_ptr, conv_w_ptr, ch, SHIFT: tl.constexpr, KC: tl.constexpr, TP: tl.constexpr):
        """Causal depthwise conv over (tail, new value) of channels ``ch`` + SiLU, rounded as the run dtype;
        with ``SHIFT`` (the program is the channels' only reader) their tails move on, in place."""
        x = tl.load(mixed_ptr + ch)
        t = tl.arange(0, TP)
        tails = _conv_tails(conv_ptr, ch, KC, TP)
        w = tl.load(conv_w_ptr + ch[:, None] * KC + t[None, :], mask=(t < KC - 1)[None, :], other=0.0)
        acc = x.to(tl.float32) * tl.load(conv_w_ptr + ch * KC + KC - 1).to(tl.float32)
        acc += tl.sum(tails.to(tl.float32) * w.to(tl.float32), 1)
        if SHIFT:
            _shift_tails(conv_ptr, ch, tails, x, KC, TP)
        acc = acc.to(x.dtype).to(tl.float32)
        return (acc * tl.sigmoid(acc)).to(x.dtype).to(tl.float32)

    @triton.jit
    def _deltanet_kernel(
        mixed_ptr,
        b_ptr,
        a_ptr,
        conv_ptr,
        conv_w_ptr,
        state_ptr,
        ssm_a_ptr,
        dt_bias_ptr,
        core_ptr,
        NK: tl.constexpr,
        DK: tl.constexpr,
        DV: tl.constexpr,
        BV: tl.constexpr,
        REP: tl.constexpr,
        KC: tl.constexpr,
        TP: tl.constexpr,
        PDL: tl.constexpr,
    ):
        # one value head's columns [j*BV, (j+1)*BV) of its state: the delta rule is independent per value column.
        # Its v channels have no other reader, so their conv tails move on here; the q/k tails, read by every
        # program of the key head, move on in the gated-norm kernel that runs after this one
        h, j = tl.program_id(0), tl.program_id(1)
        kh = h // REP
        dk, dv = tl.arange(0, DK), j * BV + tl.arange(0, BV)
        at = h * DK * DV + dk[:, None] * DV + dv[None, :]
        state = tl.load(state_ptr + at)  # only this kernel writes the layer's state: read before the wait
        wait_previous(PDL)
        q = _conv_silu(mixed_ptr, conv_ptr, conv_w_ptr, kh * DK + dk, False, KC, TP)
        k = _conv_silu(mixed_ptr, conv_ptr, conv_w_ptr, (NK + kh) * DK + dk, False, KC, TP)
        v = _conv_silu(mixed_ptr, conv_ptr, conv_w_ptr, 2 * NK * DK + h * DV + dv, True, KC, TP)
        q = q * tl.rsqrt(tl.sum(q * q, 0) + 1e-6) * (DK**-0.5)
        k = k * tl.rsqrt(tl.sum(k * k, 0) + 1e-6)
        beta = tl.sigmoid(tl.load(b_ptr + h).to(tl.float32))
        a = tl.load(a_ptr + h).to(tl.float32) + tl.load(dt_bias_ptr + h)
        g = tl.load(ssm_a_ptr + h) * tl.where(a > 20.0, a, tl.log(1.0 + tl.exp(a)))  # softplus, torch's threshold
        state = state * tl.exp(g)
        delta = (v - tl.sum(k[:, None] * state, 0)) * beta
        state += k[:, None] * delta[None, :]
        tl.store(state_ptr + at, state)
        tl.store(core_ptr + h * DV + dv, tl.sum(q[:, None] * state, 0).to(core_ptr.dtype.element_ty))

    @triton.jit
    def _gated_norm_kernel(
        core_ptr,
        z_ptr,
        norm_w_ptr,
        out_ptr,
        mixed_ptr,
        conv_ptr,
        eps,
        NK: tl.constexpr,
        DK: tl.constexpr,
        DV: tl.constexpr,
        REP: tl.constexpr,
        KC: tl.constexpr,
        TP: tl.constexpr,
        PDL: tl.constexpr,
    ):
        # one head: RMS norm of its output (plain weight), gated by silu(z), rounded where the torch path rounds;
        # a key head's first value head moves on that key head's q and k conv tails
        wait_previous(PDL)
        h = tl.program_id(0)
        if h % REP == 0:
            qk = (h // REP * DK + tl.arange(0, DK))[None, :] + tl.arange(0, 2)[:, None] * NK * DK  # q row, k row
            qk = tl.reshape(qk, (2 * DK,))
            _shift_tails(conv_ptr, qk, _conv_tails(conv_ptr, qk, KC, TP), tl.load(mixed_ptr + qk), KC, TP)
        dv = tl.arange(0, DV)
        dt = out_ptr.dtype.element_ty
        core = tl.load(core_ptr + h * DV + dv).to(tl.float32)
        normed = (core * tl.rsqrt(tl.sum(core * core, 0) / DV + eps)).to(dt)
        scaled = (tl.load(norm_w_ptr + dv) * normed).to(tl.float32)
        z = tl.load(z_ptr + h * DV + dv).to(tl.float32)
        tl.store(out_ptr + h * DV + dv, (scaled * z * tl.sigmoid(z)).to(dt))


def deltanet_step(
    mixed: torch.Tensor,
    z: torch.Tensor,
    b: torch.Tensor,
    a: torch.Tensor,
    conv_state: torch.Tensor,
    rec_state: torch.Tensor,
    w: dict[str, torch.Tensor],
    n_k_heads: int,
    eps: float,
) -> torch.Tensor:
    """One token through a Gated DeltaNet layer's mixer, from its input projections to the gated norm.

    mixed [conv_dim], z [hv*dv], b/a [hv] (one token's projections); conv_state [conv_dim, K-1] and
    rec_state [hv, dk, dv] (fp32) are updated in place; w holds ``conv``, ``ssm_a``, ``dt_bias``,
    ``ssm_norm``. -> [hv*dv] in the run dtype, ready for the output projection.
    """
    hv, dk, dv = rec_state.shape
    bv, rep, kc = min(DELTANET_COLUMNS, dv), hv // n_k_heads, conv_state.shape[1] + 1
    tp = triton.next_power_of_2(kc - 1)
    core, out = torch.empty_like(z), torch.empty_like(z)
    pdl = dependent_launch(z.device)
    _deltanet_kernel[(hv, dv // bv)](
        mixed,
        b,
        a,
        conv_state,
        w["conv"],
        rec_state,
        w["ssm_a"],
        w["dt_bias"],
        core,
        NK=n_k_heads,
        DK=dk,
        DV=dv,
        BV=bv,
        REP=rep,
        KC=kc,
        TP=tp,
        PDL=pdl,
        num_warps=DELTANET_WARPS,
        launch_pdl=pdl,
    )
    _gated_norm_kernel[(hv,)](
        core,
        z,
        w["ssm_norm"],
        out,
        mixed,
        conv_state,
        eps,
        NK=n_k_heads,
        DK=dk,
        DV=dv,
        REP=rep,
        KC=kc,
        TP=tp,
        PDL=pdl,
        num_warps=4,
        launch_pdl=pdl,
    )
    return out
