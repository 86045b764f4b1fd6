"""The decoder: embeddings, a stack of attention / DeltaNet layers with MLPs, the LM head.

``Model.forward`` takes new tokens, their explicit positions and a ``StepContext`` (slots
to write, key slots to read, mask), writes their K/V into the paged cache, updates the
recurrent state in place and returns logits. ``Model.context`` builds that context from the
view's slots in view order; decode graphs build the same context from static buffers.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch
import torch.nn.functional as F

from kvmem_torch import kernels
from kvmem_torch.deltanet import DeltaNet, fla_rule
from kvmem_torch.gemv import NormedSum, output_projection, project
from kvmem_torch.layers import (
    SMALL_QUERY,
    Attention,
    StepContext,
    TorchOpsKeys,
    cudnn_pays,
    cudnn_prefill_usable,
    interleave_rows,
    mlp,
    rms_norm,
    rope_inv_freq,
)
from kvmem_torch.mtp import MTPHead, has_mtp
from kvmem_torch.rule_graphs import RuleGraphs
from kvmem_torch.paged import PagedKV, View
from kvmem_torch.spec import ATTENTION, ModelSpec


@dataclass
class RecurrentState:
    """DeltaNet state of one sequence: conv tails [n, conv_dim, K-1] and fp32 matrices [n, hv, dk, dv]."""

    conv: torch.Tensor
    rec: torch.Tensor

    @classmethod
    def zeros(cls, spec: ModelSpec, dtype: torch.dtype, device: torch.device | str) -> RecurrentState:
        n = len(spec.deltanet_layers)
        conv = torch.zeros(n, spec.conv_dim, spec.conv_kernel - 1, dtype=dtype, device=device)
        rec = torch.zeros(
            n, spec.linear_v_heads, spec.linear_k_dim, spec.linear_v_dim, dtype=torch.float32, device=device
        )
        return cls(conv, rec)

    def snapshot(self) -> RecurrentState:
        """An independent copy (a checkpoint at the current position)."""
        return RecurrentState(self.conv.clone(), self.rec.clone())

    def restore(self, snap: RecurrentState) -> None:
        """Overwrite this state with a checkpoint, in place (graph buffers stay valid)."""
        self.conv.copy_(snap.conv)
        self.rec.copy_(snap.rec)

    def reset(self) -> None:
        self.conv.zero_()
        self.rec.zero_()


class Model:
    """Weights in the internal layout (see ``spec``) plus the per-layer callables."""

    def __init__(self, spec: ModelSpec, weights: dict[str, torch.Tensor]) -> None:
        self.spec = spec
        self.embed = weights["embed"]
        self.norm = weights["norm"].float()
        self.lm_head = weights.get("lm_head", self.embed)
        self.dtype, self.device = self.embed.dtype, self.embed.device
        self.inv_freq = rope_inv_freq(spec, self.device)
        self.can_fuse_ops = self.fused_ops = kernels.eligible(self.device)
        self.layers: list[tuple[str, object, dict[str, torch.Tensor]]] = []
        self.rule_graphs = RuleGraphs(fla_rule)  # the DeltaNet layers' fla calls (CUDA prefill), shared by shape
        attn_i = 0
        for i, kind in enumerate(spec.layer_kinds):
            w = {name[len(f"layers.{i}.") :]: t for name, t in weights.items() if name.startswith(f"layers.{i}.")}
            for name in ("attn_norm", "mlp_norm", "q_norm", "k_norm"):
                if name in w:
                    w[name] = w[name].float()
            w["gate_up"] = interleave_rows(w.pop("gate"), w.pop("up"))
            if kind == ATTENTION:
                self.layers.append((kind, Attention(spec, w, attn_i, i), w))
                attn_i += 1
            else:
                self.layers.append((kind, DeltaNet(spec, w, self.rule_graphs), w))
        self.mtp = MTPHead(spec, weights, self.embed, self.lm_head, self.inv_freq) if has_mtp(weights) else None
        self.hidden: torch.Tensor | None = None  # with an MTP head: final-normed hidden states of the last forward

    def use_kernels(self, on: bool) -> None:
        """Run single-token decode, and every forward's residual norms and MLP activations, through the Triton
        kernels where a layer can (the default) or through torch ops. Decode graphs captured before keep the path
        they were captured with."""
        self.fused_ops = on and self.can_fuse_ops
        for _, mixer, _ in self.layers:
            mixer.fused = on and mixer.can_fuse

    def use_cudnn_prefill(self, on: bool) -> bool:
        """Let eager forwards whose attention ``layers.cudnn_pays`` for go through ``layers.cudnn_prefill`` where it
        runs here (``layers.cudnn_prefill_usable``), or not. Off for a bare ``Model``; ``TorchAdapter`` turns it on
        (docs/torch.md). Captured graphs are unaffected (they keep flash attention). -> whether it is on"""
        attention = [m for kind, m, _ in self.layers if kind == ATTENTION]
        on = (
            on
            and bool(attention)
            and all(m.flash and cudnn_prefill_usable(self.dtype, m.hd, self.device) for m in attention)
        )
        for m in attention:
            m.cudnn = on
        return on

    def cudnn_prefill(self, n_new: int, n_keys: int) -> bool:
        """Whether an eager forward of ``n_new`` tokens over ``n_keys`` view keys (theirs included) attends through
        cuDNN's kernel (``layers.cudnn_prefill``): where it is on and pays (``layers.cudnn_pays``)."""
        return cudnn_pays(n_new, n_keys) and any(m.cudnn for kind, m, _ in self.layers if kind == ATTENTION)

    def new_cache(self, num_blocks: int, block_tokens: int, kv_fp8: bool = False) -> PagedKV:
        s = self.spec
        return PagedKV(
            len(s.attention_layers),
            num_blocks,
            block_tokens,
            s.n_kv_heads,
            s.head_dim,
            self.dtype,
            self.device,
            self.inv_freq,
            kv_fp8,
        )

    def new_state(self) -> RecurrentState:
        return RecurrentState.zeros(self.spec, self.dtype, self.device)

    def context(
        self, cache: PagedKV, key_slots: Sequence[int], n_new: int, positions: torch.Tensor, capture: bool = False
    ) -> StepContext:
        """Context for a forward whose view is ``key_slots`` (view order); its last ``n_new`` are the new tokens."""
        dev, start = self.device, len(key_slots) - n_new
        key_slots_t = torch.tensor(key_slots, dtype=torch.long, device=dev)
        q_index = torch.arange(start, start + n_new, device=dev)
        return self.static_context(cache, key_slots_t[start:], key_slots_t, q_index, positions.to(dev), capture)

    def static_context(
        self,
        cache: PagedKV,
        slots: torch.Tensor,
        key_slots: torch.Tensor,
        q_index: torch.Tensor,
        positions: torch.Tensor,
        capture: bool = False,
    ) -> StepContext:
        """Device-side part of the context (no host sync): the new slots placed (positions, RoPE rows); for
        layers on torch ops the rows, RoPE tables and mask in view order."""
        q_cos, q_sin = cache.place(slots, positions)
        kernels_only = all(
            mixer.decodes_in_kernels(positions.shape[0], capture) for kind, mixer, _ in self.layers if kind == ATTENTION
        )
        torch_ops = None if kernels_only else self.torch_ops_keys(cache, slots, key_slots, q_index)
        return StepContext(slots, key_slots, q_cos, q_sin, q_index[-1:] + 1, torch_ops, {} if capture else None)

    def torch_ops_keys(
        self, cache: PagedKV, slots: torch.Tensor, key_slots: torch.Tensor, q_index: torch.Tensor
    ) -> TorchOpsKeys:
        """Rows and RoPE tables of the view in view order, and the mask for a few new tokens (``StepContext``)."""
        mask = None
        if q_index.shape[0] <= SMALL_QUERY:
            mask = torch.arange(key_slots.shape[0], device=self.device)[None, :] <= q_index[:, None]
            mask = mask.repeat(self.spec.n_heads // self.spec.n_kv_heads, 1)
        return TorchOpsKeys(
            cache.base_rows(slots),
            cache.base_rows(key_slots),
            cache.cos.index_select(0, key_slots),
            cache.sin.index_select(0, key_slots),
            mask,
        )

    def forward(
        self, tokens: torch.Tensor, ctx: StepContext, cache: PagedKV, state: RecurrentState, last_only: bool = True
    ) -> torch.Tensor:
        """Run T tokens through every layer. -> logits [T, vocab] (or [1, vocab] with ``last_only``); with an MTP
        head, ``hidden`` holds the final-normed hidden states of all T rows (its input).
        One token with the kernels on folds each residual add + norm into the next projection and the MLP
        activation into the gate/up projection (``gemv``): a sublayer's input then travels as a ``NormedSum``."""
        x = F.embedding(tokens, self.embed)
        h = rms_norm(x, self.layers[0][2]["attn_norm"], self.spec.rms_eps)
        norms = [w["attn_norm"] for _, _, w in self.layers[1:]] + [self.norm]
        fold = self.fused_ops and tokens.shape[0] == 1
        dn_i = 0
        for (kind, mixer, w), next_norm in zip(self.layers, norms):
            if kind == ATTENTION:
                out = mixer(h, ctx, cache)
            else:
                snaps = [(o, s.conv[dn_i], s.rec[dn_i]) for o, s in ctx.snapshots]
                out = mixer(h, state.conv[dn_i], state.rec[dn_i], snaps, ctx.rows)
                dn_i += 1
            if isinstance(h, NormedSum):
                x = h.total
            x, h = self.mlp_block(x, out, w, next_norm, fold)
        rows = h
        if not fold and last_only:  # the last row (of a padded forward's own)
            rows = h[-1:] if ctx.rows is None else h.index_select(0, ctx.rows - 1)
        logits = project(rows, self.lm_head)
        if self.mtp is not None:
            self.hidden = rms_norm(h.total, h.weight, self.spec.rms_eps) if isinstance(h, NormedSum) else h
        return logits

    def mlp_block(
        self, x: torch.Tensor, out: torch.Tensor, w: dict[str, torch.Tensor], next_norm: torch.Tensor, fold: bool
    ) -> tuple[torch.Tensor, torch.Tensor | NormedSum]:
        """After a mixer's output: residual add, the MLP, residual add. -> (residual stream, the next sublayer's
        input, normed by ``next_norm``; with ``fold`` a ``NormedSum`` whose residual is the stream after the
        MLP, the returned one being the stream before it)."""
        eps = self.spec.rms_eps
        if not fold:
            x, h = self.add_norm(x, out, w["mlp_norm"])
            return self.add_norm(x, mlp(h, w, self.fused_ops), next_norm)
        mid = NormedSum(x, out, w["mlp_norm"], eps)
        act = mid.linear(w["gate_up"], swiglu=True)
        return mid.total, NormedSum(mid.total, output_projection(act, w["down"]), next_norm, eps)

    def add_norm(self, x: torch.Tensor, h: torch.Tensor, weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(x + h, its RMS norm): the residual stream and the next sublayer's input."""
        if self.fused_ops:
            return kernels.add_rms_norm(x, h, weight, self.spec.rms_eps)
        x = x + h
        return x, rms_norm(x, weight, self.spec.rms_eps)

    @torch.inference_mode()
    def run(
        self,
        tokens: torch.Tensor,
        positions: torch.Tensor,
        cache: PagedKV,
        view: View,
        state: RecurrentState,
        last_only: bool = True,
    ) -> torch.Tensor:
        """Append tokens to ``view`` (reserving blocks), run them, advance the view. -> logits"""
        assert cache.reserve(view, len(tokens)), "paged cache is full"
        ctx = self.context(cache, view.slots(0, view.length + len(tokens), cache.block_tokens), len(tokens), positions)
        logits = self.forward(tokens.to(self.device), ctx, cache, state, last_only)
        view.length += len(tokens)
        return logits
