"""DeepSeek-V3 routing (grouped top-k over sigmoid scores with a selection-only bias) and the
DeepSeek-V3 MoE block (routed + shared experts), against transformers' DeepseekV3 modules in
float32; the tie rule, which transformers leaves to torch.topk, against its statement; and the
block's TP sharding on emulated ranks."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

from pipeserve.distributed import parallel_state
from pipeserve.distributed.parallel_state import ParallelState
from pipeserve.layers import moe
from pipeserve.layers.moe import (
    DeepseekV3MoE,
    GroupedRouting,
    expert_checkpoint_names,
    select_experts_grouped,
    top_indices,
)
from pipeserve.model_loader import load_weights

hf_ds = pytest.importorskip("transformers.models.deepseek_v3.modeling_deepseek_v3")

HIDDEN, MOE_INTER = 32, 16
SETTINGS = {  # (experts, top_k, n_group, topk_group, renormalize, scaling)
    "8e-4g-keep2": GroupedRouting(8, 3, 4, 2, True, 2.5),
    "16e-8g-keep3": GroupedRouting(16, 4, 8, 3, True, 1.0),
    "16e-4g-keep1-unnormed": GroupedRouting(16, 2, 4, 1, False, 2.5),
    "16e-1g": GroupedRouting(16, 4, 1, 1, True, 1.5),
    "12e-6g-keepall": GroupedRouting(12, 2, 6, 6, True, 2.5),
    "64e-8g-keep4-k8": GroupedRouting(64, 8, 8, 4, True, 2.5),  # DeepSeek-V3's shape, scaled
}


def rand(*shape: int, seed: int, std: float = 1.0) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * std


def hf_config(r: GroupedRouting, hidden: int = HIDDEN, n_shared: int = 1) -> object:
    from transformers import DeepseekV3Config

    return DeepseekV3Config(
        vocab_size=64, hidden_size=hidden, intermediate_size=64, moe_intermediate_size=MOE_INTER,
        num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=2,
        q_lora_rank=16, kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=8,
        first_k_dense_replace=0, n_routed_experts=r.num_experts, num_experts_per_tok=r.top_k,
        n_group=r.n_group, topk_group=r.topk_group, norm_topk_prob=r.renormalize,
        routed_scaling_factor=r.scaling_factor, n_shared_experts=n_shared,
    )


def hf_route(logits: torch.Tensor, bias: torch.Tensor,
             r: GroupedRouting) -> tuple[torch.Tensor, torch.Tensor]:
    """transformers' router fed the logits themselves (hidden = experts, weight = identity)."""
    router = hf_ds.DeepseekV3TopkRouter(hf_config(r, hidden=r.num_experts))
    with torch.no_grad():
        router.weight.copy_(torch.eye(r.num_experts))
        router.e_score_correction_bias.copy_(bias)
        _, weights, ids = router(logits)
    return weights, ids


def by_expert(weights: torch.Tensor, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's choices in expert order (transformers returns them unsorted)."""
    ids, order = ids.sort(dim=-1)
    return weights.gather(1, order), ids


@pytest.mark.parametrize("name", list(SETTINGS))
def test_routing_matches_transformers(name: str) -> None:
    r = SETTINGS[name]
    logits, bias = rand(256, r.num_experts, seed=1, std=2.0), rand(r.num_experts, seed=2, std=0.2)
    weights, ids = select_experts_grouped(logits, bias, r)
    expected_w, expected_ids = by_expert(*hf_route(logits, bias, r))
    got_w, got_ids = by_expert(weights, ids)
    assert torch.equal(got_ids, expected_ids)
    # equal up to the order the k weights are summed in when renormalising (one ulp at most)
    torch.testing.assert_close(got_w, expected_w, rtol=1e-6, atol=0)
    # the case is not vacuous: the bias, and the groups where some are dropped, change choices
    unbiased = select_experts_grouped(logits, torch.zeros_like(bias), r)[1]
    assert (unbiased.sort(-1).values != got_ids).any()
    ungrouped = top_indices(logits.sigmoid() + bias, r.top_k).sort(-1).values
    assert (ungrouped != got_ids).any() == (r.topk_group < r.n_group)


def test_bias_chooses_experts_but_does_not_weigh_them() -> None:
    r = GroupedRouting(4, 2, 1, 1, False, 2.5)
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0]])
    bias = torch.tensor([0.0, 0.0, 0.0, 1.0])  # lifts expert 3 (0.27 -> 1.27) past the others
    weights, ids = select_experts_grouped(logits, bias, r)
    assert ids.tolist() == [[3, 0]]
    assert select_experts_grouped(logits, torch.zeros(4), r)[1].tolist() == [[0, 1]]
    torch.testing.assert_close(weights, 2.5 * torch.tensor([[-1.0, 2.0]]).sigmoid(), rtol=0, atol=0)
    assert by_expert(weights, ids)[1].tolist() == by_expert(*hf_route(logits, bias, r))[1].tolist()


def test_bias_chooses_groups_and_weights_are_renormalised_unbiased_scores() -> None:
    r = GroupedRouting(8, 2, 4, 1, True, 2.5)
    logits = torch.tensor([[3.0, 2.5, 0.0, 0.0, 0.0, 0.0, 1.0, 0.5]])
    bias = torch.tensor([0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.5, 0.5])  # group 3 overtakes group 0
    weights, ids = select_experts_grouped(logits, bias, r)
    assert ids.tolist() == [[6, 7]]
    assert select_experts_grouped(logits, torch.zeros(8), r)[1].tolist() == [[0, 1]]
    scores = torch.tensor([[1.0, 0.5]]).sigmoid()
    torch.testing.assert_close(weights, 2.5 * scores / scores.sum(), rtol=1e-6, atol=0)
    expected_w, expected_ids = by_expert(*hf_route(logits, bias, r))
    assert ids.tolist() == expected_ids.tolist()
    torch.testing.assert_close(weights, expected_w, rtol=1e-6, atol=0)


@pytest.mark.parametrize("r", [GroupedRouting(16, 3, 4, 2, True, 2.5),
                               GroupedRouting(16, 5, 1, 1, False, 1.0)])
def test_equal_scores_go_to_the_lower_group_then_the_lower_expert(r: GroupedRouting) -> None:
    weights, ids = select_experts_grouped(torch.zeros(5, 16), torch.zeros(16), r)
    assert ids.tolist() == [list(range(r.top_k))] * 5
    expected = r.scaling_factor * (1 / r.top_k if r.renormalize else 0.5)
    torch.testing.assert_close(weights, torch.full((5, r.top_k), expected), rtol=1e-6, atol=0)


def test_tied_groups_keep_the_lower_one_even_without_the_best_expert() -> None:
    """Group 0 scores 0.5 + 0.5 and group 1 0.75 + 0.25 (exact in binary): a tie, so group 0
    is kept although expert 2 is the best; within it experts 0 and 1 tie, expert 0 wins."""
    r = GroupedRouting(4, 1, 2, 1, True, 1.0)
    bias = torch.tensor([0.0, 0.0, 0.25, -0.25])
    assert select_experts_grouped(torch.zeros(3, 4), bias, r)[1].tolist() == [[0]] * 3
    r2 = GroupedRouting(4, 2, 2, 2, True, 1.0)  # both groups kept: the best expert comes first
    assert select_experts_grouped(torch.zeros(1, 4), bias, r2)[1].tolist() == [[2, 0]]


def test_partial_ties_keep_the_score_order() -> None:
    r = GroupedRouting(8, 3, 1, 1, True, 1.0)
    logits = torch.tensor([[0.0, 0.0, 1.0, 0.0, 2.0, 0.0, 0.0, 0.0]])
    assert select_experts_grouped(logits, torch.zeros(8), r)[1].tolist() == [[4, 2, 0]]


@pytest.mark.parametrize(("args", "message"), [
    ((10, 2, 4, 2, True, 1.0), "cannot be split"),
    ((8, 2, 8, 2, True, 1.0), "at least 2"),
    ((8, 2, 4, 5, True, 1.0), "topk_group 5"),
    ((8, 5, 4, 2, True, 1.0), r"num_experts_per_tok 5 must be in \[1, 4\]"),
])
def test_impossible_routing_settings_are_refused(args: tuple, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        GroupedRouting(*args)


# --- the whole block ----------------------------------------------------------------------

BLOCKS = {  # (routing, n_shared_experts)
    "keep2-shared1": (SETTINGS["8e-4g-keep2"], 1),
    "keep1-unnormed-shared2": (SETTINGS["16e-4g-keep1-unnormed"], 2),
}


class OneLayerCheckpoint(nn.Module):
    """A block where a DeepseekV3ForCausalLM checkpoint keeps layer 0's MLP, with the name
    mapping a model's `checkpoint_names` does (fused experts; shared gate/up -> gate_up_proj)."""

    def __init__(self, block: DeepseekV3MoE) -> None:
        super().__init__()
        layer = nn.Module()
        layer.mlp = block
        self.model = nn.Module()
        self.model.layers = nn.ModuleList([layer])
        self.num_experts = block.experts.num_experts

    def checkpoint_names(self, param_name: str) -> list[tuple[str, object]]:
        experts = expert_checkpoint_names(param_name, self.num_experts)
        if experts is not None:
            return experts
        if ".gate_up_proj." in param_name:
            return [(param_name.replace("gate_up_proj", p), i)
                    for i, p in enumerate(["gate_proj", "up_proj"])]
        return [(param_name, None)]


@pytest.fixture(scope="module")
def hf_block(tmp_path_factory: pytest.TempPathFactory):
    """name -> (transformers' DeepseekV3MoE with random weights, its saved checkpoint dir)."""
    made: dict[str, tuple[nn.Module, Path]] = {}

    def get(name: str) -> tuple[nn.Module, Path]:
        if name not in made:
            routing, n_shared = BLOCKS[name]
            torch.manual_seed(0)
            model = hf_ds.DeepseekV3ForCausalLM(hf_config(routing, n_shared=n_shared)).eval()
            mlp = model.model.layers[0].mlp
            assert isinstance(mlp, hf_ds.DeepseekV3MoE)
            with torch.no_grad():
                for p in mlp.parameters():
                    p.normal_(0.0, 0.3)
                mlp.gate.e_score_correction_bias.normal_(0.0, 0.1)
            path = tmp_path_factory.mktemp(name)
            model.save_pretrained(path)
            made[name] = mlp, path
        return made[name]

    return get


def load_block(name: str, path: Path) -> DeepseekV3MoE:
    routing, n_shared = BLOCKS[name]
    block = DeepseekV3MoE(HIDDEN, MOE_INTER, n_shared, routing, torch.float32)
    load_weights(OneLayerCheckpoint(block), path)
    return block


@pytest.mark.parametrize("name", list(BLOCKS))
def test_block_matches_transformers(hf_block, name: str) -> None:
    hf_mlp, path = hf_block(name)
    block = load_block(name, path)
    x = rand(200, HIDDEN, seed=3)
    with torch.no_grad():
        expected = hf_mlp(x[None])[0]
        got = block(x)
        shared = hf_mlp.shared_experts(x)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=0)
    assert (expected - shared).abs().max() > 0.1  # the routed part is not negligible
    assert block.gate.e_score_correction_bias.abs().min() > 0  # the bias was loaded


@pytest.mark.parametrize("name", list(BLOCKS))
def test_block_sharded_over_two_tp_ranks_sums_to_one_rank(
    hf_block, monkeypatch: pytest.MonkeyPatch, name: str
) -> None:
    """Each emulated rank loads its slices; its forward all-reduces once (routed and shared
    summed first); the two ranks' partial outputs add up to the single-rank output."""
    _, path = hf_block(name)
    x = rand(64, HIDDEN, seed=4)
    with torch.no_grad():
        full = load_block(name, path)(x)
    reduces: list[int] = []
    monkeypatch.setattr(moe, "tp_all_reduce", lambda t: reduces.append(1) or t)
    partials = []
    for rank in range(2):
        monkeypatch.setattr(parallel_state, "_state", ParallelState(tp_rank=rank, tp_size=2))
        block = load_block(name, path)
        assert block.experts.w13.shape[1] == MOE_INTER  # 2 x half the intermediate dim
        with torch.no_grad():
            partials.append(block(x))
    assert len(reduces) == 2
    torch.testing.assert_close(partials[0] + partials[1], full, atol=1e-5, rtol=0)
