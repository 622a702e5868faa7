"""The model runner and the event loops on a (fake) device: the same protocol as on CUDA,
checked on a CPU through tests/fake_cuda.py. A step's inputs reach the compute stream in one
copy on the copy stream and an event; the forward launches without any host read of device
values; the host waits for a batch's results only when it processes them, which the overlap
loop does after it has launched the next batch."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from engine_helpers import generate, random_prompts, tokens
from fake_cuda import FakeApi
from host_sync import no_host_sync

from pipeserve.engine.engine import Engine
from pipeserve.scheduler.batch import ReqSlice, ScheduledBatch
from pipeserve.scheduler.request import SamplingParams
from pipeserve.streams import DeviceStreams

BASE_FLAGS: dict[str, Any] = {
    "device": "cpu",
    "max_running_requests": 4,
    "chunked_prefill_size": 64,
}
GREEDY = {"temperature": 0, "max_new_tokens": 6, "ignore_eos": True}


def fake_device(engine: Engine) -> FakeApi:
    """Put the engine's model runner on a fake device; returns the fake's log keeper."""
    api = FakeApi()
    engine.backend.runner.streams = DeviceStreams(torch.device("cpu"), api)  # type: ignore[attr-defined]
    return api


def host_wait_leads(api: FakeApi) -> list[int]:
    """At each host wait for a batch's results (an untimed event recorded on a compute
    stream): how many batches' inputs had been uploaded, less the batches already waited
    for. 1: the host waits for the batch it just launched; 2: the next one is in flight."""
    uploads = waited = 0
    leads = []
    for entry in api.log:
        if entry[0] == "record" and entry[2] == "copy":
            uploads += 1
        elif entry[0] == "host_wait":
            event = api.events[entry[1]]
            if not event.timing and event.stream != "copy":
                leads.append(uploads - waited)
                waited += 1
    return leads


def copies_per_upload(api: FakeApi) -> list[int]:
    """Host-to-device copies queued before each upload's `ready` (recorded on the copy
    stream)."""
    counts, n = [], 0
    for entry in api.log:
        if entry[0] == "upload":
            n += 1
        elif entry[0] == "record" and entry[2] == "copy":
            counts.append(n)
            n = 0
    return counts


@pytest.mark.parametrize("overlap", [False, True])
def test_loop_on_a_device_waits_only_for_results_it_processes(make_engine, overlap) -> None:
    prompts = random_prompts([40, 70, 25], seed=3)
    flags = {"enable_overlap_schedule": True} if overlap else {"disable_overlap_schedule": True}
    expected = tokens(generate(make_engine(**flags), prompts, GREEDY))
    engine = make_engine(**flags)
    api = fake_device(engine)
    assert tokens(generate(engine, prompts, GREEDY)) == expected
    # every upload is waited on by a compute stream, after it was recorded
    ready = {e[1] for e in api.log if e[0] == "record" and e[2] == "copy"}
    waited = [e for e in api.log if e[0] == "stream_wait"]
    assert ready and ready == {e[2] for e in waited}
    assert all(e[1] != "copy" for e in waited)
    assert set(copies_per_upload(api)) == {1}  # a step's inputs: one host-to-device copy
    leads = host_wait_leads(api)
    assert len(leads) >= len(GREEDY) and min(leads) >= 1
    if overlap:  # decode steps: the next batch was launched before this one's results read
        assert sum(lead >= 2 for lead in leads) >= len(leads) // 2, leads
    else:
        assert max(leads) == 1, leads


def test_forward_launches_without_reading_device_values(make_engine) -> None:
    """execute() on a device queues the forward, the sampling (greedy, seeded and unseeded
    random) and the copies back without a single host read of a tensor (each would be a device
    sync on a GPU); the result is materialised when read, and equals the CPU runner's."""
    engine = make_engine(disable_overlap_schedule=True)
    runner = engine.backend.runner  # type: ignore[attr-defined]
    ids = random_prompts([48], seed=5)[0]
    greedy = SamplingParams(temperature=0)
    seeded = SamplingParams(temperature=0.8, top_k=20, top_p=0.9, seed=11)

    def batch(run: str) -> ScheduledBatch:
        prompt = ReqSlice("p", ids, 0, [(1, 48)], True, greedy, True, 3, ids[1:], chunk_index=0)
        step = ReqSlice("d", [ids[0]], 47, [(100, 48)], True, greedy, True, 2)
        drawn = ReqSlice(f"s{run}", [ids[1]], 47, [(200, 48)], True, seeded)  # own generator
        shared = ReqSlice("u", [ids[2]], 47, [(300, 48)], True, SamplingParams(min_p=0.1))
        return ScheduledBatch(1, [prompt, step, drawn, shared])

    cpu_result = runner.forward(batch("cpu")).result
    api = FakeApi()
    runner.streams = DeviceStreams(torch.device("cpu"), api)
    b = batch("device")
    fb = runner.prepare(b)
    with no_host_sync():
        out = runner.execute(b, fb)
    assert not any(e[0] == "host_wait" for e in api.log), "execute() waited for the device"
    result = out.result
    assert result is not None and api.log[-1][0] == "host_wait"
    assert result.next_token_ids[:3] == cpu_result.next_token_ids[:3]  # not the shared draw
    assert result.top_logprobs == cpu_result.top_logprobs
    torch.testing.assert_close(result.output_logprobs[:2], cpu_result.output_logprobs[:2])
    torch.testing.assert_close(result.prompt_logprobs, cpu_result.prompt_logprobs)
    assert b.stage_times and result.stage_times is b.stage_times
