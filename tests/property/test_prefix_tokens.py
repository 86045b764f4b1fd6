"""Incremental tokenization gives the ids of tokenizing each text whole, with the default model's tokenizer in both
engines: transcripts grown turn by turn, edited in the middle, cut short anywhere (inside a control token too), with
unicode and control-token texts in the messages; the read-only int64 array a prompt is built from holds the same ids.
A turn that extends the last tokenizes only what it adds."""

from __future__ import annotations

from functools import partial
from pathlib import Path
from typing import Any, Callable, Iterator

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvmem_core.config import KVMemConfig
from kvmem_core.errors import ModelNotFoundError
from kvmem_core.gguf_file import GGUFFile
from kvmem_core.tokens import MIN_CHARS, PrefixTokenizer
from kvmem_torch.tokenizer import Tokenizer, from_gguf_meta

SYSTEM = "You are a careful build assistant; keep track of every failure and say which test broke. " * 50
Encode = Callable[[str], list[int]]


def chatml(messages: list[tuple[str, str]], prompt: bool) -> str:
    """What the default model's template renders for these messages."""
    turns = "".join(f"<|im_start|>{role}\n{content}<|im_end|>\n" for role, content in messages)
    return turns + ("<|im_start|>assistant\n" if prompt else "")


@pytest.fixture(scope="module")
def default_gguf() -> Path:
    from kvmem.models import resolve_model

    try:
        return resolve_model(None)
    except ModelNotFoundError as exc:
        pytest.skip(str(exc))


@pytest.fixture(scope="module")
def torch_tokenizer(default_gguf: Path) -> Tokenizer:
    f = GGUFFile(default_gguf)
    try:
        return from_gguf_meta(f.meta)
    finally:
        f.close()


@pytest.fixture(scope="module")
def llama_vocab(default_gguf: Path) -> Iterator[Any]:
    L = pytest.importorskip("llama_cpp")
    from kvmem_llamacpp.lowlevel import LlamaModel

    model = LlamaModel(default_gguf, vocab_only=True)
    yield L.llama_model_get_vocab(model.ptr)
    model.close()


def torch_whole(tokenizer: Tokenizer, text: str) -> list[int]:
    tokenizer.tok.encode_special_tokens = False
    return tokenizer.tok.encode(text, add_special_tokens=False).ids


@pytest.fixture(params=["torch", pytest.param("llama.cpp", marks=pytest.mark.llamacpp)])
def engine(request: pytest.FixtureRequest) -> tuple[Encode, Callable[[str], np.ndarray], Encode]:
    """(incremental list, incremental array, whole) tokenization with control tokens parsed: the torch tokenizer's
    ``encode`` and ``encode_array``, and the ``PrefixTokenizer`` the llama.cpp adapter makes over
    ``llama_tokenize``."""
    if request.param == "torch":
        tokenizer = request.getfixturevalue("torch_tokenizer")
        return tokenizer.encode, tokenizer.encode_array, partial(torch_whole, tokenizer)
    from kvmem_llamacpp.vocab import cut_tokens, tokens

    vocab = request.getfixturevalue("llama_vocab")
    whole = partial(tokens, vocab, special=True)
    prefix = PrefixTokenizer(whole, partial(cut_tokens, vocab))
    return prefix, prefix.array, whole


pieces = ["a", "b", " ", "  ", "\n", ".", "é", "東", "🚢", "<", "|>", "<|im_", "start|>", "user", "<tool_call>"]
contents = st.lists(st.sampled_from(pieces + ["<|im_start|>", "<|im_end|>", "<|endoftext|>"]), max_size=10).map("".join)
messages = st.lists(st.tuples(st.sampled_from(["user", "assistant", "system"]), contents), min_size=1, max_size=3)
changes = st.one_of(
    st.tuples(st.just("grow"), messages),
    st.tuples(st.just("edit"), st.integers(0, 30), contents),  # one message's content replaced
    st.tuples(st.just("drop"), st.integers(1, 30)),  # the transcript cut back to this many messages
)
turns = st.lists(st.tuples(changes, st.integers(0, 30), st.booleans()), min_size=1, max_size=6)


def change(transcript: list[tuple[str, str]], what: tuple[Any, ...]) -> list[tuple[str, str]]:
    if what[0] == "grow":
        return transcript + what[1]
    if what[0] == "edit" and len(transcript) > 1:  # the system prompt stays: texts stay past MIN_CHARS
        i = 1 + what[1] % (len(transcript) - 1)
        return [*transcript[:i], (transcript[i][0], what[2]), *transcript[i + 1 :]]
    return transcript[: what[1]] if what[0] == "drop" else transcript


@given(first=messages, turns=turns)
@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
def test_incremental_ids_equal_whole_tokenization(
    engine: tuple[Encode, Callable[[str], np.ndarray], Encode],
    first: list[tuple[str, str]],
    turns: list[tuple[Any, int, bool]],
) -> None:
    incremental, array, whole = engine
    transcript = [("system", SYSTEM), *first]
    for i, (what, chop, prompt) in enumerate(turns):
        transcript = change(transcript, what)
        text = chatml(transcript, prompt)
        text = text[: len(text) - chop]  # ends anywhere: inside a control token, between a surrogate-free pair
        assert len(text) >= MIN_CHARS
        if i % 2:  # both ways in turn, over the texts either kept
            ids = array(text)
            assert ids.dtype == np.int64 and not ids.flags.writeable
            assert ids.tolist() == whole(text)
        else:
            assert incremental(text) == whole(text)


class CountingTokenizer:
    """An HF ``tokenizers.Tokenizer`` that records the length of every text it encodes."""

    def __init__(self, tok: Any) -> None:
        object.__setattr__(self, "tok", tok)
        object.__setattr__(self, "chars", [])

    def encode(self, text: str, **kwargs: Any) -> Any:
        self.chars.append(len(text))
        return self.tok.encode(text, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.tok, name)

    def __setattr__(self, name: str, value: Any) -> None:
        setattr(self.tok, name, value)


def two_turns() -> tuple[str, str, str]:
    """A turn's text, the next turn's (its answer and a new question added) and how much of it is new: from the
    generation prompt's control token, where the two last share a cut."""
    first = [("system", SYSTEM), ("user", "Run the tests.")]
    text = chatml(first, True)
    after = chatml([*first, ("assistant", "3 failed: é 東."), ("user", "Fix the first.")], True)
    assert after.startswith(text)
    return text, after, after[text.rindex("<|im_start|>") :]


def test_torch_tokenizes_only_what_a_turn_adds(torch_tokenizer: Tokenizer) -> None:
    counting = CountingTokenizer(torch_tokenizer.tok)
    tokenizer = Tokenizer(counting, torch_tokenizer.bos_id, [], torch_tokenizer.add_bos, None)
    text, after, new = two_turns()
    assert tokenizer.encode(text) == torch_whole(torch_tokenizer, text)
    assert tokenizer.encode(after) == torch_whole(torch_tokenizer, after)
    assert counting.chars == [len(text), len(new)]


@pytest.mark.llamacpp
def test_llama_cpp_tokenizes_only_what_a_turn_adds(monkeypatch: pytest.MonkeyPatch) -> None:
    """Through the adapter (the small test model: a byte-level BPE vocabulary with ChatML control tokens)."""
    L = pytest.importorskip("llama_cpp")
    from model_support import small_model

    from kvmem_llamacpp import create_adapter
    from kvmem_llamacpp.vocab import tokens

    adapter = create_adapter(str(small_model()), KVMemConfig(ctx=4096, budget=1024, gen_budget=256))
    text, after, new = two_turns()
    expected = [tokens(adapter.model.vocab, t, special=True) for t in (text, after)]
    sizes, llama_tokenize = [], L.llama_tokenize
    monkeypatch.setattr(
        L, "llama_tokenize", lambda vocab, raw, n, *rest: sizes.append(n) or llama_tokenize(vocab, raw, n, *rest)
    )
    try:
        assert [adapter.tokenize(text), adapter.tokenize(after)] == expected
    finally:
        adapter.close()
    assert sizes == [len(text.encode()), len(new.encode())]  # llama.cpp reads UTF-8 bytes
