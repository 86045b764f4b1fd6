"""Small random HF models and float64 causal attention: oracles for the torch engine's tests (``transformers``;
nothing is downloaded).

Random internal weights for a shape (benchmarks, 27B on a GPU) are ``kvmem_bench.torch_weights``.
"""

from __future__ import annotations

from typing import Any

import torch

from kvmem_torch.spec import ModelSpec

TINY = {
    "llama": dict(
        model_type="llama",
        vocab_size=160,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        rms_norm_eps=1e-5,
        max_position_embeddings=4096,
        rope_theta=10000.0,
        tie_word_embeddings=False,
    ),
    "qwen2": dict(
        model_type="qwen2",
        vocab_size=160,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        rms_norm_eps=1e-6,
        max_position_embeddings=4096,
        rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
        tie_word_embeddings=True,
    ),
    "qwen35": dict(
        model_type="qwen3_5_text",
        vocab_size=160,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        rms_norm_eps=1e-6,
        max_position_embeddings=4096,
        full_attention_interval=2,
        linear_conv_kernel_dim=4,
        linear_key_head_dim=16,
        linear_value_head_dim=16,
        linear_num_key_heads=2,
        linear_num_value_heads=6,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25},
        tie_word_embeddings=False,
    ),
}


def tiny_hf_config(arch: str) -> dict[str, Any]:
    return dict(TINY[arch])


def tiny_hf_model(
    arch: str, seed: int = 0, dtype: torch.dtype = torch.float32, config: dict[str, Any] | None = None
) -> Any:
    """A randomly initialised HF ``LlamaForCausalLM`` / ``Qwen2ForCausalLM`` / ``Qwen3_5ForCausalLM`` with
    non-trivial norms, biases, dt_bias and A_log, in eval mode; ``config`` replaces the tiny config of ``arch``."""
    import transformers

    cfg = dict(config or tiny_hf_config(arch))
    model_type = cfg.pop("model_type")
    if model_type == "llama":
        config, cls = transformers.LlamaConfig(**cfg), transformers.LlamaForCausalLM
    elif model_type == "qwen2":
        config, cls = transformers.Qwen2Config(**cfg), transformers.Qwen2ForCausalLM
    else:
        config, cls = transformers.Qwen3_5TextConfig(**cfg), transformers.Qwen3_5ForCausalLM
    config._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = cls(config).eval()
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(_random_like(name, p, gen))
    return model.to(dtype)


def tiny_mtp_state(config: dict[str, Any], seed: int = 0) -> dict[str, torch.Tensor]:
    """Random weights of a qwen35 MTP layer for ``config`` (an HF ``qwen3_5_text`` dict), named as Qwen3.5
    checkpoints name them (``mtp.*``; norms store w for 1 + w, centred on 0)."""
    h, i, hd = config["hidden_size"], config["intermediate_size"], config["head_dim"]
    heads, kv = config["num_attention_heads"], config["num_key_value_heads"]
    layer = "mtp.layers.0."
    shapes = {
        "mtp.fc.weight": (h, 2 * h),
        "mtp.pre_fc_norm_embedding.weight": (h,),
        "mtp.pre_fc_norm_hidden.weight": (h,),
        "mtp.norm.weight": (h,),
        layer + "input_layernorm.weight": (h,),
        layer + "post_attention_layernorm.weight": (h,),
        layer + "self_attn.q_proj.weight": (2 * heads * hd, h),
        layer + "self_attn.k_proj.weight": (kv * hd, h),
        layer + "self_attn.v_proj.weight": (kv * hd, h),
        layer + "self_attn.o_proj.weight": (h, heads * hd),
        layer + "self_attn.q_norm.weight": (hd,),
        layer + "self_attn.k_norm.weight": (hd,),
        layer + "mlp.gate_proj.weight": (i, h),
        layer + "mlp.up_proj.weight": (i, h),
        layer + "mlp.down_proj.weight": (h, i),
    }
    gen = torch.Generator().manual_seed(seed)
    return {name: _random_like(name, torch.zeros(shape), gen) for name, shape in shapes.items()}


def _random_like(name: str, p: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
    if name.endswith("A_log"):
        return torch.empty(p.shape).uniform_(0.01, 4.0, generator=gen).log()
    if name.endswith("dt_bias"):
        return torch.empty(p.shape).uniform_(-1.0, 1.0, generator=gen)
    if "norm" in name:  # keep each norm's centre (0 for Qwen's 1+w norms, 1 otherwise), then perturb
        return p.mean() + 0.2 * torch.randn(p.shape, generator=gen)
    return 0.15 * torch.randn(p.shape, generator=gen)


def tiny_spec_weights(
    model: Any, dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu"
) -> tuple[ModelSpec, dict[str, torch.Tensor]]:
    """The internal spec and weights of an HF model object (same conversion as the safetensors path)."""
    from kvmem_torch.hf_loader import weights_from_hf
    from kvmem_torch.spec import spec_from_hf

    spec = spec_from_hf(model.config.to_dict())
    return spec, weights_from_hf(spec, model.state_dict(), dtype, device)


def random_qwen35_adapter(device: str, **opts: Any) -> Any:
    """A ``TorchAdapter`` over the ``tiny`` qwen35 shape's random weights (bf16 on CUDA, fp32 on the CPU, one CPU
    thread) with an id tokenizer; ``opts``: its view and block sizes."""
    from kvmem_bench.torch_device import qwen35_spec
    from kvmem_bench.torch_weights import random_weights
    from kvmem_torch.adapter import TorchAdapter
    from kvmem_torch.tokenizer import IdTokenizer

    torch.set_num_threads(1)
    spec = qwen35_spec("tiny")
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    weights = random_weights(spec, dtype, device, 0)
    loaded = (spec, weights, IdTokenizer(spec.vocab_size), "tiny-seed0")
    return TorchAdapter("tiny", device=device, dtype=dtype, progress=False, loaded=loaded, **opts)


def causal_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """float64 attention of q [T, heads, hd] as the last T of the keys k/v [S, kv, hd] (GQA) -> [T, heads, hd]"""
    S, T, group = k.shape[0], q.shape[0], q.shape[1] // k.shape[1]
    qd, kd, vd = (x.double().transpose(0, 1) for x in (q, k, v))
    kd, vd = kd.repeat_interleave(group, 0), vd.repeat_interleave(group, 0)
    scores = qd @ kd.transpose(-1, -2) / q.shape[-1] ** 0.5
    allowed = torch.arange(S, device=q.device)[None, :] <= torch.arange(S - T, S, device=q.device)[:, None]
    return (torch.softmax(scores.masked_fill(~allowed, float("-inf")), -1) @ vd).transpose(0, 1)
