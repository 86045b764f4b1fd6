"""The held-out kinds' forms: how each plants its fact, its look-alikes and its filler rounds.

Every statement ends in (or is bounded by) its subject and its value, and look-alikes never share
the subject and the answer at once, so a statement can occur in the transcript only where the
target round puts it (``kvmem.bench.heldout`` states the forms).
"""
from __future__ import annotations

import json
import random
from dataclasses import dataclass

from kvmem.bench import heldout_text as text
from kvmem.bench.sessions import Fact


@dataclass
class Round:
    """Messages of one round; ``body`` (a list, so a statement can be inserted) becomes the content of
    the message at ``slot``."""

    turns: list[dict]
    body: list[str]
    slot: int
    joiner: str = "\n"
    index: int = 0
    """The round's place in the session (tool call ids derive from it)."""

    def messages(self) -> list[dict]:
        out = [dict(t) for t in self.turns]
        out[self.slot]["content"] = self.joiner.join(self.body)
        return out

    def insert(self, line: str, rng: random.Random) -> None:
        """Put ``line`` among the body's lines (after the first, a header or a path comment)."""
        self.body.insert(rng.randint(1, len(self.body)), line)


def _other(rng: random.Random, draw, avoid):
    """A draw of ``draw(rng)`` other than ``avoid``."""
    while (value := draw(rng)) == avoid:
        pass
    return value


TASKS = ("Track down why {s} times out under load.", "Check how {s} is configured before the migration.",
         "Compare {s} with its neighbours; something drifted.", "Audit {s} ahead of the freeze.")
NOTES = ("Read {a}; moving on.", "Noted what {a} shows.", "{a} looks as expected.", "Nothing surprising in {a}.")


def tool_round(rng: random.Random, index: int, tool: str, args: dict, body: list[str]) -> Round:
    """An assistant call, its tool result (``body``) and a short note; every fourth round opens with a task."""
    call_id = f"toolu_{index:05d}"
    call = {"id": call_id, "type": "function", "function": {"name": tool, "arguments": json.dumps(args)}}
    turns = [{"role": "user", "content": rng.choice(TASKS).format(s=text.service_name(rng))}] if index % 4 == 0 else []
    turns += [{"role": "assistant", "content": "", "tool_calls": [call]},
              {"role": "tool", "tool_call_id": call_id, "content": ""},
              {"role": "assistant", "content": rng.choice(NOTES).format(a=tool)}]
    return Round(turns, body, len(turns) - 2, index=index)


def repo_filler(rng: random.Random, index: int) -> Round:
    """A round that reads a non-settings file or runs a shell command."""
    if rng.random() < 0.7:
        service, file = text.service_name(rng), rng.choice(text.OTHER_FILES)
        return tool_round(rng, index, "read_file", {"path": f"services/{service}/{file}"},
                          text.other_source(rng, service, file))
    return tool_round(rng, index, "bash", {"cmd": rng.choice(text.SHELL)}, text.shell_output(rng))


class Form:
    """A kind's fact, drawn on construction, and its rounds."""

    def __init__(self, rng: random.Random) -> None:
        self.fact = self.draw(rng)

    def draw(self, rng: random.Random) -> Fact:
        """The fact (keeping what look-alikes must avoid on ``self``)."""
        raise NotImplementedError

    def filler(self, rng: random.Random, index: int) -> Round:
        """A round holding no statement of this form."""
        return repo_filler(rng, index)

    def lookalike(self, rng: random.Random, index: int) -> Round:
        """A round holding a same-form statement about another subject with another answer."""
        raise NotImplementedError

    def target(self, base: Round, rng: random.Random, crowded: bool) -> Round:
        """``base`` (the round at the depth) turned into the round holding the fact's statements; look-alikes
        beside them only when ``crowded``."""
        raise NotImplementedError


CHAT_FACTS = (  # statement, question, value draw (fixed width, so no value extends another)
    ("{p}'s flight to {c} leaves from gate {v}", "Which gate does {p}'s flight to {c} leave from?",
     lambda r: f"{r.choice('ABCDEF')}{r.randint(10, 59)}"),
    ("{p} is staying in room {v} at the {h}", "Which room is {p} staying in at the {h}?",
     lambda r: str(r.randint(101, 989))),
    ("{p} booked table {v} at {t}", "Which table did {p} book at {t}?", lambda r: str(r.randint(10, 96))),
)
CHAT_WRAPS = ("Oh, and {s}.", "By the way, {s}, which I only found out today.", "Someone mentioned that {s}.",
              "Before I forget: {s}.")


class ChatForm(Form):
    def draw(self, rng: random.Random) -> Fact:
        self.template = rng.choice(CHAT_FACTS)
        self.person, value, places = rng.choice(text.PERSONS), self.template[2](rng), self._places(rng)
        statement, question = (t.format(p=self.person, v=value, **places) for t in self.template[:2])
        return Fact("chat", value, question, (statement,), subject=self.person)

    @staticmethod
    def _places(rng: random.Random) -> dict[str, str]:
        return {"c": rng.choice(text.CITIES), "h": rng.choice(text.HOTELS), "t": rng.choice(text.RESTAURANTS)}

    def filler(self, rng: random.Random, index: int) -> Round:
        user = {"role": "user", "content": ""}
        reply = {"role": "assistant", "content": text.chat_reply(rng, rng.randint(2, 4))}
        return Round([user, reply], text.chat_user_sentences(rng, rng.randint(3, 6)), 0, " ")

    def _lookalike_sentence(self, rng: random.Random) -> str:
        person = _other(rng, lambda r: r.choice(text.PERSONS), self.person)
        value = _other(rng, self.template[2], self.fact.answer)
        statement = self.template[0].format(p=person, v=value, **self._places(rng))
        return rng.choice(CHAT_WRAPS).format(s=statement)

    def lookalike(self, rng: random.Random, index: int) -> Round:
        r = self.filler(rng, index)
        r.insert(self._lookalike_sentence(rng), rng)
        return r

    def target(self, base: Round, rng: random.Random, crowded: bool) -> Round:
        base.insert(rng.choice(CHAT_WRAPS).format(s=self.fact.statements[0]), rng)
        return base


CONSTANTS = {  # name -> (literal, answer) draw; fixed widths or quoted, so no value extends another
    "RETRY_LIMIT": lambda r: (str(v := r.randint(11, 98)), str(v)),
    "POOL_SIZE": lambda r: (str(v := r.randint(16, 96)), str(v)),
    "TIMEOUT_MS": lambda r: (str(v := r.randint(1200, 9800)), str(v)),
    "BATCH_ROWS": lambda r: (str(v := r.randint(120, 960)), str(v)),
    "REGION": lambda r: (f'"{(v := r.choice(text.REGIONS))}"', v),
}


class CodeForm(Form):
    def draw(self, rng: random.Random) -> Fact:
        self.service, self.constant = text.service_name(rng), rng.choice(tuple(CONSTANTS))
        self.literal, answer = CONSTANTS[self.constant](rng)
        path = self._path(self.service)
        return Fact("code", answer, f"In {path}, what is {self.constant} set to?",
                    (f"# {path}", f"{self.constant} = {self.literal}"), (0, 1), path)

    @staticmethod
    def _path(service: str) -> str:
        return f"services/{service}/settings.py"

    def _settings(self, rng: random.Random, index: int, service: str) -> Round:
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
        return tool_round(rng, index, "read_file", {"path": self._path(service)}, lines)

    def lookalike(self, rng: random.Random, index: int) -> Round:
        return self._settings(rng, index, _other(rng, text.service_name, self.service))

    def target(self, base: Round, rng: random.Random, crowded: bool) -> Round:
        return self._settings(rng, base.index, self.service)


SHIPMENT_FIELDS = {  # field -> (draw, question)
    "status": (lambda r: r.choice(text.STATUSES), "What is the status of shipment {i}?"),
    "weight_kg": (lambda r: r.randint(100, 999), "How many kilograms does shipment {i} weigh?"),
    "carrier": (lambda r: r.choice(text.CARRIERS), "Which carrier handles shipment {i}?"),
    "dock": (lambda r: r.randint(10, 99), "Which dock is shipment {i} assigned to?"),
}


class RecordForm(Form):
    def draw(self, rng: random.Random) -> Fact:
        self.field = rng.choice(tuple(SHIPMENT_FIELDS))
        self.row = self._row(rng, f"SH-{rng.randint(10000, 99999)}")
        self.as_json = rng.random() < 0.5
        answer = str(self.row[self.field])
        return Fact("record", answer, SHIPMENT_FIELDS[self.field][1].format(i=self.row["id"]),
                         (self._line(self.row, self.as_json),), subject=self.row["id"])

    @staticmethod
    def _row(rng: random.Random, shipment: str) -> dict:
        return {"id": shipment, "customer": rng.choice(text.COMPANIES),
                **{name: draw(rng) for name, (draw, _) in SHIPMENT_FIELDS.items()}}

    @staticmethod
    def _line(row: dict, as_json: bool) -> str:
        return json.dumps(row) if as_json else ",".join(str(v) for v in row.values())

    def _lookalike_row(self, rng: random.Random) -> dict:
        row = self._row(rng, _other(rng, lambda r: f"SH-{r.randint(10000, 99999)}", self.row["id"]))
        row[self.field] = _other(rng, SHIPMENT_FIELDS[self.field][0], self.row[self.field])
        return row

    def filler(self, rng: random.Random, index: int) -> Round:
        if rng.random() < 0.5:
            return repo_filler(rng, index)
        if rng.random() < 0.5:
            query, lines = text.other_table(rng)
            return tool_round(rng, index, "sql", {"query": query}, lines)
        endpoint = rng.choice(text.ENDPOINTS)
        return tool_round(rng, index, "http_get", {"url": f"http://ops.internal{endpoint}"},
                          text.endpoint_body(rng, endpoint))

    def _shipments(self, rng: random.Random, index: int, rows: list[dict], as_json: bool) -> Round:
        lines = [self._line(row, as_json) for row in rows]
        if as_json:
            return tool_round(rng, index, "http_get",
                              {"url": f"http://ops.internal/v2/shipments?page={rng.randint(1, 40)}"}, lines)
        query = f"SELECT {', '.join(rows[0])} FROM shipments WHERE depot = {rng.randint(1, 12)} LIMIT 8"
        return tool_round(rng, index, "sql", {"query": query}, [",".join(rows[0]), *lines])

    def lookalike(self, rng: random.Random, index: int) -> Round:
        rows = [self._lookalike_row(rng) for _ in range(rng.randint(3, 7))]
        return self._shipments(rng, index, rows, rng.random() < 0.5)

    def target(self, base: Round, rng: random.Random, crowded: bool) -> Round:
        rows = [self._lookalike_row(rng) for _ in range(rng.randint(2, 6) if crowded else 0)]
        rows.insert(rng.randint(0, len(rows)), self.row)
        return self._shipments(rng, base.index, rows, self.as_json)


DECISIONS = (("cache backend", ("valkey", "memcached", "dragonfly", "hazelcast", "varnish", "ignite")),
             ("message broker", ("rabbitmq", "nats", "pulsar", "kafka", "redpanda", "zeromq")),
             ("migration tool", ("alembic", "flyway", "liquibase", "sqitch", "atlas", "dbmate")))


class DecisionForm(Form):
    def draw(self, rng: random.Random) -> Fact:
        self.topic, self.options = rng.choice(DECISIONS)
        self.service, choice = text.service_name(rng), rng.choice(self.options)
        return Fact("decision", choice, f"Which {self.topic} did you settle on for {self.service}?",
                         (self._statement(self.service, choice),), subject=self.service)

    def _statement(self, service: str, choice: str) -> str:
        return f"For {service} I'm settling on {choice} as the {self.topic}"

    def _decided(self, base: Round, statement: str) -> Round:
        turns = [dict(t) for t in base.turns]
        turns[-1]["content"] = f"{statement}; it fits what the code expects."
        return Round(turns, base.body, base.slot, base.joiner, base.index)

    def lookalike(self, rng: random.Random, index: int) -> Round:
        service = _other(rng, text.service_name, self.service)
        choice = _other(rng, lambda r: r.choice(self.options), self.fact.answer)
        return self._decided(repo_filler(rng, index), self._statement(service, choice))

    def target(self, base: Round, rng: random.Random, crowded: bool) -> Round:
        return self._decided(base, self.fact.statements[0])


FORMS: dict[str, type[Form]] = {"chat": ChatForm, "code": CodeForm, "record": RecordForm, "decision": DecisionForm}
