"""Device benchmark of the torch engine on a random-weight model (no checkpoint needed).

``python -m kvmem_bench.torch_device --shape 27b --views 4096,32768`` prints one JSON object:
the bandwidths measured in the same run (HBM copy, pinned host->device, staged block
writes) and decode speed next to the bandwidth floor of the bytes each step reads; prefill
from empty at several sizes next to its compute floor (its FLOPs at the bf16 GEMM rate
measured in the same run), flash attention alone (``prefill_N``), and where cuDNN's prefill attention runs, the
same prefills with the long forwards' attention through it as ``TorchAdapter`` runs them (``prefill_N_cudnn``,
``Model.use_cudnn_prefill``); one layer's attention for a ``--chunk`` of queries at the end of each prefill size, by
kernel (``attention_N``: rate and first call).
``random_adapter`` puts the same random weights behind a ``TorchAdapter`` with a real
tokenizer and chat template, for ``kvmem bench speed --backend torch`` through ``KVMemEngine``.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any, Callable

import torch

from kvmem_bench.torch_weights import random_mtp_weights, random_weights
from kvmem_core.gguf_file import GGUFFile
from kvmem_torch import (
    BlockStager,
    Model,
    ModelSpec,
    TorchAdapter,
    from_gguf_meta,
    plain_engine,
    prefill_attention_kernels,
    prefill_chunk_for,
    qwen35_kinds,
    quantize_fp8,
    set_dependent_launch,
)


SHAPES = {
    "27b": dict(
        hidden_size=5120,
        intermediate_size=17408,
        n_heads=24,
        n_kv_heads=4,
        n_layers=64,
        linear_k_heads=16,
        linear_v_heads=48,
    ),
    "9b": dict(
        hidden_size=4096,
        intermediate_size=12288,
        n_heads=16,
        n_kv_heads=4,
        n_layers=32,
        linear_k_heads=16,
        linear_v_heads=32,
    ),
    "small": dict(
        hidden_size=1024,
        intermediate_size=3072,
        n_heads=8,
        n_kv_heads=2,
        n_layers=8,
        linear_k_heads=8,
        linear_v_heads=16,
    ),
    "tiny": dict(
        hidden_size=256,
        intermediate_size=512,
        n_heads=4,
        n_kv_heads=2,
        n_layers=4,
        linear_k_heads=2,
        linear_v_heads=4,
        vocab_size=4096,
    ),
}
GB = 1e9


def qwen35_spec(shape: str, min_vocab: int = 0) -> ModelSpec:
    """The qwen35 spec of ``shape``, its vocabulary widened to at least ``min_vocab`` tokens."""
    s = dict(SHAPES[shape])
    n_layers = s.pop("n_layers")
    s["vocab_size"] = max(s.get("vocab_size", 248320), min_vocab)
    return ModelSpec(
        arch="qwen35",
        head_dim=256,
        rotary_dim=64,
        rope_theta=1e7,
        rms_eps=1e-6,
        layer_kinds=qwen35_kinds(n_layers, 4),
        max_context=262144,
        linear_k_dim=128,
        linear_v_dim=128,
        conv_kernel=4,
        **s,
    )


def random_adapter(
    shape: str, tokenizer_gguf: str | Path, *, device: str, seed: int = 0, mtp: bool = False, **opts: Any
) -> TorchAdapter:
    """A ``TorchAdapter`` (``opts``: its view and block sizes, threads) over random qwen35 weights of ``shape``
    (bf16 on CUDA, fp32 on the CPU) with the tokenizer and chat template of ``tokenizer_gguf``; ``mtp``: with a
    random MTP layer. The vocabulary
    is the larger of the shape's and the tokenizer's. The LM-head rows of end-of-generation tokens are zero:
    their logit 0 loses to the largest of the other random logits, so greedy steps decode to ``max_tokens``."""
    f = GGUFFile(tokenizer_gguf)
    tokenizer = from_gguf_meta(f.meta)
    f.close()
    spec = qwen35_spec(shape, tokenizer.vocab_size)
    dtype = torch.bfloat16 if device.startswith("cuda") else torch.float32
    weights = random_weights(spec, dtype, device, seed)
    if mtp:
        weights |= random_mtp_weights(spec, dtype, device, seed + 1)
    weights["lm_head"][sorted(tokenizer.eog_ids)] = 0
    name = f"random-qwen35-{shape}"
    return TorchAdapter(
        name,
        device=device,
        dtype=dtype,
        progress=False,
        loaded=(spec, weights, tokenizer, f"{name}-seed{seed}"),
        **opts,
    )


def weight_bytes(model: Model) -> int:
    """Bytes a decode step reads of the weights: every layer's matrices and the LM head (not the embedding)."""
    return sum(w.nbytes for _, _, ws in model.layers for w in ws.values()) + model.lm_head.nbytes


def timed(fn: Callable[[], object], repeat: int) -> float:
    """Seconds per call (CUDA events, after one warm-up call)."""
    fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(repeat):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / 1e3 / repeat


def bandwidths(block_bytes: int) -> dict[str, float]:
    """HBM copy (read + write counted), pinned host->device, and block-sized pinned copies, in GB/s."""
    n = 1 << 30
    a, b = torch.empty(n, dtype=torch.uint8, device="cuda"), torch.empty(n, dtype=torch.uint8, device="cuda")
    hbm = 2 * n / timed(lambda: b.copy_(a), 10) / GB
    host = torch.empty(n, dtype=torch.uint8, pin_memory=True)
    h2d = n / timed(lambda: a.copy_(host, non_blocking=True), 5) / GB
    k = n // block_bytes

    def blocks() -> None:
        for i in range(k):
            part = slice(i * block_bytes, (i + 1) * block_bytes)
            a[part].copy_(host[part], non_blocking=True)

    return {
        "hbm_copy_GBps": hbm,
        "pinned_h2d_GBps": h2d,
        "pinned_block_copies_GBps": k * block_bytes / timed(blocks, 3) / GB,
    }


def gemm_tflops(n: int = 8192) -> float:
    """bf16 matmul throughput of this GPU (an n×n×n product), TFLOP/s: the compute floor's rate."""
    a, b = (torch.randn(n, n, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    return 2 * n**3 / timed(lambda: a @ b, 10) / 1e12


def attention_rates(spec: ModelSpec, n_keys: int, n_queries: int = 4096) -> dict[str, float]:
    """One layer's prefill attention, ``n_queries`` new tokens after ``n_keys - n_queries`` keys of the shape's
    heads, by kernel (``prefill_attention_kernels``): TFLOP/s, and the first call's ms (cuDNN builds per shape)."""
    q = torch.randn(n_queries, spec.n_heads, spec.head_dim, device="cuda", dtype=torch.bfloat16)
    keys, values = (torch.randn(n_keys, spec.n_kv_heads, spec.head_dim, device="cuda", dtype=q.dtype) for _ in "kv")
    flops = 4 * spec.n_heads * spec.head_dim * n_queries * (n_keys - n_queries + (n_queries + 1) / 2)
    rates = {}
    for name, kernel in prefill_attention_kernels(q.dtype, spec.head_dim, q.device).items():
        torch.cuda.synchronize()
        t = time.perf_counter()
        kernel(q, keys, values)
        torch.cuda.synchronize()
        rates[f"{name}_first_call_ms"] = (time.perf_counter() - t) * 1e3
        rates[f"{name}_TFLOPs"] = flops / timed(lambda: kernel(q, keys, values), 5) / 1e12
    return rates


def prefill_flops(model: Model, n_tokens: int) -> float:
    """FLOPs of prefilling ``n_tokens`` from empty: each token through every layer matrix, plus causal
    attention (QK and PV over the keys before it). The LM head runs for the last token only."""
    s = model.spec
    params = sum(w.numel() for _, _, ws in model.layers for w in ws.values() if w.dim() == 2)
    attention = 4 * s.n_heads * s.head_dim * n_tokens * (n_tokens + 1) / 2 * len(s.attention_layers)
    return 2 * params * n_tokens + attention


def prefill_speed(runner: Any, n_tokens: int, chunk: int, tflops: float) -> dict[str, float]:
    """Prefill ``n_tokens`` random ids from empty in ``chunk``-token forwards, against the compute floor. Two
    chunks first, untimed: the first forwards of a shape compile and autotune Triton kernels."""
    ids = torch.randint(0, runner.model.spec.vocab_size, (n_tokens,)).tolist()
    runner.clear()
    runner.prefill(ids[: 2 * chunk], list(range(min(n_tokens, 2 * chunk))), chunk=chunk)
    runner.clear()
    torch.cuda.synchronize()
    t = time.perf_counter()
    runner.prefill(ids, list(range(n_tokens)), chunk=chunk)
    torch.cuda.synchronize()
    sec = time.perf_counter() - t
    runner.clear()
    floor = prefill_flops(runner.model, n_tokens) / (tflops * 1e12)
    return {"s": sec, "tok_s": n_tokens / sec, "floor_s": floor, "fraction_of_floor": floor / sec}


def staging(runner: Any, n_blocks: int) -> dict[str, float]:
    """Blocks inserted through the stager from pageable host tensors (host memcpy included), GB/s."""
    cache, stager = runner.cache, BlockStager(runner.cache)
    k = torch.randn(cache.kv.shape[2:], dtype=torch.float32).to(cache.kv.dtype)
    v = k.clone()
    B = cache.block_tokens

    def run() -> None:
        runner.clear()
        stager.put(runner, [(k, v, range(i * B, (i + 1) * B)) for i in range(n_blocks)])
        stager.wait()

    sec = timed(run, 2)
    runner.clear()
    return {"staged_blocks_GBps": n_blocks * cache.block_nbytes / sec / GB, "block_MiB": cache.block_nbytes / 2**20}


def fill_view(runner: Any, n_tokens: int) -> None:
    """Synthesize a view of random KV blocks (what KVMem materializes) at positions 0..n-1."""
    cache, B = runner.cache, runner.B
    runner.clear()
    shape = (cache.n_layers, B, cache.rows.shape[1], cache.head_dim)
    for i in range(n_tokens // B):
        k = torch.randn(shape, device="cuda", dtype=cache.dtype)
        k = quantize_fp8(k) if cache.fp8 else k
        runner.insert_block(k, k, list(range(i * B, (i + 1) * B)))


def decode_speed(runner: Any, n_tokens: int, steps: int) -> float:
    """Seconds per decoded token with ``n_tokens`` in the view (graphs as configured)."""
    fill_view(runner, n_tokens)
    pos = [n_tokens]

    def step() -> None:
        runner.forward([1], [pos[0]])
        pos[0] += 1

    step()
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(steps):
        step()
    torch.cuda.synchronize()
    return (time.perf_counter() - t) / steps


def hf_decode_ms(spec: ModelSpec, prompt: int = 512, new: int = 16) -> float:
    """ms per generated token of HF transformers ``generate`` on the same shape (random bf16 weights)."""
    import transformers

    config = transformers.Qwen3_5TextConfig(
        vocab_size=spec.vocab_size,
        hidden_size=spec.hidden_size,
        intermediate_size=spec.intermediate_size,
        num_hidden_layers=spec.n_layers,
        num_attention_heads=spec.n_heads,
        num_key_value_heads=spec.n_kv_heads,
        head_dim=spec.head_dim,
        linear_num_key_heads=spec.linear_k_heads,
        linear_num_value_heads=spec.linear_v_heads,
        linear_key_head_dim=spec.linear_k_dim,
        linear_value_head_dim=spec.linear_v_dim,
    )
    torch.set_default_dtype(torch.bfloat16)
    with torch.device("cuda"):
        hf = transformers.Qwen3_5ForCausalLM(config).eval()
    torch.set_default_dtype(torch.float32)
    ids = torch.randint(0, spec.vocab_size, (1, prompt), device="cuda")

    def generate(n: int) -> float:
        torch.cuda.synchronize()
        t = time.perf_counter()
        hf.generate(ids, max_new_tokens=n, min_new_tokens=n, do_sample=False)
        torch.cuda.synchronize()
        return time.perf_counter() - t

    generate(2)  # warm-up
    one, many = generate(1), generate(new + 1)
    return (many - one) / new * 1e3


def profile(runner: Any, n_view: int, chunk: int, at: int) -> str:
    """Top CUDA kernels of 3 eager decode steps (view ``n_view``) and of one eager ``chunk``-token prefill forward
    after ``at`` tokens of random KV (``at`` rounded down to whole blocks)."""
    from torch.profiler import ProfilerActivity, profile as prof

    graphs, runner.use_graphs = runner.use_graphs, False
    fill_view(runner, n_view)
    with prof(activities=[ProfilerActivity.CUDA]) as p:
        for i in range(3):
            runner.forward([1], [n_view + i])
        torch.cuda.synchronize()
    decode = p.key_averages().table(sort_by="cuda_time_total", row_limit=14)
    at = at // runner.B * runner.B
    fill_view(runner, at)
    with prof(activities=[ProfilerActivity.CUDA]) as p:
        runner.forward([1] * chunk, list(range(at, at + chunk)))
        torch.cuda.synchronize()
    runner.use_graphs = graphs
    runner.clear()
    return (
        "decode x3\n"
        + decode
        + f"\nprefill chunk {chunk} at {at}\n"
        + p.key_averages().table(sort_by="cuda_time_total", row_limit=20)
    )


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="27b", choices=sorted(SHAPES))
    ap.add_argument("--views", default="4096,32768")
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--prefill", default="8192,16384,32768,65536", help="prefill sizes from empty (tokens)")
    ap.add_argument("--chunk", type=int, default=prefill_chunk_for("cuda"), help="tokens per prefill forward")
    ap.add_argument("--chunks", default="", help="also prefill --chunk-at tokens with each of these chunk sizes")
    ap.add_argument("--chunk-at", type=int, default=32768)
    ap.add_argument("--profile", help="write a kernel profile to this file")
    ap.add_argument("--profile-at", type=int, help="the profiled prefill forward's position (default: --chunk)")
    ap.add_argument("--hf", action="store_true", help="also time HF transformers generate on the same shape")
    args = ap.parse_args()
    spec, views = qwen35_spec(args.shape), [int(v) for v in args.views.split(",")]
    t = time.perf_counter()
    model = Model(spec, random_weights(spec, torch.bfloat16, "cuda"))
    weights = weight_bytes(model)
    out: dict[str, object] = {"shape": args.shape, "weights_GB": weights / GB, "build_s": time.perf_counter() - t}
    longest = max(
        [*views, *(int(p) for p in args.prefill.split(",")), args.chunk_at, (args.profile_at or 0) + args.chunk]
    )
    runner = plain_engine(model, (longest // 128 + 2) * 128, 128)
    out |= bandwidths(runner.cache.block_nbytes) | staging(runner, 64)
    kv_per_token = runner.cache.block_nbytes / 128
    for n in views:
        sec = decode_speed(runner, n, args.steps)
        floor = (weights + n * kv_per_token) / (out["hbm_copy_GBps"] * GB)  # bytes a step must read
        out[f"decode_{n}"] = {
            "ms_per_token": sec * 1e3,
            "tok_s": 1 / sec,
            "floor_ms": floor * 1e3,
            "fraction_of_floor": floor / sec,
        }
    model.use_kernels(False)  # the same graphs over torch ops only: what the Triton kernels save
    runner.drop_graphs()
    out[f"decode_{views[0]}_torch_ops_ms"] = decode_speed(runner, views[0], args.steps) * 1e3
    model.use_kernels(True)
    set_dependent_launch(False)  # every kernel waits for the one before to end: what dependent launch saves
    runner.drop_graphs()
    out[f"decode_{views[0]}_independent_launch_ms"] = decode_speed(runner, views[0], args.steps) * 1e3
    set_dependent_launch(True)
    runner.drop_graphs()
    runner.use_graphs = False
    out[f"decode_{views[0]}_eager_ms"] = decode_speed(runner, views[0], 4) * 1e3
    runner.use_graphs = True
    runner.clear()
    out["bf16_gemm_TFLOPs"] = tflops = gemm_tflops()
    for n in (int(p) for p in args.prefill.split(",")):
        out[f"attention_{n}"] = attention_rates(spec, n, min(n, args.chunk))
    for n in (int(p) for p in args.prefill.split(",")):
        out[f"prefill_{n}"] = prefill_speed(runner, n, args.chunk, tflops)
    if model.use_cudnn_prefill(True):  # the same prefills, long forwards' attention through cuDNN, eager
        runner.drop_graphs()
        for n in (int(p) for p in args.prefill.split(",")):
            out[f"prefill_{n}_cudnn"] = prefill_speed(runner, n, args.chunk, tflops)
        model.use_cudnn_prefill(False)
    for chunk in (int(c) for c in args.chunks.split(",") if c):
        out[f"prefill_{args.chunk_at}_chunk_{chunk}"] = prefill_speed(runner, args.chunk_at, chunk, tflops)
    if args.profile:
        with open(args.profile, "w") as f:
            f.write(profile(runner, views[0], args.chunk, args.profile_at or args.chunk))
    print(json.dumps(out, indent=1), flush=True)
    if args.hf:
        del runner, model
        torch.cuda.empty_cache()
        out["hf_generate_ms_per_token"] = hf_decode_ms(spec)
        print(json.dumps({"hf_generate_ms_per_token": out["hf_generate_ms_per_token"]}), flush=True)


if __name__ == "__main__":
    main()
