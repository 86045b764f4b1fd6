"""``kvmem run``: one generation on a model (the default, Qwen2.5-Coder-0.5B, without ``--model``), streamed."""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any

from kvmem_core.contract import Engine, SamplingParams, StepRequest, StepResult
from kvmem.compute import add_compute_flags, compute_opts
from kvmem.flags import add_chat_template_flag, add_kvmem_flags, chat_template_opts, resolve_config
from kvmem.models import DEFAULT, MODEL_HELP

BACKENDS = ("llama.cpp", "torch")


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("run", help="one generation, streamed, then a stats line")
    parser.add_argument("-p", "--prompt", required=True, help="the user message (or raw text with --raw)")
    parser.add_argument("--system", default=None, help="a system message (mandatory history)")
    parser.add_argument("--raw", action="store_true", help="send the prompt as raw text, without the chat template")
    parser.add_argument(
        "--json", action="store_true", help='print one JSON object {"text", "ids", "stats"} instead of streaming'
    )
    add_engine_flags(parser)
    parser.set_defaults(func=run)


def add_engine_flags(parser: argparse.ArgumentParser) -> None:
    """Sampling, model and KVMem flags: what a command that loads an engine and generates takes."""
    add_sampling_flags(parser)
    add_model_flags(parser)
    add_chat_template_flag(parser)
    add_kvmem_flags(parser)


def add_sampling_flags(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("sampling")
    group.add_argument("-n", "--max-tokens", type=int, default=256, help="tokens to generate at most (default: 256)")
    group.add_argument("--temp", type=float, default=0.0, help="temperature, 0 is greedy (default: 0)")
    group.add_argument("--top-p", type=float, default=0.95, help="nucleus sampling mass (default: 0.95)")
    group.add_argument("--top-k", type=int, default=40, help="top-k, 0 disables (default: 40)")
    group.add_argument("--seed", type=int, default=None, help="sampling seed (default: random)")


def add_model_flags(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("model")
    group.add_argument("--model", default=os.environ.get("KVMEM_MODEL"), help=f"{MODEL_HELP} (env KVMEM_MODEL)")
    group.add_argument("--backend", default="llama.cpp", choices=BACKENDS, help="engine backend (default: llama.cpp)")
    add_compute_flags(parser)


def sampling(args: argparse.Namespace) -> SamplingParams:
    return SamplingParams(
        temperature=args.temp, top_p=args.top_p, top_k=args.top_k, seed=args.seed, max_tokens=args.max_tokens
    )


def open_engine(args: argparse.Namespace) -> Engine:
    """Load the engine the flags describe, with a progress bar on stderr while it loads."""
    from tqdm import tqdm

    from kvmem.engines import load_engine

    config, _ = resolve_config(args)
    with tqdm(
        total=1,
        desc=f"kvmem: loading {args.model or DEFAULT.name}",
        file=sys.stderr,
        leave=False,
        disable=not sys.stderr.isatty(),
    ) as bar:
        engine = load_engine(
            args.backend,
            args.model,
            config,
            progress=sys.stderr.isatty(),
            **compute_opts(args, args.backend),
            **chat_template_opts(args),
        )
        bar.update(1)
    return engine


def run(args: argparse.Namespace) -> int:
    engine = open_engine(args)
    try:
        request = make_request(args)
        if args.json:
            result = engine.step(request, lambda piece: True)
            print(json.dumps({"text": result.text, "ids": list(result.token_ids), "stats": stats(engine, result)}))
        else:
            result = generate_streamed(engine, request)
            print(file=sys.stdout)
            print(stats_line(stats(engine, result)), file=sys.stderr)
    finally:
        engine.close()
    return 0


def make_request(args: argparse.Namespace) -> StepRequest:
    if args.raw:
        return StepRequest(prompt=args.prompt, sampling=sampling(args))
    messages = ([{"role": "system", "content": args.system}] if args.system else []) + [
        {"role": "user", "content": args.prompt}
    ]
    return StepRequest(messages=tuple(messages), sampling=sampling(args))


def generate_streamed(engine: Engine, request: StepRequest) -> StepResult:
    """Run one step writing text to stdout as it comes, with a progress bar over long prefills."""
    from tqdm import tqdm

    bar = None

    def on_prefill(done: int, total: int) -> None:
        nonlocal bar
        if bar is None and total > 1024 and sys.stderr.isatty():
            bar = tqdm(total=total, desc="kvmem: prefill", unit="tok", file=sys.stderr, leave=False)
        if bar is not None:
            bar.n = done
            bar.refresh()

    def on_text(piece: str) -> bool:
        if bar is not None:
            bar.close()
        sys.stdout.write(piece)
        sys.stdout.flush()
        return True

    setattr(engine, "prefill_progress", on_prefill)
    try:
        return engine.step(request, on_text)
    finally:
        if bar is not None:
            bar.close()


def stats(engine: Engine, result: StepResult) -> dict[str, Any]:
    """Prompt and cache-hit tokens, prefill and decode speed, blocks per tier, the selection, the backend and
    device the engine runs on."""
    t = result.timings
    m = engine.metrics()
    caps = engine.adapter.caps
    return {
        "backend": caps.backend,
        "device": caps.devices[0],
        "prompt_tokens": result.prompt_tokens,
        "cached_tokens": result.cached_tokens,
        "completion_tokens": result.completion_tokens,
        "finish_reason": result.finish_reason,
        "prefill_tok_s": round(t["prefill_tokens"] / t["prefill_s"], 1) if t.get("prefill_s") else 0.0,
        "decode_tok_s": round(t["decode_tokens"] / t["decode_s"], 1) if t.get("decode_s") else 0.0,
        "host_blocks": int(m.get("store_host_blocks", 0)),
        "nvme_blocks": int(m.get("store_nvme_blocks", 0)),
        "workspace_id": result.workspace_id,
        "selection": result.selection,
    }


def stats_line(s: dict[str, Any]) -> str:
    sel = s["selection"]
    return (
        f"[kvmem] prompt {s['prompt_tokens']} tok (cache hit {s['cached_tokens']}) | "
        f"prefill {s['prefill_tok_s']} tok/s | decode {s['decode_tok_s']} tok/s | "
        f"blocks host {s['host_blocks']} nvme {s['nvme_blocks']} | {sel.get('method')} ({sel.get('position_mode')}) | "
        f"{s['backend']} on {s['device']}"
    )
