"""The one sampler and stop-string stream the engine decodes with (kvmem_core.sampling)."""

from __future__ import annotations

import math
from typing import Callable

import numpy as np

from kvmem_core.contract import SamplingParams
from kvmem_core.sampling import Sampler, TextStream, decode, held_back, kept_probs, stop_cut, within


def filter_probs(z: np.ndarray, top_k: int, top_p: float) -> np.ndarray:
    """``kept_probs`` as a vector over the whole vocabulary, zero for the tokens left out."""
    tokens, probs = kept_probs(z, top_k, top_p)
    out = np.zeros(z.size)
    out[tokens] = probs
    return out


def test_greedy_takes_the_argmax() -> None:
    logits = np.array([0.1, 3.0, 2.9, -1.0], dtype=np.float32)
    assert Sampler(SamplingParams(temperature=0.0))(logits) == 1


def test_top_k_keeps_exactly_k() -> None:
    probs = filter_probs(np.array([1.0, 4.0, 3.0, 2.0, 0.0]), top_k=2, top_p=1.0)
    assert (probs > 0).tolist() == [False, True, True, False, False]
    assert math.isclose(probs.sum(), 1.0)


def test_top_p_keeps_the_smallest_set_reaching_p() -> None:
    logits = np.log(np.array([0.5, 0.3, 0.15, 0.05]))
    assert (filter_probs(logits, top_k=0, top_p=0.7) > 0).tolist() == [True, True, False, False]
    assert (filter_probs(logits, top_k=0, top_p=0.5) > 0).tolist() == [True, False, False, False]
    assert (filter_probs(logits, top_k=0, top_p=0.81) > 0).tolist() == [True, True, True, False]


def test_top_k_and_top_p_never_draw_a_filtered_token() -> None:
    rng = np.random.default_rng(0)
    logits = rng.standard_normal(50).astype(np.float32)
    allowed = set(np.argsort(-logits)[:3].tolist())
    sample = Sampler(SamplingParams(temperature=1.5, top_k=3, top_p=1.0, seed=1))
    assert {sample(logits) for _ in range(300)} == allowed


def test_seed_reproduces_and_the_distribution_follows_the_logits() -> None:
    logits = np.array([0.0, math.log(3.0)], dtype=np.float32)
    params = SamplingParams(temperature=1.0, top_k=0, top_p=1.0, seed=123)
    s1, s2 = Sampler(params), Sampler(params)
    draws = [s1(logits) for _ in range(4000)]
    assert draws[:50] == [s2(logits) for _ in range(50)]
    assert 0.72 < sum(draws) / 4000 < 0.78  # p(token 1) = 3/4
    other = Sampler(SamplingParams(temperature=1.0, top_k=0, top_p=1.0, seed=124))
    assert [other(logits) for _ in range(50)] != draws[:50]


def test_stop_cut_finds_only_matches_the_new_text_completed() -> None:
    assert stop_cut("Hello END", 1, ["END"]) == 6
    assert stop_cut("END and more", 4, ["END"]) is None
    assert stop_cut("a STOP b END", 3, ["END", "STOP"]) == 9


def test_held_back_is_the_longest_tail_that_starts_a_stop() -> None:
    assert held_back("Hello E", ["END"]) == 1
    assert held_back("Hello EN", ["END", "NX"]) == 2
    assert held_back("Hello", ["END"]) == 0
    assert held_back("aaa", ["aaab"]) == 3


def stream(pieces: list[str], stops: list[str]) -> tuple[str, str, str | None]:
    """(streamed text, final text, how it ended) for ``pieces`` arriving one token each."""
    sent: list[str] = []
    s = TextStream(stops, lambda piece: sent.append(piece) is None)
    ended = None
    for piece in pieces:
        ended = s.push(piece.encode())
        if ended:
            break
    final = s.close()
    return "".join(sent), final, ended


def test_a_stop_split_over_tokens_never_streams_its_start() -> None:
    assert stream(["Hello", " E", "N", "D"], ["END"]) == ("Hello ", "Hello ", "stop")
    assert stream(["Hello", " E", "N", "X"], ["END"]) == ("Hello ENX", "Hello ENX", None)
    assert stream(["Hello", " E"], ["END"]) == ("Hello E", "Hello E", None)  # released at the end


def test_multibyte_characters_split_over_tokens_come_out_whole() -> None:
    sent: list[str] = []
    s = TextStream([], lambda piece: sent.append(piece) is None)
    data = "né€".encode()
    for i in range(len(data)):
        assert s.push(data[i : i + 1]) is None
    assert s.close() == "né€" and "".join(sent) == "né€"


def test_a_refused_piece_aborts() -> None:
    s = TextStream(["END"], lambda piece: False)
    assert s.push(b"Hello E") == "abort"


def test_decode_commits_every_token_but_the_length_limits_last_and_reports_why_it_ended() -> None:
    pieces = {1: b"Hel", 2: b"lo", 3: b" EN", 4: b"D!", 9: b""}
    logits_for = {0: 1, 1: 2, 2: 3, 3: 4}
    advanced: list[int] = []

    def advance(token: int) -> Callable[[], np.ndarray]:
        advanced.append(token)
        return lambda: np.eye(10, dtype=np.float32)[logits_for.get(token, 9)]

    greedy = SamplingParams(temperature=0.0, max_tokens=10, stop=("END",))
    text, ids, finish = decode(
        greedy, np.eye(10, dtype=np.float32)[1], pieces.__getitem__, lambda t: t == 9, advance, lambda piece: True
    )
    assert (text, ids, finish) == ("Hello ", [1, 2, 3, 4], "stop") and advanced == [1, 2, 3, 4]
    advanced.clear()
    text, ids, finish = decode(
        SamplingParams(temperature=0.0, max_tokens=2),
        np.eye(10, dtype=np.float32)[1],
        pieces.__getitem__,
        lambda t: t == 9,
        advance,
        lambda piece: True,
    )
    assert (text, ids, finish) == ("Hello", [1, 2], "length") and advanced == [1]


def test_decode_streams_a_tokens_text_after_starting_the_next_forward() -> None:
    events: list[str] = []

    def advance(token: int) -> Callable[[], np.ndarray]:
        events.append(f"forward {token}")
        return lambda: events.append(f"wait {token}") or np.eye(10, dtype=np.float32)[token + 1]

    decode(
        SamplingParams(temperature=0.0, max_tokens=3),
        np.eye(10, dtype=np.float32)[1],
        lambda t: b"x",
        lambda t: False,
        advance,
        lambda piece: events.append(f"text {piece}") is None,
    )
    assert events == ["forward 1", "text x", "wait 1", "forward 2", "text x", "wait 2", "text x"]


def test_an_unset_max_tokens_becomes_the_room_left() -> None:
    assert within(SamplingParams(max_tokens=None), 300).max_tokens == 300
    assert within(SamplingParams(max_tokens=9), 300).max_tokens == 9


def test_decode_ends_at_the_next_token_once_the_client_is_gone_also_while_no_text_streams() -> None:
    """Every token's text starts the stop string, so nothing streams (``on_text`` is never called); the client
    leaving after the third token ends decode at that token, not at the stop string's mismatch or the limit."""
    checks, streamed = [], []

    def alive() -> bool:
        checks.append(True)
        return len(checks) < 3

    params = SamplingParams(temperature=0.0, max_tokens=40, stop=("a" * 50,))
    text, ids, finish = decode(
        params,
        np.eye(10, dtype=np.float32)[1],
        lambda t: b"a",
        lambda t: False,
        lambda t: lambda: np.eye(10, dtype=np.float32)[1],
        streamed.append,
        alive=alive,
    )
    assert (ids, finish, streamed) == ([1, 1, 1], "abort", []) and text == "aaa"


def test_a_temperature_so_small_the_logits_overflow_samples_greedily() -> None:
    logits = np.array([0.5, 3.0, -1.0], dtype=np.float32)
    assert Sampler(SamplingParams(temperature=5e-324, seed=1))(logits) == 1
