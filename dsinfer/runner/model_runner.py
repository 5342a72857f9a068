"""ModelRunner: SchedulerOutput -> ForwardBatch -> logits -> sampled tokens (+ logprobs).

It owns the model and the KV cache tensors (sized from the memory budget after the model loads).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import torch

from dsinfer import envs
from dsinfer.config import EngineConfig
from dsinfer.kvcache.spec import KVCacheSpec
from dsinfer.models.loader.model_loader import load_model
from dsinfer.runner.input_batch import build_sampling_batch, build_step_inputs
from dsinfer.sampling.sampler import Sampler
from dsinfer.scheduler.scheduler import SchedulerOutput

logger = logging.getLogger("dsinfer")

GiB = 1 << 30


@dataclass
class TokenLogprobs:
    """Logprob data of one position: candidate ids (scored token first), their logprobs, the scored token's rank."""

    token_ids: list[int]
    logprobs: list[float]
    rank: int


@dataclass
class RunnerOutput:
    sampled: dict[str, int] = field(default_factory=dict)  # request id -> new token
    logprobs: dict[str, TokenLogprobs] = field(default_factory=dict)
    prompt_logprobs: dict[str, list[TokenLogprobs]] = field(default_factory=dict)


class ModelRunner:
    def __init__(self, config: EngineConfig):
        self.config = config
        self.device = config.device.device
        if self.device.type == "cpu" and envs.CPU_THREADS.get():
            torch.set_num_threads(envs.CPU_THREADS.get())
        self.model = load_model(config)
        self.vocab_size = config.model.vocab_size
        self.block_size = config.cache.block_size
        layers = self.model.attention_layers()
        self.kv_specs: list[KVCacheSpec] = [
            layer.kv_cache_spec(self.block_size, config.model.dtype) for layer in layers]
        self.num_blocks = self._num_kv_blocks()
        for layer, spec in zip(layers, self.kv_specs):
            layer.kv_cache = spec.allocate(self.num_blocks, self.device)
        self.sampler = Sampler()

    @property
    def kv_bytes_per_token(self) -> int:
        return sum(spec.bytes_per_block for spec in self.kv_specs) // self.block_size

    def _num_kv_blocks(self) -> int:
        cache = self.config.cache
        per_block = sum(spec.bytes_per_block for spec in self.kv_specs)
        blocks_per_seq = -(-self.config.model.max_model_len // self.block_size)
        if cache.num_kv_blocks is not None:
            return cache.num_kv_blocks
        budget = self._kv_budget_bytes()
        wanted = self.config.scheduler.max_num_seqs * blocks_per_seq + 1  # more could never be used
        num_blocks = min(budget // per_block, wanted)
        if num_blocks < blocks_per_seq + 1:
            need = (blocks_per_seq + 1) * per_block / GiB
            raise ValueError(
                f"the KV cache budget ({budget / GiB:.2f} GiB) holds {num_blocks} blocks, fewer than one "
                f"max_model_len={self.config.model.max_model_len} sequence needs ({need:.2f} GiB): raise the "
                "KV memory (kv_cache_memory_gb / gpu_memory_utilization) or lower max_model_len")
        logger.info("KV cache: %d blocks of %d tokens (%.2f GiB)", num_blocks, self.block_size,
                    num_blocks * per_block / GiB)
        return int(num_blocks)

    def _kv_budget_bytes(self) -> int:
        cache = self.config.cache
        if cache.kv_cache_memory_gb is not None:
            return int(cache.kv_cache_memory_gb * GiB)
        if self.device.type == "cpu":
            return int(envs.CPU_KV_CACHE_GB.get() * GiB)
        free, total = torch.cuda.mem_get_info(self.device)
        activation_reserve = 2 * GiB  # logits, activations of the largest step, CUDA graphs
        budget = int(total * cache.gpu_memory_utilization) - (total - free) - activation_reserve
        if budget <= 0:
            raise ValueError(
                f"the model leaves no room for a KV cache: {(total - free) / GiB:.1f} GiB used of "
                f"{total / GiB:.1f} GiB, gpu_memory_utilization={cache.gpu_memory_utilization} allows "
                f"{total * cache.gpu_memory_utilization / GiB:.1f} GiB; short by {-budget / GiB:.1f} GiB")
        return budget

    @torch.inference_mode()
    def execute(self, sched: SchedulerOutput) -> RunnerOutput:
        inputs = build_step_inputs(sched.scheduled, self.block_size, self.device)
        batch = inputs.batch
        hidden = self.model(batch.input_ids, batch.positions, batch)
        logits = self.model.compute_logits(hidden[batch.logits_indices])
        out = RunnerOutput()
        if inputs.sample_items:
            self._sample(logits[inputs.sample_rows], inputs.sample_items, out)
        for rows in inputs.prompt_rows:
            n = len(rows.target_ids)
            chunk = logits[rows.first_row:rows.first_row + n]
            k = rows.item.request.params.prompt_logprobs
            targets = torch.tensor(rows.target_ids, device=chunk.device)
            out.prompt_logprobs[rows.item.request.request_id] = _score_tokens(chunk, targets, k)
        return out

    def _sample(self, logits: torch.Tensor, items, out: RunnerOutput) -> None:
        sbatch = build_sampling_batch(items, self.vocab_size, self.device)
        result = self.sampler(logits, sbatch)
        tokens = result.token_ids.tolist()  # the step's one host sync
        for item, token in zip(items, tokens):
            out.sampled[item.request.request_id] = token
        if result.logprobs is None:
            return
        ids, lps, ranks = result.logprob_token_ids.tolist(), result.logprobs.tolist(), result.sampled_ranks.tolist()
        for row, item in enumerate(items):
            k = item.request.params.logprobs
            if k is not None:
                out.logprobs[item.request.request_id] = TokenLogprobs(ids[row][:k + 1], lps[row][:k + 1], ranks[row])


def _score_tokens(logits: torch.Tensor, targets: torch.Tensor, k: int) -> list[TokenLogprobs]:
    logprobs = logits.log_softmax(dim=-1)
    target_lp = logprobs.gather(1, targets.unsqueeze(1))
    ranks = ((logprobs > target_lp).sum(dim=-1) + 1).tolist()
    if k > 0:
        top_lp, top_ids = logprobs.topk(k, dim=-1)
        ids = torch.cat((targets.unsqueeze(1), top_ids), 1).tolist()
        lps = torch.cat((target_lp, top_lp), 1).tolist()
    else:
        ids, lps = targets.unsqueeze(1).tolist(), target_lp.tolist()
    return [TokenLogprobs(i, lp, r) for i, lp, r in zip(ids, lps, ranks)]
