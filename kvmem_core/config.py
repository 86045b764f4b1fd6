"""The one KVMem configuration: built once in the launcher, validated, passed down.

Every knob has a default that makes the embedded models (Qwen2.5-Coder-0.5B, SmolLM2-135M)
useful on a 2-core CPU machine; ``FIELD_HELP`` documents each one for ``--help`` and the docs.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvmem_core.errors import ConfigError
from kvmem_core.layout import BlockLayout
from kvmem_core.machine_memory import HOST_TIER_SHARE, usable_memory_bytes

METHODS = ("retrieval", "recent", "sink-recent", "full")
SCORERS = ("retrieval-heads", "mean-k", "sub-block-mean-k", "key-direction", "per-token")  # the bench's order
POSITION_MODES = ("auto", "original", "compact")
RETENTIONS = ("evict-idle", "keep-all")
RECURRENT_MODES = ("keep", "recompute")
SPECULATIVE_MODES = ("auto", "off", "lookup", "mtp")
KV_DTYPES = ("auto", "f16", "bf16", "fp8", "q8_0")
METHOD_ALIASES = {"recency": "recent"}
SCORER_ALIASES = {"key-direction-fixed4": "key-direction", "key-direction-adaptive": "key-direction"}
GIB = 1 << 30
AUTO_CTX = 0  # ``ctx``'s default: sized to the storage tier when the engine loads (``sized_to``)
AUTO_GB = 0.0  # ``cpu_gb``'s default: a share of the machine's memory (``with_host_tier``)

FIELD_HELP = {
    "ctx": "logical workspace tokens per conversation (may exceed the model's trained context in compact mode); "
    "auto: as many as the storage tier holds at the model's layout (--kvmem-cpu-gb, or --kvmem-nvme-gb with a disk "
    "tier)",
    "budget": "history tokens materialized in the view for one step",
    "gen_budget": "generation reserve in the view (reused, so an answer may be longer)",
    "block_tokens": "tokens per stored block (64: a small view then holds several selected blocks besides the sink "
    "and recent ones, and a fact that straddles two blocks costs 128 tokens, not 256)",
    "method": "view selection: " + "|".join(METHODS),
    "scorer": "retrieval scorer: " + "|".join(SCORERS),
    "sink_tokens": "first tokens always kept in the view",
    "recent_tokens": "most recent history tokens always kept in the view",
    "positions": "position mode: compact renumbers the view (auto: the default), original keeps positions",
    "cpu_gb": "host-RAM tier capacity in GiB; auto: half of the memory this machine (or its container) has, "
    "shared by the engine replicas",
    "nvme_dir": "directory of the NVMe tier (unset: no disk tier)",
    "nvme_gb": "NVMe tier capacity in GiB",
    "retention": "when storage is full: evict-idle drops whole idle workspaces oldest first, "
    "keep-all refuses new history",
    "retrieval_heads": "retrieval heads as L:H,... (overrides the calibrated profile)",
    "recurrent": "hybrid models' recurrent state when selection drops blocks: keep the full-history state, "
    "or recompute it over the selected view",
    "relevance": "retrieval takes by score only blocks scoring at least this share of the best candidate (0-1); the "
    "rest of the view goes to the newest blocks",
    "groups": "whole-message selection: a block retrieval takes brings the rest of its message (a tool call with "
    "its results, a user or an assistant turn) when that fits half the free budget (on|off)",
    "speculative": "speculative decoding of greedy steps without an output format: lookup drafts tokens from n-gram "
    "matches in the workspace's transcript, mtp from the model's own multi-token-prediction layers (torch "
    "engine, qwen35 checkpoints that carry them), and either is verified in one forward (lossless); auto: lookup "
    "where a draft's verification costs about one token's step (the torch engine on CUDA, models without recurrent "
    "layers), off elsewhere; " + "|".join(SPECULATIVE_MODES),
    "kv_dtype": "KV dtype in the view and every tier: auto (16-bit: f16 on llama.cpp, the run dtype on torch), f16, "
    "bf16 (torch), fp8 (torch: e4m3 with a scale per token and kv head), q8_0 (llama.cpp); 8-bit halves "
    "the bytes per token; " + "|".join(KV_DTYPES),
}


@dataclass(frozen=True)
class KVMemConfig:
    """KVMem's knobs; ``validate`` checks them against each other and the view size."""

    ctx: int = AUTO_CTX
    budget: int = 2048
    gen_budget: int = 512
    block_tokens: int = 64
    method: str = "retrieval"
    scorer: str = "retrieval-heads"
    sink_tokens: int = 128
    recent_tokens: int = 512
    positions: str = "auto"
    cpu_gb: float = AUTO_GB
    nvme_dir: Path | None = None
    nvme_gb: float = 32.0
    retention: str = "evict-idle"
    retrieval_heads: tuple[tuple[int, int], ...] | None = None
    recurrent: str = "keep"
    groups: bool = True
    relevance: float = 0.35
    speculative: str = "auto"
    kv_dtype: str = "auto"

    def __post_init__(self) -> None:
        object.__setattr__(self, "method", METHOD_ALIASES.get(self.method, self.method))
        object.__setattr__(self, "scorer", SCORER_ALIASES.get(self.scorer, self.scorer))
        if self.nvme_dir is not None:
            object.__setattr__(self, "nvme_dir", Path(self.nvme_dir))
        self._check_ranges()

    def _check_ranges(self) -> None:
        _require(self.method in METHODS, f"--kvmem-method must be one of {', '.join(METHODS)}, got {self.method!r}")
        _require(
            self.scorer in SCORERS, f"--kvmem-retrieval-method must be one of {', '.join(SCORERS)}, got {self.scorer!r}"
        )
        _require(self.positions in POSITION_MODES, f"--kvmem-positions must be one of {', '.join(POSITION_MODES)}")
        _require(self.retention in RETENTIONS, f"retention must be one of {', '.join(RETENTIONS)}")
        _require(self.recurrent in RECURRENT_MODES, f"--kvmem-recurrent must be one of {', '.join(RECURRENT_MODES)}")
        _require(isinstance(self.groups, bool), "--kvmem-groups must be on or off")
        _require(self.speculative in SPECULATIVE_MODES, f"--speculative must be one of {', '.join(SPECULATIVE_MODES)}")
        _require(self.kv_dtype in KV_DTYPES, f"--kv-dtype must be one of {', '.join(KV_DTYPES)}, got {self.kv_dtype!r}")
        _require(0.0 <= self.relevance <= 1.0, "--kvmem-relevance must be between 0 and 1")
        _require(self.block_tokens >= 16, "--kvmem-block-tokens must be at least 16")
        _require(self.ctx >= 0, "--ctx must be positive (or auto)")
        for name in ("budget", "gen_budget"):
            _require(getattr(self, name) > 0, f"--{_flag(name)} must be positive")
        for name in ("sink_tokens", "recent_tokens"):
            _require(getattr(self, name) >= 0, f"--kvmem-{_flag(name)} must be >= 0")
        _require(self.cpu_gb >= 0, "--kvmem-cpu-gb must be positive (or auto)")
        _require(self.nvme_gb > 0, "--kvmem-nvme-gb must be positive")
        _require(
            self.sink_tokens + self.recent_tokens + self.block_tokens <= self.budget,
            f"--kvmem-budget ({self.budget}) must hold sink ({self.sink_tokens}) + recent "
            f"({self.recent_tokens}) + one block ({self.block_tokens}) tokens",
        )

    @property
    def view_tokens(self) -> int:
        """Tokens the engine's view must hold: history budget plus generation reserve."""
        return self.budget + self.gen_budget

    def replace(self, **changes: Any) -> KVMemConfig:
        """A copy with some knobs changed, validated again."""
        return dataclasses.replace(self, **changes)

    def validate_view(self, max_view_tokens: int) -> None:
        """Raise ConfigError unless budget + gen_budget fit the engine's view."""
        _require(
            self.view_tokens <= max_view_tokens,
            f"--kvmem-budget + --kvmem-gen-budget = {self.view_tokens} tokens do not fit the "
            f"engine's view of {max_view_tokens} tokens; lower them",
        )

    def sized_to(self, layout: BlockLayout) -> KVMemConfig:
        """This config with ``cpu_gb`` (``with_host_tier``) and ``ctx`` set: an ``auto`` ``ctx`` becomes the tokens
        the storage tier holds at ``layout`` (whole blocks); ConfigError when a set one does not fit
        (``validate_capacity``)."""
        config = self.with_host_tier()
        if config.ctx != AUTO_CTX:
            config.validate_capacity(layout)
            return config
        tier = config._tier_bytes()
        blocks = int(tier // layout.kv_bytes_per_block)
        _require(blocks > 0, f"the storage tier ({tier / GIB:.2f} GiB) holds no block of this model")
        return config.replace(ctx=blocks * layout.block_tokens)

    def with_host_tier(self, replicas: int = 1) -> KVMemConfig:
        """This config with ``cpu_gb`` set: an ``auto`` one becomes ``HOST_TIER_SHARE`` of the memory this process
        may use (``usable_memory_bytes``), split evenly among ``replicas`` engine processes; a set one stays."""
        if self.cpu_gb != AUTO_GB:
            return self
        return self.replace(cpu_gb=round(HOST_TIER_SHARE * usable_memory_bytes() / replicas / GIB, 2))

    def validate_capacity(self, layout: BlockLayout) -> None:
        """Raise ConfigError unless one full workspace (``ctx``) fits the tiers at this layout."""
        need = self.ctx * layout.bytes_per_token
        have = self._tier_bytes()
        where = "--kvmem-nvme-gb" if self.nvme_dir is not None else "--kvmem-cpu-gb (or set --kvmem-nvme-dir)"
        _require(
            need <= have,
            f"--ctx {self.ctx} needs {need / GIB:.2f} GiB of KV at this model's layout "
            f"({layout.bytes_per_token} bytes/token) but the tier holds {have / GIB:.2f} GiB; raise {where}",
        )

    def _tier_bytes(self) -> float:
        return (self.nvme_gb if self.nvme_dir is not None else self.cpu_gb) * GIB

    def describe(self) -> dict[str, object]:
        """Plain dict of every knob, for logs and ``--dry-run``."""
        out = dataclasses.asdict(self)
        out["ctx"] = self.ctx or "auto"
        out["cpu_gb"] = self.cpu_gb or "auto"
        out["nvme_dir"] = str(self.nvme_dir) if self.nvme_dir else None
        return out


def check_heads(heads: tuple[tuple[int, int], ...], layout: BlockLayout) -> None:
    """ConfigError naming the (layer, query head) pairs of ``heads`` that ``layout``'s model does not have."""
    bad = [f"{l}:{h}" for l, h in heads if not (0 <= l < layout.n_layers and 0 <= h < layout.n_heads)]
    if bad:
        raise ConfigError(
            f"retrieval heads {', '.join(bad)} are outside this model ({layout.n_layers} attention "
            f"layers, {layout.n_heads} query heads)"
        )


def parse_retrieval_heads(text: str) -> tuple[tuple[int, int], ...]:
    """Parse ``L:H,L:H`` (layer : query head) into pairs; ConfigError on bad syntax."""
    pairs = []
    for item in filter(None, (s.strip() for s in text.split(","))):
        layer, sep, head = item.partition(":")
        _require(
            sep == ":" and layer.isdigit() and head.isdigit(), f"--kvmem-retrieval-heads: bad item {item!r}, want L:H"
        )
        pairs.append((int(layer), int(head)))
    _require(bool(pairs), "--kvmem-retrieval-heads needs at least one L:H pair")
    return tuple(pairs)


def _flag(name: str) -> str:
    return "ctx" if name == "ctx" else "kvmem-" + name.replace("_", "-")


def _require(ok: bool, message: str) -> None:
    if not ok:
        raise ConfigError(message)
