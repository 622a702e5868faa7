"""The output processor (scheduler/output.py), on a byte-level tokenizer built in code:
whole characters only, each decoded once, by one decoder step per token; a character split
over tokens is matched and sent whole; tokens that never make a character (invalid bytes,
special tokens) are taken after a bounded wait; a stream holds back a possible stop string
and releases it, cuts exactly before the stop string (through it with
include_stop_str_in_output), and sends what a brute-force oracle allows."""

from __future__ import annotations

import random

import pytest
from byte_tokenizer import PieceTokenizer, letters
from test_stop_matcher import first_match, held

from pipeserve.scheduler.output import CONTEXT_TOKENS, MAX_HELD_TOKENS, OutputProcessor
from pipeserve.scheduler.scheduler import RequestUpdate

# \u2603 is e2 98 83; token 6 is an invalid byte; token 8 a special token
PIECES = [b"a", b"b", b"\xe2", b"\x98", b"\x83", b" x", b"\xff", b"x\xe2", b"<|end|>"]
SNOWMAN = [2, 3, 4]


def tokenizer() -> PieceTokenizer:
    return PieceTokenizer(PIECES, specials=(8,))


def add_all(p: OutputProcessor, ids: list[int]) -> list[str | None]:
    return [p.add(t) for t in ids]


def fed_pieces(p: OutputProcessor) -> list[str]:
    """What the processor's matcher is fed, piece by piece, from now on."""
    assert p.matcher is not None
    fed: list[str] = []
    feed = p.matcher.feed
    p.matcher.feed = lambda text: (fed.append(text), feed(text))[1]  # type: ignore[method-assign]
    return fed


def test_one_decoder_step_per_token_and_no_other_decoding() -> None:
    tok = tokenizer()
    p = OutputProcessor("r", tok, ("never",))
    ids = [0, *SNOWMAN, 5, 1, 7, 3, 4, 0] * 10
    add_all(p, ids)
    assert tok.steps == len(ids) and tok.decodes == 0
    assert p.text == tok.decode(ids)


def test_a_character_split_over_tokens_is_fed_whole_and_once() -> None:
    p = OutputProcessor("r", tokenizer(), ("\u2603 x", "\ufffd"))
    fed = fed_pieces(p)
    found = add_all(p, [0, *SNOWMAN, 5, 1])  # "a\u2603 xb"
    assert found == [None, None, None, None, "\u2603 x", "\u2603 x"]
    assert "".join(fed) == "a\u2603 xb"  # never a U+FFFD for the half character


def test_a_stop_string_before_a_split_character_is_found_once_the_character_is_whole() -> None:
    p = OutputProcessor("r", tokenizer(), ("ax",))
    found = add_all(p, [0, 7, 3, 4])  # "a", "x" + first byte of \u2603, then the rest
    assert found == [None, None, None, "ax"]


def test_every_character_is_fed_exactly_once() -> None:
    tok = tokenizer()
    p = OutputProcessor("r", tok, ("never",))
    fed = fed_pieces(p)
    ids = [0, *SNOWMAN, 1, 5, *SNOWMAN, 2, 7, 3, 4, 8, *SNOWMAN, 8, 0]
    assert add_all(p, ids) == [None] * len(ids)
    assert "".join(fed) == tok.decode(ids) == p.text


def test_invalid_bytes_are_taken_after_a_bounded_wait() -> None:
    """After MAX_HELD_TOKENS tokens without a character, their bytes are taken as they
    decode, but the last 3 (they may begin one); at the end, all of them."""
    tok = tokenizer()
    p = OutputProcessor("r", tok, ("\ufffd",))
    found = add_all(p, [6] * MAX_HELD_TOKENS)
    assert found[:-1] == [None] * (MAX_HELD_TOKENS - 1) and found[-1] == "\ufffd"
    assert p.text == "\ufffd" * (MAX_HELD_TOKENS - 3)
    p.delta(RequestUpdate("r", new_token_ids=[6] * MAX_HELD_TOKENS, finish_reason="length"))
    assert p.text == "\ufffd" * MAX_HELD_TOKENS == tok.decode([6] * MAX_HELD_TOKENS)


# bytes of valid text, one token per byte (multi-byte characters split), and special tokens
BYTE_PIECES = [bytes([b]) for b in range(256)] + [b"<|s|>"]
SPECIAL = 256


def byte_tokens(text: str) -> list[int]:
    return list(text.encode())


@pytest.mark.parametrize("seed", range(10))
def test_valid_text_comes_out_whole_whatever_runs_of_special_tokens_come_between(
    seed: int,
) -> None:
    """Valid UTF-8 split into byte tokens, with runs of special tokens (skipped) of any
    length between characters: the text is exactly what decoding it all gives."""
    rng = random.Random(seed)
    tok = PieceTokenizer(BYTE_PIECES, specials=(SPECIAL,))
    chars = "ab \u00e9\u4f60\U0001f600\u2603"
    ids: list[int] = []
    for _ in range(60):
        ids += [SPECIAL] * rng.choice([0, 0, 1, 3, 5, 7, 8, 9, 20])
        ids += byte_tokens(rng.choice(chars))
    p = OutputProcessor("r", tok, ("never",))
    add_all(p, ids)
    p.delta(RequestUpdate("r", new_token_ids=ids, finish_reason="length"))
    assert p.text == tok.decode(ids)


@pytest.mark.parametrize("seed", range(10))
def test_invalid_bytes_cost_only_replacement_characters(seed: int) -> None:
    """Random bytes (much invalid UTF-8): every whole character decoding it all gives comes
    out once, in order; only the count of replacement characters may differ (bytes taken
    after the bounded wait)."""
    rng = random.Random(seed)
    tok = PieceTokenizer(BYTE_PIECES, specials=(SPECIAL,))
    pool = [*range(0x80, 0x100), *byte_tokens("a\u4f60\U0001f600"), SPECIAL]
    ids = [rng.choice(pool) for _ in range(300)]
    p = OutputProcessor("r", tok, ("never",))
    add_all(p, ids)
    p.delta(RequestUpdate("r", new_token_ids=ids, finish_reason="length"))
    assert p.text.replace("\ufffd", "") == tok.decode(ids).replace("\ufffd", "")


def test_special_tokens_keep_the_decoders_work_bounded() -> None:
    """A run of tokens without text (here 10,000 special tokens) costs a decode call per
    MAX_HELD_TOKENS of them, not a window that grows with the run."""
    tok = tokenizer()
    p = OutputProcessor("r", tok, ("ab",))
    ids = [8] * 10_000 + [0, 1]
    found = add_all(p, ids)
    assert found[-2:] == [None, "ab"] and p.text == "ab"
    restarts = tok.decodes // 2  # two decode calls each (the context, context + held)
    assert len(ids) // MAX_HELD_TOKENS - 1 <= restarts <= len(ids) // MAX_HELD_TOKENS + 1
    assert tok.steps <= len(ids) + CONTEXT_TOKENS * restarts  # a restart replays context


def test_a_character_cut_off_by_the_end_is_sent_as_it_decodes() -> None:
    tok = tokenizer()
    p = OutputProcessor("r", tok)
    add_all(p, [0, 2, 3])
    d = p.delta(RequestUpdate("r", new_token_ids=[0, 2, 3], finish_reason="length"))
    assert d.text == tok.decode([0, 2, 3]) == "a\ufffd"


def test_without_a_tokenizer_only_ids_travel() -> None:
    p = OutputProcessor("r", None, (), prompt_tokens=3)
    assert add_all(p, [7, 8]) == [None, None]
    d = p.delta(RequestUpdate("r", new_token_ids=[7, 8], new_logprobs=[0.0, 0.0]))
    assert d.text == "" and d.token_ids == [7, 8] and d.completion_tokens == 2
    assert d.prompt_tokens == 3


# -- a stream: hold-back and the exact cut ------------------------------------------------


def stream_texts(
    stop: tuple[str, ...], text: str, finish: RequestUpdate, include_stop: bool = False
) -> list[str]:
    """The texts of a stream of one token per letter of `text` (letters a-d), the last
    update being `finish`; the scheduler's part (`add`) done before each delta."""
    p = OutputProcessor("r", letters(4), stop, include_stop=include_stop)
    ids = [ord(c) - ord("a") + 1 for c in text]
    texts = []
    for i, t in enumerate(ids):
        p.add(t)
        u = finish if i == len(ids) - 1 else RequestUpdate("r")
        u.new_token_ids = [t]
        texts.append(p.delta(u).text)
    return texts


def test_a_stream_holds_back_a_possible_stop_string_and_releases_it() -> None:
    done = RequestUpdate("r", finish_reason="length")
    assert stream_texts(("abc",), "dabdc", done) == ["d", "", "", "abd", "c"]


def test_a_stream_cuts_exactly_before_the_stop_string() -> None:
    done = RequestUpdate("r", finish_reason="stop", matched_stop="abc")
    assert stream_texts(("abc", "bd"), "dcabc", done) == ["d", "c", "", "", ""]


def test_include_stop_str_in_output_keeps_the_stop_string() -> None:
    done = RequestUpdate("r", finish_reason="stop", matched_stop="abc")
    assert stream_texts(("abc", "bd"), "dcabc", done, include_stop=True) == [
        "d",
        "c",
        "",
        "",
        "abc",
    ]


@pytest.mark.parametrize("seed", range(20))
def test_a_stream_sends_what_the_oracle_allows(seed: int) -> None:
    rng = random.Random(seed)
    stops = ["".join(rng.choices("abc", k=rng.randint(1, 4))) for _ in range(3)]
    text = "".join(rng.choices("abcd", k=30))
    match = first_match(text, stops)
    n = len(text) if match is None else match.end
    done = RequestUpdate(
        "r",
        finish_reason="length" if match is None else "stop",
        matched_stop=None if match is None else match.stop,
    )
    got = stream_texts(tuple(stops), text[:n], done)
    for i in range(len(got) - 1):  # sent so far: all but the tail that may be a stop
        assert "".join(got[: i + 1]) == text[: i + 1 - held(text[: i + 1], stops)]
    assert "".join(got) == (text if match is None else text[: match.start])
