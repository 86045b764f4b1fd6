"""``kvmem bench speed --backend torch``: an agent session through ``KVMemEngine`` + ``TorchAdapter`` (the stack
``kvmem serve --backend torch`` runs) on random qwen35 weights, with the tokenizer and chat template of a real
GGUF (default: the default model's), so every figure is the product's.

The session is the llama.cpp bench's (``speed_session.session``): the transcript grows by one
tool result per turn and is sent whole every turn; at the first turn past each workspace size
the step's TTFT (prefill, selection, materialization, state restore and replay, as the engine
times them) and decode tok/s at the fixed budget are recorded. Then a plain torch engine (a
``Runner`` over the same weights, no KVMem) prefills the same token ids from empty (stateless
re-prefill TTFT) and decodes over the whole transcript (dense decode). Block transfers host→view
and NVMe→view are timed against a raw copy / file read of the same bytes
(``speed_session.transfers``). Decode figures come with their floor: the bytes a step reads
(weights + view or whole-transcript KV) over the copy bandwidth measured in the same run.
"""

from __future__ import annotations

import importlib.metadata
import shutil
import tempfile
import time
from typing import Any, Callable, Sequence

import torch

from kvmem_bench.speed_common import floor_s, headline, ratio
from kvmem_bench.speed_kv_dtype import speed_row as kv_dtype_row
from kvmem_bench.speed_session import baseline_ratios, session, transfers
from kvmem_bench.speed_phases import PhaseClock, phase_figures
from kvmem_bench.speed_speculative import SPEED_ROW_TOKENS, speed_row
from kvmem_bench.speed_sampling import engine_vocab, sampling_cost, sampling_line, step_ms
from kvmem_bench.speed_structured import structured_cost
from kvmem_bench.speed_torch_baselines import point_goals, turn_baselines
from kvmem_core.config import GIB, KVMemConfig
from kvmem_core.engine import KVMemEngine

# sizes: workspace tokens measured (at the first turn past each); lines: log lines per tool result (~30 tokens
# each); stateless_max: the largest of the sizes the plain engine re-prefills (its attention cost grows with the
# square of the transcript); mtp (optional, False when absent): random weights with an MTP layer, whose drafts the
# speculative rows then time too
PLANS = {
    "full": dict(
        sizes=(32768, 131072, 524288, 1048576),
        budget=32768,
        recent=512,
        gen=512,
        lines=400,
        decode=32,
        stateless_max=131072,
        hf=True,
    ),
    "quick": dict(
        sizes=(16384, 65536), budget=16384, recent=512, gen=512, lines=100, decode=16, stateless_max=65536, hf=False
    ),
    "cpu": dict(sizes=(1024, 4096), budget=512, recent=128, gen=128, lines=12, decode=8, stateless_max=4096, hf=False),
}
# the view KVMemConfig gives a user who sets no knob (the plans' larger views are named changes)
DEFAULT_VIEW = dict(budget=KVMemConfig.budget, recent=KVMemConfig.recent_tokens, gen=KVMemConfig.gen_budget)
INDEX_HEADS = 3  # retrieval heads the index scores (a calibrated profile's size)
NOT_RUN = {"reprefill_ttft_s": None, "full_tok_s": None}
GB = 1e9


def run(
    *,
    quick: bool,
    shape: str | None = None,
    plan: dict[str, Any] | None = None,
    tokenizer: str | None = None,
    sizes: Sequence[int] | None = None,
    default_knobs: bool = False,
    log: Callable[[str], None] = print,
) -> dict[str, Any]:
    """Every torch speed figure as a JSON-ready dict (the contract's headline keys first). CUDA: the ``27b``
    shape in bf16; CPU: ``tiny`` in fp32. ``tokenizer``: the model (name or GGUF) whose tokenizer and chat
    template the random weights get; None: the default model. ``sizes``: the workspace sizes measured instead
    of the plan's; ``default_knobs``: the view of ``KVMemConfig``'s defaults instead of the plan's."""
    from kvmem_bench.torch_device import gemm_tflops, weight_bytes

    cuda = torch.cuda.is_available()
    shape = shape or ("27b" if cuda else "tiny")
    plan = resolve_plan(plan or PLANS[("quick" if quick else "full") if cuda else "cpu"], sizes, default_knobs)
    t = time.perf_counter()
    engine = session_engine(shape, tokenizer, plan, "cuda" if cuda else "cpu")
    adapter = engine.adapter
    model, weights = adapter.model, weight_bytes(adapter.model)
    log(f"{adapter.model_id}: {weights / GB:.2f} GB of weights built in {time.perf_counter() - t:.1f} s")
    try:
        bw = bandwidths(adapter.layout.kv_bytes_per_block, cuda)
        tflops = gemm_tflops() if cuda else None
        log(f"bandwidths {bw}, bf16 GEMM {tflops} TFLOP/s")
        phases = PhaseClock(engine)
        points, transcripts, previous = session(engine, plan["sizes"], plan["decode"], plan["lines"], log)
        transfer = transfers(engine)
        structured = structured_cost(engine)
        sampling = sampling_cost(engine_vocab(engine), step_ms(points))
        log(sampling_line(sampling))
        speculative = speed_row(engine, plan.get("speculative_tokens", SPEED_ROW_TOKENS))
    finally:
        engine.close()
    config, kv_token = engine.config, adapter.layout.bytes_per_token
    chunk = engine._prefill_chunk(config)
    kv_dtype = kv_dtype_row(model, adapter.layout, config.view_tokens, plan["decode"])
    for size, point, ids, prev in zip(plan["sizes"], points, transcripts, previous):
        add_floors(point, weights, kv_token, config.view_tokens, bw["hbm_copy_GBps"])
        add_stateless(
            point, plain_engine(model, ids, size, plan, adapter.prefill_chunk, config.block_tokens, kv_token, log)
        )
        add_prefill_floor(point, model, len(ids), tflops)
        add_fair(
            point,
            phases.for_prompt(point["workspace_tokens"]),
            turn_baselines(
                model,
                ids,
                prev,
                chunk=chunk,
                plain_chunk=adapter.prefill_chunk,
                block_tokens=config.block_tokens,
                view_tokens=config.view_tokens,
                log=log,
            ),
        )
    out = {
        **headline("torch", engine.model_id, points, transfer),
        "ttft_speedup": _largest_ttft_speedup(points),
        "shape": shape,
        "device": torch.cuda.get_device_name() if cuda else "cpu",
        "deltanet_prefill": deltanet_prefill(),
        "plan": plan,
        "config": {
            "budget": config.budget,
            "gen_budget": config.gen_budget,
            "recent_tokens": config.recent_tokens,
            "block_tokens": config.block_tokens,
            "cpu_gb": config.cpu_gb,
            "host_tier": "auto" if config.cpu_gb == KVMemConfig().with_host_tier().cpu_gb else "raised",
            "heads": [list(h) for h in engine.heads],
        },
        "weights_GB": weights / GB,
        "kv_bytes_per_token": kv_token,
        "bandwidths": bw,
        "bf16_gemm_TFLOPs": tflops,
        "points": points,
        "point_goals": {str(p["workspace_tokens"]): p["goals"] for p in points},
        "transfer": transfer,
        "capacity": capacity(weights, kv_token, points),
        "structured": structured,
        "sampling": sampling,
        "speculative": speculative,
        "kv_dtype": kv_dtype,
    }
    if plan["hf"] and cuda:
        spec = model.spec
        del engine, adapter, model  # HF builds its own weights of the same shape: ours must be gone first
        out["hf_generate"] = _hf_generate(spec, points[0]["kvmem_tok_s"])
    return out


def deltanet_prefill() -> str:
    """Which kernels prefill the DeltaNet layers on CUDA: ``fla-core <version>`` where flash-linear-attention
    imports (the ``cuda`` extra), else ``torch`` (the torch form, several times slower on the host)."""
    from kvmem_torch import fla_chunked_rule

    return f"fla-core {importlib.metadata.version('fla-core')}" if fla_chunked_rule() else "torch"


def add_fair(point: dict[str, Any], phases: dict[str, float], baselines: dict[str, Any]) -> None:
    """The turn's TTFT split (``speed_phases``), its fair baselines (``speed_torch_baselines``), KVMem's TTFT
    against each (``speed_session.baseline_ratios``) and item 4's goals at this point (``goals``)."""
    point.update(phase_figures(point, phases), **baselines)
    point.update(baseline_ratios(point))
    point["engine_prefill_vs_plain"] = ratio(point["engine_prefill_tok_s"], point["plain_prefill_tok_s"])
    point["goals"] = point_goals(point)


def resolve_plan(plan: dict[str, Any], sizes: Sequence[int] | None, default_knobs: bool) -> dict[str, Any]:
    """``plan`` with ``sizes`` (sorted) in place of its own, and with ``DEFAULT_VIEW`` in place of its view when
    ``default_knobs``."""
    plan = dict(plan, sizes=tuple(sorted(sizes))) if sizes else plan
    return dict(plan, **DEFAULT_VIEW) if default_knobs else plan


def session_engine(shape: str, tokenizer: str | None, plan: dict[str, Any], device: str) -> KVMemEngine:
    """A ``KVMemEngine`` with ``plan``'s knobs (``session_config``) over random qwen35 weights of ``shape`` on
    ``device`` (with an MTP layer where the plan's ``mtp`` asks), with ``tokenizer``'s tokenizer and template."""
    from kvmem.models import resolve_model
    from kvmem_bench.torch_device import random_adapter

    adapter = random_adapter(
        shape,
        resolve_model(tokenizer),
        device=device,
        view_tokens=plan["budget"] + plan["gen"],
        block_tokens=KVMemConfig.block_tokens,
        mtp=plan.get("mtp", False),
    )
    return KVMemEngine(adapter, session_config(plan, adapter.layout.bytes_per_token), heads=index_heads(adapter))


def session_config(plan: dict[str, Any], bytes_per_token: int) -> KVMemConfig:
    """The engine's knobs for ``plan``: its view, ``--ctx`` auto and the default host tier (auto: half of the
    machine's memory), raised to a little more than the largest size where that does not hold it (the result's
    ``config.cpu_gb`` then reads ``raised``)."""
    tokens = max(plan["sizes"]) + 64 * plan["lines"] + 4096
    config = KVMemConfig(budget=plan["budget"], gen_budget=plan["gen"], recent_tokens=plan["recent"])
    need = 1.25 * tokens * bytes_per_token / GIB
    auto = config.with_host_tier()
    return auto if auto.cpu_gb >= need else auto.replace(cpu_gb=need)


def index_heads(adapter: Any) -> tuple[tuple[int, int], ...]:
    """``INDEX_HEADS`` (attention layer, head) pairs spread over the layers: random weights have no calibration."""
    n_layers, n_heads = adapter.layout.n_layers, adapter.model.spec.n_heads
    return tuple((i * (n_layers - 1) // max(1, INDEX_HEADS - 1), i % n_heads) for i in range(INDEX_HEADS))


def bandwidths(block_bytes: int, cuda: bool) -> dict[str, float]:
    """HBM copy and pinned host→GPU GB/s on CUDA (``kvmem_bench.torch_device.bandwidths``); a memcpy on the CPU."""
    if cuda:
        from kvmem_bench.torch_device import bandwidths as device_bandwidths

        return device_bandwidths(block_bytes)
    a = torch.empty(1 << 26, dtype=torch.uint8)
    b = torch.empty_like(a)
    sec = min(_seconds(lambda: b.copy_(a)) for _ in range(3))
    return {"hbm_copy_GBps": 2 * a.nbytes / sec / GB, "pinned_h2d_GBps": a.nbytes / sec / GB}


def add_floors(point: dict[str, Any], weights: int, kv_token: int, view_tokens: int, copy_gbps: float) -> None:
    """KVMem decode's floor: weights + the view's KV (at most budget + generation reserve) at ``copy_gbps``."""
    view = min(view_tokens, point["workspace_tokens"] + point["decode_tokens"])
    floor = floor_s(weights + view * kv_token, copy_gbps)
    point.update(
        view_tokens=view,
        floor_tok_s=1 / floor,
        fraction_of_floor=None if point["kvmem_tok_s"] is None else point["kvmem_tok_s"] * floor,
        full_floor_tok_s=1 / floor_s(weights + point["workspace_tokens"] * kv_token, copy_gbps),
        theoretical_ratio=(weights + point["workspace_tokens"] * kv_token) / (weights + view * kv_token),
    )


def add_stateless(point: dict[str, Any], plain: dict[str, float | None]) -> None:
    """The plain engine's figures (None where it did not run) next to KVMem's at one workspace size, and their
    ratios; ``fraction_of_theory``: KVMem's decode speedup over dense against the bytes ratio."""
    point.update(plain)
    point["ttft_speedup"] = ratio(point["reprefill_ttft_s"], point["reuse_ttft_s"])
    point["decode_vs_full"] = speedup = ratio(point["kvmem_tok_s"], point["full_tok_s"])
    point["fraction_of_theory"] = None if speedup is None else speedup / point["theoretical_ratio"]


def add_prefill_floor(point: dict[str, Any], model: Any, n_tokens: int, tflops: float | None) -> None:
    """The re-prefill's compute floor (``kvmem_bench.torch_device.prefill_flops`` at ``tflops``) and the fraction of it
    reached; None where the plain engine did not run or no GEMM rate was measured (CPU)."""
    from kvmem_bench.torch_device import prefill_flops

    floor = prefill_flops(model, n_tokens) / (tflops * 1e12) if tflops else None
    point["reprefill_floor_s"] = floor
    point["reprefill_fraction_of_floor"] = ratio(floor, point["reprefill_ttft_s"]) if floor else None


def plain_engine(
    model: Any,
    ids: list[int],
    size: int,
    plan: dict[str, Any],
    chunk: int,
    block_tokens: int,
    kv_token: int,
    log: Callable[[str], None],
) -> dict[str, Any]:
    """``stateless`` for the transcript measured at plan size ``size`` if the plan re-prefills that size; past
    ``stateless_max``, dense decode over a view of the transcript's length with random KV (``dense_decode``)
    where it fits in GPU memory, else ``NOT_RUN``."""
    if size > plan["stateless_max"]:
        dense = dense_decode(model, len(ids), plan["decode"], block_tokens, kv_token)
        if dense["full_tok_s"] is not None:
            log(f"workspace {len(ids)}: dense decode over a synthesized view {dense['full_tok_s']:.1f} tok/s")
        return dense
    plain = stateless(model, ids, plan["decode"], chunk, block_tokens)
    log(
        f"workspace {len(ids)}: re-prefill {plain['reprefill_ttft_s']:.2f} s, "
        f"full decode {plain['full_tok_s']:.1f} tok/s"
    )
    return plain


def dense_decode(model: Any, n_tokens: int, decode: int, block_tokens: int, kv_token: int) -> dict[str, Any]:
    """Decode tok/s of the plain engine over ``n_tokens`` of random KV (``kvmem_bench.torch_device.decode_speed``): what
    dense attention over the whole transcript reads per token, without prefilling it (quadratic at 1M tokens).
    ``NOT_RUN`` where the view (``kv_token`` bytes a token) does not fit in free GPU memory (or on the CPU)."""
    from kvmem_bench.torch_device import decode_speed
    from kvmem_torch import plain_engine

    if not torch.cuda.is_available():
        return NOT_RUN
    n_blocks = n_tokens // block_tokens + 4
    if n_blocks * block_tokens * kv_token > 0.9 * torch.cuda.mem_get_info()[0]:
        return NOT_RUN
    runner = plain_engine(model, (n_blocks - 2) * block_tokens, block_tokens)
    try:
        sec = decode_speed(runner, n_tokens // block_tokens * block_tokens, max(4, decode))
        return {"reprefill_ttft_s": None, "full_tok_s": 1 / sec, "full_decode": "synthesized view"}
    finally:
        del runner
        torch.cuda.empty_cache()


def stateless(model: Any, ids: list[int], decode: int, chunk: int, block_tokens: int) -> dict[str, float]:
    """A plain torch engine over ``model`` (``kvmem_torch.plain_engine``, no KVMem): prefill ``ids`` from empty in
    ``chunk``-token chunks (time to first token), then greedy decode over the whole transcript (``decode`` >= 3
    tokens; the first decode step, which captures the CUDA graph, is not timed). Two chunks run first, untimed, as
    a serving engine's earlier requests would have: the first forwards of a shape compile and autotune Triton
    kernels (``torch_device.prefill_speed`` does the same)."""
    from kvmem_torch import plain_engine

    runner = plain_engine(model, len(ids) + decode, block_tokens)
    try:
        warm = ids[: 2 * chunk]
        runner.prefill(warm, list(range(len(warm))), chunk=chunk)
        runner.clear()
        t0 = time.perf_counter()
        logits, _ = runner.prefill(ids, list(range(len(ids))), chunk=chunk)
        token = int(logits[-1].argmax())
        ttft = time.perf_counter() - t0
        for pos in range(len(ids), len(ids) + decode - 1):
            if pos == len(ids) + 1:
                t0 = time.perf_counter()
            logits, _ = runner.forward([token], [pos])
            token = int(logits[-1].argmax())
        return {"reprefill_ttft_s": ttft, "full_tok_s": (decode - 2) / (time.perf_counter() - t0)}
    finally:
        del runner
        if torch.cuda.is_available():
            torch.cuda.empty_cache()


def capacity(weights: int, kv_token: float, points: list[dict[str, Any]]) -> dict[str, Any]:
    """Largest workspace each way on this machine (computed, not run): KVMem in host RAM + disk, dense in GPU
    memory minus the weights."""
    with open("/proc/meminfo") as f:
        mem = {k: int(v.split()[0]) * 1024 for k, v in (line.split(":", 1) for line in f)}
    disk = shutil.disk_usage(tempfile.gettempdir()).free
    gpu_total = torch.cuda.mem_get_info()[1] if torch.cuda.is_available() else 0
    kvmem_tokens = (mem["MemTotal"] + disk) / kv_token
    dense_tokens = max(0.0, gpu_total - weights) / kv_token
    dense_runs = [p["workspace_tokens"] for p in points if p.get("full_tok_s") is not None]
    return {
        "host_ram_GB": mem["MemTotal"] / GB,
        "disk_free_GB": disk / GB,
        "gpu_GB": gpu_total / GB,
        "kvmem_max_tokens": int(kvmem_tokens),
        "dense_max_tokens": int(dense_tokens),
        "ratio": ratio(kvmem_tokens, dense_tokens),
        "largest_run": points[-1]["workspace_tokens"],
        "largest_dense_run": max(dense_runs, default=None),
    }


def _largest_ttft_speedup(points: list[dict[str, Any]]) -> float | None:
    """Re-prefill / reuse TTFT at the largest workspace the plain engine re-prefilled."""
    measured = [p for p in points if p.get("reprefill_ttft_s") is not None]
    return ratio(measured[-1]["reprefill_ttft_s"], measured[-1]["reuse_ttft_s"]) if measured else None


def _hf_generate(spec: Any, kvmem_tok_s: float | None) -> dict[str, float | None]:
    """HF transformers ``generate`` on the same shape (its own random weights) against KVMem's decode."""
    from kvmem_bench.torch_device import hf_decode_ms

    torch.cuda.empty_cache()
    ms = hf_decode_ms(spec)
    return {"ms_per_token": ms, "kvmem_speedup": ratio(kvmem_tok_s, 1e3 / ms)}


def _seconds(fn: Callable[[], object]) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0
