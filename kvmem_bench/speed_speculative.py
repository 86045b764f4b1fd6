"""Decode speed with speculative decoding (prompt lookup, or a qwen35 model's MTP layer) against without, on four
greedy turns.

``rewrite`` is an agent turn that rewrites a file it has just read (the file is in the transcript, so most lookup
drafts are right); ``story`` asks for new text with nothing to copy; ``edit_json`` and ``explain``, held out from
tuning (``turns``), are one of each kind again (each row names its ``split``). Each round runs both modes on the
same engine, off first, and the rows report each mode's median decode tok/s over the rounds, the ratio, the share
of drafted tokens accepted and whether every round's answers were the same token for token; lookup rows add
``bound``, the most any choice of draft lengths could gain on that answer (``lookup_bound``). Run: ``python -m
kvmem_bench.speed_speculative [--backend llamacpp|torch] [--model NAME|PATH] [--speculative lookup|mtp] [--random
SHAPE] [--device D] [--tokens N] [--rounds R]``; rows are JSON lines. ``kvmem bench speed`` reports one round of
each turn (``speed_row``).
``--random SHAPE`` (torch) runs random qwen35 weights of a ``kvmem_bench.torch_device`` shape with ``--model``'s
tokenizer, with a random MTP layer for ``mtp``: its drafts are as random as its weights, so such a row measures
what drafting and verifying cost, not what MTP gains (acceptance needs trained weights).
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from kvmem_core.config import KVMemConfig
from kvmem_core.contract import SamplingParams, StepRequest
from kvmem_core.engine import KVMemEngine
from kvmem_core.lookup import DRAFT_TOKENS, LookupDrafter
from kvmem_core.prompt import build_prompt

CFG = KVMemConfig(ctx=8192, budget=4096, gen_budget=512, method="full")
# the file the rewrite turn reads back (about 800 tokens): a frozen copy of an earlier lookup.py, so the turn, and
# the answer it gets, do not change when that module does
FILE = Path(__file__).with_name("rewrite_source.txt")


def turns() -> dict[str, tuple[dict[str, str], ...]]:
    """The bench's turns, ``rewrite`` and ``story`` first (the draft budget was shaped on them), then the held-out
    ``edit_json`` (copy with changes: a tool's arguments sent back edited) and ``explain`` (prose), fixed on
    2026-12-05 before any run and never used to tune (``SPLITS``)."""
    source = FILE.read_text()
    return {
        "rewrite": _user(
            f"Here is lookup.py:\n```python\n{source}```\nRewrite the whole file "
            "with LookupDrafter renamed to NgramDrafter. Output only the file."
        ),
        "story": _user("Write a short story about a lighthouse keeper who finds a strange bottle on the shore."),
        "edit_json": _user(
            f"Here is services.json:\n```json\n{json.dumps(_services(), indent=2)}\n```\nReturn the whole "
            "file with every port increased by 1. Output only the JSON."
        ),
        "explain": _user("Explain how a hash table handles collisions, with the trade-offs of each approach."),
    }


SPLITS = {"rewrite": "tuning", "story": "tuning", "edit_json": "held-out", "explain": "held-out"}


def _user(content: str) -> tuple[dict[str, str], ...]:
    return ({"role": "user", "content": content},)


def _services() -> dict[str, Any]:
    """A settings file of 12 services, the same every run."""
    return {
        f"service_{i}": {
            "host": f"10.0.{i}.1",
            "port": 8000 + 7 * i,
            "retries": i % 4,
            "tags": ["api", f"zone-{i % 3}"],
        }
        for i in range(12)
    }


SPEED_ROW_TOKENS = 48  # ``kvmem bench speed``'s row: each turn once a mode, this many tokens


def speed_row(engine: KVMemEngine, tokens: int = SPEED_ROW_TOKENS) -> list[dict[str, Any]]:
    """``kvmem bench speed``'s ``speculative`` rows: ``measure`` on the bench's own engine after its session, one
    round of ``tokens``, for lookup and, where the model carries MTP layers, for MTP (on random weights they show
    what drafting and verifying cost, not what a real model gains; this module's command measures lookup on one)."""
    modes = ("lookup", "mtp") if engine.adapter.caps.draft_head else ("lookup",)
    return [row for mode in modes for row in measure(engine, tokens, rounds=1, mode=mode)]


def measure(engine: KVMemEngine, tokens: int, rounds: int, mode: str = "lookup") -> list[dict[str, Any]]:
    """One row per turn: median decode tok/s off and with ``mode``, their ratio, drafted and accepted tokens, and
    ``same_answer``: whether every round's answer with ``mode`` was off's, token for token (lossless in exact
    arithmetic; a GPU's batched verification may round a near tie the other way). Each turn first runs once
    untimed with ``mode``, so that both modes start from the turn's cached workspace (a first run prefills the turn
    and may capture decode graphs: neither belongs to either mode's rate, and a prefilled view may round differently
    from one restored from the cache), and so that the draft budget's first timings of each forward size, which an
    engine makes once (``draft_budget.ForwardCosts``), fall outside the rounds as they fall outside a served
    agent's later turns."""
    rows = []
    for name, messages in turns().items():
        rates: dict[str, list[float]] = {"off": [], mode: []}
        answers: dict[str, list[tuple[int, ...]]] = {"off": [], mode: []}
        drafted = accepted = 0.0
        engine.step(_greedy(messages, tokens, mode), lambda piece: True)
        for _ in range(rounds):
            for run in rates:
                result = engine.step(_greedy(messages, tokens, run), lambda piece: True)
                t = result.timings
                rates[run].append(t["decode_tokens"] / t["decode_s"])
                answers[run].append(tuple(result.token_ids))
                drafted += t.get("draft_tokens", 0.0)
                accepted += t.get("draft_accepted", 0.0)
        off, on = statistics.median(rates["off"]), statistics.median(rates[mode])
        ratios = engine.forward_costs.ratios(DRAFT_TOKENS + 1)
        bound = {}
        if mode == "lookup" and ratios is not None:
            history = build_prompt(engine.adapter, _greedy(messages, tokens, "off")).ids
            bound["bound"] = round(lookup_bound(history, answers["off"][0], ratios), 3)
        rows.append(
            {
                "turn": name,
                "mode": mode,
                "split": SPLITS[name],
                "off_tok_s": round(off, 2),
                f"{mode}_tok_s": round(on, 2),
                "speedup": round(on / off, 3),
                "accepted_share": round(accepted / drafted, 3) if drafted else 0.0,
                "drafted_per_round": drafted / rounds,
                "same_answer": answers[mode] == answers["off"],
                **bound,
            }
        )
    return rows


def lookup_bound(history: Sequence[int], answer: Sequence[int], ratios: np.ndarray) -> float:
    """The largest decode speedup lookup could give ``answer`` after ``history`` with forwards costing ``ratios``
    (a forward of ``k + 1`` tokens in one-token forwards, ``ForwardCosts.ratios``): each draft's accepted length
    known ahead, the draft lengths chosen for the least total cost (exact, by dynamic programming over the answer;
    the drafts follow from the answer alone). What a draft length policy can reach at best; time outside forwards is
    left out."""
    drafter, n = LookupDrafter(history), len(answer)
    accepted = []
    for i in range(n):
        draft = drafter.propose()
        a = 0
        while a < len(draft) and i + a < n and draft[a] == answer[i + a]:
            a += 1
        accepted.append(a)
        drafter.extend(answer[i : i + 1])
    cost = [0.0] * (n + 1)  # one-token forwards from token i to the end
    for i in range(n - 1, -1, -1):
        most = min(accepted[i], n - i - 1, len(ratios) - 1)
        cost[i] = min(float(ratios[k]) + cost[i + k + 1] for k in range(most + 1))
    return n / cost[0] if n else 1.0


def _greedy(messages: tuple[dict[str, str], ...], tokens: int, mode: str) -> StepRequest:
    return StepRequest(
        messages=messages, sampling=SamplingParams(temperature=0.0, max_tokens=tokens), overrides={"speculative": mode}
    )


def load(
    backend: str, model: str, threads: int | None, device: str | None, random: str | None = None, mtp: bool = False
) -> KVMemEngine:
    """The engine of ``backend`` over ``model`` (a known model's name or a path), with the whole prompt in its view;
    ``random``: torch over random qwen35 weights of that shape (``mtp``: with an MTP layer), ``model``'s tokenizer."""
    from kvmem.models import resolve_model

    path = str(resolve_model(model))
    if random:
        import torch

        from kvmem_bench.torch_device import random_adapter

        device = device or ("cuda" if torch.cuda.is_available() else "cpu")
        adapter = random_adapter(
            random, path, device=device, mtp=mtp, view_tokens=CFG.view_tokens, block_tokens=CFG.block_tokens
        )
        return KVMemEngine(adapter, CFG)
    if backend == "torch":
        from kvmem_torch import create_adapter as torch_adapter

        return KVMemEngine(torch_adapter(path, CFG, device=device, n_threads=threads, progress=False), CFG)
    from kvmem_llamacpp import create_adapter

    return KVMemEngine(create_adapter(path, CFG, n_threads=threads), CFG)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="qwen2.5-coder-0.5b")
    parser.add_argument("--tokens", type=int, default=200)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--backend", choices=("llamacpp", "torch"), default="llamacpp")
    parser.add_argument("--device", default=None, help="torch only: cuda or cpu (default: cuda when present)")
    parser.add_argument("--speculative", choices=("lookup", "mtp"), default="lookup", help="the mode set against off")
    parser.add_argument("--random", default=None, help="torch: random qwen35 weights of this shape (27b, 9b, ...)")
    args = parser.parse_args(argv)
    backend = "torch" if args.random else args.backend
    engine = load(backend, args.model, args.threads, args.device, args.random, args.speculative == "mtp")
    try:
        for row in measure(engine, args.tokens, args.rounds, args.speculative):
            extra = {"weights": f"random {args.random}"} if args.random else {}
            print(json.dumps({"backend": backend, **extra, **row}), flush=True)
    finally:
        engine.close()


if __name__ == "__main__":
    main()
