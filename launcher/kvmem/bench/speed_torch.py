"""``kvmem bench speed --backend torch``: the torch engine on a random-weight qwen35 model.

The model has no tokenizer, so the KVMem step runs at the level of the engine's ``Runner``
(the paged view ``TorchAdapter`` wraps), phase by phase as ``KVMemEngine`` runs it:

- **turn-N TTFT**: a stateless engine prefills history + new turn from empty (real
  prefill); KVMem, with the history archived as blocks in host memory and the previous
  step's view resident, prefills the new turn only, archives its blocks, scores the
  retrieval index, materializes the selected blocks, restores the recurrent state at the
  replay point and replays the query;
- **decode vs workspace**: a synthesized workspace (random KV blocks in a block-major host
  tier, pinned on CUDA, and a retrieval index of a few heads' keys) grows while the view
  stays fixed; each size times one selection + materialization and then decode;
- **dense**: the same decode with the whole workspace in the view, at each size that fits.

Every figure comes with its floor: bytes moved over the bandwidth measured in the same run.
"""
from __future__ import annotations

import os
import shutil
import tempfile
import time
from typing import Any, Callable

import torch

from kvmem.bench.speed_common import floor_s, ratio

PLANS = {
    "full": dict(view=32768, workspaces=(32768, 131072, 524288, 1048576), histories=(65536, 131072), turn=512,
                 replay=256, decode=32, hf=True),
    "quick": dict(view=32768, workspaces=(32768, 262144), histories=(65536,), turn=512, replay=256, decode=16, hf=False),
    "cpu": dict(view=1024, workspaces=(1024, 8192), histories=(2048,), turn=256, replay=128, decode=4, hf=False),
}
INDEX_HEADS = 3  # retrieval heads whose full keys the index keeps (the calibrated profile's size)
QUERY_TOKENS = 16
GB = 1e9


def run(*, quick: bool, shape: str | None = None, plan: dict[str, Any] | None = None,
        log: Callable[[str], None] = print) -> dict[str, Any]:
    """Every torch speed figure as a JSON-ready dict (contract keys first). CUDA: the 27b shape; CPU: tiny."""
    from kvmem_torch.bench import SHAPES, qwen35_spec
    from kvmem_torch.model import Model
    from kvmem_torch.tiny import random_weights

    cuda = torch.cuda.is_available()
    shape = shape or ("27b" if cuda else "tiny")
    if plan is None:
        plan = PLANS[("quick" if quick else "full") if cuda else "cpu"]
    assert shape in SHAPES, f"unknown shape {shape}"
    torch.manual_seed(0)
    spec = qwen35_spec(shape)
    dev = torch.device("cuda" if cuda else "cpu")
    t = time.perf_counter()
    model = Model(spec, random_weights(spec, torch.bfloat16 if cuda else torch.float32, dev))
    weights = sum(w.nbytes for _, _, ws in model.layers for w in ws.values()) + model.lm_head.nbytes
    log(f"{shape}: {weights / GB:.2f} GB of weights built in {time.perf_counter() - t:.1f} s")
    bench = TorchSpeed(model, plan, weights, log)
    out = bench.measure()
    out = {"backend": "torch", "model": f"random-qwen35-{shape}", **out, "shape": shape, "plan": plan,
           "device": torch.cuda.get_device_name() if cuda else "cpu"}
    if plan["hf"] and cuda:
        from kvmem_torch.bench import hf_decode_ms

        bench.release()
        del model, bench
        torch.cuda.empty_cache()
        hf_ms = hf_decode_ms(spec)
        ours = out["points"][0]["kvmem_tok_s"]
        out["hf_generate"] = {"ms_per_token": hf_ms, "kvmem_speedup": ratio(ours, 1e3 / hf_ms)}
    return out


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


class TorchSpeed:
    """One model, a host tier and a retrieval index sized for the largest workspace, and the measurements."""

    def __init__(self, model: Any, plan: dict[str, Any], weight_bytes: int, log: Callable[[str], None]) -> None:
        from kvmem_torch.runner import Runner

        self.model, self.plan, self.weights, self.log = model, plan, weight_bytes, log
        self.B = B = 128
        self.cuda = model.device.type == "cuda"
        self.runner = Runner(model, (max(*plan["histories"], plan["view"]) + 2 * plan["turn"]) // B + 8, B)
        self.block_bytes = self.runner.cache.block_nbytes
        n_host = max(max(plan["workspaces"]), max(plan["histories"]) + plan["turn"]) // B
        t, shape = time.perf_counter(), (n_host, *self.runner.cache.kv.shape[1:])
        try:
            self.host = torch.empty(shape, dtype=self.runner.cache.kv.dtype, pin_memory=self.cuda)
            self.pinned = self.cuda
        except RuntimeError:  # the host could not pin that much: pageable memory, reported as such
            self.host, self.pinned = torch.empty(shape, dtype=self.runner.cache.kv.dtype), False
        log(f"host tier: {self.host.nbytes / GB:.1f} GB (pinned: {self.pinned}) in {time.perf_counter() - t:.1f} s")
        hd = model.spec.head_dim
        self.index = torch.randn(n_host * B, INDEX_HEADS, hd, device=model.device, dtype=self.runner.cache.kv.dtype)

    def release(self) -> None:
        """Free the host tier (the runner and index are freed by ``measure``)."""
        del self.host

    def measure(self) -> dict[str, Any]:
        p = self.plan
        bw = self.bandwidths()
        self.log(f"bandwidths {bw}")
        ttft = [self.ttft(h, p["turn"], p["replay"]) for h in p["histories"]]
        for t in ttft:
            self.log(f"ttft at {t['history_tokens']} history tokens: reuse {t['reuse_ttft_s']:.3f} s, "
                     f"re-prefill {t['reprefill_ttft_s']:.2f} s")
        self.synthesize(max(p["histories"]) // self.B)
        points = [self.decode_point(w, bw) for w in p["workspaces"]]
        nvme = self.nvme()
        self.runner.clear()
        del self.runner, self.index
        torch.cuda.empty_cache() if self.cuda else None
        dense = self.dense(points, bw)
        kv_token = self.block_bytes / self.B
        host_ratios = [pt["materialize_GBps"] / bw["pinned_h2d_GBps"] for pt in points]
        flatness = ratio(points[-1]["kvmem_tok_s"], points[0]["kvmem_tok_s"])
        return {"ttft_speedup": ttft[-1]["speedup"], "decode_flatness": flatness, "nvme_vs_raw": nvme.get("read_ratio"),
                "host_vs_raw": sorted(host_ratios)[len(host_ratios) // 2], "host_tier_pinned": self.pinned,
                "weights_GB": self.weights / GB, "kv_bytes_per_token": kv_token, "bandwidths": bw, "ttft": ttft,
                "points": points, "dense": dense, "nvme": nvme, "capacity": self.capacity(kv_token, dense)}

    # ---- pieces --------------------------------------------------------------------------

    def bandwidths(self) -> dict[str, float]:
        if self.cuda:
            from kvmem_torch.bench import bandwidths

            return bandwidths(self.block_bytes)
        a = torch.empty(1 << 26, dtype=torch.uint8)
        b = torch.empty_like(a)
        sec = min(_seconds(lambda: b.copy_(a)) for _ in range(3))
        return {"hbm_copy_GBps": 2 * a.nbytes / sec / GB, "pinned_h2d_GBps": a.nbytes / sec / GB}

    def synthesize(self, start: int) -> None:
        """Random KV for host blocks ``start:`` (generated on the device, copied down in chunks)."""
        chunk = 64
        for i in range(start, self.host.shape[0], chunk):
            part = self.host[i:i + chunk]
            part.copy_(torch.randn(part.shape, device=self.model.device, dtype=part.dtype))

    def ttft(self, history: int, turn: int, replay: int) -> dict[str, Any]:
        """Turn-N time to first token: stateless re-prefill of history + turn vs KVMem's step over stored history."""
        r, B, V = self.runner, self.B, self.plan["view"]
        ids = torch.randint(0, self.model.spec.vocab_size, (history + turn,)).tolist()
        r.clear()
        sync()
        t0 = time.perf_counter()
        _, snaps = r.prefill(ids, list(range(history + turn)), chunk=2048, snapshot_at=[history])
        sync()
        cold = time.perf_counter() - t0
        for b in range(history // B):  # the archive earlier turns made
            k, v = r.read_cells(b * B, B)
            self.host[b, 0].copy_(k)
            self.host[b, 1].copy_(v)
        prev = [0, *range(history // B - (V - turn) // B + 1, history // B)]  # sink + recent: the previous step's view
        r.clear()
        for b in prev:
            r.insert_block(self.host[b, 0], self.host[b, 1], range(b * B, (b + 1) * B))
        r.state.restore(snaps[history])
        sync()
        phases = self.reuse_turn(ids[history:], history, replay, set(prev))
        reuse = sum(phases.values())
        return {"history_tokens": history, "turn_tokens": turn, "replayed_tokens": replay, "view_tokens": V,
                "reprefill_ttft_s": cold, "reuse_ttft_s": reuse, "speedup": ratio(cold, reuse), "phases_s": phases}

    def reuse_turn(self, turn: list[int], history: int, replay: int, resident: set[int]) -> dict[str, float]:
        """KVMem's step for a new turn: prefill, archive, select, materialize, restore state, replay."""
        r, B, V, n = self.runner, self.B, self.plan["view"], len(turn)
        clock = _Phases()
        r.forward(turn[:n - replay], list(range(history, history + n - replay)))
        snap = r.state.snapshot()
        r.forward(turn[n - replay:], list(range(history + n - replay, history + n)))
        clock.lap("prefill")
        for b in range(history // B, (history + n) // B):
            k, v = r.read_cells(b * B, B)
            self.host[b, 0].copy_(k, non_blocking=True)
            self.host[b, 1].copy_(v, non_blocking=True)
        clock.lap("archive")
        r0 = history + n - replay  # replayed tokens are appended again after the new view
        recent = set(range(history // B, r0 // B))
        chosen = self.select(r0 // B, (V - replay) // B - len(recent) - 1) | {0} | recent
        clock.lap("select")
        self.materialize(chosen, resident | recent, drop_from=r0)
        clock.lap("materialize")
        r.state.restore(snap)
        r.forward(turn[n - replay:], list(range(history + n - replay, history + n)))
        clock.lap("replay")
        return clock.laps

    def select(self, n_blocks: int, k: int) -> set[int]:
        """Top-``k`` of the first ``n_blocks`` blocks by attention mass of the query on the index heads."""
        keys = self.index[:n_blocks * self.B]  # [tokens, heads, hd]
        q = torch.randn(QUERY_TOKENS, INDEX_HEADS, keys.shape[-1], device=keys.device, dtype=keys.dtype)
        logits = torch.einsum("qhd,thd->hqt", q, keys).float() / keys.shape[-1] ** 0.5
        mass = logits.softmax(-1).sum((0, 1)).view(n_blocks, self.B).sum(-1)
        return set(mass.topk(min(k, n_blocks)).indices.tolist())

    def materialize(self, target: set[int], resident: set[int], drop_from: int | None = None) -> int:
        """Drop resident blocks not in ``target`` (and cells from ``drop_from``), load the missing ones; -> loaded."""
        r, B = self.runner, self.B
        if drop_from is not None:
            r.drop(drop_from, 1 << 62)
        for b in resident - target:
            r.drop(b * B, (b + 1) * B)
        missing = sorted(target - (resident & target))
        for b in missing:
            r.insert_block(self.host[b, 0], self.host[b, 1], range(b * B, (b + 1) * B))
        sync()
        return len(missing)

    def decode_point(self, workspace: int, bw: dict[str, float]) -> dict[str, Any]:
        """One selection + materialization over ``workspace`` tokens, then decode with the fixed view."""
        r, B, V = self.runner, self.B, self.plan["view"]
        n_blocks = workspace // B
        r.clear()
        clock = _Phases()
        chosen = self.select(n_blocks - 1, V // B - 1) | {n_blocks - 1}  # the newest block is always in view
        clock.lap("select")
        loaded = self.materialize(chosen, set())
        clock.lap("materialize")
        tok_s = self.decode_rate(workspace, self.plan["decode"])
        view_bytes = len(chosen) * self.block_bytes
        floor = floor_s(self.weights + view_bytes, bw["hbm_copy_GBps"])
        moved = loaded * self.block_bytes
        pt = {"workspace_tokens": workspace, "view_tokens": len(chosen) * B, "kvmem_tok_s": tok_s,
              "floor_tok_s": 1 / floor, "fraction_of_floor": tok_s * floor, "select_s": clock.laps["select"],
              "materialize_s": clock.laps["materialize"], "materialized_blocks": loaded,
              "materialize_GBps": moved / clock.laps["materialize"] / GB,
              "materialize_floor_s": floor_s(moved, bw["pinned_h2d_GBps"]),
              "host_tier_GB": workspace * self.block_bytes / B / GB, "rss_mb": _rss_mb()}
        self.log(f"workspace {workspace}: decode {tok_s:.1f} tok/s (floor {1 / floor:.1f}), "
                 f"select {pt['select_s'] * 1e3:.1f} ms, materialize {pt['materialize_s'] * 1e3:.0f} ms "
                 f"({pt['materialize_GBps']:.1f} GB/s)")
        return pt

    def decode_rate(self, start: int, steps: int, runner: Any = None) -> float:
        """Tokens per second decoding ``steps`` tokens after one warm-up (graphs on CUDA)."""
        r = runner or self.runner
        r.forward([1], [start])
        sync()
        t0 = time.perf_counter()
        for i in range(steps):
            r.forward([1], [start + 1 + i])
        sync()
        return steps / (time.perf_counter() - t0)

    def dense(self, points: list[dict[str, Any]], bw: dict[str, float]) -> list[dict[str, Any]]:
        """Decode with the whole workspace in the view at each measured size, up to the first that does not fit;
        each next to KVMem's decode there and the bytes ratio (weights + all KV) / (weights + view KV)."""
        out, kv = [], self.block_bytes / self.B
        for pt in points:
            n = pt["workspace_tokens"]
            try:
                tok_s = self.dense_rate(n)
            except torch.cuda.OutOfMemoryError:
                self.log(f"dense {n}: out of GPU memory")
                torch.cuda.empty_cache()
                break
            theory = (self.weights + n * kv) / (self.weights + pt["view_tokens"] * kv)
            speedup = ratio(pt["kvmem_tok_s"], tok_s)
            pt["full_tok_s"] = tok_s
            out.append({"workspace_tokens": n, "dense_tok_s": tok_s,
                        "floor_tok_s": 1 / floor_s(self.weights + n * kv, bw["hbm_copy_GBps"]),
                        "theoretical_ratio": theory, "kvmem_speedup": speedup,
                        "fraction_of_theory": None if speedup is None else speedup / theory})
            self.log(f"dense {n}: {tok_s:.1f} tok/s, theory ratio {theory:.3f}, kvmem speedup {speedup:.2f}")
        return out

    def dense_rate(self, n: int) -> float:
        from kvmem_torch.bench import fill_view
        from kvmem_torch.runner import Runner

        runner = Runner(self.model, n // self.B + 4, self.B)
        try:
            fill_view(runner, n) if self.cuda else _fill_cpu(runner, n)
            return self.decode_rate(n, self.plan["decode"], runner)
        finally:
            del runner
            torch.cuda.empty_cache() if self.cuda else None

    def nvme(self) -> dict[str, Any]:
        """The NVMe tier against plain file reads of the same bytes on this machine's disk (kvmem_core.bench_store)."""
        from kvmem_core.bench_store import measure_nvme
        from kvmem_core.layout import BlockLayout

        s = self.model.spec
        layout = BlockLayout(len(s.attention_layers), s.n_kv_heads, s.head_dim, s.n_heads, self.B, "float16")
        root = tempfile.mkdtemp(prefix="kvmem-nvme-", dir=os.environ.get("KVMEM_BENCH_DISK"))
        try:
            return measure_nvme(root, layout, n_blocks=32 if self.cuda else 4, rounds=3)
        finally:
            shutil.rmtree(root, ignore_errors=True)

    def capacity(self, kv_token: float, dense: list[dict[str, Any]]) -> dict[str, Any]:
        """Largest workspace each way on this machine (computed): KVMem in host RAM + disk, dense in GPU memory
        minus the weights."""
        with open("/proc/meminfo") as f:
            mem = {k: int(v.split()[0]) * 1024 for k, v in (line.split(":", 1) for line in f)}
        disk = shutil.disk_usage(tempfile.gettempdir()).free
        gpu_total = torch.cuda.mem_get_info()[1] if self.cuda else 0
        kvmem_tokens = (mem["MemTotal"] + disk) / kv_token
        dense_tokens = max(0.0, gpu_total - self.weights) / kv_token
        return {"host_ram_GB": mem["MemTotal"] / GB, "disk_free_GB": disk / GB, "gpu_GB": gpu_total / GB,
                "kvmem_max_tokens": int(kvmem_tokens), "dense_max_tokens": int(dense_tokens),
                "ratio": ratio(kvmem_tokens, dense_tokens), "largest_run": max(self.plan["workspaces"]),
                "largest_dense_run": dense[-1]["workspace_tokens"] if dense else None}


class _Phases:
    """Wall-clock laps, each ending with a device sync."""

    def __init__(self) -> None:
        self.laps: dict[str, float] = {}
        sync()
        self.t = time.perf_counter()

    def lap(self, name: str) -> None:
        sync()
        now = time.perf_counter()
        self.laps[name] = now - self.t
        self.t = now


def _seconds(fn: Callable[[], object]) -> float:
    t0 = time.perf_counter()
    fn()
    sync()
    return time.perf_counter() - t0


def _fill_cpu(runner: Any, n: int) -> None:
    kv = runner.cache.kv
    for i in range(n // runner.B):
        k = torch.randn(kv.shape[2:], dtype=kv.dtype)
        runner.insert_block(k, k, list(range(i * runner.B, (i + 1) * runner.B)))


def _rss_mb() -> float:
    from kvmem.bench.speed_common import rss_mb

    return rss_mb()[0]
