"""What a layout holds per device: weights (its stage's layers, its TP share, its experts,
the embedding on the first stage and the LM head on the last) and the KV pool the rest of
the memory budget leaves. Like the engine (runner.kv_layout.kv_pool_pages) the pool is
one rank's, sized for the heaviest stage from --mem-fraction-static (CPU: of RAM, over the
node's workers); unlike the engine's estimate, which charges every parameter in the run
dtype spread evenly over the stages, the weights are counted where they sit and in the
simulated dtype (fp8 projections, bf16 norms, router, embedding and LM head)."""

from __future__ import annotations

from dataclasses import dataclass

from pipeserve.models.arch import attention_other_params
from pipeserve.sim.cost_model import CostModel


@dataclass(frozen=True)
class DeviceMemory:
    weight_bytes: float  # the heaviest device's
    kv_bytes_per_token: float  # one token's KV over the heaviest stage's layers, on one rank
    budget_bytes: float  # memory x --mem-fraction-static (CPU: over the local workers)

    @property
    def kv_tokens(self) -> int:
        """Tokens the KV pool of one rank holds (0: the weights do not fit)."""
        left = self.budget_bytes - self.weight_bytes
        return max(int(left // self.kv_bytes_per_token), 0) if left > 0 else 0


def stage_weight_bytes(cost: CostModel, stage: int) -> float:
    """Bytes of weights one rank of `stage` holds: projections and experts in the weight
    dtype (routed experts split over the expert ranks and TP), norms, the router and the
    vocabulary matrices in the activation dtype (fp8 checkpoints keep those in bf16)."""
    a, lay, p = cost.arch, cost.layout, cost.precision
    total = 0.0
    for layer in cost.stage_layers[stage]:
        router = a.hidden_size * a.num_experts if a.is_moe_layer(layer) else 0
        total += (cost.dense_weights(layer) - router) * p.weight_bytes
        total += (attention_other_params(a) + router) * p.act_bytes
        if a.is_moe_layer(layer):
            experts = a.num_experts * cost.expert_weights / lay.tp / lay.expert_ranks
            total += experts * p.weight_bytes
    vocab = a.vocab_size * a.hidden_size * p.act_bytes / lay.tp
    copies = (stage == 0) + (stage == lay.pp - 1)  # embedding, LM head
    return total + vocab * (1 if a.tie_word_embeddings and lay.pp == 1 else copies)


def device_memory(cost: CostModel, mem_fraction: float, local_workers: int = 1) -> DeviceMemory:
    """The heaviest stage's device: its weights, and one token's KV over its layers."""
    hw = cost.hw
    weights = max(stage_weight_bytes(cost, s) for s in range(cost.layout.pp))
    per_token = cost.kv_bytes_per_token_layer() * max(cost.partition)
    budget = hw.memory_bytes * mem_fraction / (local_workers if hw.kind == "cpu" else 1)
    return DeviceMemory(weights, per_token, budget)
