"""Runs the model on scheduled batches: prepare tensors, forward this stage's layers, and on
the last stage compute logits, sample, and gather logprobs."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from pathlib import Path

import torch

from pipeserve.backends.registry import select_backend
from pipeserve.batch_overlap.single_batch import (
    SingleBatchOverlap,
    set_single_batch_overlap,
    set_step_blocks,
)
from pipeserve.batch_overlap.strategies import AFD_ATTENTION, DECODE, PREFILL, Strategy
from pipeserve.batch_overlap.two_batch import split_batch
from pipeserve.config import EngineConfig
from pipeserve.context_parallel.attention import CpContext
from pipeserve.context_parallel.layer_shards import LayerShards
from pipeserve.context_parallel.layout import PageStriping
from pipeserve.device import memory_budget, resolve_device, resolve_dtype, synchronize
from pipeserve.disaggregation.afd.micro_batches import split_micro_batches
from pipeserve.disaggregation.pd import auth
from pipeserve.disaggregation.pd.kv_remap import SideLayout
from pipeserve.disaggregation.pd.transfer import KVReceiver, KVSender
from pipeserve.distributed.parallel_state import get_parallel_state, stage_layers
from pipeserve.distributed.partition import resolve_partition
from pipeserve.engine.future_map import FutureMap
from pipeserve.layers import batch_invariant
from pipeserve.layers.linear import fp8_kept, keeping_fp8_weights
from pipeserve.layers.moe import FusedMoE
from pipeserve.layers.sampler import Sampler, output_logprobs, prompt_logprobs
from pipeserve.mem_cache.host_tier import tier_pages
from pipeserve.mem_cache.tier_store import TierStore
from pipeserve.model_loader import load_weights
from pipeserve.models.arch import ArchConfig, param_count, routed_expert_params
from pipeserve.models.registry import build_model
from pipeserve.op_profile import OpProfile
from pipeserve.runner.chunk_profiler import profile_prefill
from pipeserve.runner.cuda_graph import (
    DecodeGraphs,
    bucket_for,
    graph_blocker,
    graph_buckets,
    graph_reserve_bytes,
    graphable,
)
from pipeserve.runner.forward_batch import ForwardBatch
from pipeserve.runner.kv_layout import build_kv_pool, stage_kv_bytes_per_token
from pipeserve.runner.stage_output import PendingResult, SampledTensors, StageOutput
from pipeserve.scheduler.batch import Run, ScheduledBatch
from pipeserve.streams import DeviceStreams
from pipeserve.timeline import Recorder

log = logging.getLogger(__name__)


def kv_pool_pages(
    config: EngineConfig, arch: ArchConfig, local_workers: int, partition: list[int] | None = None
) -> int:
    """KV pool size in pages: from --max-total-tokens, or this worker's memory budget
    (`device.memory_budget`: its own GPU, or its share of RAM) left after its weights, sized
    for the stage with most layers. Workers agree on the smallest (worker.py)."""
    page = config.cache.page_size
    if config.cache.max_total_tokens is not None:
        return config.cache.max_total_tokens // page + 1
    device = resolve_device(config.model.device)
    dtype = resolve_dtype(config.model.dtype, arch.torch_dtype, config.model.device)
    p = config.parallel
    budget = memory_budget(device, config.cache.mem_fraction_static, local_workers)
    if partition is None:  # an explicit list in the config, else the default rule
        spec = p.layer_partition if p.layer_partition not in (None, "auto") else None
        partition = resolve_partition(spec, arch.num_layers, p.pp_size)
    stage_layers_max = max(partition)
    elsewhere = 1.0 if p.afd_enabled else 1 - 1 / p.expert_ranks  # experts on other ranks
    params = param_count(arch) - routed_expert_params(arch) * elsewhere
    weights = params * dtype.itemsize * stage_layers_max / arch.num_layers / p.tp_size
    per_token = stage_kv_bytes_per_token(config, arch, partition)
    backend = select_backend(
        config.model.attention_backend, device, dtype, arch.head_dim, p.world_size
    )
    graphs = graph_reserve_bytes(config, arch, device, dtype, backend)
    tokens = int((budget - weights - graphs) // per_token)
    if tokens < 4 * page:
        raise ValueError(
            f"no memory left for the KV cache ({budget / 2**30:.1f} GiB budget, "
            f"{weights / 2**30:.1f} GiB of weights); raise --mem-fraction-static or set "
            "--max-total-tokens"
        )
    return tokens // page + 1


class ModelRunner:
    def __init__(
        self, config: EngineConfig, arch: ArchConfig, model_path: str | Path, num_pages: int
    ) -> None:
        self.config, self.arch = config, arch
        self.device = resolve_device(config.model.device)
        self.dtype = resolve_dtype(config.model.dtype, arch.torch_dtype, config.model.device)
        self.state = get_parallel_state()
        set_single_batch_overlap(SingleBatchOverlap.from_config(config.parallel))
        with keeping_fp8_weights(fp8_kept(config, arch)):
            self.model = build_model(arch, self.dtype, self.device)
        load_weights(self.model, model_path)
        self.model.eval()
        c = config.cache
        page = c.page_size
        self.kv_pool = build_kv_pool(
            arch,
            num_pages * page,
            stage_layers(arch.num_layers),
            self.state.tp_size,
            self.dtype,
            self.device,
            page,
        )
        self.sampler = Sampler(config.model.seed, self.device)
        self.streams = DeviceStreams(self.device)
        self.recorder = Recorder(self.state.pp_rank, self.state.stage_rank, comm=True)
        # in layer order: under data-parallel attention a rank without tokens in a step
        # still joins these layers' expert dispatch and combine
        self.expert_layers = [m for m in self.model.modules() if isinstance(m, FusedMoE)]
        deterministic = config.model.enable_deterministic_inference
        if deterministic and arch.mla is not None:
            raise ValueError(
                "--enable-deterministic-inference is not available for multi-head latent "
                f"attention ({arch.architecture}): its batch-invariant kernels are GQA's"
            )
        self.backend = select_backend(
            config.model.attention_backend,
            self.device,
            self.dtype,
            arch.head_dim,
            config.parallel.world_size,
            deterministic,
        )
        log.info("attention backend: %s", self.backend.name)
        batch_invariant.set_enabled(False)  # not left on by an earlier runner in this process
        if deterministic:
            self._init_deterministic()
        self.cp = self._context_parallel() if self.state.cp_size > 1 else None
        # all held: the parameters, and the block scales of weights kept in fp8
        self.param_bytes = sum(p.nbytes for p in self.model.parameters()) + sum(
            b.nbytes for name, b in self.model.named_buffers() if name.endswith("scale_inv")
        )
        sharded = config.parallel.shard_linear_layers and self.state.cp_size > 1
        self.shards = self._shard_linear() if sharded else None
        self.model.layer_hooks = [self.shards] if self.shards is not None else []
        name = f"s{self.state.pp_rank}r{self.state.stage_rank}"
        self.op_profile = OpProfile.from_env(name, self.device)
        self.tiers = self._tier_store(num_pages, name) if c.enable_hierarchical_cache else None
        self._init_disaggregation()
        synchronize(self.device)  # weights and pool set-up ran on this thread's stream
        self.graphs = self._decode_graphs()

    def _init_disaggregation(self) -> None:
        """Prefill/decode disaggregation: a prefill worker sends each layer's new KV from the
        model's layer hook; a decode worker receives KV into its pool."""
        d, state, a = self.config.disaggregation, self.state, self.arch
        self.kv_sender: KVSender | None = None
        self.kv_receiver: KVReceiver | None = None
        if d.disaggregation_mode == "null":
            return
        partition = list(state.partition) or [a.num_layers]
        layout = SideLayout.of(partition, state.tp_size, a.num_kv_heads, a.mla is not None)
        me = (state.pp_rank, state.tp_rank)
        key = auth.pd_key(d.pd_auth_key)
        if d.disaggregation_mode == "prefill":
            layers = stage_layers(a.num_layers)
            timeout = d.disaggregation_transfer_timeout
            striping = self.cp.striping if self.cp is not None else None
            self.kv_sender = KVSender(self.kv_pool, layout, me, layers, timeout, striping, key)
            self.model.layer_hooks.append(self.kv_sender)  # after shard linear's, if any
        else:
            # the engine process is on node 0: other nodes' control listeners need tcp
            remote = self.config.parallel.node_rank != 0
            self.kv_receiver = KVReceiver(
                self.kv_pool, layout, me, d.disaggregation_host, key, remote
            )

    def _decode_graphs(self) -> DecodeGraphs | None:
        """Decode steps' CUDA graphs, captured now (after the Triton kernels' first runs, before
        any timed probe); None, with the reason logged, where steps stay eager."""
        blocker = graph_blocker(self.config, self.arch, self.device, self.backend)
        if blocker is not None:
            log.debug("decode steps run eagerly: %s", blocker)
            return None
        graphs = DecodeGraphs(
            lambda fb: self.model(fb)[0],
            self.kv_pool,
            self.backend,
            graph_buckets(self.config.model.cuda_graph_max_bs),
            self.device,
        )
        try:
            with torch.inference_mode():
                graphs.capture()
        except Exception as exc:  # a model whose forward cannot be captured: eager, said
            log.warning("CUDA graph capture failed (%s); decode steps run eagerly", exc)
            graphs.release()
            return None
        log.info("decode steps up to %d requests replay CUDA graphs", max(graphs.buckets))
        return graphs

    def _tier_store(self, num_pages: int, name: str) -> TierStore:
        """HiCache's host (and disk) copies of this worker's part of the KV pool."""
        c = self.config.cache
        partition = list(self.state.partition) or [self.arch.num_layers]
        host, disk = tier_pages(
            c, num_pages, stage_kv_bytes_per_token(self.config, self.arch, partition)
        )
        return TierStore(self.kv_pool, c.page_size, host, disk, c.hicache_storage_dir, name)

    def _shard_linear(self) -> LayerShards:
        """Shard linear over the CP group (see pipeserve/context_parallel/layer_shards)."""
        p, state = self.config.parallel, self.state
        names = [n.strip() for n in p.shard_linear_layers.split(",") if n.strip()]
        layers = [self.model.model.layers[i] for i in stage_layers(self.arch.num_layers)]
        return LayerShards(
            self.model,
            layers,
            names,
            p.shard_linear_warm_layers,
            state.cp_rank,
            state.cp_weights_group,
            list(state.cp_ranks),
        )

    def weight_bytes(self) -> tuple[int, int]:
        """(the most weight bytes this rank held at any point since loading, what shard
        linear's plan expects of it; without shard linear both are every parameter's)."""
        if self.shards is not None:
            return self.shards.peak_bytes, self.shards.expected_peak_bytes
        return self.param_bytes, self.param_bytes

    def _context_parallel(self) -> CpContext:
        """This rank's context-parallel share of every batch (see pipeserve/context_parallel)."""
        a, state = self.arch, self.state
        if self.config.model.enable_deterministic_inference:
            raise ValueError(
                "--enable-deterministic-inference with --cp-size: context parallelism merges "
                "partial attention results, which the batch-invariant kernels do not cover"
            )
        return CpContext(
            state.cp_size,
            state.cp_rank,
            state.cp_group,
            PageStriping(state.cp_size, state.cp_rank, self.config.cache.page_size),
            self.config.parallel.cp_prefix_mode,
            a.num_heads,
            a.num_kv_heads,
            a.head_dim,
            self.dtype.itemsize,
            native_prefill=self.backend.prefill_kernel(self.dtype) is not None,
            overlap=not self.config.parallel.disable_cp_kv_overlap,
            latent=a.mla is not None,
            ring=self.config.parallel.cp_kv_exchange == "ring" and a.mla is None,
            ranks=state.cp_ranks,
        )

    def _init_deterministic(self) -> None:
        """Batch-invariant execution (see pipeserve/layers/batch_invariant.py): the native
        attention kernels for every step (the backend), and a checked matrix product."""
        batch_invariant.set_enabled(True)
        batch_invariant.check_linear_rows(
            w for p in self.model.parameters() for w in (p if p.dim() == 3 else [p])
        )

    def prepare(self, batch: ScheduledBatch, whole: bool = True) -> ForwardBatch:
        """The batch's tensors, built on the host and copied on the copy stream (a device);
        `execute` makes the compute stream wait for them. A whole step that replays a CUDA
        graph is padded to its bucket (`whole`=False: a part of a step, never padded)."""
        pad_to = None
        if whole and self.graphs is not None and graphable(batch, self.graphs.buckets[-1]):
            pad_to = bucket_for(len(batch.slices), self.graphs.buckets)
            if pad_to is not None and not self.graphs.holds(batch, pad_to):
                pad_to = None  # a page table past the persistent one's size: eager
        with self.streams.upload() as up:
            move = up.move if self.streams.api is not None else None
            fb = ForwardBatch.prepare(
                batch, self.kv_pool, self.device, self.backend, self.cp, move, pad_to
            )
        fb.ready, fb.uploaded = up.ready, up.tensors
        return fb

    @torch.inference_mode()
    def execute(
        self,
        batch: ScheduledBatch,
        fb: ForwardBatch,
        hidden: torch.Tensor | None = None,
        residual: torch.Tensor | None = None,
        future: FutureMap | None = None,
    ) -> StageOutput:
        """Run this stage's layers on a prepared batch (on the compute stream). With a future
        map, placeholder input ids are resolved first and sampled tokens stored after."""
        if self.op_profile is None:
            return self._execute(batch, fb, hidden, residual, future)
        with self.op_profile.step():
            return self._execute(batch, fb, hidden, residual, future)

    def _execute(
        self,
        batch: ScheduledBatch,
        fb: ForwardBatch,
        hidden: torch.Tensor | None,
        residual: torch.Tensor | None,
        future: FutureMap | None,
    ) -> StageOutput:
        self.streams.wait(fb.ready, fb.uploaded)  # the compute stream, after the inputs' copy
        timer = self.streams.timer()
        if batch.cache_ops:
            if self.tiers is None:
                raise ValueError("a batch carries cache-tier copies but HiCache is off here")
            self.tiers.run(batch.cache_ops)
        if future is not None and self.state.is_first_stage:
            fb.input_ids = future.resolve(fb.input_ids)
        set_step_blocks(batch.combine_blocks)
        if self.kv_sender is not None:
            self.kv_sender.begin(batch)  # what the layer hook sends of this batch
        keep = [fb]
        if batch.two_batch is not None:
            hidden, residual = self._forward_two_batch(batch, hidden, residual, future, keep)
        elif batch.micro_batches:
            parts = split_micro_batches(batch)  # attention-FFN disaggregation
            hidden, residual = self._forward_parts(
                parts, AFD_ATTENTION, hidden, residual, future, keep
            )
        elif fb.graphed:
            assert self.graphs is not None
            hidden, residual = self.graphs.run(fb), None
        elif batch.slices:
            hidden, residual = self.model(fb, hidden, residual)
            if fb.cp is not None and self.state.is_last_stage:
                hidden = fb.cp.gather_hidden(hidden)  # the batch's rows, in batch order
        else:
            hidden, residual = self._idle_forward()
        pending = PendingResult(batch, timer, self.recorder, self.weight_bytes(), keep)
        if self.state.is_last_stage:
            pending.sampled = self._sample(batch, fb, hidden)
            if future is not None:
                future.store(fb.future_slots, pending.sampled.ids)
            pending.host = self.streams.to_host(pending.sampled.flat())
        timer.stop()
        out = StageOutput(hidden, residual, pending=pending)
        if self.streams.api is None:
            out.wait()  # a CPU has finished: record the time where it ends
        return out

    def close(self) -> None:
        """Write the per-operation profile, when one was asked for; give HiCache's disk
        space back."""
        if self.op_profile is not None:
            self.op_profile.write()
        if self.tiers is not None:
            self.tiers.close()
        if self.kv_sender is not None:
            self.kv_sender.close()
        if self.kv_receiver is not None:
            self.kv_receiver.close()
        if self.graphs is not None:
            self.graphs.release()

    def _forward_two_batch(
        self,
        batch: ScheduledBatch,
        hidden: torch.Tensor | None,
        residual: torch.Tensor | None,
        future: FutureMap | None,
        keep: list[ForwardBatch],
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The batch as micro-batches A and B whose layers interleave (two-batch overlap)."""
        assert batch.two_batch is not None
        strategy = DECODE if batch.two_batch.decode else PREFILL
        return self._forward_parts(split_batch(batch), strategy, hidden, residual, future, keep)

    def _forward_parts(
        self,
        parts: Sequence[ScheduledBatch],
        strategy: Strategy,
        hidden: torch.Tensor | None,
        residual: torch.Tensor | None,
        future: FutureMap | None,
        keep: list[ForwardBatch],
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The batch's parts (micro-batches, some may be empty) run with their layers
        interleaved under `strategy`; the rows come back in the batch's order. Their inputs
        join `keep`."""
        fbs = [self.prepare(p, whole=False) for p in parts]
        for fb in fbs:
            self.streams.wait(fb.ready, fb.uploaded)
        keep += fbs
        if future is not None and self.state.is_first_stage:
            for fb in fbs:
                fb.input_ids = future.resolve(fb.input_ids)
        sizes = [p.num_tokens for p in parts]
        hiddens = [None] * len(parts) if hidden is None else hidden.split(sizes)
        residuals = [None] * len(parts) if residual is None else residual.split(sizes)
        inputs = list(zip(hiddens, residuals, strict=True))
        outs = self.model.forward_interleaved(fbs, inputs, strategy)
        rest = [r for _, r in outs]
        both = None if any(r is None for r in rest) else torch.cat(rest)  # type: ignore[arg-type]
        return torch.cat([h for h, _ in outs]), both

    def expert_bytes(self) -> int:
        """Bytes of the routed experts' weights this rank holds."""
        return sum(p.nbytes for m in self.expert_layers for p in m.parameters())

    def _idle_forward(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        """This rank has no tokens this step (data-parallel attention, another rank has): it
        runs no attention, only its experts for the tokens the other ranks send it, in the
        same layer order as they. Hands on zero rows."""
        for moe in self.expert_layers:
            moe.join_idle()
        empty = torch.empty(0, self.arch.hidden_size, dtype=self.dtype, device=self.device)
        return empty, None if self.state.is_last_stage else torch.empty_like(empty)

    def profile_prefill(self, points: list[tuple[int, int]], runs: list[Run]) -> list[float]:
        """Seconds of one prompt chunk per (prefix_len, chunk_len) point on this stage's
        layers (runner/chunk_profiler.py)."""
        return profile_prefill(self, points, runs)

    def forward(
        self,
        batch: ScheduledBatch,
        hidden: torch.Tensor | None = None,
        residual: torch.Tensor | None = None,
    ) -> StageOutput:
        return self.execute(batch, self.prepare(batch), hidden, residual)

    def _sample(
        self, batch: ScheduledBatch, fb: ForwardBatch, hidden: torch.Tensor
    ) -> SampledTensors:
        """Sampled tokens and the logprobs asked for, left on the device (no host sync)."""
        self.sampler.release(batch.released)
        samples = [s for s in batch.slices if s.sample]
        logits_of = self.model.compute_logits
        prompt = prompt_logprobs(logits_of, hidden, fb.logprob_rows, fb.logprob_targets)
        if not samples:
            ids = torch.empty(0, dtype=torch.long, device=self.device)
            return SampledTensors(ids, None, None, prompt)
        logits = logits_of(hidden[fb.sample_rows])
        params = [s.sampling for s in samples]
        ids = self.sampler.sample(logits, params, [s.rid for s in samples])  # type: ignore[arg-type]
        wanted = any(s.return_logprob for s in samples)
        top_k = max(s.top_logprobs for s in samples)
        chosen, top = output_logprobs(logits, ids, wanted, top_k)
        return SampledTensors(ids, chosen, top, prompt)
