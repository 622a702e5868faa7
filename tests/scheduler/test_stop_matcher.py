"""The incremental stop-string matcher against a brute-force oracle (first match, hold-back),
its work per character counted (not timed) for 10 and 10,000 stop strings, the watch that
feeds it whole characters decoded token by token, and OutputStream's cut and hold-back."""

from __future__ import annotations

import random
from dataclasses import dataclass

import pytest

from pipeserve.scheduler.scheduler import RequestUpdate
from pipeserve.scheduler.stop_matcher import (
    MAX_HELD_TOKENS,
    StopMatch,
    StopMatcher,
    StopStringWatch,
    automaton_for,
)
from pipeserve.server.streams import OutputStream


def first_match(text: str, stops: list[str]) -> StopMatch | None:
    """Oracle: the stop string ending earliest in `text`; the longest of those ending there."""
    for end in range(1, len(text) + 1):
        ending = [s for s in stops if text[:end].endswith(s)]
        if ending:
            return StopMatch(max(ending, key=len), end)
    return None


def held(text: str, stops: list[str]) -> int:
    """Oracle: the longest tail of `text` that is a proper prefix of some stop string."""
    return max(
        (n for s in stops for n in range(1, min(len(s) - 1, len(text)) + 1)
         if s.startswith(text[-n:])),
        default=0,
    )


def feed_pieces(matcher: StopMatcher, text: str, rng: random.Random) -> StopMatch | None:
    pos = 0
    while pos < len(text):
        step = rng.randint(0, 4)
        matcher.feed(text[pos : pos + step])
        pos += step
    return matcher.match


# -- the matcher --------------------------------------------------------------------------


def test_reports_the_earliest_ending_stop_string_fed_in_pieces() -> None:
    m = StopMatcher(automaton_for(("cdef", "de", "zz")))
    assert m.feed("abc") is None and m.held == 1  # "c" may start "cdef"
    assert m.feed("d") is None and m.held == 2
    assert m.feed("efgh") == StopMatch("de", 5)  # "de" ends before "cdef" would
    assert m.feed("zz") == StopMatch("de", 5)  # the first match stays


def test_of_stop_strings_ending_together_the_longest_wins() -> None:
    m = StopMatcher(automaton_for(("bc", "abc", "c")))
    assert m.feed("xabc") == StopMatch("abc", 4)
    assert m.match is not None and m.match.start == 1


def test_same_match_in_whatever_order_the_stop_strings_come() -> None:
    for stops in [("ab", "b"), ("b", "ab")]:
        assert StopMatcher(automaton_for(stops)).feed("xab") == StopMatch("ab", 3)


@pytest.mark.parametrize("seed", range(40))
def test_agrees_with_a_brute_force_oracle(seed: int) -> None:
    rng = random.Random(seed)
    alphabet = "ab\u2603c"[: rng.randint(2, 4)]
    stops = ["".join(rng.choices(alphabet, k=rng.randint(1, 6))) for _ in range(rng.randint(1, 8))]
    text = "".join(rng.choices(alphabet, k=rng.randint(0, 40)))
    automaton = automaton_for(tuple(stops))
    whole = StopMatcher(automaton)
    assert feed_pieces(whole, text, rng) == first_match(text, stops)
    for cut in range(len(text) + 1):  # hold-back after every prefix that has no match yet
        m = StopMatcher(automaton)
        if m.feed(text[:cut]) is None:
            assert m.held == held(text[:cut], stops), (text[:cut], stops)


def test_work_per_character_does_not_grow_with_the_number_of_stop_strings() -> None:
    """Steps (transitions tried + failure links followed) are counted, not timed: at most two
    per character with 10 or 10,000 stop strings, on a text that keeps almost matching."""
    rng = random.Random(0)
    text = "".join(rng.choices("ab", k=5000)) + "a" * 3000 + "b"
    counts = {}
    for n in (10, 10_000):
        stops = tuple("a" * rng.randint(1, 40) + "".join(rng.choices("abc", k=8)) + "c"
                      for _ in range(n))
        m = StopMatcher(automaton_for(stops))
        assert m.feed(text) is None
        counts[n] = m.steps
    assert all(c <= 2 * len(text) for c in counts.values()), counts
    assert counts[10_000] <= 2 * len(text) and counts[10] >= len(text)


def test_automaton_is_built_once_per_distinct_stop_tuple() -> None:
    assert automaton_for(("x", "y")) is automaton_for(("x", "y"))
    assert automaton_for(("x", "y")).num_states == 3


def test_odd_characters_are_plain_characters() -> None:
    """Validation rejects lone surrogates at the boundary; the matcher itself never raises."""
    m = StopMatcher(automaton_for(("\ud800", "\x00\U0001f600")))
    assert m.feed("a\x00\U0001f600") == StopMatch("\x00\U0001f600", 3)


# -- the watch: whole characters, each fed once --------------------------------------------


BYTES = [b"a", b"b", b"\xe2", b"\x98", b"\x83", b" x", b"\xff", b"x\xe2"]  # \u2603: e2 98 83


def byte_decode(ids: list[int]) -> str:
    return b"".join(BYTES[i] for i in ids).decode("utf-8", errors="replace")


def watch_run(stops: tuple[str, ...], ids: list[int]) -> tuple[list[str], list[str | None]]:
    """What the matcher was fed, piece by piece, and what the watch found after each token."""
    watch, fed, found = StopStringWatch(stops, byte_decode), [], []
    feed = watch.matcher.feed
    watch.matcher.feed = lambda text: (fed.append(text), feed(text))[1]  # type: ignore[method-assign]
    for n in range(1, len(ids) + 1):
        found.append(watch.advance(ids[:n]))
    return fed, found


def test_a_character_split_over_tokens_is_fed_whole_and_once() -> None:
    fed, found = watch_run(("\u2603 x", "\ufffd"), [0, 2, 3, 4, 5, 1])  # "a\u2603 xb"
    assert found == [None, None, None, None, "\u2603 x", "\u2603 x"]
    assert "".join(fed) == "a\u2603 xb"  # never a U+FFFD for the half character


def test_a_stop_string_before_a_split_character_is_found_at_once() -> None:
    fed, found = watch_run(("ax",), [0, 7, 3, 4])  # "a", "x" + first byte of \u2603
    assert found == [None, "ax", "ax", "ax"]
    assert fed[:2] == ["a", "x"]  # the stop string's last character came with the half one


def test_every_character_is_fed_exactly_once() -> None:
    ids = [0, 2, 3, 4, 1, 5, 2, 3, 4, 2, 7, 3, 4, 6, 2, 3, 4, 6, 0]
    fed, found = watch_run(("never",), ids)
    assert found == [None] * len(ids)
    assert "".join(fed) == byte_decode(ids)


def test_invalid_bytes_are_taken_after_a_bounded_wait() -> None:
    fed, found = watch_run(("\ufffd",), [6] * (MAX_HELD_TOKENS + 1))
    assert found[MAX_HELD_TOKENS - 2] is None and found[-1] == "\ufffd"


def test_the_decode_window_stays_bounded_when_tokens_decode_to_nothing() -> None:
    windows: list[int] = []

    def decode(ids: list[int]) -> str:
        windows.append(len(ids))
        return "".join("" if i == 8 else byte_decode([i]) for i in ids)

    watch, ids = StopStringWatch(("ab",), decode), [8] * 100 + [0, 1]
    found = [watch.advance(ids[:n]) for n in range(1, len(ids) + 1)]
    assert found[-2:] == [None, "ab"]
    assert max(windows) <= 2 * MAX_HELD_TOKENS


# -- OutputStream: exact cut, hold-back from the matcher -------------------------------------


@dataclass
class CharTokenizer:
    """Token i is the i-th character of `chars`."""

    chars: str

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return "".join(self.chars[i] for i in ids)


def stream_texts(stop: tuple[str, ...], pieces: str, finish: RequestUpdate) -> list[str]:
    tok = CharTokenizer(pieces)
    stream = OutputStream("r", tok, stop, prompt_tokens=1)  # type: ignore[arg-type]
    texts = [stream.apply(RequestUpdate("r", new_token_ids=[i])).text
             for i in range(len(pieces) - 1)]
    finish.new_token_ids = [len(pieces) - 1]
    return [*texts, stream.apply(finish).text]


def test_stream_holds_back_a_possible_stop_string_and_releases_it() -> None:
    done = RequestUpdate("r", finish_reason="length")
    assert stream_texts(("abc",), "xabdy", done) == ["x", "", "", "abd", "y"]


def test_stream_cuts_exactly_before_the_stop_string() -> None:
    done = RequestUpdate("r", finish_reason="stop", matched_stop="abc")
    assert stream_texts(("abc", "bz"), "xyabc", done) == ["x", "y", "", "", ""]


@pytest.mark.parametrize("seed", range(20))
def test_stream_sends_what_the_oracle_allows(seed: int) -> None:
    rng = random.Random(seed)
    stops = ["".join(rng.choices("abc", k=rng.randint(1, 4))) for _ in range(3)]
    text = "".join(rng.choices("abcd", k=30))
    match = first_match(text, stops)
    n = len(text) if match is None else match.end
    done = RequestUpdate("r", finish_reason="length" if match is None else "stop",
                         matched_stop=None if match is None else match.stop)
    got = stream_texts(tuple(stops), text[:n], done)
    for i in range(len(got) - 1):  # sent so far: all but the tail that may be a stop
        assert "".join(got[: i + 1]) == text[: i + 1 - held(text[: i + 1], stops)]
    assert "".join(got) == (text if match is None else text[: match.start])
