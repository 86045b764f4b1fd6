"""``kvmem calibrate``: rank a model's retrieval heads on synthetic documents and cache the profile."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from kvmem.cmd_run import add_model_flags
from kvmem.compute import compute_opts
from kvmem.engines import adapter_factory
from kvmem.models import resolve_model
from kvmem.profiles import N_DOCS, cache_dir, run_calibration, save_profile
from kvmem_core.config import KVMemConfig


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("calibrate", help="calibrate a model's retrieval heads (cached per model file)")
    parser.add_argument("--docs", type=int, default=N_DOCS, help=f"synthetic documents to run (default: {N_DOCS})")
    parser.add_argument("--out", type=Path, default=None, help=f"profile folder (default: {cache_dir()})")
    add_model_flags(parser)
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    path = resolve_model(args.model)
    adapter = adapter_factory(args.backend)(str(path), KVMemConfig(), **compute_opts(args, args.backend))
    try:
        profile = run_calibration(adapter, n_docs=args.docs, progress=sys.stderr.isatty())
    finally:
        adapter.close()
    out = save_profile(profile, args.out or cache_dir())
    heads = ",".join(f"{layer}:{head}" for layer, head in profile.heads)
    print(
        f"retrieval heads {heads} (found the fact in {profile.fit_hit_rate:.0%} of {profile.n_docs} documents, "
        f"{profile.holdout_hit_rate:.0%} of {profile.n_holdout} held out) -> {out}"
    )
    return 0
