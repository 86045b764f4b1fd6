"""The ``kvmem`` command: dispatches to one module per subcommand.

Each subcommand module exposes ``register(subparsers)``, which adds its parser and sets
``func`` to a callable taking the parsed args and returning an exit code. User errors
print one line and exit non-zero; they never show a traceback.
"""

from __future__ import annotations

import argparse
import importlib
import sys

from kvmem_core.errors import KVMemError

SUBCOMMANDS = (
    "kvmem.cmd_run",
    "kvmem.cmd_chat",
    "kvmem.cmd_calibrate",
    "kvmem.cmd_bench",
    "kvmem.cmd_test",
    "kvmem.cmd_serve",
    "kvmem.cmd_models",
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvmem", description="Tiered, retrieval-selected KV memory for LLM agents.")
    subparsers = parser.add_subparsers(dest="command")
    for name in SUBCOMMANDS:
        importlib.import_module(name).register(subparsers)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    if extra and not getattr(args, "passthrough", False):
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    args.extra = extra
    if args.command is None:
        parser.print_usage(sys.stderr)
        return 2
    try:
        return int(args.func(args) or 0)
    except KVMemError as exc:
        print(f"kvmem: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
