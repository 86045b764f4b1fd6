"""KVMem's CLI flags: one definition per knob, each also read from ``KVMEM_*``.

``--kvmem-budget`` reads ``KVMEM_BUDGET``, ``--ctx`` reads ``KVMEM_CTX``. The resolved
config remembers where each value came from (flag, env or default) for ``--dry-run``.
"""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from kvmem_core.config import (
    AUTO_CTX,
    AUTO_GB,
    FIELD_HELP,
    KV_DTYPES,
    METHOD_ALIASES,
    METHODS,
    POSITION_MODES,
    RECURRENT_MODES,
    RETENTIONS,
    SCORER_ALIASES,
    SCORERS,
    SPECULATIVE_MODES,
    KVMemConfig,
    parse_retrieval_heads,
)
from kvmem_core.errors import ConfigError

_DEFAULTS = KVMemConfig()


@dataclass(frozen=True)
class Knob:
    """One config field exposed as a flag."""

    field: str
    flag: str
    parse: Callable[[str], Any]

    @property
    def env(self) -> str:
        return "KVMEM_" + self.flag.lstrip("-").removeprefix("kvmem-").replace("-", "_").upper()

    @property
    def dest(self) -> str:
        return "knob_" + self.field


def _choice(choices: tuple[str, ...], aliases: tuple[str, ...] = ()) -> Callable[[str], str]:
    def parse(text: str) -> str:
        if text not in choices + aliases:
            raise argparse.ArgumentTypeError(f"choose from {', '.join(choices)}")
        return text

    return parse


def parse_switch(text: str) -> bool:
    """``on`` or ``off`` as a bool; argparse.ArgumentTypeError for anything else."""
    if text not in ("on", "off"):
        raise argparse.ArgumentTypeError("choose from on, off")
    return text == "on"


def parse_ctx(text: str) -> int:
    """``--ctx``: ``auto`` (``AUTO_CTX``) or a positive token count; argparse.ArgumentTypeError otherwise."""
    if text == "auto":
        return AUTO_CTX
    if not text.isdigit() or int(text) <= 0:
        raise argparse.ArgumentTypeError(f"want a positive token count or auto, got {text!r}")
    return int(text)


def parse_gb(text: str) -> float:
    """``--kvmem-cpu-gb``: ``auto`` (``AUTO_GB``) or a positive number of GiB; argparse.ArgumentTypeError otherwise."""
    if text == "auto":
        return AUTO_GB
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not value > 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"want a positive number of GiB or auto, got {text!r}")
    return value


KNOBS = (
    Knob("ctx", "--ctx", parse_ctx),
    Knob("budget", "--kvmem-budget", int),
    Knob("gen_budget", "--kvmem-gen-budget", int),
    Knob("block_tokens", "--kvmem-block-tokens", int),
    Knob("sink_tokens", "--kvmem-sink-tokens", int),
    Knob("recent_tokens", "--kvmem-recent-tokens", int),
    Knob("method", "--kvmem-method", _choice(METHODS, tuple(METHOD_ALIASES))),
    Knob("scorer", "--kvmem-retrieval-method", _choice(SCORERS, tuple(SCORER_ALIASES))),
    Knob("retrieval_heads", "--kvmem-retrieval-heads", parse_retrieval_heads),
    Knob("cpu_gb", "--kvmem-cpu-gb", parse_gb),
    Knob("nvme_dir", "--kvmem-nvme-dir", str),
    Knob("nvme_gb", "--kvmem-nvme-gb", float),
    Knob("positions", "--kvmem-positions", _choice(POSITION_MODES)),
    Knob("retention", "--kvmem-retention", _choice(RETENTIONS)),
    Knob("recurrent", "--kvmem-recurrent", _choice(RECURRENT_MODES)),
    Knob("groups", "--kvmem-groups", parse_switch),
    Knob("relevance", "--kvmem-relevance", float),
    Knob("speculative", "--speculative", _choice(SPECULATIVE_MODES)),
    Knob("kv_dtype", "--kv-dtype", _choice(KV_DTYPES)),
)


def add_kvmem_flags(parser: argparse.ArgumentParser) -> None:
    """Add every knob as a flag whose help shows its default and environment variable."""
    group = parser.add_argument_group("KVMem memory")
    defaults = _DEFAULTS.describe()
    for knob in KNOBS:
        default = defaults[knob.field]
        group.add_argument(
            knob.flag,
            dest=knob.dest,
            type=knob.parse,
            default=None,
            metavar=knob.field.upper(),
            help=f"{FIELD_HELP[knob.field]} (default: {show_value(default)}; env {knob.env})",
        )


def resolve_config(args: argparse.Namespace) -> tuple[KVMemConfig, dict[str, str]]:
    """Build the config from flags, then env, then defaults; also return each field's source."""
    values: dict[str, Any] = {}
    sources: dict[str, str] = {}
    for knob in KNOBS:
        value, source = getattr(args, knob.dest, None), "flag"
        if value is None and knob.env in os.environ:
            value, source = _parse_env(knob), "env"
        if value is None:
            value, source = getattr(_DEFAULTS, knob.field), "default"
        values[knob.field], sources[knob.field] = value, source
    return KVMemConfig(**values), sources


def _parse_env(knob: Knob) -> Any:
    raw = os.environ[knob.env]
    try:
        return knob.parse(raw)
    except (ValueError, argparse.ArgumentTypeError) as exc:
        raise ConfigError(f"{knob.env}={raw!r}: {exc}") from None


class _ListFlag(argparse.Action):
    """A comma-separated list that may repeat; the first use on the command line replaces the env's list."""

    def __call__(
        self,
        parser: argparse.ArgumentParser,
        namespace: argparse.Namespace,
        values: Any,
        option_string: str | None = None,
    ) -> None:
        current = getattr(namespace, self.dest)
        items = [] if current is self.default else list(current)
        setattr(namespace, self.dest, items + split_list(values))


def split_list(text: str) -> list[str]:
    """``"a, b,,c"`` -> ``["a", "b", "c"]``."""
    return [item.strip() for item in text.split(",") if item.strip()]


def add_list_flag(parser: argparse.ArgumentParser, flag: str, env: str, help_text: str) -> None:
    """A flag taking names, comma-separated or repeated, whose default is ``env``'s comma-separated list."""
    parser.add_argument(
        flag,
        action=_ListFlag,
        default=split_list(os.environ.get(env, "")),
        metavar="NAMES",
        help=f"{help_text} (comma-separated or repeated; default: none; env {env})",
    )


def add_chat_template_flag(parser: argparse.ArgumentParser) -> None:
    """``--chat-template FILE``: a jinja2 chat template to use instead of the model's own."""
    parser.add_argument(
        "--chat-template",
        default=os.environ.get("KVMEM_CHAT_TEMPLATE"),
        metavar="FILE",
        help="a jinja2 chat template used instead of the model's own (default: the model's; env KVMEM_CHAT_TEMPLATE)",
    )


def chat_template_opts(args: argparse.Namespace) -> dict[str, str]:
    """The adapter option ``--chat-template`` asks for: ``{"chat_template": its text}``, or nothing."""
    path = getattr(args, "chat_template", None)
    if not path:
        return {}
    try:
        return {"chat_template": Path(path).expanduser().read_text()}
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"--chat-template {path}: {exc}") from None


def show_value(value: Any) -> str:
    """A knob's value as help and ``--dry-run`` print it: switches on/off, unset ones ``unset``."""
    if value is None:
        return "unset"
    if isinstance(value, bool):
        return "on" if value else "off"
    return str(value)
