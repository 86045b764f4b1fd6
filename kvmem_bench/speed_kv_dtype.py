"""8-bit KV against 16-bit: what a token of KV costs in every tier, decode and block staging at a long view (torch
engine, CUDA), and where greedy output first changes (llama.cpp engine).

``python -m kvmem_bench.speed_kv_dtype torch --shape 27b --view 32768`` (CUDA, random weights of the shape) prints
per KV dtype (``bf16``, ``fp8``) the decode rate with the view full, the host -> GPU staging rate of blocks and the
bytes a token and a block take, and fp8's decode speedup. ``sizes`` prints bytes per token and the workspace
tokens one GiB of host RAM or NVMe holds (blocks keep their bytes in every tier) for the torch bench shapes and the
default model on llama.cpp; ``diverge`` runs greedy turns of the default model with ``f16`` and ``q8_0`` KV and
prints the first step where their tokens differ.
"""

from __future__ import annotations

import argparse
import json
import time
from typing import Any

from kvmem_core.config import GIB, KVMemConfig
from kvmem_core.contract import SamplingParams, StepRequest
from kvmem_core.layout import BlockLayout

TORCH_DTYPES = {"bf16": "bfloat16", "fp8": "fp8_e4m3"}
LLAMACPP_DTYPES = {"f16": "float16", "q8_0": "q8_0"}
PROMPTS = (
    "Write a Python function that parses a CSV file and returns the rows as dictionaries.",
    "Explain what a hash map is and when to use one.",
    "Write a bash script that finds the ten largest files under a directory.",
    "Describe the history of the printing press in a few paragraphs.",
    "Write a C function that reverses a singly linked list, with comments.",
)
STAGED_BLOCKS = 64  # 128-token blocks staged at once (the view holds at least as many)
CFG = KVMemConfig(ctx=4096, budget=2048, gen_budget=512, method="full")


def sizes(layout: BlockLayout, dtypes: dict[str, str]) -> dict[str, dict[str, int]]:
    """Per KV dtype: bytes per token and per block, and the workspace tokens a GiB of host RAM or NVMe holds."""
    out = {}
    for name, dtype in dtypes.items():
        lay = BlockLayout(**{**layout.__dict__, "dtype": dtype})
        out[name] = {
            "bytes_per_token": lay.bytes_per_token,
            "block_bytes": lay.kv_bytes_per_block,
            "tokens_per_GiB": GIB // lay.kv_bytes_per_block * lay.block_tokens,
        }
    return out


def torch_layout(shape: str, block_tokens: int = 128) -> BlockLayout:
    from kvmem_bench.torch_device import qwen35_spec

    spec = qwen35_spec(shape)
    return BlockLayout(len(spec.attention_layers), spec.n_kv_heads, spec.head_dim, spec.n_heads, block_tokens)


def all_sizes() -> dict[str, Any]:
    """``sizes`` of the torch bench's shapes and of the default model on llama.cpp (64-token blocks, the default)."""
    from kvmem.models import resolve_model
    from kvmem_llamacpp import create_adapter
    from kvmem_bench.torch_device import SHAPES

    out: dict[str, Any] = {f"torch {s}": sizes(torch_layout(s), TORCH_DTYPES) for s in sorted(SHAPES)}
    adapter = create_adapter(str(resolve_model(None)), CFG, n_threads=1)
    out["llama.cpp default model"] = sizes(adapter.layout, LLAMACPP_DTYPES)
    adapter.close()
    return out


def diverge(steps: int) -> dict[str, Any]:
    """Greedy turns of ``steps`` tokens with f16 and q8_0 KV (whole prompt in the view); the first differing step."""
    from kvmem.engines import load_engine

    tokens: dict[str, list[list[int]]] = {}
    for kv_dtype in LLAMACPP_DTYPES:
        engine = load_engine("llama.cpp", None, CFG.replace(kv_dtype=kv_dtype), n_threads=1, n_threads_batch=1)
        sampling = SamplingParams(temperature=0.0, max_tokens=steps)
        tokens[kv_dtype] = [
            list(
                engine.step(
                    StepRequest(messages=({"role": "user", "content": p},), sampling=sampling), lambda piece: True
                ).token_ids
            )
            for p in PROMPTS
        ]
        engine.close()
    out = {}
    for i, (a, b) in enumerate(zip(*tokens.values())):
        same = next((j for j in range(min(len(a), len(b))) if a[j] != b[j]), min(len(a), len(b)))
        out[PROMPTS[i][:40]] = {
            "first_differing_step": same if a != b else None,
            "f16_tokens": len(a),
            "q8_0_tokens": len(b),
        }
    return out


def measure(model: Any, kv_dtype: str, view: int, steps: int) -> dict[str, float]:
    """Decode rate with ``view`` tokens in a fresh view of this KV dtype, and its block staging rate."""
    import torch

    from kvmem_bench.torch_device import decode_speed, staging
    from kvmem_torch import plain_engine

    runner = plain_engine(model, max(view, STAGED_BLOCKS * 128) + 256, 128, kv_fp8=kv_dtype == "fp8")
    out = staging(runner, STAGED_BLOCKS)
    out["staged_blocks_per_s"] = out["staged_blocks_GBps"] * 1e9 / runner.cache.block_nbytes
    sec = decode_speed(runner, view, steps)
    out |= {"decode_ms_per_token": sec * 1e3, "decode_tok_s": 1 / sec}
    del runner
    torch.cuda.empty_cache()
    return out


def speed_row(model: Any, layout: BlockLayout, view: int, steps: int) -> dict[str, Any]:
    """The torch KV dtypes of ``layout`` side by side (``sizes``); on CUDA also each one's decode and staging at
    ``view`` tokens (``measure``) and fp8's decode speedup. ``kvmem bench speed``'s ``kv_dtype`` row."""
    out: dict[str, Any] = sizes(layout, TORCH_DTYPES)
    if model.device.type == "cuda":
        for name in TORCH_DTYPES:
            out[name] |= measure(model, name, view, steps)
        out["fp8_decode_speedup"] = out["fp8"]["decode_tok_s"] / out["bf16"]["decode_tok_s"]
    return out


def torch_speed(shape: str, view: int, steps: int) -> dict[str, Any]:
    import torch

    from kvmem_bench.torch_device import qwen35_spec
    from kvmem_bench.torch_weights import random_weights
    from kvmem_torch import Model

    t = time.perf_counter()
    spec = qwen35_spec(shape)
    model = Model(spec, random_weights(spec, torch.bfloat16, "cuda"))
    build_s = time.perf_counter() - t
    out = speed_row(model, torch_layout(shape), view, steps)
    return {"shape": shape, "view": view, "build_s": build_s, "gpu": torch.cuda.get_device_name(), **out}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="what", required=True)
    run = sub.add_parser("torch", help="decode and staging, bf16 against fp8 KV (CUDA)")
    run.add_argument("--shape", default="27b")
    run.add_argument("--view", type=int, default=32768)
    run.add_argument("--steps", type=int, default=64)
    sub.add_parser("sizes", help="bytes per token and tokens per GiB, 16-bit against 8-bit KV")
    div = sub.add_parser("diverge", help="greedy f16 against q8_0 KV on the default model (llama.cpp)")
    div.add_argument("--steps", type=int, default=64)
    args = ap.parse_args()
    if args.what == "torch":
        out = torch_speed(args.shape, args.view, args.steps)
    else:
        out = all_sizes() if args.what == "sizes" else diverge(args.steps)
    print(json.dumps(out, indent=1), flush=True)


if __name__ == "__main__":
    main()
