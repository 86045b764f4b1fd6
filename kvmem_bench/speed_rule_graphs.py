"""The DeltaNet prefill's CUDA graphs (``kvmem_torch.rule_graphs``) on and off, on one engine, turn after turn.

The torch speed bench's session (a tool result of ~2.8K tokens a turn, the default view) on random qwen35 weights of
a shape: turns up to ``--workspace`` warm it up (the first compiles and autotunes the kernels), then ``--rounds``
pairs of turns, one with the graphs and one without, in alternating order, so both sides see the same machine
and workspace sizes. Writes ``rule_graphs.json`` (every turn's TTFT, each side's median) into ``--out``:

    python -m kvmem_bench.speed_rule_graphs --shape 27b --workspace 8000 --rounds 3 --out OUT --model <GGUF>
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path
from typing import Any

import torch

from kvmem_bench.speed_session import GREEDY_ONE, Transcript
from kvmem_bench.speed_torch import DEFAULT_VIEW, deltanet_prefill, index_heads, session_config
from kvmem_core.config import KVMemConfig
from kvmem_core.contract import StepRequest
from kvmem_core.engine import KVMemEngine

LINES = 100  # log lines a tool result (the quick plan's: ~2.8K tokens)


class Session:
    """``speed_session``'s transcript sent to ``engine`` one turn at a time."""

    def __init__(self, engine: KVMemEngine) -> None:
        self.engine, self.transcript = engine, Transcript(LINES)

    def step(self) -> tuple[int, float]:
        """One more turn. -> (workspace tokens, TTFT in seconds as the engine times it)"""
        messages = self.transcript.add_tool_result()
        result = self.engine.step(StepRequest(messages=messages, sampling=GREEDY_ONE), lambda p: True)
        self.transcript.add_reply()
        return result.prompt_tokens, result.timings["prefill_s"] + result.timings["select_s"]


def run(shape: str, model: str, workspace: int, rounds: int, log: Any = print) -> dict[str, Any]:
    """The A/B as a JSON-ready dict (module docstring)."""
    from kvmem.models import resolve_model
    from kvmem_bench.torch_device import random_adapter

    plan = dict(DEFAULT_VIEW, sizes=(workspace + 3000 * 2 * rounds,), lines=LINES)
    adapter = random_adapter(
        shape,
        resolve_model(model),
        device="cuda",
        view_tokens=plan["budget"] + plan["gen"],
        block_tokens=KVMemConfig.block_tokens,
    )
    engine = KVMemEngine(adapter, session_config(plan, adapter.layout.bytes_per_token), heads=index_heads(adapter))
    session, turns = Session(engine), []
    try:
        while (point := session.step())[0] < workspace:
            log(f"warm-up turn {session.transcript.turns}: {point[0]} tokens, TTFT {point[1]:.3f} s")
        for i in range(rounds):
            for graphs in (True, False) if i % 2 == 0 else (False, True):
                adapter.model.rule_graphs.enabled = graphs
                tokens, ttft = session.step()
                turns.append({"graphs": graphs, "workspace_tokens": tokens, "ttft_s": ttft})
                log(f"graphs {graphs}: {tokens} tokens, TTFT {ttft:.3f} s")
    finally:
        engine.close()
    side = {g: [t["ttft_s"] for t in turns if t["graphs"] == g] for g in (True, False)}
    return {
        "shape": shape,
        "device": torch.cuda.get_device_name(),
        "deltanet_prefill": deltanet_prefill(),
        "view": DEFAULT_VIEW,
        "turns": turns,
        "median_ttft_graphs_s": statistics.median(side[True]),
        "median_ttft_eager_s": statistics.median(side[False]),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", default="27b")
    ap.add_argument("--model", default=None, help="the GGUF whose tokenizer and template the weights get")
    ap.add_argument("--workspace", type=int, default=8000, help="warm-up turns until the workspace holds this many")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    out = run(args.shape, args.model, args.workspace, args.rounds)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "rule_graphs.json").write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
