"""Shard linear: which device holds each layer's largest attention projections, and when
they move. Pure planning: the engine asks these helpers what to broadcast, wait for and free.

Layer l's sharded projections (e.g. q_proj and o_proj) live whole on device l % W, their
owner. With L layers and K warm layers, one forward does, for each layer l in order:

1. prefetch: the owner of layer (l + K) mod L starts an asynchronous broadcast of it to
   every device (a receiver holds the layer's buffer from then on);
2. wait: every device but l's owner waits for l's broadcast to arrive;
3. run layer l;
4. release: every device but l's owner frees layer l.

Choices:
- The prefetch is cyclic: the last K layers of a forward prefetch layers 0..K-1 for the
  next forward (no layer index past the last is ever named). So warm layers are released
  after they run like any other layer not owned, and between forwards every device holds
  its own layers plus the K warm ones (arrived or arriving): a forward ends with what it
  started with, and the warm layers cost nothing beyond the prefetch window. The waits for
  warm layers are for the previous forward's broadcasts; before the first forward the
  loader places the warm layers, and those waits are no-ops.
- The prefetch window is K + 1 layers (all L once K >= L - 1): while layer l runs a device
  holds layers l..l+K (mod L), the running one and the K whose broadcasts were issued after
  it, arrived or in flight. Its peak is its own layers plus that window, less its own layers
  inside the window (see `expected_peak_layers`); nothing else is held.
- K = 0: each layer is broadcast at its own start and waited for at once; the first layer's
  broadcast is issued at the forward's start, exposed.
- K = L: every device holds every layer, and nothing is broadcast, waited for or released.
  (K = L - 1 also peaks at all L layers but still moves each one: never better than K = L.)
- W = 1: a broadcast would have no receiver, so none is issued.
- The owner never waits for its own layer: it is the broadcast's source and its copy is
  never rewritten.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Broadcast:
    """The owner `src` starts an asynchronous broadcast of `layer` to every device."""

    layer: int
    src: int
    next_forward: bool = False  # a warm layer, prefetched for the next forward


@dataclass(frozen=True)
class Wait:
    """`device` waits until `layer`'s broadcast has arrived."""

    layer: int
    device: int


@dataclass(frozen=True)
class Run:
    """Every device runs `layer` (on its own tokens)."""

    layer: int


@dataclass(frozen=True)
class Release:
    """`device` frees its copy of `layer`."""

    layer: int
    device: int


Event = Broadcast | Wait | Run | Release


@dataclass(frozen=True)
class ShardLinearPlan:
    """The placement and movement of sharded projections over one forward. Every layer's
    projections are assumed to be the same size."""

    num_layers: int  # L: layers whose projections are sharded, indexed 0..L-1
    world_size: int  # W: devices sharing them (the sharded-CP group)
    warm_layers: int  # K: layers 0..K-1 every device holds when a forward starts

    def __post_init__(self) -> None:
        if self.num_layers < 1:
            raise ValueError(f"shard linear needs at least one layer, got {self.num_layers}")
        if self.world_size < 1:
            raise ValueError(f"shard linear needs at least one device, got {self.world_size}")
        if self.warm_layers < 0:
            raise ValueError(f"--shard-linear-warm-layers {self.warm_layers} must be >= 0")
        if self.warm_layers > self.num_layers:
            raise ValueError(
                f"--shard-linear-warm-layers {self.warm_layers} exceeds the "
                f"{self.num_layers} layers"
            )

    @property
    def moves_weights(self) -> bool:
        """False when every device holds every layer (K = L) or there is one device."""
        return self.warm_layers < self.num_layers and self.world_size > 1

    @property
    def window(self) -> int:
        """The prefetch window in layers: the running one and the K prefetched after it."""
        return min(self.warm_layers + 1, self.num_layers)

    def owner(self, layer: int) -> int:
        self._check_layer(layer)
        return layer % self.world_size

    def owned_layers(self, device: int) -> range:
        self._check_device(device)
        return range(device, self.num_layers, self.world_size)

    def between_forwards(self, device: int) -> frozenset[int]:
        """What `device` holds when a forward starts (and so when it ends)."""
        return frozenset(self.owned_layers(device)) | frozenset(range(self.warm_layers))

    def layers_to_prefetch_at(self, layer: int) -> tuple[int, ...]:
        """Layers whose broadcast starts when `layer` starts (each from its owner)."""
        self._check_layer(layer)
        return ((layer + self.warm_layers) % self.num_layers,) if self.moves_weights else ()

    def layers_to_wait_before(self, layer: int, device: int) -> tuple[int, ...]:
        """Layers whose broadcast `device` must wait for before `layer` runs."""
        return (layer,) if self._receives(layer, device) else ()

    def layers_to_release_after(self, layer: int, device: int) -> tuple[int, ...]:
        """Layers `device` frees after `layer` has run."""
        return (layer,) if self._receives(layer, device) else ()

    def events(self) -> list[Event]:
        """One forward, in order, for all devices."""
        devices = range(self.world_size)
        out: list[Event] = []
        for layer in range(self.num_layers):
            for j in self.layers_to_prefetch_at(layer):
                out.append(Broadcast(j, self.owner(j), next_forward=j < layer))
            out += [Wait(j, d) for d in devices for j in self.layers_to_wait_before(layer, d)]
            out.append(Run(layer))
            out += [Release(j, d) for d in devices for j in self.layers_to_release_after(layer, d)]
        return out

    def resident(self, device: int) -> list[frozenset[int]]:
        """The layers `device` holds at the forward's start, then after each of `events()`."""
        held = self.between_forwards(device)
        points = [held]
        for event in self.events():
            match event:
                case Broadcast(layer=layer):
                    held = held | {layer}
                case Release(layer=layer, device=d) if d == device:
                    held = held - {layer}
            points.append(held)
        return points

    def peak_layers(self, device: int) -> int:
        return max(len(held) for held in self.resident(device))

    def peak_bytes(self, device: int, bytes_per_layer: int) -> int:
        """Simulated peak of `device`; `bytes_per_layer`: one layer's sharded projections."""
        return self.peak_layers(device) * bytes_per_layer

    def expected_peak_layers(self, device: int) -> int:
        """The analytic peak: the device's own layers (L / W of them when W divides L) plus
        the window, less its own layers inside the window where it holds fewest of them. A
        window of n layers starting at a longest run of G layers the device does not own
        holds ceil((n - G) / W) of its own. When W divides L that is every device's
        L/W + K + 1 - floor((K + 1) / W)."""
        if self.window == self.num_layers:
            return self.num_layers
        gap = self._longest_gap(device)
        own_in_window = -(-max(0, self.window - gap) // self.world_size)
        return len(self.owned_layers(device)) + self.window - own_in_window

    def expected_peak_bytes(self, device: int, bytes_per_layer: int) -> int:
        return self.expected_peak_layers(device) * bytes_per_layer

    def _longest_gap(self, device: int) -> int:
        """The longest run of consecutive layers `device` does not own, counted across the
        forward boundary (layer L - 1 is followed by the next forward's layer 0)."""
        owned = len(self.owned_layers(device))
        if owned == 0:
            return self.num_layers
        across = self.num_layers - 1 - (owned - 1) * self.world_size
        return max(across, self.world_size - 1) if owned > 1 else across

    def _receives(self, layer: int, device: int) -> bool:
        """Whether `device` gets `layer` by broadcast (rather than owning or keeping it)."""
        self._check_device(device)
        return self.owner(layer) != device and self.moves_weights

    def _check_layer(self, layer: int) -> None:
        if not 0 <= layer < self.num_layers:
            raise ValueError(
                f"layer {layer} is outside the {self.num_layers} layers (0..{self.num_layers - 1})"
            )

    def _check_device(self, device: int) -> None:
        if not 0 <= device < self.world_size:
            raise ValueError(
                f"device {device} is outside the world of {self.world_size} "
                f"(0..{self.world_size - 1})"
            )
