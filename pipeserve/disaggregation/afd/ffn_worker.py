"""The FFN worker of attention-FFN disaggregation: it holds its block of every MoE layer's
routed experts and nothing else (no attention, no KV cache, no requests). Each step the
scheduler sends it an empty batch; it then serves every MoE layer in order: every attention
worker's row count, then their rows, its experts on all of them, one partial sum back per
row."""

from __future__ import annotations

import queue
import threading
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.distributed import Work

from pipeserve.batch_overlap.operations import (
    OpFn,
    Outputs,
    State,
    arrange,
    execute,
    split_stages,
)
from pipeserve.batch_overlap.strategies import AFD_FFN_DELAY, AFD_FFN_LAYER
from pipeserve.config import EngineConfig
from pipeserve.device import resolve_device, resolve_dtype, synchronize
from pipeserve.disaggregation.afd.transport import receive_rows, send_partials
from pipeserve.disaggregation.afd.two_stage import TwoStage
from pipeserve.distributed.parallel_state import (
    AfdState,
    get_afd,
    get_expert_placement,
    get_parallel_state,
)
from pipeserve.layers.linear import fp8_kept, keeping_fp8_weights
from pipeserve.layers.moe import FusedMoE, expert_checkpoint_names, held_experts
from pipeserve.model_loader import load_weights
from pipeserve.models.arch import ArchConfig
from pipeserve.moe.dispatcher.all_to_all import RowLayout
from pipeserve.runner.stage_output import StageOutput
from pipeserve.scheduler.batch import ScheduledBatch
from pipeserve.timeline import Recorder, now, record_comm


class _Layer(nn.Module):
    """Named like a decoder layer's MoE block, so checkpoint names line up."""

    def __init__(self, experts: FusedMoE) -> None:
        super().__init__()
        self.mlp = nn.Module()
        self.mlp.experts = experts


class FfnModel(nn.Module):
    """Every MoE layer's routed experts held here (`model.layers.<i>.mlp.experts`)."""

    def __init__(self, arch: ArchConfig, dtype: torch.dtype) -> None:
        super().__init__()
        if arch.num_experts == 0:
            raise ValueError(
                "attention-FFN disaggregation needs a mixture-of-experts model; this one has "
                "no routed experts"
            )
        self.arch = arch
        # in layer order: the order the attention workers dispatch in
        self.moe_layers = [
            self._experts(arch, dtype, i) for i in range(arch.num_layers) if arch.is_moe_layer(i)
        ]
        self.model = nn.Module()
        self.model.layers = nn.ModuleDict({str(m.layer_id): _Layer(m) for m in self.moe_layers})

    @staticmethod
    def _experts(arch: ArchConfig, dtype: torch.dtype, layer: int) -> FusedMoE:
        return FusedMoE(
            arch.num_experts,
            arch.num_experts_per_tok,
            arch.hidden_size,
            arch.moe_intermediate_size,
            dtype,
            layer,
        )

    def checkpoint_names(self, param_name: str) -> list[tuple[str, object]]:
        n = self.arch.num_experts
        names = expert_checkpoint_names(param_name, n, held_experts(n))
        if names is None:
            raise ValueError(f"an FFN worker holds routed experts only, not {param_name}")
        return names


class FfnRunner:
    """What a stage worker runs on an FFN worker: the model runner's interface, serving each
    step's MoE layers for the attention workers."""

    def __init__(self, config: EngineConfig, arch: ArchConfig, model_path: str | Path) -> None:
        afd = get_afd()
        assert afd is not None and not afd.is_attention, "an FFN runner runs on an FFN worker"
        self.afd: AfdState = afd
        self.arch = arch
        self.device = resolve_device(config.model.device)
        self.dtype = resolve_dtype(config.model.dtype, arch.torch_dtype, config.model.device)
        self.state = get_parallel_state()
        with torch.device(self.device), keeping_fp8_weights(fp8_kept(config, arch)):
            self.model = FfnModel(arch, self.dtype)
        load_weights(self.model, model_path)
        self.model.eval()
        self.slots = 1 if afd.dispatch_mode == "direct" else arch.num_experts_per_tok
        self.layout = RowLayout(self.slots, arch.hidden_size, self.dtype)
        self.two_stage = None
        if afd.dispatch_mode == "two-stage":
            placement = get_expert_placement(arch.num_experts)
            self.two_stage = TwoStage(afd, placement, self.layout, self.device)
        self.recorder = Recorder(self.state.pp_rank, self.state.stage_rank, comm=True)

    def prepare(self, batch: ScheduledBatch) -> None:
        return None

    @torch.inference_mode()
    def execute(
        self,
        batch: ScheduledBatch,
        fb: object = None,
        hidden: torch.Tensor | None = None,
        residual: torch.Tensor | None = None,
        future: object = None,
    ) -> StageOutput:
        """One step: every MoE layer in order, each for the step's micro-batches in order,
        for every attention worker (the order they dispatch in). A thread receives the rows
        (counts first, then the rows) in that order while this one runs the experts on what
        has arrived and sends the partial sums back: the next micro-batch's rows travel
        while this one's experts compute."""
        start = now()
        layers, count = self.model.moe_layers, max(1, len(batch.micro_batches))
        arrived: queue.Queue[Any] = queue.Queue()
        receiver = threading.Thread(
            target=self._receive, args=(len(layers) * count, arrived), daemon=True
        )
        receiver.start()
        pending: list[Work] = []
        items = arrange({"delay": _nothing}, AFD_FFN_DELAY)
        for moe in layers:
            ops = self._operations(moe, arrived, pending)
            items += arrange(ops, AFD_FFN_LAYER)
        states = [State() for _ in range(count)]
        execute(split_stages(items), states, [{} for _ in range(count)], delta=0)
        receiver.join()
        for work in pending:
            work.wait()
        synchronize(self.device)
        end = now()
        batch.stage_times.append(end - start)
        self.recorder.add("forward", start, end, batch)
        empty = torch.empty(0, self.arch.hidden_size, dtype=self.dtype, device=self.device)
        return StageOutput(empty, None, None)

    def _operations(
        self, moe: FusedMoE, arrived: queue.Queue[Any], pending: list[Work]
    ) -> dict[str, OpFn]:
        """One MoE layer's operations for a micro-batch: its rows (as the receiver thread
        took them), the experts on them, the partial sums back."""

        def receive(state: State, **_: Any) -> Outputs:
            waited = now()
            got = arrived.get()
            if isinstance(got, BaseException):
                raise got
            record_comm("dispatch_wait", waited, moe.layer_id)
            return {"got": got}

        def experts(state: State, got: Any) -> Outputs:
            if self.two_stage is not None:
                partials, works = self.two_stage.serve(moe.run_local, got)
                pending.extend(works)
                return {"partials": partials, "counts": got.counts}
            packed, counts = got
            ids, weights, rows = self.layout.views(packed)
            return {"partials": moe.run_local(rows, weights, ids), "counts": counts}

        def send(state: State, partials: torch.Tensor, counts: list[int]) -> Outputs:
            launched = now()
            pending.extend(send_partials(self.afd, partials, counts))
            record_comm("combine_launch", launched, moe.layer_id, partials.nbytes, 0)
            return {}

        return {"receive": receive, "experts": experts, "send": send}

    def _receive(self, count: int, arrived: queue.Queue[Any]) -> None:
        """The receiver thread: each (layer, micro-batch)'s rows in order (two-stage: stage 1,
        forwarded inside the node source by source as they come)."""
        try:
            for _ in range(count):
                if self.two_stage is not None:
                    arrived.put(self.two_stage.receive())
                else:
                    arrived.put(receive_rows(self.afd, self.layout, self.device))
        except BaseException as exc:  # surfaces in the step
            arrived.put(exc)

    def profile_prefill(self, points: list[tuple[int, int]], runs: object) -> list[float]:
        """The attention workers time one forward per point: serve a step for each."""
        times = []
        for _ in points:
            batch = ScheduledBatch(-1, [])
            self.execute(batch)
            times.append(batch.stage_times[-1])
        self.recorder.take()
        return times

    def expert_bytes(self) -> int:
        return sum(p.nbytes for m in self.model.moe_layers for p in m.parameters())


def _nothing(state: State, **inputs: Any) -> None:
    """The delay stage: nothing to do while the attention workers run their first layers."""
    return None
