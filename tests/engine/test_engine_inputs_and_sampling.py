"""The offline Engine on a tiny model (float32): a call that cannot fit is rejected whole;
clear errors when a checkpoint cannot be loaded; the context-length limit; sampling (seeds,
top-k/top-p/min-p cuts, stop strings and ids, logprobs); and the overlap loop giving the
plain loop's tokens (greedy and seeded, stop strings, chunked prefill, memory pressure,
aborts)."""

from __future__ import annotations

import json
import re
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from engine_helpers import Outputs, generate, random_prompts, tokens
from safetensors.torch import load_file, save_file

from pipeserve.engine.engine import Engine, resolve_model_path
from pipeserve.models import resolve as resolve_mod
from pipeserve.scheduler.request import Req, SamplingParams, Status
from pipeserve.scheduler.scheduler import RequestUpdate

# One torch thread: a tiny model gains nothing from more, and on a busy machine (2 cores,
# benchmarks alongside) OpenMP workers waiting for each other make a step 10-50x slower.
BASE_FLAGS: dict[str, Any] = {"dtype": "float32", "max_total_tokens": 8192, "threads_per_worker": 1}
NEW_TOKENS = 32
GREEDY = {"temperature": 0.0, "max_new_tokens": NEW_TOKENS, "ignore_eos": True}
SAMPLE = {"temperature": 1.0, "top_k": -1, "max_new_tokens": NEW_TOKENS, "ignore_eos": True}

pytestmark = pytest.mark.timeout(60)  # a scheduling bug shows up as a hang: fail it fast


def pick_stop(text: str) -> str | None:
    """A piece of plain letters from the later part of `text` (so generation is cut short)."""
    words = [m.group() for m in re.finditer(r"[A-Za-z]{2,}", text) if m.start() > len(text) // 3]
    return words[len(words) // 2][:3] if words else None


@pytest.fixture(scope="module")
def engine(model_path: Path) -> Iterator[Engine]:
    """Shared engine (overlap loop, chunked prefill, radix cache)."""
    with Engine(str(model_path), chunked_prefill_size=64, **BASE_FLAGS) as e:
        yield e


@pytest.fixture(scope="module")
def reference(model_path: Path) -> Iterator[Callable[[list[int], dict[str, Any]], list[int]]]:
    """reference(prompt, sampling) -> its tokens, run by itself on the plain loop, unchunked,
    without prefix cache."""
    cache: dict[str, list[int]] = {}
    flags = {**BASE_FLAGS, "chunked_prefill_size": -1, "disable_radix_cache": True,
             "disable_overlap_schedule": True}
    with Engine(str(model_path), **flags) as e:

        def run(ids: list[int], sp: dict[str, Any]) -> list[int]:
            key = repr((ids, sorted(sp.items())))
            if key not in cache:
                cache[key] = generate(e, [ids], sp)[0]["output_ids"]
            return cache[key]

        yield run


# -- a call that cannot fit is rejected whole ------------------------------------------------


def test_call_with_one_request_too_big_for_the_pool_submits_nothing(make_engine,
                                                                     reference) -> None:
    engine = make_engine(max_total_tokens=100)
    ok, too_big = random_prompts([6, 150], seed=1)
    looked_up = engine.backend.stats()["prefix_lookup_tokens"]
    with pytest.raises(ValueError, match="needs 154 KV tokens but the pool holds 100"):
        generate(engine, [ok, too_big], {**GREEDY, "max_new_tokens": 4})
    sched = engine.backend.scheduler
    assert not sched.has_work() and sched.num_waiting == 0 and sched.num_running == 0

    a, b = random_prompts([3, 9], seed=2)
    out = generate(engine, [a, b], GREEDY)
    assert [o["meta_info"]["prompt_tokens"] for o in out] == [3, 9]
    assert tokens(out) == [reference(a, GREEDY), reference(b, GREEDY)]
    assert len({o["meta_info"]["id"] for o in out}) == 2
    # only this call's prompts were ever admitted: the valid sibling of the bad one never ran
    assert engine.backend.stats()["prefix_lookup_tokens"] == looked_up + 3 + 9
    assert not sched.has_work()


# -- loading errors -----------------------------------------------------------------------


def _unsupported_architecture(src: Path, dst: Path) -> None:
    shutil.copytree(src, dst)
    config = json.loads((dst / "config.json").read_text())
    config["architectures"] = ["GPT2LMHeadModel"]
    (dst / "config.json").write_text(json.dumps(config))


def _missing_tensor(src: Path, dst: Path) -> None:
    shutil.copytree(src, dst)
    (file,) = dst.glob("*.safetensors")
    weights = load_file(file)
    del weights["model.norm.weight"]
    save_file(weights, file, metadata={"format": "pt"})


def _no_safetensors(src: Path, dst: Path) -> None:
    shutil.copytree(src, dst, ignore=shutil.ignore_patterns("*.safetensors*"))


def _no_config(src: Path, dst: Path) -> None:
    shutil.copytree(src, dst, ignore=shutil.ignore_patterns("config.json"))


def _no_directory(src: Path, dst: Path) -> None:
    pass


def test_model_may_name_a_built_in_preset(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """--model NAME, with no directory of that name here, is the preset NAME (made on first
    use); an existing directory of that name is still read as a checkpoint."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(resolve_mod, "preset_path", lambda name: tmp_path / "cache" / name)
    assert resolve_model_path("tiny-qwen3") == tmp_path / "cache" / "tiny-qwen3"
    (tmp_path / "tiny-qwen3").mkdir()
    with pytest.raises(FileNotFoundError, match=r"tiny-qwen3: not a Hugging Face checkpoint"):
        resolve_model_path("tiny-qwen3")
    with pytest.raises(FileNotFoundError, match=r"nor a built-in model \(tiny-llama, "):
        resolve_model_path("no-such-model")


@pytest.mark.parametrize(
    ("breaker", "error", "message"),
    [
        (_unsupported_architecture, ValueError,
         r"unsupported architecture \['GPT2LMHeadModel'\]; pipeserve supports LlamaForCausalLM"),
        (_missing_tensor, ValueError, r"is missing tensor\(s\): model\.norm\.weight$"),
        (_no_safetensors, FileNotFoundError, r"no \*\.safetensors files in "),
        (_no_config, FileNotFoundError, r"not a Hugging Face checkpoint directory \(no config"),
        (_no_directory, FileNotFoundError, r"not a Hugging Face checkpoint directory \(no config"),
    ],
    ids=["unsupported-arch", "missing-tensor", "no-safetensors", "no-config", "no-directory"],
)
def test_bad_checkpoint_is_rejected_with_a_clear_message(
    model_path: Path, tmp_path: Path, breaker: Callable[[Path, Path], None],
    error: type[Exception], message: str,
) -> None:
    broken = tmp_path / "broken"
    breaker(model_path, broken)
    with pytest.raises(error, match=message):
        Engine(str(broken), **BASE_FLAGS)


def test_unknown_engine_flag_is_a_type_error(model_path: Path) -> None:
    with pytest.raises(TypeError, match=r"unknown engine flag\(s\): chunk_prefill_size"):
        Engine(str(model_path), chunk_prefill_size=32, **BASE_FLAGS)


# -- context length -----------------------------------------------------------------------


def test_context_length_limit(make_engine) -> None:
    engine = make_engine(context_length=64, chunked_prefill_size=16)
    assert engine.context_len == 64
    at_limit = engine.generate(input_ids=[5] * 60, sampling_params={**GREEDY, "max_new_tokens": 4})
    assert len(at_limit["output_ids"]) == 4
    assert at_limit["meta_info"]["finish_reason"] == "length"
    whole = engine.generate(input_ids=[7] * 64, sampling_params={"max_new_tokens": 0},
                            return_logprob=True)
    assert whole["output_ids"] == [] and len(whole["prompt_logprobs"]) == 63

    with pytest.raises(ValueError, match=r"prompt \(61 tokens\) \+ max_new_tokens \(4\) exceeds "
                       r"the context length 64$"):
        engine.generate(input_ids=[5] * 61, sampling_params={**GREEDY, "max_new_tokens": 4})
    with pytest.raises(ValueError, match=r"prompt \(65 tokens\) \+ max_new_tokens \(0\) exceeds "
                       r"the context length 64$"):
        engine.generate(input_ids=[5] * 65, sampling_params={"max_new_tokens": 0})
    assert not engine.backend.scheduler.has_work()


# -- sampling -----------------------------------------------------------------------------

PROMPT = random_prompts([40], seed=3)[0]
BATCH = random_prompts([7, 40, 90], seed=4)


def test_same_seed_same_tokens_different_seed_different_tokens(engine) -> None:
    first = generate(engine, [PROMPT], {**SAMPLE, "seed": 1})[0]["output_ids"]
    again = generate(engine, [PROMPT], {**SAMPLE, "seed": 1})[0]["output_ids"]
    other = generate(engine, [PROMPT], {**SAMPLE, "seed": 2})[0]["output_ids"]
    assert first == again
    assert len(first) == len(other) == NEW_TOKENS
    assert first != other  # 32 draws at temperature 1 over 512 tokens: a collision is hopeless


@pytest.mark.parametrize(
    "cut",
    [{"top_k": 1}, {"top_p": 1e-6}, {"min_p": 1.0}, {"top_k": 1, "top_p": 1e-6, "min_p": 1.0}],
    ids=["top_k=1", "top_p=1e-6", "min_p=1", "all-three"],
)
def test_cuts_that_leave_one_token_equal_greedy(engine, reference, cut: dict[str, Any]) -> None:
    out = generate(engine, BATCH, {**SAMPLE, "temperature": 1.5, **cut})
    assert tokens(out) == [reference(p, GREEDY) for p in BATCH]


def test_seeded_request_is_independent_of_its_batch(engine) -> None:
    target = {**SAMPLE, "seed": 7}
    alone = generate(engine, [PROMPT], target)[0]["output_ids"]
    batch = [BATCH[0], PROMPT, BATCH[1], BATCH[2], PROMPT]
    sps = [SAMPLE, target, {**SAMPLE, "seed": 8}, GREEDY, {**SAMPLE, "seed": 9}]
    out = generate(engine, batch, sps)
    assert out[1]["output_ids"] == alone
    assert out[4]["output_ids"] != alone  # same prompt, another seed


def test_stop_string_cuts_the_text(engine, reference) -> None:
    full_ids = reference(PROMPT, GREEDY)
    full_text = engine.tokenizer.decode(full_ids)
    stop = pick_stop(full_text)
    assert stop is not None, full_text
    out = generate(engine, [PROMPT], {**GREEDY, "stop": [stop, "never-in-this-text-\u2603"]})[0]
    ids = out["output_ids"]
    assert out["meta_info"]["finish_reason"] == "stop"
    assert out["meta_info"]["matched_stop"] == stop
    assert out["text"] == full_text[: full_text.index(stop)]
    assert stop not in out["text"]
    assert 0 < len(ids) < len(full_ids) and ids == full_ids[: len(ids)]
    # generation stopped at the token that completed the stop string, not later
    assert stop in engine.tokenizer.decode(ids) and stop not in engine.tokenizer.decode(ids[:-1])


def test_stop_token_id_ends_generation(engine, reference) -> None:
    full_ids = reference(PROMPT, GREEDY)
    token = full_ids[NEW_TOKENS // 2]
    first = full_ids.index(token)
    out = generate(engine, [PROMPT], {**GREEDY, "stop_token_ids": [token]})[0]
    assert out["output_ids"] == full_ids[: first + 1]
    assert out["output_ids"][-1] == token
    assert out["meta_info"]["finish_reason"] == "stop"
    assert out["meta_info"]["matched_stop"] == token


def test_zero_new_tokens_gives_prompt_logprobs_only(engine) -> None:
    out = generate(engine, BATCH, {"max_new_tokens": 0}, return_logprob=True)
    for o, p in zip(out, BATCH, strict=True):
        assert o["output_ids"] == [] and o["output_logprobs"] == []
        assert len(o["prompt_logprobs"]) == len(p) - 1
        assert all(lp <= 0 for lp in o["prompt_logprobs"])
        assert o["meta_info"]["finish_reason"] == "length"


def test_output_logprobs_equal_prompt_logprobs_of_the_same_tokens(engine) -> None:
    out = generate(engine, BATCH, GREEDY, return_logprob=True)
    fed_back = [p + o["output_ids"] for p, o in zip(BATCH, out, strict=True)]
    again = generate(engine, fed_back, {"max_new_tokens": 0}, return_logprob=True)
    for o, a in zip(out, again, strict=True):
        assert len(o["output_logprobs"]) == NEW_TOKENS
        tail = a["prompt_logprobs"][-NEW_TOKENS:]
        torch.testing.assert_close(torch.tensor(o["output_logprobs"]), torch.tensor(tail),
                                   atol=1e-4, rtol=0)


# -- overlap loop vs plain loop -----------------------------------------------------------

MANY_LENS = [1, 2, 5, 9, 14, 20, 27, 31, 32, 33, 40, 48,
             57, 63, 64, 65, 77, 90, 101, 128, 150, 199, 230, 290]  # chunked at 32
MANY_PROMPTS = random_prompts(MANY_LENS, seed=5)
MANY_NEW = [1 + (i * 11) % 37 for i in range(len(MANY_PROMPTS))]
PRESSURE_PROMPTS = random_prompts([10 + (i * 37) % 110 for i in range(24)], seed=6)
PRESSURE_NEW = [20 + (i * 13) % 60 for i in range(24)]
LOOPS = {"overlap": {"enable_overlap_schedule": True}, "plain": {"disable_overlap_schedule": True}}


def sampling_list(kind: str, new: list[int]) -> list[dict[str, Any]]:
    base = GREEDY if kind == "greedy" else SAMPLE
    return [{**base, "max_new_tokens": n, **({"seed": 100 + i} if kind == "seeded" else {})}
            for i, n in enumerate(new)]


def summary(outputs: Outputs) -> list[tuple[Any, ...]]:
    return [(o["output_ids"], o["text"], o["meta_info"]["finish_reason"],
             o["meta_info"]["matched_stop"]) for o in outputs]


@pytest.fixture(scope="module")
def loops(model_path: Path) -> Iterator[dict[str, Engine]]:
    """The two event loops, otherwise alike (chunks of 32, radix cache)."""
    made = {name: Engine(str(model_path), chunked_prefill_size=32, **BASE_FLAGS, **flags)
            for name, flags in LOOPS.items()}
    yield made
    for e in made.values():
        e.shutdown()


@pytest.mark.parametrize("kind", ["greedy", "seeded"])
def test_overlap_loop_gives_plain_loop_tokens(loops, kind: str) -> None:
    sps = sampling_list(kind, MANY_NEW)
    plain = generate(loops["plain"], MANY_PROMPTS, sps)
    overlap = generate(loops["overlap"], MANY_PROMPTS, sps)
    assert summary(overlap) == summary(plain)
    assert [len(t) for t in tokens(plain)] == MANY_NEW
    assert loops["overlap"].backend.stats()["loop"] == "overlap"
    assert loops["plain"].backend.stats()["loop"] == "plain"


@pytest.mark.parametrize("kind", ["greedy", "seeded"])
def test_overlap_loop_gives_plain_loop_tokens_with_stop_strings(loops, kind: str) -> None:
    """Stop strings taken from a first run, so most requests stop early, at different steps
    (the overlap loop has already scheduled one more step for them)."""
    sps = sampling_list(kind, [40] * len(MANY_PROMPTS))
    first = generate(loops["plain"], MANY_PROMPTS, sps)
    stops = [pick_stop(o["text"]) for o in first]
    with_stops = [{**sp, "stop": [s]} if s else sp for sp, s in zip(sps, stops, strict=True)]
    plain = generate(loops["plain"], MANY_PROMPTS, with_stops)
    overlap = generate(loops["overlap"], MANY_PROMPTS, with_stops)
    assert summary(overlap) == summary(plain)
    stopped = [o for o in plain if o["meta_info"]["finish_reason"] == "stop"]
    assert len(stopped) >= len(MANY_PROMPTS) // 2
    for o, f, s in zip(plain, first, stops, strict=True):
        if s is not None:
            assert o["meta_info"]["matched_stop"] == s
            assert o["text"] == f["text"][: f["text"].index(s)]


@pytest.mark.parametrize("kind", ["greedy", "seeded"])
def test_overlap_loop_gives_plain_loop_tokens_under_memory_pressure(make_engine, kind: str) -> None:
    sps = sampling_list(kind, PRESSURE_NEW)
    runs = {}
    for name, flags in LOOPS.items():
        engine = make_engine(max_total_tokens=300, chunked_prefill_size=32, **flags)
        runs[name] = generate(engine, PRESSURE_PROMPTS, sps)
        stats = engine.backend.stats()
        assert stats["num_retracted"] > 0, name
        assert stats["kv_pages_free"] + stats["kv_pages_cached"] == stats["kv_pages_total"]
    assert summary(runs["overlap"]) == summary(runs["plain"])
    assert [len(t) for t in tokens(runs["plain"])] == PRESSURE_NEW


def drive(engine: Engine, updates: dict[str, list[RequestUpdate]],
          until: Callable[[], bool], max_steps: int = 2000) -> None:
    """Step the backend directly, collecting updates per request, until `until()`."""
    for _ in range(max_steps):
        if until():
            return
        for u in engine.backend.step():
            updates.setdefault(u.rid, []).append(u)
    raise AssertionError(f"condition not reached in {max_steps} steps")


def finished(updates: dict[str, list[RequestUpdate]], rid: str) -> bool:
    return any(u.finish_reason is not None for u in updates.get(rid, []))


@pytest.mark.parametrize("loop", list(LOOPS))
def test_abort_mid_prefill_and_mid_decode(make_engine, reference, loop: str) -> None:
    """Abort one request between two prefill chunks and one while decoding: the others get
    the tokens they get without them, and every page is back (free or cached)."""
    engine = make_engine(chunked_prefill_size=32, **LOOPS[loop])
    backend = engine.backend
    long_prompt, decode_prompt, *prompts = random_prompts([300, 20, 10, 45, 130, 7], seed=7)
    sps = [{**GREEDY, "max_new_tokens": 30}, {**SAMPLE, "max_new_tokens": 12, "seed": 3},
           {**GREEDY, "max_new_tokens": 20}, {**SAMPLE, "max_new_tokens": 25, "seed": 4}]
    survivors = [Req(f"keep{i}", p, SamplingParams.from_dict(sp))
                 for i, (p, sp) in enumerate(zip(prompts, sps, strict=True))]
    decode_sp = {**GREEDY, "max_new_tokens": 60}
    decoding = Req("decoding", decode_prompt, SamplingParams.from_dict(decode_sp))
    chunked = Req("chunked", long_prompt, SamplingParams.from_dict(GREEDY))
    updates: dict[str, list[RequestUpdate]] = {}

    for req in (decoding, survivors[0], survivors[1]):
        backend.submit(req)
    drive(engine, updates, lambda: len(decoding.output_ids) >= 3)
    for req in (chunked, survivors[2], survivors[3]):
        backend.submit(req)
    drive(engine, updates, lambda: chunked.num_chunks >= 3)
    assert chunked.status is Status.PREFILL  # 300 tokens: chunk 3 of 10
    assert decoding.status is Status.RUNNING and not decoding.finished
    backend.abort("chunked")
    backend.abort("decoding")
    backend.abort("no-such-request")  # ignored
    drive(engine, updates, lambda: all(finished(updates, r.rid) for r in survivors))

    for rid in ("chunked", "decoding"):
        assert updates[rid][-1].finish_reason == "abort"
        assert sum(u.finish_reason is not None for u in updates[rid]) == 1
    assert sum((u.new_token_ids for u in updates.get("chunked", [])), []) == []
    got = sum((u.new_token_ids for u in updates["decoding"]), [])
    assert 3 <= len(got) < 60 and got == reference(decode_prompt, decode_sp)[: len(got)]
    for req in survivors:
        assert sum((u.new_token_ids for u in updates[req.rid]), []) == req.output_ids
        assert updates[req.rid][-1].finish_reason == "length"

    sched = backend.scheduler
    assert not sched.has_work() and sched.num_waiting == 0 and sched.num_running == 0
    stats = backend.stats()
    assert stats["kv_pages_free"] + stats["kv_pages_cached"] == stats["kv_pages_total"]
    assert sched.kv.tree is not None and sched.kv.tree.protected_pages == 0

    # the same requests without the aborted ones, on this engine (now with their prefixes
    # and the aborted ones' in the cache) and on the reference engine
    again = generate(engine, prompts, sps)
    assert tokens(again) == [r.output_ids for r in survivors]
    assert tokens(again) == [reference(p, sp) for p, sp in zip(prompts, sps, strict=True)]
    # the aborted prompt's cached prefix holds valid KV
    redo = generate(engine, [long_prompt], GREEDY)[0]
    assert redo["meta_info"]["cached_tokens"] > 0
    assert redo["output_ids"] == reference(long_prompt, GREEDY)
