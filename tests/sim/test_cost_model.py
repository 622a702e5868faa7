"""The cost model's FLOPs and bytes against counts worked out by hand here for Llama,
Qwen3-MoE and DeepSeek-V3 shapes; the ring all-reduce and P2P formulas; memory per device."""

from __future__ import annotations

import pytest

from pipeserve.models.arch import ArchConfig
from pipeserve.models.config_presets import CONFIG_PRESETS, load_config
from pipeserve.sim import collectives
from pipeserve.sim.cost_model import CostModel, Precision, SimLayout, SliceWork
from pipeserve.sim.hardware import HARDWARE, Link
from pipeserve.sim.memory import device_memory

LLAMA = {  # Llama-3-8B's shapes
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "vocab_size": 128256,
    "max_position_embeddings": 131072,
}
H20 = HARDWARE["h20"]


def model(
    cfg: dict, tp: int = 1, ep: int = 1, pp: int = 1, weights: str = "bfloat16", cp: int = 1
) -> CostModel:
    arch = ArchConfig.from_dict(cfg)
    layers = arch.num_layers
    part = [layers // pp] * (pp - 1) + [layers - layers // pp * (pp - 1)]
    lay = SimLayout(tp=tp, pp=pp, ep=ep, cp=cp, devices_per_node=8)
    return CostModel(arch, H20, lay, Precision(weights), part)


def test_llama_dense_layer_by_hand() -> None:
    cm = model(LLAMA, tp=2)
    L, x = 6000, 2048
    work = cm.work(0, [SliceWork(L, x)], x)
    # q (4096x4096) + k, v (4096x1024 each) + o (4096x4096) + gate, up, down (3 x 4096x14336)
    weights = 4096 * 4096 + 2 * 4096 * 1024 + 4096 * 4096 + 3 * 4096 * 14336
    assert weights == 218_103_808
    assert work.flops["gemm"] == 2 * x * weights / 2
    assert work.bytes["gemm"] == weights * 2 / 2  # bf16, half on each TP rank
    # 16 heads of 128 per rank; x * (L + x / 2) query-key pairs; QK^T and PV, 2 FLOPs each
    assert work.flops["attention"] == 4 * x * (L + x / 2) * 16 * 128
    # K and V of 4 KV heads per rank, 128 wide, bf16, for every position up to L + x
    assert work.bytes["attention"] == (L + x) * 2 * 4 * 128 * 2
    assert work.flops["moe"] == 0


def test_llama_decode_step_reads_its_kv() -> None:
    cm = model(LLAMA)
    work = cm.work(0, [SliceWork(9999, 1, decode=True)], 1)
    assert work.flops["attention"] == 4 * 1 * (9999 + 0.5) * 32 * 128
    assert work.bytes["attention"] == 10000 * 2 * 8 * 128 * 2


def test_qwen3_moe_layer_by_hand() -> None:
    cfg = CONFIG_PRESETS["qwen3-235b-a22b"]
    cm = model(cfg, tp=4, weights="fp8")
    x = 6144
    work = cm.work(0, [SliceWork(0, x)], x)
    h, mi = 4096, 1536
    attn = h * (64 * 128 + 2 * 4 * 128) + 64 * 128 * h  # q, k, v (4 KV heads), o
    router = h * 128  # replicated on every TP rank
    assert work.flops["gemm"] == 2 * x * (attn / 4 + router)
    assert work.flops["moe"] == 2 * x * 8 * (3 * h * mi) / 4  # top-8 experts, a quarter each
    # 6144 tokens x 8 picks leave no expert of 128 untouched: every expert's fp8 weights
    touched = 128 * (1 - (1 - 8 / 128) ** x)
    assert touched == pytest.approx(128)
    assert work.bytes["moe"] == pytest.approx(128 * 3 * h * mi * 1 / 4)


def test_expert_parallel_ranks_share_the_stage_tokens() -> None:
    cfg = CONFIG_PRESETS["qwen3-235b-a22b"]
    cm = model(cfg, ep=4, weights="fp8")
    mine, everyone = 1000, 5000
    work = cm.work(0, [SliceWork(0, mine)], everyone)
    assert work.flops["moe"] == 2 * everyone * 8 / 4 * (3 * 4096 * 1536)  # 1/4 of all pairs
    assert work.flops["gemm"] == pytest.approx(2 * mine * cm.dense_weights(0))  # own tokens


DS_H = 7168
DS_Q_A, DS_KV_A = DS_H * 1536, DS_H * (512 + 64)  # replicated on every TP rank
DS_Q_B, DS_KV_B = 1536 * 128 * 192, 512 * 128 * (128 + 128)  # split over TP (by heads)
DS_O = 128 * 128 * DS_H


def test_deepseek_v3_mla_by_hand() -> None:
    cfg = CONFIG_PRESETS["deepseek-v3.1"]
    cm = model(cfg, tp=8, weights="fp8")
    L, x = 65536, 4096
    work = cm.work(5, [SliceWork(L, x)], x)  # layer 5: MoE
    h, heads = DS_H, 128 // 8
    pairs = x * (L + x / 2)
    # expanded prefill: QK^T over 192 = 128 + 64 dims, PV over 128, per head and pair
    assert work.flops["attention"] == 2 * pairs * heads * (192 + 128)
    # the latent (512) and rope key (64) of every position, bf16, whole on every TP rank
    assert work.bytes["attention"] == (L + x) * 576 * 2
    shared, router = 3 * h * 2048, h * 256
    per_rank = (DS_Q_B + DS_KV_B + DS_O + shared) / 8 + DS_Q_A + DS_KV_A + router
    prefix_up = L * 512 * heads * (128 + 128)  # the prefix's latents up-projected again
    assert work.flops["gemm"] == pytest.approx(2 * x * per_rank + 2 * prefix_up)
    assert work.flops["moe"] == 2 * x * 8 * 3 * h * 2048 / 8
    dense_layer = cm.work(0, [SliceWork(0, x)], x)  # layer 0 keeps a dense MLP of 18432
    assert dense_layer.flops["moe"] == 0
    dense_rank = (DS_Q_B + DS_KV_B + DS_O + 3 * h * 18432) / 8 + DS_Q_A + DS_KV_A
    assert dense_layer.flops["gemm"] == pytest.approx(2 * x * dense_rank)


def test_deepseek_short_chunks_after_a_prefix_are_absorbed() -> None:
    """As the engine picks (layers.mla.absorb_max_queries, 170 for V3): up to 170 new
    tokens after a prefix attend in latent space, nothing re-expanded."""
    cm = model(CONFIG_PRESETS["deepseek-v3.1"], tp=8, weights="fp8")
    x, L = 128, 5000
    absorbed = cm.work(5, [SliceWork(L, x)], x)
    assert absorbed.flops["attention"] == 2 * x * (L + x / 2) * 16 * (512 + 64 + 512)
    assert absorbed.flops["gemm"] == pytest.approx(2 * x * cm.dense_weights(5))
    first = cm.work(5, [SliceWork(0, x)], x)  # no prefix: nothing to re-expand, expanded
    assert first.flops["attention"] == 2 * x * (x / 2) * 16 * (192 + 128)
    longer = cm.work(5, [SliceWork(L, 171)], 171)
    assert longer.flops["gemm"] > 2 * 171 * cm.dense_weights(5)  # the prefix re-expanded


def test_deepseek_v32_decode_reads_the_indexers_top_k() -> None:
    cfg = load_config("tiny-deepseek-v32")[0]
    cm = model(cfg)
    a = cm.arch
    assert a.indexer is not None and a.indexer.topk == 64
    work = cm.work(1, [SliceWork(1000, 1, decode=True)], 1)
    main = 2 * 64 * a.num_heads * (2 * a.mla.kv_lora_rank + a.mla.qk_rope_head_dim)
    index = 2 * 1000.5 * a.indexer.n_heads * (a.indexer.head_dim + 1)  # scores every key
    assert work.flops["attention"] == pytest.approx(main + index)


def test_deepseek_decode_is_absorbed() -> None:
    cm = model(CONFIG_PRESETS["deepseek-v3.1"], tp=8, weights="fp8")
    work = cm.work(5, [SliceWork(1000, 1, decode=True)], 1)
    # scores over the latent and rope parts (512 + 64), values over the latent (512)
    assert work.flops["attention"] == 2 * 1000.5 * 16 * (512 + 64 + 512)


def test_context_parallel_ranks_share_chunks_and_regather_the_prefix() -> None:
    cm = model(LLAMA, cp=2)
    L, x = 8192, 4096
    work = cm.work(0, [SliceWork(L, x)], x)
    whole = model(LLAMA).work(0, [SliceWork(L, x)], x)
    assert work.flops["gemm"] == whole.flops["gemm"] / 2  # its half of the chunk's tokens
    assert work.flops["attention"] == whole.flops["attention"] / 2  # its zig-zag queries
    assert work.bytes["attention"] == whole.bytes["attention"]  # it reads the whole prefix
    kv = (L + x) * 2 * 8 * 128 * 2  # prefix and chunk K/V, all-gathered
    launched = cm._comm(0, [SliceWork(L, x)], 0)["cp_comm"]
    assert launched == pytest.approx(collectives.ring_all_gather_s(kv, 2, H20.intra_node))
    exposed = cm._layer(0, [SliceWork(L, x)], x, 0, False, 1).seconds["cp_comm"]
    assert exposed < launched  # launched before the query projection, which hides some
    decode = cm.work(0, [SliceWork(L, 1, decode=True)], 1)  # every CP rank runs the step
    assert decode.flops["gemm"] == whole.flops["gemm"] / x
    assert cm.send_bytes(x) == 2 * x * 4096 * 2 / 2  # each CP rank sends its own rows


def test_sharded_cp_ranks_split_the_experts_not_the_pairs_twice() -> None:
    cfg = CONFIG_PRESETS["qwen3-235b-a22b"]
    arch = ArchConfig.from_dict(cfg)
    lay = SimLayout(cp=2, sharded_cp=True, devices_per_node=8)
    cm = CostModel(arch, H20, lay, Precision("fp8"), [arch.num_layers])
    x = 4096
    work = cm.work(0, [SliceWork(0, x)], x)  # the stage's chunk: x tokens over 2 ranks
    assert work.flops["moe"] == 2 * x * 8 / 2 * 3 * 4096 * 1536  # half of all pairs


def test_ring_all_reduce_formula() -> None:
    link = Link(100e9, 5e-6, 0.5)
    size = 64e6
    assert collectives.ring_all_reduce_s(size, 8, link) == pytest.approx(
        14 * 5e-6 + 2 * 7 / 8 * size / 50e9
    )
    assert collectives.ring_all_reduce_s(size, 1, link) == 0.0
    assert collectives.ring_all_gather_s(size, 4, link) == pytest.approx(
        3 * 5e-6 + 3 / 4 * size / 50e9
    )


def test_tp_layer_pays_two_all_reduces() -> None:
    cm = model(LLAMA, tp=8)
    x = 4096
    seconds = cm._layer(0, [SliceWork(0, x)], x, 0, False, 1).seconds
    size = x * 4096 * 2  # hidden states, bf16
    assert seconds["tp_comm"] == pytest.approx(
        2 * collectives.ring_all_reduce_s(size, 8, H20.intra_node)
    )


def test_pp_send_carries_hidden_states_and_residual() -> None:
    cm = model(LLAMA, pp=2)
    x = 2048
    assert cm.send_bytes(x) == 2 * x * 4096 * 2  # hidden + residual, bf16
    link = H20.intra_node
    assert sum(cm.send_parts(0, x)) == pytest.approx(
        link.latency + 2 * x * 4096 * 2 / (link.bandwidth * link.efficiency)
    )
    # stage boundary between nodes: PP2 x TP8 puts stage 1 on the second node
    cm2 = model(LLAMA, pp=2, tp=8)
    inter = H20.inter_node
    per_rank = 2 * x * 4096 * 2 / 8  # each TP rank sends its eighth of the rows ...
    gather = collectives.ring_all_gather_s(2 * x * 4096 * 2, 8, H20.intra_node)  # ... regathered
    assert sum(cm2.send_parts(0, x)) == pytest.approx(
        inter.latency + per_rank / (inter.bandwidth * inter.efficiency) + gather
    )


def test_pp_traffic_does_not_grow_with_depth_but_tp_does() -> None:
    """Spec 06: PP moves (P - 1) S H b per activation tensor whatever the depth; TP moves
    about 4 L S H b per device."""
    x = 8192
    shallow, deep = dict(LLAMA, num_hidden_layers=16), dict(LLAMA, num_hidden_layers=64)
    assert model(shallow, pp=4).send_bytes(x) == model(deep, pp=4).send_bytes(x)
    tp = [
        model(c, tp=2)._layer(0, [SliceWork(0, x)], x, 0, False, 1).seconds["tp_comm"]
        for c in (shallow, deep)
    ]
    assert tp[0] == tp[1]  # per layer, so a 4x deeper model pays 4x in all


def test_weights_per_device_by_hand() -> None:
    cfg = CONFIG_PRESETS["qwen3-235b-a22b"]
    cm = model(cfg, tp=4, weights="fp8")
    mem = device_memory(cm, 0.9)
    h, mi = 4096, 1536
    attn = h * (64 * 128 + 2 * 4 * 128) + 64 * 128 * h
    experts = 128 * 3 * h * mi
    per_layer_fp8 = (attn + experts) / 4
    per_layer_bf16 = (2 * h + 2 * 128 + h * 128) * 2  # two norms, q/k norms, router
    vocab = 151936 * h * 2 / 4 * 2  # embedding and LM head, bf16, vocab-parallel
    assert mem.weight_bytes == pytest.approx(94 * (per_layer_fp8 + per_layer_bf16) + vocab)
    assert mem.kv_bytes_per_token == 94 * 2 * 1 * 128 * 2  # one KV head per rank of 4
