"""llama.cpp's tokenizer, and where it cuts every text before anything else (for incremental tokenization).

``llama_tokenize`` (parsing special tokens) first cuts the text at each occurrence of a control,
user-defined or unknown token's text, longest tokens first, then tokenizes the pieces between
one by one; a byte-level BPE vocabulary tokenizes a piece without regard to what surrounds it.
SentencePiece and the other vocabulary types are left out (nothing is reused for them).
"""

from __future__ import annotations

from typing import Any

import llama_cpp as L

from kvmem_core.tokens import clean_cuts

_CUTTING = L.LLAMA_TOKEN_ATTR_CONTROL | L.LLAMA_TOKEN_ATTR_USER_DEFINED | L.LLAMA_TOKEN_ATTR_UNKNOWN
_PARSED = L.LLAMA_TOKEN_ATTR_CONTROL | L.LLAMA_TOKEN_ATTR_USER_DEFINED  # what parsing special tokens turns into them


def cut_tokens(vocab: Any) -> dict[str, int]:
    """Text -> id of the tokens ``llama_tokenize(..., parse_special=True)`` cuts any text at cleanly (see
    ``kvmem_core.tokens.clean_cuts``); none for a vocabulary other than byte-level BPE."""
    if L.llama_vocab_type(vocab) != L.LLAMA_VOCAB_TYPE_BPE:
        return {}
    texts, candidates = [], {}
    for token in range(L.llama_vocab_n_tokens(vocab)):
        attr = L.llama_vocab_get_attr(vocab, token)
        if not attr & _CUTTING:
            continue
        text = L.llama_vocab_get_text(vocab, token).decode("utf-8", "surrogateescape")
        texts.append(text)
        if attr & _PARSED and not attr & L.LLAMA_TOKEN_ATTR_LSTRIP:  # one that strips spaces before it moves its cut
            candidates[text] = token
    return clean_cuts(candidates, texts)


def tokens(vocab: Any, text: str, special: bool) -> list[int]:
    """``llama_tokenize`` of ``text`` as it is (no BOS added); ``special`` parses control tokens."""
    raw = text.encode()
    cap = len(raw) + 16
    buf = (L.llama_token * cap)()
    n = L.llama_tokenize(vocab, raw, len(raw), buf, cap, False, special)
    assert n >= 0, "token buffer too small"
    return list(buf[:n])
