"""Held-out sessions for the quality benchmark, from a generator written apart from ``sessions``.

The bench's retrieval was tuned on ``kvmem_bench.sessions`` (facts as lines inside tool results:
passkeys, exports, pager codes, ports, ticket owners). This module plants facts in other forms,
with its own vocabulary and filler (``heldout_rounds``), so a result on these sessions measures
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
import json
import random
from collections.abc import Callable
from typing import TypeVar

from kvmem_bench import heldout_rounds as rounds
from kvmem_bench.sessions import CHARS_PER_TOKEN, Fact, Session, estimate_tokens
from kvmem.tools_format import render_plain

T = TypeVar("T")


def _other(rng: random.Random, draw: Callable[[random.Random], T], avoid: T) -> T:
    """A draw of ``draw(rng)`` other than ``avoid``: look-alikes never share the fact's subject or answer,
    and every statement ends in (or is bounded by) both, so none can occur where the target round is not."""
    while (value := draw(rng)) == avoid:
        pass
    return value


class Form:
    """A kind's fact, drawn on construction, and its rounds."""

    def __init__(self, rng: random.Random) -> None:
        self.fact = self.draw(rng)

    def draw(self, rng: random.Random) -> Fact:
        """The fact (keeping what look-alikes must avoid on ``self``)."""
        raise NotImplementedError

    def filler(self, rng: random.Random, index: int) -> rounds.Round:
        """A round holding no statement of this form."""
        return rounds.repo_filler(rng, index)

    def lookalike(self, rng: random.Random, index: int) -> rounds.Round:
        """A round holding a same-form statement about another subject with another answer."""
        raise NotImplementedError

    def target(self, base: rounds.Round, rng: random.Random, crowded: bool) -> rounds.Round:
        """``base`` (the round at the depth) turned into the round holding the fact's statements; look-alikes
        beside them only when ``crowded``."""
        raise NotImplementedError


CHAT_FACTS = (  # statement, question, value draw (fixed width, so no value extends another)
    (
        "{p}'s flight to {c} leaves from gate {v}",
        "Which gate does {p}'s flight to {c} leave from?",
        lambda r: f"{r.choice('ABCDEF')}{r.randint(10, 59)}",
    ),
    (
        "{p} is staying in room {v} at the {h}",
        "Which room is {p} staying in at the {h}?",
        lambda r: str(r.randint(101, 989)),
    ),
    ("{p} booked table {v} at {t}", "Which table did {p} book at {t}?", lambda r: str(r.randint(10, 96))),
)
CHAT_WRAPS = (
    "Oh, and {s}.",
    "By the way, {s}, which I only found out today.",
    "Someone mentioned that {s}.",
    "Before I forget: {s}.",
)


class ChatForm(Form):
    def draw(self, rng: random.Random) -> Fact:
        self.template = rng.choice(CHAT_FACTS)
        self.person, value, places = rng.choice(rounds.PERSONS), self.template[2](rng), self._places(rng)
        statement, question = (t.format(p=self.person, v=value, **places) for t in self.template[:2])
        return Fact("chat", value, question, (statement,), subject=self.person)

    @staticmethod
    def _places(rng: random.Random) -> dict[str, str]:
        return {"c": rng.choice(rounds.CITIES), "h": rng.choice(rounds.HOTELS), "t": rng.choice(rounds.RESTAURANTS)}

    def filler(self, rng: random.Random, index: int) -> rounds.Round:
        user = {"role": "user", "content": ""}
        reply = {"role": "assistant", "content": rounds.chat_reply(rng, rng.randint(2, 4))}
        return rounds.Round([user, reply], rounds.chat_user_sentences(rng, rng.randint(3, 6)), 0, " ")

    def _lookalike_sentence(self, rng: random.Random) -> str:
        person = _other(rng, lambda r: r.choice(rounds.PERSONS), self.person)
        value = _other(rng, self.template[2], self.fact.answer)
        statement = self.template[0].format(p=person, v=value, **self._places(rng))
        return rng.choice(CHAT_WRAPS).format(s=statement)

    def lookalike(self, rng: random.Random, index: int) -> rounds.Round:
        r = self.filler(rng, index)
        r.insert(self._lookalike_sentence(rng), rng)
        return r

    def target(self, base: rounds.Round, rng: random.Random, crowded: bool) -> rounds.Round:
        base.insert(rng.choice(CHAT_WRAPS).format(s=self.fact.statements[0]), rng)
        return base


CONSTANTS = {  # name -> (literal, answer) draw; fixed widths or quoted, so no value extends another
    "RETRY_LIMIT": lambda r: (str(v := r.randint(11, 98)), str(v)),
    "POOL_SIZE": lambda r: (str(v := r.randint(16, 96)), str(v)),
    "TIMEOUT_MS": lambda r: (str(v := r.randint(1200, 9800)), str(v)),
    "BATCH_ROWS": lambda r: (str(v := r.randint(120, 960)), str(v)),
    "REGION": lambda r: (f'"{(v := r.choice(rounds.REGIONS))}"', v),
}


class CodeForm(Form):
    def draw(self, rng: random.Random) -> Fact:
        self.service, self.constant = rounds.service_name(rng), rng.choice(tuple(CONSTANTS))
        self.literal, answer = CONSTANTS[self.constant](rng)
        path = self._path(self.service)
        return Fact(
            "code",
            answer,
            f"In {path}, what is {self.constant} set to?",
            (f"# {path}", f"{self.constant} = {self.literal}"),
            (0, 1),
            path,
        )

    @staticmethod
    def _path(service: str) -> str:
        return f"services/{service}/settings.py"

    def _settings(self, rng: random.Random, index: int, service: str) -> rounds.Round:
        """``service``'s settings module; the fact's constant holds the fact's value only in the fact's file."""
        lines = [f"# {self._path(service)}", f'"""Runtime settings of {service}."""', "import os", ""]
        for name, draw in CONSTANTS.items():
            if name != self.constant:
                literal = draw(rng)[0]
            elif service == self.service:
                literal = self.literal
            else:
                literal = _other(rng, lambda r: draw(r)[0], self.literal)
            lines.append(f"{name} = {literal}")
        lines += ["", f'DEBUG = os.environ.get("{service.upper().replace("-", "_")}_DEBUG") == "1"']
        return rounds.tool_round(rng, index, "read_file", {"path": self._path(service)}, lines)

    def lookalike(self, rng: random.Random, index: int) -> rounds.Round:
        return self._settings(rng, index, _other(rng, rounds.service_name, self.service))

    def target(self, base: rounds.Round, rng: random.Random, crowded: bool) -> rounds.Round:
        return self._settings(rng, base.index, self.service)


SHIPMENT_FIELDS = {  # field -> (draw, question)
    "status": (lambda r: r.choice(rounds.STATUSES), "What is the status of shipment {i}?"),
    "weight_kg": (lambda r: r.randint(100, 999), "How many kilograms does shipment {i} weigh?"),
    "carrier": (lambda r: r.choice(rounds.CARRIERS), "Which carrier handles shipment {i}?"),
    "dock": (lambda r: r.randint(10, 99), "Which dock is shipment {i} assigned to?"),
}


class RecordForm(Form):
    def draw(self, rng: random.Random) -> Fact:
        self.field = rng.choice(tuple(SHIPMENT_FIELDS))
        self.row = self._row(rng, f"SH-{rng.randint(10000, 99999)}")
        self.as_json = rng.random() < 0.5
        answer = str(self.row[self.field])
        return Fact(
            "record",
            answer,
            SHIPMENT_FIELDS[self.field][1].format(i=self.row["id"]),
            (self._line(self.row, self.as_json),),
            subject=self.row["id"],
        )

    @staticmethod
    def _row(rng: random.Random, shipment: str) -> dict:
        return {
            "id": shipment,
            "customer": rng.choice(rounds.COMPANIES),
            **{name: draw(rng) for name, (draw, _) in SHIPMENT_FIELDS.items()},
        }

    @staticmethod
    def _line(row: dict, as_json: bool) -> str:
        return json.dumps(row) if as_json else ",".join(str(v) for v in row.values())

    def _lookalike_row(self, rng: random.Random) -> dict:
        row = self._row(rng, _other(rng, lambda r: f"SH-{r.randint(10000, 99999)}", self.row["id"]))
        row[self.field] = _other(rng, SHIPMENT_FIELDS[self.field][0], self.row[self.field])
        return row

    def filler(self, rng: random.Random, index: int) -> rounds.Round:
        if rng.random() < 0.5:
            return rounds.repo_filler(rng, index)
        if rng.random() < 0.5:
            query, lines = rounds.other_table(rng)
            return rounds.tool_round(rng, index, "sql", {"query": query}, lines)
        endpoint = rng.choice(rounds.ENDPOINTS)
        return rounds.tool_round(
            rng, index, "http_get", {"url": f"http://ops.internal{endpoint}"}, rounds.endpoint_body(rng, endpoint)
        )

    def _shipments(self, rng: random.Random, index: int, rows: list[dict], as_json: bool) -> rounds.Round:
        lines = [self._line(row, as_json) for row in rows]
        if as_json:
            return rounds.tool_round(
                rng, index, "http_get", {"url": f"http://ops.internal/v2/shipments?page={rng.randint(1, 40)}"}, lines
            )
        query = f"SELECT {', '.join(rows[0])} FROM shipments WHERE depot = {rng.randint(1, 12)} LIMIT 8"
        return rounds.tool_round(rng, index, "sql", {"query": query}, [",".join(rows[0]), *lines])

    def lookalike(self, rng: random.Random, index: int) -> rounds.Round:
        rows = [self._lookalike_row(rng) for _ in range(rng.randint(3, 7))]
        return self._shipments(rng, index, rows, rng.random() < 0.5)

    def target(self, base: rounds.Round, rng: random.Random, crowded: bool) -> rounds.Round:
        rows = [self._lookalike_row(rng) for _ in range(rng.randint(2, 6) if crowded else 0)]
        rows.insert(rng.randint(0, len(rows)), self.row)
        return self._shipments(rng, base.index, rows, self.as_json)


DECISIONS = (
    ("cache backend", ("valkey", "memcached", "dragonfly", "hazelcast", "varnish", "ignite")),
    ("message broker", ("rabbitmq", "nats", "pulsar", "kafka", "redpanda", "zeromq")),
    ("migration tool", ("alembic", "flyway", "liquibase", "sqitch", "atlas", "dbmate")),
)


class DecisionForm(Form):
    def draw(self, rng: random.Random) -> Fact:
        self.topic, self.options = rng.choice(DECISIONS)
        self.service, choice = rounds.service_name(rng), rng.choice(self.options)
        return Fact(
            "decision",
            choice,
            f"Which {self.topic} did you settle on for {self.service}?",
            (self._statement(self.service, choice),),
            subject=self.service,
        )

    def _statement(self, service: str, choice: str) -> str:
        return f"For {service} I'm settling on {choice} as the {self.topic}"

    def _decided(self, base: rounds.Round, statement: str) -> rounds.Round:
        turns = [dict(t) for t in base.turns]
        turns[-1]["content"] = f"{statement}; it fits what the code expects."
        return rounds.Round(turns, base.body, base.slot, base.joiner, base.index)

    def lookalike(self, rng: random.Random, index: int) -> rounds.Round:
        service = _other(rng, rounds.service_name, self.service)
        choice = _other(rng, lambda r: r.choice(self.options), self.fact.answer)
        return self._decided(rounds.repo_filler(rng, index), self._statement(service, choice))

    def target(self, base: rounds.Round, rng: random.Random, crowded: bool) -> rounds.Round:
        return self._decided(base, self.fact.statements[0])


FORMS: dict[str, type[Form]] = {"chat": ChatForm, "code": CodeForm, "record": RecordForm, "decision": DecisionForm}

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


def make_heldout_session(
    sid: str, kind: str, target_tokens: int, depth: float, rng: random.Random, chars_per_token: float = CHARS_PER_TOKEN
) -> Session:
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
    built, starts = _fill(form, rng, target_tokens, frame, chars_per_token)
    total = starts[-1]
    index = max(0, min(bisect.bisect_right(starts, depth * total) - 1, len(built) - 1))
    built[index] = form.target(built[index], rng, crowded=starts[index] < LOOKALIKE_SPAN * target_tokens)
    messages = [system, *itertools.chain.from_iterable(r.messages() for r in built), question]
    return Session(sid, tuple(messages), form.fact, depth, target_tokens)


def make_heldout_sessions(
    sizes: list[int], depths: list[float], kinds: list[str], seed: int = 0, chars_per_token: float = CHARS_PER_TOKEN
) -> list[Session]:
    """Every (size, depth, kind) combination once, deterministic for a seed and ``chars_per_token``."""
    rng = random.Random(seed)
    return [
        make_heldout_session(f"h{size}-d{depth:.2f}-{kind}", kind, size, depth, rng, chars_per_token)
        for size in sizes
        for depth in depths
        for kind in kinds
    ]


def _fill(
    form: Form, rng: random.Random, target_tokens: int, frame: int, chars_per_token: float
) -> tuple[list[rounds.Round], list[int]]:
    """Rounds until the session reaches ``target_tokens``, and each round's start (in estimated
    tokens) followed by the total."""
    built: list[rounds.Round] = []
    starts = [frame]
    while True:
        crowded = starts[-1] < LOOKALIKE_SPAN * target_tokens and rng.random() < LOOKALIKE_RATE
        r = form.lookalike(rng, len(built)) if crowded else form.filler(rng, len(built))
        size = _tokens(r.messages(), chars_per_token)
        if built and starts[-1] + size / 2 > target_tokens:
            return built, starts  # the round would overshoot more than it fills
        built.append(r)
        starts.append(starts[-1] + size)


def _tokens(messages: list[dict], chars_per_token: float) -> int:
    """Estimated tokens of ``messages`` once rendered as a template without tools shows them."""
    return sum(estimate_tokens(t["content"], chars_per_token) + TURN_OVERHEAD for t in render_plain(messages, None))
