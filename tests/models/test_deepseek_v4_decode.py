"""V4's batched decode path (``deepseek_v4.decode``) against the per-sequence path, and free of host reads."""

from __future__ import annotations

import copy
import json

import pytest
import torch

from dsinfer.core.forward_batch import ForwardBatch
from dsinfer.models.deepseek_v4 import DeepseekV4ForCausalLM
from dsinfer.models.deepseek_v4.attention import V4Attention
from dsinfer.models.weights import iterate_safetensors
from dsinfer.runner.cuda_graphs import DecodeGraphs
from dsinfer.runner.input_batch import HostInputs

from .host_reads import no_host_reads
from .v4_fixture import write_checkpoint

transformers = pytest.importorskip("transformers")
torch.set_grad_enabled(False)

BLOCK, BLOCKS_PER_SEQ, MAX_DRAFTS = 32, 3, 3


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    path = tmp_path_factory.mktemp("v4")
    write_checkpoint(transformers, path)
    ours = DeepseekV4ForCausalLM(json.loads((path / "config.json").read_text()))
    ours.load_weights(iterate_safetensors(path))
    return ours


def _ids(n: int, seed: int) -> torch.Tensor:
    return torch.randint(2, 128, (n,), generator=torch.Generator().manual_seed(seed))


def _batch(ids: list[torch.Tensor], starts: list[int], slots: list[int], pad: int = 0) -> ForwardBatch:
    """One step: sequence b computes ids[b] at positions starts[b]..; ``pad`` padding rows of len(ids[0]) tokens
    each (seq_len 0, slot -1, zero block row), as a padded graph batch has."""
    n, q = len(ids), len(ids[0])
    lens = [s + len(i) for s, i in zip(starts, ids)]
    positions = torch.cat([torch.arange(s, s + len(i)) for s, i in zip(starts, ids)] + [torch.zeros(pad * q)]).long()
    qsl = torch.tensor([0] + [sum(len(i) for i in ids[:b + 1]) for b in range(n)] + [n * q] * pad, dtype=torch.int32)
    tables = [[1 + BLOCKS_PER_SEQ * s + j for j in range(BLOCKS_PER_SEQ)] for s in slots] + [[0] * BLOCKS_PER_SEQ] * pad
    return ForwardBatch(
        input_ids=torch.cat(ids + [torch.zeros(pad * q, dtype=torch.int64)]), positions=positions,
        slot_mapping=torch.zeros(len(positions)).long(), block_tables=torch.tensor(tables, dtype=torch.int32),
        query_start_loc=qsl, seq_lens=torch.tensor(lens + [0] * pad, dtype=torch.int32),
        logits_indices=torch.arange(len(positions)), max_query_len=max(len(i) for i in ids),
        max_seq_len=BLOCK * BLOCKS_PER_SEQ, state_slots=torch.tensor(slots + [-1] * pad))


def _prefilled(model: DeepseekV4ForCausalLM, lens: list[int]) -> DeepseekV4ForCausalLM:
    """A copy of the model whose caches hold one prefilled sequence per length (slot b, its own blocks)."""
    model = copy.deepcopy(model)
    for layer in model.attention_layers():
        spec = layer.kv_cache_spec(BLOCK, torch.float32)
        num_blocks = 1 + BLOCKS_PER_SEQ * (len(lens) + 1)
        layer.kv_cache = None if spec is None else spec.allocate(num_blocks, torch.device("cpu"))
        layer.state = layer.state_spec(MAX_DRAFTS, torch.float32).allocate(len(lens) + 1, torch.device("cpu"))
    for b, n in enumerate(lens):
        batch = _batch([_ids(n, seed=b)], [0], [b])
        model(batch.input_ids, batch.positions, batch)
    return model


def _caches(model: DeepseekV4ForCausalLM) -> list[torch.Tensor]:
    out = []
    for layer in model.attention_layers():
        out += list(layer.kv_cache or []) + list(layer.state.values())
    return out


def _per_sequence(monkeypatch):
    monkeypatch.setattr(V4Attention, "batched", lambda self, batch: False)


@pytest.mark.parametrize("q", [1, 3, 4], ids=["decode", "two_drafts", "three_drafts"])
def test_batched_decode_equals_the_per_sequence_path(model, monkeypatch, q):
    """Mixed lengths whose steps close CSA windows (rate 4), HCA windows (rate 16: 15 -> 16, 63 -> 64) or none,
    past the window (8) and the indexer's top-3; outputs and every cache row after the step agree."""
    lens = [15, 23, 40, 63]
    ids = [_ids(q, seed=10 + b) for b in range(len(lens))]
    batched = _prefilled(model, lens)
    reference = copy.deepcopy(batched)
    batch = _batch(ids, lens, list(range(len(lens))))
    assert all(layer.batched(batch) for layer in batched.attention_layers())
    got = batched(batch.input_ids, batch.positions, batch)
    _per_sequence(monkeypatch)
    ref_batch = _batch(ids, lens, list(range(len(lens))))
    want = reference(ref_batch.input_ids, ref_batch.positions, ref_batch)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    for a, b in zip(_caches(batched), _caches(reference)):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("q", [1, 4])
def test_padding_rows_are_finite_and_write_nothing(model, monkeypatch, q):
    lens = [15, 40]
    ids = [_ids(q, seed=20 + b) for b in range(len(lens))]
    batched = _prefilled(model, lens)
    reference = copy.deepcopy(batched)
    batch = _batch(ids, lens, [0, 1], pad=3)
    got = batched(batch.input_ids, batch.positions, batch)
    assert torch.isfinite(got).all()
    _per_sequence(monkeypatch)
    ref_batch = _batch(ids, lens, [0, 1])
    want = reference(ref_batch.input_ids, ref_batch.positions, ref_batch)
    torch.testing.assert_close(got[:len(lens) * q], want, rtol=1e-5, atol=1e-5)
    for a, b in zip(_caches(batched), _caches(reference)):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def test_an_all_padding_batch_writes_nothing(model):
    """What a graph capture runs: every row padding."""
    batched = _prefilled(model, [15, 40])
    before = [t.clone() for t in _caches(batched)]
    batch = _batch([torch.zeros(1, dtype=torch.int64)], [0], [0], pad=3)
    batch = ForwardBatch(**{**batch.__dict__, "seq_lens": torch.zeros(4, dtype=torch.int32),
                            "state_slots": torch.full((4,), -1), "derived": {}})
    assert torch.isfinite(batched(batch.input_ids, batch.positions, batch)).all()
    for a, b in zip(_caches(batched), before):
        assert torch.equal(a, b)


def _attention_ops(model: DeepseekV4ForCausalLM, num_seqs: int, q: int) -> list[str]:
    """The aten ops of every attention layer's forward on one decode step of num_seqs sequences (half padding)."""
    lens = [15 + 9 * b for b in range(num_seqs // 2)]
    batched = _prefilled(model, lens)
    batch = _batch([_ids(q, seed=b) for b in range(len(lens))], lens, list(range(len(lens))),
                   pad=num_seqs - len(lens))
    x = torch.randn(batch.num_tokens, model.v4.hidden_size)
    with no_host_reads() as ops:
        for layer in batched.attention_layers():
            layer(x, batch.positions, batch)
    return ops


@pytest.mark.parametrize("q", [1, 3])
def test_decode_attention_reads_nothing_on_the_host_and_runs_the_same_ops_at_any_batch(model, q):
    small, large = _attention_ops(model, 2, q), _attention_ops(model, 8, q)
    assert small == large
    assert len(small) > 100  # the mode saw the layers' ops


def _decode_step_ops(model: DeepseekV4ForCausalLM, lens: list[int], pad: int, q: int
                     ) -> tuple[list[str], torch.Tensor]:
    """The aten ops and real rows' logits of a whole model decode step (attention, compressors, indexer, hash and
    top-k MoE, hyper-connections, the head): sequences of ``lens`` tokens, then ``pad`` padding rows."""
    batched = _prefilled(model, lens)
    batch = _batch([_ids(q, seed=b) for b in range(len(lens))], lens, list(range(len(lens))), pad=pad)
    with no_host_reads() as ops:
        logits = batched.compute_logits(batched(batch.input_ids, batch.positions, batch))
    return ops, logits[:len(lens) * q]


@pytest.mark.parametrize("q", [1, 3])
def test_a_whole_decode_step_reads_nothing_on_the_host_and_padding_changes_no_logit(model, q):
    """What a CUDA graph needs of V4's decode step, on CPU: no host read anywhere, the same ops at any batch
    size, and the logits of a padded batch (a graph's size, dummy rows) those of the unpadded one. Bits may
    differ only where a dense matmul's kernel changes with its row count."""
    lens = [15, 24, 40]
    _, alone = _decode_step_ops(model, lens, 0, q)
    small_ops, padded = _decode_step_ops(model, lens, 1, q)
    large_ops, more = _decode_step_ops(model, lens, 5, q)
    assert small_ops == large_ops and len(small_ops) > 300
    assert torch.isfinite(padded).all()
    torch.testing.assert_close(padded, alone, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(more, alone, rtol=1e-5, atol=1e-5)


def _host(batch: ForwardBatch) -> HostInputs:
    return HostInputs(batch.input_ids.numpy(), batch.positions.numpy(), batch.slot_mapping.numpy(),
                      batch.block_tables.numpy(), batch.query_start_loc.numpy(), batch.seq_lens.numpy(),
                      batch.state_slots.numpy())


@pytest.mark.parametrize("q", [1, 3])
def test_decode_graph_buffers_carry_the_state_slots_and_give_the_eager_logits(model, q):
    """The decode graphs' forward (what a capture records) on CPU: two steps copied into the graph's buffers at
    padded size 4, the second with fewer sequences (a stale slot left in the buffers would write to a ring the
    eager step leaves alone), against the eager model on the unpadded steps: logits and every cache row."""
    lens = [15, 24, 40]
    graphed, eager = _prefilled(model, lens), _prefilled(model, lens)
    graphs = DecodeGraphs(graphed, 8, BLOCKS_PER_SEQ, BLOCK * BLOCKS_PER_SEQ, torch.device("cpu"),
                          sizes=(1, 2, 4, 8), tokens_per_seq=(1, q), state_slots=True)
    for step, seqs in enumerate([[0, 1, 2], [1, 2]]):
        batch = _batch([_ids(q, seed=30 + 3 * step + b) for b in seqs], [lens[b] + step * q for b in seqs], seqs)
        graphs.load_inputs(_host(batch), 4, q)
        assert graphs.state_slots[:4].tolist() == seqs + [-1] * (4 - len(seqs))
        got = graphs._forward(4, q)[:len(seqs) * q]
        want = eager.compute_logits(eager(batch.input_ids, batch.positions, batch))
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    for a, b in zip(_caches(graphed), _caches(eager)):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def test_decode_graphs_of_a_stateful_model_refuse_inputs_without_state_slots(model):
    graphs = DecodeGraphs(model, 4, BLOCKS_PER_SEQ, BLOCK * BLOCKS_PER_SEQ, torch.device("cpu"), sizes=(4,),
                          state_slots=True)
    host = _host(_batch([_ids(1, seed=0)], [15], [0]))
    host.state_slots = None
    with pytest.raises(ValueError, match="state slots"):
        graphs.load_inputs(host, 4)


def test_the_runner_captures_v4_decode_but_not_its_prompt_steps_or_deterministic_mode():
    from dsinfer.models.llama import LlamaForCausalLM
    from dsinfer.runner.cuda_graphs import graph_modes

    assert graph_modes(DeepseekV4ForCausalLM, deterministic=False, mtp=False) == (False, False)
    assert graph_modes(DeepseekV4ForCausalLM, deterministic=True, mtp=False) == (True, False)
    assert DeepseekV4ForCausalLM.multi_token_decode_graphs
    assert graph_modes(LlamaForCausalLM, deterministic=True, mtp=False) == (False, True)  # the default flags
    assert graph_modes(LlamaForCausalLM, deterministic=False, mtp=True) == (True, True)
