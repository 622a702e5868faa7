"""CUDA graphs for decode steps: a step's hundreds of kernel launches replayed as one.

A decode step of a batch is captured once per bucket of batch sizes (`graph_buckets`), at
start-up, over persistent buffers (`DecodeGraphs`). A step of n requests is padded to the
smallest bucket b >= n (`ForwardBatch.build(pad_to=b)`): each padded row reads and writes
one slot of page 0, which the page allocator never hands out (`PAD_SLOT`), so a padded row
never touches a page a request owns; its output row is never sampled.

A step's inputs are built on the host and reach its graph in one host-to-device copy, made
when the step runs, on the compute stream (the step before, queued there first, may still
read the buffers), into one persistent input buffer (`DecodeGraphs.inputs`). A padded step's
tensors are packed in a fixed order (`ForwardBatch.tensors`: ids, positions, write slots,
then the attention plan's), so those whose size the bucket fixes lie at the same place for
every step of that bucket, and its graph reads them there. The attention backend owns the
rest (`AttentionBackend.graph_buffers`): Triton's reads the rows and `kv_indptr` in place
and expands the step's slot runs into its persistent `kv_indices`. No copy from device to
device; no host sync. Then the bucket's graph replays the model's layers up to the last
hidden states; the LM head and sampling run after it, eagerly (per-request sampling
parameters change from step to step).

What is captured is a backend that says it can be (`capturable`: the Triton backend, chosen by
`--attention-backend triton` and by auto on CUDA where triton imports: its decode launch
reads the page table from device memory, its grid depends on the bucket only; MLA's absorbed
decode too, its latent rows written at the batch's write slots in one op) on one device: no
pipeline, tensor, context or expert parallelism, no prefill/decode transfer hooks, not
DeepSeek-V3.2's indexer (its per-request segments are host objects). A MoE layer is
captured where its experts run without host syncs (the grouped GEMM path); where the
capture fails, the step stays eager with a warning. Everything else runs as before, and
the reason is logged once (`graph_blocker`). Without a GPU the same buffers are run
eagerly (nothing captured): what the CPU tests check of the padding, the copy and the
bookkeeping.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import Any

import torch

from pipeserve.backends.base import AttentionBackend, AttentionPlan
from pipeserve.config import EngineConfig
from pipeserve.device import cuda_graphs_unavailable
from pipeserve.mem_cache.kv_pool import KVPool
from pipeserve.models.arch import ArchConfig
from pipeserve.runner.forward_batch import ForwardBatch
from pipeserve.scheduler.batch import ScheduledBatch
from pipeserve.streams import ALIGN, DeviceStreams, Upload, places, views

log = logging.getLogger(__name__)
WARMUP_RUNS = 2  # eager runs of a bucket before its capture (Triton compiles on the first)


def graph_buckets(max_bs: int) -> tuple[int, ...]:
    """Batch sizes with a graph: 1, 2, 4, 8, then every 8 up to 64, then every 32, and
    `max_bs` itself (a step pads by fewer than 8 rows up to 64 requests, 32 past that)."""
    if max_bs < 1:
        return ()
    sizes = [1, 2, 4, *range(8, 65, 8), *range(96, max_bs + 1, 32)]
    return tuple(sorted({s for s in sizes if s <= max_bs} | {max_bs}))


def bucket_for(n: int, buckets: Sequence[int]) -> int | None:
    """The smallest bucket holding n rows; None when n is past the largest."""
    return next((b for b in buckets if b >= n), None)


def graph_blocker(
    config: EngineConfig, arch: ArchConfig, device: torch.device, backend: AttentionBackend
) -> str | None:
    """Why decode steps stay eager on this engine (None: they are captured)."""
    m, p = config.model, config.parallel
    if m.disable_cuda_graph or m.cuda_graph_max_bs < 1:
        return "--disable-cuda-graph (or --cuda-graph-max-bs 0)"
    if (unavailable := cuda_graphs_unavailable(device)) is not None:
        return unavailable
    sizes = {"pipeline": p.pp_size, "tensor": p.tp_size, "context": p.cp_size}
    sizes |= {"expert": p.expert_ranks, "attention-FFN": 2 if p.afd_enabled else 1}
    spread = [f"{k} {v}" for k, v in sizes.items() if v > 1]
    if spread:
        return f"CUDA graphs run on one device only ({', '.join(spread)})"
    if not backend.capturable:
        return (
            f"the {backend.name} attention backend cannot be captured (--attention-backend "
            f"{m.attention_backend}; auto takes Triton's on one device where triton imports)"
        )
    if arch.indexer is not None:
        return "DeepSeek-V3.2's indexer keeps per-request host segments (not captured yet)"
    if config.disaggregation.disaggregation_mode != "null":
        return "prefill/decode disaggregation's transfer hooks run on the host"
    return None


def graphable(batch: ScheduledBatch, largest: int) -> bool:
    """Whether a step runs as a graph: decode steps only (one token each, sampled, no prompt
    logprobs), no cache-tier copies, no micro-batches, at most the largest bucket."""
    if not batch.slices or len(batch.slices) > largest:
        return False
    if batch.cache_ops or batch.two_batch is not None or batch.micro_batches:
        return False
    return all(s.num_tokens == 1 and s.sample and not s.logprob_targets for s in batch.slices)


# Bytes per KV slot the graphs' buffers may hold: a capturable backend's persistent page
# table (Triton's: two int32 a slot) and the input buffer's room for slot runs (4).
GRAPH_SLOT_BYTES = 12


def graph_reserve_bytes(
    config: EngineConfig,
    arch: ArchConfig,
    device: torch.device,
    dtype: torch.dtype,
    backend: AttentionBackend,
) -> int:
    """What the graphs' private memory pool may hold, kept out of the KV budget: the
    activations of the largest bucket (the buckets share the pool), generously, plus a
    fixed 64 MiB; 0 where no graph will be captured."""
    if graph_blocker(config, arch, device, backend) is not None:
        return 0
    intermediate = max(arch.intermediate_size, arch.moe_intermediate_size)
    per_row = 8 * arch.hidden_size + 3 * intermediate + 4 * arch.num_heads * arch.head_dim
    return config.model.cuda_graph_max_bs * per_row * dtype.itemsize + (64 << 20)


class DecodeGraphs:
    """The persistent buffers of decode steps and, on CUDA, a graph per bucket over them."""

    def __init__(
        self,
        forward: Callable[[ForwardBatch], torch.Tensor],
        pool: KVPool,
        backend: AttentionBackend,
        buckets: Sequence[int],
        device: torch.device,
        page_size: int = 1,
    ) -> None:
        """`forward(fb)`: the model's layers on a ForwardBatch, returning the last hidden
        states (one row per token); `backend`: a capturable one, whose buffers it owns."""
        self.forward, self.buckets, self.device = forward, tuple(buckets), device
        backend = backend.for_batch([])  # what a decode step runs on (a split hands it over)
        largest = max(self.buckets)
        self.attention = backend.graph_buffers(pool.num_slots, largest, device)
        # a bucket's padding step, built on the host as prepare() builds a step
        self.padding = {
            b: ForwardBatch.build(ScheduledBatch(0, []), pool, device, backend, None, True, b)
            for b in self.buckets
        }
        # the input buffer: the largest padding step, and room for a real step's slot runs
        # (16 bytes a run: 4 a slot at most; a run covers a page but at a row's ends, and
        # `holds` bounds the keys a step reads by twice the pool) and three more per-row
        # tensors (sampled rows, ring slots, MLA's length order: 8 bytes a row each). A step
        # with more runs (a fragmented pool) stays eager.
        max_runs = min(2 * pool.num_slots // page_size, pool.num_slots // 4) + 2 * largest
        _, padding_bytes = places(self.padding[largest].tensors())
        size = padding_bytes + 16 * max_runs + 24 * largest + 8 * ALIGN
        self.inputs = torch.zeros(size, dtype=torch.uint8, device=device)
        self.batches: dict[int, ForwardBatch] = {}
        for b, step in self.padding.items():
            staged = step.moved(lambda hosts: views(self.inputs, hosts))
            attn = AttentionPlan(backend, self.attention.meta(b, staged.attn.meta))
            self.batches[b] = replace(staged, attn=attn)
        self.graphs: dict[int, Any] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        self.replays = 0  # steps run as a graph (the eager runs over the buffers not counted)
        self.overflows = 0  # decode steps of a bucket's size run eagerly: past the buffers
        self._pool_handle: Any = None

    def holds(self, batch: ScheduledBatch, bucket: int) -> bool:
        """Whether the step, padded to `bucket` (a padded row reads one key), fits the
        backend's buffers."""
        keys = sum(s.prefix_len + s.num_tokens for s in batch.slices)
        return self.attention.holds(keys + bucket - len(batch.slices), bucket)

    def overflowed(self, requests: int) -> None:
        """A decode step that a bucket takes ran eagerly: it reads more keys or runs than
        the buffers hold. Counted, and said the first time."""
        self.overflows += 1
        if self.overflows == 1:
            log.info(
                "a decode step of %d requests reads more than the CUDA graphs' buffers hold "
                "and runs eagerly (said once; DecodeGraphs.overflows counts them)",
                requests,
            )

    def fits(self, fb: ForwardBatch) -> bool:
        """Whether a step built on the host (`ForwardBatch.build`) fits the input buffer."""
        return places(fb.tensors())[1] <= self.inputs.numel()

    def load(self, fb: ForwardBatch, streams: DeviceStreams | None = None) -> ForwardBatch:
        """A padded step built on the host (and `fits`) as its graph reads it: its tensors
        copied into the input buffer in one copy on the current stream (after the last
        step, which may still read the buffer), the attention backend's buffers loaded from
        there; no copy from device to device. Without `streams`: packed straight into the
        buffer (at capture)."""
        b = fb.num_tokens
        if streams is None:
            staged = fb.moved(lambda hosts: Upload(self.device, None).move(hosts, self.inputs))
        else:
            with streams.upload(here=True) as up:
                staged = fb.moved(lambda hosts: up.move(hosts, self.inputs))
        self.attention.load(staged.attn.meta, b)
        batch = self.batches[b]
        read = ("input_ids", "positions", "out_slots")
        if any(getattr(staged, n).data_ptr() != getattr(batch, n).data_ptr() for n in read):
            raise AssertionError("a step's inputs were not copied where its graph reads them")
        return replace(staged, attn=batch.attn)

    def capture(self) -> None:
        """A graph per bucket, largest first (they share one memory pool), each after
        WARMUP_RUNS eager runs over its padding step, so that the captures write nothing
        but PAD_SLOT."""
        self._pool_handle = torch.cuda.graph_pool_handle()
        stream = torch.cuda.Stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            for b in sorted(self.buckets, reverse=True):
                self.load(self.padding[b])
                for _ in range(WARMUP_RUNS):
                    self.forward(self.batches[b])
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=self._pool_handle, stream=stream):
                    self.outputs[b] = self.forward(self.batches[b])
                self.graphs[b] = graph
        torch.cuda.current_stream(self.device).wait_stream(stream)
        torch.cuda.empty_cache()  # the warm-up runs' blocks, cached for the capture stream

    def run(self, fb: ForwardBatch) -> torch.Tensor:
        """The last hidden states of a loaded step (`load`: fb.num_tokens is a bucket): the
        bucket's graph replayed (or, uncaptured, the layers run eagerly over the same
        buffers). The result is the graph's output buffer: valid until the next step."""
        b = fb.num_tokens
        if fb.input_ids.data_ptr() != self.batches[b].input_ids.data_ptr():
            raise AssertionError("run() a step that load() gave")
        graph = self.graphs.get(b)
        if graph is None:
            return self.forward(self.batches[b])
        graph.replay()
        self.replays += 1
        return self.outputs[b]

    def release(self) -> None:
        """Drop the graphs and their memory pool (the engine's shutdown empties the cache)."""
        self.graphs.clear()
        self.outputs.clear()
        self._pool_handle = None
