"""The tcp transfer engine: prefill ranks' senders, fed batches chunk by chunk and called
layer by layer as the model's hook does, write every decode rank's layers x heads of a
request into the pages its room names (checked against one whole-model KV for each layout
pair of the plan's tests); the room is reported done exactly when all of it has arrived;
data for a room that is closed, or never opened, writes nothing."""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest
import torch
import zmq
from test_pd_kv_remap import CASES, pools_for, whole_kv

from pipeserve.context_parallel.layout import PageStriping
from pipeserve.disaggregation.pd.kv_remap import KVDestination, SideLayout
from pipeserve.disaggregation.pd.transfer import (
    KVReceiver,
    KVSender,
    ReceiverControl,
    new_room,
)
from pipeserve.scheduler.batch import ReqSlice, ScheduledBatch

pytestmark = pytest.mark.timeout(60)


def run_prefill(
    senders: dict, src: SideLayout, dest: KVDestination, runs: list, chunks: list, prefix: int = 0
) -> Iterator[int]:
    """What the prefill workers do: chunk after chunk (the first after a cached `prefix`),
    every stage's layers, each layer's hook after its forward; yields after each chunk."""
    for index, n in enumerate(chunks):
        s = ReqSlice("r", [0] * n, prefix, runs, False, chunk_index=index, kv_dest=dest)
        batch = ScheduledBatch(index, [s])
        for (stage, _tp), sender in senders.items():
            sender.begin(batch)
            for i in range(len(range(*src.stage_layers[stage]))):
                sender.after(i)
        prefix += n
        yield index


def wait_done(control: ReceiverControl, room: str, timeout: float = 20.0) -> list:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        done = control.poll()
        if done:
            return done
        time.sleep(0.01)
    return []


@pytest.fixture
def sides(request):
    made: list = []
    yield made
    for obj in made:
        (obj.shutdown if isinstance(obj, ReceiverControl) else obj.close)()


def build(case: str, sides: list, cached_prefix: int = 0):
    src, dst = CASES[case]
    whole = whole_kv(src.latent)
    # the same 40 positions sit in different slots on the two sides
    src_slots, dst_slots = torch.arange(8, 48), torch.arange(20, 60)
    src_pools = pools_for(src, whole, src_slots)
    dst_pools = pools_for(dst, None, None)
    receivers = {r: KVReceiver(dst_pools[r], dst, r, "127.0.0.1") for r in dst.ranks()}
    senders = {
        r: KVSender(src_pools[r], src, r, range(*src.stage_layers[r[0]]), 5.0) for r in src.ranks()
    }
    control = ReceiverControl(tuple(receivers[r].endpoint for r in dst.ranks()))
    sides += [*receivers.values(), *senders.values(), control]
    return src, dst, whole, dst_pools, senders, control, dst_slots


@pytest.mark.parametrize("case", list(CASES))
def test_chunks_arrive_layer_by_layer_into_the_reserved_pages(case: str, sides: list) -> None:
    src, dst, whole, dst_pools, senders, control, dst_slots = build(case, sides)
    room = new_room()
    control.open(room, [(20, 40)], 40)
    dest = KVDestination(room, control.endpoints, dst)
    # chunk 0 starts after a cached prefix of 12 positions: it sends those too
    for index in run_prefill(senders, src, dest, [(8, 40)], [10, 18], prefix=12):
        if index == 0:
            time.sleep(0.2)
            assert control.poll() == [], "done before the last chunk was sent"
    done = wait_done(control, room)
    assert [r for r, _ in done] == [room]
    stats = done[0][1]
    assert stats.nbytes > 0 and stats.wire_s >= 0 and stats.exposed_s >= 0
    src_slots = torch.arange(8, 48)
    for (stage, tp), pool in dst_pools.items():
        h0, h1 = dst.heads(tp)
        for layer in range(*dst.stage_layers[stage]):
            if dst.latent:
                assert torch.equal(pool.latent(layer)[dst_slots], whole.latent(layer)[src_slots])
                keys = pool.index_keys(layer)[dst_slots]
                assert torch.equal(keys, whole.index_keys(layer)[src_slots])
                continue
            for got, want in zip(pool.buffers(layer), whole.buffers(layer), strict=True):
                assert torch.equal(got[:, dst_slots], want[h0:h1, src_slots])


def test_a_closed_room_takes_nothing(sides: list) -> None:
    src, dst, _whole, dst_pools, senders, control, dst_slots = build("pp1->tp2", sides)
    room = new_room()
    control.open(room, [(20, 40)], 40)
    control.close(room)  # an aborted request: its pages may already be someone else's
    dest = KVDestination(room, control.endpoints, dst)
    list(run_prefill(senders, src, dest, [(8, 40)], [40]))
    time.sleep(0.5)
    assert control.poll() == []
    for pool in dst_pools.values():
        for buf, _ in pool.slot_buffers():
            assert torch.isnan(buf[:, dst_slots]).all()  # untouched
    never = KVDestination(new_room(), control.endpoints, dst)
    list(run_prefill(senders, src, never, [(8, 40)], [40]))
    time.sleep(0.3)
    for pool in dst_pools.values():
        for buf, _ in pool.slot_buffers():
            assert torch.isnan(buf[:, dst_slots]).all()


def test_a_send_to_nobody_gives_up_after_the_timeout() -> None:
    """A receiver that is gone: the sender's queue for it is bounded, the room given up."""
    src, dst = CASES["pp1->tp2"]
    whole = whole_kv(False)
    pool = pools_for(src, whole, torch.arange(8, 48))[(0, 0)]
    sender = KVSender(pool, src, (0, 0), range(6), 0.3)
    try:
        dest = KVDestination(new_room(), ("tcp://127.0.0.1:9", "tcp://127.0.0.1:9"), dst)
        for _ in range(30):  # far more than the high-water mark
            list(run_prefill({(0, 0): sender}, src, dest, [(8, 40)], [40]))
        deadline = time.monotonic() + 20
        while sender._out.qsize() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert sender._out.qsize() == 0, "the sender stays stuck on a dead receiver"
        assert dest.room in sender._failed
    finally:
        sender.close()


def test_context_parallel_ranks_each_send_the_pages_they_hold(sides: list) -> None:
    """Prefill CP2 (pages striped over the two ranks) -> decode TP2."""
    src, dst = SideLayout(((0, 6),), 1, 2), CASES["pp1->tp2"][1]
    whole = whole_kv(False)
    src_slots, dst_slots = torch.arange(8, 48), torch.arange(20, 60)
    senders, striping = {}, [PageStriping(2, r, 4) for r in range(2)]
    for r in range(2):
        pool = pools_for(src, None, None)[(0, 0)]
        mine = striping[r].owners(src_slots) == r
        local = striping[r].local_slots(src_slots[mine])
        for layer in range(6):
            for a, b in zip(whole.buffers(layer), pool.buffers(layer), strict=True):
                b[:, local] = a[:, src_slots[mine]]
        senders[r] = KVSender(pool, src, (0, 0), range(6), 5.0, striping[r])
    dst_pools = pools_for(dst, None, None)
    receivers = [KVReceiver(dst_pools[r], dst, r, "127.0.0.1") for r in dst.ranks()]
    control = ReceiverControl(tuple(r.endpoint for r in receivers))
    sides += [*receivers, *senders.values(), control]
    room = new_room()
    control.open(room, [(20, 40)], 40)
    dest = KVDestination(room, control.endpoints, dst)
    for r, sender in senders.items():  # each CP rank runs every chunk
        list(run_prefill({(0, r): sender}, src, dest, [(8, 40)], [10, 18], prefix=12))
    assert [room_id for room_id, _ in wait_done(control, room)] == [room]
    for (_, tp), pool in dst_pools.items():
        h0, h1 = dst.heads(tp)
        for layer in range(6):
            for got, want in zip(pool.buffers(layer), whole.buffers(layer), strict=True):
                assert torch.equal(got[:, dst_slots], want[h0:h1, src_slots])


def test_garbage_on_the_receiver_is_dropped_and_it_keeps_serving(sides: list) -> None:
    src, dst, whole, dst_pools, senders, control, dst_slots = build("pp1->tp2", sides)
    sock = zmq.Context.instance().socket(zmq.DEALER)
    try:
        sock.connect(control.endpoints[0])
        for frames in ([b"kv"], [b"kv", b"\xc1"], [b"open", b"\x93\x01"], [b"?", b""]):
            sock.send_multipart(frames)
    finally:
        sock.close(linger=1000)
    room = new_room()
    control.open(room, [(20, 40)], 40)
    list(run_prefill(senders, src, KVDestination(room, control.endpoints, dst), [(8, 40)], [40]))
    assert [r for r, _ in wait_done(control, room)] == [room]
