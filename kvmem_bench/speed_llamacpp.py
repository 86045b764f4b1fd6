"""``kvmem bench speed --backend llama.cpp``: an agent session on the CPU, measured turn by turn.

The session is ``speed_session``'s, shared with the torch bench: the transcript grows by one
tool result per turn and is sent whole every turn, as an agent sends it. When it passes each
workspace size, that turn's step is timed: time to first token with KVMem (the workspace
already holds the earlier turns) and decode tok/s at the fixed budget. Afterwards plain
llama-cpp-python measures the baselines of the same token ids (``baselines``): re-prefill from
empty (a stateless engine) with decode over the whole transcript (``full``), a dense prefix
cache that prefills only the suffix (its resident history synthesized past ``DENSE_MAX``), and the
suffix floor. Block transfers host→view and
NVMe→view are timed next to a raw copy / file read of the same bytes.
"""

from __future__ import annotations

import time
from typing import Any, Callable, Sequence

import numpy as np

from kvmem_bench.speed_common import headline, shown
from kvmem_bench.speed_overhead import decode_overhead, plain_opts
from kvmem_bench.speed_session import baseline_ratios, session, transfers
from kvmem_bench.speed_kv_dtype import LLAMACPP_DTYPES, sizes
from kvmem_bench.speed_speculative import speed_row
from kvmem_bench.speed_sampling import engine_vocab, sampling_cost, sampling_line, step_ms
from kvmem_bench.speed_structured import structured_cost
from kvmem_bench.prompt import measure as measure_prompt
from kvmem_core.config import KVMemConfig
from kvmem_core.step import common_prefix

QUICK = dict(sizes=(1024, 2048, 4096, 8192), budget=1024, recent=256, gen=256)
FULL = dict(sizes=(2048, 4096, 8192, 16384), budget=2048, recent=512, gen=512)  # the view's knobs: the defaults
DENSE_MAX = 16384  # past it the re-prefill is not run and the prefix cache's history is synthesized: a CPU prefill of
# the whole transcript grows with its square, ~4 hours at 128K on 2 cores
SEED_TOKENS = 512  # computed tokens whose KV a synthesized resident history repeats


def resolve_plan(quick: bool, sizes: Sequence[int] | None, default_knobs: bool) -> dict[str, Any]:
    """The quick or full plan; ``default_knobs``: the full plan's view (the defaults) whatever ``quick`` says;
    ``sizes`` replace the plan's workspace sizes."""
    plan = dict(FULL if default_knobs or not quick else QUICK)
    return {**plan, "sizes": tuple(sizes)} if sizes else plan


def session_config(plan: dict[str, Any]) -> KVMemConfig:
    """The engine's knobs for ``plan``: its view; ``--ctx`` and the host tier as ``kvmem serve``'s defaults."""
    return KVMemConfig(budget=plan["budget"], gen_budget=plan["gen"], recent_tokens=plan["recent"])


def run(
    model_path: str,
    *,
    quick: bool,
    decode_tokens: int = 32,
    lines_per_turn: int = 12,
    plan: dict[str, Any] | None = None,
    log: Callable[[str], None] = print,
    compute: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """The whole llama.cpp speed run; a JSON-ready dict (headline ratios first, then detail).
    ``plan`` (sizes, budget, recent, gen) replaces the quick / full presets; ``compute``: the adapter's
    thread and GPU-layer options, which the plain llama-cpp-python references copy."""
    from kvmem.engines import load_engine

    plan = plan or (QUICK if quick else FULL)
    config = session_config(plan)
    engine = load_engine("llama.cpp", model_path, config, **(compute or {}))
    plain, placement = plain_opts(engine.adapter), engine.adapter.placement
    log(f"llama.cpp on {placement}; {plain['n_threads']} threads ({plain['n_threads_batch']} for prefill)")
    try:
        points, transcripts, previous = session(engine, plan["sizes"], decode_tokens, lines_per_turn, log)
        transfer = transfers(engine)
        prompt_row = measure_prompt(engine.adapter)
        structured = structured_cost(engine)
        sampling = sampling_cost(engine_vocab(engine), step_ms(points))
        speculative = speed_row(engine)
        kv_dtype = sizes(engine.adapter.layout, LLAMACPP_DTYPES)
        model = engine.model_id
    finally:
        engine.close()
    for point, ids, prev in zip(points, transcripts, previous):
        point.update(baselines(model_path, ids, prev, decode_tokens, plain))
        point.update(baseline_ratios(point))
        log(
            f"workspace {point['workspace_tokens']}: re-prefill "
            f"{shown(point['reprefill_ttft_s'], '{:.2f} s', 'not run')}, prefix cache "
            f"{shown(point['prefix_ttft_s'], '{:.2f} s', 'not run')}, suffix floor "
            f"{point['suffix_floor_s']:.2f} s ({point['new_tokens']} new tokens), full decode "
            f"{shown(point['full_tok_s'], '{:.1f} tok/s', 'not run')}"
        )
    overhead = decode_overhead(model_path, rounds=3 if quick else 5, compute=compute)
    log(f"everything fits: KVMem decodes at {overhead['decode_vs_plain']:.3f}x plain llama-cpp-python")
    out = headline("llama.cpp", model, points, transfer)
    out.update(
        decode_vs_plain=overhead["decode_vs_plain"],
        overhead=overhead,
        prompt_building=prompt_row,
        structured=structured,
        sampling=sampling,
        speculative=speculative,
        kv_dtype=kv_dtype,
    )
    log(
        f"structured output: the grammar mask takes {structured['mask_ms_per_token']} ms a token "
        f"({structured.get('mask_share')} of a decode step)"
    )
    log(sampling_line(sampling))
    log(f"prompt building at {prompt_row['messages']} messages: {prompt_row['ratio']:.2f}x one render + tokenize")
    out.update(
        placement=placement,
        compute=plain,
        quick=quick,
        config={
            "budget": config.budget,
            "gen_budget": config.gen_budget,
            "recent_tokens": config.recent_tokens,
            "block_tokens": config.block_tokens,
        },
        points=points,
        transfer=transfer,
    )
    return out


def baselines(
    model_path: str, ids: list[int], previous: list[int], decode_tokens: int, opts: dict[str, Any], rounds: int = 3
) -> dict[str, Any]:
    """The plain llama-cpp-python baselines of one turn (``opts``: KVMem's threads and GPU layers), as a dict:

    - ``reprefill_ttft_s``: the whole transcript ``ids`` from an empty cache, as a stateless engine pays every
      turn (then greedy decode over it: ``full_tok_s``);
    - ``prefix_ttft_s``: a dense prefix cache (a llama.cpp server slot, vLLM or SGLang prefix caching): the
      ``previous`` turn's prompt resident, only the suffix past the common prefix prefilled; past ``DENSE_MAX``
      the resident prefix is synthesized (``synthesize_prefix``) where its context fits in memory
      (``prefix_cache`` says where it did not);
    - ``suffix_floor_s``: the same ``new_tokens`` prefilled into an empty cache, at the plain prefill rate of
      that length (``plain_prefill_tok_s``) with no history to attend to: no turn that reads its history is
      faster.

    The cheap two are medians of ``rounds``, prefix cache first (a floor round empties the cache the prefix
    rounds reuse); the re-prefill runs once: it is the long one, and its ratio to KVMem dwarfs the noise. Past
    ``DENSE_MAX`` tokens it is not run (None)."""
    hit = min(common_prefix(previous, ids), len(ids) - 1)  # the last token is always computed (its logits)
    out: dict[str, Any] = {"reprefill_ttft_s": None, "full_tok_s": None, "prefix_ttft_s": None}
    dense = len(ids) <= DENSE_MAX
    try:
        llm, fits = _context(model_path, len(ids) + decode_tokens + 64, opts), True
        out["prefix_cache"] = "resident" if dense else "resident, synthesized"
    except ValueError as e:  # llama-cpp-python's answer when llama.cpp cannot allocate the context
        llm, fits = _context(model_path, len(ids) - hit + decode_tokens + 64, opts), False
        out["prefix_cache"] = f"does not fit: a {len(ids)}-token context ({e})"
    try:
        llm.eval(ids[:8])  # warm-up: the first decode of a context allocates its graph; KVMem's is warm as well
        if fits:
            if dense:
                out.update(reprefill(llm, ids, decode_tokens))
            else:
                synthesize_prefix(llm, ids, hit)
            out["prefix_ttft_s"] = float(np.median([prefill_from(llm, ids, hit) for _ in range(rounds)]))
        floor = [prefill_from(llm, ids[hit:], 0) for _ in range(rounds)]
        out.update(suffix_floor_s=float(np.median(floor)), new_tokens=len(ids) - hit)
        out["plain_prefill_tok_s"] = out["new_tokens"] / out["suffix_floor_s"]
        return out
    finally:
        llm.close()


def _context(model_path: str, n_ctx: int, opts: dict[str, Any]) -> Any:
    import llama_cpp

    return llama_cpp.Llama(model_path, n_ctx=n_ctx, n_batch=512, flash_attn=True, verbose=False, **opts)


def synthesize_prefix(llm: Any, ids: list[int], n: int) -> None:
    """Make ``llm``'s cache hold ``n`` cells for the first ``n`` of ``ids`` without prefilling them all: the first
    ``SEED_TOKENS`` computed, their KV repeated up to ``n`` (``kvmem_llamacpp.fill_sequence``); a forward's time
    does not depend on the values it reads."""
    from kvmem_llamacpp import fill_sequence

    llm.n_tokens = 0
    llm.eval(ids[: min(SEED_TOKENS, n)])
    fill_sequence(llm._ctx.ctx, 0, n)
    llm.n_tokens = n


def reprefill(llm: Any, ids: list[int], decode_tokens: int) -> dict[str, float]:
    """Prefill ``ids`` from an empty cache (time to first token), then greedy decode ``decode_tokens`` - 1."""
    llm.n_tokens = 0
    t0 = time.perf_counter()
    llm.eval(ids)
    token = _argmax(llm)
    ttft = time.perf_counter() - t0
    t0, done = time.perf_counter(), 0
    for _ in range(decode_tokens - 1):
        llm.eval([token])
        token = _argmax(llm)
        done += 1
    return {"reprefill_ttft_s": ttft, "full_tok_s": done / (time.perf_counter() - t0)}


def prefill_from(llm: Any, ids: list[int], keep: int) -> float:
    """Seconds to the first token of ``ids`` when the cache already holds the KV of its first ``keep`` tokens
    (the caller's contract; what it holds past them is dropped first: ``Llama.eval`` removes every cell from
    ``n_tokens`` on)."""
    assert 0 <= keep < len(ids) and llm.n_tokens >= keep, "the prefix must be resident"
    llm.n_tokens = keep
    t0 = time.perf_counter()
    llm.eval(ids[keep:])
    _argmax(llm)
    return time.perf_counter() - t0


def _argmax(llm: Any) -> int:
    """The greedy next token from the context's last logits."""
    import llama_cpp

    logits = llama_cpp.llama_get_logits_ith(llm._ctx.ctx, -1)
    return int(np.argmax(np.ctypeslib.as_array(logits, shape=(llm.n_vocab(),))))
