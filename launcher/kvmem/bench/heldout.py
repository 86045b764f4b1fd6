"""Held-out sessions for the quality benchmark, from a generator written apart from ``sessions``.

The bench's retrieval was tuned on ``kvmem.bench.sessions`` (facts as lines inside tool results:
passkeys, exports, pager codes, ports, ticket owners). This module plants facts in other forms,
with its own vocabulary and filler (``heldout_text``), so a result on these sessions measures
transfer rather than fit. It shares only the data types (``Fact``, ``Session``), the token
estimate and ``render_plain`` with the bench, so the runner treats both generators' sessions alike.

Kinds (``Fact.kind``):

- ``chat``: no tools at all. A person thinks aloud to an assistant about errands, plans and
  colleagues, and mentions in passing one fact about someone: "Priya's flight to Osaka leaves
  from gate C37", "Sven is staying in room 214 at the Linden Court", "Amara booked table 42 at
  Casa Lumo". Look-alikes are the same sentence about other people with other values.
- ``code``: the agent reads many ``services/<name>/settings.py`` modules (``read_file``), each
  defining the same constants (``RETRY_LIMIT``, ``POOL_SIZE``, ``TIMEOUT_MS``, ``BATCH_ROWS``,
  ``REGION``) with other values; the question names one file and one constant. The statements are
  the file's first line (a comment naming its path) and the constant's line; both are evidence.
- ``record``: the agent queries shipments (``sql`` answers CSV rows under a header, ``http_get``
  answers one JSON object a line); the question asks one field (weight, status, carrier, dock) of
  one shipment by its id. The statement is that shipment's row.
- ``decision``: a choice the assistant itself stated in an earlier note ("For ledger-sync I'm
  settling on valkey as the cache backend"); look-alikes are its choices for other services.

A session is OpenAI chat messages: the system prompt, rounds, and the question as the last user
message. The fact's first statement sits at ``depth`` of the transcript; look-alikes (same form,
another subject, never the answer) fill about half of the rounds that start in the first 80% of
it. Every statement occurs verbatim exactly once in the rendered transcript, inside one message.
"""
from __future__ import annotations

import bisect
import itertools
import random

from kvmem.bench.heldout_forms import FORMS, Form, Round
from kvmem.bench.sessions import CHARS_PER_TOKEN, Session, estimate_tokens
from kvmem.tools_format import render_plain

HELDOUT_KINDS: tuple[str, ...] = tuple(FORMS)
LOOKALIKE_RATE = 0.5  # share of rounds holding a look-alike
LOOKALIKE_SPAN = 0.8  # look-alikes only in rounds that start in this leading share of the session
TURN_OVERHEAD = 5  # a ChatML turn's role header and end marker
ASK = "{question} Keep the reply short: the answer alone, no explanation."
SYSTEMS = {
    "chat": "You are a warm, practical assistant. The user talks through their week; reply in a few plain sentences.",
    "tools": "You are an engineering assistant in a large monorepo. Inspect files and data with the tools given, "
             "then keep your notes brief.",
}


def make_heldout_session(sid: str, kind: str, target_tokens: int, depth: float, rng: random.Random,
                         chars_per_token: float = CHARS_PER_TOKEN) -> Session:
    """A transcript of about ``target_tokens`` (for a tokenizer of ``chars_per_token``) whose fact of
    ``kind`` (one of ``HELDOUT_KINDS``) has its first statement at ``depth`` (0-1) of it.

    Deterministic for ``rng``'s state. Raises ``ValueError`` for an unknown kind.
    """
    if kind not in FORMS:
        raise ValueError(f"unknown held-out kind {kind!r}; choose from {', '.join(HELDOUT_KINDS)}")
    form = FORMS[kind](rng)
    system = {"role": "system", "content": SYSTEMS["chat" if kind == "chat" else "tools"]}
    question = {"role": "user", "content": ASK.format(question=form.fact.question)}
    frame = _tokens([system, question], chars_per_token)
    rounds, starts = _fill(form, rng, target_tokens, frame, chars_per_token)
    total = starts[-1]
    index = max(0, min(bisect.bisect_right(starts, depth * total) - 1, len(rounds) - 1))
    rounds[index] = form.target(rounds[index], rng, crowded=starts[index] < LOOKALIKE_SPAN * target_tokens)
    messages = [system, *itertools.chain.from_iterable(r.messages() for r in rounds), question]
    return Session(sid, tuple(messages), form.fact, depth, target_tokens)


def make_heldout_sessions(sizes: list[int], depths: list[float], kinds: list[str], seed: int = 0,
                          chars_per_token: float = CHARS_PER_TOKEN) -> list[Session]:
    """Every (size, depth, kind) combination once, deterministic for a seed and ``chars_per_token``."""
    rng = random.Random(seed)
    return [make_heldout_session(f"h{size}-d{depth:.2f}-{kind}", kind, size, depth, rng, chars_per_token)
            for size in sizes for depth in depths for kind in kinds]


def _fill(form: Form, rng: random.Random, target_tokens: int, frame: int,
          chars_per_token: float) -> tuple[list[Round], list[int]]:
    """Rounds until the session reaches ``target_tokens``, and each round's start (in estimated
    tokens) followed by the total."""
    rounds: list[Round] = []
    starts = [frame]
    while True:
        crowded = starts[-1] < LOOKALIKE_SPAN * target_tokens and rng.random() < LOOKALIKE_RATE
        r = form.lookalike(rng, len(rounds)) if crowded else form.filler(rng, len(rounds))
        size = _tokens(r.messages(), chars_per_token)
        if rounds and starts[-1] + size / 2 > target_tokens:
            return rounds, starts  # the round would overshoot more than it fills
        rounds.append(r)
        starts.append(starts[-1] + size)


def _tokens(messages: list[dict], chars_per_token: float) -> int:
    """Estimated tokens of ``messages`` once rendered as a template without tools shows them."""
    return sum(estimate_tokens(t["content"], chars_per_token) + TURN_OVERHEAD for t in render_plain(messages, None))
