"""Token-budget scheduler: no prefill/decode phases, each request's computed tokens chase its token count.

Each step: running requests first (in admission order), each gets ``min(num_tokens - num_computed, budget)`` new
tokens; when KV blocks run out a running request is preempted (blocks freed, recomputed later). Then waiting
requests are admitted while budget, sequence slots and blocks last, starting after their cached prefix. Chunked
prefill is just a request getting fewer tokens than it lacks. The scheduler never touches a tensor.

The KV store (``store``, a ``kvstore.StoreIndex``): a waiting request whose prefix the store holds beyond the GPU
hit is admitted LOADING (blocks allocated, a ``KVLoad`` in the plan), not scheduled until the worker reports the
load (``loads_done``), while the others keep stepping; every step's ``KVSave`` entries name the full grains of
known tokens its scheduled requests have computed and the store lacks (``num_stored_grains``). Sliding-window
groups: a save also carries each new boundary's window state (its window blocks, while all are held), a load the
state at its last boundary (``StoreIndex.lookup`` backs off to one that is stored); a load that comes back
without it frees the request's blocks and admits it again without the store (time lost, never tokens).

Policies (vLLM's ``scheduling_policy``): "fcfs" admits in arrival order and preempts the most recently admitted
request; "priority" admits by (``request.priority``, arrival), lower first, and preempts the running request
last in that order (the lowest priority, the latest of them), which may be one already given tokens this step:
its tokens are taken back. A preempted request goes back to the waiting queue at its place in the policy's order.

Overlap (async scheduling): a token sampled by a step still in flight is a placeholder the scheduler already
counts (``request.num_pending``), so the next step decodes it before its value reaches the host; the runner
fills it in on the device. A request whose pending tokens already reach ``max_tokens`` is not scheduled again.

Multi-token steps: a running request's ``draft_token_ids`` (at most ``max_tokens`` - outputs - 1 of them, and
only when every one fits the budget) are scheduled after its last token, so the step verifies them; the engine
calls ``rollback`` with the number the worker rejected, which frees the KV blocks only they needed. A request
whose one-token step is still in flight may verify drafts too: they follow its placeholder (the drafter proposed
them one token ahead). With a ``ConfidenceScheduler`` (``confidence``) each request's drafts are first cut to the
prefix whose expected gain pays for its cost on the step-latency curve.

Each step's decisions are also written as a plain-data ``StepPlan`` (``core.plan``) for the worker: a request's
tokens and sampling once, then only what changed.
"""

from __future__ import annotations

import bisect
import itertools
import time
from collections import deque
from dataclasses import dataclass, field

from dsinfer.config import SchedulerConfig
from dsinfer.core.plan import KVLoad, KVSave, NewRequestData, StepPlan
from dsinfer.core.request import Request, RequestStatus
from dsinfer.kvcache.manager import KVCacheManager
from dsinfer.kvstore.index import StoreIndex
from dsinfer.scheduler.confidence import ConfidenceScheduler


@dataclass
class ScheduledRequest:
    request: Request
    num_new_tokens: int  # drafts included
    num_computed_tokens: int  # before this step
    draft_token_ids: list[int] = field(default_factory=list)  # verified this step: the last of the new tokens

    @property
    def samples(self) -> bool:
        """True when this step computes the request's last token (known or pending), so it samples the next one
        (and one more per draft).

        Read when the step's inputs are built, before the engine counts this step's own sample as pending.
        """
        end = self.request.num_tokens + self.request.num_pending + len(self.draft_token_ids)
        return self.num_computed_tokens + self.num_new_tokens == end


@dataclass
class SchedulerOutput:
    """The engine's view of a step (live requests) beside the worker's (``plan``, plain data)."""

    scheduled: list[ScheduledRequest] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)
    plan: StepPlan = field(default_factory=StepPlan)

    @property
    def num_batched_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


class Scheduler:
    def __init__(self, config: SchedulerConfig, kv_manager: KVCacheManager, max_model_len: int,
                 store: StoreIndex | None = None, confidence: ConfidenceScheduler | None = None):
        """``store``: the KV store's index (None: no store beyond the GPU prefix cache). ``confidence``:
        chooses how many of each request's drafts a step verifies (None: all that fit)."""
        self.config = config
        self.confidence = confidence
        self.kv = kv_manager
        self.max_model_len = max_model_len
        self.store = store
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.loading: dict[str, tuple[Request, int]] = {}  # request id -> (request, tokens its load asked for)
        self.num_preemptions = 0  # requests preempted (blocks freed for recompute) since start
        self.by_priority = config.policy == "priority"
        self._arrivals = itertools.count()  # the tie-break among equal priorities: the order requests came in
        self._arrival: dict[int, int] = {}  # id(request) -> its arrival number (priority policy)
        self._plans = PlanWriter(kv_manager.num_groups)
        self._loads: list[KVLoad] = []  # loads started this step (into the next plan)

    @property
    def num_unfinished(self) -> int:
        return len(self.waiting) + len(self.running) + sum(not r.is_finished for r, _ in self.loading.values())

    def add_request(self, request: Request) -> None:
        if self.by_priority:
            self._arrival[id(request)] = next(self._arrivals)
            self._enqueue(request)
        else:
            self.waiting.append(request)

    def _order(self, request: Request) -> tuple[int, int]:
        return request.priority, self._arrival[id(request)]

    def _enqueue(self, request: Request) -> None:
        """Priority policy: into the waiting queue at its place by (priority, arrival)."""
        self.waiting.insert(bisect.bisect(self.waiting, self._order(request), key=self._order), request)

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.config.max_num_batched_tokens
        if self.confidence is not None:
            self._select_drafts(budget)
        budget = self._schedule_running(out, budget)
        if not out.preempted:
            self._schedule_waiting(out, budget)
        for item in out.scheduled:
            item.request.num_computed_tokens += item.num_new_tokens
            item.request.draft_token_ids = []
            item.request.draft_confidence = []
        loads, self._loads = self._loads, []
        out.plan = self._plans.write(out.scheduled, out.preempted)
        out.plan.kv_loads = loads
        if self.store is not None:
            out.plan.kv_saves = [save for item in out.scheduled if (save := self._save(item.request))]
        return out

    def _schedule_running(self, out: SchedulerOutput, budget: int) -> int:
        i = 0
        while i < len(self.running) and budget > 0:
            request = self.running[i]
            num_new = min(request.num_tokens + request.num_pending - request.num_computed_tokens, budget)
            if num_new <= 0 or request.num_output_tokens + request.num_pending >= request.max_tokens:
                i += 1
                continue
            drafts = self._drafts(request, budget - num_new) if request.draft_token_ids else []
            num_new += len(drafts)
            while not self.kv.allocate_slots(request, num_new):
                victim = self._pick_victim()
                index = self.running.index(victim)
                self.running.pop(index)
                if index < i:  # passed earlier this step (priority policy): tokens it was given are taken back
                    i -= 1
                    item = next((s for s in out.scheduled if s.request is victim), None)
                    if item is not None:  # None: it was passed over (nothing to compute, or at max_tokens)
                        out.scheduled.remove(item)
                        budget += item.num_new_tokens
                self._preempt(victim)
                out.preempted.append(victim)
                if victim is request:
                    return budget
            out.scheduled.append(ScheduledRequest(request, num_new, request.num_computed_tokens, drafts))
            budget -= num_new
            i += 1
        return budget

    def _drafts(self, request: Request, budget: int) -> list[int]:
        """The drafts this step verifies: all of them when the budget holds them, none otherwise."""
        drafts = request.draft_token_ids[:self._draft_room(request)]
        return list(drafts) if len(drafts) <= budget else []

    def _draft_room(self, request: Request) -> int:
        """How many drafts a step may verify for ``request``: none unless it decodes one token (known, or the
        placeholder of a one-token step in flight); never more than the outputs it may still give (a step gives
        at most one more than its drafts) or the context holds."""
        if request.num_pending > 1 or request.num_computed_tokens + 1 != request.num_tokens + request.num_pending:
            return 0
        num_tokens = request.num_tokens + request.num_pending
        room = min(request.max_tokens - request.num_output_tokens - request.num_pending,
                   self.max_model_len - num_tokens) - 1
        return max(room, 0)

    def _select_drafts(self, budget: int) -> None:
        """Confidence scheduling: cut each running request's drafts to what ``self.confidence`` admits, priced
        against the running requests' other tokens (the step's base; prompt chunks of admitted requests are not
        foreseen)."""
        confidences: dict[str, list[float]] = {}
        drafting: list[Request] = []
        base = guaranteed = 0
        for request in self.running:
            lacking = request.num_tokens + request.num_pending - request.num_computed_tokens
            if lacking <= 0 or request.num_output_tokens + request.num_pending >= request.max_tokens:
                continue
            base += lacking
            guaranteed += lacking == 1
            room = self._draft_room(request) if request.draft_token_ids else 0
            if room:
                n = min(room, len(request.draft_token_ids))
                conf = request.draft_confidence
                confidences[request.request_id] = list(conf[:n]) if len(conf) >= n else [1.0] * n
                drafting.append(request)
        if not drafting:
            return
        chosen = self.confidence.select(confidences, min(base, budget), guaranteed)
        for request in drafting:
            request.draft_token_ids = request.draft_token_ids[:chosen[request.request_id]]

    def rollback(self, request: Request, num_rejected: int) -> None:
        """A step's last ``num_rejected`` drafts were not kept: their KV is not the request's, and the blocks only
        they needed go back to the pool."""
        if num_rejected <= 0:
            return
        request.num_computed_tokens -= num_rejected
        self._plans.trimmed(request, self.kv.trim(request, request.num_computed_tokens))

    def _schedule_waiting(self, out: SchedulerOutput, budget: int) -> None:
        # structured-output grammar not compiled yet: they wait, others proceed; one that failed to compile also
        # waits (it may have failed since the engine's check this step), and the engine aborts it on the next
        compiling: list[Request] = []
        while self.waiting and budget > 0 and len(self.running) + len(self.loading) < self.config.max_num_seqs:
            request = self.waiting[0]
            if request.waits_for_grammar:
                compiling.append(self.waiting.popleft())
                continue
            if request.num_pending:  # preempted with a token in flight: wait until it lands
                break
            computed, num_cached = self.kv.get_computed_blocks(request)
            if self.store is not None and self._start_load(request, computed, num_cached):
                continue
            num_new = request.num_tokens - num_cached
            if num_new > budget and not self.config.enable_chunked_prefill:
                break
            num_new = min(num_new, budget)
            request.num_computed_tokens = num_cached  # allocate_slots sizes blocks from computed + new
            if not self.kv.allocate_slots(request, num_new, computed):
                request.num_computed_tokens = 0
                break
            self.waiting.popleft()
            if request.num_cached_tokens < 0:
                request.num_cached_tokens = num_cached
                request.first_scheduled_time = time.monotonic()
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            out.scheduled.append(ScheduledRequest(request, num_new, num_cached))
            budget -= num_new
        self.waiting.extendleft(reversed(compiling))

    # ----------------------------------------------------------------- the KV store
    def _start_load(self, request: Request, computed: list, num_cached: int) -> bool:
        """Admit the request to load its prefix from the store when the store holds more of it than the GPU
        cache: its blocks are allocated, a ``KVLoad`` goes into the plan, and it waits (LOADING, not scheduled,
        holding a sequence slot) until the worker reports the load done (``loads_done``). False: admit as usual."""
        if not request.store_lookup or request.needs_prompt_logprobs:
            return False
        self.kv.update_hashes(request)
        keys = self.store.keys(request.block_hashes, request.store_keys)
        grain = self.store.grain
        max_grains = min((request.num_tokens - 1) // grain, len(keys))  # at least one token is computed
        stored = self.store.lookup(keys[:max_grains], num_cached // grain)
        request.num_stored_grains = max(request.num_stored_grains, stored)
        if stored * grain <= num_cached:
            return False
        request.num_computed_tokens = num_cached
        if not self.kv.allocate_for_load(request, stored * grain - num_cached, computed):
            request.num_computed_tokens = 0
            return False
        self.waiting.popleft()
        first, bpg = num_cached // grain, self.store.blocks_per_grain
        num_held = self.kv.num_held(computed)
        load = KVLoad(request.request_id, [], [])
        if self.store.has_full:
            load.keys = keys[first:stored]
            load.block_ids = [request.blocks[j].block_id if j >= num_held else -1
                              for j in range(first * bpg, stored * bpg)]
        if self.store.has_windows:
            load.window_key = self.store.window_key(keys[stored - 1])
            load.window_block_ids = self.kv.window_block_ids(request, stored * grain, num_held)
            load.window_tokens = (stored - first) * grain
        self._loads.append(load)
        self.loading[request.request_id] = (request, (stored - first) * grain)
        request.status = RequestStatus.LOADING
        if request.first_scheduled_time is None:
            request.first_scheduled_time = time.monotonic()
        return True

    def loads_done(self, done: dict[str, int]) -> None:
        """The worker filled ``done[r]`` tokens of request ``r``'s load: it runs from there (a short load, the rest
        recomputed, and the store not asked again for it until it is preempted); an aborted one's blocks go back."""
        for request_id, tokens in done.items():
            request, asked = self.loading.pop(request_id)
            if request.is_finished:
                self.kv.free(request)
                continue
            if tokens < asked and self.store.has_windows:  # no window state: nothing usable, admitted anew
                self.kv.free(request)
                request.num_computed_tokens = 0
                request.store_lookup = False
                request.num_stored_grains = 0  # what it found broken is saved again, whole
                request.status = RequestStatus.WAITING
                if self.by_priority:
                    self._enqueue(request)
                else:
                    self.waiting.appendleft(request)
                continue
            start = request.num_computed_tokens // self.store.grain * self.store.grain
            request.num_computed_tokens = max(request.num_computed_tokens, start + tokens)
            if tokens < asked:
                request.store_lookup = False
                request.num_stored_grains = request.num_computed_tokens // self.store.grain
            self.kv.cache_loaded(request)
            if request.num_cached_tokens < 0:
                request.num_cached_tokens = request.num_computed_tokens
            request.status = RequestStatus.RUNNING
            self.running.append(request)

    def _save(self, request: Request) -> KVSave | None:
        """The grains of known tokens that the request's computed KV now fills and the store lacks."""
        self.kv.update_hashes(request)
        keys = self.store.keys(request.block_hashes, request.store_keys)
        end = min(request.num_computed_tokens, request.num_tokens) // self.store.grain
        first = request.num_stored_grains
        if end <= first:
            return None
        bpg = self.store.blocks_per_grain
        request.num_stored_grains = end
        save = KVSave([], [], request.kv_ttl_s)
        if self.store.has_full:
            save.keys = keys[first:end]
            save.block_ids = [b.block_id for b in request.blocks[first * bpg:end * bpg]]
        if self.store.has_windows:  # the window states whose blocks are all still held
            for i in range(first, end):
                if (ids := self.kv.window_block_ids(request, (i + 1) * self.store.grain)) is not None:
                    save.window_keys.append(self.store.window_key(keys[i]))
                    save.window_block_ids.append(ids)
        return save if save.keys or save.window_keys else None

    def _pick_victim(self) -> Request:
        if self.by_priority:
            return max(self.running, key=self._order)
        return self.running[-1]

    def _preempt(self, request: Request) -> None:
        self.kv.free(request)
        self._plans.dropped(request, preempted=True)
        request.num_computed_tokens = 0
        request.store_lookup = True
        request.num_preemptions += 1
        self.num_preemptions += 1
        request.status = RequestStatus.PREEMPTED
        if self.by_priority:
            self._enqueue(request)
        else:
            self.waiting.appendleft(request)

    def finish(self, request: Request, status: RequestStatus) -> None:
        """Remove a request (finished or aborted) and free its blocks (a loading one's when its load is done:
        the worker writes them until then)."""
        if request.status == RequestStatus.LOADING:
            request.status = status
            self._arrival.pop(id(request), None)
            return
        if request.status == RequestStatus.RUNNING:
            self.running.remove(request)
        elif not request.status.finished:
            self.waiting.remove(request)
        request.status = status
        self.kv.free(request)
        self._plans.dropped(request, preempted=False)
        self._arrival.pop(id(request), None)


class PlanWriter:
    """Writes each step's ``StepPlan``: remembers what the worker was sent of every request (its tokens in
    ``request.num_tokens_sent``, its blocks here) so a plan carries a request's data once, then only the change."""

    def __init__(self, num_groups: int = 1) -> None:
        """``num_groups``: KV cache groups; every group's block list of a request is as long as its ``blocks``."""
        self.num_groups = num_groups
        self._blocks_sent: dict[str, int] = {}  # request id -> blocks the worker holds for it (in every group)
        self._finished: list[str] = []  # worker entries to drop with the next plan
        self._preempted: list[str] = []

    def write(self, scheduled: list[ScheduledRequest], preempted: list[Request]) -> StepPlan:
        plan = StepPlan(finished_req_ids=self._finished, preempted_req_ids=self._preempted)
        self._finished, self._preempted = [], []
        cached = plan.cached_requests  # one KV cache group: its columns filled directly (``append`` is per row)
        if self.num_groups > 1:
            cached.new_block_ids = [[] for _ in range(self.num_groups)]
            cached.num_kept_blocks = [[] for _ in range(self.num_groups)]
        new_block_ids, num_kept_blocks = cached.new_block_ids[0], cached.num_kept_blocks[0]
        for item in scheduled:
            request = item.request
            blocks = request.blocks
            if request.num_tokens_sent == 0:
                plan.new_requests.append(NewRequestData(
                    request.request_id, list(request.all_token_ids), request.num_prompt_tokens, request.sampling,
                    [[block.block_id for block in group] for group in (blocks, *request.group_blocks)],
                    item.num_computed_tokens, max(len(request.prompt_logprobs) - 1, 0), request.state_slot))
            elif self.num_groups > 1:
                kept = min(self._blocks_sent[request.request_id], len(blocks))
                cached.append(request.request_id, request.all_token_ids[request.num_tokens_sent:],
                              [[b.block_id for b in group[kept:]] for group in (blocks, *request.group_blocks)],
                              [kept] * self.num_groups, item.num_computed_tokens)
            else:  # only the change: a decode step's costs no walk over the request's blocks
                kept = min(self._blocks_sent[request.request_id], len(blocks))
                cached.request_ids.append(request.request_id)
                cached.new_token_ids.append(request.all_token_ids[request.num_tokens_sent:])
                new_block_ids.append([block.block_id for block in blocks[kept:]] if kept < len(blocks) else [])
                num_kept_blocks.append(kept)
                cached.num_computed_tokens.append(item.num_computed_tokens)
            request.num_tokens_sent = request.num_tokens
            self._blocks_sent[request.request_id] = len(blocks)
            plan.num_scheduled_tokens[request.request_id] = item.num_new_tokens
            if item.draft_token_ids:
                plan.draft_token_ids[request.request_id] = list(item.draft_token_ids)
        return plan

    def trimmed(self, request: Request, num_blocks: int) -> None:
        """The request keeps only its first ``num_blocks`` blocks (the worker is told with its next plan)."""
        if request.request_id in self._blocks_sent:
            self._blocks_sent[request.request_id] = min(self._blocks_sent[request.request_id], num_blocks)

    def dropped(self, request: Request, preempted: bool) -> None:
        """The request's worker entry goes (preempted: it is sent whole again when it resumes)."""
        if self._blocks_sent.pop(request.request_id, None) is None:
            return
        request.num_tokens_sent = 0
        (self._preempted if preempted else self._finished).append(request.request_id)


def standalone_output(items: list[ScheduledRequest], resend: bool = True) -> SchedulerOutput:
    """A step of requests scheduled by hand (tests and benchmarks that allocate KV blocks outside a Scheduler),
    which can be run any number of times: each request is sent to the worker whole, or (``resend=False``, for a
    worker that ran such a step of them already) as an unchanged entry, as the engine's decode steps send them."""
    if resend:
        for item in items:
            item.request.num_tokens_sent = 0
        return SchedulerOutput(items, [], PlanWriter().write(items, []))
    plan = StepPlan()
    for item in items:
        request = item.request
        plan.cached_requests.append(request.request_id, [], [[]], [len(request.blocks)], item.num_computed_tokens)
        plan.num_scheduled_tokens[request.request_id] = item.num_new_tokens
    return SchedulerOutput(items, [], plan)
