"""Scheduler driven by a fake executor: admission, chunking, prefix reuse, memory pressure,
aborts and stop conditions. No model: the executor keeps a dict "KV pool" of which sequence
prefix each slot holds, checks every slice reads exactly its own prefix, and answers with
`next_token(sequence)` (by default the last token + 1)."""

from __future__ import annotations

import random
from collections import defaultdict
from collections.abc import Callable

import pytest
from byte_tokenizer import letters

from pipeserve.config import SchedulerConfig
from pipeserve.scheduler.batch import BatchResult, ReqSlice, ScheduledBatch
from pipeserve.scheduler.kv_manager import KVManager
from pipeserve.scheduler.output import Detokenizer
from pipeserve.scheduler.request import Req, SamplingParams, Status
from pipeserve.scheduler.scheduler import RequestUpdate, Scheduler

EOS = 99
NextToken = Callable[[list[int]], int]


def count_up(seq: list[int]) -> int:
    return seq[-1] + 1


def slots(runs: list[tuple[int, int]]) -> list[int]:
    return [s for start, n in runs for s in range(start, start + n)]


class FakeExecutor:
    def __init__(self, next_token: NextToken) -> None:
        self.next_token = next_token
        self.pool: dict[int, tuple[int, ...]] = {}  # slot -> the prefix whose KV it holds

    def run(self, batch: ScheduledBatch, reqs: dict[str, Req]) -> BatchResult:
        tokens = [self._forward(s, reqs[s.rid].seq) for s in batch.slices]
        sampled = [t for s, t in zip(batch.slices, tokens, strict=True) if s.sample]
        return BatchResult(
            batch.batch_id,
            sampled,
            [-0.5] * len(sampled),
            [[-1.0] * len(s.logprob_targets) for s in batch.slices],
        )

    def _forward(self, s: ReqSlice, seq: list[int]) -> int:
        end = s.prefix_len + s.num_tokens
        assert s.input_ids == seq[s.prefix_len : end], f"{s.rid}: wrong input tokens"
        kv = slots(s.kv_runs)
        assert len(kv) == end, f"{s.rid}: kv_runs cover {len(kv)} positions, need {end}"
        for pos in range(s.prefix_len):
            assert self.pool.get(kv[pos]) == tuple(seq[: pos + 1]), f"{s.rid}: stale KV at {pos}"
        for pos in range(s.prefix_len, end):
            self.pool[kv[pos]] = tuple(seq[: pos + 1])
        return self.next_token(seq[:end])


class Harness:
    """A Scheduler on a small fake KV pool, stepped like the plain loop."""

    def __init__(
        self,
        num_pages: int = 64,
        page_size: int = 1,
        context_len: int = 64,
        disable_radix_cache: bool = False,
        tokenizer: Detokenizer | None = None,
        next_token: NextToken = count_up,
        **flags: int | bool,
    ) -> None:
        self.kv = KVManager(num_pages, page_size, disable_radix_cache)
        self.config = SchedulerConfig(**flags)  # type: ignore[arg-type]
        self.sched = Scheduler(self.config, self.kv, context_len, (EOS,), tokenizer)
        self.executor = FakeExecutor(next_token)
        self.reqs: dict[str, Req] = {}
        self.updates: dict[str, list[RequestUpdate]] = defaultdict(list)
        self.batches: list[ScheduledBatch] = []

    def add(self, rid: str, prompt: list[int] | range, return_logprob: bool = False,
            **sampling: object) -> Req:
        params = SamplingParams(**sampling)  # type: ignore[arg-type]
        req = Req(rid, list(prompt), params, return_logprob=return_logprob)
        self.sched.add_request(req)
        self.reqs[rid] = req
        return req

    def step(self) -> ScheduledBatch | None:
        batch = self.sched.schedule()
        if batch is None:
            return None
        self.batches.append(batch)
        self.record(self.sched.process_result(batch, self.executor.run(batch, self.reqs)))
        self.check_invariants()
        return batch

    def run(self, max_steps: int = 1000) -> None:
        for _ in range(max_steps):
            if not self.sched.has_work():
                return
            self.step_with_work()
        raise AssertionError(f"not done after {max_steps} steps")

    def step_with_work(self) -> None:
        # A decode step that only retracts its sole request schedules nothing; the next
        # call must make progress.
        if self.step() is None:
            assert self.step() is not None, "scheduler has work but schedules nothing"

    def abort(self, rid: str) -> None:
        update = self.sched.abort(rid)
        assert update is not None
        self.record([update])
        self.check_invariants()

    def record(self, updates: list[RequestUpdate]) -> None:
        for u in updates:
            self.updates[u.rid].append(u)

    def outputs(self, rid: str) -> list[int]:
        return [t for u in self.updates[rid] for t in u.new_token_ids]

    def final(self, rid: str) -> RequestUpdate:
        finished = [u for u in self.updates[rid] if u.finish_reason is not None]
        assert len(finished) == 1, f"{rid} finished {len(finished)} times"
        return finished[0]

    def first(self, rid: str) -> RequestUpdate:
        """The first update that is not a prompt's progress (the first token's)."""
        return next(u for u in self.updates[rid] if u.prefilled is None)

    def slices_of(self, rid: str) -> list[ReqSlice]:
        return [s for b in self.batches for s in b.slices if s.rid == rid]

    def check_invariants(self) -> None:
        """Every page is free, in the prefix cache, or owned by exactly one live request."""
        cached = self.kv.tree.cached_pages() if self.kv.tree else 0
        own = sum(len(r.pages) - r.cached_pages for r in self.sched.reqs.values())
        assert self.kv.allocator.num_free + cached + own == self.kv.allocator.capacity
        holding = sum(bool(r.pages) for r in self.sched.reqs.values())
        assert holding <= self.sched.num_running <= self.config.max_running_requests

    def assert_all_pages_back(self) -> None:
        """Nothing is held once every request is gone; the cache can give everything back."""
        assert not self.sched.has_work()
        if self.kv.tree is not None:
            assert self.kv.tree.protected_pages == 0
            self.kv.tree.evict(self.kv.allocator.capacity)
        assert self.kv.allocator.num_free == self.kv.allocator.capacity


def expected_count_up(prompt: list[int] | range, n: int) -> list[int]:
    return [prompt[-1] + i for i in range(1, n + 1)]


# -- admission and chunking -------------------------------------------------------------


def test_admission_stays_within_the_token_budget() -> None:
    h = Harness(max_prefill_tokens=10)
    for i, rid in enumerate("abc"):
        h.add(rid, [10 * i + t for t in (1, 2, 3, 4)], max_new_tokens=3)
    first = h.step()
    assert first is not None
    assert [(s.rid, s.num_tokens, s.sample) for s in first.slices] == [
        ("a", 4, True), ("b", 4, True), ("c", 2, False)
    ]
    h.run()
    assert all(b.num_tokens <= 10 for b in h.batches)
    assert [h.outputs(rid) for rid in "abc"] == [[5, 6, 7], [15, 16, 17], [25, 26, 27]]
    h.assert_all_pages_back()


def test_disabled_chunking_never_splits_a_prompt() -> None:
    h = Harness(max_prefill_tokens=10, chunked_prefill_size=-1)
    for i, rid in enumerate("abc"):
        h.add(rid, [10 * i + t for t in (1, 2, 3, 4)], max_new_tokens=1)
    h.run()
    assert [h.reqs[rid].chunk_sizes for rid in "abc"] == [[4], [4], [4]]


def test_long_prompt_is_prefilled_in_chunks() -> None:
    h = Harness(chunked_prefill_size=4)
    req = h.add("a", range(1, 11), max_new_tokens=2)
    kv_lens, statuses = [], []
    for _ in range(3):
        h.step()
        kv_lens.append(req.kv_len)
        statuses.append(req.status)
    chunks = h.slices_of("a")
    assert [s.num_tokens for s in chunks] == [4, 4, 2]
    assert [s.prefix_len for s in chunks] == [0, 4, 8]
    assert [s.chunk_index for s in chunks] == [0, 1, 2]
    assert [s.sample for s in chunks] == [False, False, True]
    assert [s.sampling is not None for s in chunks] == [False, False, True]
    assert kv_lens == [4, 8, 10]
    assert statuses == [Status.PREFILL, Status.PREFILL, Status.RUNNING]
    h.run()
    assert h.outputs("a") == [11, 12]
    assert h.final("a").chunk_sizes == [4, 4, 2]
    # the chunks that sample nothing report the prompt's progress, once each, in order
    progress = [u.prefilled for u in h.updates["a"] if u.prefilled is not None]
    assert progress == [4, 8]
    assert all(not u.new_token_ids and u.finish_reason is None
               for u in h.updates["a"] if u.prefilled is not None)


def test_nobody_is_admitted_behind_a_chunked_prompt() -> None:
    h = Harness(chunked_prefill_size=4)
    h.add("long", range(1, 11), max_new_tokens=1)
    h.add("short", [21, 22, 23], max_new_tokens=1)
    h.run()
    # the short prompt fills the rest of the long one's last chunk: no batch exceeds a chunk
    assert [[(s.rid, s.num_tokens) for s in b.slices] for b in h.batches] == [
        [("long", 4)], [("long", 4)], [("long", 2), ("short", 2)], [("short", 1)]
    ]


def test_mixed_chunk_runs_decode_beside_a_prefill_chunk() -> None:
    h = Harness(chunked_prefill_size=4, enable_mixed_chunk=True)
    h.add("a", [1, 2], max_new_tokens=5)
    h.step()
    h.add("b", range(1, 11), max_new_tokens=1)
    batch = h.step()
    assert batch is not None
    assert [(s.rid, s.is_decode) for s in batch.slices] == [("b", False), ("a", True)]
    h.run()
    assert h.outputs("a") == [3, 4, 5, 6, 7]


def test_max_running_requests_is_respected() -> None:
    h = Harness(max_running_requests=2)
    for i in range(5):
        h.add(f"r{i}", [i + 1, i + 2], max_new_tokens=4)
    h.run()  # check_invariants asserts num_running <= 2 after every step
    assert len(h.batches[0].slices) == 2
    assert max(len(b.slices) for b in h.batches) == 2
    for i in range(5):
        assert h.outputs(f"r{i}") == expected_count_up([i + 2], 4)
    h.assert_all_pages_back()


# -- prefix cache -----------------------------------------------------------------------


@pytest.mark.parametrize("page_size", [1, 4])
def test_shared_prefix_is_served_from_the_cache(page_size: int) -> None:
    h = Harness(page_size=page_size)
    h.add("a", range(1, 13), max_new_tokens=2)
    h.run()
    a_slots = slots(h.slices_of("a")[0].kv_runs)
    h.add("b", [*range(1, 9), 50, 51, 52], max_new_tokens=2)
    h.run()
    b_prefill = h.slices_of("b")[0]
    assert b_prefill.prefix_len == 8
    assert b_prefill.input_ids == [50, 51, 52]
    assert slots(b_prefill.kv_runs)[:8] == a_slots[:8]
    assert h.first("b").cached_tokens == 8
    assert h.outputs("b") == [53, 54]
    h.assert_all_pages_back()


def test_identical_prompt_recomputes_only_its_last_token() -> None:
    h = Harness()
    h.add("a", [1, 2, 3, 4, 5], max_new_tokens=1)
    h.run()
    h.add("b", [1, 2, 3, 4, 5], max_new_tokens=1)
    h.run()
    assert h.slices_of("b")[0].input_ids == [5]
    assert h.first("b").cached_tokens == 4


def test_disabled_radix_cache_recomputes_and_keeps_nothing() -> None:
    h = Harness(disable_radix_cache=True)
    h.add("a", range(1, 13), max_new_tokens=2)
    h.run()
    assert h.kv.allocator.num_free == h.kv.allocator.capacity
    h.add("b", [*range(1, 9), 50], max_new_tokens=2)
    h.run()
    assert h.slices_of("b")[0].prefix_len == 0
    assert h.first("b").cached_tokens == 0
    assert h.outputs("b") == [51, 52]
    h.assert_all_pages_back()


def test_prefix_lookup_stats_count_each_admission_once() -> None:
    h = Harness(num_pages=9)  # 8 tokens: room for one request at a time
    h.add("a", [1, 2, 3, 4, 5, 6], max_new_tokens=2)
    h.add("b", [7, 8, 9, 10, 11, 12], max_new_tokens=2)
    h.run()
    assert h.kv.lookup_tokens == 12


# -- memory pressure --------------------------------------------------------------------


@pytest.mark.parametrize("page_size", [1, 2])
def test_more_requests_than_pages_all_complete(page_size: int) -> None:
    h = Harness(num_pages=32 // page_size + 1, page_size=page_size)
    prompts = {f"r{i}": [1, 2, 3, 4, *range(10 * i + 5, 10 * i + 9)] for i in range(6)}
    for rid, prompt in prompts.items():
        h.add(rid, prompt, max_new_tokens=12)
    h.run()
    assert h.sched.decode.num_retracted > 0
    for rid, prompt in prompts.items():
        assert h.outputs(rid) == expected_count_up(prompt, 12), rid
        assert h.final(rid).finish_reason == "length"
    h.assert_all_pages_back()


def test_retracted_request_resumes_with_its_outputs() -> None:
    h = Harness(num_pages=17)  # 16 tokens; two requests of 8 + 6 cannot both finish
    h.add("a", range(1, 9), max_new_tokens=6)
    h.add("b", range(21, 29), max_new_tokens=6)
    h.run()
    assert h.sched.decode.num_retracted > 0
    resumed = [s for rid in "ab" for s in h.slices_of(rid) if not s.is_decode]
    assert any(len(s.input_ids) + s.prefix_len > 8 for s in resumed)  # prompt + outputs
    assert h.outputs("a") == list(range(9, 15))
    assert h.outputs("b") == list(range(29, 35))
    h.assert_all_pages_back()


# -- aborts -----------------------------------------------------------------------------


def test_abort_while_waiting() -> None:
    h = Harness(max_running_requests=1)
    h.add("a", [1, 2], max_new_tokens=3)
    h.add("b", [5, 6], max_new_tokens=3)
    h.step()
    h.abort("b")
    assert h.final("b").finish_reason == "abort"
    assert h.sched.num_waiting == 0
    h.run()
    assert h.slices_of("b") == []
    assert h.outputs("a") == [3, 4, 5]
    h.assert_all_pages_back()


def test_abort_mid_chunked_prefill() -> None:
    h = Harness(chunked_prefill_size=4)
    h.add("a", range(1, 13), max_new_tokens=3)
    h.add("b", [5, 6], max_new_tokens=2)
    h.step()
    assert h.reqs["a"].status is Status.PREFILL
    h.abort("a")
    assert h.sched.prefill.chunked is None
    nxt = h.step()
    assert nxt is not None
    assert [s.rid for s in nxt.slices] == ["b"] and nxt.released == ["a"]
    h.run()
    assert h.outputs("b") == [7, 8]
    h.assert_all_pages_back()


def test_abort_while_running() -> None:
    h = Harness()
    h.add("a", [1, 2, 3, 4], max_new_tokens=10)
    h.step()
    h.step()
    assert h.outputs("a") == [5, 6]
    h.abort("a")
    assert h.final("a").finish_reason == "abort"
    assert h.sched.decode.running == [] and not h.sched.has_work()
    h.assert_all_pages_back()


def test_result_of_an_aborted_request_is_ignored() -> None:
    h = Harness()
    h.add("a", [1, 2], max_new_tokens=4)
    h.add("b", [5, 6], max_new_tokens=4)
    batch = h.sched.schedule()
    assert batch is not None
    result = h.executor.run(batch, h.reqs)
    h.abort("a")
    updates = h.sched.process_result(batch, result)
    assert [u.rid for u in updates] == ["b"]
    h.record(updates)
    h.run()
    assert h.outputs("b") == [7, 8, 9, 10]
    h.assert_all_pages_back()


def test_a_reused_id_does_not_take_the_aborted_request_s_result() -> None:
    """"a" is aborted while its batch is in flight and a new "a" arrives before the result:
    the old batch's token is not folded into the new request, which gets only its own."""
    h = Harness()
    old = h.add("a", [1, 2], max_new_tokens=4)
    batch = h.sched.schedule()
    assert batch is not None
    result = h.executor.run(batch, {"a": old})
    h.abort("a")
    new = h.add("a", [20, 21, 22], max_new_tokens=2)
    assert h.sched.process_result(batch, result) == []
    assert new.output_ids == [] and new.inflight == 0
    h.updates.clear()
    h.run()
    assert h.outputs("a") == [23, 24] and new.output_ids == [23, 24]
    h.assert_all_pages_back()


def test_a_renumbered_batch_keeps_its_requests() -> None:
    """A batch given a shared micro-batch id (data-parallel attention) still knows which
    request objects it was made for: the reused id gets nothing from it."""
    h = Harness()
    old = h.add("a", [1, 2], max_new_tokens=4)
    batch = h.sched.schedule()
    assert batch is not None
    h.sched.renumber(batch, 42)
    result = h.executor.run(batch, {"a": old})
    h.abort("a")
    h.add("a", [20, 21, 22], max_new_tokens=2)
    assert batch.batch_id == 42 and h.sched.process_result(batch, result) == []


def test_abort_unknown_request() -> None:
    assert Harness().sched.abort("nobody") is None


# -- stop conditions --------------------------------------------------------------------


def run_one(prompt: list[int], tokenizer: Detokenizer | None = None,
            **sampling: object) -> Harness:
    h = Harness(tokenizer=tokenizer)
    h.add("a", prompt, **sampling)
    h.run()
    h.assert_all_pages_back()
    return h


def test_stops_at_max_new_tokens() -> None:
    h = run_one([1, 2, 3], max_new_tokens=3)
    assert h.outputs("a") == [4, 5, 6]
    assert h.final("a").finish_reason == "length"


def test_stops_at_eos() -> None:
    h = run_one([95, 96], max_new_tokens=10)
    assert h.outputs("a") == [97, 98, EOS]
    assert (h.final("a").finish_reason, h.final("a").matched_stop) == ("stop", EOS)


def test_ignore_eos_runs_past_it() -> None:
    h = run_one([95, 96], max_new_tokens=5, ignore_eos=True)
    assert h.outputs("a") == [97, 98, 99, 100, 101]
    assert h.final("a").finish_reason == "length"


def test_stop_token_ids_apply_even_with_ignore_eos() -> None:
    h = run_one([1, 2], max_new_tokens=10, ignore_eos=True, stop_token_ids=[5])
    assert h.outputs("a") == [3, 4, 5]
    assert (h.final("a").finish_reason, h.final("a").matched_stop) == ("stop", 5)


def test_stop_string_across_tokens() -> None:
    h = run_one([1, 2, 3], letters(), max_new_tokens=10, stop=["ef", "zz"])
    assert h.outputs("a") == [4, 5, 6]  # "d", "e", "f"
    assert (h.final("a").finish_reason, h.final("a").matched_stop) == ("stop", "ef")


def test_stop_string_in_the_prompt_does_not_stop() -> None:
    h = run_one([1, 2, 3], letters(), max_new_tokens=3, stop="bc")
    assert h.outputs("a") == [4, 5, 6]
    assert h.final("a").finish_reason == "length"


def test_max_new_tokens_zero_runs_the_prompt_only() -> None:
    h = run_one([1, 2, 3], max_new_tokens=0)
    assert len(h.batches) == 1
    assert h.outputs("a") == []
    assert h.reqs["a"].output_ids == []
    assert h.final("a").finish_reason == "length"


# -- validation -------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("prompt_len", "max_new_tokens", "message"),
    [
        (0, 4, "the prompt is empty"),
        (10, 7, r"prompt \(10 tokens\) \+ max_new_tokens \(7\) exceeds the context length 16"),
        (6, 4, "needs 10 KV tokens but the pool holds 8; raise --max-total-tokens"),
    ],
)
def test_invalid_requests_are_rejected(prompt_len: int, max_new_tokens: int, message: str) -> None:
    h = Harness(num_pages=9, context_len=16)
    with pytest.raises(ValueError, match=message):
        h.add("a", [1] * prompt_len, max_new_tokens=max_new_tokens)
    assert not h.sched.has_work() and h.sched.num_waiting == 0


def test_request_ids_must_be_unique() -> None:
    h = Harness()
    h.add("a", [1], max_new_tokens=1)
    with pytest.raises(ValueError, match="'a' is already in use"):
        h.add("a", [2], max_new_tokens=1)


# -- randomized -------------------------------------------------------------------------


def random_harness(rng: random.Random) -> Harness:
    page_size = rng.choice([1, 2, 4])
    return Harness(
        num_pages=rng.choice([16, 32, 64]) // page_size + 1,
        page_size=page_size,
        context_len=40,
        disable_radix_cache=rng.random() < 0.2,
        chunked_prefill_size=rng.choice([-1, 3, 4, 16]),
        max_prefill_tokens=rng.choice([4, 16, 100]),
        max_running_requests=rng.choice([1, 2, 8]),
        enable_mixed_chunk=rng.random() < 0.5,
    )


def random_prompt(rng: random.Random) -> list[int]:
    shared = [1, 2, 3, 4, 5, 6][: rng.randint(0, 6)]  # so that prefixes get reused
    return (shared + [rng.randint(10, 60) for _ in range(12)])[: rng.randint(1, 12)]


@pytest.mark.parametrize("seed", range(30))
def test_random_workload_with_aborts(seed: int) -> None:
    """Arrivals, aborts and steps interleaved on a small pool: every request that is not
    aborted gets exactly its expected tokens (and prompt logprobs), pages are never lost."""
    rng = random.Random(seed)
    h = random_harness(rng)
    expected: dict[str, tuple[list[int], int, bool]] = {}
    for i in range(150):
        if rng.random() < 0.3 and len(h.reqs) < 15:
            prompt, n, lp = random_prompt(rng), rng.randint(0, 8), rng.random() < 0.3
            if len(prompt) + n <= h.kv.capacity_tokens:
                h.add(f"r{i}", prompt, return_logprob=lp, max_new_tokens=n, ignore_eos=True)
                expected[f"r{i}"] = (prompt, n, lp)
        if rng.random() < 0.05 and h.sched.reqs:
            rid = rng.choice(sorted(h.sched.reqs))
            h.abort(rid)
            del expected[rid]
        if h.sched.has_work():
            h.step_with_work()
    h.run()
    for rid, (prompt, n, lp) in expected.items():
        assert h.outputs(rid) == expected_count_up(prompt, n), rid
        assert h.final(rid).finish_reason == "length"
        assert h.first(rid).prompt_logprobs == ([-1.0] * (len(prompt) - 1) if lp else None)
    h.assert_all_pages_back()
