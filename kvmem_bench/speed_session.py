"""The agent session both speed benches time through ``KVMemEngine`` (llama.cpp's ``speed_llamacpp``, torch's
``speed_torch``), and the block transfers they time after it.

The transcript grows by one tool result per turn and is sent whole every turn, as an agent
sends it (``session``). When it passes each workspace size, that turn's step is timed
(``point``): time to first token with KVMem (the workspace already holds the earlier turns),
split into its phases by timing the adapter's forwards (``ForwardClock``), and decode tok/s
at the fixed budget; ``baseline_ratios`` sets it against a backend's baselines of the same
turn. ``transfers`` times blocks host→view and NVMe→view next to a raw copy / file read of
the same bytes.
"""

from __future__ import annotations

import shutil
import tempfile
import time
from pathlib import Path
from typing import Any, Callable, Sequence

import numpy as np

from kvmem_bench.speed_common import decode_rate, gpu_memory_mb, ratio, rss_mb
from kvmem_bench.store import drop_page_cache, plain_read, plain_write
from kvmem_core.adapter import Placement
from kvmem_core.contract import SamplingParams, StepRequest
from kvmem_core.layout import BlockKV, BlockMeta
from kvmem_core.step import reset
from kvmem_core.store import BlockStore

GREEDY_ONE = SamplingParams(temperature=0.0, max_tokens=1)
SYSTEM = "You are a build assistant. Read each tool result and keep track of failures across the session."


def tool_result(turn: int, lines: int, rng: np.random.Generator) -> str:
    """One tool round of log lines (distinct numbers per line, like real command output)."""
    body = "\n".join(
        f"{turn:03d}.{i:03d} worker-{rng.integers(1, 64)} batch {rng.integers(1000, 99999)} "
        f"status={'ok' if rng.random() > 0.05 else 'FAIL'} in {rng.integers(1, 900)} ms"
        for i in range(lines)
    )
    return (
        f"Tool result of `tail -n {lines} logs/run{turn}.log`:\n{body}\n"
        "List every failed batch so far, one per line, with its worker and run."
    )


def baseline_ratios(point: dict[str, Any]) -> dict[str, float | None]:
    """KVMem's reuse TTFT against each baseline of the same turn: ``ttft_speedup`` (re-prefill / reuse, > 1 is
    KVMem faster), ``ttft_vs_prefix_cache`` and ``ttft_vs_suffix_floor`` (reuse / baseline, < 1 is KVMem
    faster), and ``decode_vs_full``."""
    reuse = point["reuse_ttft_s"]
    return {
        "ttft_speedup": ratio(point["reprefill_ttft_s"], reuse),
        "ttft_vs_prefix_cache": ratio(reuse, point.get("prefix_ttft_s")),
        "ttft_vs_suffix_floor": ratio(reuse, point.get("suffix_floor_s")),
        "decode_vs_full": ratio(point["kvmem_tok_s"], point["full_tok_s"]),
    }


class Transcript:
    """The agent's transcript, sent whole every turn: a system prompt, then per turn a tool result of ``lines`` log
    lines (``tool_result``) and a one-line reply."""

    def __init__(self, lines: int) -> None:
        self.lines, self.rng, self.turns = lines, np.random.default_rng(0), 0
        self.messages: list[dict[str, str]] = [{"role": "system", "content": SYSTEM}]

    def add_tool_result(self) -> tuple[dict[str, str], ...]:
        """The next turn's tool result appended. -> the messages to send"""
        self.messages.append({"role": "user", "content": tool_result(self.turns, self.lines, self.rng)})
        self.turns += 1
        return tuple(self.messages)

    def add_reply(self) -> None:
        self.messages.append({"role": "assistant", "content": f"Noted the failures of run {self.turns - 1}."})


def session(
    engine: Any, sizes: Sequence[int], decode_tokens: int, lines: int, log: Callable[[str], None]
) -> tuple[list[dict[str, Any]], list[list[int]], list[list[int]]]:
    """Grow one transcript turn by turn; time the first turn past each size. -> (points, token ids, the previous
    turn's prompt ids: what a prefix cache holds when the measured turn arrives)"""
    clock, transcript = ForwardClock(engine.adapter), Transcript(lines)
    points, transcripts, previous, todo = [], [], [], list(sizes)
    while todo:
        messages = transcript.add_tool_result()
        measure = engine.count_tokens(StepRequest(messages=messages)) >= todo[0]
        clock.reset()
        request = StepRequest(messages=messages, sampling=SamplingParams(temperature=0.0, max_tokens=decode_tokens))
        result = engine.step(
            request if measure else StepRequest(messages=messages, sampling=GREEDY_ONE), lambda p: True
        )
        if measure:
            todo.pop(0)
            points.append(point(engine, result, clock))
            points[-1]["kvmem_tok_s"] = max([points[-1]["kvmem_tok_s"] or 0.0, *decode_rounds(engine, request)])
            transcripts.append(engine.tokenize(engine.adapter.render_chat(list(messages))))
            previous.append(engine.tokenize(engine.adapter.render_chat(list(messages[:-2]))))
            p = points[-1]
            log(
                f"turn {transcript.turns}: {p['workspace_tokens']} tokens, ttft {p['reuse_ttft_s']:.3f} s "
                f"({p['prefill_tokens']} prefilled), decode {p['kvmem_tok_s']:.1f} tok/s"
            )
        transcript.add_reply()
    return points, transcripts, previous


def decode_rounds(engine: Any, request: StepRequest, rounds: int = 2) -> list[float]:
    """Decode tok/s of the same step repeated (a full cache hit, the view already selected): the best
    of several runs is the least disturbed on a shared machine."""
    out = []
    for _ in range(rounds):
        rate = decode_rate(engine.step(request, lambda piece: True))
        if rate is not None:
            out.append(rate)
    return out


def point(engine: Any, result: Any, clock: ForwardClock) -> dict[str, Any]:
    """One workspace size's KVMem figures from a step's timings and the forward clock. ``overhead_s`` is what
    the turn costs beyond computing each new token once in full (``ForwardClock.first_pass_s``): the probe of
    the query window, a replay, scoring and materialization; ``select_materialize_s`` is its part outside
    forwards. ``select_s`` is the engine's phase after the prefill (with a probe it holds the window's one full
    forward)."""
    t = result.timings
    ttft, new = t["prefill_s"] + t["select_s"], int(t["prefill_tokens"])
    forwards = max(0, len(result.token_ids) - 1)
    replay, probe = clock.replay_s(new), clock.probe_s()
    overhead = ttft - clock.first_pass_s(new)
    rss, peak = rss_mb()
    return {
        "workspace_tokens": result.prompt_tokens,
        "cached_tokens": result.cached_tokens,
        "prefill_tokens": new,
        "reuse_ttft_s": ttft,
        "prefill_s": t["prefill_s"],
        "select_s": t["select_s"],
        "replay_s": replay,
        "probe_s": probe,
        "probed_tokens": clock.probed_tokens(),
        "select_materialize_s": overhead - replay - probe,
        "overhead_s": overhead,
        "select_share": ratio(t["select_s"], ttft),
        "overhead_share": ratio(overhead, ttft),
        "select_materialize_share": ratio(overhead - replay - probe, ttft),
        "kvmem_tok_s": decode_rate(result),
        "decode_tokens": forwards,
        "method": result.selection.get("method"),
        "selected_blocks": len(result.selection.get("blocks", ())),
        "rss_mb": rss,
        "peak_rss_mb": peak,
        "host_tier_mb": engine.metrics().get("store_host_bytes", 0.0) / 1e6,
        **gpu_memory_mb(),
    }


class ForwardClock:
    """Times every ``forward`` of one adapter (wrapping the bound method), to split a step's phases:
    prefill chunks come first, then at most one multi-token replay, then one-token decodes. A multi-token
    forward is timed until its logits are out (a forward may return before the device finishes). Probes
    (forwards with ``stop_after``: only the layers the scorer reads) are kept apart in ``probes``."""

    def __init__(self, adapter: Any) -> None:
        self.calls: list[tuple[int, float]] = []
        self.probes: list[tuple[int, float]] = []
        inner = adapter.forward

        def timed(tokens: Sequence[int], *args: Any, **kwargs: Any) -> Any:
            t0 = time.perf_counter()
            out = inner(tokens, *args, **kwargs)
            if len(tokens) > 1:
                _ = out.logits  # waits for the device
            (self.probes if kwargs.get("stop_after") is not None else self.calls).append(
                (len(tokens), time.perf_counter() - t0)
            )
            return out

        adapter.forward = timed

    def reset(self) -> None:
        self.calls, self.probes = [], []

    def replay_s(self, prefill_tokens: int) -> float:
        """Seconds of multi-token full forwards after the first ``prefill_tokens`` tokens (those recompute)."""
        seen, out = 0, 0.0
        for n, sec in self.calls:
            if seen >= prefill_tokens and n > 1:
                out += sec
            seen += n
        return out

    def first_pass_s(self, prefill_tokens: int) -> float:
        """Seconds of the full forwards that compute the step's ``prefill_tokens`` new tokens once."""
        seen, out = 0, 0.0
        for n, sec in self.calls:
            if seen >= prefill_tokens:
                break
            out, seen = out + sec, seen + n
        return out

    def probe_s(self) -> float:
        return sum(sec for _, sec in self.probes)

    def probed_tokens(self) -> int:
        return sum(n for n, _ in self.probes)


def transfers(engine: Any, n_blocks: int = 32, rounds: int = 3) -> dict[str, Any]:
    """Host→view and NVMe→view throughput of real stored blocks, each next to a raw copy (memcpy, cold file
    read) of the same bytes. Blocks go into the view in batches of half the view (an import stages through a
    scratch sequence of the same cache), each at its stored position."""
    store, adapter = engine.store, engine.adapter
    ws = max(store.list_workspaces(), key=lambda w: w.get("blocks", 0))
    metas = store.workspace_blocks(ws["id"])[:n_blocks]
    loaded = store.complete_load(store.prepare_load([m.chain_hash for m in metas])).blocks
    blocks = [(m, _contiguous(loaded[m.chain_hash])) for m in metas]
    nbytes = sum(kv.nbytes for _, kv in blocks)
    batch = max(1, adapter.caps.max_view_tokens // adapter.layout.block_tokens // 2 - 1)
    host = [(_raw_copy_s(blocks), _to_view_s(adapter, blocks, batch)) for _ in range(rounds)]
    nvme = [_nvme_round(engine.layout, adapter, blocks, batch, first=r) for r in range(rounds)]
    reset(engine.view, adapter)  # the engine's view state forgets what the timed writes replaced
    med = lambda xs: float(np.median(xs))  # noqa: E731
    return {
        "blocks": len(blocks),
        "bytes": nbytes,
        "view_batch_blocks": batch,
        "raw_copy_GBps": nbytes / med([r for r, _ in host]) / 1e9,
        "host_to_view_GBps": nbytes / med([v for _, v in host]) / 1e9,
        "host_vs_raw": med([r / v for r, v in host]),
        "raw_read_GBps": nbytes / med([r for r, _, _ in nvme]) / 1e9,
        "nvme_to_host_GBps": nbytes / med([h for _, h, _ in nvme]) / 1e9,
        "nvme_to_view_GBps": nbytes / med([v for _, _, v in nvme]) / 1e9,
        "nvme_vs_raw": med([r / v for r, _, v in nvme]),
        "nvme_tier_vs_raw": med([r / h for r, h, _ in nvme]),
        "rounds": rounds,
    }


def _contiguous(kv: BlockKV) -> BlockKV:
    return BlockKV(np.ascontiguousarray(kv.k), np.ascontiguousarray(kv.v))


def _raw_copy_s(blocks: list[tuple[BlockMeta, BlockKV]]) -> float:
    """Seconds of a memcpy of the blocks into buffers already faulted in (as the view's cache is)."""
    dst = [(np.ones_like(kv.k), np.ones_like(kv.v)) for _, kv in blocks]
    t0 = time.perf_counter()
    for (_, kv), (k, v) in zip(blocks, dst):
        np.copyto(k, kv.k)
        np.copyto(v, kv.v)
    return time.perf_counter() - t0


def _to_view_s(
    adapter: Any,
    blocks: list[tuple[BlockMeta, BlockKV]],
    batch: int,
    load: Callable[[list[BlockMeta]], list[BlockKV]] | None = None,
) -> float:
    """Seconds to write ``blocks`` into the view, ``batch`` at a time (``load`` fetches each batch first)."""
    total = 0.0
    for i in range(0, len(blocks), batch):
        part = blocks[i : i + batch]
        adapter.clear_view()
        t0 = time.perf_counter()
        kvs = load([m for m, _ in part]) if load else [kv for _, kv in part]
        adapter.write_blocks([Placement(kv, m.start_pos, m.start_pos) for (m, _), kv in zip(part, kvs)])
        total += time.perf_counter() - t0
    return total


def _nvme_round(
    layout: Any, adapter: Any, blocks: list[tuple[BlockMeta, BlockKV]], batch: int, first: int
) -> tuple[float, float, float]:
    """Seconds of a raw cold file read, a cold NVMe tier load, and a cold tier load + view write of the same
    blocks; each starts with the page cache dropped, and ``first`` rotates their order between rounds."""
    root = Path(tempfile.mkdtemp(prefix="kvmem-speed-"))
    nbytes = sum(kv.nbytes for _, kv in blocks)
    try:
        store = _tier(layout, root, nbytes)
        ws, _ = store.open_workspace("bench", np.zeros(0, dtype=np.int32))
        for meta, kv in blocks:
            store.append(ws.id, meta, kv)
        store.close()
        plain_write(root, blocks)
        times: dict[str, float] = {}
        for side in np.roll(["raw", "tier", "view"], -first):
            drop_page_cache(root)
            times[side] = (
                plain_read(root, nbytes)
                if side == "raw"
                else _tier_load_s(layout, root, adapter, blocks, batch if side == "view" else 0)
            )
        return times["raw"], times["tier"], times["view"]
    finally:
        shutil.rmtree(root, ignore_errors=True)


def _tier_load_s(layout: Any, root: Path, adapter: Any, blocks: list[tuple[BlockMeta, BlockKV]], batch: int) -> float:
    """A fresh store on ``root`` (as after a restart) loads ``blocks``; with ``batch`` > 0 they go on into the view."""
    store = _tier(layout, root, sum(kv.nbytes for _, kv in blocks))

    def load(metas: list[BlockMeta]) -> list[BlockKV]:
        got = store.complete_load(store.prepare_load([m.chain_hash for m in metas]))
        assert not got.missing
        return [got.blocks[m.chain_hash] for m in metas]

    try:
        if batch:
            return _to_view_s(adapter, blocks, batch, load)
        t0 = time.perf_counter()
        load([m for m, _ in blocks])
        return time.perf_counter() - t0
    finally:
        store.close()


def _tier(layout: Any, root: Path, nbytes: int) -> BlockStore:
    return BlockStore(layout, cpu_bytes=2 * nbytes, nvme_dir=root / "tier", nvme_bytes=4 * nbytes + (1 << 30))
