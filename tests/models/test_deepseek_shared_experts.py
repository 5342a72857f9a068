"""DeepSeek shared experts fused into the routed experts' stack (``blocks.fused_shared_experts``).

A MoE layer is loaded from one layer's checkpoint tensors (HF names, through the model's ``checkpoint_name`` and
the weight loaders, FP8 ones with their block scales) and compared with the same tensors computed the unfused
way: the routed experts (``fused_moe_ref``) plus the shared MLP of intermediate size S * I, in float32.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from dsinfer.models.deepseek import DeepseekV2ForCausalLM, DeepseekV3ForCausalLM
from dsinfer.models.deepseek.blocks import DeepseekMLP, fused_shared_experts
from dsinfer.ops.fp8 import block_dequantize, block_quantize
from dsinfer.ops.moe import fused_moe_ref, select_experts_ref

HIDDEN, ROUTED, TOP_K = 64, 8, 3
ARCHS = {"v2": DeepseekV2ForCausalLM, "v3": DeepseekV3ForCausalLM}


def tiny_config(arch: str, shared: int, inter: int = 32, block: tuple[int, int] | None = None) -> dict:
    """Two layers (dense, MoE); V2: softmax greedy, V3: sigmoid noaux_tc over 4 groups. Both renormalize and
    scale by 2.5, so a shared column that got the routed scaling would show."""
    cfg = dict(architectures=[ARCHS[arch].__name__], vocab_size=64, hidden_size=HIDDEN, intermediate_size=48,
               moe_intermediate_size=inter, num_hidden_layers=2, num_attention_heads=2, n_routed_experts=ROUTED,
               num_experts_per_tok=TOP_K, n_shared_experts=shared, first_k_dense_replace=1, q_lora_rank=None,
               kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=8, norm_topk_prob=True,
               routed_scaling_factor=2.5)
    if arch == "v3":
        cfg |= dict(n_group=4, topk_group=2)
    if block:
        cfg["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": list(block)}
    return cfg


def moe_tensors(cfg: dict, seed: int = 0) -> dict[str, torch.Tensor]:
    """Checkpoint tensors of layer 1's MoE (per-expert routed experts, one shared MLP), unit-scale; FP8 with
    ``weight_scale_inv`` blocks when the config is quantized."""
    gen = torch.Generator().manual_seed(seed)
    inter, shared = cfg["moe_intermediate_size"], cfg["n_shared_experts"]

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen) / shape[-1] ** 0.5

    out = {"gate.weight": randn(ROUTED, HIDDEN)}
    if cfg["architectures"][0] == "DeepseekV3ForCausalLM":
        out["gate.e_score_correction_bias"] = 0.1 * torch.randn(ROUTED, generator=gen)
    for prefix, size in [(f"experts.{e}", inter) for e in range(ROUTED)] + [("shared_experts", inter * shared)]:
        out |= {f"{prefix}.gate_proj.weight": randn(size, HIDDEN), f"{prefix}.up_proj.weight": randn(size, HIDDEN),
                f"{prefix}.down_proj.weight": randn(HIDDEN, size)}
    if "quantization_config" in cfg:
        block = tuple(cfg["quantization_config"]["weight_block_size"])
        for name in [n for n in out if n.endswith("_proj.weight")]:
            out[name], out[name + "_scale_inv"] = block_quantize(out[name], block)
    return {f"model.layers.1.mlp.{name}": t for name, t in out.items()}


def load_moe(cfg: dict, tensors: dict[str, torch.Tensor], kernel=None):
    """The model's layer-1 MoE with ``tensors`` loaded the way ``load_weights`` routes them, post-processed
    (``kernel``: the model's ``KernelConfig``, None for the defaults)."""
    model = ARCHS["v3" if "V3" in cfg["architectures"][0] else "v2"](dict(cfg), kernel)
    params = dict(model.named_parameters())
    for ckpt_name, tensor in tensors.items():
        name, shard = model.checkpoint_name(ckpt_name)
        loader = getattr(params[name], "weight_loader", None)
        if loader is None:
            params[name].data.copy_(tensor)
        else:
            loader(params[name], tensor) if shard is None else loader(params[name], tensor, shard)
    moe = model.layers[1].mlp
    for module in moe.modules():
        if hasattr(module, "process_weights_after_loading"):
            module.process_weights_after_loading()
    return model, moe


def dense(tensors: dict[str, torch.Tensor], name: str, cfg: dict) -> torch.Tensor:
    """A checkpoint projection in float32 (dequantized when FP8)."""
    weight = tensors[f"model.layers.1.mlp.{name}.weight"]
    scale = tensors.get(f"model.layers.1.mlp.{name}.weight_scale_inv")
    if scale is None:
        return weight.float()
    return block_dequantize(weight, scale, tuple(cfg["quantization_config"]["weight_block_size"]))


def unfused_reference(cfg: dict, tensors: dict[str, torch.Tensor], routing, x: torch.Tensor) -> torch.Tensor:
    """Routed experts (top-k, the routing's weights) + the shared MLP of intermediate size S * I, unfused."""
    bias = tensors.get("model.layers.1.mlp.gate.e_score_correction_bias")
    weights, ids = select_experts_ref(x @ dense(tensors, "gate", cfg).T, TOP_K, routing, bias)
    w13 = torch.stack([torch.cat([dense(tensors, f"experts.{e}.{k}_proj", cfg) for k in ("gate", "up")])
                       for e in range(ROUTED)])
    w2 = torch.stack([dense(tensors, f"experts.{e}.down_proj", cfg) for e in range(ROUTED)])
    gate, up, down = (dense(tensors, f"shared_experts.{k}_proj", cfg) for k in ("gate", "up", "down"))
    return fused_moe_ref(x, w13, w2, weights, ids) + (F.silu(x @ gate.T) * (x @ up.T)) @ down.T


def _check_fused_layer(arch: str, shared: int, block: tuple[int, int] | None = None) -> None:
    cfg = tiny_config(arch, shared, block=block)
    tensors = moe_tensors(cfg)
    _, moe = load_moe(cfg, tensors)
    assert moe.shared_experts is None and moe.gate.cfg.num_shared == shared
    assert moe.experts.w13.shape == (ROUTED + shared, 2 * 32, HIDDEN)
    for kind, leaf in (("gate", "w13"), ("up", "w13"), ("down", "w2")):  # the loader read backwards
        for suffix in ("", "_scale_inv") if block else ("",):
            stored = tensors[f"model.layers.1.mlp.shared_experts.{kind}_proj.weight{suffix}"]
            assert torch.equal(moe.experts.checkpoint_tensor(leaf + suffix, ("shared", kind)).float(), stored.float())
    x = torch.randn(13, HIDDEN, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        out = moe(x)
    torch.testing.assert_close(out, unfused_reference(cfg, tensors, moe.gate.cfg.routing, x), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("arch, shared", [("v3", 1), ("v2", 2)])
def test_fused_shared_experts_equal_routed_plus_shared_mlp(arch, shared):
    _check_fused_layer(arch, shared)


@pytest.mark.parametrize("arch, shared", [("v3", 1), ("v2", 2)])
def test_fused_shared_experts_fp8_on_the_scale_grid(arch, shared):
    """I = 32 on a [16, 16] grid: each shared chunk takes its own rows / columns of the checkpoint's scales."""
    _check_fused_layer(arch, shared, block=(16, 16))


@pytest.mark.parametrize("arch, shared, block", [("v3", 1, None), ("v2", 2, None), ("v2", 2, (16, 16))])
def test_large_batches_run_the_shared_slots_beside_the_grouped_gemm(arch, shared, block, monkeypatch):
    """Past FUSED_SHARED_MAX_TOKENS the router leaves the shared columns out and ``shared`` runs the same
    slots as dense MLPs: the same output."""
    from dsinfer.layers.moe import FusedExperts
    from dsinfer.models.deepseek import blocks

    monkeypatch.setattr(blocks, "FUSED_SHARED_MAX_TOKENS", 12)  # the layer gets 13 tokens
    monkeypatch.setattr(blocks, "FUSED_SHARED_MAX_TOKENS_BESIDE", 12)
    calls, run_shared = [], FusedExperts.shared
    monkeypatch.setattr(FusedExperts, "shared", lambda self, *a, **k: calls.append(1) or run_shared(self, *a, **k))
    widths, select = [], blocks.Router.forward
    monkeypatch.setattr(blocks.Router, "forward", lambda self, *a, **k: widths.append(select(self, *a, **k)[1].shape[1])
                        or select(self, *a, **k))
    _check_fused_layer(arch, shared, block)
    assert calls == [1] and widths == [TOP_K]


@pytest.mark.skipif(torch.cuda.is_available(), reason="CPU tensors through Triton's interpreter")
def test_fused_shared_experts_through_the_triton_kernels(monkeypatch, kernel_options):
    """The same layer with the router and grouped GEMM kernels (Triton's interpreter on CPU)."""
    from dsinfer.ops.triton import moe_fused, router

    kernel_options(use_triton="always")
    calls = []
    for module, fn in ((router, "select_experts_triton"), (moe_fused, "fused_moe_triton")):
        kernel = getattr(module, fn)
        monkeypatch.setattr(module, fn, lambda *a, kernel=kernel, fn=fn, **k: calls.append(fn) or kernel(*a, **k))
    _check_fused_layer("v2", 2)
    assert calls == ["select_experts_triton", "fused_moe_triton"]


@pytest.mark.parametrize("inter, block", [(24, (16, 16)), (16, (16, 32))], ids=["rows-off-grid", "cols-off-grid"])
def test_fp8_off_the_scale_grid_keeps_a_separate_shared_mlp(inter, block):
    """A shared chunk would split a scale block (I not a multiple of the block height or width)."""
    cfg = tiny_config("v2", 2, inter=inter, block=block)
    assert fused_shared_experts(cfg, ARCHS["v2"](dict(cfg)).quant) == 0
    tensors = moe_tensors(cfg)
    model, moe = load_moe(cfg, tensors)
    assert isinstance(moe.shared_experts, DeepseekMLP) and moe.gate.cfg.num_shared == 0
    assert moe.experts.w13.shape[0] == ROUTED
    assert model.checkpoint_name("model.layers.1.mlp.shared_experts.up_proj.weight") == (
        "layers.1.mlp.shared_experts.gate_up_proj.weight", 1)
    x = torch.randn(5, HIDDEN, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        out = moe(x)
    torch.testing.assert_close(out, unfused_reference(cfg, tensors, moe.gate.cfg.routing, x), rtol=1e-5, atol=1e-5)


def test_fusing_needs_shared_experts():
    assert fused_shared_experts(tiny_config("v2", 2), None) == 2
    assert fused_shared_experts(tiny_config("v2", 2) | {"n_shared_experts": None}, None) == 0
    model = DeepseekV2ForCausalLM(tiny_config("v2", 2) | {"n_shared_experts": None})
    assert model.layers[1].mlp.shared_experts is None and model.layers[1].mlp.experts.w13.shape[0] == ROUTED


def test_mtp_shared_experts_load_into_the_mtp_block_stack():
    model = DeepseekV3ForCausalLM(tiny_config("v3", 1) | {"num_nextn_predict_layers": 1})
    name, shard = model.checkpoint_name("model.layers.2.mlp.shared_experts.down_proj.weight")
    assert (name, shard) == ("mtp.layers.0.block.mlp.experts.w2", ("shared", "down"))
    assert dict(model.named_parameters())[name].shape == (ROUTED + 1, HIDDEN, 32)


@pytest.mark.parametrize("name, shape", [
    ("shared_experts.gate_proj.weight", (2 * 32 + 1, HIDDEN)),  # not S chunks of I rows
    ("shared_experts.up_proj.weight", (32, HIDDEN)),  # one chunk's rows for two shared experts
    ("shared_experts.down_proj.weight", (HIDDEN, 32)),  # columns: S * I expected
    ("shared_experts.down_proj.weight", (HIDDEN + 1, 2 * 32)),  # rows: H expected
])
def test_wrong_shared_tensor_shape_raises(name, shape):
    model = DeepseekV2ForCausalLM(tiny_config("v2", 2))
    param_name, shard = model.checkpoint_name(f"model.layers.1.mlp.{name}")
    param = dict(model.named_parameters())[param_name]
    with pytest.raises(ValueError, match=rf"shape \({shape[0]}, {shape[1]}\) does not fit"):
        param.weight_loader(param, torch.zeros(shape), shard)


def test_wrong_shared_scale_shape_raises():
    model = DeepseekV2ForCausalLM(tiny_config("v2", 2, block=(16, 16)))
    param_name, shard = model.checkpoint_name("model.layers.1.mlp.shared_experts.down_proj.weight_scale_inv")
    assert param_name == "layers.1.mlp.experts.w2_scale_inv"
    param = dict(model.named_parameters())[param_name]
    param.weight_loader(param, torch.ones(4, 4), shard)  # [H / 16, S * I / 16]
    assert (param[ROUTED:] == 1).all()
    with pytest.raises(ValueError, match=r"\(4, 2\) does not fit \(4, 4\)"):
        param.weight_loader(param, torch.ones(4, 2), shard)


def test_routed_expert_index_past_the_routed_experts_raises():
    """Slot 8 exists (the first shared expert), but a checkpoint's expert 8 is not a routed expert of 8."""
    model = DeepseekV2ForCausalLM(tiny_config("v2", 2))
    param_name, shard = model.checkpoint_name("model.layers.1.mlp.experts.8.gate_proj.weight")
    param = dict(model.named_parameters())[param_name]
    with pytest.raises(ValueError, match=r"expert index 8 out of range \[0, 8\)"):
        param.weight_loader(param, torch.zeros(32, HIDDEN), shard)


def test_stacked_routed_layout_fills_only_the_routed_slots():
    """transformers' fused ``experts.gate_up_proj`` [E, 2I, H] loads whole into slots [:E]; the shared stay."""
    model = DeepseekV2ForCausalLM(tiny_config("v2", 2))
    name, shard = model.checkpoint_name("model.layers.1.mlp.experts.gate_up_proj")
    param = dict(model.named_parameters())[name]
    param.data.fill_(7.0)
    param.weight_loader(param, torch.ones(ROUTED, 64, HIDDEN))
    assert (param[:ROUTED] == 1).all() and (param[ROUTED:] == 7).all()
    with pytest.raises(ValueError, match=r"\(10, 64, 64\) does not fit \(8, 64, 64\)"):
        param.weight_loader(param, torch.ones(ROUTED + 2, 64, HIDDEN))
    experts = model.layers[1].mlp.experts
    assert torch.equal(experts.checkpoint_tensor("w13", shard), param[:ROUTED])


@pytest.mark.parametrize("dropped, reported", [
    ("model.layers.1.mlp.shared_experts.up_proj.weight", "layers.1.mlp.shared_experts.up_proj.weight"),
    ("model.layers.1.mlp.experts.5.down_proj.weight", "layers.1.mlp.experts.5.down_proj.weight"),
])
def test_load_weights_reports_an_expert_the_checkpoint_lacks(dropped, reported):
    """The stacked w13 / w2 are one parameter each: a missing expert tensor (shared or routed) must still fail."""
    cfg = tiny_config("v2", 2)
    model = DeepseekV2ForCausalLM(dict(cfg))
    tensors = moe_tensors(cfg)
    others = {f"model.{name}": torch.zeros(p.shape, dtype=p.dtype) for name, p in model.named_parameters()
              if ".mlp.experts." not in name and ".mlp.gate." not in name}
    full = others | tensors
    model.load_weights(full.items())  # complete: loads
    del full[dropped]
    with pytest.raises(ValueError, match=r"lacks 1 parameter") as err:
        DeepseekV2ForCausalLM(dict(cfg)).load_weights(full.items())
    assert reported in str(err.value)
