"""DeepSeek-V4 in the engine against transformers' ``generate`` on a tiny random checkpoint it wrote.

Every attention layer type (sliding, CSA rate 4 with the indexer's top-3, HCA rate 16), hash and top-k MoE and two
hyper-connection streams (``v4_fixture``); prompts of 3 to 70 tokens, so past the window (8), several CSA windows
and several HCA windows. fp32 on CPU: greedy continuations identical (``min_tokens`` as ``min_new_tokens``) and
prompt logprobs within 1e-4, in one batch of mixed lengths, through chunked prefill and through preemption; with
prefix caching the output is the same, the hits restoring each state slot from its block (more in
``test_deepseek_v4_prefix``). The
published checkpoint's tensor names (and its MTP tensors) load to the same model, from bf16 safetensors too.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from dsinfer import LLM, SamplingParams
from dsinfer.models.deepseek_v4 import DeepseekV4ForCausalLM
from dsinfer.models.deepseek_v4.quant import unpack_fp4
from dsinfer.models.weights import iterate_safetensors
from tests.models.hf_reference import record_preemptions

from ..engine.test_multi_token_steps import KnownTokensDrafter, with_drafter
from .v4_fixture import write_checkpoint

transformers = pytest.importorskip("transformers")

NEW_TOKENS = 12
LENGTHS = (3, 11, 23, 40, 70)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    path = tmp_path_factory.mktemp("deepseek-v4")
    hf = write_checkpoint(transformers, path)
    gen = torch.Generator().manual_seed(7)
    prompts = [torch.randint(2, 128, (n,), generator=gen).tolist() for n in LENGTHS]
    with torch.no_grad():
        greedy = [hf.generate(torch.tensor([p]), attention_mask=torch.ones(1, len(p), dtype=torch.long),
                              max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, do_sample=False,
                              pad_token_id=0)[0, len(p):].tolist() for p in prompts]
        logprobs = [hf(torch.tensor([p])).logits[0].log_softmax(-1)[:-1].gather(1, torch.tensor(p[1:])[:, None])[:, 0]
                    for p in prompts]
    return path, hf, prompts, greedy, logprobs


def _generate(llm: LLM, prompts: list[list[int]], prompt_logprobs: bool = True):
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, min_tokens=NEW_TOKENS,
                            prompt_logprobs=0 if prompt_logprobs else None)
    return llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)


def _assert_matches_hf(outputs, ckpt, mode: str, indices: list[int] | None = None) -> None:
    _, _, prompts, greedy, logprobs = ckpt
    for i, out in zip(indices or range(len(prompts)), outputs, strict=True):
        assert out.outputs[0].token_ids == greedy[i], f"{mode}: prompt {i} ({len(prompts[i])} tokens) diverged"
        if out.prompt_logprobs is not None:
            ids = prompts[i]
            ours = torch.tensor([out.prompt_logprobs[p][ids[p]].logprob for p in range(1, len(ids))])
            worst = float((ours - logprobs[i]).abs().max())
            assert worst < 1e-4, f"{mode}: prompt {i} logprobs differ by {worst:.3g}"


def test_mixed_batch_matches_hf(ckpt):
    _assert_matches_hf(_generate(LLM(str(ckpt[0])), ckpt[2]), ckpt, "batch")


def test_chunked_prefill_matches_hf(ckpt):
    """16-token chunks: prompts split mid-window, beside other requests' decode rows."""
    llm = LLM(str(ckpt[0]), max_num_batched_tokens=16, max_num_seqs=4)
    _assert_matches_hf(_generate(llm, ckpt[2]), ckpt, "chunked")


def test_preemption_matches_hf(ckpt):
    """Blocks of 16 tokens (4 CSA / 1 HCA entry each), 6 usable: the 23- and 40-token prompts start in 5 and grow
    into 7, so one is preempted (blocks and state slot freed) and recomputed from its first token; the 70-token
    one waits for room."""
    llm = LLM(str(ckpt[0]), block_size=16, num_kv_blocks=7)
    preempted = record_preemptions(llm)
    _assert_matches_hf(_generate(llm, ckpt[2][2:]), ckpt, "preempt", [2, 3, 4])
    assert preempted, "the KV cache was large enough: nothing was preempted"


def test_deterministic_mode_gives_a_request_the_same_bits_alone_batched_and_chunked(ckpt):
    """Deterministic mode: the 40-token prompt's tokens and logprobs are identical alone, beside the 23-token one
    and in 16-token chunks beside it (its window and entries read in a layout fixed by each query's position), and
    still transformers' greedy tokens."""
    path, _, prompts, greedy, _ = ckpt
    params = SamplingParams(temperature=0, max_tokens=6, min_tokens=6, logprobs=2)

    def run(llm: LLM, batch: list[list[int]]):
        outs = llm.generate([{"prompt_token_ids": p} for p in batch], params, use_tqdm=False)
        return [(o.outputs[0].token_ids, [{t: lp.logprob for t, lp in d.items()} for d in o.outputs[0].logprobs])
                for o in outs]

    alone = run(LLM(str(path), deterministic=True), [prompts[3]])[0]
    assert alone[0] == greedy[3][:6]
    assert run(LLM(str(path), deterministic=True), prompts[2:4])[1] == alone
    assert run(LLM(str(path), deterministic=True, max_num_batched_tokens=16), prompts[2:4])[1] == alone


def test_draft_verification_matches_hf(ckpt):
    """Steps of 1 + 3 tokens verifying drafts (every third one spoiled): the rings hold window + 3 rows, so the rows
    a rejected draft overwrote were never needed, and entries a rejected draft closed are pooled again."""
    path, _, prompts, greedy, _ = ckpt
    drafter = KnownTokensDrafter({tuple(p): g for p, g in zip(prompts, greedy)}, spoil_every=3, vocab=128)
    llm = with_drafter(LLM(str(path)), drafter, k=3)
    _assert_matches_hf(_generate(llm, prompts, prompt_logprobs=False), ckpt, "drafts")
    assert drafter.proposed > 20


def test_worker_process_matches_hf(ckpt):
    """The model in a worker process: each request's state slot crosses the pipe in its NewRequestData."""
    llm = LLM(str(ckpt[0]), distributed_executor_backend="mp")
    _assert_matches_hf(_generate(llm, ckpt[2][2:], prompt_logprobs=False), ckpt, "mp", [2, 3, 4])


def test_async_scheduling_matches_hf(ckpt):
    """Overlapped steps: a decode row's input id is the previous step's sample, filled in on the device before the
    forward (the hash router reads it)."""
    llm = LLM(str(ckpt[0]), async_scheduling=True)
    _assert_matches_hf(_generate(llm, ckpt[2], prompt_logprobs=False), ckpt, "async")


def test_prefix_caching_on_gives_the_output_of_off(ckpt):
    """Prompts sharing a 48-token stem, run twice with prefix caching: the same tokens as without it, and the
    second run hits every full block of known KV (the state slots restored from the blocks' ends)."""
    stem = ckpt[2][4][:48]
    prompts = [stem + [5, 9, 11], stem + [17, 3]]
    off = [o.outputs[0].token_ids for o in _generate(LLM(str(ckpt[0]), enable_prefix_caching=False), prompts,
                                                     prompt_logprobs=False)]
    llm = LLM(str(ckpt[0]), enable_prefix_caching=True, block_size=16)
    for _ in range(2):
        on = [o.outputs[0].token_ids for o in _generate(llm, prompts, prompt_logprobs=False)]
        assert on == off
    assert llm.engine.get_stats()["prefix_cache_hits"] == 2 * 48


PUBLISHED = {"model.embed_tokens.weight": "embed.weight", "model.hc_head.hc_fn": "hc_head_fn",
             "model.hc_head.hc_base": "hc_head_base", "model.hc_head.hc_scale": "hc_head_scale"}


def _published(src: Path, dst: Path, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """The checkpoint as DeepSeek publishes it (no ``model.`` prefix, ``embed`` / ``hc_head_fn`` /
    ``attn.kv_norm``..., an MTP layer's tensors under ``mtp.0``, config ``num_nextn_predict_layers=1``) in
    ``dtype``; -> the MTP tensors written."""
    dst.mkdir()
    cfg = json.loads((src / "config.json").read_text())
    (dst / "config.json").write_text(json.dumps(cfg | {"num_nextn_predict_layers": 1}))
    out = {}
    gen = torch.Generator().manual_seed(1)
    for name, t in load_file(src / "model.safetensors").items():
        name = PUBLISHED.get(name, name).removeprefix("model.").replace(".attn.norm.", ".attn.kv_norm.")
        out[name] = t.to(dtype) if t.is_floating_point() else t
        # the MTP layer's block (sliding attention, top-k MoE): a copy of the last layer's, without its compressors
        if name.startswith("layers.3.") and ".compressor." not in name and ".indexer." not in name:
            out["mtp.0." + name.removeprefix("layers.3.")] = out[name].clone()
    extras = {"e_proj.weight": (32, 32), "h_proj.weight": (32, 32), "enorm.weight": (32,), "hnorm.weight": (32,),
              "norm.weight": (32,), "hc_head_fn": (2, 64), "hc_head_base": (2,), "hc_head_scale": (1,)}
    for name, shape in extras.items():
        out["mtp.0." + name] = torch.randn(shape, generator=gen).to(dtype)
    save_file(out, dst / "model.safetensors", metadata={"format": "pt"})
    return {k: v for k, v in out.items() if k.startswith("mtp.")}


def test_published_names_and_bf16_load_the_same_model(ckpt, tmp_path):
    """The published names load to the model transformers' names give; the MTP layer's tensors load into
    ``model.mtp`` (its hyper-connection and expert tensors by the same rules as a main layer's)."""
    path, hf = ckpt[0], ckpt[1]
    cfg = json.loads((path / "config.json").read_text())
    saved = DeepseekV4ForCausalLM(cfg)
    saved.load_weights(iterate_safetensors(path))
    for dtype in (torch.float32, torch.bfloat16):
        mtp = _published(path, tmp_path / str(dtype), dtype)
        model = DeepseekV4ForCausalLM(cfg | {"num_nextn_predict_layers": 1})
        model.load_weights(iterate_safetensors(tmp_path / str(dtype)))
        ours = {k: v for k, v in model.state_dict().items() if not k.startswith("mtp.")}
        assert list(ours) == list(saved.state_dict())
        for (name, mine), ref in zip(ours.items(), saved.state_dict().values()):
            expected = ref.to(dtype).to(ref.dtype) if ref.is_floating_point() else ref
            assert torch.equal(mine, expected), name
        layer = model.mtp.layers[0]
        assert torch.equal(layer.hc_head.fn, mtp["mtp.0.hc_head_fn"].float())
        assert torch.equal(layer.hc_attn.scale, mtp["mtp.0.hc_attn_scale"].float())
        assert torch.equal(layer.ffn.experts.target(2, "w3"), mtp["mtp.0.ffn.experts.2.w3.weight"].float())
        assert torch.equal(layer.e_proj.weight, mtp["mtp.0.e_proj.weight"].float())
        assert layer.attn.compressor is None and not layer.ffn.gate.hashed
    experts = saved.layers[1].ffn.experts
    torch.testing.assert_close(experts.w13, hf.model.layers[1].mlp.experts.gate_up_proj, rtol=0, atol=0)


def test_a_checkpoint_without_mtp_tensors_drops_the_mtp_layer(ckpt):
    """num_nextn_predict_layers=1 in the config but no ``mtp.*`` tensor (transformers drops them): the model loads
    without its MTP layer, so ``method='mtp'`` is refused."""
    cfg = json.loads((ckpt[0] / "config.json").read_text())
    model = DeepseekV4ForCausalLM(cfg | {"num_nextn_predict_layers": 1})
    assert model.mtp is not None
    model.load_weights(iterate_safetensors(ckpt[0]))
    assert model.mtp is None


E2M1 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0])


def _fp8(weight: torch.Tensor, block: tuple[int, int], ue8m0: bool = False
         ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(e4m3 weight, scale per block: float32, or a power of two as float8_e8m0fnu; what they dequantize to)."""
    rows, cols = weight.shape
    grid = weight.reshape(rows // block[0], block[0], cols // block[1], block[1])
    scale = grid.abs().amax(dim=(1, 3)) / 448.0
    if ue8m0:
        scale = scale.log2().ceil().exp2()
    q = (grid / scale[:, None, :, None]).to(torch.float8_e4m3fn)
    stored = scale.to(torch.float8_e8m0fnu) if ue8m0 else scale
    return q.reshape(rows, cols), stored, (q.float() * scale[:, None, :, None]).reshape(rows, cols)


def _fp4(shape: tuple[int, int], gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(packed e2m1 int8 [N, K / 2], ue8m0 scale per row and 16 or 32 columns, what they dequantize to)."""
    rows, cols = shape
    group = min(32, cols)
    codes = torch.randint(0, 16, shape, generator=gen)
    exponents = torch.randint(120, 130, (rows, cols // group), generator=gen)
    packed = (codes[:, 0::2] | (codes[:, 1::2] << 4)).to(torch.uint8).view(torch.int8)
    expected = E2M1[codes] * (exponents.float() - 127).exp2().repeat_interleave(group, dim=1)
    return packed, exponents.to(torch.uint8), expected


def test_fp8_linears_and_fp4_experts_dequantize_on_load(ckpt, tmp_path):
    """The published format: FP8 e4m3 linears with a float32 scale per 8 x 8 block under ``.scale``, FP4 routed
    experts (two e2m1 a byte, low nibble first) with ue8m0 exponent bytes per 32 (16) columns; wo_b's scales as
    float8_e8m0fnu; the
    compressor / indexer projections stay unquantized, as published."""
    path = ckpt[0]
    _published(path, tmp_path / "plain", torch.float32)
    gen = torch.Generator().manual_seed(3)
    out, expected = {}, {}
    for name, t in load_file(tmp_path / "plain" / "model.safetensors").items():
        prefix = name.removesuffix(".weight")
        if ".experts." in name and not name.startswith("mtp."):
            out[name], out[prefix + ".scale"], expected[name] = _fp4(tuple(t.shape), gen)
        elif name.endswith(("wq_a.weight", "wq_b.weight", "wo_b.weight", "shared_experts.w1.weight")) \
                and ".indexer." not in name:
            out[name], out[prefix + ".scale"], expected[name] = _fp8(t, (8, 8), ue8m0="wo_b" in name)
        else:
            out[name] = t
    (tmp_path / "quantized").mkdir()
    (tmp_path / "quantized" / "config.json").write_text((tmp_path / "plain" / "config.json").read_text())
    save_file(out, tmp_path / "quantized" / "model.safetensors", metadata={"format": "pt"})
    model = DeepseekV4ForCausalLM(json.loads((tmp_path / "plain" / "config.json").read_text()))
    model.load_weights(iterate_safetensors(tmp_path / "quantized"))
    experts = model.layers[2].ffn.experts
    assert torch.equal(experts.target(3, "w2"), expected["layers.2.ffn.experts.3.w2.weight"])
    assert torch.equal(experts.target(1, "w3"), expected["layers.2.ffn.experts.1.w3.weight"])
    assert torch.equal(model.layers[1].attn.wq_b.weight, expected["layers.1.attn.wq_b.weight"])
    assert torch.equal(model.layers[0].ffn.shared_experts.w1.weight, expected["layers.0.ffn.shared_experts.w1.weight"])
    assert torch.equal(model.layers[3].attn.wo_b.weight, expected["layers.3.attn.wo_b.weight"])
    assert torch.equal(model.mtp.layers[0].attn.wq_a.weight, expected["mtp.0.attn.wq_a.weight"])
    byte = int(out["layers.0.ffn.experts.0.w1.weight"][0, 0])  # low nibble first
    unpacked = unpack_fp4(torch.tensor([[byte]], dtype=torch.int8))
    assert torch.equal(unpacked, E2M1[[byte & 0xF, (byte >> 4) & 0xF]][None])


def test_dummy_weights_in_bf16_spread_hash_routing(ckpt):
    """Dummy weights at the checkpoint's shapes, in bf16: the hash table sends each token to k distinct experts,
    spread over all of them (an all-zero table would send every token to expert 0), and generation runs."""
    llm = LLM(str(ckpt[0]), load_format="dummy", dtype="bfloat16")
    model = llm.engine.executor.runner.model
    table = model.layers[0].ffn.gate.tid2eid
    assert all(len(set(row)) == table.shape[1] for row in table.tolist())
    assert torch.bincount(table.flatten(), minlength=4).min() > table.numel() // 8
    assert model.layers[1].hc_attn.scale.dtype == torch.float32
    (out,) = _generate(llm, [ckpt[2][4]], prompt_logprobs=False)
    assert len(out.outputs[0].token_ids) == NEW_TOKENS


@pytest.mark.slow
@pytest.mark.skipif(torch.cuda.is_available(), reason="with CUDA the kernels run compiled (test_deepseek_v4_gpu)")
def test_triton_interpreter_fused_moe_matches_hf(ckpt, monkeypatch):
    """The routed experts (hash and top-k) on the Triton fused MoE with its SwiGLU clamp, under TRITON_INTERPRET=1:
    HF's greedy tokens and prompt logprobs, and the kernel really ran."""
    import dsinfer.ops.triton.moe_fused as moe_kernels

    monkeypatch.setenv("DSINFER_USE_TRITON", "always")
    calls = []
    fused = moe_kernels.fused_moe_triton
    monkeypatch.setattr(moe_kernels, "fused_moe_triton", lambda *a, **k: calls.append(k["swiglu_limit"]) or
                        fused(*a, **k))
    _, _, prompts, _, _ = ckpt
    _assert_matches_hf(_generate(LLM(str(ckpt[0])), prompts[:2]), ckpt, "Triton MoE", [0, 1])
    assert calls and set(calls) == {2.0}


def _through_graph_buffers(llm: LLM, monkeypatch, tokens_per_seq: tuple[int, ...] = (1,)) -> list[tuple[int, int]]:
    """Give the CPU runner decode graphs whose replay runs the forward they would capture (on the graphs' own
    buffers, at the padded size): the runner's graph path end to end without CUDA. Returns the replays' (size, q)."""
    from dsinfer.runner.cuda_graphs import DecodeGraphs

    runner, config = llm.engine.runner, llm.engine.config
    max_len = config.model.max_model_len
    graphs = DecodeGraphs(runner.model, config.scheduler.max_num_seqs, -(-max_len // runner.block_size), max_len,
                          runner.device, sizes=(1, 2, 4, 8), tokens_per_seq=tokens_per_seq, state_slots=True)
    graphs.graphs = {(size, q): None for size in graphs.sizes for q in tokens_per_seq}  # as if captured
    replays: list[tuple[int, int]] = []
    monkeypatch.setattr(graphs, "replay", lambda size, q=1: replays.append((size, q)) or graphs._forward(size, q))
    runner.graphs = graphs
    return replays


def test_decode_through_the_graph_buffers_matches_hf(ckpt, monkeypatch):
    """Async scheduling (input ids filled into the graph's buffer on the device), 5 sequences padded to 8, then
    fewer as they finish: state slots copied in with the other inputs, padding rows reset."""
    llm = LLM(str(ckpt[0]), async_scheduling=True)
    replays = _through_graph_buffers(llm, monkeypatch)
    _assert_matches_hf(_generate(llm, ckpt[2], prompt_logprobs=False), ckpt, "graph buffers")
    assert len(replays) >= NEW_TOKENS - 1 and (8, 1) in replays


def test_draft_verification_through_four_token_graph_buffers_matches_hf(ckpt, monkeypatch):
    path, _, prompts, greedy, _ = ckpt
    drafter = KnownTokensDrafter({tuple(p): g for p, g in zip(prompts, greedy)}, spoil_every=3, vocab=128)
    llm = with_drafter(LLM(str(path)), drafter, k=3)
    replays = _through_graph_buffers(llm, monkeypatch, (1, 4))
    _assert_matches_hf(_generate(llm, prompts, prompt_logprobs=False), ckpt, "drafts in graph buffers")
    assert (8, 4) in replays and drafter.proposed > 20
