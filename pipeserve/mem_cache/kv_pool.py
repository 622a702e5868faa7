"""The KV cache tensors of this stage's layers."""

from __future__ import annotations

import torch

PAD_SLOT = 0  # page 0 is never a request's: padded reads and writes go there


class KVPool:
    """The cache of this stage's layers in one of two layouts with one slot numbering: slot s
    of page p is p * page_size + s; page 0 is the padding target: zero at start, and only
    ever written by the padded rows of a CUDA graph's decode step (runner/cuda_graph.py),
    with finite values that masked reads weigh zero.

    - K/V (MHA/GQA, the constructor): per layer K and V, each [kv_heads, num_slots, head_dim]:
      head-major, so one head's KV for a run of consecutive slots is contiguous and a request
      whose pages are consecutive is read as a view.
    - latent (MLA, `latent_layout`): per layer one [num_slots, width] buffer (MLA's
      kv_lora_rank + qk_rope_head_dim) and, for DeepSeek-V3.2, one [num_slots, extra_width]
      buffer of indexer keys; no per-head K/V.
    The buffers of the layout not built are empty lists."""

    k: list[torch.Tensor]
    v: list[torch.Tensor]
    latents: list[torch.Tensor]
    index_key_bufs: list[torch.Tensor]

    def __init__(
        self,
        num_slots: int,
        layers: range,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device,
        page_size: int,
    ) -> None:
        shape = (num_kv_heads, num_slots, head_dim)
        self._init_common(num_slots, layers, dtype)
        self.k = _alloc(layers, shape, dtype, device)
        self.v = _alloc(layers, shape, dtype, device)
        self.latents, self.index_key_bufs = [], []
        self.zero_slots(0, page_size)

    @classmethod
    def latent_layout(
        cls,
        num_slots: int,
        layers: range,
        width: int,
        dtype: torch.dtype,
        device: torch.device,
        page_size: int,
        extra_width: int = 0,
    ) -> KVPool:
        """The MLA layout: `width` values per token and layer, plus `extra_width` indexer key
        values (DeepSeek-V3.2) when above 0."""
        pool = cls.__new__(cls)
        pool._init_common(num_slots, layers, dtype)
        pool.k, pool.v = [], []
        pool.latents = _alloc(layers, (num_slots, width), dtype, device)
        extra = (num_slots, extra_width)
        pool.index_key_bufs = _alloc(layers, extra, dtype, device) if extra_width else []
        pool.zero_slots(0, page_size)
        return pool

    def _init_common(self, num_slots: int, layers: range, dtype: torch.dtype) -> None:
        self.num_slots = num_slots
        self.dtype = dtype
        self.first_layer = layers.start

    def buffers(self, layer_id: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of a layer, each [kv_heads, num_slots, head_dim]."""
        i = self._index(self.k, layer_id, "per-head K/V")
        return self.k[i], self.v[i]

    def latent(self, layer_id: int) -> torch.Tensor:
        """The latent cache of a layer: [num_slots, width]."""
        return self.latents[self._index(self.latents, layer_id, "latent cache")]

    def index_keys(self, layer_id: int) -> torch.Tensor:
        """The indexer key cache of a layer: [num_slots, extra_width]."""
        return self.index_key_bufs[self._index(self.index_key_bufs, layer_id, "indexer keys")]

    def _index(self, bufs: list[torch.Tensor], layer_id: int, what: str) -> int:
        if not bufs:
            raise ValueError(
                f"this KVPool holds no {what}: build it with KVPool(...) for per-head K/V or "
                "KVPool.latent_layout(...) for MLA (extra_width > 0 for indexer keys)"
            )
        return layer_id - self.first_layer

    def slot_buffers(self) -> list[tuple[torch.Tensor, int]]:
        """Every buffer of either layout with the dimension that indexes slots."""
        return [(b, 1) for b in self.k + self.v] + [
            (b, 0) for b in self.latents + self.index_key_bufs
        ]

    def zero_slots(self, start: int, n: int) -> None:
        """Zeroes slots [start, start + n) in every buffer of either layout."""
        for buf in self.k + self.v:  # [kv_heads, slots, head_dim]
            buf[:, start : start + n].zero_()
        for buf in self.latents + self.index_key_bufs:  # [slots, width]
            buf[start : start + n].zero_()

    @staticmethod
    def bytes_per_token(
        num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype
    ) -> int:
        """Bytes one token takes in the K/V layout."""
        return 2 * num_layers * num_kv_heads * head_dim * dtype.itemsize

    @staticmethod
    def latent_bytes_per_token(
        num_layers: int, width: int, dtype: torch.dtype, extra_width: int = 0
    ) -> int:
        """Bytes one token takes in the latent layout: one row per layer, no K/V pair, no heads."""
        return num_layers * (width + extra_width) * dtype.itemsize


def _alloc(
    layers: range, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device
) -> list[torch.Tensor]:
    return [torch.empty(shape, dtype=dtype, device=device) for _ in layers]
