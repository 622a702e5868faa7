"""The KV cache tensors of this stage's layers."""

from __future__ import annotations

import torch


class KVPool:
    """K and V buffers per layer, each [kv_heads, num_slots, head_dim]: head-major, so one
    head's KV for a run of consecutive slots is contiguous and a request whose pages are
    consecutive is read as a view. Slot s of page p is p * page_size + s; page 0 is the
    padding target and stays zero."""

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
        self.num_slots = num_slots
        self.dtype = dtype
        self.first_layer = layers.start
        shape = (num_kv_heads, num_slots, head_dim)
        self.k = [torch.empty(shape, dtype=dtype, device=device) for _ in layers]
        self.v = [torch.empty(shape, dtype=dtype, device=device) for _ in layers]
        for buf in self.k + self.v:
            buf[:, :page_size].zero_()

    def buffers(self, layer_id: int) -> tuple[torch.Tensor, torch.Tensor]:
        i = layer_id - self.first_layer
        return self.k[i], self.v[i]

    @staticmethod
    def bytes_per_token(
        num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype
    ) -> int:
        return 2 * num_layers * num_kv_heads * head_dim * dtype.itemsize
