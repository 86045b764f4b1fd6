"""The torch engine's fair baselines of one measured turn (``kvmem bench speed --backend torch``).

Each is the same ``Runner`` over the same weights as KVMem's adapter, timed to the first token (the
last logits' argmax on the host), the median of ``ROUNDS`` after one untimed warm-up:

- ``prefix_ttft_s``: a **dense prefix cache** (vLLM / SGLang prefix caching, a llama.cpp server slot):
  the KV of the previous turn's prompt resident on the device, only the suffix past the common prefix
  prefilled. The resident prefix is synthesized (random KV at its positions, the recurrent state as it
  is): a forward's time does not depend on the values it reads, and prefilling a 1M-token prefix to set
  it up would take minutes. Where the whole transcript's KV, and the suffix's attention over it, does
  not fit in GPU memory it is not run (``prefix_cache`` says why). It and the floor run the plain engine's own
  forward length (``TorchAdapter.prefill_chunk``: 4,096 tokens on a GPU), not KVMem's (a quarter of its view).
- ``suffix_floor_s``: the same new tokens prefilled into an empty cache, the engine's plain prefill rate
  at that length (``plain_prefill_tok_s``): no turn that reads its history is faster.
- ``view_prefill_s``: the same new tokens in KVMem's forwards over a streaming view of KVMem's size: the view
  starts full less one forward (at most the transcript's prefix), and before each forward its oldest blocks after
  the sink leave until the forward fits, as the engine's ``_make_room`` does: the forward path alone of a KVMem
  suffix prefill (no archiving, staging, checkpoints or selection), and ``view_prefill_vs_plain`` its rate against
  the plain one (goal ≥ ``VIEW_PREFILL_GOAL``).
"""

from __future__ import annotations

import statistics
import time
from typing import Any, Callable, Sequence

import torch

from kvmem_bench.speed_common import GOALS, ratio, shown
from kvmem_core.config import KVMemConfig
from kvmem_core.step import common_prefix

ROUNDS = 3
VIEW_PREFILL_GOAL = 0.8
HEADROOM = 0.9  # of the free GPU memory the resident KV may take before the suffix's activations
SINK_TOKENS = KVMemConfig.sink_tokens  # a streaming view's first tokens, never dropped (whole blocks)


def turn_baselines(
    model: Any,
    ids: Sequence[int],
    previous: Sequence[int],
    *,
    chunk: int,
    plain_chunk: int,
    block_tokens: int,
    view_tokens: int,
    log: Callable[[str], None] = print,
) -> dict[str, Any]:
    """The three baselines of the turn whose prompt is ``ids`` after the turn whose prompt was ``previous``,
    as a point's keys (see the module docstring), with ``new_tokens`` (the suffix past the common prefix;
    the last token is always computed, for its logits). The suffix floor and the dense prefix cache prefill in the
    plain engine's own ``plain_chunk``-token forwards, as a user's engine would; KVMem's forward path in its
    ``chunk``-token ones over a streaming view of ``view_tokens``."""
    hit = min(common_prefix(previous, ids), len(ids) - 1)
    new = list(ids[hit:])
    floor = suffix_ttft(model, new, 0, plain_chunk, block_tokens)
    resident = max(0, min(hit, view_tokens - chunk))
    view = suffix_ttft(model, new, resident, chunk, block_tokens, view_tokens=view_tokens)
    prefix = suffix_ttft(model, new, hit, plain_chunk, block_tokens)
    out = {
        "new_tokens": len(new),
        "suffix_floor_s": floor,
        "plain_prefill_tok_s": ratio(len(new), floor),
        "prefix_ttft_s": prefix if isinstance(prefix, float) else None,
        "prefix_cache": "resident on the device" if isinstance(prefix, float) else prefix,
        "view_resident_tokens": resident,
        "view_chunk_tokens": chunk,
        "view_prefill_s": view if isinstance(view, float) else None,
    }
    out["view_prefill_tok_s"] = ratio(len(new), out["view_prefill_s"])
    out["view_prefill_vs_plain"] = ratio(out["view_prefill_tok_s"], out["plain_prefill_tok_s"])
    log(
        f"workspace {len(ids)}: {len(new)} new tokens; suffix floor {floor:.3f} s, over a {view_tokens}-token view "
        f"{shown(out['view_prefill_s'], '{:.3f} s', 'does not fit')}, dense prefix cache ({hit} resident) "
        f"{shown(out['prefix_ttft_s'], '{:.3f} s', 'does not fit')}"
    )
    return out


def suffix_ttft(
    model: Any,
    new: Sequence[int],
    resident: int,
    chunk: int,
    block_tokens: int,
    rounds: int = ROUNDS,
    view_tokens: int | None = None,
) -> float | str:
    """Median seconds to the first token of ``new`` prefilled in ``chunk``-token forwards at positions
    ``resident``.. after ``resident`` tokens of synthesized KV; with ``view_tokens``, over a streaming view of that
    size (the module docstring); a sentence instead where that does not fit in GPU memory."""
    from kvmem_torch import plain_engine

    cells = view_tokens or resident + len(new)
    why = _does_not_fit(model, -(-cells // block_tokens) + 2, block_tokens)
    if why:
        return why
    runner = None
    try:
        runner = plain_engine(model, cells, block_tokens)
        synthesize_view(runner, resident)
        start = runner.state.snapshot()
        times = [_prefill_s(runner, new, resident, chunk, start, view_tokens) for _ in range(rounds + 1)][1:]
        return statistics.median(times)
    except torch.cuda.OutOfMemoryError:
        return f"does not fit: {cells} tokens of KV and their attention ran out of GPU memory"
    finally:
        del runner
        if torch.cuda.is_available():
            torch.cuda.empty_cache()


def synthesize_view(runner: Any, n_tokens: int) -> None:
    """Fill an empty view with ``n_tokens`` of random KV at positions 0..n-1, one block at a time (the last
    one partly): what a resident prefix costs a forward, whatever its values."""
    cache, B = runner.cache, runner.B
    kv = torch.randn(cache.kv.shape[2:], device=cache.kv.device).to(cache.kv.dtype)
    for start in range(0, n_tokens, B):
        runner.insert_block(kv, kv, list(range(start, min(start + B, n_tokens))))


def _prefill_s(runner: Any, new: Sequence[int], at: int, chunk: int, start: Any, view_tokens: int | None) -> float:
    """Seconds to the first token of ``new`` at positions ``at``.. (with ``view_tokens``: room made before each
    forward); the view and state are put back after."""
    runner.state.restore(start)
    _settle()
    t0 = time.perf_counter()
    for a in range(0, len(new), chunk):
        piece = list(new[a : a + chunk])
        if view_tokens is not None:
            _make_room(runner, len(piece), view_tokens)
        logits, _ = runner.forward(piece, list(range(at + a, at + a + len(piece))))
    int(logits[-1].argmax())  # the token reaches the host: the device is done
    sec = time.perf_counter() - t0
    runner.drop(at, 1 << 62)
    if runner.length < at:  # the streaming view dropped resident blocks: the next round starts from the same view
        runner.clear()
        synthesize_view(runner, at)
    return sec


def _make_room(runner: Any, n: int, view_tokens: int) -> None:
    """Drop the oldest resident blocks after the sink's until ``n`` more tokens fit in ``view_tokens``."""
    keep = -(-SINK_TOKENS // runner.B) * runner.B
    while runner.length + n > view_tokens and runner.length > keep:
        oldest = runner.positions[keep]
        runner.drop(oldest, oldest + runner.B)


def _does_not_fit(model: Any, n_blocks: int, block_tokens: int) -> str | None:
    """Why a cache of ``n_blocks`` cannot be allocated on ``model``'s GPU (None: it can, or on the CPU)."""
    if model.device.type != "cuda":
        return None
    s = model.spec
    nbytes = (
        n_blocks * block_tokens * 2 * len(s.attention_layers) * s.n_kv_heads * s.head_dim * model.embed.element_size()
    )
    free = torch.cuda.mem_get_info()[0]
    if nbytes > HEADROOM * free:
        return f"does not fit: {nbytes / 1e9:.1f} GB of KV, {free / 1e9:.1f} GB of GPU memory free"
    return None


def _settle() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def point_goals(point: dict[str, Any]) -> dict[str, bool | None]:
    """Item 4's goals at one point (None where not measured): reuse TTFT ≤ 1.25 × (suffix floor + 50 ms), ≤ 1.2 ×
    the dense prefix cache's, the suffix prefill into the view at ≥ 80% of the plain rate (the forward path
    alone and through the engine), and selection + replay + materialization within their share of TTFT."""
    reuse, floor = point["reuse_ttft_s"], point.get("suffix_floor_s")
    cache, share = point.get("ttft_vs_prefix_cache"), point.get("select_replay_materialize_share")
    limit = point.get("select_replay_materialize_goal")
    return {
        "ttft<=1.25x(suffix_floor+50ms)": None
        if floor is None
        else reuse <= GOALS["vs_floor"] * (floor + GOALS["floor_slack_s"]),
        "ttft_vs_prefix_cache<=1.2": None if cache is None else cache <= GOALS["vs_prefix_cache"],
        "view_prefill_vs_plain>=0.8": _at_least(point.get("view_prefill_vs_plain"), VIEW_PREFILL_GOAL),
        "engine_prefill_vs_plain>=0.8": _at_least(point.get("engine_prefill_vs_plain"), VIEW_PREFILL_GOAL),
        f"select_replay_materialize_share<={limit}": None if share is None or limit is None else share <= limit,
    }


def _at_least(value: float | None, goal: float) -> bool | None:
    return None if value is None else value >= goal
