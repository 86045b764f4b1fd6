"""qwen35's multi-token prediction (MTP) layer as a draft head for speculative decoding (``--speculative mtp``).

The published architecture (Qwen3-Next / Qwen3.5 checkpoints' ``mtp.*`` tensors; a GGUF's ``blk.N.nextn.*`` plus
the layer tensors of block N = the main layers' count): for the main model's final-normed hidden state ``h_t`` at
position t and the token ``x_{t+1}`` after it,

    u = fc(concat(rms_norm(embed(x_{t+1})) * enorm, rms_norm(h_t) * hnorm))
    u = one decoder layer (gated full attention with q/k norms and partial RoPE, then the MLP) over u at position t
    draft_hidden = rms_norm(u) * norm;   logits = lm_head(draft_hidden)   (embedding and LM head shared)

predicts ``x_{t+2}``; fed its own ``draft_hidden`` and that guess, it predicts the token after, and so on. The layer
attends over its own keys (it has its own KV): here those of the pairs this step committed, from the last forward
before decoding (the prompt's last chunk: earlier hidden states are not kept, which can only lower acceptance,
never change the output) to the answer so far.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

import torch
import torch.nn.functional as F

from kvmem_torch.layers import apply_rope, interleave_rows, mlp, rms_norm
from kvmem_torch.paged import rope_cos_sin
from kvmem_torch.spec import ModelSpec

MTP_DRAFT_TOKENS = 3  # each guess feeds the next, so later ones are right less often (vLLM's default is 1-3)
MTP_KV_POSITIONS = 8192  # the head's own KV (up to half of it from the prompt); a longer answer starts it over
PREFIX = "mtp."
NORMS = ("enorm", "hnorm", "norm", "layers.0.attn_norm", "layers.0.mlp_norm", "layers.0.q_norm", "layers.0.k_norm")


def has_mtp(weights: dict[str, torch.Tensor]) -> bool:
    """Whether internal ``weights`` carry an MTP layer (its fc projection and decoder layer)."""
    return f"{PREFIX}fc" in weights and f"{PREFIX}layers.0.q" in weights


class MTPHead:
    """The MTP layer with its own KV of up to ``capacity`` positions (see module docstring)."""

    def __init__(
        self,
        spec: ModelSpec,
        weights: dict[str, torch.Tensor],
        embed: torch.Tensor,
        lm_head: torch.Tensor,
        inv_freq: torch.Tensor,
        capacity: int = MTP_KV_POSITIONS,
    ) -> None:
        """``weights``: the internal ones (``mtp.*`` among them); ``embed``, ``lm_head``, ``inv_freq``: the main
        model's."""
        w = {name[len(PREFIX) :]: t for name, t in weights.items() if name.startswith(PREFIX)}
        for name in NORMS:
            w[name] = w[name].float()
        w["layers.0.gate_up"] = interleave_rows(w.pop("layers.0.gate"), w.pop("layers.0.up"))
        self.w, self.spec, self.embed, self.lm_head, self.inv_freq = w, spec, embed, lm_head, inv_freq
        self.layer = {name[len("layers.0.") :]: t for name, t in w.items() if name.startswith("layers.0.")}
        shape = (capacity, spec.n_kv_heads, spec.head_dim)
        self.k = torch.zeros(shape, dtype=embed.dtype, device=embed.device)
        self.v = torch.zeros_like(self.k)
        self.length = 0  # positions held in the KV

    def forward(self, hidden: torch.Tensor, tokens: Sequence[int], positions: Sequence[int]) -> torch.Tensor:
        """Run the pairs (``hidden[i]``, ``tokens[i]``) at ``positions`` (after every held one), appending their K/V.
        -> the draft hidden states [T, H] (``logits`` of them are the guesses)."""
        s, dev = self.spec, self.embed.device
        ids = torch.tensor(list(tokens), dtype=torch.long, device=dev)
        e = rms_norm(F.embedding(ids, self.embed), self.w["enorm"], s.rms_eps)
        h = rms_norm(hidden.to(self.embed.dtype), self.w["hnorm"], s.rms_eps)
        x = F.linear(torch.cat([e, h], dim=-1), self.w["fc"])
        pos = torch.tensor(list(positions), dtype=torch.long, device=dev)
        x = x + self._attention(rms_norm(x, self.layer["attn_norm"], s.rms_eps), pos)
        x = x + mlp(rms_norm(x, self.layer["mlp_norm"], s.rms_eps), self.layer)
        return rms_norm(x, self.w["norm"], s.rms_eps)

    def logits(self, draft_hidden: torch.Tensor) -> torch.Tensor:
        return F.linear(draft_hidden, self.lm_head)

    def truncate(self, length: int) -> None:
        """Forget the K/V past the first ``length`` positions."""
        self.length = min(self.length, length)

    def _attention(self, x: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        """Gated attention of the new rows over the held K/V and themselves (causal), as qwen35's attention layers."""
        s, w, T = self.spec, self.layer, x.shape[0]
        q, gate = F.linear(x, w["q"]).view(T, s.n_heads, 2 * s.head_dim).split(s.head_dim, dim=-1)
        k = F.linear(x, w["k"]).view(T, s.n_kv_heads, s.head_dim)
        v = F.linear(x, w["v"]).view(T, s.n_kv_heads, s.head_dim)
        cos, sin = rope_cos_sin(pos, self.inv_freq, x.dtype)
        q = apply_rope(rms_norm(q, w["q_norm"], s.rms_eps), cos, sin)
        k = apply_rope(rms_norm(k, w["k_norm"], s.rms_eps), cos, sin)
        n = self.length + T
        assert n <= self.k.shape[0], "MTP KV full"
        self.k[self.length : n], self.v[self.length : n] = k, v
        self.length = n
        group = s.n_heads // s.n_kv_heads
        keys = self.k[:n].repeat_interleave(group, dim=1).transpose(0, 1)  # [heads, n, hd]
        values = self.v[:n].repeat_interleave(group, dim=1).transpose(0, 1)
        mask = torch.ones(T, n, dtype=torch.bool, device=x.device).tril(n - T)
        out = F.scaled_dot_product_attention(q.transpose(0, 1), keys, values, attn_mask=mask)
        out = out.transpose(0, 1).reshape(T, -1) * torch.sigmoid(gate.reshape(T, -1))
        return F.linear(out, w["o"])


@dataclass(frozen=True)
class Forwarded:
    """A forward's tokens, their positions and the final-normed hidden states of its rows [len(tokens), H]."""

    tokens: list[int]
    positions: list[int]
    hidden: torch.Tensor


class MTPDrafter:
    """A ``kvmem_core.speculative.Drafter`` over an ``MTPHead``. Before each draft, the pairs committed since the
    last one join the head's KV: each committed row of the adapter's last forward (``last()``) with the token that
    followed it; at the first draft these are the rows of the forward before decoding (the prompt's last chunk,
    at most half the head's KV), later the kept rows of the last verification. Then the head guesses ``k`` tokens,
    each from its own last output."""

    def __init__(self, head: MTPHead, last: Callable[[], Forwarded | None], k: int = MTP_DRAFT_TOKENS) -> None:
        self.head, self.last, self.k = head, last, k
        self.context = last()  # the forward before decoding: all its rows are committed
        self.new: list[int] = []  # tokens advanced since the last draft
        head.truncate(0)

    def extend(self, tokens: Sequence[int]) -> None:
        self.new.extend(tokens)

    @torch.inference_mode()
    def propose(self, limit: int | None = None) -> list[int]:
        """Up to ``min(k, limit)`` guesses; [] where the hidden states of the new tokens are not at hand (then the
        head's KV skips them)."""
        last, new, first = self.last(), self.new, self.context is not None
        self.new, self.context = [], None
        k = self.k if limit is None else min(self.k, limit)
        committed = len(last.tokens) if first and last is not None else len(new)
        if last is None or not new or k <= 0 or last.hidden.shape[0] < committed:
            return []
        start = max(0, committed - self.head.k.shape[0] // 2)
        following = [*last.tokens[start + 1 : committed], new[-1]]
        if self.head.length + len(following) + k > self.head.k.shape[0]:
            self.head.truncate(0)
        out = self.head.forward(last.hidden[start:committed], following, last.positions[start:committed])
        kept, draft, position = self.head.length, [], last.positions[committed - 1] + 1
        for i in range(k):
            draft.append(int(self.head.logits(out[-1:]).argmax(-1)))
            if i + 1 < k:
                out = self.head.forward(out[-1:], draft[-1:], [position + i])
        self.head.truncate(kept)  # guesses' K/V came from the head's own states: not kept
        return draft
