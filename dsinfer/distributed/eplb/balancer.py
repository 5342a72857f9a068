"""The worker's EPLB: expert load counters over a window of steps, and rebalances that never stall a step.

Counters: every MoE layer's ``ExpertMap`` adds its routed (token, expert) pairs to its row of ``current``
[layers, storage slots] inside the forward (on the device, no host read: CUDA graphs capture it). At each step
boundary ``end_step`` moves ``current`` into the ring ``window`` [window_size, layers, storage slots] and zeroes
it (two device ops, no host sync). Physical expert p of a layer lives in one storage slot (``slot_phys``: the
physical id of each slot, -1 for a spare); ``physical_load`` reads the window per physical expert.

A rebalance (the first after a quarter of ``step_interval``, then every interval; one at a time):
1. the window's loads per logical expert are planned (``planner.rebalance_experts``: replica counts; at EP = 1
   the GPU a replica sits on does not matter), inline on CPU, in a background thread on CUDA (the window reaches
   the host by a non-blocking copy the thread waits for);
2. the plan becomes moves per layer, (expert losing a replica, expert gaining one) in id order;
3. each step, a layer with a free spare slot copies the gaining expert's weights from one of its replicas into
   the spare (CUDA: on a copy stream, after the main stream's earlier work, with an event; CPU: at once, one
   expert per layer per step, so a step's copy is bounded);
4. at a later step boundary whose copy is done (``event.query()``: never waited for), the layer's map switches:
   the spare becomes the gaining expert's replica (taking over the physical id of the slot it replaces) and
   the losing expert's highest slot becomes the spare. A switch or the start of a rebalance never happens at a
   boundary inside a prefill (a request with prompt tokens still to compute): it waits for the next boundary.
Every intermediate map is a valid placement (a losing expert keeps at least the replicas the plan gives it), and
replicas are byte copies routed by token index, so outputs do not change across a rebalance. The window restarts
after each rebalance (its loads described the old placement).
"""

from __future__ import annotations

import logging
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np
import torch

from dsinfer.config import EplbConfig
from dsinfer.distributed.eplb.planner import moe_lb, placement_from_phy2log, rebalance_experts

logger = logging.getLogger("dsinfer")


@dataclass
class RebalanceStats:
    """What the rebalances did (tests and logs read it)."""

    num_rebalances: int = 0  # completed
    num_switches: int = 0  # map switches (one replica moved in one layer each)
    num_deferred: int = 0  # boundaries where a finished copy's switch waited for the end of a prefill
    num_not_ready: int = 0  # boundaries where a copy was still running: the switch came later, nobody waited
    copy_bytes: int = 0  # weights copied in all
    max_copy_bytes_per_step: int = 0  # the most one step boundary started copying
    last_plan_step: int = -1  # the step the last rebalance was planned at


class ExpertLoadBalancer:
    """EPLB for the MoE ``blocks`` of one model at EP = 1 (each with ``expert_map`` and ``experts``).

    ``num_groups``: the router's expert groups (the planner's hierarchical policy keeps them whole)."""

    def __init__(self, blocks: list, config: EplbConfig, num_groups: int, device: torch.device):
        self.maps = [block.expert_map for block in blocks]
        self.experts = [block.experts for block in blocks]
        self.config, self.num_groups, self.device = config, num_groups, device
        first = self.maps[0]
        self.num_logical, self.num_physical, self.num_storage = first.num_logical, first.num_physical, \
            first.num_storage
        num_layers = len(blocks)
        self.current = torch.zeros(num_layers, self.num_storage, dtype=torch.float32, device=device)
        for layer, expert_map in enumerate(self.maps):
            expert_map.load = self.current[layer]
        self.window = torch.zeros(config.window_size, num_layers, self.num_storage, dtype=torch.float32,
                                  device=device)
        self.pos = 0
        self.slot_phys = [[p if p < self.num_physical else -1 for p in range(self.num_storage)]
                          for _ in range(num_layers)]
        self._slot_of_phys = torch.zeros(num_layers, self.num_physical, dtype=torch.int64, device=device)
        self._write_slot_of_phys()
        self.step = 0
        self.next_rebalance = max(1, config.step_interval // 4)
        self.stats = RebalanceStats()
        self._plan: Future | None = None
        self._moves: list[deque[tuple[int, int]]] | None = None  # per layer: (losing, gaining) logical experts
        self._in_flight: list[tuple[int, int, int, torch.cuda.Event | None] | None] = [None] * num_layers
        cuda = device.type == "cuda"
        self._copy_stream = torch.cuda.Stream(device) if cuda else None
        self._threads = ThreadPoolExecutor(1, thread_name_prefix="eplb-plan") if cuda else None

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
        ``mid_prefill``: a request of the step still has prompt tokens to compute."""
        self.window[self.pos].copy_(self.current)
        self.current.zero_()
        self.pos = (self.pos + 1) % self.config.window_size
        self.step += 1
        if self._moves is not None:
            self._switch_finished(mid_prefill)
        if self._moves is None and self._plan is not None and self._plan.done():
            self._moves = self._plan.result()
            self._plan = None
        if self._moves is not None:
            self._start_copies()
            self._finish_if_done()
        elif self._plan is None and self.step >= self.next_rebalance and not mid_prefill:
            self._start_plan()

    def _start_plan(self) -> None:
        self.stats.last_plan_step = self.step
        self.next_rebalance = self.step + self.config.step_interval
        slot_log = [list(m.slot_log) for m in self.maps]
        loads = self.window.sum(dim=0)
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

    def _plan_moves(self, slot_loads: torch.Tensor, slot_log: list[list[int]]) -> list[deque[tuple[int, int]]]:
        """Plan from the window's loads per storage slot; -> each layer's moves."""
        slots = np.asarray(slot_log)
        per_slot = slot_loads.cpu().numpy().astype(np.float64)
        logical = np.zeros((len(slot_log), self.num_logical))
        for layer in range(len(slot_log)):
            used = slots[layer] >= 0
            np.add.at(logical[layer], slots[layer][used], per_slot[layer][used])
        groups = self.num_groups if self.num_logical % self.num_groups == 0 else 1
        placement = rebalance_experts(logical, self.num_physical, groups, 1, 1)
        if self.config.log_balancedness:
            before = moe_lb(logical, placement_from_phy2log(np.stack([s[s >= 0] for s in slots]), self.num_logical), 1)
            logger.info("EPLB at step %d: moe_lb over 1 rank %.3f (1.0 at EP = 1); replicas per expert, hottest "
                        "layer: %s", self.step, float(before.mean()),
                        placement.logcnt[int(np.argmax(logical.max(axis=1)))].tolist())
        moves = []
        for layer in range(len(slot_log)):
            now = np.bincount(slots[layer][slots[layer] >= 0], minlength=self.num_logical)
            diff = placement.logcnt[layer] - now
            gains = np.repeat(np.arange(self.num_logical), np.maximum(diff, 0))
            losses = np.repeat(np.arange(self.num_logical), np.maximum(-diff, 0))
            moves.append(deque(zip(losses.tolist(), gains.tolist())))
        return moves

    def _start_copies(self) -> None:
        """Each layer with a move left and its spare free starts copying the gaining expert into the spare."""
        started = 0
        waited = False
        for layer, moves in enumerate(self._moves):
            if not moves or self._in_flight[layer] is not None:
                continue
            losing, gaining = moves.popleft()
            slot_log = self.maps[layer].slot_log
            src, dst = slot_log.index(gaining), slot_log.index(-1)
            experts = self.experts[layer]
            event = None
            if self._copy_stream is not None:
                if not waited:  # the spare may still be read by steps queued before its switch
                    self._copy_stream.wait_stream(torch.cuda.current_stream(self.device))
                    waited = True
                with torch.cuda.stream(self._copy_stream):
                    experts.copy_slot(src, dst)
                    event = torch.cuda.Event()
                    event.record()
            else:
                experts.copy_slot(src, dst)
            self._in_flight[layer] = (dst, losing, gaining, event)
            started += experts.slot_bytes()
        self.stats.copy_bytes += started
        self.stats.max_copy_bytes_per_step = max(self.stats.max_copy_bytes_per_step, started)

    def _switch_finished(self, mid_prefill: bool) -> None:
        """Switch the maps of the layers whose copy has finished (unless inside a prefill)."""
        switched = False
        for layer, flight in enumerate(self._in_flight):
            if flight is None:
                continue
            dst, losing, gaining, event = flight
            if event is not None and not event.query():
                self.stats.num_not_ready += 1
                continue
            if mid_prefill:
                self.stats.num_deferred += 1
                continue
            slot_log = list(self.maps[layer].slot_log)
            lost = len(slot_log) - 1 - slot_log[::-1].index(losing)  # the losing expert's highest slot
            slot_log[dst], slot_log[lost] = gaining, -1
            self.maps[layer].assign(slot_log)
            phys = self.slot_phys[layer]
            phys[dst], phys[lost] = phys[lost], -1
            self._in_flight[layer] = None
            self.stats.num_switches += 1
            switched = True
        if switched:
            self._write_slot_of_phys()

    def _finish_if_done(self) -> None:
        if any(self._moves) or any(f is not None for f in self._in_flight):
            return
        self._moves = None
        self.stats.num_rebalances += 1
        self.window.zero_()

    def close(self) -> None:
        if self._threads is not None:
            self._threads.shutdown(wait=False, cancel_futures=True)
