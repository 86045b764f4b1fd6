"""Write an HF ``llama`` / ``qwen2`` / ``qwen3_5_text`` state dict as GGUF the way llama.cpp's converter does.

Used to build test models (tiny random weights, tokenizer model ``no_vocab``) that both
this engine and llama.cpp load: Llama Q/K rows permuted for interleaved RoPE (qwen2 keeps
them: llama.cpp runs it with NeoX RoPE); qwen35 V
heads tiled, ``ssm_a = -exp(A_log)``, ``+1`` on the norms that compute ``1 + w``. A qwen35 MTP layer (``mtp.*``)
becomes block N (N = the main layers' count) with its ``nextn.*`` tensors, as llama.cpp names next-token-prediction
layers (``{arch}.nextn_predict_layers`` = 1, ``block_count`` = N + 1).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Mapping

import numpy as np
import torch

from kvmem_torch.spec import ModelSpec, spec_from_hf

_GLOBAL = {
    "model.embed_tokens.weight": "token_embd.weight",
    "model.norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
}
_LAYER = {
    "input_layernorm.weight": "attn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.o_proj.weight": "attn_output.weight",
    "self_attn.q_proj.bias": "attn_q.bias",
    "self_attn.k_proj.bias": "attn_k.bias",
    "self_attn.v_proj.bias": "attn_v.bias",
    "self_attn.q_norm.weight": "attn_q_norm.weight",
    "self_attn.k_norm.weight": "attn_k_norm.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
    "linear_attn.in_proj_qkv.weight": "attn_qkv.weight",
    "linear_attn.in_proj_z.weight": "attn_gate.weight",
    "linear_attn.in_proj_b.weight": "ssm_beta.weight",
    "linear_attn.in_proj_a.weight": "ssm_alpha.weight",
    "linear_attn.out_proj.weight": "ssm_out.weight",
    "linear_attn.conv1d.weight": "ssm_conv1d.weight",
    "linear_attn.dt_bias": "ssm_dt.bias",
    "linear_attn.A_log": "ssm_a",
    "linear_attn.norm.weight": "ssm_norm.weight",
}


_NEXTN = {
    "mtp.fc.weight": "eh_proj.weight",
    "mtp.pre_fc_norm_embedding.weight": "enorm.weight",
    "mtp.pre_fc_norm_hidden.weight": "hnorm.weight",
    "mtp.norm.weight": "shared_head_norm.weight",
}


def gguf_name(spec: ModelSpec, hf_name: str) -> str:
    if hf_name in _GLOBAL:
        return _GLOBAL[hf_name]
    if hf_name in _NEXTN:
        return f"blk.{spec.n_layers}.nextn.{_NEXTN[hf_name]}"
    if hf_name.startswith("mtp.layers.0."):
        return gguf_name(spec, f"model.layers.{spec.n_layers}.{hf_name.removeprefix('mtp.layers.0.')}")
    index, _, sub = hf_name[len("model.layers.") :].partition(".")
    if spec.arch == "qwen35" and sub == "post_attention_layernorm.weight":
        return f"blk.{index}.post_attention_norm.weight"
    if sub == "post_attention_layernorm.weight":
        return f"blk.{index}.ffn_norm.weight"
    return f"blk.{index}.{_LAYER[sub]}"


def is_quantized(t: torch.Tensor, block: int = 32) -> bool:
    """Which tensors the writer stores quantized: matrices whose rows split into whole blocks."""
    return t.dim() == 2 and t.shape[-1] % block == 0


def roundtrip(t: torch.Tensor, qtype_name: str) -> torch.Tensor:
    """quantize -> dequantize along rows (what a reader of the file sees)."""
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize, quantize

    qtype = GGMLQuantizationType[qtype_name]
    return torch.from_numpy(dequantize(quantize(t.float().numpy(), qtype), qtype).copy())


def to_gguf_tensor(spec: ModelSpec, hf_name: str, t: torch.Tensor) -> torch.Tensor:
    """The converter's value transform for one tensor."""
    t = t.detach().float()
    if spec.arch == "llama" and hf_name.endswith(("q_proj.weight", "k_proj.weight")):
        n = spec.n_heads if "q_proj" in hf_name else spec.n_kv_heads
        return t.reshape(n, 2, t.shape[0] // n // 2, *t.shape[1:]).transpose(1, 2).reshape(t.shape)
    if spec.arch != "qwen35":
        return t
    if (hf_name.endswith("norm.weight") and "linear_attn" not in hf_name) or hf_name.startswith("mtp.pre_fc_norm"):
        t = t + 1.0
    if hf_name.endswith("A_log"):
        t = -t.exp()
    if "conv1d" in hf_name:
        t = t.reshape(t.shape[0], -1)
    return _tile(spec, hf_name, t) if "linear_attn" in hf_name else t


def _tile(spec: ModelSpec, hf_name: str, t: torch.Tensor) -> torch.Tensor:
    nk, r, dv = spec.linear_k_heads, spec.linear_v_heads // spec.linear_k_heads, spec.linear_v_dim
    qk = 2 * nk * spec.linear_k_dim

    def tile(x: torch.Tensor, dim: int, hd: int) -> torch.Tensor:
        shape = list(x.shape)
        return x.reshape(*shape[:dim], nk, r, hd, *shape[dim + 1 :]).transpose(dim, dim + 1).reshape(shape)

    if "in_proj_qkv" in hf_name or "conv1d" in hf_name:
        return torch.cat([t[:qk], tile(t[qk:], 0, dv)])
    if "in_proj_z" in hf_name:
        return tile(t, 0, dv)
    if "out_proj" in hf_name:
        return tile(t, 1, dv)
    if hf_name.endswith(("in_proj_a.weight", "in_proj_b.weight", "dt_bias", "A_log")):
        return tile(t, 0, 1)
    return t


def write_gguf(
    path: str | Path,
    config: Mapping[str, Any],
    state: Mapping[str, torch.Tensor],
    qtype: str = "F32",
    sentencepiece: Mapping[str, list] | None = None,
) -> ModelSpec:
    """Write a GGUF; matrices that split into 32-blocks use ``qtype``. The tokenizer is ``no_vocab`` or, with
    ``sentencepiece`` (``tokens``, ``scores``, ``types``; ids 0/1/2 = unk/BOS/EOS), a SentencePiece one."""
    import gguf

    spec = spec_from_hf(config)
    writer = gguf.GGUFWriter(str(path), spec.arch)
    _write_meta(writer, spec, mtp=any(name.startswith("mtp.") for name in state))
    if sentencepiece:
        _write_sentencepiece(writer, sentencepiece)
    else:
        writer.add_tokenizer_model("no_vocab")
    for hf_name, t in state.items():
        if hf_name == "lm_head.weight" and spec.tie_embeddings:
            continue
        data = to_gguf_tensor(spec, hf_name, t).numpy().astype(np.float32)
        if qtype != "F32" and is_quantized(torch.from_numpy(data)):
            qt = gguf.GGMLQuantizationType[qtype]
            writer.add_tensor(gguf_name(spec, hf_name), gguf.quants.quantize(data, qt), raw_dtype=qt)
        else:
            writer.add_tensor(gguf_name(spec, hf_name), data)
    if spec.rope_factors:  # as llama.cpp's converter writes llama3 scaling
        writer.add_tensor("rope_freqs.weight", np.array(spec.rope_factors, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return spec


def _write_meta(w: Any, spec: ModelSpec, mtp: bool = False) -> None:
    w.add_block_count(spec.n_layers + mtp)
    if mtp:
        w.add_nextn_predict_layers(1)
    w.add_context_length(spec.max_context)
    w.add_embedding_length(spec.hidden_size)
    w.add_feed_forward_length(spec.intermediate_size)
    w.add_head_count(spec.n_heads)
    w.add_head_count_kv(spec.n_kv_heads)
    w.add_key_length(spec.head_dim)
    w.add_value_length(spec.head_dim)
    w.add_rope_freq_base(spec.rope_theta)
    w.add_rope_dimension_count(spec.rotary_dim)
    w.add_layer_norm_rms_eps(spec.rms_eps)
    w.add_vocab_size(spec.vocab_size)
    w.add_file_type(0)
    if spec.arch == "qwen35":
        w.add_rope_dimension_sections([11, 11, 10, 0])
        w.add_full_attention_interval(spec.layer_kinds.index("attention") + 1)
        w.add_ssm_conv_kernel(spec.conv_kernel)
        w.add_ssm_state_size(spec.linear_k_dim)
        w.add_ssm_group_count(spec.linear_k_heads)
        w.add_ssm_time_step_rank(spec.linear_v_heads)
        w.add_ssm_inner_size(spec.linear_v_heads * spec.linear_v_dim)


def _write_sentencepiece(w: Any, vocab: Mapping[str, list]) -> None:
    w.add_tokenizer_model("llama")
    w.add_token_list(vocab["tokens"])
    w.add_token_scores(vocab["scores"])
    w.add_token_types(vocab["types"])
    w.add_unk_token_id(0)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_add_bos_token(True)
    w.add_add_space_prefix(True)
