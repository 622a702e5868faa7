"""Expert parallelism in the MoE blocks of Qwen3-MoE and DeepSeek-V3 (shared experts, a
non-zero correction bias), on real gloo groups of 2 and 4 processes.

Each rank builds one MoE layer of a preset checkpoint with only its block of experts and runs
its own tokens through it, twice: once with rank 1 holding no tokens, once with every rank
busy; some tokens have all their experts on one rank. The test process builds the same layer
in one process and checks, per rank: the outputs on that rank's tokens (fp32, within 1e-5),
the expert weights held (exactly its block), and the expert tensors read from the checkpoint
(only its block's, each once)."""

from __future__ import annotations

import re
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch
from moe_helpers import multi_process, run_ranks
from torch import nn

from pipeserve.distributed import parallel_state
from pipeserve.distributed.parallel_state import ParallelState, set_parallel_state, standalone
from pipeserve.layers.moe import (
    DeepseekV3MoE,
    FusedMoE,
    expert_checkpoint_names,
    held_experts,
    select_experts,
)
from pipeserve.model_loader import LazyTensor, load_weights
from pipeserve.models.arch import ArchConfig
from pipeserve.models.registry import build_model
from pipeserve.moe.dispatcher import LocalDispatcher

MODELS = {  # name -> (preset, a MoE layer, overrides)
    "qwen3-moe": ("tiny-qwen3-moe", 0, {}),
    # 16 experts in 4 groups of 4: at ep4 a rank holds a group, so a token's 3 experts (from
    # 2 groups) may all sit on one rank
    "deepseek-v3": ("tiny-deepseek-v3", 1, {"n_routed_experts": 16}),
}
POOL = 4000  # candidate tokens the per-rank token sets are drawn from
EXPERT_TENSOR = re.compile(r".*\.experts\.(\d+)\.(gate|up|down)_proj\.weight")


# --- loading one MoE layer ----------------------------------------------------------------


@contextmanager
def recording_reads(names: list[str]) -> Iterator[None]:
    """Append the name of every checkpoint tensor (or slice) read to `names`."""
    original = LazyTensor.load

    def load(self: LazyTensor) -> torch.Tensor:
        names.append(self.name)
        return original(self)

    LazyTensor.load = load  # type: ignore[method-assign]
    try:
        yield
    finally:
        LazyTensor.load = original  # type: ignore[method-assign]


def load_moe_layer(name: str, path: Path, state: ParallelState) -> tuple[nn.Module, list[str]]:
    """The model's MoE block of its layer (a one-layer stage of the real model class, loaded by
    `load_weights` through its `checkpoint_names`) and the tensors read."""
    layer = MODELS[name][1]
    set_parallel_state(replace(state, layers=range(layer, layer + 1)))
    model = build_model(ArchConfig.load(path), torch.float32, torch.device("cpu"))
    read: list[str] = []
    with recording_reads(read):
        load_weights(model, path)
    return model.model.layers[layer].mlp, read


def expert_reads(read: list[str]) -> list[tuple[int, str]]:
    return sorted((int(m[1]), m[2]) for m in map(EXPERT_TENSOR.fullmatch, read) if m)


def route(block: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """[tokens, k] global expert ids the block's router picks."""
    if isinstance(block, DeepseekV3MoE):
        return block.gate(x)[1]
    return select_experts(block.gate(x), block.top_k, block.renormalize)[1]


# --- what each rank runs ------------------------------------------------------------------


def foreign_expert_error(experts: FusedMoE) -> str:
    other = next(e for e in range(experts.num_experts) if e not in experts.experts)
    try:
        experts.weight_loader(experts.w13, None, (other, 0))  # type: ignore[arg-type]
    except ValueError as exc:
        return str(exc)
    return ""


def rank_results(rank: int, world: int, out_dir: str) -> dict[str, Any]:
    """Per model: this rank's outputs per step, its expert ids and weights, what it read."""
    inputs = torch.load(Path(out_dir) / "inputs.pt")
    results = {}
    for name, (path, steps) in inputs.items():
        block, read = load_moe_layer(name, Path(path), ParallelState(ep_rank=rank, ep_size=world))
        with torch.no_grad():
            outs = [block(xs[rank]) for xs in steps]
        experts = block.experts
        results[name] = {
            "out": outs, "experts": experts.experts, "w13": experts.w13.data,
            "w2": experts.w2.data, "read": read, "foreign": foreign_expert_error(experts),
        }
    return results


# --- the test process: reference blocks, token sets, the spawned groups ---------------------


@pytest.fixture(scope="module")
def checkpoints(model_dir) -> dict[str, Path]:
    return {name: model_dir(preset, **over) for name, (preset, _, over) in MODELS.items()}


@pytest.fixture(scope="module")
def reference(checkpoints) -> dict[str, tuple[nn.Module, list[str]]]:
    """name -> (the one-process block, the tensors it read)."""
    with standalone():
        return {name: load_moe_layer(name, path, ParallelState())
                for name, path in checkpoints.items()}


def plans(world: int) -> list[list[tuple[int, int, int]]]:
    """Per step, per rank: (tokens whose experts span several ranks, a rank r, tokens whose
    experts all sit on rank r)."""
    rank1_idle = [(4, world - 1, 2), (0, 0, 0), (0, 1, 3), (5, 0, 0)][:world]
    all_busy = [(3 + r, (r + 1) % world, 2) for r in range(world)]
    return [rank1_idle, all_busy]


def token_sets(block: nn.Module, world: int, seed: int) -> list[list[torch.Tensor]]:
    """[step][rank] -> hidden [n, H]: distinct tokens drawn from a random pool by where their
    experts sit (contiguous blocks of experts per rank)."""
    num_experts = block.experts.num_experts
    pool = torch.randn(POOL, block.gate.weight.shape[1],
                       generator=torch.Generator().manual_seed(seed))
    with torch.no_grad():
        ids = route(block, pool).tolist()
    owners = [{e * world // num_experts for e in row} for row in ids]
    spread = [t for t, o in enumerate(owners) if len(o) > 1]
    alone = {r: [t for t, o in enumerate(owners) if o == {r}] for r in range(world)}
    steps = []
    for plan in plans(world):
        picks = []
        for n, r, m in plan:
            picks.append(spread[:n] + alone[r][:m])
            assert len(picks[-1]) == n + m, f"the pool holds too few tokens on rank {r}"
            del spread[:n], alone[r][:m]
        steps.append([pool[p] for p in picks])
    return steps


@pytest.fixture(scope="module", params=[2, 4], ids=["ep2", "ep4"])
def group(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory,
          checkpoints, reference) -> tuple[int, dict[str, Any], list[dict[str, Any]]]:
    """(world, name -> per-step per-rank inputs, per-rank results); one spawn per world."""
    world = request.param
    out_dir = tmp_path_factory.mktemp(f"ep{world}")
    inputs = {name: token_sets(reference[name][0], world, seed=world)
              for name in MODELS}
    torch.save({name: (str(checkpoints[name]), inputs[name]) for name in MODELS},
               out_dir / "inputs.pt")
    return world, inputs, run_ranks(rank_results, world, out_dir)


def block_of(world: int, rank: int, num_experts: int) -> range:
    per = num_experts // world
    return range(rank * per, (rank + 1) * per)


# --- the tests --------------------------------------------------------------------------


@multi_process
@pytest.mark.parametrize("name", list(MODELS))
def test_each_rank_gets_one_process_output_on_its_tokens(group, reference, name: str) -> None:
    world, inputs, results = group
    block = reference[name][0]
    for step, xs in enumerate(inputs[name]):
        for r in range(world):
            with torch.no_grad():
                expected = block(xs[r])
            got = results[r][name]["out"][step]
            assert got.shape == xs[r].shape and got.dtype == torch.float32
            torch.testing.assert_close(got, expected, atol=1e-5, rtol=0)
    assert inputs[name][0][1].shape[0] == 0  # rank 1 ran no tokens in step 0


@multi_process
@pytest.mark.parametrize("name", list(MODELS))
def test_each_rank_holds_exactly_its_block_of_experts(group, reference, name: str) -> None:
    world, _, results = group
    full = reference[name][0].experts
    for r in range(world):
        mine = block_of(world, r, full.num_experts)
        got = results[r][name]
        assert got["experts"] == tuple(mine)
        assert got["w13"].shape == (len(mine), *full.w13.shape[1:])
        assert torch.equal(got["w13"], full.w13[mine.start : mine.stop])
        assert torch.equal(got["w2"], full.w2[mine.start : mine.stop])


@multi_process
@pytest.mark.parametrize("name", list(MODELS))
def test_each_rank_reads_only_its_experts_tensors(group, reference, name: str) -> None:
    world, _, results = group
    num_experts = reference[name][0].experts.num_experts
    assert len(expert_reads(reference[name][1])) == 3 * num_experts
    for r in range(world):
        expected = sorted((e, p) for e in block_of(world, r, num_experts)
                          for p in ("gate", "up", "down"))
        assert expert_reads(results[r][name]["read"]) == expected


@multi_process
def test_loading_another_ranks_expert_is_refused(group) -> None:
    world, _, results = group
    for r in range(world):
        assert "is not on this expert-parallel rank" in results[r]["qwen3-moe"]["foreign"]


def test_deepseek_block_has_shared_experts_and_a_correction_bias(reference) -> None:
    block = reference["deepseek-v3"][0]
    assert block.gate.e_score_correction_bias.abs().min() > 0
    assert block.shared_experts.gate_up_proj.weight.abs().max() > 0


@pytest.mark.parametrize("name", list(MODELS))
def test_ep_size_one_passes_the_routing_straight_to_the_experts(reference, name: str) -> None:
    """At ep size 1 the dispatcher moves nothing: the block's output is bitwise its experts'
    sum on the router's choice, computed as before expert parallelism (one pass per expert)."""
    block = reference[name][0]
    experts = block.experts
    assert isinstance(experts.dispatcher, LocalDispatcher)
    assert experts.experts == tuple(range(experts.num_experts))
    assert experts.w13.shape[0] == experts.num_experts
    x = torch.randn(37, experts.w13.shape[2], generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        got = block(x)
        weights, ids = (block.gate(x) if isinstance(block, DeepseekV3MoE)
                        else select_experts(block.gate(x), block.top_k, block.renormalize))
        routed = experts.run_local(x, weights, ids)
        if isinstance(block, DeepseekV3MoE):
            routed = routed + block.shared_experts.partial(x)
    assert torch.equal(got, routed)


def test_slots_of_experts_elsewhere_are_skipped(reference) -> None:
    """A -1 local id adds nothing: the same as weight 0 on any expert (up to the rounding of
    expert 0's products, which then have more rows)."""
    experts = reference["qwen3-moe"][0].experts
    gen = torch.Generator().manual_seed(6)
    x = torch.randn(9, experts.w13.shape[2], generator=gen)
    ids = torch.randint(0, experts.num_experts, (9, 2), generator=gen)
    ids[::2, 1] = -1
    weights = torch.rand(9, 2, generator=gen).masked_fill(ids < 0, 0.0)
    with torch.no_grad():
        got = experts.run_local(x, weights, ids)
        expected = experts.run_local(x, weights, ids.clamp(min=0))
    torch.testing.assert_close(got, expected, atol=1e-6, rtol=0)


def test_ep_with_tp_is_refused() -> None:
    with pytest.raises(ValueError, match=r"--ep-size 2 with --tp-size 2.*--tp-size 1"):
        ParallelState(tp_size=2, ep_size=2)
    with pytest.raises(ValueError, match="ep_rank 2 is outside --ep-size 2"):
        ParallelState(ep_rank=2, ep_size=2)


def test_checkpoint_names_list_only_the_held_experts(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(parallel_state, "_state", ParallelState(ep_rank=1, ep_size=3))
    assert held_experts(8) == (3, 4, 5)  # 3 + 3 + 2: the first ranks hold one more
    names = expert_checkpoint_names("model.layers.2.mlp.experts.w2", 8, held_experts(8))
    assert names == [(f"model.layers.2.mlp.experts.{e}.down_proj.weight", (e, 2))
                     for e in (3, 4, 5)]
    assert expert_checkpoint_names("model.layers.2.mlp.gate.weight", 8, (3,)) is None
