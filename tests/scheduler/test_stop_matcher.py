"""The incremental stop-string matcher against a brute-force oracle (first match, hold-back),
its work per character counted (not timed) for 10 and 10,000 stop strings. What feeds it
(whole characters, each once) and the cut of a stream: test_output.py."""

from __future__ import annotations

import random

import pytest

from pipeserve.scheduler.stop_matcher import StopMatch, StopMatcher, automaton_for


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
