"""``kvmem serve``: the OpenAI-compatible server and web UI on one engine.

``--dry-run`` prints the resolved configuration and starts nothing. A server this command
started answers ``/health`` with a fingerprint of its configuration: the same configuration
on the same port is reused ("already up"), a different one needs ``--restart``. ``--stop``
stops only a server this command started, found through its pidfile and checked against
the running process.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import signal
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kvmem import devices
from kvmem.compute import add_compute_flags
from kvmem.flags import add_chat_template_flag, add_kvmem_flags, add_list_flag, resolve_config
from kvmem.models import MODEL_HELP
from kvmem.serve_config import (
    DEFAULT_MODEL,
    config_fingerprint,
    describe,
    engine_envs,
    persistence,
    replica_opts,
    sized_host_tier,
    ui_dir,
)
from kvmem_core.config import KVMemConfig
from kvmem_core.errors import ConfigError
from kvmem_core.paths import cache_root

if TYPE_CHECKING:
    from kvmem.server.security import Security


def register(subparsers: argparse._SubParsersAction) -> None:
    env = os.environ.get
    p = subparsers.add_parser("serve", help="serve the OpenAI-compatible API and the web UI")
    p.add_argument(
        "--host", default=env("KVMEM_HOST", "127.0.0.1"), help="bind address (default: 127.0.0.1; env KVMEM_HOST)"
    )
    p.add_argument(
        "--port", type=int, default=int(env("KVMEM_PORT", "8080")), help="port (default: 8080; env KVMEM_PORT)"
    )
    p.add_argument(
        "--api-key",
        default=env("KVMEM_API_KEY"),
        help="require this bearer key on API routes (default: none; env KVMEM_API_KEY)",
    )
    add_list_flag(
        p, "--allowed-hosts", "KVMEM_ALLOWED_HOSTS", "also accept these Host names (a proxy's, a LAN name; * for any)"
    )
    add_list_flag(
        p,
        "--cors-origins",
        "KVMEM_CORS_ORIGINS",
        "let web pages of these origins (http://host:port; * for any) call the API",
    )
    add_list_flag(
        p, "--served-model-name", "KVMEM_SERVED_MODEL_NAME", "names clients may send as `model`, listed by /v1/models"
    )
    p.add_argument(
        "--backend",
        default=env("KVMEM_BACKEND", "auto"),
        choices=devices.BACKENDS,
        help="engine: torch on a GPU for models it supports, else llama.cpp (default: auto; env KVMEM_BACKEND)",
    )
    p.add_argument(
        "--device",
        default=env("KVMEM_DEVICE", "auto"),
        choices=devices.DEVICES,
        help="device (default: auto; env KVMEM_DEVICE)",
    )
    p.add_argument(
        "--gpu",
        type=int,
        default=_int_or_none(env("KVMEM_GPU")),
        help="GPU index when several (default: CUDA_VISIBLE_DEVICES, else the one with most free memory; "
        "env KVMEM_GPU)",
    )
    p.add_argument("--model", default=env("KVMEM_MODEL"), help=f"{MODEL_HELP} (env KVMEM_MODEL)")
    add_chat_template_flag(p)
    p.add_argument(
        "--replicas",
        type=int,
        default=_int_or_none(env("KVMEM_REPLICAS")),
        help="engine processes, each with its own queue; conversations stay on theirs "
        "(default: one per --gpus, else 1; env KVMEM_REPLICAS)",
    )
    add_list_flag(p, "--gpus", "KVMEM_GPUS", "GPU indexes, one engine replica on each")
    p.add_argument("--max-queue", type=int, default=16, help="requests waiting for each engine before 429 (default 16)")
    p.add_argument(
        "--max-tokens-default",
        type=_positive,
        default=env("KVMEM_MAX_TOKENS_DEFAULT"),
        help="longest answer to a request that sets no max_tokens (default: the room left in the workspace, "
        "--ctx less the prompt, as OpenAI does, at most the model's trained context; env KVMEM_MAX_TOKENS_DEFAULT)",
    )
    p.add_argument(
        "--max-body-mb",
        type=_body_mb,
        default=None,
        help="largest request body in MiB (default auto: 16 bytes a token of the workspace, --ctx, at least 8 MiB)",
    )
    p.add_argument(
        "--ui-dir",
        type=Path,
        default=None,
        help="serve the web UI from this folder (default: the installed package kvmem_webui)",
    )
    p.add_argument("--no-ui", action="store_true", help="do not serve the web UI")
    p.add_argument("--dry-run", action="store_true", help="print the resolved configuration and exit")
    p.add_argument(
        "--restart", action="store_true", help="replace a server this command started with another configuration"
    )
    p.add_argument("--stop", action="store_true", help="stop the server this command started on --port")
    add_compute_flags(p)
    add_kvmem_flags(p)
    p.set_defaults(func=run)


def _int_or_none(text: str | None) -> int | None:
    return int(text) if text else None


def _positive(text: str) -> int:
    """A whole number of at least 1, for argparse."""
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"expected a whole number of at least 1, got {text!r}")
    return int(text)


def _body_mb(text: str) -> float | None:
    """``--max-body-mb``: ``auto`` (None) or a positive number of MiB, for argparse."""
    if text == "auto":
        return None
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not 0 < value < float("inf"):
        raise argparse.ArgumentTypeError(f"want a positive number of MiB or auto, got {text!r}")
    return value


def run(args: argparse.Namespace) -> int:
    """Stop, describe, reuse or start a server, as the flags ask."""
    if args.stop:
        return 0 if stop_server(args.port) else 1
    from kvmem.server.security import Security, exposure_warning

    config, sources = resolve_config(args)
    config = sized_host_tier(args, config, sources)
    security = Security(args.host, tuple(args.allowed_hosts), tuple(args.cors_origins))
    warning = exposure_warning(args.host, args.api_key)
    if warning:
        print(f"kvmem: WARNING: {warning}", file=sys.stderr, flush=True)
    placement = devices.resolve(args.backend, args.device, args.gpu)
    fingerprint = config_fingerprint(args, config, placement)
    if args.dry_run:
        print(describe(args, config, sources, placement))
        return 0
    running = probe_health(args.host, args.port)
    if running is not None:
        if running.get("fingerprint") == fingerprint:
            print(f"kvmem: already up on port {args.port} ({running.get('model')})")
            print_urls(args)
            return 0
        if not args.restart:
            raise ConfigError(
                f"a server with another configuration is running on port {args.port}; "
                "add --restart to replace it, or pick another --port"
            )
        if not stop_server(args.port):
            return 1
    return start(args, config, placement, fingerprint, security)


def probe_health(host: str, port: int) -> dict[str, Any] | None:
    """The ``/health`` JSON of a KVMem server on the port, or None if nothing answers there."""
    url = f"http://{_connect_host(host)}:{port}/health"
    try:
        with urllib.request.urlopen(url, timeout=3) as resp:
            return json.loads(resp.read())
    except urllib.error.HTTPError as exc:
        try:
            return json.loads(exc.read())
        except ValueError:
            raise ConfigError(f"port {port} is taken by something that is not a KVMem server") from None
    except (urllib.error.URLError, OSError):
        return None
    except ValueError:
        raise ConfigError(f"port {port} is taken by something that is not a KVMem server") from None


def _connect_host(host: str) -> str:
    return "127.0.0.1" if host in ("0.0.0.0", "", "::") else host


def pidfile(port: int) -> Path:
    """Where this command records the server it started on ``port``."""
    root = Path(os.environ.get("KVMEM_RUN_DIR") or cache_root())
    return root / f"serve-{port}.json"


def stop_server(port: int) -> bool:
    """Stop the server this command started on ``port``; False (and a message) if there is none."""
    path = pidfile(port)
    try:
        record = json.loads(path.read_text())
    except (OSError, ValueError):
        print(f"kvmem: no server started by `kvmem serve` on port {port}", file=sys.stderr)
        return False
    pid = int(record["pid"])
    if not _is_our_server(pid):
        path.unlink(missing_ok=True)
        print(f"kvmem: the server recorded for port {port} (pid {pid}) is no longer running", file=sys.stderr)
        return False
    os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + 30
    while _is_our_server(pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    path.unlink(missing_ok=True)
    print(f"kvmem: stopped the server on port {port} (pid {pid})")
    return True


def _is_our_server(pid: int) -> bool:
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return False
    return b"kvmem" in b" ".join(cmdline) and b"serve" in cmdline


def print_urls(args: argparse.Namespace) -> None:
    base = f"http://{_connect_host(args.host)}:{args.port}"
    if ui_dir(args) is not None:
        print(f"  web UI: {base}/")
    print(f"  API:    {base}/v1", flush=True)


def start(
    args: argparse.Namespace, config: KVMemConfig, placement: devices.Placement, fingerprint: str, security: Security
) -> int:
    """Run the server in the foreground until SIGINT/SIGTERM."""
    from kvmem import protocol as P
    from kvmem.server.app import serve
    from kvmem.server.replicas import make_engine
    from kvmem.server.state import ResponseStore, ServerState

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s", stream=sys.stderr)
    logging.getLogger("kvmem.server").info("config: %s", json.dumps(config.describe(), default=str))
    spec = P.EngineSpec(
        backend=placement.backend,
        model=args.model,
        config=P.config_to_wire(config),
        opts=replica_opts(args, placement, sys.stderr.isatty()),
    )
    engine = make_engine(spec, args.max_queue, engine_envs(args, placement))
    stored = Path(config.nvme_dir) / "responses.sqlite3" if config.nvme_dir else None  # outlives restarts with the KV
    state = ServerState(
        engine=engine,
        config=config,
        api_key=args.api_key or None,
        ui_dir=ui_dir(args),
        fingerprint=fingerprint,
        responses=ResponseStore(stored),
        security=security,
        model_names=tuple(args.served_model_name),
        max_tokens_default=args.max_tokens_default,
    )
    path = pidfile(args.port)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"pid": os.getpid(), "port": args.port, "host": args.host, "fingerprint": fingerprint}))

    def ready() -> None:
        print(f"kvmem: serving {engine.model_id} ({placement.backend} on {placement.device})")
        print_urls(args)

    print(f"kvmem: {persistence(config)}", flush=True)
    print(
        f"kvmem: loading {args.model or DEFAULT_MODEL} on {placement.backend} ({placement.device}); "
        "a model's first start without a shipped profile calibrates its retrieval heads (a few minutes on a CPU)",
        flush=True,
    )
    try:
        limit = None if args.max_body_mb is None else int(args.max_body_mb * (1 << 20))
        asyncio.run(serve(state, args.host, args.port, ready, limit))
    except RuntimeError as exc:
        print(f"kvmem: {exc}", file=sys.stderr)
        return 1
    except OSError as exc:
        print(f"kvmem: cannot listen on {args.host}:{args.port}: {exc.strerror or exc}", file=sys.stderr)
        return 1
    finally:
        if path.is_file() and json.loads(path.read_text()).get("pid") == os.getpid():
            path.unlink()
    return 0
