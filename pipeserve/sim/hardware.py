"""The devices the simulator knows, as data: peak FLOP/s per dtype, memory bandwidth and size,
links inside and between nodes, devices per node, and how efficiently each operator class
reaches the peak.

Figures are vendors' dense (no sparsity) numbers. A link's `bandwidth` is what one device
can send in one direction; `latency` is one message's fixed cost. The efficiencies are the
model's free parameters: `--calibrate` fits them on this machine's CPU, and the GPU ones
come from the published points (sim/calibrate.py); the defaults below are neutral starting
points, not measurements.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from pipeserve import envs

GB = 1e9
GIB = 2**30  # device memory sizes: an "80 GB" H100 holds 80 GiB
TFLOPS = 1e12


@dataclass(frozen=True)
class Link:
    bandwidth: float  # bytes/s one device sends in one direction
    latency: float  # seconds per message (or per step of a ring)
    efficiency: float = 0.8  # share of `bandwidth` a large transfer reaches


@dataclass(frozen=True)
class Efficiency:
    """Share of the peak an operator class reaches, and fixed costs. Calibrated values."""

    gemm: float = 0.6  # projections, dense MLPs, shared experts, router, LM head
    moe: float = 0.5  # routed experts (grouped GEMM)
    attention: float = 0.5  # the attention kernel (scores and weighted values)
    memory: float = 0.8  # share of the memory bandwidth a streaming read reaches
    layer_overhead_s: float = 0.0  # per decoder layer per forward (launches, norms, rotary)
    forward_overhead_s: float = 0.0  # per forward (preparing inputs, sampling)


@dataclass(frozen=True)
class Hardware:
    name: str
    kind: str  # "gpu" | "cpu"
    peak_flops: dict[str, float]  # per dtype ("fp8", "bfloat16", "float16", "float32")
    memory_bandwidth: float  # bytes/s
    memory_bytes: float
    intra_node: Link
    inter_node: Link
    devices_per_node: int
    efficiency: Efficiency = field(default_factory=Efficiency)
    # scheduler work per batch on the host (schedule + process), seconds
    host_overhead_s: float = 0.002
    # CPU only: the figures above are per core; a device (worker process) has some threads,
    # and efficiencies fitted per thread count (solo, and with every core busy) replace the
    # one above
    per_core: bool = False
    cores_per_node: int = 0
    thread_efficiency: dict[str, Efficiency] = field(default_factory=dict)
    source: str = ""  # where the figures come from
    calibration: str = ""  # the calibration applied (a file, or what was fitted)
    # what the engine computes in here when the run names no dtype (a CPU calibration's:
    # `--dtype best` on the machine measured); None: the checkpoint's weights decide
    compute_dtype: str | None = None

    def peak(self, dtype: str, threads: int = 1) -> float:
        if dtype not in self.peak_flops:
            known = ", ".join(self.peak_flops)
            raise ValueError(f"{self.name} has no peak for dtype {dtype!r} (known: {known})")
        return self.peak_flops[dtype] * (threads if self.per_core else 1)

    def bandwidth(self, threads: int = 1) -> float:
        return self.memory_bandwidth * (threads if self.per_core else 1)

    def efficiency_for(self, threads: int, shared: bool) -> Efficiency:
        """The calibrated efficiency of a device with `threads` threads (CPU: alone on the
        machine, or with every core busy when `shared`), else the hardware's one."""
        key = efficiency_key(threads, shared)
        if key in self.thread_efficiency:
            return self.thread_efficiency[key]
        solo = self.thread_efficiency.get(efficiency_key(threads, False))
        return solo or self.efficiency

    def with_efficiency(self, eff: Efficiency) -> Hardware:
        return replace(self, efficiency=eff)


def efficiency_key(threads: int, shared: bool) -> str:
    return f"{threads}t" + ("-shared" if shared else "")


def _nvlink(gb_s: float) -> Link:
    return Link(gb_s * GB, 3e-6, 0.8)


def _rdma(gbit_s: float) -> Link:
    return Link(gbit_s / 8 * GB, 8e-6, 0.85)


HARDWARE: dict[str, Hardware] = {
    "h20": Hardware(
        "h20",
        "gpu",
        {
            "fp8": 296 * TFLOPS,
            "bfloat16": 148 * TFLOPS,
            "float16": 148 * TFLOPS,
            "float32": 44 * TFLOPS,
        },
        4.0e12,
        96 * GIB,
        _nvlink(450),  # NVLink 900 GB/s both directions
        _rdma(400),
        8,
        # fitted on the two published points of spec 06 and nothing else (`pipeserve
        # simulate --calibrate --hardware h20`; tests/sim/test_calibrate.py refits them)
        Efficiency(gemm=0.923, moe=0.923, attention=0.902),
        source="NVIDIA H20 (Hopper, 96 GB HBM3); spec/06",
        calibration="published points (spec 06): DeepSeek-V3.1 PP1 TP8, Qwen3-235B PP1 TP4",
    ),
    "h100": Hardware(
        "h100",
        "gpu",
        {
            "fp8": 1979 * TFLOPS,
            "bfloat16": 989 * TFLOPS,
            "float16": 989 * TFLOPS,
            "float32": 67 * TFLOPS,
        },
        3.35e12,
        80 * GIB,
        _nvlink(450),
        _rdma(400),
        8,
        source="NVIDIA H100 SXM5 80 GB datasheet, dense",
    ),
    "h200": Hardware(
        "h200",
        "gpu",
        {
            "fp8": 1979 * TFLOPS,
            "bfloat16": 989 * TFLOPS,
            "float16": 989 * TFLOPS,
            "float32": 67 * TFLOPS,
        },
        4.8e12,
        140 * GIB,
        _nvlink(450),
        _rdma(400),
        8,
        source="NVIDIA H200 SXM 141 GB datasheet, dense",
    ),
    "b200": Hardware(
        "b200",
        "gpu",
        {
            "fp8": 4500 * TFLOPS,
            "bfloat16": 2250 * TFLOPS,
            "float16": 2250 * TFLOPS,
            "float32": 75 * TFLOPS,
        },
        8.0e12,
        179 * GIB,
        _nvlink(900),  # NVLink 5: 1.8 TB/s both directions
        _rdma(400),
        8,
        source="NVIDIA HGX B200 datasheet (per GPU), dense",
    ),
    # This machine kind: a "device" is a worker process with its own threads; figures per
    # core. Links: gloo over loopback inside the machine, the emulated 1 Gbit/s veth pair
    # (benchmarks/netlab.sh) between two "nodes".
    "cpu": Hardware(
        "cpu",
        "cpu",
        {"bfloat16": 390e9, "float16": 100e9, "float32": 150e9},
        10 * GB,
        24 * GIB,
        Link(2.5 * GB, 60e-6, 1.0),
        Link(1 / 8 * GB, 150e-6, 0.95),
        2,
        Efficiency(gemm=0.5, moe=0.3, attention=0.2, memory=0.8),
        host_overhead_s=0.001,
        per_core=True,
        cores_per_node=2,
        source="development machine: AVX512-BF16 cores; `pipeserve simulate --calibrate` "
        "fits the efficiencies",
    ),
}


def calibration_path(hardware: str = "cpu") -> Path:
    """Where `--calibrate` saves a hardware's calibration and `load_hardware` finds it."""
    return envs.cache_dir() / "sim" / f"{hardware}-calibration.json"


def load_hardware(name: str, calibration: str | Path | None = None) -> Hardware:
    """A table entry, with a calibration file's efficiencies when one is given (CPU: the one
    `--calibrate` saved on this machine is used when none is given; a GPU's saved fit only
    when named, the table holding the published-point fit)."""
    if name not in HARDWARE:
        raise ValueError(f"unknown hardware {name!r}; known: {', '.join(HARDWARE)}")
    hw = HARDWARE[name]
    path = Path(calibration) if calibration else None
    if path is None and hw.kind == "cpu" and calibration_path(name).is_file():
        path = calibration_path(name)  # this machine's, as --calibrate measured it
    if path is None:
        return hw
    return replace(apply_calibration(hw, json.loads(path.read_text())), calibration=str(path))


def apply_calibration(hw: Hardware, data: dict[str, Any]) -> Hardware:
    if data.get("hardware") not in (None, hw.name):
        raise ValueError(f"the calibration is for {data['hardware']!r}, not {hw.name!r}")
    eff = Efficiency(**data["efficiency"]) if "efficiency" in data else hw.efficiency
    per_threads = {k: Efficiency(**v) for k, v in data.get("thread_efficiency", {}).items()}
    intra = Link(**data["intra_node"]) if "intra_node" in data else hw.intra_node
    inter = Link(**data["inter_node"]) if "inter_node" in data else hw.inter_node
    return replace(
        hw,
        efficiency=eff,
        thread_efficiency=per_threads,
        peak_flops=hw.peak_flops | data.get("peak_flops", {}),
        intra_node=intra,
        inter_node=inter,
        compute_dtype=data.get("compute_dtype", hw.compute_dtype),
    )


def calibration_json(hw: Hardware, **extra: Any) -> dict[str, Any]:
    return {
        "hardware": hw.name,
        "peak_flops": hw.peak_flops,
        "efficiency": asdict(hw.efficiency),
        "thread_efficiency": {k: asdict(v) for k, v in hw.thread_efficiency.items()},
        "intra_node": asdict(hw.intra_node),
        "inter_node": asdict(hw.inter_node),
        "compute_dtype": hw.compute_dtype,
        **extra,
    }
