"""Rotary position embedding: the frequency schedules (default, linear, Llama-3, YaRN), the
per-token cos/sin tables, and their application to a whole head or to the rotary part of one.

Layouts. Half-split (`interleaved=False`, GPT-NeoX / `rotate_half`) pairs channel i with channel
i + d/2. Interleaved pairs channels 2i and 2i + 1. As in transformers, the interleaved form
returns its result de-interleaved (the pairs' first components, then their second ones): one
fixed permutation shared by q and k, so q·k equals that of an in-place pairwise rotation, and
rotated keys reach the cache in half-split order.

Which DeepSeek part uses which (transformers 5, modeling_deepseek_v3.py / modeling_deepseek_v32.py):
- V3 MLA: q's rotary part is the last qk_rope_head_dim channels of each head (after the
  qk_nope_head_dim ones); k's is one head shared by all, the tail of kv_a_proj_with_mqa's output.
  Interleaved when the config's `rope_interleave` is true (its default), half-split otherwise.
- V3.2 MLA: the same split, always interleaved (V3.2 does not read `rope_interleave`).
- V3.2 indexer: half-split, and the rotary part is the FIRST qk_rope_head_dim channels of its
  index_head_dim q heads and its single k head. Its scores use index_head_dim**-0.5, no mscale.
All three share the model's one cos/sin table: rotary dim qk_rope_head_dim, YaRN's attention
factor folded in. The MLA softmax scale is `mla_softmax_scale`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

SCALING_TYPES = ("linear", "llama3", "yarn")
_REQUIRED = {
    "llama3": ("original_max_position_embeddings", "low_freq_factor", "high_freq_factor"),
    "yarn": ("original_max_position_embeddings",),
}


@dataclass(frozen=True)
class RopeScaling:
    """Frequency scaling of one checkpoint under transformers' names, built from config.json by
    `RopeConfig.scaling`. No scaling (rope_type "default") is `None`, not an instance.
    Fields a type does not use keep their defaults; 0 means "not given"."""

    rope_type: str  # one of SCALING_TYPES
    factor: float  # context extension ratio
    original_max_position_embeddings: int = 0  # pre-training context (llama3, yarn)
    low_freq_factor: float = 0.0  # llama3: wavelengths over original/low are divided by factor
    high_freq_factor: float = 0.0  # llama3: wavelengths under original/high are kept
    beta_fast: float = 32.0  # yarn: pairs turning more often over the original context are kept
    beta_slow: float = 1.0  # yarn: pairs turning less often are divided by factor
    mscale: float = 0.0  # yarn: numerator coefficient of the cos/sin attention factor
    mscale_all_dim: float = 0.0  # yarn: its denominator; DeepSeek squares it into softmax scale
    attention_factor: float | None = None  # yarn: explicit cos/sin factor, overrides the mscales
    truncate: bool = True  # yarn: round the ramp's ends out to whole channel pairs

    def __post_init__(self) -> None:
        if self.rope_type not in SCALING_TYPES:
            supported = ", ".join(SCALING_TYPES)
            raise ValueError(f"rope scaling type {self.rope_type!r} is not one of {supported}")
        missing = [k for k in _REQUIRED.get(self.rope_type, ()) if not getattr(self, k)]
        if missing:
            raise ValueError(
                f"rope scaling {self.rope_type!r} needs {', '.join(missing)}; add them to the "
                "checkpoint's rope_scaling"
            )


def inverse_frequencies(rotary_dim: int, theta: float, scaling: RopeScaling | None) -> torch.Tensor:
    """[rotary_dim // 2] float32: the angle per position of each channel pair."""
    powers = theta ** (torch.arange(0, rotary_dim, 2, dtype=torch.int64).float() / rotary_dim)
    if scaling is None:
        return 1.0 / powers
    if scaling.rope_type == "linear":
        return 1.0 / powers / scaling.factor
    if scaling.rope_type == "llama3":
        return _llama3(1.0 / powers, scaling)
    return _yarn(powers, rotary_dim, theta, scaling)


def _llama3(inv_freq: torch.Tensor, s: RopeScaling) -> torch.Tensor:
    """Long wavelengths are divided by `factor`, short ones kept, the band between blended."""
    factor, low, high = s.factor, s.low_freq_factor, s.high_freq_factor
    old_len = s.original_max_position_embeddings
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    blended = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= old_len / high) & (wavelen <= old_len / low)
    return torch.where(medium, blended, scaled)


def _yarn(powers: torch.Tensor, dim: int, theta: float, s: RopeScaling) -> torch.Tensor:
    """powers: theta**(2i/dim). Pairs that turn more than beta_fast times over the original
    context keep their frequency, those under beta_slow turns are divided by `factor`, and a
    linear ramp over the pair index blends the two in between."""
    low, high = _yarn_ramp_ends(dim, theta, s)
    if low == high:
        high += 0.001  # a ramp of zero width would divide by zero
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    kept = 1 - ramp  # weight of the unscaled frequency
    return 1.0 / (s.factor * powers) * (1 - kept) + 1.0 / powers * kept


def _yarn_ramp_ends(dim: int, theta: float, s: RopeScaling) -> tuple[float, float]:
    """Pair indices (fractional unless truncated) turning beta_fast and beta_slow times."""

    def pair_index(turns: float) -> float:
        wavelengths = s.original_max_position_embeddings / (turns * 2 * math.pi)
        return (dim * math.log(wavelengths)) / (2 * math.log(theta))

    low, high = pair_index(s.beta_fast), pair_index(s.beta_slow)
    if s.truncate:
        low, high = math.floor(low), math.ceil(high)
    return max(low, 0), min(high, dim - 1)


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    """YaRN's magnitude correction 0.1·mscale·ln(factor) + 1; 1 when not extending."""
    if factor <= 1:
        return 1.0
    return 0.1 * mscale * math.log(factor) + 1.0


def rope_attention_factor(scaling: RopeScaling | None) -> float:
    """What cos and sin are multiplied by (transformers' `attention_scaling`): for yarn an
    explicit attention_factor, else mscale(mscale) / mscale(mscale_all_dim) when both are set,
    else mscale(1); 1 for every other type."""
    if scaling is None or scaling.rope_type != "yarn":
        return 1.0
    if scaling.attention_factor is not None:
        return scaling.attention_factor
    factor, mscale, mscale_all_dim = scaling.factor, scaling.mscale, scaling.mscale_all_dim
    if mscale and mscale_all_dim:
        return yarn_mscale(factor, mscale) / yarn_mscale(factor, mscale_all_dim)
    return yarn_mscale(factor)


def mla_softmax_scale(qk_head_dim: int, scaling: RopeScaling | None) -> float:
    """Softmax scale of DeepSeek's MLA (V2, V3, V3.2), qk_head_dim = qk_nope_head_dim +
    qk_rope_head_dim: qk_head_dim**-0.5, times yarn_mscale(factor, mscale_all_dim)**2 when the
    scaling (of any type) sets mscale_all_dim, as transformers' DeepseekV3Attention.scaling.
    With mscale == mscale_all_dim the cos/sin factor is 1 and all of YaRN's correction is here."""
    scale = qk_head_dim**-0.5
    if scaling is not None and scaling.mscale_all_dim:
        m = yarn_mscale(scaling.factor, scaling.mscale_all_dim)
        scale = scale * m * m
    return scale


class RotaryEmbedding:
    """The frequencies of one model; `cos_sin` turns them into per-token tables.
    rotary_dim: the rotated channels per head (head_dim, or qk_rope_head_dim for DeepSeek)."""

    def __init__(self, rotary_dim: int, theta: float, scaling: RopeScaling | None) -> None:
        self.inv_freq = inverse_frequencies(rotary_dim, theta, scaling)
        self.attention_factor = rope_attention_factor(scaling)

    def cos_sin(
        self, positions: torch.Tensor, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Per-token tables, computed once per forward and shared by all layers: cos, sin of
        shape [tokens, 1, rotary_dim], in float32 with the attention factor, then cast."""
        freqs = positions.float()[:, None] * self.inv_freq.to(positions.device)[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        cos, sin = emb.cos() * self.attention_factor, emb.sin() * self.attention_factor
        return cos.to(dtype)[:, None, :], sin.to(dtype)[:, None, :]


def apply_rotary(
    x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleaved: bool = False
) -> torch.Tensor:
    """x: [tokens, heads, rotary_dim]. Interleaved input comes back de-interleaved (see top)."""
    if interleaved:
        x = torch.cat((x[..., 0::2], x[..., 1::2]), dim=-1)  # pair (2i, 2i+1) -> (i, i + d/2)
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


def apply_rotary_part(
    x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, start: int, interleaved: bool = False
) -> torch.Tensor:
    """x: [tokens, heads, head_dim] -> the same shape with channels [start, start + rotary_dim)
    rotated and the others as they were. DeepSeek MLA: start = qk_nope_head_dim (rotary part
    last); V3.2's indexer: start = 0 (rotary part first)."""
    rot = cos.shape[-1]
    before, part, after = x.split((start, rot, x.shape[-1] - start - rot), dim=-1)
    return torch.cat((before, apply_rotary(part, cos, sin, interleaved), after), dim=-1)
