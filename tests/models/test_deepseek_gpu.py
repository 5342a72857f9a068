"""Tiny DeepSeek V2/V3 through the Triton kernels: on CUDA (gpu-marked) and in Triton's CPU interpreter.

The checkpoints are ``test_deepseek.py``'s (rope dim 8, below ``tl.dot``'s 16: the MLA kernels pad and mask it, so
these shapes take the same Triton path as real ones and decode is captured in CUDA graphs).

On CUDA, float32 with the CUDA defaults (decode CUDA graphs, async scheduling) must give the CPU path's greedy
tokens and HF's, with prompt logprobs within 1e-4; the graphs must really be captured and replayed. dtype is
explicit: ``dtype="auto"`` runs a float32 checkpoint in bf16 on CUDA, and bf16 legitimately diverges from the
float32 reference after a few tokens (on CPU in bf16, V2's prompt 0 leaves HF's greedy path at token 19). A bf16
smoke run checks that path stays close.

The interpreter test (not gpu-marked; marked slow: ~30 s of CPU, 45 s on a loaded 2-core machine, still part of
``make test``) runs V3 on CPU with every op on its Triton kernel.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from dsinfer import LLM, SamplingParams

from .hf_reference import hf_greedy, hf_prompt_logprobs
from .test_deepseek import NEW_TOKENS, Checkpoint, v2, v3  # noqa: F401  (v2, v3: fixtures)

HAS_CUDA = torch.cuda.is_available()
ALL = list(range(8))
TOL = 1e-4  # float32 prompt logprobs, as the CPU parity tests


@dataclass
class Run:
    tokens: list[list[int]]
    logprobs: list[torch.Tensor]  # per prompt: logprob of prompt token p given tokens < p, p >= 1


def _generate(llm: LLM, ckpt: Checkpoint, indices: list[int]) -> Run:
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True, prompt_logprobs=0)
    outs = llm.generate([{"prompt_token_ids": ckpt.prompts[i]} for i in indices], params, use_tqdm=False)
    logprobs = []
    for out, i in zip(outs, indices):
        ids = ckpt.prompts[i]
        logprobs.append(torch.tensor([out.prompt_logprobs[p][ids[p]].logprob for p in range(1, len(ids))]))
    return Run([o.outputs[0].token_ids for o in outs], logprobs)


def _hf(ckpt: Checkpoint, indices: list[int]) -> Run:
    """HF's plain argmax loop (no logits processor) and prompt logprobs, float32 on CPU."""
    return Run([hf_greedy(ckpt.hf, ckpt.prompts[i], NEW_TOKENS) for i in indices],
               [hf_prompt_logprobs(ckpt.hf, ckpt.prompts[i]) for i in indices])


def _worst(a: Run, b: Run) -> float:
    return max(float((x - y).abs().max()) for x, y in zip(a.logprobs, b.logprobs))


def _assert_same(ours: Run, ref: Run, indices: list[int], what: str) -> None:
    for got, want, i in zip(ours.tokens, ref.tokens, indices):
        first = next((j for j, (x, y) in enumerate(zip(got, want)) if x != y), None)
        assert got == want, f"prompt {i}: greedy tokens leave {what} at token {first}"
    worst = _worst(ours, ref)
    assert worst < TOL, f"prompt logprobs differ from {what} by {worst:.3g}"


_REFERENCES: dict[str, tuple[Run, Run]] = {}


def _references(ckpt: Checkpoint) -> tuple[Run, Run]:
    """(the CPU torch path, HF) on all 8 prompts, computed once per checkpoint."""
    if ckpt.arch not in _REFERENCES:
        cpu = _generate(LLM(str(ckpt.path), device="cpu", dtype="float32"), ckpt, ALL)
        _REFERENCES[ckpt.arch] = (cpu, _hf(ckpt, ALL))
    return _REFERENCES[ckpt.arch]


def _count_replays(llm: LLM, monkeypatch) -> list[int]:
    graphs = llm.engine.runner.graphs
    count = [0]
    replay = graphs.replay

    def counted(size: int, q: int = 1) -> torch.Tensor:
        count[0] += 1
        return replay(size, q)

    monkeypatch.setattr(graphs, "replay", counted)
    return count


# ---- CUDA ----


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA device")
@pytest.mark.parametrize("mode", [dict(), dict(async_scheduling=False, enforce_eager=True)],
                         ids=["graphs-async", "eager-sync"])
@pytest.mark.parametrize("arch", ["v2", "v3"])
def test_cuda_float32_greedy_matches_cpu_and_hf(arch, mode, request, monkeypatch):
    ckpt = request.getfixturevalue(arch)
    cpu, hf = _references(ckpt)
    # TF32 anywhere would make float32 inexact (cuBLAS reads this flag; the Triton dots ask for IEEE fp32)
    assert torch.get_float32_matmul_precision() == "highest"
    llm = LLM(str(ckpt.path), device="cuda", dtype="float32", **mode)
    eager = mode.get("enforce_eager", False)
    assert llm.engine.async_scheduling == mode.get("async_scheduling", True)
    if not eager:
        assert llm.engine.runner.graphs is not None and llm.engine.runner.graphs.graphs, \
            "decode CUDA graphs were not captured (see the capture warning in the log)"
        assert llm.engine.runner.prefill_graphs.captured_sizes, "prefill CUDA graphs were not captured"
        replays = _count_replays(llm, monkeypatch)
    ours = _generate(llm, ckpt, ALL)
    if not eager:
        assert replays[0] >= NEW_TOKENS - 1, f"only {replays[0]} decode steps replayed a CUDA graph"
    _assert_same(ours, cpu, ALL, "the CPU path")
    _assert_same(ours, hf, ALL, "HF")


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA device")
@pytest.mark.parametrize("arch", ["v2", "v3"])
def test_cuda_fp8_latent_cache_matches_cpu(arch, request, monkeypatch):
    """An FP8 latent cache through the Triton store, decode (in CUDA graphs; the tiny models' 4 heads take the
    pointer-load kernel, the TMA one is covered in tests/ops/test_mla_fp8_cache.py) and prefill kernels gives the
    CPU path's greedy tokens over the same FP8 cache; float32 values a few bits apart on the two devices may round
    to neighbouring FP8 values, hence a looser logprob bound than TOL."""
    ckpt = request.getfixturevalue(arch)
    cpu = _generate(LLM(str(ckpt.path), device="cpu", dtype="float32", kv_cache_dtype="fp8"), ckpt, ALL)
    llm = LLM(str(ckpt.path), device="cuda", dtype="float32", kv_cache_dtype="fp8")
    assert llm.engine.runner.graphs.graphs, "decode CUDA graphs were not captured"
    replays = _count_replays(llm, monkeypatch)
    ours = _generate(llm, ckpt, ALL)
    assert replays[0] >= NEW_TOKENS - 1
    assert ours.tokens == cpu.tokens
    assert _worst(ours, cpu) < 1e-2


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA device")
@pytest.mark.parametrize("arch", ["v2", "v3"])
def test_cuda_bfloat16_smoke(arch, request, monkeypatch):
    """dtype auto: the float32 checkpoint runs in bf16 on CUDA; close to float32 HF, not identical."""
    ckpt = request.getfixturevalue(arch)
    _, hf = _references(ckpt)
    llm = LLM(str(ckpt.path), device="cuda")
    assert llm.engine.config.model.dtype == torch.bfloat16
    assert llm.engine.runner.graphs.graphs, "decode CUDA graphs were not captured"
    replays = _count_replays(llm, monkeypatch)
    ours = _generate(llm, ckpt, ALL)
    assert replays[0] >= NEW_TOKENS - 1
    assert all(len(t) == NEW_TOKENS for t in ours.tokens)
    mean = float(torch.cat([(x - y).abs() for x, y in zip(ours.logprobs, hf.logprobs)]).mean())
    assert mean < 0.05, f"bf16 prompt logprobs differ from float32 HF by {mean:.3g} on average"  # CPU bf16: ~0.01
    same_first = sum(o[0] == h[0] for o, h in zip(ours.tokens, hf.tokens))
    assert same_first >= 6, f"only {same_first} of 8 first greedy tokens agree with HF"


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA device")
@pytest.mark.parametrize("arch", ["v2", "v3"])
def test_cuda_prefill_graphs_match_eager_on_a_mixed_step(arch, request):
    """Decode rows (absorbed MLA) and prompts (expanded MLA) in one step, through the piecewise graphs."""
    from tests.runner.test_prefill_graphs import _mixed_step_logits

    ckpt = request.getfixturevalue(arch)
    llm = LLM(str(ckpt.path), device="cuda", dtype="float32", enable_prefix_caching=False)
    assert llm.engine.runner.prefill_graphs.captured_sizes, "prefill CUDA graphs were not captured"
    with_graphs, eager, _ = _mixed_step_logits(llm)
    torch.testing.assert_close(with_graphs, eager, rtol=1e-4, atol=1e-4)


# ---- CPU: the Triton kernels in the interpreter ----


@pytest.mark.slow
@pytest.mark.skipif(HAS_CUDA, reason="with CUDA the kernels run compiled (the gpu tests above)")
def test_triton_interpreter_v3_greedy_matches_hf(v3, monkeypatch):  # noqa: F811
    """V3 (MLA decode + prefill, fused MoE, noaux_tc routing, rope, norms, sampler) on every Triton kernel under
    TRITON_INTERPRET=1, with async scheduling's placeholder path on: HF's greedy tokens and prompt logprobs."""
    import dsinfer.ops.triton.mla as mla_kernels
    import dsinfer.ops.triton.mla_uv as mla_uv_kernels
    import dsinfer.ops.triton.moe_fused as moe_kernels
    import dsinfer.ops.triton.router as router_kernels

    monkeypatch.setenv("DSINFER_USE_TRITON", "always")
    calls = {"mla_decode_uv_triton": 0, "mla_prefill_triton": 0, "fused_moe_triton": 0, "select_experts_triton": 0}
    for module in (mla_kernels, mla_uv_kernels, moe_kernels, router_kernels):
        for name in calls:
            if hasattr(module, name):
                monkeypatch.setattr(module, name, _counting(calls, name, getattr(module, name)))
    indices = [0, 7]  # 3 and 64 prompt tokens: one cache block and four (decode crosses block boundaries)
    llm = LLM(str(v3.path), device="cpu", dtype="float32", async_scheduling=True)
    _assert_same(_generate(llm, v3, indices), _hf(v3, indices), indices, "HF")
    assert all(calls.values()), f"an op did not take its Triton kernel: {calls}"


def _counting(calls: dict[str, int], name: str, fn):
    def wrapped(*args, **kwargs):
        calls[name] += 1
        return fn(*args, **kwargs)

    return wrapped
