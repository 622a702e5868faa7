"""The expert-parallel group's options: the communication/compute SM split on NCCL
(--moe-comm-max-sms), nothing on gloo, bad values refused."""

from __future__ import annotations

import pytest
import torch.distributed as dist

from pipeserve.config import EngineConfig
from pipeserve.device import comm_group_options


def test_gloo_has_nothing_to_split() -> None:
    assert comm_group_options("gloo", 8) is None
    assert comm_group_options("gloo", None) is None


def test_no_cap_keeps_the_backend_defaults() -> None:
    assert comm_group_options("nccl", None) is None


@pytest.mark.parametrize("bad", [0, -4])
def test_a_cap_below_one_sm_is_refused(bad: int) -> None:
    with pytest.raises(ValueError, match="--moe-comm-max-sms"):
        comm_group_options("nccl", bad)
    with pytest.raises(ValueError, match="--moe-comm-max-sms"):
        EngineConfig.from_flags(moe_comm_max_sms=bad)


@pytest.mark.skipif(not dist.is_nccl_available(), reason="needs a torch built with NCCL")
def test_nccl_kernels_are_capped() -> None:
    options = comm_group_options("nccl", 4)
    assert options.config.max_ctas == 4
    assert options.config.min_ctas <= 4
