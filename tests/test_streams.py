"""The host/device protocol of pipeserve/streams.py, driven through a fake CUDA runtime
(tests/fake_cuda.py): inputs copied on the copy stream and waited on by the compute stream,
results copied back without blocking and waited on only when read, no device-wide sync."""

from __future__ import annotations

import pytest
import torch
from fake_cuda import FakeApi

from pipeserve.streams import DeviceStreams

CPU = torch.device("cpu")


def test_on_a_cpu_nothing_is_queued() -> None:
    streams = DeviceStreams(CPU)
    assert streams.api is None and streams.copy_stream is None
    with streams.upload() as up:
        [t] = up.move([torch.arange(3)])
    assert up.ready is None and up.tensors == []
    streams.wait(up.ready, up.tensors)
    host = streams.to_host([t * 2])
    assert host.get()[0].tolist() == [0, 2, 4]
    timer = streams.timer()
    timer.stop()
    assert timer.seconds() >= 0


def test_upload_is_one_copy_on_the_copy_stream_and_the_compute_stream_waits() -> None:
    api = FakeApi()
    streams = DeviceStreams(CPU, api)
    # 32 bytes, 8 bytes and 16 bytes, each at a 16-byte boundary: 64 bytes in one copy
    hosts = [torch.arange(4), torch.ones(2), torch.tensor([[1, 2], [3, 4]], dtype=torch.int32)]
    with streams.upload() as up:
        assert api.current_stream(CPU).name == "copy"  # device ops while preparing go there
        moved = up.move(hosts)
    assert api.current_stream(CPU).name.startswith("default")
    assert [(m.dtype, m.shape) for m in moved] == [(h.dtype, h.shape) for h in hosts]
    assert all(torch.equal(m, h) for m, h in zip(moved, hosts, strict=True))
    [copied] = up.tensors  # one buffer, of which the moved tensors are views
    assert all(m.untyped_storage().data_ptr() == copied.untyped_storage().data_ptr() for m in moved)
    assert api.log == [("pin",), ("upload", 64, "copy"), ("record", up.ready.id, "copy")]
    streams.wait(up.ready, up.tensors)
    compute = api.current_stream(CPU).name
    assert api.log[3:] == [("stream_wait", compute, up.ready.id), ("keep", compute)]


def test_a_buffer_still_being_packed_is_never_handed_out() -> None:
    """Another thread's upload still packing into a buffer (no copy recorded yet): a taker
    in turn gets a one-off buffer, not that one; a failed upload gives its buffer back
    after the copy it may have queued."""
    api = FakeApi()
    streams = DeviceStreams(CPU, api)
    ring = streams.staging
    assert ring is not None
    first = ring.take(64)
    ring.take(64)  # the other buffer
    slot, one_off = ring.take(64)  # first's turn again, while first is still packing
    assert slot is None and one_off.data_ptr() != first[1].data_ptr()
    streams = DeviceStreams(CPU, api)
    try:
        with streams.upload() as up:
            up.move([torch.arange(4)])
            raise RuntimeError("preparing failed")
    except RuntimeError:
        pass
    assert streams.staging is not None and up.slots == [0] and up.ready is not None
    assert not streams.staging.busy[0] and streams.staging.copied[0] is up.ready


def test_staging_buffers_alternate_and_are_packed_again_only_after_their_copy() -> None:
    """Two pinned buffers for every step (pinned once, grown seldom); the third step packs
    the first one's buffer after waiting for that step's copy, and sees no stale bytes."""
    api = FakeApi()
    streams = DeviceStreams(CPU, api)
    ups = []
    for step in range(6):
        with streams.upload() as up:
            [moved] = up.move([torch.full((100 + step,), step)])
        assert moved.tolist() == [step] * (100 + step)
        ups.append(up)
    assert sum(e == ("pin",) for e in api.log) == 2
    assert sum(e[0] == "upload" for e in api.log) == 6
    waited = [e[1] for e in api.log if e[0] == "host_wait"]
    assert waited == [u.ready.id for u in ups[:4]]  # step k + 2 waits for step k's copy
    for k in range(2, 6):
        wait = api.log.index(("host_wait", ups[k - 2].ready.id))
        uploads = [i for i, e in enumerate(api.log) if e[0] == "upload"]
        assert uploads[k - 1] < wait < uploads[k]


def test_results_come_back_without_blocking_until_read() -> None:
    api = FakeApi()
    streams = DeviceStreams(CPU, api)
    host = streams.to_host([torch.tensor([7, 8])])
    compute = api.current_stream(CPU).name
    (_, done, where) = api.log[-1]
    assert where == compute and not any(e[0] == "host_wait" for e in api.log)
    assert host.get()[0].tolist() == [7, 8]
    assert api.log[-1] == ("host_wait", done)
    host.get()
    assert sum(e[0] == "host_wait" for e in api.log) == 1  # waited once


def test_timer_reads_its_events_once_the_host_waits() -> None:
    api = FakeApi()
    streams = DeviceStreams(CPU, api)
    timer = streams.timer()
    timer.stop()
    assert not any(e[0] == "host_wait" for e in api.log)
    assert timer.seconds() >= 0
    assert [e[0] for e in api.log] == ["record", "record", "host_wait"]


def test_an_upload_into_a_persistent_buffer_on_the_current_stream() -> None:
    """What a CUDA graph's step does: one copy on the current (compute) stream into the
    graph's own buffer, no new device buffer to keep alive and nothing to wait for; a
    tensor lies where any list of the same sizes before it put it; a buffer too small is
    refused before anything is packed or copied."""
    api = FakeApi()
    streams = DeviceStreams(CPU, api)
    buffer = torch.zeros(256, dtype=torch.uint8)
    heads = [torch.arange(3), torch.tensor([7, 8], dtype=torch.int32)]
    with streams.upload(here=True) as up:
        moved = up.move([*heads, torch.arange(5)], into=buffer)
    with streams.upload(here=True) as again:
        other = again.move([torch.arange(3) + 10, torch.tensor([1, 2], dtype=torch.int32)], buffer)
    compute = api.current_stream(CPU).name
    assert [e for e in api.log if e[0] == "upload"] == [
        ("upload", 96, compute),
        ("upload", 48, compute),
    ]
    assert up.tensors == [] and again.tensors == []
    assert [m.data_ptr() for m in moved[:2]] == [o.data_ptr() for o in other]
    assert all(m.untyped_storage().data_ptr() == buffer.data_ptr() for m in moved)
    assert moved[0].tolist() == [10, 11, 12] and moved[2].tolist() == [0, 1, 2, 3, 4]
    pins = len(api.log)
    with pytest.raises(ValueError, match="do not fit"), streams.upload(here=True) as up:
        up.move([torch.zeros(80)], into=buffer)  # 320 bytes
    assert not any(e[0] in ("upload", "pin") for e in api.log[pins:])
