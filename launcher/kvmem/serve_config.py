"""What ``kvmem serve``'s flags resolve to: the engine replicas and their options, the server's
configuration fingerprint, and the ``--dry-run`` description.

The fingerprint covers everything that makes two servers behave differently; ``kvmem serve``
reuses a running server of the same fingerprint and replaces one of another only on ``--restart``.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
from pathlib import Path

from kvmem import devices
from kvmem.compute import compute_opts, describe_compute
from kvmem.flags import chat_template_opts, show_value
from kvmem.models import DEFAULT
from kvmem_core.config import AUTO_GB, KVMemConfig
from kvmem_core.errors import ConfigError
from kvmem_core.threads import THREADS_BATCH_ENV, THREADS_ENV, usable_cores

DEFAULT_MODEL = f"{DEFAULT.name}, {DEFAULT.title}"


ROOM_LEFT = "the room left (at most the model's trained context)"  # an answer's length without max_tokens


def config_fingerprint(args: argparse.Namespace, config: KVMemConfig, placement: devices.Placement) -> str:
    """A short hash of everything that makes two servers behave differently."""
    key = hashlib.sha256(args.api_key.encode()).hexdigest() if args.api_key else None
    gpu = placement.gpu.index if placement.gpu else None
    blob = json.dumps(
        [
            placement.backend,
            placement.device,
            gpu,
            replica_count(args),
            args.gpus,
            args.model,
            config.describe(),
            key,
            args.max_queue,
            args.max_tokens_default,
            ui_dir(args) and str(ui_dir(args)),
            args.allowed_hosts,
            args.cors_origins,
            args.served_model_name,
            args.threads,
            args.threads_batch,
            args.n_gpu_layers,
            args.chat_template,
        ],
        sort_keys=True,
        default=str,
    )
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def replica_count(args: argparse.Namespace) -> int:
    """How many engine processes to run: ``--replicas``, else one per ``--gpus`` entry, else one."""
    count = args.replicas if args.replicas is not None else max(len(args.gpus), 1)
    if count < 1:
        raise ConfigError("--replicas must be at least 1")
    if args.gpus and len(args.gpus) != count:
        raise ConfigError(f"--gpus names {len(args.gpus)} GPUs for {count} replicas; give one GPU per replica")
    if not all(gpu.isdigit() for gpu in args.gpus):
        raise ConfigError("--gpus takes GPU indexes (0,1,...)")
    return count


def sized_host_tier(args: argparse.Namespace, config: KVMemConfig, sources: dict[str, str]) -> KVMemConfig:
    """``config`` with an ``auto`` host tier sized for this server's replicas (``KVMemConfig.with_host_tier``); its
    entry in ``sources`` then reads ``auto``, as ``--dry-run`` shows it."""
    if config.cpu_gb == AUTO_GB:
        sources["cpu_gb"] = "auto"
    return config.with_host_tier(replica_count(args))


def replica_opts(args: argparse.Namespace, placement: devices.Placement, progress: bool) -> dict[str, object]:
    """``engine_opts`` of each replica: on the CPU, without thread counts from the flags or the environment,
    N replicas get cores / N threads each (every core each would oversubscribe the cores N times)."""
    opts = engine_opts(args, placement, progress)
    count = replica_count(args)
    if count == 1 or placement.device != "cpu":
        return opts
    share = max(1, usable_cores() // count)
    if args.threads is None and not os.environ.get(THREADS_ENV):
        opts["n_threads"] = share
        if args.threads_batch is None and not os.environ.get(THREADS_BATCH_ENV):
            opts["n_threads_batch"] = share
    return opts


def engine_envs(args: argparse.Namespace, placement: devices.Placement) -> list[dict[str, str]]:
    """The environment of each engine replica."""
    from kvmem.server.replicas import replica_envs

    vendor = placement.gpu.vendor if placement.gpu else "nvidia"
    return replica_envs(replica_count(args), [int(g) for g in args.gpus], placement.env, devices.VISIBLE_ENV[vendor])


def describe(
    args: argparse.Namespace, config: KVMemConfig, sources: dict[str, str], placement: devices.Placement
) -> str:
    """The ``--dry-run`` text: placement, model, every knob with its source."""
    gpu = placement.gpu
    gpu_text = f"{gpu.index}: {gpu.name} ({gpu.free_mib} MiB free of {gpu.total_mib})" if gpu else "none"
    lines = [
        f"backend   {placement.backend}",
        f"device    {placement.device}",
        f"gpu       {gpu_text} [{placement.reason}]",
        f"replicas  {replica_count(args)}{' on GPUs ' + ','.join(args.gpus) if args.gpus else ''}",
        f"model     {args.model or DEFAULT_MODEL}",
        f"template  {args.chat_template or 'from the model'}",
        f"compute   {describe_compute(replica_opts(args, placement, False))}",
        f"listen    http://{args.host}:{args.port} (auth {'on' if args.api_key else 'off'}, queue {args.max_queue})",
        f"hosts     {', '.join(args.allowed_hosts) or 'the bound address'}; "
        f"CORS {', '.join(args.cors_origins) or 'off'}",
        f"names     {', '.join(args.served_model_name) or 'the model id'}",
        f"answers   up to {args.max_tokens_default or ROOM_LEFT} tokens without max_tokens",
        f"web UI    {ui_dir(args) or 'off'}",
        f"restart   {persistence(config)}",
        "knobs:",
    ]
    width = max(len(name) for name in sources)
    for name, value in config.describe().items():
        lines.append(f"  {name:<{width}}  {show_value(value):<24} ({sources[name]})")
    return "\n".join(lines)


def persistence(config: KVMemConfig) -> str:
    """Whether conversations (their KV, workspaces and stored responses) survive a restart, and why."""
    if config.nvme_dir:
        return (
            f"conversations survive a restart: their KV and workspaces are kept in {config.nvme_dir} "
            f"(up to {config.nvme_gb:g} GiB, --kvmem-nvme-gb)"
        )
    return (
        f"conversations are kept in host RAM only (up to {config.cpu_gb:g} GiB) and a restart loses them; "
        "--kvmem-nvme-dir DIR keeps them on disk"
    )


def ui_dir(args: argparse.Namespace) -> Path | None:
    """The folder the web UI is served from: ``--ui-dir`` or the installed one; None with ``--no-ui`` or where
    the folder holds no ``index.html``."""
    from kvmem.server.app import installed_ui_dir

    if args.no_ui:
        return None
    folder = args.ui_dir or installed_ui_dir()
    return folder if folder is not None and (folder / "index.html").is_file() else None


def engine_opts(args: argparse.Namespace, placement: devices.Placement, progress: bool) -> dict[str, object]:
    """Adapter options for the placement: the torch engine runs on the chosen device (ROCm torch calls it cuda);
    llama.cpp offloads to it, as a requirement when ``--device`` named it."""
    opts: dict[str, object] = {
        "progress": progress,
        **compute_opts(args, placement.backend, args.device),
        **chat_template_opts(args),
    }
    if placement.backend == "torch":
        opts["device"] = "cpu" if placement.device == "cpu" else "cuda"
    return opts
