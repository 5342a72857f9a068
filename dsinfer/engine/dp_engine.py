"""DP attention: one engine per data-parallel rank (its own scheduler, KV cache and batch), the MoE layers across
all ranks (vLLM's ``data_parallel_size`` with ``enable_expert_parallel``; DeepInfer's #DP = #EP shape).

``DataParallelEngine`` holds ``data_parallel_size`` ``LLMEngine``s over one ``MultiprocExecutor`` whose workers
form the EP group (each engine's ``RankExecutor`` talks to its own worker). A request goes to the rank with the
fewest unfinished requests (ties: the lower rank) and stays there, so its KV blocks and prefix hits are that
rank's. ``step()`` steps every rank's engine at once, each in a thread of its own: a rank whose engine has
nothing to compute runs an empty step, in which its worker still takes part in every MoE layer's ``ep_moe``
exchange with no tokens, so the collectives of the busy ranks always meet. Steps are synchronous (one forward per
rank per step: no async scheduling, no speculative decoding).

It answers what ``LLM`` asks of an engine: ``add_request``, ``abort_request``, ``abort_all``, ``step``,
``has_unfinished_requests``, ``get_stats`` (counters summed over the ranks), ``shutdown``, and rank 0's
``tokenizer``, ``config``, ``model_config`` and ``check_priority``.
"""

from __future__ import annotations

from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor, wait
from typing import Any

from dsinfer.engine.arg_utils import EngineArgs
from dsinfer.engine.llm_engine import LLMEngine
from dsinfer.engine.outputs import RequestOutput
from dsinfer.engine.sampling_params import SamplingParams
from dsinfer.executor.base import WorkerDiedError

# get_stats keys summed over the ranks (the others are rank 0's)
SUMMED = ("num_running", "num_waiting", "num_waiting_tokens", "num_kv_tokens", "num_preemptions",
          "prefix_cache_queries", "prefix_cache_hits", "num_prompt_tokens", "num_generation_tokens")


class DataParallelEngine:
    def __init__(self, engines: list[LLMEngine]):
        self.engines = engines
        self.executor = engines[0].executor.parent  # the workers of every rank
        self.config, self.model_config, self.tokenizer = engines[0].config, engines[0].model_config, \
            engines[0].tokenizer
        self._rank_of: dict[str, int] = {}
        self._threads = ThreadPoolExecutor(len(engines), thread_name_prefix="dsinfer-dp")

    @classmethod
    def from_engine_args(cls, args: EngineArgs, usage: str = "offline") -> DataParallelEngine:
        from dsinfer.executor.mp import MultiprocExecutor

        config, tokenizer = LLMEngine.config_and_tokenizer(args, usage)
        executor = MultiprocExecutor(config)  # every rank's worker, the EP group among them
        try:
            engines = [LLMEngine(config, tokenizer, executor=executor.rank_view(rank))
                       for rank in range(config.parallel.data_parallel_size)]
        except BaseException:
            executor.shutdown()
            raise
        return cls(engines)

    # ---- requests ------------------------------------------------------------------------------------------

    def check_priority(self, priority: Any) -> None:
        self.engines[0].check_priority(priority)

    def add_request(self, request_id: str, prompt: str | dict[str, Any], params: SamplingParams,
                    arrival_time: float | None = None, priority: int = 0, first_token: int | None = None) -> None:
        """To the rank with the fewest unfinished requests (ties: the lower rank); see ``LLMEngine.add_request``."""
        if request_id in self._rank_of:
            raise ValueError(f"request id {request_id!r} is already in use")
        loads = [sum(1 for rid, r in self._rank_of.items() if r == rank) for rank in range(len(self.engines))]
        rank = loads.index(min(loads))
        self.engines[rank].add_request(request_id, prompt, params, arrival_time, priority, first_token)
        self._rank_of[request_id] = rank

    def abort_request(self, request_ids: Iterable[str]) -> None:
        for request_id in list(request_ids):
            rank = self._rank_of.pop(request_id, None)
            if rank is not None:
                self.engines[rank].abort_request([request_id])

    def abort_all(self) -> None:
        for engine in self.engines:
            engine.abort_all()
        self._rank_of.clear()

    def has_unfinished_requests(self) -> bool:
        return any(engine.has_unfinished_requests() for engine in self.engines)

    # ---- stepping ------------------------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """One step of every rank at once (an empty one where a rank has nothing to compute); -> the outputs of
        all ranks. A rank's failure is raised after every rank's step has returned."""
        if not self.has_unfinished_requests():
            return []
        futures = [self._threads.submit(engine.step) for engine in self.engines]
        wait(futures)  # every rank's step has returned (or raised) before anyone touches the engines again
        died = [f.exception() for f in futures if isinstance(f.exception(), WorkerDiedError)]
        if died:  # the root cause before the other ranks' failed collectives
            raise died[0]
        outputs = []
        for future in futures:
            outputs += future.result()
        for output in outputs:
            if output.finished:
                self._rank_of.pop(output.request_id, None)
        return outputs

    # ---- introspection -------------------------------------------------------------------------------------

    def get_stats(self) -> dict[str, Any]:
        stats = [engine.get_stats() for engine in self.engines]
        merged = dict(stats[0])
        for key in SUMMED:
            merged[key] = sum(s[key] for s in stats)
        merged["kv_cache_usage"] = max(s["kv_cache_usage"] for s in stats)  # the fullest rank's
        merged["per_rank"] = stats
        merged["num_empty_steps"] = [engine.num_empty_steps for engine in self.engines]  # steps a rank sat out
        return merged

    def shutdown(self) -> None:
        for engine in self.engines:
            engine._save_curve()
        self.executor.shutdown()
        self._threads.shutdown(wait=False)
