"""The native backend's whole-stack decode kernel (kernels/decode_stack.cpp): a batch of decode
steps through a stage's dense Llama-family layers in one native call. It chains the kernels the
layer-by-layer path calls, in its order, so its results are bitwise that path's: the same
tokens and the same logprobs to the last bit, for float32 and bfloat16 runs, float weights and
weights kept in GGUF blocks, a qkv bias (Qwen2), q/k norms (Qwen3), GQA, several requests of
different lengths;
it is taken by batches of decode steps alone and only those; Qwen3's q/k norms included;
stages it does not fit (MLA, deterministic runs) keep the layers."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from pipeserve.backends import native_backend
from pipeserve.backends.native_backend import NativeBackend, NativeStack
from pipeserve.device import native_decode_stack
from pipeserve.engine.engine import Engine
from pipeserve.models.llama import LlamaAttention, LlamaDecoderLayer
from pipeserve.models.qwen3 import Qwen3Attention

pytestmark = [
    pytest.mark.timeout(300),
    pytest.mark.skipif(native_decode_stack() is None, reason="the native kernels do not build"),
]

FLAGS = {"chunked_prefill_size": 32, "max_total_tokens": 4096, "page_size": 16}
# prompts of several lengths (one longer than a chunk): the first steps mix prompt chunks and
# decode steps, the later ones are decode steps alone
PROMPTS = [list(range(3, 40)), list(range(100, 105)), [7] * 70]
SAMPLING = {"max_new_tokens": 12, "temperature": 0.0, "ignore_eos": True}


class Counts:
    """How many forwards took the stack, and how many decode-step layers ran one by one."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, stack: bool) -> None:
        self.stack_steps = self.layer_calls = 0
        if not stack:
            monkeypatch.setattr(NativeBackend, "decode_stack", lambda self, layers: None)
        run, forward = NativeStack.run, LlamaDecoderLayer.forward

        def counted_run(stack_self: NativeStack, *args: Any) -> Any:
            out = run(stack_self, *args)
            self.stack_steps += out is not None
            return out

        def counted_forward(layer: LlamaDecoderLayer, *args: Any) -> Any:
            self.layer_calls += 1
            return forward(layer, *args)

        monkeypatch.setattr(NativeStack, "run", counted_run)
        monkeypatch.setattr(LlamaDecoderLayer, "forward", counted_forward)


def generate(path: Path | str, monkeypatch: pytest.MonkeyPatch, stack: bool, **flags: Any):
    with monkeypatch.context() as patch:
        counts = Counts(patch, stack)
        with Engine(str(path), **FLAGS, **flags) as engine:
            out = engine.generate(input_ids=PROMPTS, sampling_params=SAMPLING, return_logprob=True)
    return [(o["output_ids"], o["output_logprobs"], o["prompt_logprobs"]) for o in out], counts


# SmolLM2's widths: the norms' sums of squares past the first level of torch's cascade
WIDE = {
    "hidden_size": 576,
    "intermediate_size": 1536,
    "num_attention_heads": 9,
    "num_key_value_heads": 3,
    "head_dim": 64,
}


@pytest.mark.parametrize(
    ("preset", "dtype", "overrides"),
    [
        ("tiny-llama", "float32", {}),  # bfloat16 weights under float32 x, llama3 rope scaling
        ("tiny-llama", "bfloat16", WIDE),  # bfloat16 norms compiled, bitwise the torch ops
        ("tiny-qwen2", "float32", {}),  # a qkv bias, one KV head
        ("tiny-qwen3", "float32", {}),  # q/k norms, tied embeddings
        ("tiny-qwen3", "bfloat16", {}),
    ],
)
def test_the_stack_is_bitwise_the_layers(
    model_dir, monkeypatch, preset: str, dtype: str, overrides: dict
) -> None:
    path = model_dir(preset, **overrides)
    want, layers = generate(path, monkeypatch, False, dtype=dtype)
    got, stacked = generate(path, monkeypatch, True, dtype=dtype)
    assert got == want  # tokens and every logprob, exactly
    assert layers.stack_steps == 0
    # every batch of decode steps alone took the stack: 12 tokens of 3 requests need at least
    # 10 such steps after the prompts, and the layers then ran only for the other batches
    assert stacked.stack_steps >= 10
    assert stacked.layer_calls < layers.layer_calls
    num_layers = 4
    assert layers.layer_calls - stacked.layer_calls == num_layers * stacked.stack_steps


@pytest.mark.parametrize(
    ("preset", "overrides"), [("tiny-llama", WIDE), ("tiny-qwen3", {"head_dim": 128})]
)
def test_compiled_norms_leave_every_result_as_the_torch_ops(
    model_dir, monkeypatch, preset: str, overrides: dict
) -> None:
    """bfloat16 with the compiled norms (the stack, the layers, Qwen3's q/k norms before the
    compiled rotary) against a run whose norms are all the torch ops (no compiled norms, so
    no stack): the same tokens and logprobs to the last bit."""
    path = model_dir(preset, **overrides)
    got, stacked = generate(path, monkeypatch, True, dtype="bfloat16")
    assert stacked.stack_steps >= 10
    with monkeypatch.context() as patch:
        patch.setattr(native_backend, "native_norm_kernels", lambda: None)
        want, torch_norms = generate(path, monkeypatch, True, dtype="bfloat16")
    assert torch_norms.stack_steps == 0
    assert got == want


def test_the_built_in_model_s_blocks_take_the_stack(monkeypatch) -> None:
    """The built-in model: float32 x over weights kept in GGUF Q4_1/Q8_0 blocks, 30 layers."""
    want, _ = generate("smollm2", monkeypatch, False, threads_per_worker=2)
    got, stacked = generate("smollm2", monkeypatch, True, threads_per_worker=2)
    assert got == want
    assert stacked.stack_steps >= 10


def test_stages_it_does_not_fit_keep_the_layers(model_dir, monkeypatch) -> None:
    """DeepSeek's MLA layers, a deterministic run's backend (its products batch-invariant on
    torch's GEMM) and an attention whose forward is not LlamaAttention's: no stack; batches of
    more rows than a product's skinny kernel takes: the layers."""
    path = model_dir("tiny-deepseek-v3")
    with monkeypatch.context() as patch:
        built: list[object] = []
        decode_stack = NativeBackend.decode_stack

        def asked(backend: NativeBackend, layers: list) -> object:
            built.append(layers)
            return decode_stack(backend, layers)

        patch.setattr(NativeBackend, "decode_stack", asked)
        with Engine(str(path), dtype="float32", **FLAGS) as engine:
            out = engine.generate(input_ids=PROMPTS, sampling_params=SAMPLING)
    assert built == [] and all(len(o["output_ids"]) == 12 for o in out)
    assert NativeBackend(deterministic=True).decode_stack([]) is None
    with monkeypatch.context() as patch:
        # an attention that computes otherwise than LlamaAttention.forward (here: a wrapper)
        patch.setattr(Qwen3Attention, "forward", lambda a, *args: LlamaAttention.forward(a, *args))
        _, counts = generate(model_dir("tiny-qwen3"), patch, True, dtype="float32")
    assert counts.stack_steps == 0 and counts.layer_calls > 0
    with monkeypatch.context() as patch:
        # float32 x over bfloat16 weights: 2 rows at most on the skinny kernel, and the three
        # requests decode together
        patch.setattr(native_backend, "SKINNY_MAX_ROWS_NARROW", 2)
        _, counts = generate(model_dir("tiny-llama"), patch, True, dtype="float32")
    assert counts.stack_steps == 0 and counts.layer_calls > 0
