"""``dsinfer bench throughput --compare-hf``: the same workload through transformers' ``generate``.

HF runs each batch padded to its longest request (``min_new_tokens = max_new_tokens`` when EOS is ignored), so its
*useful* tokens/s counts only the tokens each prompt asked for. With dummy weights the HF model is built from the
config with dsinfer's random weights copied in (merged q/k/v and gate/up split back; DeepSeek's stacked experts
copied whole or per expert, as the installed transformers lays them out), so both engines compute the same
function and their greedy outputs can be compared. transformers is imported only here, when asked for.
"""

from __future__ import annotations

import time
from dataclasses import dataclass


@dataclass(frozen=True)
class HFResult:
    elapsed_s: float
    cpu_s: float  # process CPU time of the run (all threads)
    prompt_tokens: int
    output_tokens: int  # tokens the prompts asked for (the padded extra tokens not included)
    generated_tokens: int  # tokens computed (batch x longest request)

    @property
    def output_throughput(self) -> float:
        return self.output_tokens / self.elapsed_s


def load_hf(model_dir, dtype, device: str):
    """The checkpoint's transformers model, on ``device`` in eval mode."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).to(device).eval()


def run_hf(model, device: str, prompts: list[list[int]], lengths: list[int], batch_size: int,
           ignore_eos: bool) -> tuple[HFResult, list[list[int]]]:
    """HF ``generate`` over ``prompts`` in batches of ``batch_size``, greedy; -> the figures and each prompt's
    output ids (cut to the length it asked for)."""
    import torch

    pad = model.generation_config.pad_token_id
    if pad is None:
        eos = model.generation_config.eos_token_id
        pad = eos[0] if isinstance(eos, list) else (eos if eos is not None else 0)

    def generate(batch: list[list[int]], new_tokens: int):
        ids = torch.tensor(batch, device=device)
        extra = {"min_new_tokens": new_tokens} if ignore_eos else {}
        with torch.inference_mode():
            return model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
                                  do_sample=False, pad_token_id=pad, **extra)

    generate(prompts[:2], 4)  # warm-up
    tokens, generated = [], 0
    started, cpu = time.perf_counter(), time.process_time()
    for start in range(0, len(prompts), batch_size):
        batch, wanted = prompts[start:start + batch_size], lengths[start:start + batch_size]
        out = generate(batch, max(wanted))
        generated += out.shape[0] * (out.shape[1] - len(batch[0]))
        tokens += [row[len(batch[0]):len(batch[0]) + n].tolist() for row, n in zip(out, wanted)]
    elapsed, cpu = time.perf_counter() - started, time.process_time() - cpu
    useful = sum(len(t) for t in tokens)
    return HFResult(elapsed, cpu, sum(map(len, prompts)), useful, generated), tokens


def hf_from_engine(llm, device: str, overrides: dict | None = None):
    """The HF model of llm's config with llm's weights copied in (merged q/k/v and gate/up split back; DeepSeek's
    stacked experts copied whole or per expert, as the installed transformers lays them out)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    ours = llm.engine.runner.model
    config = AutoConfig.from_pretrained(llm.engine.model_config.path, **(overrides or {}))
    with torch.device(device):
        hf = AutoModelForCausalLM.from_config(config, dtype=llm.engine.model_config.dtype).eval()
    with torch.no_grad():
        if hasattr(type(ours), "packed_modules"):
            _copy_llama_into_hf(ours, hf.state_dict())
        else:
            _copy_by_checkpoint_names(ours, hf.state_dict())
    return hf


def _copy_llama_into_hf(ours, state: dict) -> None:
    unpacked = {merged: name for name, merged in type(ours).packed_modules.items()}
    for name, param in ours.named_parameters():
        module_name, leaf = name.rsplit(".", 1)
        shards = getattr(ours.get_submodule(module_name), "shard_offsets", {})
        if len(shards) > 1:
            parent, merged = module_name.rsplit(".", 1)
            for shard_id, (offset, size) in shards.items():
                state[f"model.{parent}.{unpacked[(merged, shard_id)]}.{leaf}"].copy_(param[offset:offset + size])
        elif name.startswith("lm_head."):
            if not ours.lm_head.tied:
                state[name].copy_(param)
        else:
            state[f"model.{name}"].copy_(param)


def _copy_by_checkpoint_names(ours, state: dict) -> None:
    """Fill every HF tensor from ours through the model's own checkpoint-name routing (``checkpoint_name``:
    checkpoint name -> (our parameter, shard)), read in reverse: the shard of a merged parameter, what a checkpoint
    tensor fills of the stacked experts (``FusedExperts.checkpoint_tensor``), or the whole parameter."""
    from dsinfer.layers.moe import FusedExperts
    from dsinfer.ops.fp8 import FP8_DTYPE

    params = dict(ours.named_parameters())
    missing = []
    for key, target in state.items():
        routed = ours.checkpoint_name(key)
        if routed is None:
            continue
        name, shard = routed
        source = params.get(name)
        if source is None:
            missing.append(key)
            continue
        if source.dtype == FP8_DTYPE:
            raise ValueError("the HF comparison needs a bf16/fp32 model; this one has FP8 weights")
        module_name, leaf = name.rsplit(".", 1)
        module = ours.get_submodule(module_name)
        if isinstance(module, FusedExperts):  # one expert, the routed stack, or the fused shared experts' MLP
            source = module.checkpoint_tensor(leaf, shard)
        elif shard is not None:
            offset, size = module.shard_offsets[shard]
            source = source[offset:offset + size]
        if source.shape != target.shape:
            raise ValueError(f"HF tensor {key} {tuple(target.shape)} != ours {name} {tuple(source.shape)}")
        target.copy_(source.to(target.dtype) if target.is_floating_point() else source)
    if missing:
        raise ValueError(f"{len(missing)} HF tensor(s) have no counterpart in dsinfer's model, e.g. {missing[:5]}")


def common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def compare_subset(llm, device: str, load_format: str, overrides: dict | None, prompts: list[list[int]],
                   lengths: list[int], batch_size: int | None, ignore_eos: bool, run_ours) -> dict:
    """HF and dsinfer (``run_ours(prompts, lengths)`` -> (wall s, CPU s, output ids)) on the same prompts; HF's
    model is freed before dsinfer runs. -> the figures: both engines' useful output tok/s, their ratio by wall and
    by CPU time (the latter less sensitive to other processes with ``--threads 1``), and how many greedy outputs
    are identical (and their mean common prefix)."""
    import gc

    import torch

    if load_format == "dummy":
        hf_model = hf_from_engine(llm, device, overrides)
    else:
        hf_model = load_hf(llm.engine.model_config.path, llm.engine.model_config.dtype, device)
    hf, hf_tokens = run_hf(hf_model, device, prompts, lengths, batch_size or len(prompts), ignore_eos)
    del hf_model
    gc.collect()
    if device == "cuda":
        torch.cuda.empty_cache()
    elapsed, cpu, ours = run_ours(prompts, lengths)
    ours_tok_s = sum(len(t) for t in ours) / elapsed
    same = sum(a == b for a, b in zip(ours, hf_tokens))
    return {"hf_num_prompts": len(prompts), "hf_output_len": max(lengths), "hf_elapsed_s": hf.elapsed_s,
            "hf_cpu_s": hf.cpu_s, "hf_output_throughput": hf.output_throughput,
            "hf_generated_tokens": hf.generated_tokens, "dsinfer_subset_output_throughput": ours_tok_s,
            "ratio_vs_hf": ours_tok_s / hf.output_throughput, "dsinfer_subset_cpu_s": cpu,
            "ratio_vs_hf_cpu": hf.cpu_s / cpu if cpu else float("inf"), "identical_outputs": same,
            "mean_common_prefix": sum(common_prefix(a, b) for a, b in zip(ours, hf_tokens)) / len(prompts)}
