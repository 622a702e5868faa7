"""--enable-deterministic-inference: the same prompt gives bitwise the same greedy tokens and
logprobs alone, among 32 other requests (other chunk boundaries, other batch sizes), after a
prefix-cache hit and on a two-stage pipeline; the same runs without the flag differ, which
shows these situations do exercise what the mode fixes."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from engine_helpers import random_prompts

from pipeserve.device import DTYPES, best_dtype, native_decode_kernel, native_prefill_kernel
from pipeserve.engine.engine import Engine
from pipeserve.layers import batch_invariant

# the bench model's matrix shapes (LM head, MLP, attention projections)
BENCH_SHAPES = [(8192, 768), (2048, 768), (768, 2048), (768, 768), (256, 768)]
# the runs' dtype: what the engine computes in here by default (bf16 with native bf16
# products, else float32), so the mode is tested where users run it
DTYPE = best_dtype(torch.device("cpu"))


def blas_is_row_invariant() -> bool:
    """Whether this machine's BLAS sums a row alike whatever the row count, on the bench
    model's shapes: the start-up check the mode runs (on some CPUs, e.g. with AMX, the
    library picks kernels by row count and the engine refuses the mode, tested below)."""
    try:
        batch_invariant.check_linear_rows(torch.randn(s).to(DTYPES[DTYPE]) for s in BENCH_SHAPES)
        return True
    except RuntimeError:
        return False


NATIVE = native_decode_kernel() is not None and native_prefill_kernel(DTYPES[DTYPE]) is not None
ROW_INVARIANT = NATIVE and blas_is_row_invariant()
pytestmark = [
    pytest.mark.timeout(600),
    pytest.mark.skipif(not NATIVE, reason="deterministic mode needs the native kernels"),
]
needs_row_invariant_blas = pytest.mark.skipif(
    not ROW_INVARIANT, reason="this machine's BLAS sums a row differently by row count"
)


@pytest.fixture(scope="module")
def model_path(model_dir: Any) -> Any:
    """The 8-layer bench model: wide enough that BLAS computes a one-row product of its MLP
    with a matrix-vector kernel that sums in another order, and deep enough that such
    differences reach the logprobs (on the 4-layer tiny model bf16 rounding hides them)."""
    return model_dir("bench")


BASE_FLAGS: dict[str, Any] = {"dtype": DTYPE, "max_total_tokens": 16384}
GREEDY = {"temperature": 0.0, "max_new_tokens": 24, "ignore_eos": True}


def runs(make_engine: Any, deterministic: bool) -> dict[str, tuple[list[int], list[float]]]:
    """The target prompt's (tokens, logprobs) in each situation."""
    target, *others = random_prompts([301] + [37 + 11 * i for i in range(32)], seed=5)
    flags = {"enable_deterministic_inference": deterministic}

    def result(
        engine: Engine, prompts: list[list[int]], index: int
    ) -> tuple[list[int], list[float]]:
        out = engine.generate(input_ids=prompts, sampling_params=GREEDY, return_logprob=True)
        return out[index]["output_ids"], out[index]["output_logprobs"]

    engine = make_engine(chunked_prefill_size=64, **flags)
    seen = {"alone": result(engine, [target], 0)}
    seen["cache hit"] = result(engine, [target], 0)  # all but its last token cached
    crowd = make_engine(chunked_prefill_size=96, disable_radix_cache=True, **flags)
    seen["among 32"] = result(crowd, others[:16] + [target] + others[16:], 16)
    pp2 = make_engine(pp_size=2, chunked_prefill_size=128, **flags)
    seen["pp2"] = result(pp2, [target], 0)
    return seen


@needs_row_invariant_blas
def test_deterministic_mode_is_batch_chunk_cache_and_layout_invariant(make_engine: Any) -> None:
    seen = runs(make_engine, deterministic=True)
    tokens, logprobs = seen["alone"]
    for situation, (t, lp) in seen.items():
        assert t == tokens, f"{situation}: other tokens"
        assert lp == logprobs, f"{situation}: other logprobs"


@needs_row_invariant_blas  # the guard of the test above: moot where that one cannot run
def test_without_the_flag_the_same_situations_differ(make_engine: Any) -> None:
    seen = runs(make_engine, deterministic=False)
    alone = seen.pop("alone")
    assert any(other != alone for other in seen.values()), "nothing to fix: a hollow test"


@pytest.mark.skipif(ROW_INVARIANT, reason="this machine's BLAS is row-invariant")
def test_deterministic_mode_refuses_a_blas_that_is_not_row_invariant(make_engine: Any) -> None:
    with pytest.raises(RuntimeError, match="not available with this BLAS library"):
        make_engine(enable_deterministic_inference=True, chunked_prefill_size=64)


def test_deterministic_mode_refuses_the_torch_kernels(make_engine: Any) -> None:
    with pytest.raises(ValueError, match="needs the native attention kernels"):
        make_engine(enable_deterministic_inference=True, attention_backend="torch")
