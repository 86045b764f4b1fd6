"""8-bit KV against 16-bit on the torch engine at a model shape with random weights: decode at a long view, block
staging, and what a token of KV costs in every tier.

``python -m kvmem_torch.speed_kv_dtype --shape 27b --view 32768`` (CUDA) prints one JSON object: per KV dtype
(``bf16``, ``fp8``) the decode rate at the view, the host -> GPU staging rate of blocks, the bytes a token and a
block take (the same in the view, host RAM and NVMe: blocks move as their bytes), and fp8's decode speedup.
``--sizes-only`` prints the byte counts of the bench's shapes without a GPU.
"""
from __future__ import annotations

import argparse
import json
import time

import torch

from kvmem_core.layout import BlockLayout
from kvmem_torch.bench import SHAPES, decode_speed, qwen35_spec, staging
from kvmem_torch.model import Model
from kvmem_torch.runner import Runner
from kvmem_torch.tiny import random_weights

KV_DTYPES = {"bf16": "bfloat16", "fp8": "fp8_e4m3"}
GIB = 1 << 30


def tier_sizes(shape: str, block_tokens: int = 128) -> dict[str, dict[str, float]]:
    """Per KV dtype: bytes per token and per block, and the workspace tokens one GiB of host RAM or NVMe holds."""
    spec = qwen35_spec(shape)
    out = {}
    for name, dtype in KV_DTYPES.items():
        layout = BlockLayout(len(spec.attention_layers), spec.n_kv_heads, spec.head_dim, spec.n_heads, block_tokens,
                             dtype)
        out[name] = {"bytes_per_token": layout.bytes_per_token, "block_bytes": layout.kv_bytes_per_block,
                     "tokens_per_GiB": GIB // layout.kv_bytes_per_block * block_tokens}
    return out


def measure(model: Model, kv_dtype: str, view: int, steps: int) -> dict[str, float]:
    """Decode rate at ``view`` tokens and staging rate, for a fresh view of this KV dtype."""
    runner = Runner(model, view // 128 + 4, 128, kv_fp8=kv_dtype == "fp8")
    out = staging(runner, 64)
    out["staged_blocks_per_s"] = out["staged_blocks_GBps"] * 1e9 / runner.cache.block_nbytes
    sec = decode_speed(runner, view, steps)
    out |= {"decode_ms_per_token": sec * 1e3, "decode_tok_s": 1 / sec}
    del runner
    torch.cuda.empty_cache()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", default="27b", choices=sorted(SHAPES))
    ap.add_argument("--view", type=int, default=32768)
    ap.add_argument("--steps", type=int, default=64)
    ap.add_argument("--sizes-only", action="store_true", help="byte counts of every shape, no GPU")
    args = ap.parse_args()
    if args.sizes_only:
        print(json.dumps({shape: tier_sizes(shape) for shape in sorted(SHAPES)}, indent=1))
        return
    t = time.perf_counter()
    spec = qwen35_spec(args.shape)
    model = Model(spec, random_weights(spec, torch.bfloat16, "cuda"))
    out: dict[str, object] = {"shape": args.shape, "view": args.view, "build_s": time.perf_counter() - t,
                              "gpu": torch.cuda.get_device_name()}
    sizes = tier_sizes(args.shape)
    for name in KV_DTYPES:
        out[name] = sizes[name] | measure(model, name, args.view, args.steps)
    out["fp8_decode_speedup"] = out["fp8"]["decode_tok_s"] / out["bf16"]["decode_tok_s"]
    print(json.dumps(out, indent=1), flush=True)


if __name__ == "__main__":
    main()
