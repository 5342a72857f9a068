"""DeepSeek-V2/V3 against HF transformers on tiny random checkpoints written by transformers.

V2: softmax greedy gate, no q LoRA, a dense first layer, YaRN rope, hub-style config (rope_scaling).
V3: sigmoid noaux_tc with groups, q LoRA, a shared expert, transformers-5 config (rope_parameters,
rope_interleave), an MTP layer appended to the safetensors. fp32 on CPU: prompt logprobs match, greedy
32-token continuations of 8 prompts are identical, also through prefix-cache hits, chunked prefill and
preemption. Weights are re-drawn at unit scale (std 1/sqrt(fan_in), norms around 1, a random
e_score_correction_bias) so attention, routing and every expert visibly shape the output; transformers'
default init (std 0.02) leaves the residual stream almost equal to the embeddings, which would hide bugs.
"""

from __future__ import annotations

import contextlib
import json
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from dsinfer import LLM, SamplingParams
from dsinfer.config import KV_CACHE_DTYPES
from dsinfer.core.forward_batch import ForwardBatch
from dsinfer.models.deepseek import DeepseekV3ForCausalLM
from dsinfer.models.weights import iterate_safetensors
from dsinfer.ops.fp8 import FP8_DTYPE, block_dequantize, block_quantize
from tests.models.hf_reference import record_preemptions

transformers = pytest.importorskip("transformers")

YARN = {
    "rope_type": "yarn",
    "factor": 4.0,
    "original_max_position_embeddings": 64,
    "beta_fast": 32,
    "beta_slow": 1,
    "mscale": 0.707,
    "mscale_all_dim": 0.707,
    "rope_theta": 10000.0,
}
COMMON = dict(
    vocab_size=256,
    hidden_size=64,
    intermediate_size=96,
    moe_intermediate_size=32,
    num_attention_heads=4,
    num_key_value_heads=4,
    kv_lora_rank=32,
    qk_nope_head_dim=16,
    qk_rope_head_dim=8,
    v_head_dim=16,
    n_routed_experts=8,
    max_position_embeddings=256,
)


def v2_config() -> transformers.DeepseekV2Config:
    """Softmax greedy gate, no q LoRA, a dense first layer, two shared experts, YaRN rope."""
    return transformers.DeepseekV2Config(
        **COMMON,
        num_hidden_layers=2,
        q_lora_rank=None,
        n_shared_experts=2,
        num_experts_per_tok=3,
        first_k_dense_replace=1,
        topk_method="greedy",
        routed_scaling_factor=1.5,
        rope_parameters=dict(YARN),
    )


def v3_config(num_hidden_layers: int = 2, rope_interleave: bool = True) -> transformers.DeepseekV3Config:
    """Sigmoid noaux_tc over 4 groups (top 2 groups), q LoRA, one shared expert, YaRN rope with mscale 1."""
    rope = dict(YARN, mscale=1.0, mscale_all_dim=1.0)
    return transformers.DeepseekV3Config(
        **COMMON,
        num_hidden_layers=num_hidden_layers,
        q_lora_rank=24,
        n_shared_experts=1,
        num_experts_per_tok=2,
        first_k_dense_replace=1,
        n_group=4,
        topk_group=2,
        norm_topk_prob=True,
        routed_scaling_factor=2.5,
        rope_parameters=rope,
        rope_interleave=rope_interleave,
    )


def randomize(model: torch.nn.Module, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in list(model.named_parameters()) + list(model.named_buffers()):
            if "inv_freq" in name:
                continue
            if "norm" in name:
                param.copy_(1 + 0.2 * torch.randn(param.shape, generator=gen))
            elif "e_score_correction_bias" in name:
                param.copy_(0.1 * torch.randn(param.shape, generator=gen))
            elif param.dim() >= 2:
                fan_in = 1 if "embed" in name else param.shape[-1]
                param.copy_(torch.randn(param.shape, generator=gen) / fan_in**0.5)


def hub_style_config(path: Path) -> None:
    """Rewrite config.json as hub checkpoints write it: rope_theta + rope_scaling {type: yarn}."""
    cfg = json.loads((path / "config.json").read_text())
    rope = cfg.pop("rope_parameters")
    cfg["rope_theta"] = rope.pop("rope_theta")
    rope.pop("rope_type", None)
    cfg["rope_scaling"] = dict(rope, type="yarn")
    (path / "config.json").write_text(json.dumps(cfg))


def mtp_tensors(
    hf_donor: torch.nn.Module, donor_layer: int, index: int, seed: int
) -> dict[str, torch.Tensor]:
    """The checkpoint tensors of one MTP layer stored as ``model.layers.{index}``: the decoder block of
    ``hf_donor.model.layers[donor_layer]`` (experts split per expert, as hub checkpoints store them) plus
    enorm, hnorm, eh_proj, embed_tokens and shared_head."""
    gen = torch.Generator().manual_seed(seed)
    hidden, vocab = hf_donor.config.hidden_size, hf_donor.config.vocab_size
    out: dict[str, torch.Tensor] = {}
    for name, tensor in hf_donor.model.layers[donor_layer].state_dict().items():
        if name == "mlp.experts.gate_up_proj":
            for e, (gate, up) in enumerate(t.chunk(2, dim=0) for t in tensor):
                out[f"mlp.experts.{e}.gate_proj.weight"], out[f"mlp.experts.{e}.up_proj.weight"] = gate, up
        elif name == "mlp.experts.down_proj":
            for e, down in enumerate(tensor):
                out[f"mlp.experts.{e}.down_proj.weight"] = down
        else:
            out[name] = tensor
    out["enorm.weight"] = 1 + 0.2 * torch.randn(hidden, generator=gen)
    out["hnorm.weight"] = 1 + 0.2 * torch.randn(hidden, generator=gen)
    out["eh_proj.weight"] = torch.randn(hidden, 2 * hidden, generator=gen) / (2 * hidden) ** 0.5
    out["embed_tokens.weight"] = torch.randn(vocab, hidden, generator=gen)
    out["shared_head.norm.weight"] = 1 + 0.2 * torch.randn(hidden, generator=gen)
    out["shared_head.head.weight"] = torch.randn(vocab, hidden, generator=gen) / hidden**0.5
    return {f"model.layers.{index}.{k}": v.contiguous().clone() for k, v in out.items()}


def append_tensors(path: Path, extra: dict[str, torch.Tensor]) -> None:
    tensors = load_file(path / "model.safetensors")
    tensors.update(extra)
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})


QUANTIZED = (
    "q_proj",
    "q_a_proj",
    "q_b_proj",
    "kv_a_proj_with_mqa",
    "kv_b_proj",
    "o_proj",
    "gate_proj",
    "up_proj",
    "down_proj",
)


def quantize_checkpoint(src: Path, dst: Path, block: tuple[int, int] = (128, 128)) -> None:
    """Copy a checkpoint with every projection weight stored as FP8 e4m3 + ``weight_scale_inv`` blocks."""
    dst.mkdir(parents=True, exist_ok=True)
    cfg = json.loads((src / "config.json").read_text())
    cfg["quantization_config"] = {
        "quant_method": "fp8",
        "fmt": "e4m3",
        "activation_scheme": "dynamic",
        "weight_block_size": list(block),
    }
    (dst / "config.json").write_text(json.dumps(cfg))
    out = {}
    for name, tensor in load_file(src / "model.safetensors").items():
        if name.endswith(".weight") and name.split(".")[-2] in QUANTIZED:
            out[name], out[name + "_scale_inv"] = block_quantize(tensor, block)
        else:
            out[name] = tensor
    save_file(out, dst / "model.safetensors", metadata={"format": "pt"})


NEW_TOKENS = 32
PARITY: dict[str, float] = {}  # arch/mode -> max |logprob difference|, printed at the end


@dataclass
class Checkpoint:
    arch: str
    path: Path
    hf: torch.nn.Module
    prompts: list[list[int]]
    _logprobs: dict[int, torch.Tensor] = field(default_factory=dict)
    _greedy: dict[int, list[int]] = field(default_factory=dict)

    def hf_logprobs(self, i: int) -> torch.Tensor:
        if i not in self._logprobs:
            ids = self.prompts[i]
            with torch.no_grad():
                logits = self.hf(torch.tensor([ids])).logits[0].float()
            self._logprobs[i] = (
                logits.log_softmax(-1)[:-1].gather(1, torch.tensor(ids[1:]).unsqueeze(1)).squeeze(1)
            )
        return self._logprobs[i]

    def hf_greedy(self, i: int) -> list[int]:
        if i not in self._greedy:
            ids = self.prompts[i]
            with torch.no_grad():
                out = self.hf.generate(
                    torch.tensor([ids]),
                    attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                    max_new_tokens=NEW_TOKENS,
                    min_new_tokens=NEW_TOKENS,
                    do_sample=False,
                    pad_token_id=0,
                )
            self._greedy[i] = out[0, len(ids) :].tolist()
        return self._greedy[i]


def _prompts(vocab: int) -> list[list[int]]:
    """8 prompts; the last four share a 36-token stem (two full 16-token blocks and a partial one)."""
    gen = torch.Generator().manual_seed(7)
    stem = torch.randint(0, vocab, (36,), generator=gen).tolist()
    own = [torch.randint(0, vocab, (n,), generator=gen).tolist() for n in (3, 9, 17, 30)]
    return own + [stem + torch.randint(0, vocab, (n,), generator=gen).tolist() for n in (5, 12, 16, 28)]


def save_v2(path: Path) -> transformers.DeepseekV2ForCausalLM:
    """The random V2 checkpoint (seeded), written to ``path`` as a hub checkpoint; -> the transformers model."""
    torch.manual_seed(0)
    hf = transformers.DeepseekV2ForCausalLM(v2_config()).eval()
    randomize(hf, seed=1)
    hf.save_pretrained(path)
    hub_style_config(path)
    return hf


@pytest.fixture(scope="module")
def v2(tmp_path_factory) -> Checkpoint:
    path = tmp_path_factory.mktemp("deepseek-v2")
    hf = save_v2(path)
    return Checkpoint("v2", path, hf, _prompts(hf.config.vocab_size))


@pytest.fixture(scope="module")
def v3(tmp_path_factory) -> Checkpoint:
    """Main model = layers 0-1 of a 3-layer donor; the donor's layer 2 becomes the MTP layer's block."""
    torch.manual_seed(0)
    donor = transformers.DeepseekV3ForCausalLM(v3_config(num_hidden_layers=3)).eval()
    randomize(donor, seed=2)
    hf = transformers.DeepseekV3ForCausalLM(v3_config()).eval()
    state = {k: v for k, v in donor.state_dict().items() if not k.startswith("model.layers.2.")}
    hf.load_state_dict(state, strict=True)
    path = tmp_path_factory.mktemp("deepseek-v3")
    hf.save_pretrained(path)
    append_tensors(path, mtp_tensors(donor, donor_layer=2, index=2, seed=3))
    ckpt = Checkpoint("v3", path, hf, _prompts(hf.config.vocab_size))
    ckpt.donor = donor
    return ckpt


@pytest.fixture(params=["v2", "v3"])
def ckpt(request) -> Checkpoint:
    return request.getfixturevalue(request.param)


def _run(llm: LLM, ckpt: Checkpoint, indices: list[int], prompt_logprobs: bool = True):
    """Greedy; prompt logprobs only when asked (a request that wants them bypasses the prefix cache)."""
    params = SamplingParams(
        temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True, prompt_logprobs=0 if prompt_logprobs else None
    )
    return llm.generate([{"prompt_token_ids": ckpt.prompts[i]} for i in indices], params, use_tqdm=False)


def _assert_matches_hf(outputs, ckpt: Checkpoint, indices: list[int], mode: str, tol: float = 1e-4) -> None:
    worst = 0.0
    for out, i in zip(outputs, indices):
        assert out.outputs[0].token_ids == ckpt.hf_greedy(i), f"{ckpt.arch} {mode}: prompt {i} diverged"
        if out.prompt_logprobs is None:
            continue
        ids = ckpt.prompts[i]
        ours = torch.tensor([out.prompt_logprobs[p][ids[p]].logprob for p in range(1, len(ids))])
        worst = max(worst, float((ours - ckpt.hf_logprobs(i)).abs().max()))
    PARITY[f"{ckpt.arch}/{mode}"] = max(PARITY.get(f"{ckpt.arch}/{mode}", 0.0), worst)
    assert worst < tol, f"{ckpt.arch} {mode}: prompt logprobs differ by {worst:.3g}"


ALL = list(range(8))


def test_prompt_logprobs_and_greedy_match_hf(ckpt):
    _assert_matches_hf(_run(LLM(str(ckpt.path)), ckpt, ALL), ckpt, ALL, "batch")


def test_prefix_cache_hits_match_hf(ckpt):
    llm = LLM(str(ckpt.path), enable_prefix_caching=True)
    _assert_matches_hf(_run(llm, ckpt, [7], prompt_logprobs=False), ckpt, [7], "prefix")
    hits = llm.engine.get_stats()["prefix_cache_hits"]
    # 4..7 hit the shared stem, 7 its whole prompt; then the cached prefix is read back by prefill rows
    _assert_matches_hf(_run(llm, ckpt, ALL, prompt_logprobs=False), ckpt, ALL, "prefix")
    assert llm.engine.get_stats()["prefix_cache_hits"] > hits


def test_chunked_prefill_matches_hf(ckpt):
    llm = LLM(str(ckpt.path), max_num_batched_tokens=16, enable_prefix_caching=False)
    _assert_matches_hf(_run(llm, ckpt, ALL), ckpt, ALL, "chunked")


def test_preemption_matches_hf(ckpt):
    llm = LLM(str(ckpt.path), num_kv_blocks=10, enable_prefix_caching=False)
    preempted = record_preemptions(llm)
    _assert_matches_hf(_run(llm, ckpt, ALL), ckpt, ALL, "preempt")
    assert preempted, "the KV cache was large enough: nothing was preempted"


def test_seeded_sampling_is_batch_and_preemption_independent(ckpt):
    """A seeded request (T=0.8, top-p) gives the same tokens alone, among companions, and through preemption."""
    target = SamplingParams(temperature=0.8, top_p=0.9, seed=99, max_tokens=NEW_TOKENS, ignore_eos=True)
    others = SamplingParams(temperature=1.0, seed=5, max_tokens=NEW_TOKENS, ignore_eos=True)
    prompt = {"prompt_token_ids": ckpt.prompts[5]}
    companions = [{"prompt_token_ids": ckpt.prompts[i]} for i in (0, 3, 6, 7)]
    (alone,) = LLM(str(ckpt.path)).generate(prompt, target, use_tqdm=False)
    for llm in (LLM(str(ckpt.path)), LLM(str(ckpt.path), num_kv_blocks=10, enable_prefix_caching=False)):
        outs = llm.generate(companions[:2] + [prompt] + companions[2:], [others, others, target, others, others],
                            use_tqdm=False)
        assert outs[2].outputs[0].token_ids == alone.outputs[0].token_ids


def test_kv_cache_is_latent_only(v3):
    llm = LLM(str(v3.path))
    runner = llm.engine.runner
    cfg = v3.hf.config
    assert runner.kv_bytes_per_token == cfg.num_hidden_layers * (cfg.kv_lora_rank + cfg.qk_rope_head_dim) * 4
    layer = runner.model.attention_layers()[0]
    assert layer.kv_cache.shape == (runner.num_blocks, 16, cfg.kv_lora_rank + cfg.qk_rope_head_dim)


@pytest.fixture(scope="module", autouse=True)
def _report_parity():
    yield
    for key, value in sorted(PARITY.items()):
        print(f"deepseek parity {key}: max |difference| = {value:.3g}")


# ---- MTP ----


def _load(path: Path) -> DeepseekV3ForCausalLM:
    model = DeepseekV3ForCausalLM(json.loads((path / "config.json").read_text()))
    model.load_weights(iterate_safetensors(path))
    model.post_load()
    return model.eval()


def _prefill_batch(ids: torch.Tensor, block_size: int = 16) -> ForwardBatch:
    n = ids.numel()
    num_blocks = -(-n // block_size)
    return ForwardBatch(
        input_ids=ids,
        positions=torch.arange(n),
        slot_mapping=torch.arange(n),
        block_tables=torch.arange(num_blocks, dtype=torch.int32).unsqueeze(0),
        query_start_loc=torch.tensor([0, n], dtype=torch.int32),
        seq_lens=torch.tensor([n], dtype=torch.int32),
        logits_indices=torch.arange(n),
        max_query_len=n,
        max_seq_len=n,
    )


def _bind_caches(layers, num_blocks: int = 8) -> None:
    for layer in layers:
        layer.kv_cache = layer.kv_cache_spec(16, torch.float32).allocate(num_blocks, torch.device("cpu"))


def _rms(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return weight * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)


def _mtp_reference(ckpt: Checkpoint, hidden: torch.Tensor, next_ids: torch.Tensor) -> torch.Tensor:
    """The DeepSeek-V3 report's MTP equations written out; TRM_1 is the donor's HF decoder layer."""
    w = {
        k.removeprefix("model.layers.2."): v
        for k, v in load_file(ckpt.path / "model.safetensors").items()
        if k.startswith("model.layers.2.")
    }
    emb = torch.nn.functional.embedding(next_ids, w["embed_tokens.weight"])
    h = (
        torch.cat((_rms(emb, w["enorm.weight"]), _rms(hidden, w["hnorm.weight"])), dim=-1)
        @ w["eh_proj.weight"].T
    )
    n = h.shape[0]
    pos = torch.arange(n).unsqueeze(0)
    mask = torch.full((n, n), float("-inf")).triu(1)[None, None]
    rope = ckpt.donor.model.rotary_emb(h[None], pos)
    with torch.no_grad():
        h = ckpt.donor.model.layers[2](
            h[None], attention_mask=mask, position_ids=pos, position_embeddings=rope
        )[0]
    return _rms(h, w["shared_head.norm.weight"]) @ w["shared_head.head.weight"].T


def test_mtp_matches_report_equations(v3):
    model = _load(v3.path)
    assert model.mtp is not None and len(model.mtp.layers) == 1
    _bind_caches(model.attention_layers() + model.mtp.attention_layers())
    ids = torch.tensor(v3.prompts[7])
    with torch.no_grad():
        hidden = model(ids, torch.arange(ids.numel()), _prefill_batch(ids))
        hf_hidden = v3.hf.model(ids[None]).last_hidden_state[0]
        assert (hidden - hf_hidden).abs().max() < 1e-4
        logits, _ = model.mtp(hidden[:-1], ids[1:], torch.arange(ids.numel() - 1), _prefill_batch(ids[1:]))
    ref = _mtp_reference(v3, hf_hidden[:-1], ids[1:])
    diff = float((logits - ref).abs().max())
    PARITY["v3/mtp-logits"] = diff
    assert diff < 1e-3 * float(ref.abs().max())


def test_checkpoint_without_mtp_weights_drops_the_module(v2, tmp_path):
    cfg = json.loads((v2.path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps(dict(cfg, num_nextn_predict_layers=1)))
    (tmp_path / "model.safetensors").symlink_to(v2.path / "model.safetensors")
    llm = LLM(str(tmp_path))
    assert llm.engine.runner.model.mtp is None


# ---- FP8 block weights ----


@pytest.fixture(scope="module")
def v3_fp8(v3, tmp_path_factory) -> tuple[Path, Path]:
    """(bf16 checkpoint, the same quantized to FP8 [128, 128] blocks)."""
    bf16 = tmp_path_factory.mktemp("deepseek-v3-bf16")
    cfg = json.loads((v3.path / "config.json").read_text())
    (bf16 / "config.json").write_text(json.dumps(dict(cfg, dtype="bfloat16")))
    tensors = {
        k: v.to(torch.bfloat16) if v.is_floating_point() and "e_score" not in k else v
        for k, v in load_file(v3.path / "model.safetensors").items()
    }
    save_file(tensors, bf16 / "model.safetensors", metadata={"format": "pt"})
    fp8 = tmp_path_factory.mktemp("deepseek-v3-fp8")
    quantize_checkpoint(bf16, fp8)
    return bf16, fp8


def _prompt_logprobs(path: Path, prompts: list[list[int]]) -> torch.Tensor:
    params = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True, prompt_logprobs=0)
    outs = LLM(str(path)).generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return torch.tensor(
        [o.prompt_logprobs[i][ids[i]].logprob for o, ids in zip(outs, prompts) for i in range(1, len(ids))]
    )


def test_fp8_block_weights_load_and_run_close_to_bf16(v3, v3_fp8, tmp_path):
    bf16, fp8 = v3_fp8
    ours = _prompt_logprobs(fp8, v3.prompts)
    # exact: the FP8 checkpoint against its own dequantization written out in float32
    deq = {}
    tensors = load_file(fp8 / "model.safetensors")
    for name, t in tensors.items():
        if name.endswith("_scale_inv"):
            continue
        scale = tensors.get(name + "_scale_inv")
        deq[name] = t.float() if scale is None else block_dequantize(t, scale, (128, 128))
    save_file(deq, tmp_path / "model.safetensors", metadata={"format": "pt"})
    cfg = json.loads((fp8 / "config.json").read_text())
    cfg.pop("quantization_config")
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    exact = float((ours - _prompt_logprobs(tmp_path, v3.prompts)).abs().max())
    PARITY["v3/fp8-vs-its-dequantization"] = exact
    assert exact < 1e-4
    # close: against the bf16 weights it was quantized from (unit-scale weights amplify the 3-bit mantissa)
    close = float((ours - _prompt_logprobs(bf16, v3.prompts)).abs().mean())
    PARITY["v3/fp8-vs-bf16 (mean)"] = close
    assert close < 0.15, f"FP8 prompt logprobs differ from bf16 by {close:.3g} on average"


def test_fp8_weights_and_block_scales_are_kept(v3_fp8):
    bf16, fp8 = v3_fp8
    model = _load(fp8)
    attn = model.layers[1].self_attn
    assert attn.kv_b_proj.weight.dtype == FP8_DTYPE
    assert attn.kv_b_proj.weight_scale_inv.shape == (1, 1)  # [128 / 128, 32 / 128] rounded up
    experts = model.layers[1].mlp.experts
    assert experts.w13.dtype == FP8_DTYPE and experts.w13_scale_inv.shape == (
        8,
        2,
        1,
    )  # gate and up: own grids
    dense = load_file(bf16 / "model.safetensors")["model.layers.1.self_attn.kv_b_proj.weight"].float()
    err = (attn.kv_b_proj.dense - dense).norm() / dense.norm()
    assert err < 0.05  # e4m3 keeps 3 mantissa bits
    gate = load_file(bf16 / "model.safetensors")["model.layers.1.mlp.experts.3.gate_proj.weight"].float()
    assert (experts.dense[0][3, :32] - gate).norm() / gate.norm() < 0.05


def test_fp8_dummy_weights_are_realistic(v3_fp8):
    _, fp8 = v3_fp8
    llm = LLM(str(fp8), load_format="dummy")
    model = llm.engine.runner.model
    w = model.layers[0].self_attn.o_proj.dequantized_weight()
    assert 0.015 < float(w.std()) < 0.025  # normal(0, initializer_range) through FP8
    out = llm.generate(
        [{"prompt_token_ids": [1, 2, 3]}], SamplingParams(max_tokens=3, ignore_eos=True), use_tqdm=False
    )
    assert len(out[0].outputs[0].token_ids) == 3


def test_v3_without_rope_interleave_matches_hf(tmp_path):
    """transformers-5 configs may set rope_interleave false: rope then rotates halves (neox layout)."""
    torch.manual_seed(0)
    hf = transformers.DeepseekV3ForCausalLM(v3_config(rope_interleave=False)).eval()
    randomize(hf, seed=4)
    hf.save_pretrained(tmp_path)
    assert json.loads((tmp_path / "config.json").read_text())["rope_interleave"] is False
    ckpt = Checkpoint("v3-neox", tmp_path, hf, _prompts(hf.config.vocab_size))
    _assert_matches_hf(_run(LLM(str(tmp_path)), ckpt, [3, 7]), ckpt, [3, 7], "batch")


@pytest.mark.parametrize("q_lora_rank, bias, fused", [(None, False, True), (24, True, True), (None, True, False)])
def test_q_and_kv_a_projections_load_into_one_gemm(q_lora_rank, bias, fused):
    """q_proj / q_a_proj and kv_a_proj_with_mqa share one GEMM (two row ranges), except when only kv_a would
    carry a bias (attention_bias without q LoRA): then they stay apart."""
    cfg = v3_config().to_dict() | {"q_lora_rank": q_lora_rank, "attention_bias": bias}
    with torch.device("meta"):
        model = DeepseekV3ForCausalLM(cfg)
    attn = model.layers[0].self_attn
    q_name = "q_a_proj" if q_lora_rank else "q_proj"
    routed = [model.checkpoint_name(f"model.layers.0.self_attn.{n}.weight") for n in (q_name, "kv_a_proj_with_mqa")]
    if fused:
        assert attn.q_proj is None and attn.fused_qkv_a_proj.weight.shape[0] == sum(attn.q_split)
        assert routed == [("layers.0.self_attn.fused_qkv_a_proj.weight", 0),
                          ("layers.0.self_attn.fused_qkv_a_proj.weight", 1)]
    else:
        assert attn.fused_qkv_a_proj is None
        assert routed == [("layers.0.self_attn.q_proj.weight", None),
                          ("layers.0.self_attn.kv_a_proj_with_mqa.weight", None)]


@contextlib.contextmanager
def _hf_reads_fp8_latent(hf, dtype: torch.dtype):
    """HF's attention expands K/V from its (normalized) latent and roped key in ``expand_kv``: rounding both there
    through ``dtype`` gives the model an FP8 latent cache computes (each value rounded once, as stored)."""
    cls = type(hf.model.layers[0].self_attn)
    expand = cls.expand_kv

    def rounded(self, kv_nope, k_rot):
        return expand(self, kv_nope.to(dtype).to(kv_nope.dtype), k_rot.to(dtype).to(k_rot.dtype))

    cls.expand_kv = rounded
    try:
        yield
    finally:
        cls.expand_kv = expand


@pytest.mark.parametrize("kv_cache_dtype", ["fp8", "fp8_e5m2"])
def test_fp8_latent_cache_matches_hf_over_fp8_rounded_latents(ckpt, kv_cache_dtype):
    """An FP8 latent cache holds a quarter of the float32 cache's bytes per token and computes what HF computes
    with its latent and rope key rounded to FP8: prompts, cached prefixes read back and decode alike."""
    dtype = KV_CACHE_DTYPES[kv_cache_dtype]
    auto = LLM(str(ckpt.path), kv_cache_memory_gb=0.01)
    llm = LLM(str(ckpt.path), kv_cache_dtype=kv_cache_dtype, kv_cache_memory_gb=0.01, enable_prefix_caching=True)
    runner = llm.engine.runner
    assert {layer.kv_cache.dtype for layer in runner.model.attention_layers()} == {dtype}
    assert runner.kv_bytes_per_token * 4 == auto.engine.runner.kv_bytes_per_token
    want_lp, want_tokens = {}, {}
    with _hf_reads_fp8_latent(ckpt.hf, dtype), torch.no_grad():
        for i in ALL:
            ids = torch.tensor([ckpt.prompts[i]])
            logits = ckpt.hf(ids).logits[0].float()
            want_lp[i] = logits.log_softmax(-1)[:-1].gather(1, ids[0, 1:].unsqueeze(1)).squeeze(1)
            out = ckpt.hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW_TOKENS,
                                   min_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=0)
            want_tokens[i] = out[0, ids.shape[1]:].tolist()
    worst = 0.0
    for out, i in zip(_run(llm, ckpt, ALL), ALL):
        ids = ckpt.prompts[i]
        ours = torch.tensor([out.prompt_logprobs[p][ids[p]].logprob for p in range(1, len(ids))])
        worst = max(worst, float((ours - want_lp[i]).abs().max()))
        assert out.outputs[0].token_ids == want_tokens[i], f"prompt {i} diverged"
    PARITY[f"{ckpt.arch}/{kv_cache_dtype} cache"] = worst
    assert worst < 1e-4, f"prompt logprobs differ by {worst:.3g}"
    hits = llm.engine.get_stats()["prefix_cache_hits"]
    second = _run(llm, ckpt, ALL, prompt_logprobs=False)  # the prompts again: prefixes read back from FP8 rows
    assert llm.engine.get_stats()["prefix_cache_hits"] > hits
    assert [o.outputs[0].token_ids for o in second] == [want_tokens[i] for i in ALL]
