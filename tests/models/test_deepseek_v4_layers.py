"""DeepSeek-V4's pieces against transformers' modules, same random weights, fp32: hyper-connections and the HC
head, both compressors, the lightning indexer's choice, the MoE block (hash and top-k routing), each attention
layer type, and the whole model's logits through our paged entries and state-slot rings, in one step and in
chunks; the config's published spellings; V4-Flash's cache sizes."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from dsinfer.core.forward_batch import ForwardBatch
from dsinfer.models.deepseek_v4 import DeepseekV4ForCausalLM
from dsinfer.models.deepseek_v4.config import CSA, HCA, V4Config
from dsinfer.models.weights import iterate_safetensors

from .v4_fixture import write_checkpoint

transformers = pytest.importorskip("transformers")
torch.set_grad_enabled(False)


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    path = tmp_path_factory.mktemp("v4")
    hf = write_checkpoint(transformers, path)
    ours = DeepseekV4ForCausalLM(json.loads((path / "config.json").read_text()))
    ours.load_weights(iterate_safetensors(path))
    return hf, ours


def tokens(n: int, seed: int = 1) -> torch.Tensor:
    return torch.randint(2, 128, (n,), generator=torch.Generator().manual_seed(seed))


def test_hyper_connection_and_head_match(pair):
    hf, ours = pair
    streams = torch.randn(7, 2, 32)
    post, comb, collapsed = hf.model.layers[1].attn_hc(streams.unsqueeze(0))
    p, c, x = ours.layers[1].hc_attn(streams)
    torch.testing.assert_close(p, post[0], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(c, comb[0], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(x, collapsed[0], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(ours.hc_head(streams), hf.model.hc_head(streams.unsqueeze(0))[0], rtol=1e-5,
                               atol=1e-6)


@pytest.mark.parametrize("layer", [1, 2])
def test_compressor_entries_match(pair, layer):
    """CSA (layer 1: overlapping windows of rate 4) and HCA (layer 2: rate 16) over 37 tokens, stateless."""
    hf, ours = pair
    x = torch.randn(1, 37, 32)
    positions = torch.arange(37).unsqueeze(0)
    q_res = hf.model.layers[layer].self_attn.q_a_norm(hf.model.layers[layer].self_attn.q_a_proj(x))
    ref = hf.model.layers[layer].self_attn.compressor(x, q_res, positions, None, layer)[0][0, 0]
    comp = ours.layers[layer].attn.compressor
    n = (37 // comp.rate) * comp.rate
    got = comp.pool(comp.project(x[0])[:n], 0, False)
    assert got.shape[0] == ref.shape[0] > 1
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)


def test_indexer_choice_matches(pair):
    hf, ours = pair
    x = torch.randn(1, 40, 32)
    positions = torch.arange(40)
    attn = hf.model.layers[1].self_attn
    q_res = attn.q_a_norm(attn.q_a_proj(x))
    ref = attn.compressor.indexer(x, q_res, positions.unsqueeze(0), None, 1)[0]  # [S, k], -1: none
    indexer = ours.layers[1].attn.indexer
    keys = indexer.compressor.pool(indexer.compressor.project(x[0]), 0, False)
    q, w = indexer.queries(q_res[0], x[0], positions)
    chosen = indexer.select(q, w, keys, positions)
    expected = torch.zeros_like(chosen)
    for t, picks in enumerate(ref.tolist()):
        expected[t, [p for p in picks if p >= 0]] = True
    assert chosen.sum(1).max() == 3 and (chosen.sum(1) < ((positions + 1) // 4)).any()  # the top-k cuts
    assert torch.equal(chosen, expected)


@pytest.mark.parametrize("layer", [0, 1])  # hash routed, top-k routed
def test_moe_matches(pair, layer):
    hf, ours = pair
    ids = tokens(9)
    x = torch.randn(1, 9, 32) * 3  # large enough that swiglu_limit clips
    ref = hf.model.layers[layer].mlp(x, input_ids=ids.unsqueeze(0))[0]
    torch.testing.assert_close(ours.layers[layer].ffn(x[0], ids), ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("layer", [0, 1, 2])  # sliding, CSA, HCA
def test_attention_layer_matches(pair, layer):
    """Shared-KV MQA with sinks, partial RoPE (main / compress + YaRN), the window, the compressed entries (and
    the indexer's choice) and the grouped output projection, over 37 tokens in one step."""
    hf, ours = pair
    x = torch.randn(1, 37, 32)
    positions = torch.arange(37)
    rotary = hf.model.rotary_emb
    angles = {kind: rotary(x, positions.unsqueeze(0), layer_type=kind) for kind in ("main", "compress")}
    offset = positions.view(-1, 1) - positions.view(1, -1)
    mask = torch.zeros(37, 37).masked_fill((offset < 0) | (offset >= 8), float("-inf"))[None, None]
    ref = hf.model.layers[layer].self_attn(x, angles, positions.unsqueeze(0), mask)[0][0]
    _engine_caches(ours, block_size=32, num_blocks=3)
    batch = ForwardBatch(
        input_ids=torch.zeros(37).long(), positions=positions, slot_mapping=torch.zeros(37).long(),
        block_tables=torch.tensor([[2, 1]], dtype=torch.int32), query_start_loc=torch.tensor([0, 37]),
        seq_lens=torch.tensor([37]), logits_indices=torch.arange(37), max_query_len=37, max_seq_len=37,
        state_slots=torch.tensor([0]))
    torch.testing.assert_close(ours.layers[layer].attn(x[0], positions, batch), ref, rtol=1e-5, atol=1e-5)


def _engine_caches(model: DeepseekV4ForCausalLM, block_size: int, num_blocks: int) -> None:
    for layer in model.attention_layers():
        spec = layer.kv_cache_spec(block_size, torch.float32)
        layer.kv_cache = None if spec is None else spec.allocate(num_blocks, torch.device("cpu"))
        layer.state = layer.state_spec(0, torch.float32).allocate(2, torch.device("cpu"))


def _run_chunk(model, ids: torch.Tensor, start: int, end: int, block_row: list[int], slot: int) -> torch.Tensor:
    batch = ForwardBatch(
        input_ids=ids[start:end], positions=torch.arange(start, end), slot_mapping=torch.zeros(end - start).long(),
        block_tables=torch.tensor([block_row], dtype=torch.int32), query_start_loc=torch.tensor([0, end - start]),
        seq_lens=torch.tensor([end]), logits_indices=torch.arange(end - start), max_query_len=end - start,
        max_seq_len=end, state_slots=torch.tensor([slot]))
    return model.compute_logits(model(batch.input_ids, batch.positions, batch))


@pytest.mark.parametrize("chunks", [[70], [5, 17, 18, 1, 1, 28]], ids=["one_step", "chunked"])
def test_model_logits_match_through_the_engine_caches(pair, chunks):
    """70 tokens: past the window (8), several HCA windows (16) and the indexer's top-3; the chunked run crosses
    window boundaries mid-chunk and decodes single tokens, reading everything back from blocks and rings."""
    hf, ours = pair
    ids = tokens(70, seed=3)
    ref = hf(ids.unsqueeze(0)).logits[0]
    _engine_caches(ours, block_size=32, num_blocks=6)
    got, start = [], 0
    for n in chunks:
        got.append(_run_chunk(ours, ids, start, start + n, [3, 1, 5], slot=1))  # blocks out of order
        start += n
    torch.testing.assert_close(torch.cat(got), ref, rtol=1e-4, atol=1e-4)


def test_published_flat_config_reads_as_transformers_nested_one(pair, tmp_path):
    """The published config.json spells the layout flat (compress_ratios, num_hash_layers, qk_rope_head_dim,
    rope_theta / compress_rope_theta / rope_scaling): it reads as the config transformers wrote."""
    hf, ours = pair
    cfg = hf.config.to_dict()
    flat = {k: v for k, v in cfg.items() if k not in ("layer_types", "mlp_layer_types", "rope_parameters",
                                                        "partial_rotary_factor", "compress_rates")}
    compress = cfg["rope_parameters"]["compress"]
    flat.update(compress_ratios=[0, 4, 128, 4], num_hash_layers=1, qk_rope_head_dim=8,
                rope_scaling={k: v for k, v in compress.items() if k not in ("rope_theta", "partial_rotary_factor",
                                                                             "attention_factor")})
    got = V4Config.of(flat)
    assert got.layer_types == ours.v4.layer_types and got.mlp_layer_types == ours.v4.mlp_layer_types
    assert got.rope_parameters == ours.v4.rope_parameters and got.rope_dim == 8
    assert got.compress_rates == {CSA: 4, HCA: 128}  # the ratios name the layer types; the rates are V4's
    assert V4Config.of(dict(flat, compress_rate_hca=16)).compress_rates == ours.v4.compress_rates


def test_v4_flash_pages_6_4_kb_a_token_and_a_12_mib_state_slot():
    """V4-Flash's real config (43 layers, built on the meta device): 2,048-token blocks, 6,584 bytes of cache a
    token of context in bf16 (V3: 70 KB), and a 12 MiB state slot a running sequence."""
    cfg = json.loads((Path("/work/shared/model-configs/deepseek-v4-flash/config.json")).read_text()) \
        if Path("/work/shared/model-configs/deepseek-v4-flash/config.json").exists() else None
    if cfg is None:
        pytest.skip("shared/model-configs/deepseek-v4-flash is not here")
    with torch.device("meta"):
        model = DeepseekV4ForCausalLM(cfg)
    block = 16 * model.v4.max_rate
    specs = [layer.kv_cache_spec(block, torch.bfloat16) for layer in model.attention_layers()]
    assert block == 2048 and sum(s.bytes_per_block for s in specs if s is not None) / block == 6584
    slot = sum(layer.state_spec(0, torch.bfloat16).bytes_per_slot for layer in model.attention_layers())
    assert round(slot / 2**20, 1) == 11.9
