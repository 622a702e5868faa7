"""Engine configuration: one frozen dataclass per area, gathered into `EngineConfig`.

Every field is a user flag: the CLI flag `--foo-bar` and the `Engine(foo_bar=...)` keyword
are both derived from the field `foo_bar`, its default and its help text. Values that
follow from others are properties; nothing writes to a config after it is built.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from pipeserve import envs

DTYPES = ("best", "auto", "bfloat16", "float16", "float32")
DYNAMIC_CHUNKING_MODELS = ("prefix-quadratic", "quadratic")
HICACHE_WRITE_POLICIES = ("write_through", "write_back")
# built in, and those registered (pipeserve/backends/registry.py)
ATTENTION_BACKENDS = ["auto", "native", "torch", "flashinfer", "triton"]


class SettingsError(ValueError):
    """The settings do not fit this model or machine, found by a check before anything is
    served: its message says what to change. Commands print it in one line, without a
    traceback (PIPESERVE_TRACEBACK=1 prints it), and exit with 2."""


def is_refusal(exc: BaseException) -> bool:
    """Whether a failure while starting is a check refusing the settings: a SettingsError,
    or a plain ValueError (how the model, layer and layout checks say what to change), not a
    subclass such as a decoding error, which is a fault and keeps its traceback."""
    return isinstance(exc, SettingsError) or type(exc) is ValueError


def _flag(default: Any, help: str, **extra: Any) -> Any:
    return field(default=default, metadata={"help": help, **extra})


def _secret_flag(help: str) -> Any:
    """A secret's flag: None by default, kept out of printed configs."""
    return field(default=None, repr=False, metadata={"help": help})


AFD_DISPATCH_MODES = ("direct-rank", "direct", "two-stage")
FP8_WEIGHTS = ("dequantize", "keep")
GGUF_WEIGHTS = ("keep", "dequantize")
CP_PREFIX_MODES = ("auto", "merge", "regather")
CP_KV_EXCHANGES = ("all-gather", "ring")


@dataclass(frozen=True)
class ModelConfig:
    model_path: str | None = _flag(
        None,
        "Hugging Face checkpoint directory, a .gguf file (or a directory holding one), or the "
        "name of a built-in random-weight model (`pipeserve make-model --list`; made once, "
        "cached); default: SmolLM2-135M-Instruct (generate, serve; `smollm2` names it), "
        "`bench` (bench, tune)",
    )
    dtype: str = _flag(
        "best",
        "weight, activation and KV cache dtype. 'best': bfloat16 on GPUs and on CPUs with "
        "native bf16 products (AVX512-BF16, AMX), float32 on other CPUs (chosen once where the "
        "run starts, logged); 'auto': the checkpoint's",
        choices=DTYPES,
    )
    fp8_weights: str = _flag(
        "dequantize",
        "FP8 block-quantised checkpoints (DeepSeek-V3/V3.2, Qwen3 FP8): 'dequantize' (each "
        "weight dequantised to --dtype as it loads, on every device) or 'keep' (CUDA GPUs of "
        "compute capability 8.9 and up, with triton: the linears and the routed experts keep "
        "their fp8 values and 128x128 block scales, half bfloat16's bytes, and multiply by "
        "Triton kernels with activations quantised per 1x128 group; not yet measured on a "
        "GPU). Under 'keep' MLA's kv_b_proj and any layer whose TP slice starts inside a "
        "128-block are dequantised",
        choices=FP8_WEIGHTS,
    )
    gguf_weights: str = _flag(
        "keep",
        "GGUF checkpoints' Q4_1 and Q8_0 weights in a float32 run on a CPU with the native "
        "kernels: 'keep' (held in their blocks, a quarter of float32's bytes for Q4_1; "
        "decode steps multiply them by 8-bit integer products, x in two 8-bit parts) or "
        "'dequantize' (held as their values, as other types always are: float32 matrices, "
        "16-bit ones where every value of one is a float16 or bfloat16 number)",
        choices=GGUF_WEIGHTS,
    )
    context_length: int | None = _flag(
        None, "maximum tokens per request (prompt + output); default: the model's"
    )
    device: str = _flag("auto", "'cpu', 'cuda' or 'auto' (cuda when available)")
    attention_backend: str = _flag(
        "auto",
        "'auto': on a CPU the native kernels where they build; on CUDA the Triton kernels "
        "(decode steps replayed as CUDA graphs) where triton imports, except prompt chunks "
        "over 16K keys (prefix + chunk), which run on FlashInfer where it imports, else on "
        "torch's flash kernels (measured fastest on an H200), without triton FlashInfer or "
        "torch; 'native' (CPU); 'torch' (PyTorch's fused kernels, on CUDA a chunked fallback "
        "where they do not fit); 'flashinfer' (CUDA, float16/bfloat16; paged GQA attention, "
        "MLA stays on torch); 'triton' (CUDA: batched paged attention, one launch per layer "
        "for all decode steps and one for all prompt chunks, MLA's decode steps too; context "
        "parallelism stays on torch)",
        choices=ATTENTION_BACKENDS,
    )
    cuda_graph_max_bs: int = _flag(
        128,
        "the largest decode batch replayed as a CUDA graph (one per bucket of sizes up to it, "
        "captured at start-up; larger steps run eagerly). Graphs capture the Triton path "
        "(--attention-backend auto or triton) on one device; 0 turns them off",
    )
    disable_cuda_graph: bool = _flag(False, "run every decode step eagerly (no CUDA graphs)")
    enable_deterministic_inference: bool = _flag(
        False,
        "batch-invariant kernels: greedy tokens and logprobs bitwise the same whatever the "
        "batch, the chunking, the prefix cache and the layout (needs the native kernels)",
    )
    seed: int = _flag(0, "seed of the sampler for requests without their own seed")
    tokenizer_path: str | None = _flag(
        None, "a directory with the tokenizer to use (tokenizer.json, ...); default: the model's"
    )
    skip_tokenizer_init: bool = _flag(
        False,
        "load no tokenizer: prompts as token ids, outputs as token ids (text requests are "
        "refused; the server answers them with HTTP 400)",
    )
    chat_template: str | None = _flag(
        None,
        "a Jinja chat template file to use instead of the checkpoint's (chat_template.jinja "
        "beside the tokenizer, else tokenizer_config.json's chat_template)",
    )


@dataclass(frozen=True)
class CacheConfig:
    page_size: int = _flag(1, "tokens per KV page (a power of two)")
    max_total_tokens: int | None = _flag(
        None, "KV pool size in tokens; default: from --mem-fraction-static"
    )
    mem_fraction_static: float = _flag(
        0.5,
        "share of device memory for weights + KV cache (CPU: of RAM, split among local workers)",
    )
    disable_radix_cache: bool = _flag(False, "do not share KV of common prefixes")
    enable_hierarchical_cache: bool = _flag(
        False,
        "HiCache: prefixes evicted from the device KV pool move to host memory (and from there "
        "to --hicache-storage-dir) instead of being dropped, and a later hit loads them back",
    )
    hicache_ratio: float | None = _flag(
        None,
        "host-memory (L2) tier size, as a multiple of the device KV pool's pages (with "
        "write-through it also holds copies of what is on the device: keep it above 1); "
        "default 2, capped by --hicache-size; a ratio given that exceeds the cap is refused",
    )
    hicache_size: float | None = _flag(
        None,
        "cap on the host-memory (L2) tier, GiB per worker; default: what is free where the "
        "run starts (MemAvailable, less this run's pools on a CPU device and a tenth of RAM, "
        "split among the node's workers); more than that is refused",
    )
    hicache_write_policy: str = _flag(
        "write_through",
        "write_through: a cached prefix is copied to host memory soon after it is computed; "
        "write_back: only when the device pool evicts it",
        choices=HICACHE_WRITE_POLICIES,
    )
    hicache_storage_dir: str | None = _flag(
        None,
        "directory of the disk (L3) tier: one file per worker, its space reserved at start "
        "and the file unlinked at once (nothing survives a restart)",
    )
    hicache_storage_ratio: float = _flag(
        4.0, "disk (L3) tier size, as a multiple of the device KV pool's pages"
    )
    hicache_prefetch_threshold: int = _flag(
        256, "a hit in the host or disk tier shorter than this many tokens is recomputed"
    )


DEFAULT_CHUNK_SIZE = 2048


@dataclass(frozen=True)
class SchedulerConfig:
    chunked_prefill_size: int | None = _flag(
        None,
        "max prompt tokens per request per forward (-1: no chunking); default: "
        f"{DEFAULT_CHUNK_SIZE} on one worker, and for PP/TP layouts a size picked from a "
        "start-up measurement (printed; see docs/chunking.md)",
    )
    max_prefill_tokens: int = _flag(16384, "token budget of one prefill batch")
    max_running_requests: int = _flag(128, "max requests holding KV at once")
    enable_mixed_chunk: bool = _flag(False, "run decode steps in the same batch as a prefill chunk")
    enable_dynamic_chunking: bool = _flag(
        False,
        "size chunks so each costs the same time on the slowest stage (--chunked-prefill-size "
        "is the initial size)",
    )
    dynamic_chunking_model: str = _flag(
        "prefix-quadratic",
        "chunk cost model: 'prefix-quadratic' t(L, x) = c + gL + bx + a(2Lx + x^2), fitted on "
        "chunks timed after prefixes up to --dynamic-chunking-profile-max-len; 'quadratic' the "
        "published f(l) = al^2 + bl + c on a 1.25 C sweep at prefix 0",
        choices=DYNAMIC_CHUNKING_MODELS,
    )
    dynamic_chunking_smooth_factor: float | None = _flag(
        None, "0 = fixed chunks .. 1 = follow the cost model (env default 0.75)"
    )
    dynamic_chunking_min_size: int | None = _flag(
        None,
        "smallest chunk dynamic chunking picks (then aligned down to max(page size, 64)); "
        "default: C // 8 for prefix-quadratic, C // 4 for quadratic",
    )
    dynamic_chunking_profile_max_len: int = _flag(
        32768,
        "prefix-quadratic: the longest prefix + chunk the start-up profile times (also capped "
        "by the context length and the KV pool); set it near the longest prompts you serve",
    )
    dynamic_chunking_online: bool = _flag(
        False, "keep refitting the chunk cost model from measured chunk times while serving"
    )
    disable_overlap_schedule: bool = _flag(False, "run the plain loop (no CPU/device overlap)")
    enable_overlap_schedule: bool = _flag(
        False,
        "run the overlap loop even where the plain loop is the default (in-process on a CPU, "
        "where it measures slower)",
    )

    @property
    def chunk_size(self) -> int | None:
        """The chunk size given, or the one-worker default; None: no chunking."""
        size = self.chunked_prefill_size
        size = DEFAULT_CHUNK_SIZE if size is None else size
        return size if size > 0 else None

    @property
    def smooth_factor(self) -> float:
        if self.dynamic_chunking_smooth_factor is not None:
            return self.dynamic_chunking_smooth_factor
        return envs.dynamic_chunking_smooth_factor()


@dataclass(frozen=True)
class ParallelConfig:
    tp_size: int = _flag(1, "tensor parallel size")
    pp_size: int = _flag(1, "pipeline parallel size")
    ep_size: int = _flag(
        1,
        "expert parallel size: each pipeline stage has this many ranks, each with the full "
        "attention, its own KV cache and requests (data-parallel attention), the routed "
        "experts split over them (needs --tp-size 1)",
    )
    cp_size: int = _flag(
        1,
        "context parallel size: each pipeline stage has this many ranks; a prompt chunk's "
        "tokens are split over them (zig-zag: rank r computes blocks r and 2N-1-r of 2N) and "
        "each rank keeps every N-th KV page of a request, so the KV capacity grows N-fold "
        "(--max-total-tokens is per rank); needs --tp-size 1 --ep-size 1",
    )
    cp_prefix_mode: str = _flag(
        "auto",
        "context parallelism: how a later chunk's queries (and a decode step) attend to the "
        "prefix the CP ranks hold between them: 'merge' (every rank attends all the "
        "chunk's queries to its own pages, partial results merged by log-sum-exp), "
        "'regather' (the prefix KV all-gathered per layer), 'auto' (whichever moves fewer "
        "bytes; decode steps merge)",
        choices=CP_PREFIX_MODES,
    )
    cp_kv_exchange: str = _flag(
        "all-gather",
        "context parallelism: how a chunk's K/V reach every rank: 'all-gather' (one per layer, "
        "launched before the query projection) or 'ring' (each rank's block passed around a "
        "ring while the blocks held are attended, merged by log-sum-exp; the prefix is then "
        "always merged)",
        choices=CP_KV_EXCHANGES,
    )
    enable_sharded_cp: bool = _flag(
        False,
        "context parallelism with the routed experts spread over the CP ranks (as under "
        "--ep-size): each rank's tokens go to the experts by all-to-all, so no rank holds every "
        "expert (sequence-parallel MoE; with --shard-linear-layers: sharded CP)",
    )
    disable_cp_kv_overlap: bool = _flag(
        False,
        "context parallelism: wait for each layer's K/V exchange as soon as it is launched "
        "instead of running it during the query projection (measures what the overlap hides)",
    )
    shard_linear_layers: str = _flag(
        "",
        "context parallelism: these projections of every decoder layer (comma-separated module "
        "names, e.g. 'qkv_proj,o_proj') live whole on CP rank (layer mod N) only and are broadcast "
        "to the others just before use, then freed ('': every rank holds every weight; no "
        "effect with --cp-size 1)",
    )
    shard_linear_warm_layers: int = _flag(
        1,
        "shard linear: every CP rank keeps the first K layers' projections; when layer l starts "
        "the owner of layer l + K broadcasts it (the prefetch distance)",
    )
    pp_layer_partition: str | None = _flag(
        None, "layers per stage, e.g. '15,15,15,16' or 'auto' (env PIPESERVE_PP_LAYER_PARTITION)"
    )
    afd_attention_size: int = _flag(
        0,
        "attention-FFN disaggregation: this many attention workers, each with its own requests "
        "and KV cache, running embedding, attention, router, shared experts and LM head "
        "(0: off; needs --afd-ffn-size)",
    )
    afd_ffn_size: int = _flag(
        0, "attention-FFN disaggregation: this many FFN workers holding the routed experts"
    )
    afd_ffn_nodes: int = _flag(
        1, "attention-FFN disaggregation: the FFN workers form this many nodes of equal size"
    )
    afd_micro_batches: int = _flag(
        1,
        "attention-FFN disaggregation: each step runs as this many micro-batches whose layers "
        "interleave (3: three-batch overlap), so the FFN workers compute one while the "
        "attention workers compute the next",
    )
    afd_dispatch_mode: str = _flag(
        "direct-rank",
        "attention-FFN disaggregation: 'direct-rank' (a token goes once to each FFN worker "
        "holding one of its experts), 'direct' (once per selected expert) or 'two-stage' "
        "(once per FFN node, forwarded inside the node to the workers holding its experts)",
        choices=AFD_DISPATCH_MODES,
    )
    pp_async_batch_depth: int = _flag(
        1,
        "micro-batches in flight beyond --pp-size (keeps the first stage fed while results "
        "travel back)",
    )
    enable_two_batch_overlap: bool = _flag(
        False,
        "MoE under expert parallelism: run each forward as two micro-batches whose layers "
        "interleave, one's dispatch/combine hidden behind the other's compute",
    )
    tbo_token_distribution_threshold: float = _flag(
        0.48,
        "two-batch overlap of a prompt batch: when the most even split between requests "
        "gives one side less than this share of the tokens, cut a request in two instead",
    )
    two_batch_overlap_min_tokens: int = _flag(
        1024,
        "two-batch overlap splits only steps where some attention rank has at least this "
        "many tokens (each half reads every weight again: decode steps of a few dozen "
        "requests and 512-token chunks measured slower split; 0: split every step that can be)",
    )
    enable_single_batch_overlap: bool = _flag(
        False,
        "MoE under expert parallelism: inside each MoE layer, overlap the dispatch or combine "
        "with the shared experts or the expert computation",
    )
    single_batch_overlap_modes: str = _flag(
        "combine-down,dispatch-shared",
        "with --enable-single-batch-overlap: combine-down (experts in blocks, each block's "
        "combine launched at once), dispatch-shared or combine-shared (the shared experts run "
        "while the dispatch / the combine is in flight; dispatch-shared wins if both)",
    )
    single_batch_overlap_min_tokens: int = _flag(
        256,
        "combine-down runs in blocks only in steps where some attention rank has at least "
        "this many tokens (smaller steps: one block)",
    )
    moe_comm_max_sms: int | None = _flag(
        None,
        "on NCCL: the most SMs the expert-parallel dispatch/combine kernels may take, the "
        "rest left to the compute they overlap (default: NCCL's choice; no effect on gloo)",
    )
    threads_per_worker: int | None = _flag(
        None, "torch threads per worker (default: cores/workers)"
    )
    spawn_workers: bool = _flag(
        False, "run the model in a worker process even on one device (default: in-process)"
    )
    nnodes: int = _flag(1, "number of nodes")
    node_rank: int = _flag(0, "rank of this node")
    dist_init_addr: str | None = _flag(None, "host:port of node 0 for multi-node launch")
    dist_auth_key: str | None = _secret_flag(
        "multi-node: a shared secret (give every node the same), at least 32 hex digits "
        "(`openssl rand -hex 32`), that authenticates and encrypts the scheduler's ZMQ "
        "channels (CURVE); prefer env PIPESERVE_DIST_AUTH_KEY, which the process list does "
        "not show"
    )
    heartbeat_interval: float = _flag(
        0.5, "seconds between a worker's heartbeats (sent by a thread of their own)"
    )
    heartbeat_timeout: float = _flag(
        5.0,
        "a worker silent this long is stalled: fail the engine (a worker with no scheduler "
        "for this long exits)",
    )

    @property
    def world_size(self) -> int:
        return self.stage_width * self.pp_size

    @property
    def stage_width(self) -> int:
        """Ranks per pipeline stage: its TP ranks, under EP its attention ranks, under CP its
        context-parallel ranks, under AFD its attention workers and then its FFN workers."""
        if self.afd_enabled:
            return self.afd_attention_size + self.afd_ffn_size
        return self.tp_size * self.ep_size * self.cp_size

    @property
    def afd_enabled(self) -> bool:
        return self.afd_attention_size > 0 or self.afd_ffn_size > 0

    @property
    def attention_ranks(self) -> int:
        """Data-parallel attention ranks per stage, each with its own scheduler."""
        return self.afd_attention_size if self.afd_enabled else self.ep_size

    @property
    def expert_ranks(self) -> int:
        """Ranks of a stage the routed experts are spread over."""
        return self.cp_size if self.enable_sharded_cp else self.ep_size

    @property
    def uses_workers(self) -> bool:
        return self.world_size > 1 or self.nnodes > 1 or self.spawn_workers

    @property
    def layer_partition(self) -> str | None:
        return self.pp_layer_partition or envs.pp_layer_partition()

    @property
    def auth_key(self) -> str | None:
        return self.dist_auth_key or envs.dist_auth_key()


@dataclass(frozen=True)
class ServerConfig:
    host: str = _flag("127.0.0.1", "address to serve HTTP on (loopback unless you say otherwise)")
    port: int = _flag(30000, "HTTP port")
    api_key: str | None = _flag(
        None, "require 'Authorization: Bearer <key>' on /v1/* (not on /health or /metrics)"
    )
    served_model_name: str | None = _flag(None, "model name clients use (default: directory name)")
    watchdog_timeout: float = _flag(
        300.0, "seconds a step may take; beyond, or when a worker dies, fail and shut down"
    )
    max_queued_requests: int = _flag(
        256, "requests waiting beyond --max-running-requests; more get HTTP 503"
    )
    max_request_bytes: int = _flag(
        64 * 2**20,
        "largest HTTP request body in bytes (64 MiB); larger ones, by Content-Length or as a "
        "chunked body arrives, get HTTP 413",
    )
    http_head_timeout: float = _flag(
        5.0,
        "seconds a connection has to send a request's head, from connect (or from the first "
        "byte of a later request on a kept-alive connection); then HTTP 408 and close",
    )
    http_body_timeout: float = _flag(
        30.0, "seconds a request has to send its whole body once its head is in; then 408"
    )
    sse_keepalive_interval: float = _flag(
        15.0,
        "seconds a streamed response may stay silent (a long prompt prefilling, a slow "
        "step) before it sends an SSE comment line, so that the client, a proxy or the PD "
        "router does not take the connection for dead",
    )
    http_max_connections: int = _flag(
        2048,
        "HTTP connections held at once (at most the descriptor limit less 64); at the cap the "
        "oldest connection still sending its request is dropped for a new one",
    )
    http_max_pending_per_peer: int = _flag(
        256,
        "connections one client address may hold while they still send their requests; more "
        "are closed at once",
    )
    ssl_certfile: str | None = _flag(
        None,
        "serve HTTPS with this certificate (PEM; with --ssl-keyfile): for the internal legs "
        "of disaggregation between machines, or any client",
    )
    ssl_keyfile: str | None = _flag(None, "the private key of --ssl-certfile (PEM)")
    ssl_ca_certs: str | None = _flag(
        None,
        "CA certificates (PEM) that https:// prefill servers this decode server calls must "
        "chain to (default: the system's)",
    )
    enable_api_docs: bool = _flag(
        False,
        "serve /docs, /redoc and /openapi.json (off by default: they map the API for anyone "
        "who can reach the port, key or not)",
    )


DISAGGREGATION_MODES = ("null", "prefill", "decode")


@dataclass(frozen=True)
class DisaggregationConfig:
    disaggregation_mode: str = _flag(
        "null",
        "prefill/decode disaggregation role: null (serve whole requests), prefill (compute "
        "prompts and send their KV to the decode server named by each request) or decode "
        "(reserve pages, receive KV, generate); put `pipeserve router` in front",
        choices=DISAGGREGATION_MODES,
    )
    disaggregation_transfer_backend: str = _flag(
        "tcp",
        "KV transfer engine (tcp: pipeserve's authenticated, encrypted KV link over TCP, "
        "local or between machines)",
        choices=("tcp",),
    )
    disaggregation_host: str = _flag(
        "127.0.0.1",
        "decode side: the address its workers' KV receivers listen on and tell the prefill "
        "side (an address the prefill servers can reach)",
    )
    disaggregation_transfer_timeout: float = _flag(
        60.0,
        "seconds a request's KV may still take to arrive once the prefill server has answered "
        "(decode side), and a send may wait for a receiver (prefill side); beyond, the "
        "request fails and its pages are freed",
    )
    disaggregation_prefill_timeout: float = _flag(
        3600.0,
        "seconds a decode server waits for the prefill server's answer (its queue and the "
        "prompt's compute; a prefill server that dies or a client that leaves ends the wait "
        "at once); beyond, the request fails and its pages are freed",
    )
    disaggregation_prefill_url: tuple[str, ...] = _flag(
        (),
        "decode side: a prefill server this decode server may call (http://HOST:PORT; repeat "
        "the flag for several, the router's --prefill list). The router names one per request "
        "in X-Pipeserve-Prefill; a name not on this list is refused, nothing else is called",
    )
    disaggregation_decode_host: tuple[str, ...] = _flag(
        ("127.0.0.1",),
        "prefill side: an address of decode servers' KV receivers (their --disaggregation-host) "
        "this prefill server may send KV to (repeat the flag for several); a destination "
        "elsewhere is refused",
    )
    disaggregation_auth_key: str | None = _secret_flag(
        "prefill/decode disaggregation's shared secret (the same on the router and every "
        "prefill and decode server), at least 32 hex digits (`openssl rand -hex 32`): it "
        "authenticates the internal HTTP calls and the KV data link; prefer env "
        "PIPESERVE_PD_AUTH_KEY, which the process list does not show"
    )

    @property
    def pd_auth_key(self) -> str | None:
        return self.disaggregation_auth_key or envs.pd_auth_key()

    @property
    def prefill_wait_s(self) -> float:
        """A decode server's longest wait for a request's prompt (prefilled within the
        prefill timeout, its KV in a transfer timeout after that) and one transfer timeout
        more: what the router adds to its time limit, and how long a KV room lives."""
        return self.disaggregation_prefill_timeout + 2 * self.disaggregation_transfer_timeout


@dataclass(frozen=True)
class EngineConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    server: ServerConfig = field(default_factory=ServerConfig)
    disaggregation: DisaggregationConfig = field(default_factory=DisaggregationConfig)

    @classmethod
    def from_flags(cls, **flags: Any) -> EngineConfig:
        """Route flat keyword flags (as the CLI and `Engine(**flags)` use) to their areas."""
        unknown = set(flags) - set(FLAG_AREAS)
        if unknown:
            raise TypeError(f"unknown engine flag(s): {', '.join(sorted(unknown))}")
        parts: dict[str, dict[str, Any]] = {}
        for name, value in flags.items():
            if name in LIST_FLAGS and not isinstance(value, tuple):  # one value, or a list
                value = (value,) if isinstance(value, str) else tuple(value)
            parts.setdefault(FLAG_AREAS[name], {})[name] = value
        areas = {f.name: f.type for f in dataclasses.fields(cls)}
        built = {area: AREA_TYPES[area](**kw) for area, kw in parts.items() if area in areas}
        config = cls(**built)
        validate(config)
        return config

    def flags(self) -> dict[str, Any]:
        """The flat flag dict this config was built from (for handing to worker processes)."""
        return {
            f.name: getattr(getattr(self, area), f.name)
            for area, kind in AREA_TYPES.items()
            for f in dataclasses.fields(kind)
        }


AREA_TYPES: dict[str, type] = {
    "model": ModelConfig,
    "cache": CacheConfig,
    "scheduler": SchedulerConfig,
    "parallel": ParallelConfig,
    "server": ServerConfig,
    "disaggregation": DisaggregationConfig,
}
LIST_FLAGS = {  # flags that take several values (the CLI flag repeated)
    f.name
    for kind in AREA_TYPES.values()
    for f in dataclasses.fields(kind)
    if str(f.type).startswith("tuple[")
}
FLAG_AREAS: dict[str, str] = {
    f.name: area for area, kind in AREA_TYPES.items() for f in dataclasses.fields(kind)
}


def validate(config: EngineConfig) -> None:
    """Reject inconsistent settings with a message that says what to change."""
    m, c, s, p = config.model, config.cache, config.scheduler, config.parallel
    checks = [
        (m.dtype in DTYPES, f"--dtype {m.dtype!r} is not one of {', '.join(DTYPES)}"),
        (
            m.fp8_weights in FP8_WEIGHTS,
            f"--fp8-weights {m.fp8_weights!r} is not one of {', '.join(FP8_WEIGHTS)}",
        ),
        (
            m.attention_backend in ATTENTION_BACKENDS,
            f"--attention-backend {m.attention_backend!r} is not one of "
            + ", ".join(ATTENTION_BACKENDS),
        ),
        (
            m.cuda_graph_max_bs >= 0,
            f"--cuda-graph-max-bs {m.cuda_graph_max_bs} must be 0 (off) or more",
        ),
        (
            c.page_size > 0 and c.page_size & (c.page_size - 1) == 0,
            f"--page-size {c.page_size} must be a power of two",
        ),
        (
            0 < c.mem_fraction_static <= 1,
            f"--mem-fraction-static {c.mem_fraction_static} must be in (0, 1]",
        ),
        (
            c.max_total_tokens is None or c.max_total_tokens > 0,
            f"--max-total-tokens {c.max_total_tokens} must be positive",
        ),
        (s.chunked_prefill_size != 0, "--chunked-prefill-size 0 is invalid (use -1 to disable)"),
        (s.max_running_requests > 0, "--max-running-requests must be positive"),
        (
            not (s.disable_overlap_schedule and s.enable_overlap_schedule),
            "--disable-overlap-schedule and --enable-overlap-schedule contradict each other; "
            "give at most one",
        ),
        (s.max_prefill_tokens > 0, "--max-prefill-tokens must be positive"),
        (
            0.0 <= s.smooth_factor <= 1.0,
            f"dynamic chunking smooth factor {s.smooth_factor} must be in [0, 1]",
        ),
        (
            s.dynamic_chunking_model in DYNAMIC_CHUNKING_MODELS,
            f"--dynamic-chunking-model {s.dynamic_chunking_model!r} is not one of "
            f"{', '.join(DYNAMIC_CHUNKING_MODELS)}",
        ),
        *_dynamic_chunking_checks(s),
        *_hicache_checks(c, p),
        *_disaggregation_checks(config),
        (
            p.tp_size > 0 and p.pp_size > 0 and p.ep_size > 0,
            "--tp-size, --pp-size and --ep-size must be positive",
        ),
        (
            p.ep_size == 1 or p.tp_size == 1,
            f"--ep-size {p.ep_size} with --tp-size {p.tp_size}: under expert parallelism each "
            "attention rank runs whole (TP inside an attention rank is not built yet); use "
            "--tp-size 1",
        ),
        (p.pp_async_batch_depth >= 0, "--pp-async-batch-depth must be >= 0"),
        (
            m.fp8_weights == "dequantize" or not m.enable_deterministic_inference,
            "--enable-deterministic-inference needs batch-invariant products, which the FP8 "
            "kernels of --fp8-weights keep are not shown to be; use --fp8-weights dequantize",
        ),
        (
            m.fp8_weights == "dequantize" or not p.shard_linear_layers,
            "--shard-linear-layers moves weights between CP ranks in the compute dtype; it does "
            "not take --fp8-weights keep",
        ),
        *_afd_checks(p),
        *_cp_checks(p),
        (p.two_batch_overlap_min_tokens >= 0, "--two-batch-overlap-min-tokens must be >= 0"),
        (
            p.moe_comm_max_sms is None or p.moe_comm_max_sms >= 1,
            f"--moe-comm-max-sms {p.moe_comm_max_sms} must be at least 1",
        ),
        (
            p.single_batch_overlap_min_tokens >= 0,
            "--single-batch-overlap-min-tokens must be >= 0",
        ),
        (
            0 < p.tbo_token_distribution_threshold <= 0.5,
            f"--tbo-token-distribution-threshold {p.tbo_token_distribution_threshold} must be "
            "in (0, 0.5]",
        ),
        (
            p.nnodes > 0 and 0 <= p.node_rank < p.nnodes,
            f"--node-rank {p.node_rank} must be in [0, --nnodes {p.nnodes})",
        ),
        (p.nnodes == 1 or p.dist_init_addr, "--nnodes > 1 needs --dist-init-addr host:port"),
        (
            p.auth_key is None or key_problem(p.auth_key, DIST_KEY_NAME) is None,
            key_problem(p.auth_key or "", DIST_KEY_NAME) or "",
        ),
        (config.server.watchdog_timeout > 0, "--watchdog-timeout must be positive"),
        (
            0 < p.heartbeat_interval * 2 <= p.heartbeat_timeout,
            f"--heartbeat-timeout {p.heartbeat_timeout:g} must be at least twice "
            f"--heartbeat-interval {p.heartbeat_interval:g} (both positive)",
        ),
        (config.server.max_queued_requests >= 0, "--max-queued-requests must be >= 0"),
        (config.server.max_request_bytes > 0, "--max-request-bytes must be positive"),
        (
            (config.server.ssl_certfile is None) == (config.server.ssl_keyfile is None),
            "--ssl-certfile and --ssl-keyfile go together",
        ),
        (config.server.http_head_timeout > 0, "--http-head-timeout must be positive"),
        (config.server.http_body_timeout > 0, "--http-body-timeout must be positive"),
        (
            config.server.sse_keepalive_interval > 0,
            "--sse-keepalive-interval must be positive",
        ),
        (config.server.http_max_connections > 0, "--http-max-connections must be positive"),
        (
            config.server.http_max_pending_per_peer > 0,
            "--http-max-pending-per-peer must be positive",
        ),
        (
            p.world_size % p.nnodes == 0,
            f"{_world_words(p)} = {p.world_size} must be divisible by --nnodes {p.nnodes}",
        ),
    ]
    for ok, message in checks:
        if not ok:
            raise SettingsError(message)


def _hicache_checks(c: CacheConfig, p: ParallelConfig) -> list[tuple[bool, str]]:
    if not c.enable_hierarchical_cache:
        return []
    return [
        (
            not c.disable_radix_cache,
            "--enable-hierarchical-cache extends the prefix cache: drop --disable-radix-cache",
        ),
        (
            c.hicache_ratio is None or c.hicache_ratio > 0,
            f"--hicache-ratio {c.hicache_ratio} must be positive",
        ),
        (
            c.hicache_size is None or c.hicache_size > 0,
            f"--hicache-size {c.hicache_size} must be positive",
        ),
        (
            c.hicache_storage_ratio > 0,
            f"--hicache-storage-ratio {c.hicache_storage_ratio} must be positive",
        ),
        (
            c.hicache_write_policy in HICACHE_WRITE_POLICIES,
            f"--hicache-write-policy {c.hicache_write_policy!r} is not one of "
            f"{', '.join(HICACHE_WRITE_POLICIES)}",
        ),
        (c.hicache_prefetch_threshold >= 0, "--hicache-prefetch-threshold must be >= 0"),
        (
            p.cp_size == 1,
            "--enable-hierarchical-cache with --cp-size > 1 is not built yet (each CP rank "
            "holds a stripe of every page); use one or the other",
        ),
    ]


def _disaggregation_checks(config: EngineConfig) -> list[tuple[bool, str]]:
    d, p = config.disaggregation, config.parallel
    mode = d.disaggregation_mode
    if mode == "null":
        return [(mode in DISAGGREGATION_MODES, f"--disaggregation-mode {mode!r} is unknown")]
    return [
        (mode in DISAGGREGATION_MODES, f"--disaggregation-mode {mode!r} is unknown"),
        (
            p.ep_size == 1 and not p.afd_enabled,
            f"--disaggregation-mode {mode} runs PP x TP (and, prefill side, CP) layouts; "
            "expert and attention-FFN parallelism under disaggregation are not built yet",
        ),
        (
            p.cp_size == 1 or mode == "prefill",
            "--disaggregation-mode decode with --cp-size > 1 is not built yet (context "
            "parallelism splits prompts: use it on the prefill side)",
        ),
        (
            not p.enable_two_batch_overlap,
            f"--disaggregation-mode {mode} with --enable-two-batch-overlap is not built yet "
            "(the KV is sent layer by layer from the plain forward)",
        ),
        (d.disaggregation_transfer_timeout > 0, "--disaggregation-transfer-timeout must be > 0"),
        (d.disaggregation_prefill_timeout > 0, "--disaggregation-prefill-timeout must be > 0"),
        (d.pd_auth_key is not None, MISSING_PD_KEY),
        (
            d.pd_auth_key is None or key_problem(d.pd_auth_key, PD_KEY_NAME) is None,
            key_problem(d.pd_auth_key or "", PD_KEY_NAME) or "",
        ),
        *[
            (valid_server_url(u), f"--disaggregation-prefill-url {u!r}: {URL_FORM}")
            for u in d.disaggregation_prefill_url
        ],
        (
            mode == "decode" or not d.disaggregation_prefill_url,
            "--disaggregation-prefill-url is a decode server's flag",
        ),
    ]


URL_FORM = "write a server's base URL as http://HOST:PORT (no path, query or fragment)"
PD_KEY_NAME = "the PD key (PIPESERVE_PD_AUTH_KEY or --disaggregation-auth-key)"
DIST_KEY_NAME = "the control plane's key (PIPESERVE_DIST_AUTH_KEY or --dist-auth-key)"
MISSING_PD_KEY = (
    "prefill/decode disaggregation needs a shared secret: set PIPESERVE_PD_AUTH_KEY (or "
    "--disaggregation-auth-key) to the same value on the router and on every prefill and "
    "decode server, e.g. `export PIPESERVE_PD_AUTH_KEY=$(openssl rand -hex 32)`"
)


MIN_KEY_HEX_DIGITS = 32  # 128 bits


def key_problem(key: str, what: str) -> str | None:
    """Why `key` is not a shared secret of at least 128 random bits, or None. The check is of
    form (it cannot see where a key came from): at least 32 hex digits, not a short pattern
    repeated, at least 8 distinct digits (32 random ones have about 14)."""
    how = (
        f"{what} must be at least {MIN_KEY_HEX_DIGITS} hex digits (128 bits) from a random "
        "source: make one with `openssl rand -hex 32`"
    )
    text = key.lower()
    if len(text) < MIN_KEY_HEX_DIGITS or any(c not in "0123456789abcdef" for c in text):
        return f"{how}; the key given is not (a short or word-like key can be guessed offline)"
    periodic = any(
        len(text) % p == 0 and text == text[:p] * (len(text) // p)
        for p in range(1, len(text) // 2 + 1)
    )
    if periodic or len(set(text)) < 8:
        return f"{how}; the key given is a pattern, not random digits"
    return None


def valid_server_url(url: str) -> bool:
    """Whether `url` is a bare http(s)://host:port base URL (a trailing / allowed)."""
    from urllib.parse import urlsplit

    try:
        parts = urlsplit(url)
        port = parts.port
    except ValueError:
        return False
    bare = parts.path in ("", "/") and not (parts.query or parts.fragment or parts.username)
    return parts.scheme in ("http", "https") and bool(parts.hostname) and port is not None and bare


def _dynamic_chunking_checks(s: SchedulerConfig) -> list[tuple[bool, str]]:
    if not s.enable_dynamic_chunking:
        return []
    size, low = s.chunk_size or -1, s.dynamic_chunking_min_size
    if s.chunked_prefill_size is None:  # the initial size is picked at start-up
        return [(low is None or low > 0, f"--dynamic-chunking-min-size {low} must be positive")]
    return [
        (
            size > 0,
            f"--enable-dynamic-chunking needs --chunked-prefill-size C > 0 (the initial chunk "
            f"size), not {size}; drop --enable-dynamic-chunking to prefill without chunks",
        ),
        (
            low is None or 0 < low <= max(size, 1),
            f"--dynamic-chunking-min-size {low} must be in [1, --chunked-prefill-size {size}]",
        ),
        (
            s.dynamic_chunking_model == "quadratic" or s.dynamic_chunking_profile_max_len >= size,
            f"--dynamic-chunking-profile-max-len {s.dynamic_chunking_profile_max_len} must be at "
            f"least --chunked-prefill-size {size} (the profile times chunks of up to C tokens)",
        ),
    ]


def _world_words(p: ParallelConfig) -> str:
    if p.afd_enabled:
        return "--afd-attention-size + --afd-ffn-size"
    return "--tp-size * --pp-size * --ep-size * --cp-size"


def _cp_checks(p: ParallelConfig) -> list[tuple[bool, str]]:
    return [
        (p.cp_size > 0, f"--cp-size {p.cp_size} must be positive"),
        (
            p.cp_prefix_mode in CP_PREFIX_MODES,
            f"--cp-prefix-mode {p.cp_prefix_mode!r} is not one of {', '.join(CP_PREFIX_MODES)}",
        ),
        (
            p.cp_kv_exchange in CP_KV_EXCHANGES,
            f"--cp-kv-exchange {p.cp_kv_exchange!r} is not one of {', '.join(CP_KV_EXCHANGES)}",
        ),
        (
            p.cp_kv_exchange != "ring" or p.cp_prefix_mode != "regather",
            "--cp-kv-exchange ring carries the chunk only: the prefix is merged, so "
            "--cp-prefix-mode regather does not combine with it",
        ),
        (
            p.cp_size == 1 or (p.tp_size, p.ep_size) == (1, 1),
            f"--cp-size {p.cp_size} with --tp-size {p.tp_size} --ep-size {p.ep_size}: each "
            "context-parallel rank runs whole (TP or EP inside a CP rank is not built yet); "
            "use --tp-size 1 --ep-size 1",
        ),
        (
            p.cp_size == 1 or not p.afd_enabled,
            "context parallelism and attention-FFN disaggregation do not combine yet; drop "
            "--cp-size or the --afd-* flags",
        ),
        (
            p.cp_size == 1 or not p.enable_two_batch_overlap,
            "two-batch overlap applies to expert parallelism, not to --cp-size (under "
            "--enable-sharded-cp, --enable-single-batch-overlap overlaps the experts' "
            "dispatch and combine)",
        ),
        (
            p.cp_size == 1 or p.enable_sharded_cp or not p.enable_single_batch_overlap,
            "--enable-single-batch-overlap with --cp-size needs --enable-sharded-cp (without it "
            "every CP rank holds every expert: nothing is dispatched)",
        ),
        (
            not p.enable_sharded_cp or p.cp_size > 1,
            "--enable-sharded-cp spreads the experts over the context-parallel ranks: it needs "
            "--cp-size > 1",
        ),
        (
            p.shard_linear_warm_layers >= 0,
            f"--shard-linear-warm-layers {p.shard_linear_warm_layers} must be >= 0",
        ),
    ]


def _afd_checks(p: ParallelConfig) -> list[tuple[bool, str]]:
    if not p.afd_enabled:
        return []
    na, nf, nodes = p.afd_attention_size, p.afd_ffn_size, p.afd_ffn_nodes
    return [
        (
            na > 0 and nf > 0,
            f"--afd-attention-size {na} and --afd-ffn-size {nf}: attention-FFN disaggregation "
            "needs at least one worker of each kind",
        ),
        (
            (p.pp_size, p.tp_size, p.ep_size) == (1, 1, 1),
            f"attention-FFN disaggregation runs with --pp-size 1 --tp-size 1 --ep-size 1 (the "
            f"FFN workers are the expert parallelism), not {p.pp_size}, {p.tp_size}, "
            f"{p.ep_size}",
        ),
        (
            nodes > 0 and nf % nodes == 0,
            f"--afd-ffn-nodes {nodes} does not divide --afd-ffn-size {nf}: every FFN node "
            "needs the same number of workers",
        ),
        (p.afd_micro_batches >= 1, f"--afd-micro-batches {p.afd_micro_batches} must be >= 1"),
        (
            p.afd_dispatch_mode in AFD_DISPATCH_MODES,
            f"--afd-dispatch-mode {p.afd_dispatch_mode!r} is not one of "
            f"{', '.join(AFD_DISPATCH_MODES)}",
        ),
        (
            not (p.enable_two_batch_overlap or p.enable_single_batch_overlap),
            "two-batch and single-batch overlap apply to expert parallelism (--ep-size), not to "
            "attention-FFN disaggregation; drop them or the --afd-* flags",
        ),
    ]
