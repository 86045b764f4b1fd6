"""Offline agent sessions with planted facts, for the quality benchmark.

A session is the transcript an agent harness sends: a system prompt, then rounds of
user task → assistant tool call → tool result → assistant note, with one fact planted in
a tool result at a chosen depth, same-form distractor facts elsewhere, and the question
as the last user turn. Everything comes from a seeded RNG, so a seed (and the tokenizer's
``chars_per_token``) fixes the sessions. The forms (file reads, command output, search
results) differ from the calibration documents on purpose: the benchmark measures
transfer, not memorization; ``port`` and ``owner`` are forms no calibration template has.
"""

from __future__ import annotations

import bisect
import itertools
import json
import random
import re
from collections.abc import Callable
from dataclasses import dataclass

from kvmem.tools_format import render_plain

CHARS_PER_TOKEN = 3.8  # Qwen2.5's tokenizer on the non-digit text of these rounds (fit_chars_per_token)
WRAPPER_TOKENS = 5  # a ChatML message's role header and end marker
FRAME_TOKENS = 60  # system prompt and question, rendered
DISTRACTOR_RATE = 0.5  # share of rounds holding a same-form distractor
DISTRACTOR_SPAN = 0.8  # distractors start in the first 80% of a session: the newest rounds, which every
# method keeps in view, hold none, so they confuse the reading only through what a selection chose
SYSTEM = "You are a careful software agent. You read files and run commands with tools, then answer briefly."
NAMES = ("orion", "vega", "lyra", "draco", "atlas", "nova", "cygnus", "hydra", "pavo", "tucana", "carina", "fornax")
PEOPLE = ("Alice", "Bruno", "Chiara", "Dmitri", "Elena", "Farid", "Greta", "Hugo", "Ingrid", "Jonas", "Keiko", "Luis")
FILES = (
    "src/app/server.py",
    "src/app/models.py",
    "deploy/config.yaml",
    "scripts/build.sh",
    "docs/notes.md",
    "src/lib/cache.py",
    "tests/test_api.py",
    "Makefile",
    "src/app/routes.py",
    "infra/main.tf",
)
COMMANDS = (
    "make test",
    "git log --oneline -n 12",
    "docker ps",
    "df -h",
    "pytest -q tests/",
    "kubectl get pods",
    "journalctl -u api -n 20",
    "ls -la build/",
)
WORDS = (
    "request",
    "handler",
    "timeout",
    "retry",
    "config",
    "worker",
    "queue",
    "latency",
    "cache",
    "token",
    "session",
    "deploy",
    "metric",
    "buffer",
    "index",
    "schema",
    "router",
    "client",
    "backend",
    "job",
)
QUESTION = "Based on the tool outputs above, {question} Reply with just the value."
TASKS = (
    "Find out why the nightly build is slow.",
    "Check the API error rate after the last deploy.",
    "Review the cache module for stale entries.",
    "See which tests are flaky.",
    "Figure out where the request timeout is configured.",
    "Summarize the recent changes.",
)


@dataclass(frozen=True)
class Fact:
    """The planted fact: its kind, the exact answer and the question asked at the end."""

    kind: str
    answer: str
    question: str
    statements: tuple[str, ...]
    """Lines planted in order (an update or a chain plants two); the first sits at the depth."""
    evidence: tuple[int, ...] = (0,)
    """Indices of the statements the answer needs (an update's old value is not evidence)."""
    subject: str = ""
    """The name the fact is about; distractors use other names."""


@dataclass(frozen=True)
class Session:
    """One benchmark item: the full transcript (question last) and what it tests."""

    id: str
    messages: tuple[dict, ...]
    fact: Fact
    depth: float
    target_tokens: int


def _passkey(name: str, rng: random.Random) -> Fact:
    key = str(rng.randint(10000, 99999))
    return Fact(
        "passkey",
        key,
        f"What is the {name} deployment passkey?",
        (f"NOTE: the {name} deployment passkey is {key}. Keep it safe.",),
        subject=name,
    )


def _kv(name: str, rng: random.Random) -> Fact:
    value = str(rng.randint(10000, 99999))
    return Fact(
        "kv",
        value,
        f"What is the value of {name.upper()}_API_KEY?",
        (f"export {name.upper()}_API_KEY={value}",),
        subject=name,
    )


def _chain(name: str, rng: random.Random) -> Fact:
    build, var = str(rng.randint(1000, 9999)), name.upper()
    return Fact(
        "chain",
        build,
        f"What is the numeric value of {var}_ARTIFACT?",
        (f"{var}_BUILD={build}", f"{var}_ARTIFACT=${{{var}_BUILD}}"),
        (0, 1),
        name,
    )


def _update(name: str, rng: random.Random) -> Fact:
    old, new = rng.sample(range(1000, 9999), 2)
    return Fact(
        "update",
        str(new),
        f"What is the current {name} pager code?",
        (f"the {name} pager code is {old}", f"UPDATE: the {name} pager code changed to {new}"),
        (1,),
        name,
    )


def _port(name: str, rng: random.Random) -> Fact:
    port = str(rng.randint(10000, 65535))
    return Fact(
        "port",
        port,
        f"Which port does the {name}-svc service listen on?",
        (f"{name}-svc listening on 0.0.0.0 port {port}",),
        subject=name,
    )


def _owner(name: str, rng: random.Random) -> Fact:
    ticket, person = f"{name.upper()}-{rng.randint(100, 999)}", rng.choice(PEOPLE)
    return Fact(
        "owner",
        person,
        f"Who is ticket {ticket} assigned to?",
        (f"ticket {ticket} assigned to {person}",),
        subject=name,
    )


FACTS: dict[str, Callable[[str, random.Random], Fact]] = {
    "passkey": _passkey,
    "kv": _kv,
    "chain": _chain,
    "update": _update,
    "port": _port,
    "owner": _owner,
}
KINDS = tuple(FACTS)
"""Every fact kind: ``update`` (the newest value wins) and ``chain`` (two lines) need two statements."""


def make_fact(kind: str, rng: random.Random, avoid: str = "") -> Fact:
    """A fact of ``kind`` (one of ``KINDS``) about a random name other than ``avoid``."""
    return FACTS[kind](rng.choice([n for n in NAMES if n != avoid]), rng)


def distractor(fact: Fact, rng: random.Random) -> str:
    """A line of the same form as ``fact``'s statements, about another name with another answer."""
    while True:
        other = make_fact(fact.kind, rng, avoid=fact.subject)
        if other.answer != fact.answer:
            return rng.choice(other.statements)


def estimate_tokens(text: str, chars_per_token: float = CHARS_PER_TOKEN) -> int:
    """Tokens of ``text`` for a digit-splitting tokenizer (Qwen2.5's, SmolLM2's): one per digit,
    ``chars_per_token`` characters per token elsewhere."""
    digits = sum(c.isdigit() for c in text)
    return round(digits + (len(text) - digits) / chars_per_token)


def fit_chars_per_token(count_tokens: Callable[[str], int]) -> float:
    """``chars_per_token`` that makes ``estimate_tokens`` match ``count_tokens`` (a model's tokenizer)
    on a probe session's rendered turns, so sessions come out at their size in that model's tokens."""
    probe = make_session("probe", "kv", 12000, 0.5, random.Random(1))  # long enough to average the rounds' mix
    text = "\n".join(t["content"] for t in render_plain(list(probe.messages), None))
    digits = sum(c.isdigit() for c in text)
    return (len(text) - digits) / max(1, count_tokens(text) - digits)


def _code_lines(rng: random.Random, n: int) -> list[str]:
    lines = []
    for _ in range(n):
        a, b, c = rng.sample(WORDS, 3)
        lines.append(
            rng.choice(
                (
                    f"def {a}_{b}(self, {c}):",
                    f"    {a} = self.{b}.get({c!r}, {rng.randint(1, 500)})",
                    f"    return {a}_{c}({b})",
                    f"# {a} {b} for the {c}",
                    f"{a.upper()}_{b.upper()} = {rng.randint(1, 90)}",
                )
            )
        )
    return lines


def _log_lines(rng: random.Random, n: int) -> list[str]:
    levels = ("INFO", "WARN", "DEBUG", "ERROR")
    return [
        f"2026-11-{rng.randint(1, 28):02d}T{rng.randint(0, 23):02d}:{rng.randint(0, 59):02d} "
        f"{rng.choice(levels)} {rng.choice(WORDS)}: {rng.choice(WORDS)} {rng.choice(WORDS)} "
        f"took {rng.randint(2, 900)}ms"
        for _ in range(n)
    ]


def _search_lines(rng: random.Random, n: int) -> list[str]:
    return [
        f"{rng.choice(FILES)}:{rng.randint(1, 400)}: {rng.choice(WORDS)} = {rng.choice(WORDS)}_{rng.choice(WORDS)}()"
        for _ in range(n)
    ]


@dataclass
class _Round:
    """One tool round before rendering; planted lines go into ``body``."""

    index: int
    tool: str
    args: dict
    body: list[str]
    task: str | None

    def plant(self, line: str, rng: random.Random) -> None:
        self.body.insert(rng.randint(1, len(self.body) - 1), line)

    def messages(self) -> list[dict]:
        call_id = f"call_{self.index}"
        call = {"id": call_id, "type": "function", "function": {"name": self.tool, "arguments": json.dumps(self.args)}}
        out = [{"role": "user", "content": self.task}] if self.task else []
        return out + [
            {"role": "assistant", "content": "", "tool_calls": [call]},
            {"role": "tool", "tool_call_id": call_id, "content": "\n".join(self.body)},
            {"role": "assistant", "content": f"Checked {next(iter(self.args.values()))}; nothing blocking there."},
        ]

    def tokens(self, chars_per_token: float) -> int:
        """Estimated tokens once rendered: each turn as a template without tools shows it, plus its wrapper."""
        turns = render_plain(self.messages(), None)
        return sum(estimate_tokens(t["content"], chars_per_token) + WRAPPER_TOKENS for t in turns)


def _tool_round(rng: random.Random, index: int) -> _Round:
    tool = rng.choice(("read_file", "run", "search"))
    if tool == "read_file":
        args, body = {"path": rng.choice(FILES)}, _code_lines(rng, 14)
    elif tool == "run":
        args, body = {"command": rng.choice(COMMANDS)}, _log_lines(rng, 10)
    else:
        args, body = {"query": rng.choice(WORDS)}, _search_lines(rng, 12)
    return _Round(index, tool, args, body, rng.choice(TASKS) if index % 3 == 0 else None)


def make_session(
    sid: str, kind: str, target_tokens: int, depth: float, rng: random.Random, chars_per_token: float = CHARS_PER_TOKEN
) -> Session:
    """A transcript of about ``target_tokens`` (for a tokenizer of ``chars_per_token``) with the fact's
    first statement at ``depth`` (0–1) of it.

    A chain's second statement or an update's new value goes halfway between the first and the end.
    Same-form distractors (other names, other values) sit in about half the rounds that start in
    the first ``DISTRACTOR_SPAN`` of the session.
    """
    fact = make_fact(kind, rng)
    rounds: list[_Round] = []
    sizes: list[int] = []
    total = FRAME_TOKENS
    while not rounds or total < target_tokens:
        r = _tool_round(rng, len(rounds))
        if total < DISTRACTOR_SPAN * target_tokens and rng.random() < DISTRACTOR_RATE:
            r.plant(distractor(fact, rng), rng)
        size = r.tokens(chars_per_token)
        if rounds and total + size / 2 > target_tokens:
            break  # the round would overshoot more than it fills
        rounds.append(r)
        sizes.append(size)
        total += size
    ends = list(itertools.accumulate(sizes, initial=FRAME_TOKENS))[1:]
    first = _round_at(ends, depth * total)
    second = _round_at(ends, (ends[first] + total) / 2)
    rounds[first].plant(fact.statements[0], rng)
    if len(fact.statements) > 1:
        rounds[max(second, min(first + 1, len(rounds) - 1))].plant(fact.statements[1], rng)
    messages: list[dict] = [{"role": "system", "content": SYSTEM}]
    for r in rounds:
        messages += r.messages()
    messages.append({"role": "user", "content": QUESTION.format(question=fact.question)})
    return Session(sid, tuple(messages), fact, depth, target_tokens)


def _round_at(ends: list[int], token: float) -> int:
    """The round whose token span holds position ``token``."""
    return min(bisect.bisect_right(ends, token), len(ends) - 1)


def make_sessions(
    sizes: list[int], depths: list[float], kinds: list[str], seed: int = 0, chars_per_token: float = CHARS_PER_TOKEN
) -> list[Session]:
    """Every (size, depth, kind) combination once, deterministic for a seed and ``chars_per_token``."""
    rng = random.Random(seed)
    return [
        make_session(f"s{size}-d{depth:.2f}-{kind}", kind, size, depth, rng, chars_per_token)
        for size in sizes
        for depth in depths
        for kind in kinds
    ]


def is_correct(answer: str, fact: Fact) -> bool:
    """Exact match, ignoring case: the expected value is a whole word (letters and digits) of the
    answer's first line."""
    first = (answer.strip().splitlines() or [""])[0]
    return fact.answer.lower() in re.split(r"[^0-9a-z]+", first.lower())
