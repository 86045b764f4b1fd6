"""``kvmem bench``: benchmarks. ``speed``: decode, turn-2 time to first token, block transfer."""
from __future__ import annotations

import argparse
import json

from kvmem.cmd_run import BACKENDS


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("bench", help="benchmarks (speed)")
    suites = parser.add_subparsers(dest="suite", required=True)
    speed = suites.add_parser("speed", help="decode vs plain engine, turn-2 TTFT with reuse, block export/import")
    speed.add_argument("--backend", default="llama.cpp", choices=BACKENDS, help="engine backend (default: llama.cpp)")
    speed.add_argument("--model", default=None, help="GGUF file (default: the embedded model)")
    speed.add_argument("--decode-tokens", type=int, default=64, help="tokens decoded per side (default: 64)")
    speed.add_argument("--json", action="store_true", help="print one JSON object")
    speed.set_defaults(func=run_speed_cmd)
    from kvmem.bench import quality

    quality_parser = suites.add_parser("quality", help="answer accuracy of every selection method on agent sessions")
    quality.add_arguments(quality_parser)
    quality_parser.set_defaults(func=quality.run)


def run_speed_cmd(args: argparse.Namespace) -> int:
    from kvmem.bench.speed import run_speed
    from kvmem.models import resolve_model

    result = run_speed(args.backend, str(resolve_model(args.model)), decode_tokens=args.decode_tokens)
    if args.json:
        print(json.dumps(result))
        return 0
    d, t, b = result["decode"], result["turn2_ttft"], result["blocks"]
    print(f"decode   kvmem {d['kvmem_tok_s']} tok/s  plain {d['plain_tok_s']} tok/s  ratio {d['ratio']}")
    print(f"turn 2   ttft reuse {t['reuse_s']} s  cold {t['cold_s']} s  speedup {t['speedup']}x "
          f"({t['cached_tokens']}/{t['prompt_tokens']} tokens cached)")
    print(f"blocks   export {b['export_mb_s']} MB/s  import {b['import_mb_s']} MB/s  ({b['block_mb']} MB per block)")
    return 0
