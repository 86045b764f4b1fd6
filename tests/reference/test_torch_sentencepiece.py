"""SentencePiece GGUF vocabularies in the torch engine's tokenizer, against llama.cpp's SPM tokenizer on
the same file: a small vocabulary with shuffled scores (so merge order matters), byte fallback,
control tokens and the space prefix."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

pytest.importorskip("transformers")
pytest.importorskip("gguf")
pytest.importorskip("tokenizers")

from kvmem_core.gguf_file import GGUFFile  # noqa: E402
from gguf_writer import write_gguf  # noqa: E402
from torch_tiny import tiny_hf_config, tiny_hf_model  # noqa: E402
from kvmem_torch.tokenizer import from_gguf_meta  # noqa: E402

S = "\u2581"
WORDS = ("the", "and", "Hello", "world", "café", "in", "ing", "er", "or", "12", "na")
# overlapping pieces of a small alphabet without their unions: which bigram merges first decides the split
AMBIGUOUS = [a + b for a in "abcde" for b in "abcde"] + ["abc", "cde", "eab", "bca", S + "a", S + "ab"]
TEXTS = (
    "abcdeabcde",
    "eabca dcab",
    "bcdea acebd ecdba",
    "the and the",
    "Hello world",
    "  two  spaces",
    "café 12 naïve 日本",
    "a\nb\tc",
    "<s>the</s> and",
    "x",
    "The THE tHe theand",
    "Helloworld  ",
    " leading",
)


def sentencepiece_vocab(seed: int = 0) -> dict[str, list]:
    """unk, BOS, EOS, 256 byte tokens, then letters, the space piece and every prefix/suffix of a few words."""
    pieces = {S, *"abcdefghijklmnopqrstuvwxyzHTé12", *AMBIGUOUS}
    for word in WORDS:
        for w in (word, S + word):
            pieces |= {w[:i] for i in range(2, len(w) + 1)} | {w[i:] for i in range(1, len(w) - 1)}
    pieces = sorted(pieces)
    rng = random.Random(seed)
    scores = [-float(i) for i in range(len(pieces))]
    rng.shuffle(scores)
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)] + pieces
    return {"tokens": tokens, "scores": [0.0] * 259 + scores, "types": [2, 3, 3] + [6] * 256 + [1] * len(pieces)}


@pytest.fixture(scope="module")
def gguf_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    vocab = sentencepiece_vocab()
    config = tiny_hf_config("llama") | {"vocab_size": len(vocab["tokens"])}
    path = tmp_path_factory.mktemp("spm") / "spm.gguf"
    write_gguf(path, config, tiny_hf_model("llama", seed=1, config=config).state_dict(), sentencepiece=vocab)
    return path


@pytest.fixture(scope="module")
def ours(gguf_path: Path):
    f = GGUFFile(gguf_path)
    tok = from_gguf_meta(f.meta)
    f.close()
    return tok


@pytest.mark.llamacpp
@pytest.mark.parametrize("special", (True, False))
def test_token_ids_equal_llama_cpp(gguf_path: Path, ours, special: bool) -> None:
    llama_cpp = pytest.importorskip("llama_cpp")
    ref = llama_cpp.Llama(str(gguf_path), vocab_only=True, verbose=False)
    for text in TEXTS:
        assert ours.encode(text, special=special) == ref.tokenize(text.encode(), add_bos=False, special=special), text
    assert ours.encode("the", add_bos=True) == ref.tokenize(b"the", add_bos=True)


def test_pieces_spell_the_text_back(ours) -> None:
    for text in TEXTS[:5]:
        ids = ours.encode(text, special=False)
        assert b"".join(ours.token_bytes(i) for i in ids).decode() == " " + text  # the space prefix
        assert ours.decode(ids) == text
    assert ours.encode("日", special=False)[1:] == [3 + b for b in "日".encode()]  # byte fallback: <0xNN> ids


def test_a_long_text_is_tokenized_whole_every_time(ours) -> None:
    """Incremental tokenization is for byte-level BPE only: nothing is reused for a SentencePiece vocabulary."""
    text = "<s>the and</s> " * 400
    chars = []
    encode, ours.tok.encode = ours.tok.encode, lambda t, **kw: chars.append(len(t)) or encode(t, **kw)
    try:
        assert ours.encode(text) == ours.encode(text)
    finally:
        ours.tok.encode = encode
    assert chars == [len(text)] * 2
