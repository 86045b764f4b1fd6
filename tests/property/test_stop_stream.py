"""Streamed text equals the final text for any split of the output into tokens and any stop set."""

from __future__ import annotations

import hypothesis.strategies as st
from hypothesis import given, settings

from kvmem_core.sampling import TextStream

ALPHABET = "abEND \né€"  # few letters, so stops and their prefixes occur often; multibyte characters too
texts = st.text(alphabet=ALPHABET, max_size=40)
stop_sets = st.lists(st.text(alphabet=ALPHABET, min_size=1, max_size=5), max_size=4)


@st.composite
def token_bytes(draw: st.DrawFn) -> list[bytes]:
    """The UTF-8 bytes of a text, cut into tokens anywhere (inside a character too)."""
    data = draw(texts).encode()
    cuts = sorted(draw(st.sets(st.integers(1, max(1, len(data) - 1)), max_size=len(data))))
    bounds = [0, *[c for c in cuts if c < len(data)], len(data)]
    return [data[a:b] for a, b in zip(bounds, bounds[1:]) if b > a]


@given(tokens=token_bytes(), stops=stop_sets)
@settings(max_examples=2000, deadline=None)
def test_streamed_text_is_the_final_text(tokens: list[bytes], stops: list[str]) -> None:
    sent: list[str] = []
    stream = TextStream(stops, lambda piece: sent.append(piece) is None)
    for data in tokens:
        if stream.push(data) is not None:
            break
    final = stream.close()
    assert "".join(sent) == final
    full = b"".join(tokens).decode("utf-8", "replace")
    assert full.startswith(final) and not any(s in final for s in stops)
    if stream.ended == "stop":  # cut right before a stop string
        assert any(full.startswith(s, len(final)) for s in stops)
    else:  # no stop anywhere: nothing was cut
        assert final == full and not any(s in full for s in stops)
