"""The offline Engine on a tiny model (float32, so greedy tokens have no near-ties): the same
greedy tokens whatever the layout (chunk size, page size, radix cache, event loop, batch
composition, memory pressure); prefix-cache hits; clear errors for bad input; sampling
(seeds, top-k/top-p/min-p cuts, stop strings and ids, prompt-only logprobs)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from engine_helpers import VOCAB, generate, random_prompts, tokens

from pipeserve.engine.engine import Engine

BASE_FLAGS: dict[str, Any] = {"dtype": "float32", "max_total_tokens": 8192}
NEW_TOKENS = 16
GREEDY = {"temperature": 0.0, "max_new_tokens": NEW_TOKENS, "ignore_eos": True}
SAMPLE = {"temperature": 1.0, "max_new_tokens": NEW_TOKENS, "ignore_eos": True}
PROMPT_LENS = [1, 9, 63, 64, 65, 150, 300]

pytestmark = pytest.mark.timeout(120)  # a scheduling bug shows up as a hang: fail it fast


PROMPTS = random_prompts(PROMPT_LENS, seed=0)


@pytest.fixture(scope="module")
def engine(model_path: Path) -> Iterator[Engine]:
    """Shared engine for tests that do not depend on the cache state."""
    with Engine(str(model_path), chunked_prefill_size=64, **BASE_FLAGS) as e:
        yield e


@pytest.fixture(scope="module")
def alone(model_path: Path) -> Iterator[Callable[[list[int]], list[int]]]:
    """alone(prompt) -> its greedy tokens, run by itself, unchunked, without prefix cache."""
    cache: dict[tuple[int, ...], list[int]] = {}
    flags = {**BASE_FLAGS, "chunked_prefill_size": -1, "disable_radix_cache": True,
             "disable_overlap_schedule": True}
    with Engine(str(model_path), **flags) as e:

        def run(ids: list[int]) -> list[int]:
            if tuple(ids) not in cache:
                cache[tuple(ids)] = generate(e, [ids], GREEDY)[0]["output_ids"]
            return cache[tuple(ids)]

        yield run


# -- the same tokens whatever the layout ----------------------------------------------------

LAYOUTS: dict[str, dict[str, Any]] = {
    "chunk16": {"chunked_prefill_size": 16},
    "chunk64": {"chunked_prefill_size": 64},
    "no-chunking": {"chunked_prefill_size": -1},
    "page16": {"page_size": 16, "chunked_prefill_size": 64},
    "page64": {"page_size": 64, "chunked_prefill_size": 64},
    "no-radix-cache": {"disable_radix_cache": True, "chunked_prefill_size": 64},
    "plain-loop": {"disable_overlap_schedule": True, "chunked_prefill_size": 64},
    "overlap-loop": {"enable_overlap_schedule": True, "chunked_prefill_size": 64},
    "mixed-chunk": {"enable_mixed_chunk": True, "chunked_prefill_size": 32},
    "small-prefill-budget": {"max_prefill_tokens": 100, "chunked_prefill_size": 64},
    # C = 128 on a real profile: later chunks of the 300-token prompt shrink to 64
    "dynamic-chunking": {"enable_dynamic_chunking": True, "chunked_prefill_size": 128,
                         "dynamic_chunking_smooth_factor": 1.0},
}


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_greedy_tokens_do_not_depend_on_layout(make_engine, alone, layout: str) -> None:
    """All prompts in one call (then again, now hitting the prefix cache) give the tokens
    each prompt gives alone, unchunked, without the cache."""
    engine = make_engine(**LAYOUTS[layout])
    expected = [alone(p) for p in PROMPTS]
    first = generate(engine, PROMPTS, GREEDY)
    assert tokens(first) == expected
    second = generate(engine, PROMPTS, GREEDY)
    assert tokens(second) == expected
    if not LAYOUTS[layout].get("disable_radix_cache"):
        assert sum(o["meta_info"]["cached_tokens"] for o in second) > 0
    if LAYOUTS[layout].get("enable_dynamic_chunking"):  # it ran: a later chunk is below C
        size = LAYOUTS[layout]["chunked_prefill_size"]
        assert engine.backend.chunking["mode"] == "dynamic"
        assert any(x < size for x in first[-1]["meta_info"]["chunk_sizes"][1:-1])
    assert all(o["meta_info"]["finish_reason"] == "length" for o in first + second)
    assert_pool_empty(engine)


def test_chunk_sizes_are_reported(make_engine) -> None:
    engine = make_engine(chunked_prefill_size=64, disable_radix_cache=True)
    out = generate(engine, [PROMPTS[-1]], GREEDY)[0]
    assert out["meta_info"]["chunk_sizes"] == [64, 64, 64, 64, 44]


def test_batch_composition_does_not_change_tokens(engine, alone) -> None:
    target = random_prompts([120], seed=11)[0]
    others = random_prompts([5, 270, 33], seed=12)
    batch = [others[0], target, others[1], others[2]]
    sps = [GREEDY, GREEDY, {**GREEDY, "max_new_tokens": 3}, {**GREEDY, "max_new_tokens": 30}]
    out = generate(engine, batch, sps)
    assert out[1]["output_ids"] == alone(target)
    assert out[0]["output_ids"] == alone(others[0])
    assert len(out[2]["output_ids"]) == 3 and len(out[3]["output_ids"]) == 30


# -- prefix cache ---------------------------------------------------------------------------


def test_radix_cache_hit_and_miss(make_engine, alone) -> None:
    page = 16
    engine = make_engine(page_size=page, chunked_prefill_size=64)
    shared, tail_a, tail_b = random_prompts([200, 30, 20], seed=21)
    a, b = shared + tail_a, shared + tail_b

    first = generate(engine, [a], GREEDY)[0]
    assert first["meta_info"]["cached_tokens"] == 0  # miss: nothing cached yet
    again = generate(engine, [a], GREEDY)[0]
    assert again["meta_info"]["cached_tokens"] == (len(a) - 1) // page * page
    other = generate(engine, [b], GREEDY)[0]
    assert other["meta_info"]["cached_tokens"] == len(shared) // page * page
    assert first["output_ids"] == again["output_ids"] == alone(a)
    assert other["output_ids"] == alone(b)
    stats = engine.backend.stats()
    assert stats["prefix_hit_tokens"] > 0 and stats["kv_pages_cached"] > 0
    assert_pool_empty(engine)


def test_radix_cache_shared_prefix_within_one_batch(make_engine, alone) -> None:
    engine = make_engine(chunked_prefill_size=64)
    shared, tail_a, tail_b = random_prompts([150, 10, 25], seed=22)
    a, b = shared + tail_a, shared + tail_b
    out = generate(engine, [a, b], GREEDY)
    assert out[0]["meta_info"]["cached_tokens"] == 0
    assert out[1]["meta_info"]["cached_tokens"] >= len(shared)
    assert tokens(out) == [alone(a), alone(b)]
    assert_pool_empty(engine)


def test_prompt_logprobs_bypass_the_prefix_cache(engine) -> None:
    ids = random_prompts([80], seed=23)[0]
    generate(engine, [ids], GREEDY)  # now cached
    out = generate(engine, [ids], {**GREEDY, "max_new_tokens": 1}, return_logprob=True)[0]
    assert len(out["prompt_logprobs"]) == len(ids) - 1
    assert out["meta_info"]["cached_tokens"] == 0


# -- memory pressure ------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("radix", "seeded"), [(True, False), (False, False), (True, True)],
    ids=["radix-greedy", "no-radix-greedy", "radix-seeded"],
)
def test_memory_pressure_completes_every_request(make_engine, alone, radix: bool,
                                                 seeded: bool) -> None:
    """8 requests of 100 + 40 tokens in a 400-token pool: never all at once, none lost, the
    same tokens as with a big pool (seeded sampling too: a retracted request resumes its
    own random stream), and every page back afterwards."""
    prompts = random_prompts([100] * 8, seed=31)
    sp = {**(SAMPLE if seeded else GREEDY), "max_new_tokens": 40}
    sps = [{**sp, "seed": i} if seeded else sp for i in range(len(prompts))]
    engine = make_engine(max_total_tokens=400, chunked_prefill_size=64,
                         disable_radix_cache=not radix)
    sched = engine.backend.scheduler
    most_running = 0
    step = engine.backend.step

    def watched_step() -> list:
        nonlocal most_running
        most_running = max(most_running, sched.num_running)
        return step()

    engine.backend.step = watched_step
    out = generate(engine, prompts, sps, return_logprob=True)
    assert most_running < len(prompts) or engine.backend.stats()["num_retracted"] > 0
    assert all(len(t) == 40 for t in tokens(out))
    assert all(o["meta_info"]["finish_reason"] == "length" for o in out)
    big = generate(make_engine(chunked_prefill_size=64), prompts, sps, return_logprob=True)
    assert tokens(out) == tokens(big)
    for key in ("prompt_logprobs", "output_logprobs"):
        torch.testing.assert_close(torch.tensor([o[key] for o in out]),
                                   torch.tensor([o[key] for o in big]), atol=1e-4, rtol=0)
    if not seeded:
        assert [t[:NEW_TOKENS] for t in tokens(out)] == [alone(p) for p in prompts]
    assert_pool_empty(engine)


def assert_pool_empty(engine: Engine) -> None:
    sched = engine.backend.scheduler
    assert not sched.has_work() and sched.num_waiting == 0 and sched.num_running == 0
    kv = sched.kv
    if kv.tree is not None:
        assert kv.tree.protected_pages == 0  # no request holds a prefix any more
        kv.tree.evict(kv.tree.evictable_pages)
        assert kv.tree.cached_pages() == 0
    stats = engine.backend.stats()
    assert stats["kv_pages_free"] == stats["kv_pages_total"] == kv.allocator.capacity


# -- bad input ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"input_ids": []}, "the prompt is empty"),
        ({"prompt": ""}, "the prompt is empty"),
        ({"input_ids": [[1, 2], []]}, "the prompt is empty"),
        ({"input_ids": [5] * 4097}, "exceeds the context length 4096"),
        ({"input_ids": [5] * 4000, "sampling_params": {"max_new_tokens": 100}},
         r"prompt \(4000 tokens\) \+ max_new_tokens \(100\) exceeds the context length"),
        ({"input_ids": [1, 2], "sampling_params": {"max_new_tokens": -1}},
         "max_new_tokens must be a non-negative integer, got -1"),
        ({"input_ids": [1, VOCAB]}, rf"token id {VOCAB} is outside the vocabulary \[0, {VOCAB}\)"),
        ({"input_ids": [-1, 2]}, "token id -1 is outside the vocabulary"),
        ({"input_ids": [1, 2], "sampling_params": {"temprature": 0.5}},
         r"unknown sampling parameter\(s\): temprature"),
        ({"input_ids": [1, 2], "sampling_params": {"top_p": 0}}, r"top_p must be in \(0, 1\]"),
        ({"input_ids": [[1], [2]], "sampling_params": [{}]}, "1 sampling_params for 2 prompts"),
        ({"input_ids": [1], "prompt": "x"}, "exactly one of prompt or input_ids"),
    ],
    ids=["empty-ids", "empty-text", "empty-in-batch", "too-long", "too-long-with-output",
         "negative-max-new", "id-too-big", "id-negative", "unknown-key", "bad-top-p",
         "params-count", "prompt-and-ids"],
)
def test_bad_request_is_rejected(engine, kwargs: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        engine.generate(**kwargs)
    assert not engine.backend.scheduler.has_work()  # nothing was half submitted
    assert engine.generate(input_ids=[1, 2, 3], sampling_params=GREEDY)["output_ids"]


def test_request_larger_than_pool_is_rejected(make_engine) -> None:
    engine = make_engine(max_total_tokens=100)
    with pytest.raises(ValueError, match="needs 154 KV tokens but the pool holds 100; raise "
                       "--max-total-tokens"):
        engine.generate(input_ids=[5] * 150, sampling_params={"max_new_tokens": 4})
    assert not engine.backend.scheduler.has_work()


