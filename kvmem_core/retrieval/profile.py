"""A model's retrieval profile: which (layer, query head) pairs find facts, cached as JSON."""
from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path

from kvmem_core.layout import BlockLayout

PROFILE_VERSION = 1


def model_fingerprint(model_id: str, layout: BlockLayout) -> str:
    """Stable 16-hex digest naming a model and its KV layout; profiles are cached under it."""
    text = f"{model_id}|{layout.layout_hash()}".encode()
    return hashlib.blake2b(text, digest_size=8).hexdigest()


@dataclass(frozen=True)
class RetrievalProfile:
    """Chosen retrieval heads of one model, plus every scored head's calibration numbers.

    ``scores`` maps ``"layer:head"`` to the mean attention mass the head put on the planted
    fact; ``hit_rate`` to the fraction of documents where its strongest token lay in the fact.
    """

    fingerprint: str
    heads: tuple[tuple[int, int], ...]
    scores: dict[str, float] = field(default_factory=dict)
    hit_rate: dict[str, float] = field(default_factory=dict)
    n_docs: int = 0

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
            },
            indent=1,
            sort_keys=True,
        )

    @classmethod
    def from_json(cls, text: str) -> RetrievalProfile:
        """Parse ``to_json`` output; ValueError on another version."""
        data = json.loads(text)
        if data.get("version") != PROFILE_VERSION:
            raise ValueError(f"retrieval profile version {data.get('version')} != {PROFILE_VERSION}")
        return cls(
            fingerprint=data["fingerprint"],
            heads=tuple((int(a), int(b)) for a, b in data["heads"]),
            scores={k: float(v) for k, v in data["scores"].items()},
            hit_rate={k: float(v) for k, v in data["hit_rate"].items()},
            n_docs=int(data["n_docs"]),
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
