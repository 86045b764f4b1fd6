"""A model's retrieval profile: which (layer, query head) pairs find facts, cached as JSON."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

PROFILE_VERSION = 2
READABLE_VERSIONS = (1, 2)  # version 1 lacks the block size and hit rates of the chosen set


@dataclass(frozen=True)
class RetrievalProfile:
    """Chosen retrieval heads of one model, plus every scored head's calibration numbers.

    ``scores`` maps ``"layer:head"`` to the head's mean log margin of the fact's block over
    the best other block, ``hit_rate`` to the fraction of fitting documents where the fact's
    block came first (at ``block_tokens`` per block); ``fit_hit_rate`` and
    ``holdout_hit_rate`` are the chosen set's, on the ``n_docs`` fitting documents and on
    ``n_holdout`` held-out ones.
    """

    fingerprint: str
    heads: tuple[tuple[int, int], ...]
    scores: dict[str, float] = field(default_factory=dict)
    hit_rate: dict[str, float] = field(default_factory=dict)
    n_docs: int = 0
    block_tokens: int = 0
    fit_hit_rate: float = float("nan")
    holdout_hit_rate: float = float("nan")
    n_holdout: int = 0

    def to_json(self) -> str:
        """JSON text that ``from_json`` reads back to an equal profile."""
        return json.dumps(
            {
                "version": PROFILE_VERSION,
                "fingerprint": self.fingerprint,
                "heads": [list(h) for h in self.heads],
                "scores": self.scores,
                "hit_rate": self.hit_rate,
                "n_docs": self.n_docs,
                "block_tokens": self.block_tokens,
                "fit_hit_rate": self.fit_hit_rate,
                "holdout_hit_rate": self.holdout_hit_rate,
                "n_holdout": self.n_holdout,
            },
            indent=1,
            sort_keys=True,
        )

    @classmethod
    def from_json(cls, text: str) -> RetrievalProfile:
        """Parse ``to_json`` output (or a version-1 profile); ValueError on another version."""
        data = json.loads(text)
        if data.get("version") not in READABLE_VERSIONS:
            raise ValueError(f"retrieval profile version {data.get('version')} is not one of {READABLE_VERSIONS}")
        return cls(
            fingerprint=data["fingerprint"],
            heads=tuple((int(a), int(b)) for a, b in data["heads"]),
            scores={k: float(v) for k, v in data["scores"].items()},
            hit_rate={k: float(v) for k, v in data["hit_rate"].items()},
            n_docs=int(data["n_docs"]),
            block_tokens=int(data.get("block_tokens", 0)),
            fit_hit_rate=float(data.get("fit_hit_rate", "nan")),
            holdout_hit_rate=float(data.get("holdout_hit_rate", "nan")),
            n_holdout=int(data.get("n_holdout", 0)),
        )

    def save(self, path: Path) -> None:
        """Write atomically (temp name, then rename)."""
        path = Path(path)
        tmp = path.with_suffix(path.suffix + ".tmp")
        tmp.write_text(self.to_json())
        tmp.replace(path)

    @classmethod
    def load(cls, path: Path) -> RetrievalProfile:
        return cls.from_json(Path(path).read_text())
