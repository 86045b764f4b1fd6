"""HF checkpoints (``llama``, ``qwen2``, ``qwen3_5_text``, the ``qwen3_5`` wrapper's language part) to the internal
layout."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Mapping

import torch
from tqdm import tqdm

from kvmem_core.errors import ModelNotFoundError
from kvmem_torch.spec import ModelSpec, spec_from_hf

_LAYER_NAMES = {
    "input_layernorm.weight": "attn_norm",
    "post_attention_layernorm.weight": "mlp_norm",
    "self_attn.q_proj.weight": "q",
    "self_attn.k_proj.weight": "k",
    "self_attn.v_proj.weight": "v",
    "self_attn.o_proj.weight": "o",
    "self_attn.q_proj.bias": "q_bias",
    "self_attn.k_proj.bias": "k_bias",
    "self_attn.v_proj.bias": "v_bias",
    "self_attn.q_norm.weight": "q_norm",
    "self_attn.k_norm.weight": "k_norm",
    "mlp.gate_proj.weight": "gate",
    "mlp.up_proj.weight": "up",
    "mlp.down_proj.weight": "down",
    "linear_attn.in_proj_qkv.weight": "qkv",
    "linear_attn.in_proj_z.weight": "z",
    "linear_attn.in_proj_b.weight": "b",
    "linear_attn.in_proj_a.weight": "a",
    "linear_attn.out_proj.weight": "out",
    "linear_attn.conv1d.weight": "conv",
    "linear_attn.dt_bias": "dt_bias",
    "linear_attn.A_log": "ssm_a",
    "linear_attn.norm.weight": "ssm_norm",
}
_GLOBAL_NAMES = {"embed_tokens.weight": "embed", "norm.weight": "norm"}
_PREFIXES = ("model.language_model.", "model.")
_MTP_NAMES = {  # qwen35's MTP layer (``kvmem_torch.mtp``); its decoder layer's tensors are named as the main ones
    "mtp.fc.weight": "mtp.fc",
    "mtp.pre_fc_norm_embedding.weight": "mtp.enorm",
    "mtp.pre_fc_norm_hidden.weight": "mtp.hnorm",
    "mtp.norm.weight": "mtp.norm",
}
_OFFSET_NORMS = {"attn_norm", "mlp_norm", "q_norm", "k_norm", "norm", "enorm", "hnorm"}  # qwen35: w stored, 1+w used


def _mtp_name(hf_name: str) -> str | None:
    """Internal name of an MTP tensor (the first MTP layer only: qwen35 checkpoints carry one)."""
    if hf_name in _MTP_NAMES:
        return _MTP_NAMES[hf_name]
    sub = hf_name.removeprefix("mtp.layers.0.")
    return f"mtp.layers.0.{_LAYER_NAMES[sub]}" if sub != hf_name and sub in _LAYER_NAMES else None


def internal_name(hf_name: str) -> str | None:
    """Internal name of an HF tensor, or None for tensors the engine does not use (vision, MTP layers past the
    first)."""
    if hf_name == "lm_head.weight":
        return "lm_head"
    if hf_name.startswith("mtp."):
        return _mtp_name(hf_name)
    for prefix in _PREFIXES:
        if hf_name.startswith(prefix):
            rest = hf_name[len(prefix) :]
            if rest in _GLOBAL_NAMES:
                return _GLOBAL_NAMES[rest]
            if rest.startswith("layers."):
                index, _, sub = rest[len("layers.") :].partition(".")
                return f"layers.{index}.{_LAYER_NAMES[sub]}" if sub in _LAYER_NAMES else None
    return None


def convert_tensor(spec: ModelSpec, name: str, t: torch.Tensor) -> torch.Tensor:
    """HF value -> internal value: qwen35 norms get +1, A_log becomes -exp(A_log), conv loses its middle dim."""
    leaf = name.rsplit(".", 1)[-1]
    if spec.arch == "qwen35" and leaf in _OFFSET_NORMS:
        return t.float() + 1.0
    if leaf == "ssm_a":
        return -t.float().exp()
    if leaf == "conv":
        return t.reshape(t.shape[0], -1)
    return t


def weights_from_hf(
    spec: ModelSpec, tensors: Mapping[str, torch.Tensor], dtype: torch.dtype, device: torch.device | str = "cpu"
) -> dict[str, torch.Tensor]:
    """Convert an HF state dict (name -> tensor) to internal weights in ``dtype`` on ``device``."""
    out = {}
    for hf_name in tensors:
        name = internal_name(hf_name)
        if name is None or (name.startswith("layers.") and int(name.split(".")[1]) >= spec.n_layers):
            continue
        out[name] = _place(name, convert_tensor(spec, name, tensors[hf_name]), dtype, device)
    if spec.tie_embeddings:
        out.pop("lm_head", None)
    return out


def _place(name: str, t: torch.Tensor, dtype: torch.dtype, device: torch.device | str) -> torch.Tensor:
    """Matrices go to the run dtype; DeltaNet's per-head scalars stay fp32 (they feed exp/softplus)."""
    keep_fp32 = name.endswith(("ssm_a", "dt_bias"))
    return t.to(device=device, dtype=torch.float32 if keep_fp32 else dtype).contiguous()


def load_hf_dir(
    path: str | Path, dtype: torch.dtype, device: torch.device | str = "cpu", progress: bool = True
) -> tuple[ModelSpec, dict[str, torch.Tensor]]:
    """Load ``config.json`` + ``*.safetensors`` of an HF model directory."""
    from safetensors import safe_open

    path = Path(path)
    if not (path / "config.json").is_file():
        raise ModelNotFoundError(f"{path} has no config.json")
    spec = spec_from_hf(json.loads((path / "config.json").read_text()))
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ModelNotFoundError(f"{path} has no *.safetensors files")
    out: dict[str, torch.Tensor] = {}
    for file in tqdm(files, desc="loading weights", disable=not progress, unit="file"):
        with safe_open(str(file), framework="pt") as f:
            out.update(weights_from_hf(spec, _LazyFile(f), dtype, device))
    if spec.tie_embeddings:
        out.pop("lm_head", None)
    return spec, out


class _LazyFile(Mapping[str, torch.Tensor]):
    """A safetensors file as a mapping that reads each tensor only when asked."""

    def __init__(self, handle) -> None:  # noqa: ANN001 - safetensors handle has no public type
        self.handle = handle
        self.names = list(handle.keys())

    def __getitem__(self, name: str) -> torch.Tensor:
        return self.handle.get_tensor(name)

    def __iter__(self):  # noqa: ANN204
        return iter(self.names)

    def __len__(self) -> int:
        return len(self.names)
