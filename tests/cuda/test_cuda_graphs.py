"""Decode steps replayed as CUDA graphs (`make test-gpu`; skipped without a GPU): for every
bucket a replay equals the eager forward of the same padded step over the same buffers
bitwise, and the unpadded eager forward within bfloat16's bound; a replayed step (its inputs
copied from the host into the graph's buffers, the graph, sampling) makes no host sync
(CUDA's own sync detector); the engine's greedy tokens and logprobs with graphs match those
without; the graphs' memory is given back at shutdown."""

from __future__ import annotations

import gc

import pytest
import torch

from pipeserve.engine.engine import Engine
from pipeserve.runner.cuda_graph import graph_buckets
from pipeserve.runner.forward_batch import ForwardBatch
from pipeserve.scheduler.batch import ReqSlice, ScheduledBatch
from pipeserve.scheduler.request import SamplingParams

pytestmark = [pytest.mark.cuda, pytest.mark.timeout(600)]

FLAGS = {"device": "cuda", "dtype": "bfloat16", "attention_backend": "triton"}
MAX_BS = 16


def decode_step(n: int, page: int, greedy: bool = True) -> ScheduledBatch:
    """n decode steps with contexts of different lengths on pages of their own (the pool's
    contents are whatever is there: every run reads the same)."""
    params = SamplingParams(temperature=0) if greedy else SamplingParams(temperature=0.7, seed=3)
    slices = []
    for i in range(n):
        length = 37 + 29 * i
        start = (1 + 64 * i) * page
        slices.append(ReqSlice(f"r{i}", [11 + i], length - 1, [(start, length)], True, params))
    return ScheduledBatch(1, slices)


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_a_replay_equals_the_eager_forward_of_its_padded_step(model_dir, dtype: str) -> None:
    """Per bucket, the replay equals the eager forward of the same padded step bitwise. In
    float32 the padded step's real rows also give the unpadded step's logprobs within 1e-3
    (padding rows read and write PAD_SLOT only; a leak into real rows moves them by far
    more). Not in bfloat16: there a different row count picks other GEMM tilings, whose
    roundings alone moved logprobs by 0.07 on an H200."""
    flags = {**FLAGS, "dtype": dtype}
    with Engine(str(model_dir("tiny-qwen3")), **flags, cuda_graph_max_bs=MAX_BS) as engine:
        runner = engine.backend.runner  # type: ignore[attr-defined]
        graphs = runner.graphs
        assert graphs is not None and sorted(graphs.graphs) == list(graph_buckets(MAX_BS))
        page = engine.config.cache.page_size
        for n in (1, 3, 8, 13, 16):
            batch = decode_step(n, page)
            staged = runner.prepare(batch)  # on the host until loaded into the buffers
            assert staged.graphed and staged.num_tokens in graphs.graphs
            with torch.inference_mode():
                fb = graphs.load(staged, runner.streams)
                torch.cuda.synchronize()
                eager = runner.model(fb)[0].clone()
                replays = graphs.replays
                replayed = graphs.run(fb).clone()
                assert graphs.replays == replays + 1
                assert torch.equal(replayed, eager), f"bucket {fb.num_tokens}"
                if dtype == "bfloat16":
                    continue
                plain = ForwardBatch.prepare(batch, runner.kv_pool, runner.device, runner.backend)
                unpadded = runner.model(plain)[0]
                got = torch.log_softmax(runner.model.compute_logits(replayed[:n]).float(), -1)
                want = torch.log_softmax(runner.model.compute_logits(unpadded).float(), -1)
            torch.testing.assert_close(got, want, atol=1e-3, rtol=0)


def test_a_replayed_step_makes_no_host_sync(model_dir) -> None:
    with Engine(str(model_dir("tiny-qwen3")), **FLAGS, cuda_graph_max_bs=MAX_BS) as engine:
        runner = engine.backend.runner  # type: ignore[attr-defined]
        page = engine.config.cache.page_size
        expected = runner.forward(decode_step(5, page)).result
        batch = decode_step(5, page)
        fb = runner.prepare(batch)
        torch.cuda.synchronize()
        replays = runner.graphs.replays
        torch.cuda.set_sync_debug_mode("error")
        try:
            out = runner.execute(batch, fb)
        finally:
            torch.cuda.set_sync_debug_mode("default")
        assert runner.graphs.replays == replays + 1
        assert out.result is not None
        assert out.result.next_token_ids == expected.next_token_ids


def test_the_engine_serves_the_same_with_and_without_graphs(model_dir) -> None:
    gen = torch.Generator().manual_seed(5)
    prompts = [torch.randint(0, 512, (n,), generator=gen).tolist() for n in (40, 7, 300, 90)]
    params = [{"max_new_tokens": n, "temperature": 0, "ignore_eos": True} for n in (24, 9, 16, 3)]
    outs = {}
    for max_bs in (0, MAX_BS):
        with Engine(str(model_dir("tiny-qwen3")), **FLAGS, cuda_graph_max_bs=max_bs) as engine:
            outs[max_bs] = engine.generate(
                input_ids=prompts, sampling_params=params, return_logprob=True
            )
            graphs = engine.backend.runner.graphs  # type: ignore[attr-defined]
            assert (graphs is not None and graphs.replays > 0) == (max_bs > 0)
    for got, want in zip(outs[MAX_BS], outs[0], strict=True):
        lp_got = torch.tensor(got["output_logprobs"])
        lp_want = torch.tensor(want["output_logprobs"])
        # bfloat16 on random weights: a padded step's products may round differently and a
        # near tie flip a greedy token; the logprobs agree up to the first difference
        pairs = zip(got["output_ids"], want["output_ids"], strict=True)
        same = next((i for i, (a, b) in enumerate(pairs) if a != b), len(lp_got))
        assert same >= 1  # the first token comes from the prompt's forward, never a graph
        torch.testing.assert_close(lp_got[: same + 1], lp_want[: same + 1], atol=5e-2, rtol=0)


def test_the_graphs_memory_is_given_back_at_shutdown(model_dir) -> None:
    gc.collect()
    torch.cuda.empty_cache()
    before = torch.cuda.memory_reserved()
    with Engine(str(model_dir("tiny-qwen3")), **FLAGS, cuda_graph_max_bs=64) as engine:
        assert engine.backend.runner.graphs is not None  # type: ignore[attr-defined]
        during = torch.cuda.memory_reserved()
    gc.collect()
    torch.cuda.empty_cache()
    after = torch.cuda.memory_reserved()
    assert during > before and after <= before + (8 << 20)
