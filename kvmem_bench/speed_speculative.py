"""Decode speed with prompt-lookup speculative decoding against without, on two greedy turns.

``rewrite`` is an agent turn that rewrites a file it has just read (the file is in the transcript, so most drafts
are right); ``story`` asks for new text with nothing to copy. Each round runs both modes on the same engine, off
first, and the rows report each mode's median decode tok/s over the rounds, the ratio, and the share of drafted
tokens accepted. Run: ``python -m kvmem_bench.speed_speculative [--model NAME] [--tokens N] [--rounds R]``.
"""
from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path
from typing import Any

import kvmem_core.lookup
from kvmem_core.config import KVMemConfig
from kvmem_core.contract import SamplingParams, StepRequest
from kvmem_core.engine import KVMemEngine

CFG = KVMemConfig(ctx=8192, budget=4096, gen_budget=512, method="full")
FILE = Path(kvmem_core.lookup.__file__)  # a file of this project, about 800 tokens


def turns() -> dict[str, tuple[dict[str, str], ...]]:
    source = FILE.read_text()
    return {
        "rewrite": ({"role": "user", "content": f"Here is lookup.py:\n```python\n{source}```\nRewrite the whole file "
                                                "with LookupDrafter renamed to NgramDrafter. Output only the file."},),
        "story": ({"role": "user", "content": "Write a short story about a lighthouse keeper who finds a strange "
                                              "bottle on the shore."},),
    }


def measure(engine: KVMemEngine, tokens: int, rounds: int) -> list[dict[str, Any]]:
    """One row per turn: median decode tok/s off and with lookup, their ratio, drafted and accepted tokens."""
    rows = []
    for name, messages in turns().items():
        rates: dict[str, list[float]] = {"off": [], "lookup": []}
        drafted = accepted = 0.0
        for _ in range(rounds):
            for mode in rates:
                request = StepRequest(messages=messages, sampling=SamplingParams(temperature=0.0, max_tokens=tokens),
                                      overrides={"speculative": mode})
                t = engine.step(request, lambda piece: True).timings
                rates[mode].append(t["decode_tokens"] / t["decode_s"])
                drafted += t.get("draft_tokens", 0.0)
                accepted += t.get("draft_accepted", 0.0)
        off, on = statistics.median(rates["off"]), statistics.median(rates["lookup"])
        rows.append({"turn": name, "off_tok_s": round(off, 2), "lookup_tok_s": round(on, 2),
                     "speedup": round(on / off, 3), "accepted_share": round(accepted / drafted, 3) if drafted else 0.0,
                     "drafted_per_round": drafted / rounds})
    return rows


def main(argv: list[str] | None = None) -> None:
    from kvmem.models import resolve_model
    from kvmem_llamacpp import create_adapter

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="qwen2.5-coder-0.5b")
    parser.add_argument("--tokens", type=int, default=200)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=None)
    args = parser.parse_args(argv)
    engine = KVMemEngine(create_adapter(str(resolve_model(args.model)), CFG, n_threads=args.threads), CFG)
    try:
        for row in measure(engine, args.tokens, args.rounds):
            print(json.dumps(row), flush=True)
    finally:
        engine.close()


if __name__ == "__main__":
    main()
