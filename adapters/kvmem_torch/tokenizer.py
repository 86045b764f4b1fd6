"""Tokenizer and chat template from the model itself: GGUF metadata or an HF ``tokenizer.json``.

GGUF BPE vocabularies (``tokenizer.ggml.model == "gpt2"``) are rebuilt as a ``tokenizers``
BPE with the pre-tokenizer llama.cpp uses for the file's ``tokenizer.ggml.pre``.
SentencePiece vocabularies (``"llama"``: Llama 2, Mistral, TinyLlama) become a BPE whose
merges rank by the score of the merged piece, with byte fallback and the ``▁`` space
prefix: the merge order of llama.cpp's SPM tokenizer. Chat templates render with jinja2 in
a sandbox, as HF and llama.cpp do.
"""

from __future__ import annotations

import json
from datetime import datetime
from functools import lru_cache, partial
from pathlib import Path
from typing import Any, Mapping, Sequence

import numpy as np

from kvmem_core.errors import UnsupportedModelError
from kvmem_core.tokens import PrefixTokenizer, clean_cuts, read_only

_QWEN2 = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"
    r"|\s+(?!\S)|\s+"
)
_QWEN35 = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_LLAMA3 = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_SPLIT_REGEX = {"qwen2": _QWEN2, "qwen35": _QWEN35, "llama3": _LLAMA3, "llama-bpe": _LLAMA3}
_UNKNOWN, _CONTROL, _USER_DEFINED, _BYTE = 2, 3, 4, 6
_SPACE = "\u2581"  # SentencePiece's visible space
_EOG_TEXTS = ("<|im_end|>", "<|endoftext|>", "<|eot_id|>", "<|end_of_text|>", "<end_of_turn>")


class Tokenizer:
    """Encode/decode, per-token bytes, end-of-generation ids and the chat template."""

    def __init__(
        self,
        tok: Any,
        bos_id: int | None,
        eos_ids: Sequence[int],
        add_bos: bool,
        chat_template: str | None,
        sentencepiece: bool = False,
    ) -> None:
        self.tok, self.sentencepiece = tok, sentencepiece
        self.bos_id, self.add_bos = bos_id, add_bos
        vocab = tok.get_vocab()
        self.eog_ids = frozenset(eos_ids) | {vocab[t] for t in _EOG_TEXTS if t in vocab}
        self.chat_template = chat_template
        self.id_to_token = {i: t for t, i in vocab.items()}
        self.special_ids = frozenset(i for i, t in tok.get_added_tokens_decoder().items() if t.special)
        self._parsed = PrefixTokenizer(partial(self._encode, special=True), lambda: _cut_tokens(tok))

    @property
    def vocab_size(self) -> int:
        return self.tok.get_vocab_size()

    def encode(self, text: str, special: bool = True, add_bos: bool = False) -> list[int]:
        """Token ids of ``text``; ``special`` parses control tokens; ``add_bos`` prepends BOS if the model wants one.
        A long text that starts like a recent one is tokenized from the last cut they share (``PrefixTokenizer``)."""
        ids = self._parsed(text) if special else self._encode(text, special=False)
        return [self.bos_id, *ids] if add_bos and self.add_bos and self.bos_id is not None else ids

    def encode_array(self, text: str) -> np.ndarray:
        """``encode(text)`` (control tokens parsed, no BOS) as a read-only int64 array (``PrefixTokenizer.array``)."""
        return self._parsed.array(text)

    def _encode(self, text: str, special: bool) -> list[int]:
        self.tok.encode_special_tokens = not special
        return self.tok.encode(text, add_special_tokens=False).ids

    def decode(self, ids: Sequence[int]) -> str:
        """Text of ``ids``, control tokens included as text."""
        return self.tok.decode(list(ids), skip_special_tokens=False)

    def token_bytes(self, token: int) -> bytes:
        """Raw bytes of one token (byte-level BPE pieces map back through the GPT-2 byte table; SentencePiece
        pieces turn ``▁`` into a space and ``<0xNN>`` into that byte)."""
        piece = self.id_to_token.get(token, "")
        if token in self.special_ids:
            return piece.encode()
        if self.sentencepiece:
            is_byte = len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">")
            return bytes([int(piece[3:5], 16)]) if is_byte else piece.replace(_SPACE, " ").encode()
        table = _byte_decoder()
        if all(ch in table for ch in piece):
            return bytes(table[ch] for ch in piece)
        return self.decode([token]).encode()

    def is_eog(self, token: int) -> bool:
        return token in self.eog_ids

    def render_chat(
        self,
        messages: Sequence[Mapping[str, Any]],
        tools: Sequence[Mapping[str, Any]] | None = None,
        add_generation_prompt: bool = True,
        **kwargs: Any,
    ) -> str:
        """Apply the model's chat template (jinja2 sandbox)."""
        if not self.chat_template:
            raise UnsupportedModelError("the model has no chat template; send a raw prompt instead")
        bos = self.id_to_token.get(self.bos_id, "") if self.bos_id is not None else ""
        eos = self.id_to_token.get(min(self.eog_ids), "") if self.eog_ids else ""
        return _compile(self.chat_template).render(
            messages=list(messages),
            tools=list(tools) if tools else None,
            add_generation_prompt=add_generation_prompt,
            bos_token=bos,
            eos_token=eos,
            **kwargs,
        )


class IdTokenizer:
    """The text form of a model without a vocabulary (``no_vocab`` test models): token ids as
    decimal numbers separated by spaces, ``"5 17 3"``. No chat template; nothing ends generation."""

    chat_template = None

    def __init__(self, vocab_size: int) -> None:
        self.vocab_size = vocab_size

    def encode(self, text: str, special: bool = True, add_bos: bool = False) -> list[int]:
        ids = [int(t) for t in text.split()]
        if any(not 0 <= i < self.vocab_size for i in ids):
            raise UnsupportedModelError(f"token ids must lie in [0, {self.vocab_size})")
        return ids

    def encode_array(self, text: str) -> np.ndarray:
        return read_only(np.asarray(self.encode(text), dtype=np.int64))

    def decode(self, ids: Sequence[int]) -> str:
        return "".join(f" {i}" for i in ids)

    def token_bytes(self, token: int) -> bytes:
        return f" {token}".encode()

    def is_eog(self, token: int) -> bool:
        return False

    def render_chat(
        self,
        messages: Sequence[Mapping[str, Any]],
        tools: Sequence[Mapping[str, Any]] | None = None,
        add_generation_prompt: bool = True,
        **kwargs: Any,
    ) -> str:
        raise UnsupportedModelError("the model has no chat template; send a raw prompt instead")


def _cut_tokens(tok: Any) -> dict[str, int]:
    """Text -> id of the added tokens a byte-level BPE cuts any text at cleanly (see ``kvmem_core.tokens.clean_cuts``):
    ``tokenizers`` cuts at every added token before normalizing and pre-tokenizing the pieces between, one by one.
    Added tokens matched after normalization, or that strip spaces before them or want a word boundary, do not
    count; other models (SentencePiece) get none."""
    from tokenizers import decoders

    if not isinstance(tok.decoder, decoders.ByteLevel):
        return {}
    added = tok.get_added_tokens_decoder()
    cuts = {t.content: i for i, t in added.items() if not (t.normalized or t.lstrip or t.single_word)}
    return clean_cuts(cuts, [t.content for t in added.values()])


@lru_cache(maxsize=8)
def _compile(template: str) -> Any:
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message: str) -> None:
        raise UnsupportedModelError(f"chat template: {message}")

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
    env.filters["tojson"] = lambda x, indent=None, ensure_ascii=False: json.dumps(
        x, indent=indent, ensure_ascii=ensure_ascii
    )
    env.globals.update(raise_exception=raise_exception, strftime_now=lambda fmt: datetime.now().strftime(fmt))
    return env.from_string(template)


@lru_cache(maxsize=1)
def _byte_decoder() -> dict[str, int]:
    """Inverse of GPT-2's bytes_to_unicode table."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs, n = list(bs), 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(bs, cs)}


def from_gguf_meta(meta: Mapping[str, Any]) -> Tokenizer:
    """Build the tokenizer a GGUF describes (byte-level BPE or SentencePiece vocabularies)."""
    from tokenizers import AddedToken

    kind = meta.get("tokenizer.ggml.model")
    if kind == "gpt2":
        tok = _byte_level_bpe(meta)
    elif kind == "llama":
        tok = _sentencepiece_bpe(meta)
    else:
        raise UnsupportedModelError(
            f"GGUF tokenizer model {kind!r} is not supported (have: 'gpt2' byte-level BPE, 'llama' SentencePiece)"
        )
    tokens, types = meta["tokenizer.ggml.tokens"], meta.get("tokenizer.ggml.token_type", [])
    tok.add_special_tokens(
        [
            AddedToken(tokens[i], special=True, normalized=False)
            for i, t in enumerate(types)
            if t in (_CONTROL, _USER_DEFINED)
        ]
    )
    eos = meta.get("tokenizer.ggml.eos_token_id")
    eot = meta.get("tokenizer.ggml.eot_token_id")
    add_bos = bool(meta.get("tokenizer.ggml.add_bos_token", kind == "llama"))
    return Tokenizer(
        tok,
        meta.get("tokenizer.ggml.bos_token_id"),
        [i for i in (eos, eot) if i is not None],
        add_bos,
        meta.get("tokenizer.chat_template"),
        sentencepiece=kind == "llama",
    )


def _byte_level_bpe(meta: Mapping[str, Any]) -> Any:
    from tokenizers import Regex, decoders, models, pre_tokenizers
    from tokenizers import Tokenizer as HFTokenizer

    tokens = meta["tokenizer.ggml.tokens"]
    merges = [tuple(m.split(" ", 1)) for m in meta["tokenizer.ggml.merges"]]
    tok = HFTokenizer(models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=merges, fuse_unk=False))
    tok.pre_tokenizer = _pre_tokenizer(meta.get("tokenizer.ggml.pre", "default"), pre_tokenizers, Regex)
    tok.decoder = decoders.ByteLevel()
    return tok


def _sentencepiece_bpe(meta: Mapping[str, Any]) -> Any:
    from tokenizers import decoders, models, normalizers
    from tokenizers import Tokenizer as HFTokenizer

    tokens = meta["tokenizer.ggml.tokens"]
    scores = meta.get("tokenizer.ggml.scores") or [0.0] * len(tokens)
    types = meta.get("tokenizer.ggml.token_type") or [1] * len(tokens)
    vocab = {t: i for i, t in enumerate(tokens)}
    unk = tokens[meta.get("tokenizer.ggml.unknown_token_id", 0)]
    tok = HFTokenizer(
        models.BPE(
            vocab=vocab,
            merges=sentencepiece_merges(tokens, scores, types),
            unk_token=unk,
            fuse_unk=True,
            byte_fallback=True,
        )
    )
    prefix = bool(meta.get("tokenizer.ggml.add_space_prefix", True))
    tok.normalizer = normalizers.Sequence([normalizers.Prepend(_SPACE)] * prefix + [normalizers.Replace(" ", _SPACE)])
    tok.decoder = decoders.Sequence(
        [decoders.Replace(_SPACE, " "), decoders.ByteFallback(), decoders.Fuse()] + [decoders.Strip(" ", 1, 0)] * prefix
    )
    return tok


def sentencepiece_merges(tokens: Sequence[str], scores: Sequence[float], types: Sequence[int]) -> list[tuple[str, str]]:
    """BPE merges equivalent to SentencePiece's scoring: every split of a piece into two vocabulary pieces,
    ranked by the merged piece's score (highest first), as llama.cpp's SPM tokenizer picks bigrams."""
    vocab = {t: i for i, t in enumerate(tokens)}
    ranked = []
    for i, piece in enumerate(tokens):
        if types[i] in (_UNKNOWN, _CONTROL, _BYTE):
            continue
        for cut in range(1, len(piece)):
            left, right = piece[:cut], piece[cut:]
            if left in vocab and right in vocab:
                ranked.append((-scores[i], vocab[left], vocab[right], left, right))
    return [(left, right) for *_, left, right in sorted(ranked)]


def _pre_tokenizer(pre: str, pre_tokenizers: Any, Regex: Any) -> Any:  # noqa: N803 - tokenizers' class name
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=pre not in _SPLIT_REGEX)
    if pre in _SPLIT_REGEX:
        return pre_tokenizers.Sequence(
            [pre_tokenizers.Split(Regex(_SPLIT_REGEX[pre]), behavior="isolated"), byte_level]
        )
    if pre == "smollm":
        return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
    return byte_level


def from_hf_dir(path: str | Path) -> Tokenizer:
    """``tokenizer.json`` plus ``tokenizer_config.json`` / ``chat_template.jinja`` of an HF directory."""
    from tokenizers import Tokenizer as HFTokenizer

    path = Path(path)
    tok = HFTokenizer.from_file(str(path / "tokenizer.json"))
    cfg = json.loads((path / "tokenizer_config.json").read_text()) if (path / "tokenizer_config.json").is_file() else {}
    template = cfg.get("chat_template")
    if (path / "chat_template.jinja").is_file():
        template = (path / "chat_template.jinja").read_text()
    vocab = tok.get_vocab()
    name = lambda v: v.get("content") if isinstance(v, dict) else v  # noqa: E731
    bos, eos = name(cfg.get("bos_token")), name(cfg.get("eos_token"))
    return Tokenizer(
        tok,
        vocab.get(bos) if bos else None,
        [vocab[eos]] if eos in vocab else [],
        bool(cfg.get("add_bos_token", False)),
        template,
    )
