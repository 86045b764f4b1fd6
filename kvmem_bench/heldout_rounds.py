"""Rounds, vocabulary and filler for the held-out session generator (``kvmem_bench.heldout``).

Kept apart from the bench's own generator (``kvmem_bench.sessions``) on purpose: none of its
words, rounds or distractor code is reused, so retrieval tuned on those sessions meets forms and
surroundings it has not seen. Nothing here ever writes a planted form (a gate, room or table
booking, a settings constant assignment, a shipment row), so a planted statement occurs only
where the generator puts it.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass


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


TASKS = (
    "Track down why {s} times out under load.",
    "Check how {s} is configured before the migration.",
    "Compare {s} with its neighbours; something drifted.",
    "Audit {s} ahead of the freeze.",
)
NOTES = ("Read {a}; moving on.", "Noted what {a} shows.", "{a} looks as expected.", "Nothing surprising in {a}.")


def tool_round(rng: random.Random, index: int, tool: str, args: dict, body: list[str]) -> Round:
    """An assistant call, its tool result (``body``) and a short note; every fourth round opens with a task."""
    call_id = f"toolu_{index:05d}"
    call = {"id": call_id, "type": "function", "function": {"name": tool, "arguments": json.dumps(args)}}
    turns = [{"role": "user", "content": rng.choice(TASKS).format(s=service_name(rng))}] if index % 4 == 0 else []
    turns += [
        {"role": "assistant", "content": "", "tool_calls": [call]},
        {"role": "tool", "tool_call_id": call_id, "content": ""},
        {"role": "assistant", "content": rng.choice(NOTES).format(a=tool)},
    ]
    return Round(turns, body, len(turns) - 2, index=index)


def repo_filler(rng: random.Random, index: int) -> Round:
    """A round that reads a non-settings file or runs a shell command."""
    if rng.random() < 0.7:
        service, file = service_name(rng), rng.choice(OTHER_FILES)
        return tool_round(
            rng, index, "read_file", {"path": f"services/{service}/{file}"}, other_source(rng, service, file)
        )
    return tool_round(rng, index, "bash", {"cmd": rng.choice(SHELL)}, shell_output(rng))


PERSONS = (
    "Priya",
    "Tomasz",
    "Amara",
    "Sven",
    "Leilani",
    "Kwame",
    "Ottilie",
    "Rafael",
    "Zainab",
    "Henrik",
    "Mirela",
    "Dario",
    "Yusuf",
    "Noor",
    "Teodora",
    "Caspian",
    "Ines",
    "Wendell",
    "Marisol",
    "Bogdan",
    "Saoirse",
    "Idris",
    "Fumiko",
    "Lorcan",
    "Beatriz",
    "Anselm",
    "Rukmini",
    "Evander",
    "Solveig",
    "Thandiwe",
)
CITIES = (
    "Osaka",
    "Porto",
    "Tallinn",
    "Cusco",
    "Halifax",
    "Dakar",
    "Bergen",
    "Hobart",
    "Valletta",
    "Leipzig",
    "Tbilisi",
    "Quito",
    "Nagoya",
    "Galway",
    "Windhoek",
    "Trieste",
)
HOTELS = ("Linden Court", "Seabright Inn", "Corvid House", "Old Mill Lodge", "Harrow Arms", "Pinegate Hotel")
RESTAURANTS = ("Salt & Ember", "the Copper Pot", "Fennel Street Diner", "Casa Lumo", "the Blue Heron", "Mizu Bar")
ERRANDS = (
    "return the library books",
    "pick up the dry cleaning",
    "renew my passport",
    "fix the bike's back brake",
    "get the car's tyres checked",
    "buy a birthday present for my nephew",
    "sort out the gas bill",
    "drop the old laptop at the recycling centre",
    "book a haircut",
    "replace the hallway light bulb",
)
PLANS = (
    "go hiking along the coast",
    "host a small dinner",
    "try the new climbing gym",
    "visit the botanical garden",
    "take a pottery class",
    "cycle out to the lake",
    "see the late film at the arthouse cinema",
    "spend a weekend at the cabin",
    "start a vegetable patch",
    "learn a few phrases of Portuguese",
)
EXCUSES = (
    "work keeps spilling into the evenings",
    "the weather has been miserable",
    "I keep forgetting",
    "the shop closes before I get out",
    "my calendar is a mess this month",
    "I was waiting on a refund",
)
TOPICS = (
    "moving to a smaller flat",
    "asking for a four-day week",
    "adopting a dog",
    "selling the old piano",
    "going back to evening classes",
    "taking the train instead of flying",
    "cooking in batches on Sundays",
)
PERIODS = ("weekend", "month", "spring", "autumn", "holiday", "week")
ADVICE = (
    "it usually helps to pick one thing and finish it first",
    "a short list on paper can take the pressure off",
    "asking a friend to join makes it easier to follow through",
    "blocking an hour in the calendar tends to work",
    "it is fine to let the less urgent errands wait a few days",
    "a rough budget first will make the choice clearer",
    "checking opening times the day before saves a wasted trip",
    "splitting it into two smaller outings is easier",
)

USER_LINES = (
    "I keep meaning to {errand} before the {period}, but {excuse}.",
    "{person} suggested we {plan}, which sounds lovely if the weather holds.",
    "Do you think it's worth trying to {plan} this {period}, or is that too ambitious?",
    "I've been turning over the idea of {topic} again.",
    "My sister wants to {plan} and I'm not sure I can get the time off.",
    "Also I still need to {errand}, which I've put off for ages.",
    "{person} and I talked about {topic} over lunch, and neither of us could decide.",
    "Honestly I'd rather {plan} than sit at home again.",
)
ASSISTANT_LINES = (
    "That sounds reasonable; {advice}.",
    "If time is short, {advice}.",
    "On {topic}, it may help to write down what would change day to day.",
    "Plans like that are easier with a date fixed early, so {advice}.",
    "It is a good sign that you keep coming back to it.",
    "You could {plan} next {period} and see how it feels.",
)


def chat_user_sentences(rng: random.Random, n: int) -> list[str]:
    """``n`` sentences of a person thinking aloud about errands, plans and colleagues."""
    return [_fill(rng.choice(USER_LINES), rng) for _ in range(n)]


def chat_reply(rng: random.Random, n: int) -> str:
    """An assistant's prose reply of ``n`` sentences."""
    return " ".join(_fill(rng.choice(ASSISTANT_LINES), rng) for _ in range(n))


def _fill(template: str, rng: random.Random) -> str:
    return template.format(
        errand=rng.choice(ERRANDS),
        period=rng.choice(PERIODS),
        excuse=rng.choice(EXCUSES),
        person=rng.choice(PERSONS),
        plan=rng.choice(PLANS),
        topic=rng.choice(TOPICS),
        advice=rng.choice(ADVICE),
    )


SERVICE_HEADS = (
    "ledger",
    "payout",
    "catalog",
    "invoice",
    "geo",
    "search",
    "notify",
    "audit",
    "pricing",
    "identity",
    "media",
    "booking",
    "loyalty",
    "export",
    "fraud",
    "inventory",
    "tariff",
    "session",
    "webhook",
    "quota",
)
SERVICE_TAILS = ("sync", "api", "worker", "gateway", "indexer", "scheduler", "relay", "store", "bridge", "cron")
REGIONS = (
    "lisbon",
    "montreal",
    "singapore",
    "frankfurt",
    "sydney",
    "oregon",
    "mumbai",
    "seoul",
    "dublin",
    "ohio",
    "paris",
    "zurich",
    "tokyo",
    "virginia",
    "stockholm",
    "milan",
)
OTHER_FILES = ("handlers.py", "models.py", "Dockerfile", "README.md", "tests/test_handlers.py", "urls.py")
IDENTS = ("payload", "cursor", "envelope", "ledger_row", "snapshot", "tenant", "receipt", "manifest", "digest", "slot")
SHELL = (
    "git diff --stat HEAD~3",
    "poetry run mypy .",
    "du -sh */",
    "tail -n 15 var/log/app.log",
    "pip list --outdated",
)


def service_name(rng: random.Random) -> str:
    """A two-part service name such as ``ledger-sync``."""
    return f"{rng.choice(SERVICE_HEADS)}-{rng.choice(SERVICE_TAILS)}"


def other_source(rng: random.Random, service: str, file: str) -> list[str]:
    """Lines of a non-settings file of ``service`` (handlers, models, a Dockerfile, ...)."""
    if file == "Dockerfile":
        return [
            "FROM python:3.12-slim",
            "WORKDIR /srv",
            f"COPY services/{service} ./{service}",
            "RUN pip install --no-cache-dir -r requirements.txt",
            f'CMD ["python", "-m", "{service}.main"]',
        ]
    if file == "README.md":
        return [
            f"# {service}",
            "",
            f"Owns the {rng.choice(IDENTS)} pipeline; see handlers.py for the entry points.",
            "Run the tests with `pytest -q` from the service folder.",
        ]
    lines = [f'"""{service}: {file}."""', "from __future__ import annotations", ""]
    for _ in range(rng.randint(3, 5)):
        a, b = rng.sample(IDENTS, 2)
        setting = rng.choice(("TIMEOUT_MS", "RETRY_LIMIT", "POOL_SIZE"))
        lines += [
            f"def handle_{a}({b}, settings):",
            f"    if not {b}.ready:",
            f"        return settings.{setting}",
            f"    return build_{a}({b}.items[:{rng.randint(2, 64)}])",
            "",
        ]
    return lines


def shell_output(rng: random.Random) -> list[str]:
    """A few lines of a diff-stat-like command output."""
    return [
        f"{rng.choice(SERVICE_HEADS)}/{rng.choice(IDENTS)}.py  | {rng.randint(1, 80)} "
        f"{'+' * rng.randint(1, 9)}{'-' * rng.randint(0, 6)}"
        for _ in range(rng.randint(5, 9))
    ]


COMPANIES = (
    "Halvorsen Foods",
    "Mbeki Textiles",
    "Quillon Labs",
    "Arbor & Finch",
    "Tessaro Marine",
    "Nakamura Print",
    "Brightwater Co",
    "Oduya Motors",
    "Falkner Glass",
    "Ivory Lane Books",
)
CARRIERS = ("Kestrel", "Bramble", "Tidewater", "Northvane", "Larkspur", "Ironbark", "Sundial", "Greyhaven")
STATUSES = ("delayed", "loaded", "held", "returned", "cleared", "staged", "weighed")
ENDPOINTS = ("/v2/health", "/v2/queues", "/v2/feature-flags", "/v2/rate-limits")


def other_table(rng: random.Random) -> tuple[str, list[str]]:
    """A query on a table unlike the shipments one, and its CSV result."""
    rows = [
        f"INV-{rng.randint(100, 999)}-{rng.choice('ABCDEFGH')},{rng.choice(COMPANIES)},"
        f"{rng.randint(10, 9000)}.{rng.randint(0, 99):02d},{rng.choice(('paid', 'open', 'void'))}"
        for _ in range(rng.randint(4, 8))
    ]
    return "SELECT number, customer, amount_eur, state FROM invoices ORDER BY issued DESC LIMIT 8", [
        "number,customer,amount_eur,state",
        *rows,
    ]


def endpoint_body(rng: random.Random, endpoint: str) -> list[str]:
    """The JSON lines an internal status endpoint returns."""
    return (
        [
            f'{{"name": "{rng.choice(IDENTS)}", "depth": {rng.randint(0, 400)}, "ok": {rng.choice(("true", "false"))}}}'
            for _ in range(rng.randint(4, 8))
        ]
        if endpoint != "/v2/health"
        else [f'{{"status": "ok", "uptime_s": {rng.randint(100, 99999)}}}']
    )
