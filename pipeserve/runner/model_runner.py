"""Runs the model on scheduled batches: prepare tensors, forward this stage's layers, and on
the last stage compute logits, sample, and gather logprobs."""

from __future__ import annotations

import logging
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

import torch

from pipeserve.backends.base import AttentionBackend
from pipeserve.backends.registry import run_backend
from pipeserve.batch_overlap.single_batch import SingleBatchOverlap, overlapping
from pipeserve.batch_overlap.strategies import AFD_ATTENTION, DECODE, PREFILL, Strategy
from pipeserve.batch_overlap.two_batch import split_batch
from pipeserve.config import EngineConfig
from pipeserve.device import resolve_device, resolve_dtype, synchronize
from pipeserve.disaggregation.afd.micro_batches import split_micro_batches
from pipeserve.distributed.parallel_state import get_parallel_state, stage_layers
from pipeserve.engine.future_map import FutureMap
from pipeserve.layers import batch_invariant
from pipeserve.layers.block_quant import describe_blocks
from pipeserve.layers.linear import fp8_kept, keeping_fp8_weights, use_linear_kernels
from pipeserve.layers.moe import FusedMoE
from pipeserve.layers.sampler import Sampler, output_logprobs, prompt_logprobs
from pipeserve.model_loader import load_weights
from pipeserve.models.arch import ArchConfig
from pipeserve.models.registry import build_model
from pipeserve.op_profile import OpProfile
from pipeserve.runner import features
from pipeserve.runner.chunk_profiler import profile_prefill
from pipeserve.runner.cuda_graph import (
    DecodeGraphs,
    bucket_for,
    graph_blocker,
    graph_buckets,
    graphable,
)
from pipeserve.runner.forward_batch import ForwardBatch
from pipeserve.runner.kv_layout import build_kv_pool
from pipeserve.runner.stage_output import PendingResult, SampledTensors, StageOutput
from pipeserve.scheduler.batch import Run, ScheduledBatch
from pipeserve.streams import DeviceStreams
from pipeserve.timeline import Recorder

log = logging.getLogger(__name__)


class ModelRunner:
    def __init__(
        self,
        config: EngineConfig,
        arch: ArchConfig,
        model_path: str | Path,
        num_pages: int,
        backend: AttentionBackend | None = None,
    ) -> None:
        """`backend`: the run's attention backend (`registry.run_backend`, chosen here where
        None), handed in where the pool's size was computed for it."""
        self.config, self.arch = config, arch
        self.device = resolve_device(config.model.device)
        self.dtype = resolve_dtype(config.model.dtype, arch.torch_dtype, config.model.device)
        self.state = get_parallel_state()
        self.sbo = SingleBatchOverlap.from_config(config.parallel)
        with keeping_fp8_weights(fp8_kept(config, arch)):
            self.model = build_model(arch, self.dtype, self.device)
        load_weights(self.model, model_path)
        self.model.eval()
        page = config.cache.page_size
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
        self._init_backend(backend or run_backend(config, arch))
        # all held: the parameters, and the block scales of weights kept in fp8
        self.param_bytes = sum(p.nbytes for p in self.model.parameters()) + sum(
            b.nbytes for name, b in self.model.named_buffers() if name.endswith("scale_inv")
        )
        name = f"s{self.state.pp_rank}r{self.state.stage_rank}"
        self.op_profile = OpProfile.from_env(name, self.device)
        self._init_features(num_pages, name)
        synchronize(self.device)  # weights and pool set-up ran on this thread's stream
        self.graphs = self._decode_graphs()

    def _init_backend(self, backend: AttentionBackend) -> None:
        """The run's attention backend, and batch-invariant products in its forwards where
        deterministic inference is asked for."""
        self.backend = backend
        use_linear_kernels(self.model, backend.linears, self.config.model.gguf_weights == "keep")
        self.deterministic = self.config.model.enable_deterministic_inference
        log.info("attention backend: %s", backend.name)
        if (kept := describe_blocks(self.model.parameters())) is not None:
            log.info("%s; --gguf-weights dequantize holds the values", kept)
        if self.deterministic:
            batch_invariant.check_linear_rows(
                w for p in self.model.parameters() for w in (p if p.dim() == 3 else [p])
            )

    def _init_features(self, num_pages: int, name: str) -> None:
        """Context parallelism, shard linear, HiCache's tiers and PD's KV transfer, where
        asked for (runner/features.py); shard linear's and the KV sender's layer hooks run
        in that order."""
        config, arch, state = self.config, self.arch, self.state
        cp = state.cp_size > 1
        self.cp = (
            features.context_parallel(config, arch, state, self.dtype, self.backend) if cp else None
        )
        sharded = cp and bool(config.parallel.shard_linear_layers)
        self.shards = features.shard_linear(config, arch, state, self.model) if sharded else None
        self.tiers = None
        if config.cache.enable_hierarchical_cache:
            self.tiers = features.tier_store(config, arch, state, self.kv_pool, num_pages, name)
        self.kv_sender, self.kv_receiver = features.kv_transfer(
            config, arch, state, self.kv_pool, self.cp
        )
        hooks = [self.shards, self.kv_sender]
        self.model.layer_hooks = [h for h in hooks if h is not None]

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
            self.config.cache.page_size,
        )
        try:
            with torch.inference_mode(), self.modes():
                graphs.capture()
        except Exception as exc:  # a model whose forward cannot be captured: eager, said
            log.warning("CUDA graph capture failed (%s); decode steps run eagerly", exc)
            graphs.release()
            return None
        log.info("decode steps up to %d requests replay CUDA graphs", max(graphs.buckets))
        return graphs

    def weight_bytes(self) -> tuple[int, int]:
        """(the most weight bytes this rank held at any point since loading, what shard
        linear's plan expects of it; without shard linear both are every parameter's)."""
        if self.shards is not None:
            return self.shards.peak_bytes, self.shards.expected_peak_bytes
        return self.param_bytes, self.param_bytes

    def prepare(self, batch: ScheduledBatch, whole: bool = True) -> ForwardBatch:
        """The batch's tensors, built on the host and copied on the copy stream (a device);
        `execute` makes the compute stream wait for them. A whole step that replays a CUDA
        graph is padded to its bucket and left on the host: `execute` copies it into the
        graph's buffers (`whole`=False: a part of a step, never padded)."""
        graphs = self.graphs
        if whole and graphs is not None and graphable(batch, graphs.buckets[-1]):
            pad_to = bucket_for(len(batch.slices), graphs.buckets)
            if pad_to is not None:
                if graphs.holds(batch, pad_to):  # else past its page table
                    fb = ForwardBatch.build(
                        batch, self.kv_pool, self.device, self.backend, None, True, pad_to
                    )
                    if graphs.fits(fb):
                        return fb  # on the host: `execute` copies it into the graph's buffers
                graphs.overflowed(len(batch.slices))
        with self.streams.upload() as up:
            move = up.move if self.streams.api is not None else None
            fb = ForwardBatch.prepare(batch, self.kv_pool, self.device, self.backend, self.cp, move)
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
        with self.modes(batch.combine_blocks):
            if self.op_profile is None:
                return self._execute(batch, fb, hidden, residual, future)
            with self.op_profile.step():
                return self._execute(batch, fb, hidden, residual, future)

    @contextmanager
    def modes(self, combine_blocks: int = 1) -> Iterator[None]:
        """This runner's modes for a forward run inside (on this thread only): batch-invariant
        products (pipeserve/layers/batch_invariant.py), single-batch overlap and the step's
        combine-down blocks."""
        with batch_invariant.enabled_in(self.deterministic), overlapping(self.sbo, combine_blocks):
            yield

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
        if fb.graphed:  # its copy: here, into the buffers the last step's graph has read
            assert self.graphs is not None
            fb = self.graphs.load(fb, self.streams)
        if batch.cache_ops:
            if self.tiers is None:
                raise ValueError("a batch carries cache-tier copies but HiCache is off here")
            self.tiers.run(batch.cache_ops)
        if future is not None and self.state.is_first_stage:
            fb.input_ids = future.resolve(fb.input_ids, in_place=fb.graphed)
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
