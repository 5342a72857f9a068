"""DeepSeek-V4's pieces against transformers' modules, same random weights, fp32: hyper-connections and the HC
head, both compressors, the lightning indexer's choice, the MoE block (hash and top-k routing), and the whole
model's logits through our paged entries and state-slot rings, in one step and in chunks."""

from __future__ import annotations

import json

import pytest
import torch

from dsinfer.core.forward_batch import ForwardBatch
from dsinfer.models.deepseek_v4 import DeepseekV4ForCausalLM
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
