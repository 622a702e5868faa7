"""The host/device protocol of pipeserve/streams.py, driven through a fake CUDA runtime
(tests/fake_cuda.py): inputs copied on the copy stream and waited on by the compute stream,
results copied back without blocking and waited on only when read, no device-wide sync."""

from __future__ import annotations

import torch
from fake_cuda import FakeApi

from pipeserve.streams import DeviceStreams

CPU = torch.device("cpu")


def test_on_a_cpu_nothing_is_queued() -> None:
    streams = DeviceStreams(CPU)
    assert streams.api is None and streams.copy_stream is None
    with streams.upload() as up:
        t = up.move(torch.arange(3))
    assert up.ready is None and up.tensors == []
    streams.wait(up.ready, up.tensors)
    host = streams.to_host([t * 2])
    assert host.get()[0].tolist() == [0, 2, 4]
    timer = streams.timer()
    timer.stop()
    assert timer.seconds() >= 0


def test_upload_goes_through_the_copy_stream_and_the_compute_stream_waits() -> None:
    api = FakeApi()
    streams = DeviceStreams(CPU, api)
    with streams.upload() as up:
        assert api.current_stream(CPU).name == "copy"  # device ops while preparing go there
        a = up.move(torch.arange(4))
        b = up.move(torch.ones(2))
    assert api.current_stream(CPU).name.startswith("default")
    assert up.tensors == [a, b]
    assert api.log == [("pin",), ("pin",), ("record", up.ready.id, "copy")]
    streams.wait(up.ready, up.tensors)
    compute = api.current_stream(CPU).name
    assert api.log[3:] == [("stream_wait", compute, up.ready.id), ("keep", compute)] + [
        ("keep", compute)
    ]


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
