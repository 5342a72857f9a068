"""The worker's EPLB: expert load counters over a window of steps, and rebalances that never stall a step.

Counters: every MoE layer's ``ExpertMap`` adds its routed (token, expert) pairs to its row of ``current``
[layers, storage slots] inside the forward (on the device, no host read: CUDA graphs capture it). At each step
boundary ``end_step`` moves ``current`` into the ring ``window`` [window_size, layers, storage slots] and zeroes
it (two device ops, no host sync). Physical expert p of a layer lives in one storage slot (``slot_phys``: the
physical id of each slot, -1 for a spare); ``physical_load`` reads the window per physical expert.

A rebalance (the first after a quarter of ``step_interval``, then every interval; one at a time):
1. the window's loads per logical expert are planned (``planner.rebalance_experts`` over the EP ranks), inline
   on CPU, in a background thread on CUDA (the window reaches the host by a non-blocking copy the thread waits
   for; with several ranks they agree that every rank's plan is ready before any uses it);
2. each planned rank's experts are matched to a real rank, and each rank's excess and missing experts become
   rounds of moves (``moves``: at most one per rank and layer, every round a valid placement);
3. each step, a layer without a round in flight starts the next: each moving rank's spare slot receives its
   gaining expert, a byte copy of one of its replicas: from a slot of its own (CUDA: on a copy stream, after
   the main stream's earlier work, with an event; CPU: at once), or from another rank (``isend`` / ``irecv``
   on the EP ranks' move group, non-blocking). One expert per rank and layer per step: a step's copy is bounded;
4. at a later step boundary where every rank's copies of the round are done (each rank asks its own without
   waiting, ``Work.is_completed`` / ``event.query()``, and one small all-reduce over the host group gives every
   rank the same answer), the round switches on every rank at once: each spare becomes its gaining expert's
   replica (taking over the physical id of the slot it replaces, so physical ids stay on their rank) and a slot
   of the losing expert becomes the spare. A switch or the start of a rebalance never happens at a boundary
   inside a prefill (a request with prompt tokens still to compute): it waits for the next boundary.
Every intermediate map is a valid placement, and replicas are byte copies routed by token index, so greedy
outputs do not change across a rebalance (at one rank the sums are the same bits; over several ranks a pair's
rank decides only where it is summed). The window restarts after each rebalance (its loads described the old
placement). Every rank runs the same decisions on the same loads, so the maps stay identical everywhere: with
data_parallel_size 1 each rank routes every token (equal counters); with DP attention each counts its own
tokens, the window's loads are all-reduced over the EP group when a plan starts, and whether the boundary is
inside a prefill is agreed (any rank's prefill counts) at the boundaries where it decides something.
"""

from __future__ import annotations

import logging
from collections import Counter
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

import numpy as np
import torch
import torch.distributed as dist

from dsinfer.config import EplbConfig
from dsinfer.distributed.eplb import moves
from dsinfer.distributed.eplb.planner import moe_lb, placement_from_phy2log, rebalance_experts
from dsinfer.distributed.state import SINGLE, ParallelState

logger = logging.getLogger("dsinfer")


@dataclass
class RebalanceStats:
    """What the rebalances did (tests, logs and the engine's stats read it)."""

    num_rebalances: int = 0  # completed
    num_switches: int = 0  # moves switched (one replica moved in one layer each), over every rank
    num_deferred: int = 0  # boundaries where a finished round's switch waited for the end of a prefill
    num_not_ready: int = 0  # boundaries where a round's copy was still running: the switch came later, nobody waited
    num_abandoned: int = 0  # rebalances stopped short: no move left that keeps every expert a replica
    copy_bytes: int = 0  # weights copied into this rank's spares in all (from its own slots or received)
    received_bytes: int = 0  # of which came from another rank
    max_copy_bytes_per_step: int = 0  # the most one step boundary started copying into this rank
    last_plan_step: int = -1  # the step the last rebalance was planned at

    def as_dict(self) -> dict[str, int]:
        return {name: getattr(self, name) for name in self.__dataclass_fields__}


@dataclass
class _Round:
    """One layer's round in flight: its moves (rank, losing, gaining), each rank's spare, and this rank's part
    of the copies (point-to-point works, CUDA events of local copies; ``received``: on gloo, whose works report
    completion only to ``wait()``, a helper thread's wait on them)."""

    moves: list[tuple[int, int, int]]
    spares: dict[int, int]
    works: list = field(default_factory=list)
    events: list = field(default_factory=list)
    received: Future | None = None

    def copied(self) -> bool:
        """Whether this rank's copies are done, asked without waiting; a failed transfer raises here."""
        if self.received is not None:
            if not self.received.done():
                return False
            self.received.result()
        elif not all(w.is_completed() for w in self.works):
            return False
        return all(e.query() for e in self.events)


class ExpertLoadBalancer:
    """EPLB for the MoE ``blocks`` of one model (each with ``expert_map`` and ``experts``), over the EP ranks
    of ``parallel`` (one rank: ``SINGLE``).

    ``num_groups``: the router's expert groups (the planner's hierarchical policy keeps them whole)."""

    def __init__(self, blocks: list, config: EplbConfig, num_groups: int, device: torch.device,
                 parallel: ParallelState = SINGLE):
        self.maps = [block.expert_map for block in blocks]
        self.experts = [block.experts for block in blocks]
        self.config, self.num_groups, self.device = config, num_groups, device
        self.parallel = parallel
        self.num_ranks, self.rank = parallel.ep_size, parallel.ep_rank
        first = self.maps[0]
        self.num_logical, self.num_physical, self.num_storage = first.num_logical, first.num_physical, \
            first.num_storage
        self.rank_slots = [first.rank_slots(r) for r in range(self.num_ranks)]
        num_layers = len(blocks)
        self.current = torch.zeros(num_layers, self.num_storage, dtype=torch.float32, device=device)
        for layer, expert_map in enumerate(self.maps):
            expert_map.load = self.current[layer]
        self.window = torch.zeros(config.window_size, num_layers, self.num_storage, dtype=torch.float32,
                                  device=device)
        self.pos = 0
        # the physical id of each storage slot (-1: a spare): rank r's slots hold its physical experts in order
        per_rank = self.num_physical // self.num_ranks
        self.slot_phys = [[p for r in range(self.num_ranks) for p in
                           [*range(r * per_rank, (r + 1) * per_rank), *[-1] * (len(self.rank_slots[r]) - per_rank)]]
                          for _ in range(num_layers)]
        self._slot_of_phys = torch.zeros(num_layers, self.num_physical, dtype=torch.int64, device=device)
        self._write_slot_of_phys()
        self.step = 0
        self.next_rebalance = max(1, config.step_interval // 4)
        self.stats = RebalanceStats()
        self._plan: Future | None = None
        # per layer, while a rebalance runs: each rank's (excess, missing) experts
        self._moves: list[tuple[list[Counter], list[Counter]]] | None = None
        self._rounds: list[_Round | None] = [None] * num_layers
        cuda = device.type == "cuda"
        self._copy_stream = torch.cuda.Stream(device) if cuda else None
        self._threads = ThreadPoolExecutor(1, thread_name_prefix="eplb-plan") if cuda else None
        self._waits: ThreadPoolExecutor | None = None

    # ---- counters ----------------------------------------------------------------------------------------

    def reset_counters(self) -> None:
        """Forget every count (after warm-up and capture runs on dummy batches)."""
        self.current.zero_()
        self.window.zero_()

    def physical_load(self) -> torch.Tensor:
        """[layers, physical experts]: tokens routed to each physical expert over the window (on the device)."""
        return self.window.sum(dim=0).gather(1, self._slot_of_phys)

    def _write_slot_of_phys(self) -> None:
        table = torch.zeros(len(self.slot_phys), self.num_physical, dtype=torch.int64)
        for layer, phys in enumerate(self.slot_phys):
            for slot, p in enumerate(phys):
                if p >= 0:
                    table[layer, p] = slot
        self._slot_of_phys.copy_(table.pin_memory() if self.device.type == "cuda" else table, non_blocking=True)

    # ---- the step boundary -------------------------------------------------------------------------------

    def end_step(self, mid_prefill: bool) -> None:
        """After a step's forward is queued: fold its counts into the window, then advance the rebalance.
        ``mid_prefill``: a request of the step still has prompt tokens to compute (the same on every rank)."""
        self.window[self.pos].copy_(self.current)
        self.current.zero_()
        self.pos = (self.pos + 1) % self.config.window_size
        self.step += 1
        due = self._moves is not None or (self._plan is None and self.step >= self.next_rebalance)
        if self.parallel.dp_size > 1 and due:  # DP attention: each rank its own batch, one answer for all
            mid_prefill = not self._agree([not mid_prefill])[0]
        if self._moves is not None:
            self._switch_finished(mid_prefill)
        if self._moves is None and self._plan is not None and self._agree([self._plan.done()])[0]:
            self._moves = self._plan.result()
            self._plan = None
        if self._moves is not None:
            self._start_rounds()
            self._finish_if_done()
        elif self._plan is None and self.step >= self.next_rebalance and not mid_prefill:
            self._start_plan()

    def _agree(self, flags: list[bool]) -> list[bool]:
        """Each flag true on every EP rank (one all-reduce over the host group; at one rank: the flags)."""
        if self.num_ranks == 1:
            return flags
        t = torch.tensor(flags, dtype=torch.int32)
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self.parallel.ep_host_group)
        return [bool(v) for v in t.tolist()]

    def _start_plan(self) -> None:
        self.stats.last_plan_step = self.step
        self.next_rebalance = self.step + self.config.step_interval
        slot_log = [list(m.slot_log) for m in self.maps]
        loads = self.window.sum(dim=0)
        if self.parallel.dp_size > 1:  # DP attention: each rank counted its own tokens; plan from all of them
            dist.all_reduce(loads, group=self.parallel.ep_group)
        if self._threads is None:
            future: Future = Future()
            future.set_result(self._plan_moves(loads, slot_log))
            self._plan = future
            return
        host = torch.empty(loads.shape, dtype=loads.dtype, pin_memory=True)
        host.copy_(loads, non_blocking=True)
        ready = torch.cuda.Event()
        ready.record()
        self._plan = self._threads.submit(self._plan_after, ready, host, slot_log)

    def _plan_after(self, ready: torch.cuda.Event, host: torch.Tensor, slot_log: list[list[int]]):
        ready.synchronize()  # in the planning thread: the step loop never waits for it
        return self._plan_moves(host, slot_log)

    def _plan_moves(self, slot_loads: torch.Tensor, slot_log: list[list[int]]
                    ) -> list[tuple[list[Counter], list[Counter]]]:
        """Plan from the window's loads per storage slot; -> each layer's (excess, missing) experts per rank."""
        slots = np.asarray(slot_log)
        per_slot = slot_loads.cpu().numpy().astype(np.float64)
        logical = np.zeros((len(slot_log), self.num_logical))
        for layer in range(len(slot_log)):
            used = slots[layer] >= 0
            np.add.at(logical[layer], slots[layer][used], per_slot[layer][used])
        groups = self.num_groups if self.num_logical % self.num_groups == 0 else 1
        placement = rebalance_experts(logical, self.num_physical, groups, 1, self.num_ranks)
        if self.config.log_balancedness:
            now = placement_from_phy2log(np.stack([s[s >= 0] for s in slots]), self.num_logical)
            logger.info("EPLB at step %d: moe_lb over %d rank(s) %.3f now, %.3f planned", self.step,
                        self.num_ranks, float(moe_lb(logical, now, self.num_ranks).mean()),
                        float(moe_lb(logical, placement, self.num_ranks).mean()))
        plans = []
        for layer in range(len(slot_log)):
            targets = moves.rank_targets(placement.phy2log[layer], slot_log[layer], self.rank_slots)
            plans.append(moves.rank_moves(targets, slot_log[layer], self.rank_slots))
        return plans

    def _start_rounds(self) -> None:
        """Each layer with moves left and no round in flight starts its next round's copies."""
        started = 0
        waited = False
        for layer, (excess, missing) in enumerate(self._moves):
            if self._rounds[layer] is not None or not any(missing):
                continue
            slot_log = self.maps[layer].slot_log
            chosen = moves.next_round(slot_log, excess, missing)
            if not chosen:  # cannot happen for a planner's placement; said and stopped, never looped on
                logger.warning("EPLB: layer %d has moves left that would leave an expert without a replica; "
                               "this rebalance stops there", layer)
                self.stats.num_abandoned += 1
                missing.clear()
                continue
            if self._copy_stream is not None and not waited:  # spares may still be read by queued steps
                self._copy_stream.wait_stream(torch.cuda.current_stream(self.device))
                waited = True
            spares = {rank: next(s for s in self.rank_slots[rank] if slot_log[s] == -1) for rank, _, _ in chosen}
            flight = _Round(chosen, spares)
            for rank, _, gaining in chosen:
                started += self._copy(layer, flight, spares[rank], rank, self._source(slot_log, gaining, rank))
            moves.take(excess, missing, chosen)
            if flight.works and self.device.type == "cpu":
                flight.received = self._waiter().submit(lambda works=flight.works: [w.wait() for w in works])
            self._rounds[layer] = flight
        self.stats.copy_bytes += started
        self.stats.max_copy_bytes_per_step = max(self.stats.max_copy_bytes_per_step, started)

    def _waiter(self) -> ThreadPoolExecutor:
        """The thread that waits on gloo's transfers for the step loop (made on first use)."""
        if self._waits is None:
            self._waits = ThreadPoolExecutor(1, thread_name_prefix="eplb-move")
        return self._waits

    def _source(self, slot_log: list[int], expert: int, rank: int) -> int:
        """The slot to copy ``expert`` from for ``rank``: one of its own, else the lowest holding it."""
        own = [s for s in self.rank_slots[rank] if slot_log[s] == expert]
        return own[0] if own else slot_log.index(expert)

    def _copy(self, layer: int, flight: _Round, dst: int, dst_rank: int, src: int) -> int:
        """This rank's part in copying slot ``src`` into ``dst`` (global slots); -> the bytes it receives."""
        src_rank = src // len(self.rank_slots[0])
        if self.rank not in (src_rank, dst_rank):
            return 0
        experts = self.experts[layer]
        local_src, local_dst = src - self.rank_slots[src_rank][0], dst - self.rank_slots[dst_rank][0]
        if src_rank == dst_rank:
            if self._copy_stream is None:
                experts.copy_slot(local_src, local_dst)
            else:
                with torch.cuda.stream(self._copy_stream):
                    experts.copy_slot(local_src, local_dst)
                    event = torch.cuda.Event()
                    event.record()
                    flight.events.append(event)
            return experts.slot_bytes()
        group = self.parallel.ep_move_group
        for index, tensor in enumerate(experts.slot_tensors()):
            tag = layer * 16 + index  # one round per layer at a time: tags never meet a message of another
            if self.rank == src_rank:
                flight.works.append(dist.isend(tensor[local_src], dst_rank, group=group, tag=tag))
            else:
                flight.works.append(dist.irecv(tensor[local_dst], src_rank, group=group, tag=tag))
        if self.rank == src_rank:
            return 0
        self.stats.received_bytes += experts.slot_bytes()
        return experts.slot_bytes()

    def _switch_finished(self, mid_prefill: bool) -> None:
        """Switch, on every rank at once, the rounds whose copies every rank has finished (unless inside a
        prefill)."""
        layers = [layer for layer, flight in enumerate(self._rounds) if flight is not None]
        if not layers:
            return
        done = self._agree([self._rounds[layer].copied() for layer in layers])
        switched = False
        for layer, ready in zip(layers, done):
            if not ready:
                self.stats.num_not_ready += 1
                continue
            if mid_prefill:
                self.stats.num_deferred += 1
                continue
            flight = self._rounds[layer]
            slot_log = list(self.maps[layer].slot_log)
            phys = self.slot_phys[layer]
            for dst, lost in moves.apply_round(slot_log, flight.moves, flight.spares, self.rank_slots):
                phys[dst], phys[lost] = phys[lost], -1
            self.maps[layer].assign(slot_log)
            self._rounds[layer] = None
            self.stats.num_switches += len(flight.moves)
            switched = True
        if switched:
            self._write_slot_of_phys()

    def _finish_if_done(self) -> None:
        if any(any(missing) for _, missing in self._moves) or any(f is not None for f in self._rounds):
            return
        self._moves = None
        self.stats.num_rebalances += 1
        self.window.zero_()

    def close(self) -> None:
        for threads in (self._threads, self._waits):
            if threads is not None:
                threads.shutdown(wait=False, cancel_futures=True)
