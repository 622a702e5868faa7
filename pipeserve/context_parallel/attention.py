"""Attention under context parallelism: what one CP rank computes of a batch, and the per-layer
exchanges that make its result equal to the unsplit model's.

A prompt chunk's tokens are split zig-zag over the N ranks (pipeserve/context_parallel/zigzag);
a decode step runs on every rank alike (one token: replicating it is cheaper than moving it).
The KV pages are striped over the ranks (pipeserve/context_parallel/layout). Per layer:

1. Exchange A, launched before the query projection so the two overlap: one all-gather of
   every rank's share of the batch's chunk K/V, plus, for segments that re-gather their
   prefix, the prefix K/V of the pages it holds. Afterwards every rank has each chunk's K/V
   whole and writes the positions of the pages it holds to its pool.
2. A chunk's queries attend to the chunk causally (every rank has it) and to the prefix,
   which the ranks hold between them, in one of two ways:
   - regather: the prefix came whole with exchange A; plain causal attention over
     [prefix | chunk] (the compiled CPU kernel where it runs).
   - merge (decode context parallelism): exchange B all-gathers the chunk's queries; every
     rank attends all of them to the prefix positions it holds, and exchange C (one
     all-to-all) returns each query's partial result and log-sum-exp to the rank computing
     it, which merges them with its own chunk part. A decode step does the same without
     exchange B (its query is on every rank already): it costs one all-to-all of a few
     floats per head, against a re-gather of its whole prefix.
   `--cp-prefix-mode auto` picks per segment whichever moves fewer bytes: re-gathering costs
   the prefix's K/V, merging the chunk's queries plus float32 partials; decode steps merge.
   Where the compiled CPU prefill kernel runs, auto re-gathers every chunk's prefix: the merge
   partials need log-sum-exp, which only the torch kernels return (bench preset, CP2, a 32K
   prompt in 8K chunks: 115 s merged against 58 s re-gathered). Decode steps: 8K context,
   11.6 tokens/s merged against 5.2 re-gathered.
   MLA (`layers/mla.py`) always re-gathers, its latent rows being small; DeepSeek-V3.2
   exchanges every position's indexer key and the chunks' latent rows (`launch_chunk`), and
   of a prefix only the latent rows its queries chose, asked of their holders (`fetch`).
3. On the last pipeline stage the ranks' hidden rows are all-gathered back into batch order
   (`gather_hidden`), so sampling and prompt logprobs run as without CP, on every rank.

Every rank builds the same plan from the same batch (the counts of every rank's rows are
known everywhere), so the collectives always match.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from pipeserve.backends.base import Kernel
from pipeserve.backends.torch_backend import TorchBackend
from pipeserve.backends.torch_ops import attention_with_lse
from pipeserve.context_parallel.layout import PageStriping
from pipeserve.context_parallel.zigzag import rank_blocks
from pipeserve.layers.attention_parts import KVPart, merge_partials, merge_partials_lse
from pipeserve.scheduler.batch import ScheduledBatch
from pipeserve.timeline import now, record_comm

if TYPE_CHECKING:
    from pipeserve.layers.attention import PagedAttention
    from pipeserve.mem_cache.kv_pool import KVPool

PREFIX_MODES = ("auto", "merge", "regather")


class Buffers:
    """Tensors kept from layer to layer and forward to forward, grown when too small: the
    exchange's buffers and a segment's re-gathered keys and values. A layer's long rows then
    land in memory already mapped instead of fresh pages (tens of MB per layer at 32K).
    Each use is finished before the next layer's, so one of each suffices."""

    def __init__(self) -> None:
        self._bufs: dict[str, torch.Tensor] = {}

    def get(
        self, name: str, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device
    ) -> torch.Tensor:
        numel = 1
        for n in shape:
            numel *= n
        buf = self._bufs.get(name)
        if buf is None or buf.numel() < numel or buf.dtype != dtype or buf.device != device:
            buf = torch.empty(numel, dtype=dtype, device=device)
            self._bufs[name] = buf
        return buf[:numel].view(shape)


@dataclass(frozen=True)
class CpContext:
    """What a model runner knows about its CP rank (fixed for its life)."""

    size: int
    rank: int
    group: Any
    striping: PageStriping
    prefix_mode: str = "auto"
    q_heads: int = 1
    kv_heads: int = 1
    head_dim: int = 1
    itemsize: int = 2
    prefill: Kernel | None = None  # the run backend's compiled dense kernel for the dtype
    overlap: bool = True  # the K/V exchange runs during the query projection (else: waited
    # for at once, for measuring what the overlap hides)
    latent: bool = False  # MLA: a token's cache row is small; every segment re-gathers
    ring: bool = False  # the chunk's K/V passed around a ring, attended block by block
    ranks: tuple[int, ...] = ()  # global ranks of the group, in CP rank order (the ring)
    buffers: Buffers = field(default_factory=Buffers, compare=False, repr=False)

    def merges(self, decode: bool, prefix: int, length: int) -> bool:
        """Whether a segment reads its prefix by merging partial results (else re-gather)."""
        if prefix == 0 or self.latent:
            return False
        if self.ring:  # the ring carries the chunk only
            return True
        if self.prefix_mode != "auto":
            return self.prefix_mode == "merge"
        if decode:
            return True
        if self.prefill is not None:  # merging runs the torch kernels: 2x slower at 32K (see below)
            return False
        return self.regather_bytes(prefix) > self.merge_bytes(length)

    def regather_bytes(self, prefix: int) -> int:
        return prefix * 2 * self.kv_heads * self.head_dim * self.itemsize

    def merge_bytes(self, length: int) -> int:
        heads, d = self.q_heads, self.head_dim
        return length * heads * d * self.itemsize + length * heads * (d + 1) * 4


@dataclass
class Segment:
    """One request's share of the forward on this rank."""

    decode: bool
    prefix: int  # positions already cached
    length: int  # positions computed now (1 for a decode step)
    rows: torch.Tensor  # this rank's rows of the forward, in chunk order
    blocks: list[tuple[int, int]]  # chunk-relative blocks of those rows (decode: [(0, 1)])
    merge: bool
    chunk_index: torch.Tensor | None = None  # prompt: [length] rows of exchange A, chunk order
    prefix_index: torch.Tensor | None = None  # regather: [prefix] rows of exchange A
    own_slots: torch.Tensor | None = None  # merge: local slots of the positions held here
    q_index: torch.Tensor | None = None  # merge prompt: [length] rows of exchange B
    send_rows: list[torch.Tensor] = field(default_factory=list)  # merge prompt: per rank
    recv_offset: int = 0  # merge: first row of this segment in each source's block of C
    # prompt: every rank's blocks of the chunk and where they start in its block of A
    peer_blocks: list[list[tuple[int, int]]] = field(default_factory=list)
    peer_offsets: list[int] = field(default_factory=list)
    kv_runs: list[Any] = field(default_factory=list)  # the request's KV runs (global slots)
    chunk_only_index: torch.Tensor | None = None  # prompt: [length] rows of `launch_chunk`
    prefix_slots: torch.Tensor | None = None  # `fetch`: global slots of the prefix, once made

    def query_blocks(self) -> list[tuple[int, int, torch.Tensor]]:
        """(first position, end position, this rank's rows) of each non-empty block of its
        queries: the queries of positions [first, end) attend to positions [0, end)."""
        out, start = [], 0
        for s, e in self.blocks:
            if e > s:
                out.append((self.prefix + s, self.prefix + e, self.rows[start : start + e - s]))
            start += e - s
        return out


@dataclass
class Exchange:
    """Exchange A of one layer in flight."""

    work: Any
    out: torch.Tensor  # [N * rows, ...]: every rank's rows
    fresh: torch.Tensor  # this rank's fresh rows [rows, ...] (decode steps read their own)
    write_src: torch.Tensor  # the rows of `out` that `finish` writes to the pool
    launched: float = 0.0  # when the launch began (timeline)


class CpPlan:
    """A batch as one CP rank runs it (built once, used by every layer)."""

    def __init__(self, ctx: CpContext, device: torch.device) -> None:
        self.ctx, self.device = ctx, device
        self.segments: list[Segment] = []
        self.a_rows = 0  # rows per rank in exchange A
        self.a_chunk_max = 0  # rows per rank in `launch_chunk` (exchange A's chunk rows alone)
        self.write_src_chunk = torch.empty(0, dtype=torch.long)  # write_src in launch_chunk's
        self.a_chunk_rows = torch.empty(0, dtype=torch.long)  # local rows sent in A
        self.a_prefix_slots = torch.empty(0, dtype=torch.long)  # local slots sent in A
        self.write_src = torch.empty(0, dtype=torch.long)  # rows of A written to the pool
        self.write_slots = torch.empty(0, dtype=torch.long)
        self.decode_write_rows = torch.empty(0, dtype=torch.long)  # local rows (decode)
        self.decode_write_slots = torch.empty(0, dtype=torch.long)
        self.b_rows = 0  # rows per rank in exchange B
        self.b_local = torch.empty(0, dtype=torch.long)  # local rows sent in B
        self.c_send: list[int] = []  # rows sent to each rank in exchange C
        self.c_recv = 0  # rows received from each rank
        self.hidden_rows = 0  # rows per rank when gathering the hidden states
        self.hidden_index = torch.empty(0, dtype=torch.long)  # batch order -> gathered rows

    # ---- building ------------------------------------------------------------------

    @classmethod
    def build(
        cls, batch: ScheduledBatch, ctx: CpContext, device: torch.device
    ) -> tuple[CpPlan, list[int], list[int]]:
        """The plan, and this rank's input ids and positions (its rows, in batch order)."""
        plan = cls(ctx, device)
        n_ranks, me = ctx.size, ctx.rank
        ids: list[int] = []
        positions: list[int] = []
        # per rank: rows of the forward, rows of A (chunk part), rows of B, rows of C to me
        fwd_off = [0] * n_ranks
        a_chunk = [0] * n_ranks
        b_off = [0] * n_ranks
        c_mine = 0
        spans: list[list[tuple[int, int]]] = []  # per slice: each rank's forward rows
        chunk_pos_ranks: list[list[torch.Tensor]] = []  # per slice: each rank's chunk positions
        for s in batch.slices:
            n, c = s.num_tokens, s.prefix_len
            if s.is_decode:
                blocks_per = [[(0, n)]] * n_ranks
            else:
                blocks_per = [rank_blocks(n, n_ranks, r) for r in range(n_ranks)]
            pos_per = [_positions(b) for b in blocks_per]
            span = []
            for r in range(n_ranks):
                span.append((fwd_off[r], fwd_off[r] + len(pos_per[r])))
                fwd_off[r] += len(pos_per[r])
            spans.append(span)
            chunk_pos_ranks.append([torch.tensor(p, dtype=torch.long) for p in pos_per])
            mine = pos_per[me]
            ids.extend(s.input_ids[i] for i in mine)
            positions.extend(c + i for i in mine)
            merge = ctx.merges(s.is_decode, c, n)
            seg = Segment(
                s.is_decode,
                c,
                n,
                torch.arange(*span[me], device=device),
                blocks_per[me] if not s.is_decode else [(0, 1)],
                merge,
                kv_runs=s.kv_runs,
            )
            if not s.is_decode:
                seg.peer_blocks, seg.peer_offsets = blocks_per, list(a_chunk)
                seg.chunk_index = _concat_index(chunk_pos_ranks[-1], a_chunk, n, device)
                for r in range(n_ranks):
                    a_chunk[r] += len(pos_per[r])
                if merge:
                    seg.q_index = _concat_index(chunk_pos_ranks[-1], b_off, n, device)
                    for r in range(n_ranks):
                        b_off[r] += len(pos_per[r])
            plan.segments.append(seg)
        # exchange A: after every rank's chunk rows, the prefix rows of regather segments
        a_used = list(a_chunk)
        written = plan._chunk_writes(batch, chunk_pos_ranks)
        prefix_slots: list[torch.Tensor] = []
        for s, seg in zip(batch.slices, plan.segments, strict=True):
            if seg.prefix and not seg.merge:
                seg.prefix_index, mine_slots = plan._prefix_rows(s, written, a_used)
                prefix_slots.append(mine_slots)
        plan.a_rows = max(a_used) if a_used else 0
        plan.a_chunk_max = max(a_chunk) if a_chunk else 0
        for seg in plan.segments:  # rows of rank r start at r * a_rows
            if seg.chunk_index is not None:  # chunk rows come first in each rank's block
                seg.chunk_only_index = _rebase(seg.chunk_index, plan.a_chunk_max)
            for name in ("chunk_index", "prefix_index"):
                index = getattr(seg, name)
                if index is not None:
                    setattr(seg, name, _rebase(index, plan.a_rows))
        plan.a_chunk_rows = torch.cat(
            [seg.rows for seg in plan.segments if not seg.decode] or [_empty(device)]
        )
        plan.a_prefix_slots = torch.cat(prefix_slots) if prefix_slots else _empty(device)
        plan._finish_writes(batch, written)
        # exchange B and C (merge segments)
        plan.b_rows = max(b_off) if b_off else 0
        c_send = [0] * n_ranks
        for i, (s, seg) in enumerate(zip(batch.slices, plan.segments, strict=True)):
            if not seg.merge:
                continue
            _, seg.own_slots = ctx.striping.owned(
                s.kv_runs, 0, seg.prefix + (1 if seg.decode else 0), device
            )
            seg.recv_offset = c_mine
            if seg.decode:
                c_mine += 1
                c_send = [x + 1 for x in c_send]
                continue
            assert seg.q_index is not None
            seg.q_index = _rebase(seg.q_index, plan.b_rows)
            seg.send_rows = [p.to(device) for p in chunk_pos_ranks[i]]
            for r in range(n_ranks):
                c_send[r] += len(seg.send_rows[r])
            c_mine += len(seg.rows)
        plan.b_local = torch.cat(
            [seg.rows for seg in plan.segments if seg.merge and not seg.decode] or [_empty(device)]
        )
        plan.c_send, plan.c_recv = c_send, c_mine
        plan._hidden_index(batch, spans, chunk_pos_ranks, fwd_off)
        return plan, ids, positions

    def _chunk_writes(
        self, batch: ScheduledBatch, chunk_pos: list[list[torch.Tensor]]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(global slots, rows of exchange A before rebasing as (rank, row) pairs flattened
        with a_rows unknown: kept as rank and row) of every chunk position of the batch."""
        striping = self.ctx.striping
        slots, ranks, rows = [], [], []
        offsets = [0] * self.ctx.size
        for s, seg, per_rank in zip(batch.slices, self.segments, chunk_pos, strict=True):
            if seg.decode:
                continue
            all_slots = striping.slots_of(s.kv_runs, seg.prefix + seg.length, torch.device("cpu"))
            for r, pos in enumerate(per_rank):
                slots.append(all_slots[seg.prefix + pos])
                ranks.append(torch.full_like(pos, r))
                rows.append(offsets[r] + torch.arange(len(pos)))
                offsets[r] += len(pos)
        if not slots:
            return _empty(torch.device("cpu")), _empty(torch.device("cpu")).view(0, 2)
        pairs = torch.stack((torch.cat(ranks), torch.cat(rows)), 1)
        return torch.cat(slots), pairs

    def _prefix_rows(
        self,
        s: Any,
        written: tuple[torch.Tensor, torch.Tensor],
        a_used: list[int],
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """A regather segment's prefix: where each position lies in exchange A, as (rank,
        row) pairs [prefix, 2], and the local slots this rank sends for it. A position whose
        KV this very batch computes (another request's chunk, just cached) is read from that
        chunk's rows; the others from the rank holding their page."""
        striping, cpu = self.ctx.striping, torch.device("cpu")
        c = s.prefix_len
        slots = striping.slots_of(s.kv_runs, c, cpu)
        owners = striping.owners(slots)
        pairs = torch.empty(c, 2, dtype=torch.long)
        fresh = torch.zeros(c, dtype=torch.bool)
        w_slots, w_pairs = written
        if w_slots.numel():
            order = torch.argsort(w_slots)
            sorted_slots = w_slots[order]
            at = torch.searchsorted(sorted_slots, slots).clamp(max=len(sorted_slots) - 1)
            fresh = sorted_slots[at] == slots
            pairs[fresh] = w_pairs[order[at[fresh]]]
        mine = torch.empty(0, dtype=torch.long)
        for r in range(self.ctx.size):
            held = (owners == r) & ~fresh
            count = int(held.sum())
            pairs[held, 0] = r
            pairs[held, 1] = a_used[r] + torch.arange(count)
            a_used[r] += count
            if r == self.ctx.rank:
                mine = striping.local_slots(slots[held])
        return pairs.to(self.device), mine.to(self.device)

    def _finish_writes(self, batch: ScheduledBatch, written: tuple[torch.Tensor, torch.Tensor]):
        """Which rows this rank writes to its pool: chunk positions (from exchange A) and
        decode tokens (its own rows) whose pages it holds."""
        striping, me = self.ctx.striping, self.ctx.rank
        w_slots, w_pairs = written
        if w_slots.numel():
            held = striping.owners(w_slots) == me
            self.write_src = _rebase(w_pairs[held].to(self.device), self.a_rows)
            self.write_src_chunk = _rebase(w_pairs[held].to(self.device), self.a_chunk_max)
            self.write_slots = striping.local_slots(w_slots[held]).to(self.device)
        rows, slots = [], []
        for s, seg in zip(batch.slices, self.segments, strict=True):
            if not seg.decode:
                continue
            slot = striping.slots_of(s.kv_runs, seg.prefix + 1, torch.device("cpu"))[-1:]
            if int(striping.owners(slot)) == me:
                rows.append(seg.rows)
                slots.append(striping.local_slots(slot).to(self.device))
        if rows:
            self.decode_write_rows, self.decode_write_slots = torch.cat(rows), torch.cat(slots)

    def _hidden_index(
        self,
        batch: ScheduledBatch,
        spans: list[list[tuple[int, int]]],
        chunk_pos: list[list[torch.Tensor]],
        rows_per_rank: list[int],
    ) -> None:
        """Where each row of the batch (in batch order) lies among the ranks' gathered rows."""
        self.hidden_rows = max(rows_per_rank) if rows_per_rank else 0
        parts = []
        for s, span, per_rank in zip(batch.slices, spans, chunk_pos, strict=True):
            if s.is_decode:  # the same on every rank: this rank's copy
                start = self.ctx.rank * self.hidden_rows + span[self.ctx.rank][0]
                parts.append(torch.arange(start, start + 1))
                continue
            offsets = [span[r][0] for r in range(self.ctx.size)]
            parts.append(_concat_index(per_rank, offsets, s.num_tokens, torch.device("cpu")))
            parts[-1] = _rebase(parts[-1], self.hidden_rows)
        self.hidden_index = torch.cat(parts).to(self.device) if parts else _empty(self.device)

    # ---- per layer -------------------------------------------------------------------

    def launch(self, layer_id: int, k: torch.Tensor, v: torch.Tensor, pool: KVPool) -> Exchange:
        """Start exchange A of a layer (k/v: this rank's fresh rows [rows, kv_heads, d])."""
        kc, vc = pool.buffers(layer_id)

        def cached(slots: torch.Tensor) -> torch.Tensor:  # [m, 2, kv_heads, d]
            return torch.stack((kc[:, slots], vc[:, slots])).permute(2, 0, 1, 3)

        return self.launch_rows(layer_id, torch.stack((k, v), 1), cached)

    def launch_rows(
        self,
        layer_id: int,
        fresh: torch.Tensor,
        cached: Callable[[torch.Tensor], torch.Tensor],
    ) -> Exchange:
        """Start exchange A of a layer: fresh [rows, ...] is what this rank's tokens cache
        (K/V, or MLA's latent rows), `cached(local slots)` reads the same from its pool."""
        if self.a_rows == 0:
            return Exchange(None, fresh.new_empty(0, *fresh.shape[1:]), fresh, self.write_src)
        start = now()
        buffers, dtype, device = self.ctx.buffers, fresh.dtype, fresh.device
        send = buffers.get("a_send", (self.a_rows, *fresh.shape[1:]), dtype, device)
        n, m = self.a_chunk_rows.numel(), self.a_prefix_slots.numel()
        send[:n] = fresh[self.a_chunk_rows]
        if m:
            send[n : n + m] = cached(self.a_prefix_slots)
        out = buffers.get("a_out", (self.ctx.size * self.a_rows, *send.shape[1:]), dtype, device)
        if self.ctx.ring:  # the other ranks' rows arrive step by step in attend
            me = self.ctx.rank
            out[me * self.a_rows : (me + 1) * self.a_rows] = send
            return Exchange(None, out, fresh, self.write_src, start)
        return self._all_gather(
            layer_id, send, out, Exchange(None, out, fresh, self.write_src, start)
        )

    def _all_gather(
        self, layer_id: int, send: torch.Tensor, out: torch.Tensor, exchange: Exchange
    ) -> Exchange:
        """All-gathers every rank's `send` into `out` for `exchange` (waited for at once
        where the exchange does not overlap the query projection)."""
        exchange.work = dist.all_gather_single(out, send, group=self.ctx.group, async_op=True)
        peers = send.nbytes * (self.ctx.size - 1)  # its rows to every other rank, theirs back
        record_comm("cp_kv_launch", exchange.launched, layer_id, peers, peers)
        if not self.ctx.overlap:
            self._wait(exchange, layer_id)
        return exchange

    @staticmethod
    def _wait(exchange: Exchange, layer_id: int) -> None:
        """Wait for exchange A: the waiting is its exposed part, the span since the launch
        began its whole (the rest of which the query projection hid)."""
        if exchange.work is None:
            return
        waited = now()
        exchange.work.wait()
        exchange.work = None
        record_comm("cp_kv_wait", waited, layer_id)
        record_comm("cp_kv_exchange", exchange.launched, layer_id)

    def finish(
        self,
        exchange: Exchange,
        layer_id: int,
        write: Callable[[torch.Tensor, torch.Tensor], None],
    ) -> None:
        """Wait for exchange A (or a `launch_chunk` exchange) and write the rows of the pages
        this rank holds to its pool (`write(local slots, rows)`): chunk positions from the
        exchange, decode tokens from its own rows."""
        self._wait(exchange, layer_id)
        if self.write_slots.numel():
            write(self.write_slots, exchange.out[exchange.write_src])
        if self.decode_write_slots.numel():
            write(self.decode_write_slots, exchange.fresh[self.decode_write_rows])

    def launch_chunk(self, layer_id: int, fresh: torch.Tensor) -> Exchange:
        """Exchange A's chunk rows alone, without any prefix: every rank's rows of the
        batch's prompt chunks all-gathered ([N * a_chunk_max, ...]; `finish` writes the
        positions of the pages this rank holds). DeepSeek-V3.2's latent rows go this way; the
        rows of a prefix its queries chose are asked of their holders (`fetch`)."""
        src = self.write_src_chunk
        if self.a_chunk_max == 0:
            return Exchange(None, fresh.new_empty(0, *fresh.shape[1:]), fresh, src)
        start = now()
        buffers, dtype, device = self.ctx.buffers, fresh.dtype, fresh.device
        send = buffers.get("chunk_send", (self.a_chunk_max, *fresh.shape[1:]), dtype, device)
        send[: self.a_chunk_rows.numel()] = fresh[self.a_chunk_rows]
        shape = (self.ctx.size * self.a_chunk_max, *send.shape[1:])
        out = buffers.get("chunk_out", shape, dtype, device)
        return self._all_gather(layer_id, send, out, Exchange(None, out, fresh, src, start))

    def chunk_rows(self, seg: Segment, exchange: Exchange) -> torch.Tensor:
        """A segment's rows of its new positions [length, ...] from a `launch_chunk` exchange
        (a decode step's own row from this rank)."""
        if seg.decode:
            return exchange.fresh[seg.rows]
        assert seg.chunk_only_index is not None
        return exchange.out[seg.chunk_only_index]

    def fetch(
        self,
        layer_id: int,
        wanted: list[torch.Tensor],
        read: Callable[[torch.Tensor], torch.Tensor],
    ) -> list[torch.Tensor]:
        """The cached rows of the prefix positions `wanted[i]` (ascending, each < its
        prefix) of segment i, asked of the ranks holding their pages: one all-to-all of
        the counts, one of the slots asked (local to their holders), one of the rows
        (`read(local slots)` on the holder) -> per segment its rows, in the order asked.
        Every rank calls it once per layer (the collectives match), asking or not."""
        striping, size, device = self.ctx.striping, self.ctx.size, self.device
        slots = []
        for seg, want in zip(self.segments, wanted, strict=True):
            if not want.numel():
                slots.append(want)
                continue
            if seg.prefix_slots is None:  # made once per forward, for every layer
                seg.prefix_slots = striping.slots_of(seg.kv_runs, seg.prefix, device)
            slots.append(seg.prefix_slots[want])
        every = torch.cat(slots) if slots else _empty(device)
        owners = striping.owners(every)
        order = torch.argsort(owners, stable=True)  # grouped by holder
        counts = torch.bincount(owners, minlength=size)
        asked = striping.local_slots(every[order])
        start = now()
        counts_in = torch.empty_like(counts)
        dist.all_to_all_single(counts_in, counts, group=self.ctx.group)
        sizes_out, sizes_in = counts.tolist(), counts_in.tolist()
        requests = asked.new_empty(sum(sizes_in))
        dist.all_to_all_single(requests, asked, sizes_in, sizes_out, group=self.ctx.group)
        answer = read(requests)
        rows = answer.new_empty(every.numel(), *answer.shape[1:])
        dist.all_to_all_single(rows, answer, sizes_out, sizes_in, group=self.ctx.group)
        me, row_bytes = self.ctx.rank, answer[:1].nbytes
        sent = (sum(sizes_in) - sizes_in[me]) * row_bytes
        received = (every.numel() - sizes_out[me]) * row_bytes
        record_comm("cp_rows_fetch", start, layer_id, sent, received)
        back = torch.empty_like(rows)
        back[order] = rows  # in the order asked
        return list(back.split([len(w) for w in wanted]))

    def segment_rows(self, seg: Segment, exchange: Exchange) -> torch.Tensor:
        """A regather segment's rows of every position [prefix + length, ...], in order: the
        prefix and the chunk from exchange A, a decode step's own row from this rank. In a
        reused buffer (valid until the next segment's)."""
        fresh = exchange.fresh
        shape = (seg.prefix + seg.length, *fresh.shape[1:])
        rows = self.ctx.buffers.get("rows", shape, fresh.dtype, fresh.device)
        if seg.prefix_index is not None:
            torch.index_select(exchange.out, 0, seg.prefix_index, out=rows[: seg.prefix])
        if seg.decode:
            rows[seg.prefix :] = fresh[seg.rows]
        else:
            assert seg.chunk_index is not None
            torch.index_select(exchange.out, 0, seg.chunk_index, out=rows[seg.prefix :])
        return rows

    def attend(
        self, attn: PagedAttention, q: torch.Tensor, exchange: Exchange, pool: KVPool
    ) -> torch.Tensor:
        """This rank's attention output [rows, heads * d] for its query rows q [rows, h, d]."""
        kc, vc = pool.buffers(attn.layer_id)

        def write(slots: torch.Tensor, rows: torch.Tensor) -> None:
            kc[:, slots] = rows[:, 0].transpose(0, 1)
            vc[:, slots] = rows[:, 1].transpose(0, 1)

        ring = self._ring(attn, q, exchange) if self.ctx.ring and self.a_rows else {}
        self.finish(exchange, attn.layer_id, write)
        gathered = exchange.out
        out = torch.empty_like(q)
        partials = self._merge_partials(attn, q, kc, vc)
        for i, seg in enumerate(self.segments):
            if i in ring:
                prefix = self._received(seg, partials) if seg.merge else []
                out[seg.rows] = merge_partials([*prefix, ring[i]]).to(q.dtype)
            elif seg.merge:
                out[seg.rows] = self._merged(attn, q, gathered, seg, partials)
            else:
                out[seg.rows] = self._whole(attn, q, exchange, seg)
        return out.flatten(1)

    def _whole(
        self, attn: PagedAttention, q: torch.Tensor, exchange: Exchange, seg: Segment
    ) -> torch.Tensor:
        """A segment whose keys are all here ([prefix | chunk] from exchange A, a decode step's
        own row from this rank), attended causally. The rows are gathered, then laid out
        head-major, in reused buffers: two copies, no fresh memory."""
        ordered = self.segment_rows(seg, exchange)  # [positions, 2, hk, d]
        length, _, hk, d = ordered.shape
        kv = self.ctx.buffers.get("kv", (2, hk, length, d), q.dtype, q.device)
        kv.copy_(ordered.permute(1, 2, 0, 3))
        keys, values = kv[0], kv[1]  # [hk, positions, d]
        outs = [
            _causal(attn, q[rows], keys, values, first, end, self.ctx.prefill)
            for first, end, rows in seg.query_blocks()
        ]
        return torch.cat(outs) if outs else q.new_empty(0, *q.shape[1:])

    def _merge_partials(
        self,
        attn: PagedAttention,
        q: torch.Tensor,
        kc: torch.Tensor,
        vc: torch.Tensor,
    ) -> torch.Tensor | None:
        """Exchanges B and C: every merge segment's queries attended to the positions held
        here, returned to the ranks that compute them. [N * c_recv, heads, d + 1] float32:
        from each rank, for this rank's merge rows, the output and log-sum-exp."""
        if not any(seg.merge for seg in self.segments):
            return None
        group, size = self.ctx.group, self.ctx.size
        heads, d = q.shape[1], q.shape[2]
        all_q = None
        if self.b_rows:
            send = q.new_zeros(self.b_rows, heads, d)
            send[: self.b_local.numel()] = q[self.b_local]
            all_q = send.new_empty(size * self.b_rows, heads, d)
            start = now()
            dist.all_gather_single(all_q, send, group=group)
            peers = send.nbytes * (size - 1)
            record_comm("cp_merge", start, attn.layer_id, peers, peers)
        blocks: list[list[torch.Tensor]] = [[] for _ in range(size)]  # in segment order
        for seg in self.segments:
            if not seg.merge:
                continue
            assert seg.own_slots is not None
            keys, values = kc[:, seg.own_slots], vc[:, seg.own_slots]
            if seg.decode:  # every rank merges the step: the same rows to all
                part = _partial(attn, q[seg.rows], keys, values)
                for block in blocks:
                    block.append(part)
                continue
            assert all_q is not None and seg.q_index is not None
            part = _partial(attn, all_q[seg.q_index], keys, values)  # [length, heads, d + 1]
            for r in range(size):
                blocks[r].append(part[seg.send_rows[r]])
        width = (heads, d + 1)
        nothing = q.new_empty(0, *width, dtype=torch.float32)
        send_c = torch.cat([torch.cat(b) if b else nothing for b in blocks])
        recv = send_c.new_empty(size * self.c_recv, *width)
        start = now()
        dist.all_to_all_single(
            recv,
            send_c,
            output_split_sizes=[self.c_recv] * size,
            input_split_sizes=self.c_send,
            group=group,
        )
        row_bytes = recv[:1].nbytes
        own = self.c_send[self.ctx.rank]
        sent = (send_c.shape[0] - own) * row_bytes
        record_comm("cp_merge", start, attn.layer_id, sent, (size - 1) * self.c_recv * row_bytes)
        return recv

    def _merged(
        self,
        attn: PagedAttention,
        q: torch.Tensor,
        gathered: torch.Tensor,
        seg: Segment,
        partials: torch.Tensor | None,
    ) -> torch.Tensor:
        """A merge segment's output for this rank's rows: the other ranks' (and this rank's)
        partial results over the prefix, merged with the chunk part computed here."""
        parts = self._received(seg, partials)
        if not seg.decode:
            assert seg.chunk_index is not None
            chunk = gathered[seg.chunk_index]
            keys = chunk[:, 0].transpose(0, 1)
            values = chunk[:, 1].transpose(0, 1)
            outs, lses = [], []
            for first, end, rows in seg.query_blocks():
                s, e = first - seg.prefix, end - seg.prefix  # in the chunk
                o, lse = _chunk_partial(attn, q[rows], keys[:, :e], values[:, :e], s)
                outs.append(o)
                lses.append(lse)
            parts.append((torch.cat(outs), torch.cat(lses)))
        return merge_partials(parts).to(q.dtype)

    def _received(
        self, seg: Segment, partials: torch.Tensor | None
    ) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """A merge segment's partial results over the prefix, one per rank, for its rows."""
        assert partials is not None
        n, parts = len(seg.rows), []
        for r in range(self.ctx.size):
            start = r * self.c_recv + seg.recv_offset
            block = partials[start : start + n]
            parts.append((block[..., :-1], block[..., -1]))
        return parts

    def _ring(
        self, attn: PagedAttention, q: torch.Tensor, exchange: Exchange
    ) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
        """Ring attention over the chunks: in N steps every rank's block of exchange A
        passes every rank (each sends what it holds to the next rank while receiving from
        the previous one) and each rank attends its queries to the block it holds meanwhile:
        a key block before a query block entirely, or the same block causally (zig-zag
        blocks never overlap otherwise). Per prompt segment, its rows' (output, lse) over the
        whole chunk; exchange A's buffer is whole afterwards."""
        size, me, rows_per = self.ctx.size, self.ctx.rank, self.a_rows
        out = exchange.out
        nxt, prv = self.ctx.ranks[(me + 1) % size], self.ctx.ranks[(me - 1) % size]
        # per prompt segment, per block of its queries: the (output, lse) of each key block
        parts: dict[int, list[list[tuple[torch.Tensor, torch.Tensor]]]] = {
            i: [[] for _ in seg.query_blocks()]
            for i, seg in enumerate(self.segments)
            if not seg.decode
        }
        for step in range(size):
            src = (me - step) % size
            held = out[src * rows_per : (src + 1) * rows_per]
            works = []
            if step < size - 1:  # pass on what is held, take the previous rank's
                start = now()
                into = (src - 1) % size
                incoming = out[into * rows_per : (into + 1) * rows_per]
                ops = [
                    dist.P2POp(dist.isend, held, nxt, self.ctx.group),
                    dist.P2POp(dist.irecv, incoming, prv, self.ctx.group),
                ]
                works = dist.batch_isend_irecv(ops)
                record_comm("cp_kv_launch", start, attn.layer_id, held.nbytes, held.nbytes)
            for i, seg in enumerate(self.segments):
                if not seg.decode:
                    self._ring_step(attn, q, seg, held, src, parts[i])
            if works:
                waited = now()
                for w in works:
                    w.wait()
                record_comm("cp_kv_wait", waited, attn.layer_id)
        merged = {}
        for i, per_block in parts.items():
            blocks = [merge_partials_lse(block) for block in per_block]  # each sees itself
            if not blocks:  # no queries of this segment here
                empty = q.new_empty(0, *q.shape[1:], dtype=torch.float32)
                blocks = [(empty, empty[..., 0])]
            merged[i] = (torch.cat([o for o, _ in blocks]), torch.cat([x for _, x in blocks]))
        return merged

    def _ring_step(
        self,
        attn: PagedAttention,
        q: torch.Tensor,
        seg: Segment,
        held: torch.Tensor,
        src: int,
        parts: list[list[tuple[torch.Tensor, torch.Tensor]]],
    ) -> None:
        """This rank's query blocks of a segment against rank `src`'s key blocks (held):
        appends to parts[b] the float32 (output, lse) of query block b per key block it sees."""
        for block, (first, _, rows) in zip(parts, seg.query_blocks(), strict=True):
            qs, queries = first - seg.prefix, q[rows]
            row = seg.peer_offsets[src]
            for ks, ke in seg.peer_blocks[src]:
                kv = held[row : row + ke - ks]
                row += ke - ks
                if ke == ks or ks > qs:
                    continue  # empty, or after the queries
                keys, values = kv[:, 0].transpose(0, 1), kv[:, 1].transpose(0, 1)
                if ks == qs:  # the same block: causal
                    o, lse = _chunk_partial(attn, queries, keys, values, 0)
                else:  # entirely before
                    o, lse = _unfold(attn, *_lse_attention(attn, queries, keys, values), len(rows))
                block.append((o.float(), lse))

    # ---- after the last layer --------------------------------------------------------

    def gather_hidden(self, hidden: torch.Tensor) -> torch.Tensor:
        """This rank's rows [rows, hidden] -> the batch's rows in batch order (every rank)."""
        send = hidden.new_zeros(self.hidden_rows, hidden.shape[1])
        send[: hidden.shape[0]] = hidden
        out = send.new_empty(self.ctx.size * self.hidden_rows, hidden.shape[1])
        start = now()
        dist.all_gather_single(out, send, group=self.ctx.group)
        peers = send.nbytes * (self.ctx.size - 1)
        record_comm("cp_hidden_gather", start, -1, peers, peers)
        return out[self.hidden_index]


def _positions(blocks: list[tuple[int, int]]) -> list[int]:
    return [i for s, e in blocks for i in range(s, e)]


def _empty(device: torch.device) -> torch.Tensor:
    return torch.empty(0, dtype=torch.long, device=device)


def _concat_index(
    per_rank: list[torch.Tensor], offsets: list[int], length: int, device: torch.device
) -> torch.Tensor:
    """[length, 2] (rank, row) of each chunk position, rank r's positions being rows
    offsets[r], offsets[r] + 1, ... of its block."""
    out = torch.empty(length, 2, dtype=torch.long)
    for r, pos in enumerate(per_rank):
        out[pos, 0] = r
        out[pos, 1] = offsets[r] + torch.arange(len(pos))
    return out.to(device)


def _rebase(pairs: torch.Tensor, rows: int) -> torch.Tensor:
    """(rank, row) pairs -> flat rows of a gathered [N * rows] tensor."""
    return pairs[:, 0] * rows + pairs[:, 1]


def _fold(attn: PagedAttention, q: torch.Tensor) -> torch.Tensor:
    """q [n, heads, d] -> [1, kv_heads, group * n, d]: a KV head's query heads in a row."""
    n, d = q.shape[0], q.shape[2]
    return q.transpose(0, 1).reshape(1, attn.num_kv_heads, attn.group * n, d)


def _unfold(
    attn: PagedAttention, o: torch.Tensor, lse: torch.Tensor, n: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """The inverse of _fold for an output [1, kv_heads, group * n, d] and its lse."""
    d = o.shape[-1]
    return (
        o.reshape(attn.num_heads, n, d).transpose(0, 1),
        lse.reshape(attn.num_heads, n).transpose(0, 1),
    )


def _lse_attention(
    attn: PagedAttention, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Folded queries over keys [kv_heads, m, d], nothing masked: (output, lse) folded."""
    return attention_with_lse(_fold(attn, q), keys[None], values[None], False, attn.scale)


def _partial(
    attn: PagedAttention, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor
) -> torch.Tensor:
    """Queries [n, heads, d] over keys [kv_heads, m, d] (no mask) -> [n, heads, d + 1]
    float32: output and log-sum-exp (zeros and -inf over no keys)."""
    n, heads, d = q.shape
    out = torch.zeros(n, heads, d + 1, dtype=torch.float32, device=q.device)
    if keys.shape[1] == 0 or n == 0:
        out[..., -1] = float("-inf")
        return out
    o, lse = attention_with_lse(_fold(attn, q), keys[None], values[None], False, attn.scale)
    o, lse = _unfold(attn, o, lse, n)
    out[..., :-1], out[..., -1] = o, lse
    return out


def _chunk_partial(
    attn: PagedAttention, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, start: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Queries of chunk positions [start, start + n) over chunk keys [0, start + n) (keys
    [kv_heads, start + n, d]), causally: (output [n, heads, d], lse [n, heads])."""
    n = q.shape[0]
    group = attn.group
    parts = []
    if start:
        o, lse = attention_with_lse(
            _fold(attn, q), keys[None, :, :start], values[None, :, :start], False, attn.scale
        )
        parts.append(_unfold(attn, o, lse, n))
    q_heads = q.transpose(0, 1)[None]  # [1, heads, n, d]: causal needs one row per query
    kr = keys[:, start:].repeat_interleave(group, dim=0)[None]
    vr = values[:, start:].repeat_interleave(group, dim=0)[None]
    o, lse = attention_with_lse(q_heads, kr, vr, True, attn.scale)
    parts.append((o[0].transpose(0, 1), lse[0].transpose(0, 1)))
    return merge_partials_lse(parts)


def _causal(
    attn: PagedAttention,
    q: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    first: int,
    end: int,
    kernel: Kernel | None,
) -> torch.Tensor:
    """Queries of positions [first, end) over keys [0, end) of [kv_heads, positions, d]: on
    the run backend's compiled dense `kernel` where it has one, else the torch backend's
    prompt-chunk attention."""
    if kernel is not None:
        runs = torch.tensor([[0, end]], dtype=torch.long)
        return kernel(q, keys, values, runs, first, attn.scale)
    cached: list[KVPart] = [(keys[:, :first], values[:, :first])] if first else []
    k_self = keys[:, first:end].transpose(0, 1)
    v_self = values[:, first:end].transpose(0, 1)
    return TorchBackend(q.device).prompt_chunk(attn, q, k_self, v_self, cached)
