"""Next-token sampling (temperature, top-k, top-p, seed) and stop-string detection."""
from __future__ import annotations

from typing import Sequence

import torch

from kvmem_core.contract import SamplingParams


class Sampler:
    """Draws tokens for one request; a given ``seed`` reproduces the same draws on the same device."""

    def __init__(self, params: SamplingParams, device: torch.device | str = "cpu") -> None:
        self.params = params
        self.generator = torch.Generator(device=device)
        if params.seed is not None:
            self.generator.manual_seed(params.seed)
        else:
            self.generator.seed()

    def __call__(self, logits: torch.Tensor) -> int:
        """logits [vocab] -> token id; temperature 0 is greedy (ties: lowest id)."""
        p = self.params
        logits = logits.float().reshape(-1)
        if p.temperature <= 0:
            return int(torch.argmax(logits))
        probs = torch.softmax(filter_logits(logits / p.temperature, p.top_k, p.top_p), dim=-1)
        return int(torch.multinomial(probs, 1, generator=self.generator))


def filter_logits(logits: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """Mask (to -inf) all but the ``top_k`` best tokens, then all outside the smallest set of mass ``top_p``."""
    if 0 < top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if 0 < top_p < 1:
        sorted_logits, order = torch.sort(logits, descending=True)
        cum = torch.softmax(sorted_logits, dim=-1).cumsum(-1)
        drop = cum - torch.softmax(sorted_logits, dim=-1) >= top_p  # keep the token that crosses top_p
        logits = logits.masked_fill(torch.zeros_like(drop).scatter(0, order, drop), float("-inf"))
    return logits


class StopMatcher:
    """Finds the earliest stop string in streamed text and holds back text that may start one."""

    def __init__(self, stops: Sequence[str]) -> None:
        self.stops = tuple(s for s in stops if s)
        self.text = ""
        self.emitted = 0

    def feed(self, piece: str) -> tuple[str, bool]:
        """Add text; -> (text safe to emit now, stopped). After a stop, the stop string is not emitted."""
        self.text += piece
        hits = [i for i in (self.text.find(s, max(0, self.emitted - len(s))) for s in self.stops) if i >= 0]
        if hits:
            out, self.emitted = self.text[self.emitted:min(hits)], min(hits)
            return out, True
        hold = max((_overlap(self.text, s) for s in self.stops), default=0)
        safe = len(self.text) - hold
        out, self.emitted = self.text[self.emitted:safe], max(self.emitted, safe)
        return out, False

    def flush(self) -> str:
        """Text held back at the end of generation (no stop came)."""
        out, self.emitted = self.text[self.emitted:], len(self.text)
        return out


def _overlap(text: str, stop: str) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of ``stop``."""
    for n in range(min(len(stop) - 1, len(text)), 0, -1):
        if text.endswith(stop[:n]):
            return n
    return 0
