"""Gated DeltaNet (qwen35 linear-attention layers): causal conv + gated delta rule.

Per sequence each layer keeps a fixed-size state: the conv tail [conv_dim, kernel-1] in the
run dtype and the recurrent matrix [v_heads, k_dim, v_dim] in fp32. Prefill runs the
chunked (WY) form of the delta rule, decode the recurrent one; both update the state in
place so decode can be graph-captured. On CUDA, prefill runs flash-linear-attention's chunked
kernels when the package (``fla-core``, the ``cuda`` extra) is installed: the torch form loops
over 64-token chunks in Python, a few kernels per chunk and layer. Forwards shorter than a chunk
(``FLA_MIN_TOKENS``) keep the torch form, whose host cost is then the smaller.

**Snapshots in one call.** A prefill forward may hand out the state after given tokens (the engine's checkpoints).
Through fla, a layer makes one call for them all: each snapshot's prefix of the tokens runs as another sequence
of one variable-length batch, from the same starting state (``Prefixes``), so its final state is the state a
forward cut there would leave. The extra tokens cost the GPU little. The torch form splits its work at the offsets
instead.

**Graphs.** An fla call costs the host ~1.5 ms (fla's Python wrappers, Triton's launchers), which a forward of a few
hundred tokens cannot hide; the model's layers share a ``rule_graphs.RuleGraphs`` that replays the calls of a shape
it has seen from a CUDA graph. A forward replayed whole from a graph (``Runner``) takes its snapshot offsets as
device tensors, so one graph serves every offset: each snapshot's sequence then runs all ``T`` tokens, and past its
offset a token neither decays nor writes the state (its gate and beta are zeroed, ``_stopped_at``), so the
sequence's final state is still the state after the offset.
"""

from __future__ import annotations

import functools
import itertools
from dataclasses import dataclass
from typing import Callable, Sequence

import torch
import torch.nn.functional as F

from kvmem_torch import kernels
from kvmem_torch.deltanet_kernels import deltanet_step
from kvmem_torch.gemv import NormedSum, output_projection, project
from kvmem_torch.layers import fuse
from kvmem_torch.rule_graphs import Rule
from kvmem_torch.spec import ModelSpec

CHUNK = 64
Offset = int | torch.Tensor  # a snapshot's token count: a device tensor inside a graph of the whole forward
FLA_MIN_TOKENS = CHUNK  # shorter forwards run the torch form: fla's Python wrappers cost ~1-2 ms of host a call
# (autotuner lookups, input guards), one chunk of the torch form ~25 launches


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + eps)


def recurrent_delta_rule(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, state: torch.Tensor
) -> torch.Tensor:
    """Token by token. q,k [h, T, dk], v [h, T, dv], g/beta [h, T], state [h, dk, dv] (updated). -> [h, T, dv]"""
    out = torch.empty_like(v)
    for t in range(q.shape[1]):
        state.mul_(g[:, t].exp()[:, None, None])
        kv = torch.bmm(k[:, t, None, :], state)[:, 0]  # [h, dv]: what the state predicts for k
        delta = (v[:, t] - kv) * beta[:, t, None]
        state.baddbmm_(k[:, t, :, None], delta[:, None, :])
        out[:, t] = torch.bmm(q[:, t, None, :], state)[:, 0]
    return out


def chunked_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
    chunk: int = CHUNK,
) -> torch.Tensor:
    """Same contract as ``recurrent_delta_rule``, in chunks: intra-chunk work as matmuls (UT transform)."""
    h, T, dv = v.shape
    pad = (-T) % chunk
    q, k, v = (F.pad(x, (0, 0, 0, pad)) for x in (q, k, v))
    g, beta = (F.pad(x, (0, pad)) for x in (g, beta))
    n = (T + pad) // chunk
    q, k, v = (x.reshape(h, n, chunk, -1) for x in (q, k, v))
    g, beta = g.reshape(h, n, chunk), beta.reshape(h, n, chunk)
    gc = g.cumsum(-1)  # [h, n, C] log decay from chunk start
    lower = torch.ones(chunk, chunk, dtype=torch.bool, device=q.device).tril()
    decay = (gc[..., :, None] - gc[..., None, :]).masked_fill(~lower, float("-inf")).exp()  # [h, n, C, C]
    k_beta = k * beta[..., None]
    system = (k_beta @ k.transpose(-1, -2)) * decay
    u = torch.linalg.solve_triangular(system, v * beta[..., None], upper=False, unitriangular=True)
    w = torch.linalg.solve_triangular(system, k_beta * gc.exp()[..., None], upper=False, unitriangular=True)
    intra = (q @ k.transpose(-1, -2)) * decay
    q_dec = q * gc.exp()[..., None]
    k_dec = k * (gc[..., -1:] - gc).exp()[..., None]
    chunk_decay = gc[..., -1].exp()[..., None, None]  # [h, n, 1, 1]
    out = torch.empty_like(v)
    s = state
    for i in range(n):
        v_new = u[:, i] - w[:, i] @ s
        out[:, i] = q_dec[:, i] @ s + intra[:, i] @ v_new
        s = s * chunk_decay[:, i] + k_dec[:, i].transpose(-1, -2) @ v_new
    state.copy_(s)
    return out.reshape(h, n * chunk, dv)[:, :T]


@functools.cache
def fla_causal_conv() -> Callable:
    """flash-linear-attention's ``causal_conv1d`` (installed wherever ``fla_chunked_rule`` is)."""
    from fla.modules.causal_conv1d import causal_conv1d

    return causal_conv1d


@functools.cache
def fla_chunked_rule() -> Callable | None:
    """flash-linear-attention's ``chunk_gated_delta_rule``, or None when it is not installed."""
    try:
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule
    except ImportError:
        return None
    return chunk_gated_delta_rule


@dataclass(frozen=True)
class Prefixes:
    """A forward's ``T`` tokens followed by their first ``offsets[i]`` tokens for each snapshot offset, as one
    variable-length batch on ``device``: ``rows`` picks each sequence's tokens from the forward's, ``cu_seqlens`` and
    ``chunk_indices`` are fla's description of the batch (made here, so fla never reads a device tensor back)."""

    lengths: tuple[int, ...]
    rows: torch.Tensor
    cu_seqlens: torch.Tensor
    chunk_indices: torch.Tensor


@functools.lru_cache(maxsize=16)  # one forward's layers share it
def prefixes(T: int, offsets: tuple[int, ...], device: torch.device) -> Prefixes:
    """The batch of a forward of ``T`` tokens with snapshots after each of ``offsets`` (see ``Prefixes``)."""
    lengths = (T, *offsets)
    rows = [r for n in lengths for r in range(n)]
    chunks = [(i, c) for i, n in enumerate(lengths) for c in range(-(-n // CHUNK))]
    return Prefixes(lengths, *(_sent(x, device) for x in (rows, [0, *itertools.accumulate(lengths)], chunks)))


@functools.cache  # a graph reads the batch's tensors for as long as it lives: kept for the process's life
def tiled(T: int, sequences: int, device: torch.device) -> Prefixes:
    """The batch of a forward of ``T`` tokens whose ``sequences - 1`` snapshot offsets are device tensors: every
    sequence runs all ``T`` tokens (``_stopped_at`` ends each snapshot's at its offset)."""
    return prefixes(T, (T,) * (sequences - 1), device)


def _stopped_at(
    g: torch.Tensor, beta: torch.Tensor, batch: Prefixes, ends: Sequence[Offset]
) -> tuple[torch.Tensor, torch.Tensor]:
    """``g`` and ``beta`` of a ``tiled`` batch with each sequence's tokens past its end zeroed (the forward's own
    rows first, then each snapshot's offset): no decay, no write, so each sequence's final state is the state after
    its end."""
    T = batch.lengths[0]
    per_row = [batch.rows.new_full((T,), e) if isinstance(e, int) else e.to(batch.rows.dtype).expand(T) for e in ends]
    keep = (batch.rows < torch.cat(per_row))[:, None]
    return g * keep, beta * keep


def _columns(x: torch.Tensor, start: Offset, width: int) -> torch.Tensor:
    """Columns ``[start, start + width)`` of ``x``; a device tensor ``start`` is gathered (no read back)."""
    if isinstance(start, int):
        return x[:, start : start + width]
    return x.index_select(1, start + torch.arange(width, device=x.device))


def _tail_after(tail: torch.Tensor, x: torch.Tensor, offset: Offset) -> torch.Tensor:
    """The conv tail [conv_dim, width] after ``offset`` (an int or a device tensor) of the tokens ``x`` [T, conv_dim]
    that follow ``tail``: their last ``width`` inputs up to there, the oldest still ``tail``'s where ``offset <
    width``."""
    width = tail.shape[1]
    if isinstance(offset, int) and offset >= width:
        return x[offset - width : offset].T
    at = offset + torch.arange(-width, 0, device=x.device)  # rows of x; below 0, columns of tail
    return torch.where(
        at >= 0, x.index_select(0, at.clamp(min=0)).T, tail.index_select(1, (at + width).clamp(max=width - 1))
    )


def _sent(values: list, device: torch.device) -> torch.Tensor:
    """``values`` as int32 on ``device``; to a GPU from page-locked memory behind the queued work (no wait)."""
    host = torch.tensor(values, dtype=torch.int32)
    return host if device.type == "cpu" else host.pin_memory().to(device, non_blocking=True)


def fla_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    initial_state: torch.Tensor,
    batch: Prefixes | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """fla's chunked rule on inputs as it takes them: q,k [1, n, nk, dk] (L2-normalized in the kernel, q scaled by
    dk^-1/2 there), v [1, n, nv, dv], g/beta [1, n, nv] fp32, initial_state [sequences, nv, dk, dv] fp32 (one
    sequence, or ``batch``'s). -> (out [1, n, nv, dv] in v's dtype, final states like initial_state)"""
    return fla_chunked_rule()(
        q,
        k,
        v,
        g,
        beta,
        scale=q.shape[-1] ** -0.5,
        initial_state=initial_state,
        output_final_state=True,
        use_qk_l2norm_in_kernel=True,
        cu_seqlens=None if batch is None else batch.cu_seqlens,
        chunk_indices=None if batch is None else batch.chunk_indices,
    )


def fla_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
    batch: Prefixes | None = None,
    snapshots: Sequence[torch.Tensor] = (),
    rule: Rule = fla_rule,
) -> torch.Tensor:
    """The chunked rule through ``rule`` (``fla_rule`` or the graphs replaying it, ``rule_graphs``), from the conv
    outputs as they are (no head repeat: its value heads share key heads as ``repeat_interleave`` does). q,k [T,
    nk, dk], v [T, nv, dv], g/beta [T, nv] fp32, state [nv, dk, dv] fp32 (updated). -> [T, nv, dv] in v's dtype.
    With a ``batch``, the inputs hold its sequences' rows (``Prefixes``): the output and ``state`` are the first
    sequence's, and ``snapshots[i]`` receives the final state of sequence ``i + 1``."""
    n = 1 if batch is None else len(batch.lengths)
    out, final = rule(q[None], k[None], v[None], g[None], beta[None], state.expand(n, *state.shape), batch)
    state.copy_(final[0])
    for snapshot, after in zip(snapshots, final[1:]):
        snapshot.copy_(after)
    return out[0] if batch is None else out[0, : batch.lengths[0]]


class DeltaNet:
    """One Gated DeltaNet layer; ``__call__`` reads and updates (conv, recurrent) state in place."""

    def __init__(self, spec: ModelSpec, w: dict[str, torch.Tensor], rule: Rule = fla_rule) -> None:
        self.w, self.eps, self.rule = w, spec.rms_eps, rule
        self.nk, self.nv, self.dk, self.dv = (
            spec.linear_k_heads,
            spec.linear_v_heads,
            spec.linear_k_dim,
            spec.linear_v_dim,
        )
        self.conv_dim = spec.conv_dim
        self.sizes = fuse(w, ("qkv", "z", "b", "a"), "in_fused")
        self.can_fuse = self.fused = kernels.eligible(w["in_fused"].device, self.dk, self.dv)
        # half-precision runs only: fp32 keeps the exact torch form (the engine's reference runs)
        self.fla = w["in_fused"].is_cuda and w["in_fused"].dtype != torch.float32 and fla_chunked_rule() is not None

    def __call__(
        self,
        x: torch.Tensor | NormedSum,
        conv_state: torch.Tensor,
        rec_state: torch.Tensor,
        snapshots: Sequence[tuple[Offset, torch.Tensor, torch.Tensor]] = (),
        rows: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """The layer's output for ``x`` [T, ...]; reads and updates the state in place. ``snapshots``: (offset,
        conv, rec) with ascending offsets inside T: the state after that many tokens is copied into conv and rec,
        as a forward cut there would leave it (through fla one call for all; in the torch form the work is split
        there). ``rows`` (a device tensor, fla only): the forward's own rows, the rest padding the state skips."""
        w = self.w
        mixed, z, b, a = project(x, w["in_fused"]).split(self.sizes, dim=-1)
        T = mixed.shape[0]
        if T == 1 and self.fused:
            core = deltanet_step(mixed[0], z[0], b[0], a[0], conv_state, rec_state, w, self.nk, self.eps)
            return output_projection(core[None], w["out"])
        if (snapshots or rows is not None) and self.fla:
            core = self.mix(mixed, a, b, conv_state, rec_state, snapshots, rows)
        else:
            cores, start = [], 0
            for end, conv_copy, rec_copy in (*snapshots, (T, None, None)):
                cores.append(self.mix(mixed[start:end], a[start:end], b[start:end], conv_state, rec_state))
                if conv_copy is not None:
                    conv_copy.copy_(conv_state)
                    rec_copy.copy_(rec_state)
                start = end
            core = cores[0] if len(cores) == 1 else torch.cat(cores)
        return F.linear(self.gated_norm(core, z.reshape(T, self.nv, self.dv)).reshape(T, -1), w["out"])

    def mix(
        self,
        mixed: torch.Tensor,
        a: torch.Tensor,
        b: torch.Tensor,
        conv_state: torch.Tensor,
        rec_state: torch.Tensor,
        snapshots: Sequence[tuple[Offset, torch.Tensor, torch.Tensor]] = (),
        rows: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Conv and delta rule of T consecutive tokens' projections, from and into the state; ``snapshots`` and
        ``rows`` (fla only) as ``__call__``'s, in the same call (``Prefixes``). -> [T, nv, dv]"""
        T = mixed.shape[0]
        tails = [(offset, conv) for offset, conv, _ in snapshots]
        mixed = self.conv(mixed, conv_state, tails, rows)  # [T, conv_dim]
        offsets = [offset for offset, _, _ in snapshots]
        on_device = rows is not None or any(isinstance(o, torch.Tensor) for o in offsets)
        batch = None
        if on_device:
            batch = tiled(T, 1 + len(offsets), mixed.device)
        elif snapshots:
            batch = prefixes(T, tuple(offsets), mixed.device)
        if batch is not None and len(batch.lengths) > 1:  # one sequence: its rows are the forward's
            mixed, a, b = (x.index_select(0, batch.rows) for x in (mixed, a, b))
        n = mixed.shape[0]
        q, k, v = mixed.split([self.nk * self.dk, self.nk * self.dk, self.nv * self.dv], dim=-1)
        g, beta = self.w["ssm_a"] * F.softplus(a.float() + self.w["dt_bias"]), torch.sigmoid(b.float())
        if on_device:
            g, beta = _stopped_at(g, beta, batch, [T if rows is None else rows, *offsets])
        if self._through_fla(T, snapshots, rows):
            return fla_delta_rule(
                q.view(n, self.nk, self.dk),
                k.view(n, self.nk, self.dk),
                v.view(n, self.nv, self.dv),
                g,
                beta,
                rec_state,
                batch,
                [rec for _, _, rec in snapshots],
                self.rule,
            )
        return self.torch_rule(q, k, v, g, beta, rec_state).to(a.dtype)

    def torch_rule(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        g: torch.Tensor,
        beta: torch.Tensor,
        rec_state: torch.Tensor,
    ) -> torch.Tensor:
        """The delta rule in torch ops (fp32) from the conv outputs [T, ...]. -> [T, nv, dv] fp32"""
        T, rep = q.shape[0], self.nv // self.nk
        q = l2norm(q.float().view(T, self.nk, self.dk)).repeat_interleave(rep, dim=1) * self.dk**-0.5
        k = l2norm(k.float().view(T, self.nk, self.dk)).repeat_interleave(rep, dim=1)
        v = v.float().view(T, self.nv, self.dv)
        rule = recurrent_delta_rule if T == 1 else chunked_delta_rule
        return rule(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), g.T, beta.T, rec_state).transpose(0, 1)

    def conv(
        self,
        mixed: torch.Tensor,
        conv_state: torch.Tensor,
        tails: Sequence[tuple[Offset, torch.Tensor]] = (),
        rows: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Depthwise causal conv + SiLU, continuing from (and updating) the conv tail; ``tails``: (offset, conv)
        pairs, each conv receiving the tail after that many tokens (an int or a device tensor); ``rows``: the
        forward's own rows (the tail kept is theirs). Through fla where the delta rule goes there too
        (``_fla_conv``)."""
        if self._through_fla(mixed.shape[0], tails, rows):
            return self._fla_conv(mixed, conv_state, tails, rows)
        xin = torch.cat([conv_state, mixed.T.to(conv_state.dtype)], dim=1)  # [conv_dim, K-1+T]
        width = conv_state.shape[1]
        for offset, tail in tails:
            tail.copy_(_columns(xin, offset, width))
        conv_state.copy_(_columns(xin, xin.shape[1] - width if rows is None else rows, width))
        out = F.conv1d(xin[None].to(self.w["conv"].dtype), self.w["conv"][:, None, :], groups=self.conv_dim)[0]
        return F.silu(out).T.to(mixed.dtype)

    def _through_fla(self, T: int, snapshots: Sequence, rows: torch.Tensor | None) -> bool:
        """Whether a forward of ``T`` tokens runs its conv and delta rule through fla: on a layer that can, a forward
        of at least ``FLA_MIN_TOKENS``, or one with snapshots or padding rows (which only fla's batch form takes)."""
        return self.fla and (bool(snapshots) or rows is not None or T >= FLA_MIN_TOKENS)

    def _fla_conv(
        self,
        mixed: torch.Tensor,
        conv_state: torch.Tensor,
        tails: Sequence[tuple[Offset, torch.Tensor]],
        rows: torch.Tensor | None,
    ) -> torch.Tensor:
        """``conv`` through fla's causal conv kernel, which reads ``mixed`` [T, conv_dim] where it lies (the torch
        form copies it transposed behind the tail, then convolves channel by channel) and applies the SiLU to the
        float32 sum (one rounding where the torch form rounds twice); the tails come from ``mixed``'s rows."""
        before = F.pad(conv_state, (1, 0))[None]  # fla's state holds the kernel's width of inputs, the oldest unread
        out, _ = fla_causal_conv()(mixed[None], self.w["conv"], initial_state=before, activation="silu")
        for offset, tail in (*tails, (mixed.shape[0] if rows is None else rows, conv_state)):
            tail.copy_(_tail_after(before[0, :, 1:], mixed, offset))
        return out[0]

    def gated_norm(self, core: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        """RMSNorm over each head's output (plain weight, no 1+w), gated by silu(z)."""
        normed = F.rms_norm(core.float(), (core.shape[-1],), eps=self.eps).to(core.dtype)
        return (self.w["ssm_norm"] * normed * F.silu(z.float())).to(core.dtype)
