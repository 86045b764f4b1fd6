"""``kvmem chat``: an interactive multi-turn chat that resends the whole transcript each turn.

Resending is what agents do; KVMem matches the transcript against the stored workspace, so
each turn prefills only its new messages. ``/reset`` starts over, ``/exit`` (or EOF) quits.
"""

from __future__ import annotations

import argparse
import sys

from kvmem_core.contract import StepRequest
from kvmem.cmd_run import add_engine_flags, generate_streamed, open_engine, sampling, stats, stats_line


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("chat", help="interactive multi-turn chat (the transcript is resent every turn)")
    parser.add_argument("--system", default=None, help="a system message")
    parser.add_argument("--quiet", action="store_true", help="no stats line after each answer")
    add_engine_flags(parser)
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    engine = open_engine(args)
    base = [{"role": "system", "content": args.system}] if args.system else []
    messages = list(base)
    prompt = "you> " if sys.stdin.isatty() else ""
    try:
        while True:
            try:
                line = input(prompt).strip()
            except EOFError:
                break
            if line in ("/exit", "/quit"):
                break
            if line == "/reset":
                messages = list(base)
                continue
            if not line:
                continue
            messages.append({"role": "user", "content": line})
            result = generate_streamed(engine, StepRequest(messages=tuple(messages), sampling=sampling(args)))
            print(flush=True)
            messages.append({"role": "assistant", "content": result.text})
            if not args.quiet:
                print(stats_line(stats(engine, result)), file=sys.stderr, flush=True)
    finally:
        engine.close()
    return 0
