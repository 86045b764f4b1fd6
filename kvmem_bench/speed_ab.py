"""One of the torch engine's speed features on and off, on one engine, turn after turn (an A/B on one machine).

``--feature``: ``graphs`` (the DeltaNet prefill's CUDA graphs, ``kvmem_torch.rule_graphs``), ``prefill`` (whole
prefill forwards replayed from CUDA graphs, ``kvmem_torch.graph_steps``), ``snapshots`` (those of them handing out
checkpoint states, the offsets read on the device, or padded to a graph's rows; off: such forwards run eagerly),
``summaries`` (staged blocks summarized where the view is, ``kvmem_torch.staged``; off: on the host), ``moves``
(blocks that stay in the view moved in place, ``Runner.move_cells``; off: dropped and reloaded) or ``scoring``
(retrieval-heads scores from one fused pass over the device index, ``kvmem_torch.score_kernel``; off: the streamed
chunks of logits). The torch speed bench's session (a tool result of ~2.8K tokens a turn, the default view) on
random qwen35 weights of a shape: turns up to ``--workspace`` warm it up (the first compiles the kernels), then
``--rounds`` pairs of turns, one with the feature and one without, in alternating order, so both sides see the same
machine and workspace sizes. Writes ``ab-FEATURE.json`` (every turn's TTFT, each side's median) into ``--out``:

    python -m kvmem_bench.speed_ab --feature graphs --shape 27b --workspace 8000 --rounds 3 --out OUT --model <GGUF>
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
from pathlib import Path
from typing import Any

import torch

from kvmem_bench.speed_session import GREEDY_ONE, Transcript
from kvmem_bench.speed_torch import DEFAULT_VIEW, deltanet_prefill, session_engine
from kvmem_core.contract import StepRequest
from kvmem_core.engine import KVMemEngine

LINES = 100  # log lines a tool result (the quick plan's: ~2.8K tokens)


def set_graphs(adapter: Any, on: bool) -> None:
    adapter.model.rule_graphs.enabled = on


def set_prefill_graphs(adapter: Any, on: bool) -> None:
    adapter.runner.graph_prefill = on


def set_snapshot_graphs(adapter: Any, on: bool) -> None:
    adapter.runner.graph_snapshots = on


def set_summaries(adapter: Any, on: bool) -> None:
    adapter.staged.device_summaries = on


def set_moves(adapter: Any, on: bool) -> None:
    adapter.caps = dataclasses.replace(adapter.caps, moves_cells=on)


def set_fused_scoring(adapter: Any, on: bool) -> None:
    from kvmem_torch import score_kernel

    score_kernel.FUSED = on


FEATURES = {
    "graphs": set_graphs,
    "prefill": set_prefill_graphs,
    "snapshots": set_snapshot_graphs,
    "summaries": set_summaries,
    "moves": set_moves,
    "scoring": set_fused_scoring,
}


class Session:
    """``speed_session``'s transcript sent to ``engine`` one turn at a time."""

    def __init__(self, engine: KVMemEngine, lines: int = LINES) -> None:
        self.engine, self.transcript = engine, Transcript(lines)

    def step(self) -> tuple[int, float]:
        """One more turn. -> (workspace tokens, TTFT in seconds as the engine times it)"""
        messages = self.transcript.add_tool_result()
        result = self.engine.step(StepRequest(messages=messages, sampling=GREEDY_ONE), lambda p: True)
        self.transcript.add_reply()
        return result.prompt_tokens, result.timings["prefill_s"] + result.timings["select_s"]


def run(
    feature: str,
    shape: str,
    model: str | None,
    workspace: int,
    rounds: int,
    device: str = "cuda",
    lines: int = LINES,
    log: Any = print,
) -> dict[str, Any]:
    """The A/B of ``feature`` (``FEATURES``) as a JSON-ready dict (module docstring)."""
    toggle = FEATURES[feature]
    plan = dict(DEFAULT_VIEW, sizes=(workspace + 30 * lines * 2 * rounds,), lines=lines)
    engine = session_engine(shape, model, plan, device)
    adapter = engine.adapter
    session, turns = Session(engine, lines), []
    try:
        while (point := session.step())[0] < workspace:
            log(f"warm-up turn {session.transcript.turns}: {point[0]} tokens, TTFT {point[1]:.3f} s")
        for i in range(rounds):
            for on in (True, False) if i % 2 == 0 else (False, True):
                toggle(adapter, on)
                tokens, ttft = session.step()
                turns.append({feature: on, "workspace_tokens": tokens, "ttft_s": ttft})
                log(f"{feature} {on}: {tokens} tokens, TTFT {ttft:.3f} s")
    finally:
        engine.close()
    side = {on: [t["ttft_s"] for t in turns if t[feature] == on] for on in (True, False)}
    return {
        "feature": feature,
        "shape": shape,
        "device": torch.cuda.get_device_name() if device == "cuda" else device,
        "deltanet_prefill": deltanet_prefill(),
        "view": DEFAULT_VIEW,
        "turns": turns,
        "median_ttft_on_s": statistics.median(side[True]),
        "median_ttft_off_s": statistics.median(side[False]),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--feature", choices=sorted(FEATURES), required=True)
    ap.add_argument("--shape", default="27b")
    ap.add_argument("--model", default=None, help="the GGUF whose tokenizer and template the weights get")
    ap.add_argument("--workspace", type=int, default=8000, help="warm-up turns until the workspace holds this many")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--device", default="cuda", help="cuda, or cpu (the tiny shape: what the host does)")
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    out = run(args.feature, args.shape, args.model, args.workspace, args.rounds, args.device)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"ab-{args.feature}.json").write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
