"""EngineConfig: flat flags routed to their areas, validation messages, env defaults."""

from __future__ import annotations

import dataclasses
import secrets
from typing import Any

import pytest

from pipeserve.config import EngineConfig, SchedulerConfig

SMOOTH_ENV = "PIPESERVE_DYNAMIC_CHUNKING_SMOOTH_FACTOR"
PARTITION_ENV = "PIPESERVE_PP_LAYER_PARTITION"


@pytest.fixture(autouse=True)
def clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(SMOOTH_ENV, raising=False)
    monkeypatch.delenv(PARTITION_ENV, raising=False)


def test_defaults() -> None:
    config = EngineConfig.from_flags()
    assert config == EngineConfig()
    assert config.scheduler.chunk_size == 2048
    assert config.scheduler.smooth_factor == 0.75
    assert config.parallel.world_size == 1


def test_flags_are_routed_to_their_areas() -> None:
    config = EngineConfig.from_flags(
        page_size=4, disable_radix_cache=True, chunked_prefill_size=-1,
        max_running_requests=3, tp_size=2, pp_size=3, dtype="float32",
    )
    assert (config.cache.page_size, config.cache.disable_radix_cache) == (4, True)
    assert config.scheduler.chunk_size is None
    assert config.scheduler.max_running_requests == 3
    assert (config.parallel.tp_size, config.parallel.pp_size) == (2, 3)
    assert config.parallel.world_size == 6
    assert config.model.dtype == "float32"
    assert config.scheduler.max_prefill_tokens == SchedulerConfig().max_prefill_tokens


def test_flags_round_trip() -> None:
    config = EngineConfig.from_flags(page_size=8, pp_size=2, enable_dynamic_chunking=True)
    assert EngineConfig.from_flags(**config.flags()) == config


def test_unknown_flags_are_named() -> None:
    with pytest.raises(TypeError, match="unknown engine flag\\(s\\): pipeline_size, tp"):
        EngineConfig.from_flags(tp=2, pipeline_size=2, page_size=1)


def test_config_is_frozen() -> None:
    config = EngineConfig.from_flags()
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.cache.page_size = 2  # type: ignore[misc]


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        ({"page_size": 3}, "--page-size 3 must be a power of two"),
        ({"page_size": 0}, "--page-size 0 must be a power of two"),
        ({"dtype": "int8"}, "--dtype 'int8' is not one of best, auto, bfloat16, float16, float32"),
        ({"mem_fraction_static": 0.0}, r"--mem-fraction-static 0.0 must be in \(0, 1\]"),
        ({"mem_fraction_static": 1.5}, r"--mem-fraction-static 1.5 must be in \(0, 1\]"),
        ({"max_total_tokens": 0}, "--max-total-tokens 0 must be positive"),
        ({"chunked_prefill_size": 0}, r"--chunked-prefill-size 0 is invalid \(use -1 to disable\)"),
        ({"max_running_requests": 0}, "--max-running-requests must be positive"),
        ({"max_prefill_tokens": -1}, "--max-prefill-tokens must be positive"),
        ({"dynamic_chunking_smooth_factor": 1.5}, r"smooth factor 1.5 must be in \[0, 1\]"),
        ({"enable_dynamic_chunking": True, "chunked_prefill_size": -1},
         r"--enable-dynamic-chunking needs --chunked-prefill-size C > 0 \(the initial chunk "
         r"size\), not -1; drop --enable-dynamic-chunking to prefill without chunks"),
        ({"enable_dynamic_chunking": True, "dynamic_chunking_min_size": 4096,
          "chunked_prefill_size": 2048},
         r"--dynamic-chunking-min-size 4096 must be in \[1, --chunked-prefill-size 2048\]"),
        ({"enable_dynamic_chunking": True, "dynamic_chunking_min_size": 0,
          "chunked_prefill_size": 2048},
         r"--dynamic-chunking-min-size 0 must be in \[1, --chunked-prefill-size 2048\]"),
        ({"enable_dynamic_chunking": True, "dynamic_chunking_min_size": 0},
         r"--dynamic-chunking-min-size 0 must be positive"),
        ({"enable_dynamic_chunking": True, "dynamic_chunking_profile_max_len": 1024,
          "chunked_prefill_size": 2048},
         "--dynamic-chunking-profile-max-len 1024 must be at least --chunked-prefill-size 2048"),
        ({"dynamic_chunking_model": "cubic"},
         "--dynamic-chunking-model 'cubic' is not one of prefix-quadratic, quadratic"),
        ({"tp_size": 0}, "--tp-size, --pp-size and --ep-size must be positive"),
        ({"ep_size": 0}, "--tp-size, --pp-size and --ep-size must be positive"),
        ({"ep_size": 2, "tp_size": 2}, "--ep-size 2 with --tp-size 2: under expert parallelism"),
        ({"nnodes": 2, "node_rank": 2, "dist_init_addr": "h:1"},
         r"--node-rank 2 must be in \[0, --nnodes 2\)"),
        ({"nnodes": 2, "pp_size": 2}, "--nnodes > 1 needs --dist-init-addr host:port"),
        ({"nnodes": 2, "pp_size": 3, "dist_init_addr": "h:1"},
         "--tp-size \\* --pp-size \\* --ep-size \\* --cp-size = 3 must be divisible by --nnodes 2"),
        ({"cp_size": 0}, "--cp-size 0 must be positive"),
        ({"cp_size": 2, "tp_size": 2}, "--cp-size 2 with --tp-size 2 --ep-size 1: each"),
        ({"cp_size": 2, "afd_attention_size": 1, "afd_ffn_size": 1},
         "context parallelism and attention-FFN disaggregation do not combine yet"),
        ({"cp_size": 2, "enable_two_batch_overlap": True},
         "two-batch overlap applies to expert parallelism, not to --cp-size"),
        ({"cp_size": 2, "enable_single_batch_overlap": True},
         "--enable-single-batch-overlap with --cp-size needs --enable-sharded-cp"),
        ({"cp_prefix_mode": "ring"}, "--cp-prefix-mode 'ring' is not one of auto, merge"),
        ({"cp_kv_exchange": "p2p"}, "--cp-kv-exchange 'p2p' is not one of all-gather, ring"),
        ({"cp_size": 2, "cp_kv_exchange": "ring", "cp_prefix_mode": "regather"},
         "--cp-kv-exchange ring carries the chunk only"),
        ({"enable_sharded_cp": True}, "--enable-sharded-cp spreads the experts over the"),
        ({"afd_attention_size": 2}, "--afd-attention-size 2 and --afd-ffn-size 0"),
        ({"afd_attention_size": 1, "afd_ffn_size": 1, "ep_size": 2},
         "attention-FFN disaggregation runs with --pp-size 1 --tp-size 1 --ep-size 1"),
        ({"afd_attention_size": 1, "afd_ffn_size": 3, "afd_ffn_nodes": 2},
         "--afd-ffn-nodes 2 does not divide --afd-ffn-size 3"),
        ({"afd_attention_size": 1, "afd_ffn_size": 1, "afd_dispatch_mode": "three-stage"},
         "--afd-dispatch-mode 'three-stage' is not one of direct-rank, direct, two-stage"),
        ({"afd_attention_size": 1, "afd_ffn_size": 1, "enable_two_batch_overlap": True},
         "two-batch and single-batch overlap apply to expert parallelism"),
        ({"afd_attention_size": 1, "afd_ffn_size": 2, "nnodes": 2, "dist_init_addr": "h:1"},
         "--afd-attention-size \\+ --afd-ffn-size = 3 must be divisible by --nnodes 2"),
    ],
)
def test_invalid_settings_say_what_to_change(flags: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        EngineConfig.from_flags(**flags)


WEAK_KEYS = [
    "summer2024",  # a word list's
    "secret-pd-key-for-the-cluster-0001",  # long, but not hex: a phrase
    "0123456789abcdef0123456789abcde",  # 31 hex digits: under 128 bits
    "abababababababababababababababab",  # a pattern
    "0000000011111111000000001111111100",  # 2 distinct digits
]


@pytest.mark.parametrize("key", WEAK_KEYS)
@pytest.mark.parametrize(
    ("flags", "name"),
    [
        ({"disaggregation_mode": "prefill"}, "disaggregation_auth_key"),
        ({"nnodes": 2, "pp_size": 2, "dist_init_addr": "h:1"}, "dist_auth_key"),
    ],
)
def test_short_or_patterned_keys_are_refused(flags: dict[str, Any], name: str, key: str) -> None:
    """The PD key and the control plane's key must carry 128 random bits: a recorded
    handshake lets anyone test guesses offline. The refusal says how to make one."""
    with pytest.raises(ValueError, match=r"at least 32 hex digits.*openssl rand -hex 32"):
        EngineConfig.from_flags(**flags, **{name: key})
    EngineConfig.from_flags(**flags, **{name: secrets.token_hex(16)})  # 128 random bits do


def test_the_keys_from_the_environment_are_checked_too(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PIPESERVE_PD_AUTH_KEY", "summer2024")
    with pytest.raises(ValueError, match="PIPESERVE_PD_AUTH_KEY.*at least 32 hex digits"):
        EngineConfig.from_flags(disaggregation_mode="decode")
    monkeypatch.setenv("PIPESERVE_DIST_AUTH_KEY", "summer2024")
    with pytest.raises(ValueError, match="PIPESERVE_DIST_AUTH_KEY.*at least 32 hex digits"):
        EngineConfig.from_flags(nnodes=2, pp_size=2, dist_init_addr="h:1")


def test_valid_multi_node_layout() -> None:
    config = EngineConfig.from_flags(nnodes=2, node_rank=1, pp_size=4, dist_init_addr="h:1")
    assert config.parallel.world_size == 4


def test_afd_layout_counts_both_kinds_of_worker() -> None:
    p = EngineConfig.from_flags(afd_attention_size=3, afd_ffn_size=2).parallel
    assert (p.world_size, p.stage_width, p.attention_ranks) == (5, 5, 3)
    assert EngineConfig.from_flags(ep_size=2).parallel.attention_ranks == 2


# -- environment defaults ---------------------------------------------------------------


def test_smooth_factor_comes_from_env_when_the_flag_is_absent(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv(SMOOTH_ENV, "0.3")
    assert EngineConfig.from_flags().scheduler.smooth_factor == 0.3


@pytest.mark.parametrize("flag", [0.9, 0.0])  # 0.0 is a real value, not "unset"
def test_smooth_factor_flag_beats_env(monkeypatch: pytest.MonkeyPatch, flag: float) -> None:
    monkeypatch.setenv(SMOOTH_ENV, "0.3")
    config = EngineConfig.from_flags(dynamic_chunking_smooth_factor=flag)
    assert config.scheduler.smooth_factor == flag


def test_empty_env_means_the_default(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(SMOOTH_ENV, "")
    assert EngineConfig.from_flags().scheduler.smooth_factor == 0.75


def test_bad_env_values_are_reported(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(SMOOTH_ENV, "high")
    with pytest.raises(ValueError, match=f"{SMOOTH_ENV}='high' is not a number"):
        EngineConfig.from_flags()
    monkeypatch.setenv(SMOOTH_ENV, "2")
    with pytest.raises(ValueError, match=r"smooth factor 2.0 must be in \[0, 1\]"):
        EngineConfig.from_flags()


def test_layer_partition_falls_back_to_env(monkeypatch: pytest.MonkeyPatch) -> None:
    assert EngineConfig.from_flags().parallel.layer_partition is None
    monkeypatch.setenv(PARTITION_ENV, "3,5")
    assert EngineConfig.from_flags().parallel.layer_partition == "3,5"
    config = EngineConfig.from_flags(pp_layer_partition="4,4")
    assert config.parallel.layer_partition == "4,4"


def test_dynamic_chunking_flags_reach_the_chunk_policy() -> None:
    from pipeserve.engine.chunking import ChunkPolicy

    config = EngineConfig.from_flags(
        enable_dynamic_chunking=True, chunked_prefill_size=4096, dynamic_chunking_min_size=256,
        dynamic_chunking_model="quadratic", dynamic_chunking_profile_max_len=65536,
        dynamic_chunking_smooth_factor=0.6, dynamic_chunking_online=True,
    )
    assert ChunkPolicy.from_config(config) == ChunkPolicy(
        4096, True, smooth_factor=0.6, online=True, model="quadratic", min_size=256,
        profile_max_len=65536)
    default = ChunkPolicy.from_config(EngineConfig.from_flags(enable_dynamic_chunking=True))
    assert (default.model, default.min_size, default.profile_max_len) == (
        "prefix-quadratic", None, 32768)
    # no size given: picked at start-up for PP/TP layouts, the one-worker default otherwise
    assert ChunkPolicy.from_config(EngineConfig.from_flags(pp_size=2)).auto
    assert ChunkPolicy.from_config(EngineConfig.from_flags(tp_size=2)).auto
    one = ChunkPolicy.from_config(EngineConfig.from_flags())
    assert (one.auto, one.size) == (False, 2048)
    assert not ChunkPolicy.from_config(EngineConfig.from_flags(pp_size=2,
                                                               chunked_prefill_size=1024)).auto
    # without dynamic chunking its settings are not checked against the chunk size
    assert EngineConfig.from_flags(chunked_prefill_size=-1, dynamic_chunking_min_size=9999)
