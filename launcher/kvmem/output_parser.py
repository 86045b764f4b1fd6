"""Generated text -> reasoning, content and tool calls, streamed or whole.

The model's chat template decides what its answers look like (``ChatFormat``): whether it
thinks inside tags (``kvmem_core.reasoning``) and which tool-call syntax it uses
(``kvmem.tool_syntax``). ``OutputParser`` reads a step's text pieces as they come and gives
items out as soon as they are certain: ``("reasoning", text)``, ``("content", text)``,
``("call", tool_call)``. It holds back only what may still turn out to be a tag or a call,
so a stream's items concatenate to what parsing the whole text gives (``parse_output``).

Blanks around tags are not content: reasoning and content drop the blanks that open them
after a tag, reasoning the blanks before its closing tag, content those before a call.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Collection

from kvmem.tool_syntax import SYNTAXES, Call, Item, Syntax, detect
from kvmem_core.reasoning import ThinkTags, think_tags
from kvmem_core.sampling import held_back


@dataclass(frozen=True)
class ChatFormat:
    """What a model's answers look like: the tool syntax it was taught (None: its template renders no
    tools, so KVMem writes them as plain ``hermes`` text) and its think tags (None: no thinking)."""

    tools: str | None = None
    think: ThinkTags | None = None

    @classmethod
    def detect(cls, template: str) -> ChatFormat:
        return cls(detect(template), think_tags(template))

    @property
    def syntax(self) -> Syntax:
        return SYNTAXES[self.tools or "hermes"]

    def parser(self, with_tools: bool, declared: Collection[str] | None = None) -> OutputParser:
        """A parser for one answer; ``with_tools``: the request offered tools, so calls are read; ``declared``:
        the names it offered (a call to another name stays content; None: any name is a call)."""
        return OutputParser(self.think, self.syntax if with_tools else None, declared)


@dataclass
class Parsed:
    """A whole answer, split."""

    reasoning: str = ""
    content: str = ""
    calls: list[Call] = field(default_factory=list)

    def add(self, item: Item) -> None:
        kind, value = item
        if kind == "call":
            self.calls.append(value)
        else:
            setattr(self, kind, getattr(self, kind) + value)


class ThinkSplit:
    """Text pieces -> reasoning and content items, by the think tags (partial tags held back)."""

    def __init__(self, tags: ThinkTags) -> None:
        self.tags = tags
        self.buf = ""
        self.inside = False
        self.fresh = False  # just past a tag: leading blanks are dropped

    def feed(self, piece: str, final: bool = False) -> list[Item]:
        self.buf += piece
        out: list[Item] = []
        while True:
            tag = self.tags.close if self.inside else self.tags.open
            at = self.buf.find(tag)
            if at < 0:
                break
            self._say(self.buf[:at].rstrip() if self.inside else self.buf[:at], out)
            self.buf, self.inside, self.fresh = self.buf[at + len(tag) :], not self.inside, True
        keep = 0 if final else held_back(self.buf, (tag,))
        if self.inside and not final:
            keep += _trailing(self.buf[: len(self.buf) - keep], " \t\r\n")
        self._say(self.buf[: len(self.buf) - keep], out)
        self.buf = self.buf[len(self.buf) - keep :]
        return out

    def _say(self, text: str, out: list[Item]) -> None:
        if self.fresh:
            text = text.lstrip()
            self.fresh = not text
        if text:
            out.append(("reasoning" if self.inside else "content", text))


class ToolStream:
    """Content pieces -> content items and complete calls, by a ``Syntax``.

    A call region is held until the syntax reads it; text that may begin one (a partial
    marker, blanks, an answer's first ``{``) is held until it is certain. A region calling a
    name outside ``declared`` (when given) is content: a client cannot run a tool it never offered.
    """

    def __init__(self, syntax: Syntax, declared: Collection[str] | None = None) -> None:
        self.syntax = syntax
        self.declared = None if declared is None else frozenset(declared)
        self.buf = ""
        self.region = False  # buf starts with a call region
        self.gap = ""  # blanks before the region: dropped if it holds a call, content otherwise
        self.spoken = False  # content other than blanks was given out: leading markers no longer apply
        self.after_call = False

    def feed(self, piece: str, final: bool = False) -> list[Item]:
        self.buf += piece
        out: list[Item] = []
        while self.buf:
            if self.region:
                items, used = self.syntax.read(self.buf, final)
                if not used:
                    break
                region, self.buf, self.region = self.buf[:used], self.buf[used:], False
                self._take(items, region, out)
                continue
            start = self._region_start()
            if start is None:
                keep = 0 if final else self._held()
                self._say(self.buf[: len(self.buf) - keep], out)
                self.buf = self.buf[len(self.buf) - keep :]
                break
            cut = start - _trailing(self.buf[:start], self.syntax.blanks)
            self._say(self.buf[:cut], out)
            self.gap, self.buf, self.region = self.buf[cut:start], self.buf[start:], True
        return out

    def _take(self, items: list[Item], region: str, out: list[Item]) -> None:
        gap, self.gap = self.gap, ""
        calls = [value for kind, value in items if kind == "call"]
        if not calls:
            self._say(gap + "".join(v for _, v in items), out)
            return
        if self.declared is not None and any(c["function"]["name"] not in self.declared for c in calls):
            self._say(gap + region, out)
            return
        for kind, value in items:
            if kind == "call":
                out.append(("call", value))
                self.after_call = True
            else:
                self._say(value, out)

    def _region_start(self) -> int | None:
        found = [i for i in (self.buf.find(m) for m in self.syntax.markers) if i >= 0]
        rest = self.buf.lstrip(self.syntax.blanks)
        if not self.spoken and rest.startswith(self.syntax.leading):
            found.append(len(self.buf) - len(rest))
        return min(found, default=None)

    def _held(self) -> int:
        """How much of the buffer's end may still begin a region, or separate content from one."""
        rest = self.buf.lstrip(self.syntax.blanks)
        if not self.spoken and any(m.startswith(rest) for m in self.syntax.leading):
            return len(self.buf)
        keep = held_back(self.buf, self.syntax.markers)
        return keep + _trailing(self.buf[: len(self.buf) - keep], self.syntax.blanks)

    def _say(self, text: str, out: list[Item]) -> None:
        if self.after_call:
            text = text.lstrip(self.syntax.blanks)
            self.after_call = not text
        if text:
            out.append(("content", text))
            self.spoken = self.spoken or bool(text.strip(self.syntax.blanks))


def _trailing(text: str, blanks: str) -> int:
    return len(text) - len(text.rstrip(blanks))


class OutputParser:
    """Reasoning first (tool calls inside a think block are thoughts, not calls), then tool calls."""

    def __init__(self, think: ThinkTags | None, syntax: Syntax | None, declared: Collection[str] | None = None) -> None:
        self.think = ThinkSplit(think) if think else None
        self.tools = ToolStream(syntax, declared) if syntax else None

    def feed(self, piece: str, final: bool = False) -> list[Item]:
        """Items that ``piece`` made certain; with ``final`` everything still held comes out too."""
        items = self.think.feed(piece, final) if self.think else [("content", piece)] if piece else []
        if self.tools is None:
            return items
        out: list[Item] = []
        for kind, value in items:
            out += self.tools.feed(value) if kind == "content" else [(kind, value)]
        return out + (self.tools.feed("", final=True) if final else [])

    def finish(self) -> list[Item]:
        return self.feed("", final=True)


def parse_output(text: str, parser: OutputParser) -> Parsed:
    """The whole of one answer, split by a fresh ``parser``."""
    parsed = Parsed()
    for item in parser.feed(text, final=True):
        parsed.add(item)
    return parsed
