"""An engine gives back what it put on its device when it shuts down, though the Engine
object lives on: the KV pool, the weights, the overlap loop's future-token ring, the runner
and the backend are all unreachable afterwards (weak references die; what startup froze out
of the collector's passes is thawed), shutdown is
idempotent, and using the engine after it raises. On a GPU (`-m cuda`): the device's
allocated memory returns to where it started and engines with default flags run one after
another in one process (the second one's KV budget is read from free memory)."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch

from pipeserve import Engine

pytestmark = pytest.mark.timeout(300)

PROMPT = [5, 9, 13, 21, 34]
GREEDY = {"max_new_tokens": 3, "temperature": 0}


@pytest.mark.parametrize("loop", ["plain", "overlap"])
def test_shutdown_drops_everything_the_engine_held(model_dir, loop: str) -> None:
    overlap = {"enable_overlap_schedule": True} if loop == "overlap" else {}
    engine = Engine(str(model_dir("tiny-llama")), dtype="float32", **overlap)
    assert engine.backend.loop.name == loop
    assert gc.get_freeze_count() > 0  # the model and runner: out of the collector's passes
    first = engine.generate(input_ids=PROMPT, sampling_params=GREEDY)
    runner = engine.backend.runner
    held = {
        "kv pool": weakref.ref(runner.kv_pool),
        "a KV buffer": weakref.ref(runner.kv_pool.slot_buffers()[0][0]),
        "a weight": weakref.ref(next(runner.model.parameters())),
        "the runner": weakref.ref(runner),
        "the backend": weakref.ref(engine.backend),
    }
    if loop == "overlap":
        held["the future ring"] = weakref.ref(engine.backend.loop.future)
    del runner
    engine.shutdown()
    alive = [what for what, ref in held.items() if ref() is not None]
    assert not alive, f"still referenced after shutdown: {alive}"
    assert gc.get_freeze_count() == 0
    engine.shutdown()  # a second call does nothing
    with pytest.raises(RuntimeError, match="shut down"):
        engine.generate(input_ids=PROMPT, sampling_params=GREEDY)
    # the next engine in this process serves the same tokens
    with Engine(str(model_dir("tiny-llama")), dtype="float32", **overlap) as again:
        out = again.generate(input_ids=PROMPT, sampling_params=GREEDY)
        assert out["output_ids"] == first["output_ids"]


@pytest.mark.cuda
def test_engines_in_a_row_give_their_gpu_back(model_dir) -> None:
    """Default flags (the KV pool takes its share of the free memory): each engine's
    memory is back after shutdown, so the next one gets a budget again."""
    model = str(model_dir("tiny-llama"))
    torch.cuda.synchronize()
    start = torch.cuda.memory_allocated()
    for _ in range(3):
        engine = Engine(model, device="cuda")
        assert torch.cuda.memory_allocated() > start
        out = engine.generate(input_ids=PROMPT, sampling_params=GREEDY)
        assert len(out["output_ids"]) == GREEDY["max_new_tokens"]
        engine.shutdown()  # the Engine object is still referenced here
        # at most what was there: shutdown also clears the cuBLAS workspaces, the ones
        # earlier work in this process left included
        assert torch.cuda.memory_allocated() <= start
