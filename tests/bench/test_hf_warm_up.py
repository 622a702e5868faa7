"""The transformers baseline's warm-up length: on a GPU the prompts' own (SDPA's cuDNN
kernels plan each new shape on its first call, which must not land in the timed prefill),
64 tokens past 128K (the plan is a small share there) and on a CPU."""

from __future__ import annotations

import torch

from pipeserve.bench.hf_baseline import FULL_WARM_UP_MAX, warm_up_len


def test_the_warm_up_runs_the_timed_shape_on_a_gpu() -> None:
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    assert warm_up_len(32768, cuda) == 32768
    assert warm_up_len(FULL_WARM_UP_MAX, cuda) == FULL_WARM_UP_MAX
    assert warm_up_len(FULL_WARM_UP_MAX + 1, cuda) == 64
    assert warm_up_len(32768, cpu) == 64
    assert warm_up_len(16, cpu) == 16
