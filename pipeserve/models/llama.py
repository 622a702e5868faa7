"""Llama: pre-norm decoder with RMSNorm, rotary attention with grouped KV heads, SwiGLU MLP.

The Qwen family differs in small ways expressed by subclasses (qkv bias, per-head q/k norm,
routed experts). Module and parameter names follow the Hugging Face checkpoints. A pipeline
stage builds only its own layers (the others stay empty placeholders); TP sharding is inside
the parallel layer classes.
"""

from __future__ import annotations

import weakref
from typing import Protocol, cast

import torch
from torch import nn

from pipeserve.backends.base import (
    TORCH_NORMS,
    AttentionBackend,
    DecodeStack,
    NormKernels,
    StackLayer,
)
from pipeserve.batch_overlap.operations import OpFn, Outputs, State, execute
from pipeserve.batch_overlap.single_batch import get_single_batch_overlap
from pipeserve.batch_overlap.strategies import Strategy, forward_stages
from pipeserve.distributed.parallel_state import is_first_stage, is_last_stage, stage_layers
from pipeserve.layers.activation import silu_and_mul
from pipeserve.layers.attention import PagedAttention
from pipeserve.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from pipeserve.layers.layernorm import RMSNorm
from pipeserve.layers.linear import (
    ColumnParallelLinear,
    MergedColumnParallelLinear,
    QKVParallelLinear,
    RowParallelLinear,
)
from pipeserve.layers.moe import MoEBlock
from pipeserve.layers.rotary import RotaryEmbedding, apply_rotary
from pipeserve.mem_cache.kv_pool import KVPool
from pipeserve.models.arch import ArchConfig
from pipeserve.op_profile import region
from pipeserve.runner.forward_batch import ForwardBatch

Rope = tuple[torch.Tensor, torch.Tensor]


class LayerHook(Protocol):
    """Work around each of a stage's layers (n: its index among the stage's layers): what
    shard linear (context_parallel/layer_shards) and PD's KV sender (disaggregation/pd)
    provide. Several may be set; `after` runs in the reverse order of `before`."""

    def before(self, n: int) -> None: ...

    def after(self, n: int) -> None: ...


class LlamaMLP(nn.Module):
    def __init__(
        self, hidden: int, intermediate: int, dtype: torch.dtype, bias: bool = False
    ) -> None:
        super().__init__()
        self.gate_up_proj = MergedColumnParallelLinear(hidden, [intermediate] * 2, bias, dtype)
        self.down_proj = RowParallelLinear(intermediate, hidden, bias, dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(silu_and_mul(self.gate_up_proj(x)))


class LlamaAttention(nn.Module):
    def __init__(self, arch: ArchConfig, layer_id: int, dtype: torch.dtype) -> None:
        super().__init__()
        d = arch.head_dim
        self.qkv_proj = QKVParallelLinear(
            arch.hidden_size, d, arch.num_heads, arch.num_kv_heads, arch.qkv_bias, dtype
        )
        heads, kv_heads = self.qkv_proj.num_heads, self.qkv_proj.num_kv_heads
        self.o_proj = RowParallelLinear(arch.num_heads * d, arch.hidden_size, arch.o_bias, dtype)
        self.attn = PagedAttention(layer_id, heads, kv_heads, d)
        self.split = [heads * d, kv_heads * d, kv_heads * d]
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, d

    def qk_norms(self) -> tuple[RMSNorm, RMSNorm] | None:
        """The RMSNorms over each query and key head (Qwen3's); Llama has none."""
        return None

    def norm_q(self, q: torch.Tensor) -> torch.Tensor:
        norms = self.qk_norms()
        return q if norms is None else norms[0](q)

    def norm_k(self, k: torch.Tensor) -> torch.Tensor:
        norms = self.qk_norms()
        return k if norms is None else norms[1](k)

    def forward(self, x: torch.Tensor, rope: Rope, fb: ForwardBatch) -> torch.Tensor:
        if fb.cp is not None:
            return self._forward_context_parallel(x, rope, fb)
        n = x.shape[0]
        q, k, v = self.qkv_proj(x).split(self.split, dim=-1)
        q = q.view(n, self.heads, self.head_dim)  # [tokens, heads, d]
        k = k.view(n, self.kv_heads, self.head_dim)
        v = v.view(n, self.kv_heads, self.head_dim)
        fused = self._rope_and_store(q, k, v, rope, fb)
        if fused is not None:
            return self.o_proj(self.attn.attend(fused, fb.kv_pool, fb.attn))
        q, k = self.norm_q(q), self.norm_k(k)
        q, k = apply_rotary(q, *rope), apply_rotary(k, *rope)
        o = self.attn(q, k, v, fb.kv_pool, fb.out_slots, fb.attn)
        return self.o_proj(o)

    def _rope_and_store(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, rope: Rope, fb: ForwardBatch
    ) -> torch.Tensor | None:
        """The backend's one kernel for the q/k norms, rotary and the KV write -> q as
        attention reads it; None where it has none for this layer (the torch ops run)."""
        weights = None
        if (norms := self.qk_norms()) is not None:
            q_norm, k_norm = norms
            if q_norm.eps != k_norm.eps:  # such a kernel takes one
                return None
            weights = (q_norm.weight, k_norm.weight, q_norm.eps)
        cache = fb.kv_pool.buffers(self.attn.layer_id)
        return fb.attn.backend.rope_and_store((q, k, v), rope, cache, fb.out_slots, weights)

    def _forward_context_parallel(
        self, x: torch.Tensor, rope: Rope, fb: ForwardBatch
    ) -> torch.Tensor:
        """Context parallelism: the keys and values first, so their exchange with the other
        CP ranks runs while the query projection computes."""
        assert fb.cp is not None
        n, q_size = x.shape[0], self.qkv_proj.q_size
        k, v = self.qkv_proj.project(x, q_size, None).split(self.split[1:], dim=-1)
        k = k.view(n, self.kv_heads, self.head_dim)
        v = v.view(n, self.kv_heads, self.head_dim)
        k = apply_rotary(self.norm_k(k), *rope)
        exchange = fb.cp.launch(self.attn.layer_id, k, v, fb.kv_pool)
        q = self.qkv_proj.project(x, 0, q_size).view(n, self.heads, self.head_dim)
        q = apply_rotary(self.norm_q(q), *rope)
        return self.o_proj(fb.cp.attend(self.attn, q, exchange, fb.kv_pool))


class LlamaDecoderLayer(nn.Module):
    def __init__(
        self, attn: nn.Module, mlp: nn.Module, hidden: int, eps: float, dtype: torch.dtype
    ) -> None:
        super().__init__()
        self.self_attn, self.mlp = attn, mlp
        self.input_layernorm = RMSNorm(hidden, eps, dtype)
        self.post_attention_layernorm = RMSNorm(hidden, eps, dtype)

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None, rope: Rope, fb: ForwardBatch
    ) -> tuple[torch.Tensor, torch.Tensor]:
        with region("attention"):
            x, residual = self.attention_part(x, residual, rope, fb)
        with region("mlp"):
            return self.mlp(x), residual

    def attention_part(
        self, x: torch.Tensor, residual: torch.Tensor | None, rope: Rope, fb: ForwardBatch
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Norms and attention: the MLP's input and the residual stream."""
        norms = fb.attn.norms  # the batch's backend's norm kernels
        if residual is None:
            residual, x = x, self.input_layernorm(x, norms)
        else:
            x, residual = self.input_layernorm.add_and_norm(x, residual, norms)
        x = self.attend(x, rope, fb)
        return self.post_attention_layernorm.add_and_norm(x, residual, norms)

    def operations(self) -> dict[str, OpFn]:
        """The layer as operations (pipeserve/batch_overlap): a MoE layer offers attention,
        its MoE block's operations and layer_output, so another micro-batch can run between
        them; a dense layer is one operation. The micro-batch's state holds `fb` and `rope`."""
        if not isinstance(self.mlp, MoEBlock):
            return {"layer": self._whole}
        return {"attention": self._attention, **self.mlp.operations(), "layer_output": self._out}

    def _whole(self, state: State, hidden: torch.Tensor, residual: torch.Tensor | None) -> Outputs:
        hidden, residual = self(hidden, residual, state["rope"], state["fb"])
        return {"hidden": hidden, "residual": residual}

    def _attention(
        self, state: State, hidden: torch.Tensor, residual: torch.Tensor | None
    ) -> Outputs:
        x, state["layer_residual"] = self.attention_part(
            hidden, residual, state["rope"], state["fb"]
        )
        return {"x": x}

    def _out(self, state: State, out: torch.Tensor) -> Outputs:
        return {"hidden": out, "residual": state.pop("layer_residual")}

    def attend(self, x: torch.Tensor, rope: Rope, fb: ForwardBatch) -> torch.Tensor:
        return self.self_attn(x, rope, fb)


def _norm_pair(q: RMSNorm, k: RMSNorm) -> tuple[torch.Tensor, float, torch.Tensor, float]:
    return q.weight, q.eps, k.weight, k.eps


class LlamaModel(nn.Module):
    """The decoder stack of one pipeline stage (named `model.` in checkpoints): the embedding
    on the first stage, this stage's layers (others are empty placeholders), the final norm
    on the last stage."""

    def __init__(
        self, arch: ArchConfig, dtype: torch.dtype, layers: list[nn.Module], first: bool, last: bool
    ) -> None:
        super().__init__()
        self.embed_tokens = (
            VocabParallelEmbedding(arch.vocab_size, arch.hidden_size, dtype) if first else None
        )
        self.layers = nn.ModuleList(layers)
        self.norm = RMSNorm(arch.hidden_size, arch.rms_norm_eps, dtype) if last else None


class LlamaForCausalLM(nn.Module):
    attention_class: type[LlamaAttention] = LlamaAttention
    # (our parameter fragment, checkpoint fragment, shard id)
    stacked_params = [
        ("qkv_proj", "q_proj", "q"),
        ("qkv_proj", "k_proj", "k"),
        ("qkv_proj", "v_proj", "v"),
        ("gate_up_proj", "gate_proj", 0),
        ("gate_up_proj", "up_proj", 1),
    ]

    def __init__(self, arch: ArchConfig, dtype: torch.dtype) -> None:
        super().__init__()
        self.arch, self.dtype = arch, dtype
        self.layer_ids = stage_layers(arch.num_layers)
        self.first, self.last = is_first_stage(), is_last_stage()
        layers = [
            self.make_layer(i) if i in self.layer_ids else nn.Identity()
            for i in range(arch.num_layers)
        ]
        self.model = LlamaModel(arch, dtype, layers, self.first, self.last)
        self.lm_head: ParallelLMHead | None = None
        if self.last:
            self.lm_head = ParallelLMHead(arch.vocab_size, arch.hidden_size, dtype)
            if arch.tie_word_embeddings and self.model.embed_tokens is not None:
                self.lm_head.weight = self.model.embed_tokens.weight
        self.rotary = RotaryEmbedding(arch.head_dim, arch.rope_theta, arch.rope_scaling)
        # what runs around each of the stage's layers (shard linear's weight broadcasts, PD's
        # KV sending): before(n) in this order, after(n) in the reverse one
        self.layer_hooks: list[LayerHook] = []
        # each backend's whole-stack decode kernel (`_decode_stack`) and the pool it is for: a
        # split backend hands prompt chunks and decode steps to two
        self._stacks: weakref.WeakKeyDictionary[
            AttentionBackend, tuple[weakref.ref[KVPool], DecodeStack | None]
        ] = weakref.WeakKeyDictionary()

    def make_layer(self, layer_id: int) -> nn.Module:
        a = self.arch
        attn = self.attention_class(a, layer_id, self.dtype)
        return LlamaDecoderLayer(
            attn, self.make_mlp(layer_id), a.hidden_size, a.rms_norm_eps, self.dtype
        )

    def make_mlp(self, layer_id: int) -> nn.Module:
        a = self.arch
        return LlamaMLP(a.hidden_size, a.intermediate_size, self.dtype, a.mlp_bias)

    def forward(
        self,
        fb: ForwardBatch,
        hidden: torch.Tensor | None = None,
        residual: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """First stage: embeds fb.input_ids. Last stage: returns final-normed hidden states.
        Other stages pass (hidden, residual) on to the next one."""
        hidden, residual = self._embed(fb, hidden, residual)
        rope = self.rotary.cos_sin(fb.positions, self.dtype)
        stack = self._decode_stack(fb)
        if stack is not None:
            out = stack.run(hidden, residual, rope, fb.attn.meta, fb.out_slots)
            if out is not None:
                return self._final_norm(*out, fb.attn.norms)
        hooks = self.layer_hooks
        for n, i in enumerate(self.layer_ids):
            for hook in hooks:
                hook.before(n)
            hidden, residual = self.model.layers[i](hidden, residual, rope, fb)
            for hook in reversed(hooks):
                hook.after(n)
        return self._final_norm(hidden, residual, fb.attn.norms)

    def _decode_stack(self, fb: ForwardBatch) -> DecodeStack | None:
        """The batch's backend's whole-stack kernel over this stage's layers (built once per
        backend and pool), where the stage qualifies: dense Llama-family layers (Qwen3's q/k
        norms included) without TP, CP, FP8 weights or work around each layer
        (layer_hooks)."""
        if fb.cp is not None or self.layer_hooks:
            return None
        backend, pool = fb.attn.backend, fb.kv_pool
        built = self._stacks.get(backend)
        if built is not None and built[0]() is pool:
            return built[1]
        layers = self._stack_layers(pool)
        stack = None if layers is None else backend.decode_stack(layers)
        self._stacks[backend] = (weakref.ref(pool), stack)
        return stack

    def _stack_layers(self, pool: KVPool) -> list[StackLayer] | None:
        found = []
        for i in self.layer_ids:
            layer = self.model.layers[i]
            if type(layer) is not LlamaDecoderLayer:  # DeepSeek's layers subclass it
                return None
            attn, mlp = layer.self_attn, layer.mlp
            if (
                not isinstance(attn, LlamaAttention)
                or type(attn).forward is not LlamaAttention.forward  # Qwen3 changes qk_norms only
                or type(mlp) is not LlamaMLP
            ):
                return None
            linears: tuple[ColumnParallelLinear | RowParallelLinear, ...] = (
                attn.qkv_proj,
                attn.o_proj,
                mlp.gate_up_proj,
                mlp.down_proj,
            )
            if any(lin.scale_inv is not None or lin.tp_size > 1 for lin in linears) or any(
                lin.bias is not None for lin in linears[1:]
            ):
                return None
            found.append(
                StackLayer(
                    layer.input_layernorm.weight,
                    layer.input_layernorm.eps,
                    layer.post_attention_layernorm.weight,
                    layer.post_attention_layernorm.eps,
                    attn.qkv_proj.weight,
                    attn.qkv_proj.bias,
                    None if (qk := attn.qk_norms()) is None else _norm_pair(*qk),
                    attn.o_proj.weight,
                    mlp.gate_up_proj.weight,
                    mlp.down_proj.weight,
                    attn.heads,
                    attn.kv_heads,
                    attn.head_dim,
                    attn.attn.scale,
                    pool.buffers(attn.attn.layer_id),
                )
            )
        return found or None

    def forward_interleaved(
        self,
        fbs: list[ForwardBatch],
        inputs: list[tuple[torch.Tensor | None, torch.Tensor | None]],
        strategy: Strategy,
    ) -> list[tuple[torch.Tensor, torch.Tensor | None]]:
        """`forward` of several micro-batches whose layers' stages interleave (two-batch
        overlap); `inputs` are each one's (hidden, residual) from the previous stage."""
        states, carried = [], []
        for fb, (hidden, residual) in zip(fbs, inputs, strict=True):
            hidden, residual = self._embed(fb, hidden, residual)
            states.append(State(fb=fb, rope=self.rotary.cos_sin(fb.positions, self.dtype)))
            carried.append({"hidden": hidden, "residual": residual})
        layers = [cast(LlamaDecoderLayer, self.model.layers[i]) for i in self.layer_ids]
        stages = forward_stages(layers, strategy, get_single_batch_overlap())
        outs = execute(stages, states, carried, strategy.delta)
        return [
            self._final_norm(o["hidden"], o["residual"], fb.attn.norms)
            for o, fb in zip(outs, fbs, strict=True)
        ]

    def _embed(
        self, fb: ForwardBatch, hidden: torch.Tensor | None, residual: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        if self.model.embed_tokens is not None:
            return self.model.embed_tokens(fb.input_ids), None
        assert hidden is not None
        return hidden, residual

    def _final_norm(
        self,
        hidden: torch.Tensor,
        residual: torch.Tensor | None,
        norms: NormKernels = TORCH_NORMS,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        norm = self.model.norm
        if norm is None:
            return hidden, residual
        if residual is None:
            return norm(hidden, norms), None
        return norm.add_and_norm(hidden, residual, norms)[0], None

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[rows, hidden] -> [rows, vocab] float32 logits (last stage only)."""
        assert self.lm_head is not None
        return self.lm_head.logits(hidden).float()

    def checkpoint_names(self, param_name: str) -> list[tuple[str, object]]:
        """The checkpoint tensors (and shard ids) that make up one of our parameters."""
        if param_name == "lm_head.weight" and self.arch.tie_word_embeddings:
            return [("model.embed_tokens.weight", None)]
        fused = next((o for o, _, _ in self.stacked_params if f".{o}." in param_name), None)
        if fused is None:
            return [(param_name, None)]
        return [
            (param_name.replace(fused, ckpt), sid)
            for ours, ckpt, sid in self.stacked_params
            if ours == fused
        ]
