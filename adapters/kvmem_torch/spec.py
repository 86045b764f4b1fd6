"""Model shape shared by every architecture, read from an HF config or GGUF metadata.

One internal weight layout serves ``llama``, ``qwen2`` and ``qwen35``: tensors are named per layer
(``layers.{i}.q`` ...) in HF orientation ([out, in]), RMSNorm weights are stored as the
effective multiplier (Qwen's ``1 + w`` already applied), DeltaNet V heads are grouped by
key head (HF order) and ``ssm_a`` holds ``-exp(A_log)``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Mapping

from kvmem_core.errors import UnsupportedModelError
from kvmem_core.gguf_file import gguf_rope_factors

ARCHS = ("llama", "qwen2", "qwen35")
ATTENTION, DELTANET = "attention", "deltanet"


@dataclass(frozen=True)
class ModelSpec:
    """Everything the forward pass needs to know about a model's shape."""

    arch: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    rotary_dim: int
    rope_theta: float
    rms_eps: float
    layer_kinds: tuple[str, ...]
    max_context: int = 8192
    tie_embeddings: bool = False
    linear_k_heads: int = 0
    linear_v_heads: int = 0
    linear_k_dim: int = 0
    linear_v_dim: int = 0
    conv_kernel: int = 4
    rope_factors: tuple[float, ...] = ()  # per rotary frequency, divides it (rope scaling); () = none

    def __post_init__(self) -> None:
        if self.arch not in ARCHS:
            raise UnsupportedModelError(f"architecture {self.arch!r} is not supported (have: {', '.join(ARCHS)})")
        assert set(self.layer_kinds) <= {ATTENTION, DELTANET}
        assert self.n_heads % self.n_kv_heads == 0 and self.rotary_dim <= self.head_dim
        assert len(self.rope_factors) in (0, self.rotary_dim // 2)

    @property
    def n_layers(self) -> int:
        return len(self.layer_kinds)

    @property
    def gated_attention(self) -> bool:
        """qwen35 attention: a double-width q projection carries a sigmoid output gate; q/k norms."""
        return self.arch == "qwen35"

    @property
    def attention_layers(self) -> tuple[int, ...]:
        return tuple(i for i, kind in enumerate(self.layer_kinds) if kind == ATTENTION)

    @property
    def deltanet_layers(self) -> tuple[int, ...]:
        return tuple(i for i, kind in enumerate(self.layer_kinds) if kind == DELTANET)

    @property
    def conv_dim(self) -> int:
        return 2 * self.linear_k_heads * self.linear_k_dim + self.linear_v_heads * self.linear_v_dim


def qwen35_kinds(n_layers: int, interval: int) -> tuple[str, ...]:
    """Every ``interval``-th layer is full attention, the others Gated DeltaNet."""
    return tuple(ATTENTION if (i + 1) % interval == 0 else DELTANET for i in range(n_layers))


def spec_from_hf(config: Mapping[str, Any]) -> ModelSpec:
    """Build a spec from an HF ``config.json`` dict (``llama``, ``qwen2``, ``qwen3_5_text`` or the ``qwen3_5``
    wrapper)."""
    model_type = config.get("model_type")
    if model_type == "qwen3_5":
        config = dict(config["text_config"], tie_word_embeddings=config.get("tie_word_embeddings", False))
        model_type = "qwen3_5_text"
    if model_type in ("llama", "qwen2"):
        return _llama_from_hf(config, model_type)
    if model_type == "qwen3_5_text":
        return _qwen35_from_hf(config)
    raise UnsupportedModelError(
        f"HF model_type {model_type!r} is not supported (have: llama, qwen2, qwen3_5_text, qwen3_5)"
    )


def _rope(config: Mapping[str, Any]) -> Mapping[str, Any]:
    return config.get("rope_parameters") or config.get("rope_scaling") or {}


def hf_rope_factors(rope: Mapping[str, Any], rotary_dim: int, theta: float) -> tuple[float, ...]:
    """Per-frequency divisors of an HF rope config: ``linear`` (all ``factor``), ``llama3`` (low frequencies
    divided by ``factor``, high ones kept, a smooth ramp between), ``default`` (none)."""
    kind = rope.get("rope_type", rope.get("type", "default"))
    if kind == "default":
        return ()
    if kind == "linear":
        return (float(rope["factor"]),) * (rotary_dim // 2)
    if kind != "llama3":
        raise UnsupportedModelError(f"rope type {kind!r} is not supported (have: default, linear, llama3)")
    factor, low, high = float(rope["factor"]), float(rope["low_freq_factor"]), float(rope["high_freq_factor"])
    old = float(rope["original_max_position_embeddings"])
    out = []
    for i in range(0, rotary_dim, 2):
        wavelen = 2 * math.pi * theta ** (i / rotary_dim)
        if wavelen < old / high:
            out.append(1.0)
        elif wavelen > old / low:
            out.append(factor)
        else:
            smooth = (old / wavelen - low) / (high - low)
            out.append(1.0 / ((1 - smooth) / factor + smooth))
    return tuple(out)


def _llama_from_hf(c: Mapping[str, Any], arch: str) -> ModelSpec:
    """``llama`` and ``qwen2``: full attention in every layer, rotate-half RoPE (qwen2 adds q/k/v biases)."""
    if c.get("use_sliding_window"):
        raise UnsupportedModelError("sliding-window attention (use_sliding_window) is not supported")
    head_dim = c.get("head_dim") or c["hidden_size"] // c["num_attention_heads"]
    rope = _rope(c)
    theta = float(rope.get("rope_theta", c.get("rope_theta", 10000.0)))
    return ModelSpec(
        arch=arch,
        vocab_size=c["vocab_size"],
        hidden_size=c["hidden_size"],
        intermediate_size=c["intermediate_size"],
        n_heads=c["num_attention_heads"],
        n_kv_heads=c.get("num_key_value_heads") or c["num_attention_heads"],
        head_dim=head_dim,
        rotary_dim=head_dim,
        rope_theta=theta,
        rope_factors=hf_rope_factors(rope, head_dim, theta),
        rms_eps=c.get("rms_norm_eps", 1e-5),
        layer_kinds=(ATTENTION,) * c["num_hidden_layers"],
        max_context=c.get("max_position_embeddings", 8192),
        tie_embeddings=c.get("tie_word_embeddings", False),
    )


def _qwen35_from_hf(c: Mapping[str, Any]) -> ModelSpec:
    rope = _rope(c)
    head_dim = c.get("head_dim", 256)
    rotary_dim = int(head_dim * rope.get("partial_rotary_factor", c.get("partial_rotary_factor", 0.25)))
    theta = float(rope.get("rope_theta", 10000.0))
    kinds = c.get("layer_types")
    if kinds:
        kinds = tuple(ATTENTION if k == "full_attention" else DELTANET for k in kinds)
    else:
        kinds = qwen35_kinds(c["num_hidden_layers"], c.get("full_attention_interval", 4))
    return ModelSpec(
        arch="qwen35",
        vocab_size=c["vocab_size"],
        hidden_size=c["hidden_size"],
        intermediate_size=c["intermediate_size"],
        n_heads=c["num_attention_heads"],
        n_kv_heads=c["num_key_value_heads"],
        head_dim=head_dim,
        rotary_dim=rotary_dim,
        rope_theta=theta,
        rope_factors=hf_rope_factors(rope, rotary_dim, theta),
        rms_eps=c.get("rms_norm_eps", 1e-6),
        layer_kinds=kinds,
        max_context=c.get("max_position_embeddings", 32768),
        tie_embeddings=c.get("tie_word_embeddings", False),
        linear_k_heads=c["linear_num_key_heads"],
        linear_v_heads=c["linear_num_value_heads"],
        linear_k_dim=c["linear_key_head_dim"],
        linear_v_dim=c["linear_value_head_dim"],
        conv_kernel=c.get("linear_conv_kernel_dim", 4),
    )


def spec_from_gguf(
    meta: Mapping[str, Any], vocab_size: int, has_output: bool, rope_freqs: list[float] | None = None
) -> ModelSpec:
    """Build a spec from GGUF key/values (``{arch}.*`` keys) and the ``rope_freqs`` tensor if the file has
    one; MTP layers are not counted."""
    arch = meta["general.architecture"]
    if arch not in ARCHS:
        raise UnsupportedModelError(f"GGUF architecture {arch!r} is not supported (have: {', '.join(ARCHS)})")
    key = lambda name, default=None: meta.get(f"{arch}.{name}", default)  # noqa: E731
    n_layers = key("block_count") - key("nextn_predict_layers", 0)
    n_heads = key("attention.head_count")
    head_dim = key("attention.key_length") or key("embedding_length") // n_heads
    rotary_dim = key("rope.dimension_count") or head_dim
    common = dict(
        arch=arch,
        vocab_size=vocab_size,
        hidden_size=key("embedding_length"),
        intermediate_size=key("feed_forward_length"),
        n_heads=n_heads,
        n_kv_heads=key("attention.head_count_kv") or n_heads,
        head_dim=head_dim,
        rotary_dim=rotary_dim,
        rope_theta=float(key("rope.freq_base", 10000.0)),
        rope_factors=gguf_rope_factors(meta, arch, rotary_dim, rope_freqs),
        rms_eps=float(key("attention.layer_norm_rms_epsilon", 1e-6)),
        max_context=key("context_length", 8192),
        tie_embeddings=not has_output,
    )
    if arch in ("llama", "qwen2"):
        return ModelSpec(layer_kinds=(ATTENTION,) * n_layers, **common)
    n_v_heads = key("ssm.time_step_rank")
    return ModelSpec(
        layer_kinds=qwen35_kinds(n_layers, key("full_attention_interval", 4)),
        linear_k_heads=key("ssm.group_count"),
        linear_v_heads=n_v_heads,
        linear_k_dim=key("ssm.state_size"),
        linear_v_dim=key("ssm.inner_size") // n_v_heads,
        conv_kernel=key("ssm.conv_kernel"),
        **common,
    )
