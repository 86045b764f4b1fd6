"""Synthetic documents for retrieval-head calibration: one planted fact among look-alikes.

Each document mixes one kind of surrounding text (prose, log lines, JSON records, code,
chat turns) with facts of one template (an entity name and a code); exactly one fact is
asked about, the others are same-form distractors. Everything is generated offline from a
seed. The forms are deliberately unlike agent tool-result transcripts (which benchmarks use),
so calibration does not fit the test data.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

ENTITIES = (
    "Falcon",
    "Heron",
    "Juniper",
    "Basalt",
    "Orchid",
    "Tundra",
    "Marigold",
    "Quartz",
    "Cobalt",
    "Willow",
    "Saffron",
    "Granite",
    "Lantern",
    "Meridian",
    "Harbor",
    "Nimbus",
    "Sequoia",
    "Topaz",
    "Vireo",
    "Ember",
)
FACTS = (
    ("The access code for project {e} is {c}.", "What is the access code for project {e}?"),
    ("Locker {e} opens with the combination {c}.", "Which combination opens locker {e}?"),
    ("Agent {e} was assigned the badge number {c}.", "What badge number was agent {e} assigned?"),
    (
        "The shipment labelled {e} carries tracking number {c}.",
        "What tracking number does the shipment labelled {e} carry?",
    ),
)
PROSE = (
    "The committee met again on a grey morning and reviewed the quarterly figures line by line.",
    "Rain had delayed the harvest, so the cooperative moved its market day to the following week.",
    "A small museum near the river displays tools that the first settlers carried across the hills.",
    "The library extended its opening hours after students asked for a quiet place to study.",
    "Engineers replaced the old bridge cables, and traffic resumed before the holiday weekend.",
    "The orchestra rehearsed the second movement twice, slowing the tempo in the final bars.",
)
LOG = (
    "{t} INFO  scheduler: job {n} finished in {m} ms",
    "{t} WARN  cache: eviction pressure at {m}%",
    "{t} DEBUG http: GET /api/v1/items/{n} 200",
    "{t} INFO  worker-{m}: heartbeat ok",
)
CODE = (
    "def total_{n}(values):\n    return sum(v * {m} for v in values)\n",
    "for i in range({m}):\n    buffer.append(i % {n})\n",
    "class Record{n}:\n    size = {m}\n",
)
CHAT = (
    "User: could you check the weather for tomorrow?\nAssistant: Light rain in the morning, clearing later.",
    "User: how long does the train take?\nAssistant: About {m} minutes with one change.",
    "User: remind me to call the bank.\nAssistant: I will remind you at {m} o'clock.",
)
SURROUNDINGS = ("prose", "log", "json", "code", "chat")


@dataclass(frozen=True)
class SyntheticDoc:
    """Document text, the question, and the planted fact's character span in ``text``."""

    text: str
    question: str
    answer: str
    fact_span: tuple[int, int]


def make_doc(seed: int, *, filler_lines: int = 40, n_distractors: int = 5) -> SyntheticDoc:
    """One document: ``filler_lines`` of one surrounding, one target fact and same-form distractors."""
    rng = random.Random(seed)
    fact, question = FACTS[seed % len(FACTS)]
    kind = SURROUNDINGS[seed % len(SURROUNDINGS)]
    names = rng.sample(ENTITIES, n_distractors + 1)
    codes = [str(rng.randint(10000, 99999)) for _ in names]
    lines = [_filler(kind, rng) for _ in range(filler_lines)]
    slots = sorted(rng.sample(range(2, filler_lines), len(names)))
    target = rng.randrange(len(names))
    for i, slot in reversed(list(enumerate(slots))):
        lines.insert(slot, _wrap(kind, fact.format(e=names[i], c=codes[i])))
    text, span = _join(lines, fact.format(e=names[target], c=codes[target]))
    return SyntheticDoc(text, question.format(e=names[target]), codes[target], span)


def make_docs(n: int, seed: int = 0, **kwargs: int) -> list[SyntheticDoc]:
    """``n`` documents cycling through every fact template and surrounding."""
    return [make_doc(seed + i, **kwargs) for i in range(n)]


def _filler(kind: str, rng: random.Random) -> str:
    n, m = rng.randint(100, 999), rng.randint(2, 90)
    if kind == "prose":
        return rng.choice(PROSE)
    if kind == "log":
        t = f"2025-03-{rng.randint(10, 28)}T{rng.randint(10, 23)}:{rng.randint(10, 59)}:{rng.randint(10, 59)}"
        return rng.choice(LOG).format(t=t, n=n, m=m)
    if kind == "json":
        return f'{{"id": {n}, "status": "{rng.choice(["open", "closed", "pending"])}", "count": {m}}}'
    if kind == "code":
        return rng.choice(CODE).format(n=n, m=m).rstrip()
    return rng.choice(CHAT).format(m=m)


def _wrap(kind: str, fact: str) -> str:
    if kind == "log":
        return f"2025-03-14T09:30:00 NOTE  registry: {fact}"
    if kind == "json":
        return f'{{"note": "{fact}"}}'
    if kind == "code":
        return f"# {fact}"
    if kind == "chat":
        return f"User: note this down. {fact}\nAssistant: Noted."
    return fact


def _join(lines: list[str], target_fact: str) -> tuple[str, tuple[int, int]]:
    text = "\n".join(lines)
    start = text.index(target_fact)
    return text, (start, start + len(target_fact))
