"""The tcp transfer engine: prefill ranks' senders, fed batches chunk by chunk and called
layer by layer as the model's hook does, write every decode rank's layers x heads of a
request into the pages its room names (checked against one whole-model KV for each layout
pair of the plan's tests, over the CURVE link); the room is reported done exactly when all
of it has arrived; data for a room that is closed, never opened or expired writes nothing.

Hostile peers: a peer without the PD key gets nothing in; forged messages from a key holder
(an `open` on the data link, kv for another stage, heads, positions or size) change nothing
and are counted; a destination that cannot be reached, or never takes anything, holds no
other destination up; a connection lost mid-transfer fails its rooms only. (The link's own
refusals, limits and framing: test_pd_link.py.)"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from typing import Any

import msgpack
import pytest
import torch
from ports import free_port
from test_pd_kv_remap import CASES, pools_for, whole_kv
from test_pd_link import RawPeer

from pipeserve.context_parallel.layout import PageStriping
from pipeserve.disaggregation.pd import auth, link
from pipeserve.disaggregation.pd.kv_remap import KVDestination, SideLayout
from pipeserve.disaggregation.pd.link import Channel
from pipeserve.disaggregation.pd.transfer import (
    MAX_MESSAGE_POSITIONS,
    KVReceiver,
    KVSender,
    ReceiverControl,
    RoomRefused,
    new_room,
    split_positions,
)
from pipeserve.distributed.messages import (
    KV_ANSWER,
    KV_CONTROL,
    KV_HEADER,
    KVHeader,
    OpenRoom,
    RoomAnswer,
)
from pipeserve.scheduler.batch import ReqSlice, ScheduledBatch

pytestmark = pytest.mark.timeout(60)

KEY = "5f0c9a3e7b21d48e6a90c3f1b7d2e5a4"


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


def assert_received_whole(
    dst: SideLayout,
    dst_pools: dict,
    whole: Any,
    dst_slots: torch.Tensor,
    src_slots: torch.Tensor | None = None,
) -> None:
    """Every decode rank's slots hold its heads of the whole KV (6 layers) as the prefill
    side had them at `src_slots` (8..47 unless given)."""
    src_slots = torch.arange(8, 48) if src_slots is None else src_slots
    for (_, tp), pool in dst_pools.items():
        h0, h1 = dst.heads(tp)
        for layer in range(6):
            for got, want in zip(pool.buffers(layer), whole.buffers(layer), strict=True):
                assert torch.equal(got[:, dst_slots], want[h0:h1, src_slots])


@pytest.fixture
def sides(request):
    made: list = []
    yield made
    for obj in made:
        (obj.shutdown if isinstance(obj, ReceiverControl) else obj.close)()


def build(case: str, sides: list, room_ttl_s: float = 3600.0):
    src, dst = CASES[case]
    whole = whole_kv(src.latent)
    # the same 40 positions sit in different slots on the two sides
    src_slots, dst_slots = torch.arange(8, 48), torch.arange(20, 60)
    src_pools = pools_for(src, whole, src_slots)
    dst_pools = pools_for(dst, None, None)
    receivers = {r: KVReceiver(dst_pools[r], dst, r, "127.0.0.1", KEY) for r in dst.ranks()}
    senders = {
        r: KVSender(src_pools[r], src, r, range(*src.stage_layers[r[0]]), 5.0, key=KEY)
        for r in src.ranks()
    }
    control = control_of([receivers[r] for r in dst.ranks()], room_ttl_s)
    sides += [*receivers.values(), *senders.values(), control]
    return src, dst, whole, dst_pools, senders, control, dst_slots


def lone_sender(src: SideLayout, timeout_s: float, sides: list) -> KVSender:
    """The one rank of a PP1 prefill side, over a whole-model KV, giving up after
    `timeout_s`."""
    pool = pools_for(src, whole_kv(False), torch.arange(8, 48))[(0, 0)]
    sender = KVSender(pool, src, (0, 0), range(6), timeout_s, key=KEY)
    sides.append(sender)
    return sender


def control_of(receivers: list[KVReceiver], room_ttl_s: float = 3600.0) -> ReceiverControl:
    return ReceiverControl(
        tuple(r.endpoint for r in receivers),
        tuple((r.control_endpoint, r.control_secret) for r in receivers),
        room_ttl_s=room_ttl_s,
    )


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
        senders[r] = KVSender(pool, src, (0, 0), range(6), 5.0, striping[r], KEY)
    dst_pools = pools_for(dst, None, None)
    receivers = [KVReceiver(dst_pools[r], dst, r, "127.0.0.1", KEY) for r in dst.ranks()]
    control = control_of(receivers)
    sides += [*receivers, *senders.values(), control]
    room = new_room()
    control.open(room, [(20, 40)], 40)
    dest = KVDestination(room, control.endpoints, dst)
    for r, sender in senders.items():  # each CP rank runs every chunk
        list(run_prefill({(0, r): sender}, src, dest, [(8, 40)], [10, 18], prefix=12))
    assert [room_id for room_id, _ in wait_done(control, room)] == [room]
    assert_received_whole(dst, dst_pools, whole, dst_slots, src_slots)


def peer(endpoint: str, key: str = KEY) -> RawPeer:
    """A peer of a receiver's data link holding the PD key (a prefill worker, or anyone who
    has it) or another."""
    return RawPeer(endpoint, auth.kv_link_secret(key))


def kv_message(room: str, layer: int, heads: tuple, runs: list, nbytes: int) -> list[bytes]:
    header = KV_HEADER.encode(KVHeader(room, layer, *heads, [tuple(r) for r in runs], time.time()))
    frame = torch.ones(nbytes // 4).numpy().tobytes()
    return [header, frame, frame]


def untouched(pools: dict, slots: torch.Tensor) -> bool:
    return all(torch.isnan(b[:, slots]).all() for p in pools.values() for b, _ in p.slot_buffers())


def wait_dropped(control: ReceiverControl, n: int, timeout: float = 20.0) -> int:
    deadline = time.monotonic() + timeout
    while control.dropped < n and time.monotonic() < deadline:
        control.poll()
        time.sleep(0.05)
    return control.dropped


def test_a_peer_without_the_key_gets_nothing_in(sides: list) -> None:
    src, dst, _whole, dst_pools, senders, control, dst_slots = build("pp1->tp2", sides)
    room = new_room()
    control.open(room, [(20, 40)], 40)
    control_secret = control.controls[0][1]
    for secret in (auth.kv_link_secret("0" * 31 + "1"), control_secret):
        # the control link's secret opens the data link no more than any other
        sock = RawPeer(control.endpoints[0], secret)
        assert sock.reply == b"" and not sock.authentic  # closed at its hello, unanswered
        sock.close()
    assert untouched(dst_pools, dst_slots)
    assert control.dropped == 0 or wait_dropped(control, 1, 2.0) == 0  # never got in
    # the receivers keep serving the real prefill side
    list(run_prefill(senders, src, KVDestination(room, control.endpoints, dst), [(8, 40)], [40]))
    assert [r for r, _ in wait_done(control, room)] == [room]


def test_forged_messages_change_nothing_and_are_counted(sides: list) -> None:
    """Even from a peer holding the key: every check of a kv message drops what fails it."""
    src, dst, whole, dst_pools, senders, control, dst_slots = build("pp1->tp2", sides)
    room = new_room()
    control.open(room, [(20, 40)], 40)
    size = 40 * 4 * 4  # one head x 40 positions x head_dim 4 x float32
    forged = [
        [b"open", msgpack.packb([new_room(), [[0, 64]], 64, 1e9])],  # rooms are not opened here
        kv_message(new_room(), 0, (0, 1), [[0, 40]], size),  # no such room
        kv_message(room, 6, (0, 1), [[0, 40]], size),  # a layer this stage does not hold
        kv_message(room, 0, (1, 2), [[0, 40]], size),  # heads of the other rank
        kv_message(room, 0, (0, 1), [[30, 20]], 20 * 16),  # positions past the room's 40
        kv_message(room, 0, (0, 1), [[-4, 8]], 8 * 16),  # before its start
        kv_message(room, 0, (0, 1), [[0, 40]], size - 16),  # the wrong byte size
        kv_message(room, 0, (0, 1), [[0, MAX_MESSAGE_POSITIONS + 1]], 16),  # too many
        kv_message(room, 0, (0, 1), [], 0),  # no positions
        [b"\xc1", b""],  # a header that does not decode
        [msgpack.packb([room, "0", 0, 1, [[0, 40]], 0.0]), b"", b""],  # wrong types
        [msgpack.packb([room, 0, 0, 1, [[0, 40]], 0.0])],  # no data
    ]
    sock = peer(control.endpoints[0])
    try:
        for frames in forged:
            sock.sock.sendall(sock.message(frames))
        assert wait_dropped(control, len(forged)) == len(forged)
    finally:
        sock.close()
    assert untouched(dst_pools, dst_slots)
    assert control.poll() == []  # nothing counted towards the room
    list(run_prefill(senders, src, KVDestination(room, control.endpoints, dst), [(8, 40)], [40]))
    assert [r for r, _ in wait_done(control, room)] == [room]
    assert_received_whole(dst, dst_pools, whole, dst_slots)


def tcp_receiver(dst: SideLayout, sides: list) -> KVReceiver:
    """Rank (0, 0) of `dst` with its control listener on tcp (as on a node other than the
    engine's), over a pool of NaNs."""
    pool = pools_for(dst, None, None)[(0, 0)]
    receiver = KVReceiver(pool, dst, (0, 0), "127.0.0.1", KEY, remote_control=True)
    sides.append(receiver)
    return receiver


def test_the_pd_key_does_not_open_the_control_link(sides: list) -> None:
    """The control link's secret is random per receiver, not derived from the PD key: a PD
    key holder (a prefill server, say) cannot open rooms; only the engine that read the
    secret from its worker's ready message can."""
    _src, dst = CASES["pp1->tp2"]
    receiver = tcp_receiver(dst, sides)
    for secret in (
        auth.kv_link_secret(KEY),
        link.derive(KEY, "disaggregation kv control"),  # what the old code derived
    ):
        stranger = RawPeer(receiver.control_endpoint, secret)
        assert stranger.reply == b"" and not stranger.authentic
        stranger.close()
    other = tcp_receiver(dst, sides)
    assert other.control_secret != receiver.control_secret
    control = ReceiverControl(
        (receiver.endpoint,), ((receiver.control_endpoint, receiver.control_secret),)
    )
    sides.append(control)
    control.open(new_room(), [(0, 8)], 8)  # the engine's own opens go through


def ask(channel: Channel, message: list[bytes]) -> str:
    """Send one control message on `channel` and return the answer."""
    deadline = time.monotonic() + 10
    while not channel.ready:
        assert time.monotonic() < deadline, "no handshake"
        link.drive([channel], 0.05)
    channel.send(message)
    while True:
        assert time.monotonic() < deadline, "no answer"
        for _, frames in link.drive([channel], 0.05):
            answer = KV_ANSWER.decode(bytes(frames[0]))
            assert isinstance(answer, RoomAnswer), answer
            return answer.answer


def test_opens_over_held_or_foreign_slots_are_refused(sides: list) -> None:
    """Even with the control link's secret, an open is refused (answered `refused`, counted)
    unless its slots lie inside the pool and no open room holds them, its time to live is
    finite and bounded, and its room is new; the room already there keeps its KV."""
    src, dst, whole, dst_pools, senders, control, dst_slots = build("pp1->tp2", sides)
    room = new_room()
    control.open(room, [(20, 40)], 40)
    receiver = next(r for r in sides if isinstance(r, KVReceiver))
    num_slots = receiver.pool.num_slots
    bad = [
        ([(30, 8)], 8, 60.0, "slots another room holds"),  # inside the open room
        ([(0, 4), (2, 4)], 8, 60.0, "slots another room holds"),  # overlapping itself
        ([(num_slots - 2, 4)], 4, 60.0, "slots outside the pool"),
        ([(-1, 2)], 2, 60.0, "slots outside the pool"),
        ([(0, 4)], 5, 60.0, "slot runs that do not cover its tokens"),
        ([(0, 4)], 4, float("nan"), "a time to live that is not finite and positive"),
        ([(0, 4)], 4, float("inf"), "a time to live that is not finite and positive"),
        ([(0, 4)], 4, -1.0, "a time to live that is not finite and positive"),
    ]
    # the engine's own opens, sent as they are (not capped as ReceiverControl caps them)
    endpoint, secret = control.controls[0]
    link_ = Channel.connect(endpoint, secret, 1 << 20)
    for runs, n, ttl, reason in bad:
        body = KV_CONTROL.encode(OpenRoom(new_room(), runs, n, ttl))
        assert ask(link_, [body]) == "refused", reason
        assert receiver.refused_opens[reason] >= 1, reason
    link_.close()
    with pytest.raises(RoomRefused, match="refused to open"):
        control.open(room, [(80, 4)], 4)  # a room id already open
    assert receiver.refused_opens["a room that is open already"] == 1
    control.room_ttl_s = float("inf")  # ReceiverControl caps what it asks for
    control.open(new_room(), [(num_slots - 4, 4)], 4)
    # the refused opens left the first room alone: its KV arrives whole
    list(run_prefill(senders, src, KVDestination(room, control.endpoints, dst), [(8, 40)], [40]))
    assert [r for r, _ in wait_done(control, room)] == [room]
    assert_received_whole(dst, dst_pools, whole, dst_slots)
    control.open(new_room(), [(20, 40)], 40)  # once done, its slots may be opened again


def test_a_room_is_done_only_when_every_position_arrived_once(sides: list) -> None:
    """One piece sent again and again (by a PD key holder) is taken once and then dropped:
    six copies of a layer's 40 positions add up to a rank's 240 units (6 layers x 1 head x
    40), but the room is not done until every other layer has come too."""
    src, dst, _whole, _dst_pools, senders, control, _dst_slots = build("pp1->tp2", sides)
    room = new_room()
    control.open(room, [(20, 40)], 40)
    for rank, endpoint in enumerate(control.endpoints):
        sock = peer(endpoint)
        try:
            piece = kv_message(room, 0, (rank, rank + 1), [[0, 40]], 40 * 4 * 4)
            for _ in range(6):
                sock.sock.sendall(sock.message(piece))
            overlapping = kv_message(room, 0, (rank, rank + 1), [[10, 20]], 20 * 4 * 4)
            sock.sock.sendall(sock.message(overlapping))
        finally:
            sock.close()
    assert wait_dropped(control, 2 * 6) == 2 * 6  # 5 repeats and 1 overlap per rank
    assert wait_done(control, room, timeout=1) == []
    dest = KVDestination(room, control.endpoints, dst)
    list(run_prefill(senders, src, dest, [(8, 40)], [40]))  # layer 0 again, then the rest
    assert [r for r, _ in wait_done(control, room)] == [room]
    assert wait_dropped(control, 2 * 6 + 2) == 2 * 6 + 2  # and the real sender's repeats


def test_a_room_expires_with_its_request(sides: list) -> None:
    src, dst, _whole, dst_pools, senders, control, dst_slots = build(
        "pp1->tp2", sides, room_ttl_s=0.3
    )
    room = new_room()
    control.open(room, [(20, 40)], 40)
    time.sleep(0.8)  # the request is long over: nobody closed the room, it went by itself
    list(run_prefill(senders, src, KVDestination(room, control.endpoints, dst), [(8, 40)], [40]))
    assert wait_dropped(control, 1) >= 1
    assert control.poll() == [] and untouched(dst_pools, dst_slots)


def test_unreachable_and_silent_destinations_hold_up_no_other(sides: list) -> None:
    """A destination that is not tcp:// fails its room at once; 20 that take nothing
    wait out their timeout (30 s) each on their own: a room to a live receiver queued after
    all of them arrives meanwhile, while none of theirs has been given up yet."""
    src, dst, _whole, _dst_pools, _senders, control, _dst_slots = build("pp1->tp2", sides)
    sender = lone_sender(src, 30.0, sides)
    bad = KVDestination(new_room(), ("foo://bar", "foo://bar"), dst)
    list(run_prefill({(0, 0): sender}, src, bad, [(8, 40)], [40]))
    silent = []
    for _ in range(20):
        port = free_port()  # nobody listens on it (and a connect cannot land on itself)
        dest = KVDestination(new_room(), (f"tcp://127.0.0.1:{port}",) * 2, dst)
        silent.append(dest.room)
        list(run_prefill({(0, 0): sender}, src, dest, [(8, 40)], [40]))
    room = new_room()
    control.open(room, [(20, 40)], 40)
    live = KVDestination(room, control.endpoints, dst)
    list(run_prefill({(0, 0): sender}, src, live, [(8, 40)], [40]))
    assert [r for r, _ in wait_done(control, room)] == [room]
    assert bad.room in sender._failed and sender.given_up == 1
    assert not set(silent) & set(sender._failed)  # still waiting out their own timeout
    assert sender.alive


def test_a_sender_that_stopped_fails_the_forward() -> None:
    """The worker fails (so the server's /health does) rather than dropping KV silently."""
    src, dst = CASES["pp1->tp2"]
    pool = pools_for(src, whole_kv(False), torch.arange(8, 48))[(0, 0)]
    sender = KVSender(pool, src, (0, 0), range(6), 1.0, key=KEY)
    sender.close()
    dest = KVDestination(new_room(), ("tcp://127.0.0.1:9",) * 2, dst)
    with pytest.raises(RuntimeError, match="sender thread has stopped"):
        list(run_prefill({(0, 0): sender}, src, dest, [(8, 40)], [40]))


def test_messages_carry_at_most_max_positions() -> None:
    slots = torch.arange(100, 113)
    parts = split_positions([(0, 5), (10, 8)], slots, 4)
    assert [runs for runs, _ in parts] == [[(0, 4)], [(4, 1), (10, 3)], [(13, 4)], [(17, 1)]]
    assert torch.equal(torch.cat([s for _, s in parts]), slots)
    assert [len(s) for _, s in parts] == [4, 4, 4, 1]


def test_an_error_writing_one_message_leaves_the_receiver_serving(sides: list) -> None:
    """A bug while writing one message (here: forced) drops and counts that message; the
    thread keeps serving the next room."""
    src, dst, _whole, _dst_pools, senders, control, _dst_slots = build("pp1->tp2", sides)
    receiver = next(obj for obj in sides if isinstance(obj, KVReceiver))
    real = receiver._write
    failures = []

    def once_broken(header, frames):
        if not failures:
            failures.append(header.room)
            raise RuntimeError("forced")
        return real(header, frames)

    receiver._write = once_broken  # type: ignore[method-assign]
    first = new_room()
    control.open(first, [(20, 40)], 40)
    list(run_prefill(senders, src, KVDestination(first, control.endpoints, dst), [(8, 40)], [40]))
    assert wait_dropped(control, 1) == 1 and failures == [first]
    control.close(first)  # one message of it never landed: the request would time out
    second = new_room()
    control.open(second, [(20, 40)], 40)
    list(run_prefill(senders, src, KVDestination(second, control.endpoints, dst), [(8, 40)], [40]))
    assert [r for r, _ in wait_done(control, second)] == [second]


def test_a_connection_lost_mid_transfer_fails_its_rooms_only(sides: list) -> None:
    """A receiver that closes the connection after the first message of a room: that room
    is given up (what was in flight is gone, it can never complete), and the sender connects
    again for the next room, which arrives whole."""
    from pipeserve.disaggregation.pd.link import Server

    src, dst, _whole, _dst_pools, _senders, control, _dst_slots = build("pp1->tp2", sides)
    server = Server()
    listener = server.listen("tcp://127.0.0.1:*", auth.kv_link_secret(KEY), 1 << 20, 4, 4)
    seen: set = set()  # the connections messages came on

    def cut_after_one() -> None:
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline and len(seen) < 2:
            for _listener, channel, _message in server.poll(0.02):
                seen.add(channel)
                server.drop(channel)
        server.close()

    thread = threading.Thread(target=cut_after_one, daemon=True)
    thread.start()
    sender = lone_sender(src, 10.0, sides)
    cut = KVDestination(new_room(), (listener.endpoint,) * 2, dst)
    list(run_prefill({(0, 0): sender}, src, cut, [(8, 40)], [40]))
    deadline = time.monotonic() + 10
    while cut.room not in sender._failed and time.monotonic() < deadline:
        time.sleep(0.02)
    assert cut.room in sender._failed and sender.given_up == 1
    again = KVDestination(new_room(), (listener.endpoint,) * 2, dst)
    list(run_prefill({(0, 0): sender}, src, again, [(8, 40)], [40]))
    thread.join(15)
    assert len(seen) == 2  # the second room came on a new connection
    room = new_room()
    control.open(room, [(20, 40)], 40)
    live = KVDestination(room, control.endpoints, dst)
    list(run_prefill({(0, 0): sender}, src, live, [(8, 40)], [40]))
    assert [r for r, _ in wait_done(control, room)] == [room]
    assert sender.alive


def test_a_destination_that_never_authenticates_is_given_up_in_time(sides: list) -> None:
    """A receiver under another PD key accepts every connection and fails every handshake:
    the sender's reconnects are no progress, so its rooms are given up after the transfer
    timeout (not queued forever, each reconnect's hello counting as bytes sent)."""
    from pipeserve.disaggregation.pd.link import Server

    src, dst = CASES["pp1->tp2"]
    server = Server()
    other = server.listen("tcp://127.0.0.1:*", auth.kv_link_secret("another key"), 1 << 20, 4, 4)
    stop = threading.Event()

    def serve() -> None:
        while not stop.is_set():
            server.poll(0.02)
        server.close()

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    sender = lone_sender(src, 1.0, sides)
    dest = KVDestination(new_room(), (other.endpoint,) * 2, dst)
    try:
        list(run_prefill({(0, 0): sender}, src, dest, [(8, 40)], [40]))
        deadline = time.monotonic() + 10
        while dest.room not in sender._failed and time.monotonic() < deadline:
            time.sleep(0.05)
        assert dest.room in sender._failed and sender.given_up == 1
        assert other.refused["failed or left the handshake"] >= 2  # it did retry meanwhile
    finally:
        stop.set()
        thread.join(5)
