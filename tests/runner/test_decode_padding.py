"""Steps whose sequences verify different draft counts, padded to the step's longest query (``runner.decode_padding``,
what lets them replay a decode CUDA graph): the padded layout itself, and a padded step against the same step
unpadded on the Llama and DeepSeek-V2 (MLA, MoE) tiny models on CPU: the same logits rows, tokens and logprobs,
the same KV cache after it, and a next step that reads that cache alike. Padded either by force on the eager model
(``force_decode_padding``) or through the decode graphs' own path (their buffers, sizes and forward) with each
"graph" replayed by running the forward it would have captured."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from dsinfer.core.plan import CachedRequestData, NewRequestData, RequestSampling, StepPlan
from dsinfer.core.step_latency import DecodePadding
from dsinfer.engine.arg_utils import EngineArgs
from dsinfer.runner.cuda_graphs import DecodeGraphs
from dsinfer.runner.decode_padding import pad_step
from dsinfer.runner.input_batch import HostInputs
from dsinfer.runner.model_runner import ModelRunner

BLOCK = 4


def _host(q_lens: list[int], starts: list[int], tables: list[list[int]]) -> HostInputs:
    cu = np.concatenate([[0], np.cumsum(q_lens)])
    positions = np.concatenate([np.arange(s, s + q) for s, q in zip(starts, q_lens)]).astype(np.int64)
    row = np.repeat(np.arange(len(q_lens)), q_lens)
    table = np.array(tables, dtype=np.int32)
    slots = table[row, positions // BLOCK].astype(np.int64) * BLOCK + positions % BLOCK
    return HostInputs(np.arange(100, 100 + cu[-1], dtype=np.int64), positions, slots, table, cu.astype(np.int32),
                      (np.array(starts) + np.array(q_lens)).astype(np.int32), None,
                      np.arange(cu[-1], dtype=np.int64))


def test_padding_goes_before_each_sequence_at_positions_it_has_computed():
    # the second and third sequences end on a block boundary (8 and 12 tokens in 2 and 3 blocks)
    host = _host([4, 1, 2], [5, 7, 10], [[1, 2, 3], [4, 5, 0], [6, 7, 8]])
    padded = pad_step(host, 4)
    p = padded.host
    assert p.query_start_loc.tolist() == [0, 4, 8, 12] and p.seq_lens.tolist() == host.seq_lens.tolist()
    assert padded.rows.tolist() == [0, 1, 2, 3, 7, 10, 11]
    # the real tokens keep their ids, positions and slots; padding stores nothing
    assert p.input_ids[padded.rows].tolist() == host.input_ids.tolist()
    assert p.positions[padded.rows].tolist() == host.positions.tolist()
    assert p.slot_mapping[padded.rows].tolist() == host.slot_mapping.tolist()
    assert p.positions.tolist() == [5, 6, 7, 8, 4, 5, 6, 7, 8, 9, 10, 11]
    assert (np.delete(p.slot_mapping, padded.rows) == -1).all()
    # row j of a sequence sits at seq_len - Q + j (the attention contract), inside the blocks it holds
    assert (p.positions == np.repeat(p.seq_lens - 4, 4) + np.tile(np.arange(4), 3)).all()
    held = np.array([3, 2, 3])
    assert (p.positions // BLOCK < np.repeat(held, 4)).all() and (p.positions >= 0).all()
    assert p.logits_indices.tolist() == padded.rows.tolist()


def test_a_sequence_with_fewer_tokens_before_it_than_its_padding_is_not_padded():
    assert pad_step(_host([4, 1], [5, 2], [[1, 2, 3], [4, 0, 0]]), 4) is None  # needs 3 before it, has 2
    assert pad_step(_host([4, 1], [5, 3], [[1, 2, 3], [4, 0, 0]]), 4) is not None
    assert pad_step(_host([4, 1], [5, 3], [[1, 2, 3], [4, 0, 0]]), 3) is None  # longer than the length


class _ForwardAsReplay:
    """A captured graph's stand-in on CPU: its replay runs the forward a capture would have recorded."""

    def __init__(self, graphs: DecodeGraphs, size: int, q: int):
        self.graphs, self.key = graphs, (size, q)

    def replay(self) -> None:
        self.graphs.logits[self.key] = self.graphs._forward(*self.key)


def _with_graphs(runner: ModelRunner, max_q: int) -> None:
    """Decode graphs of batch sizes 1, 2 and 8 (four sequences replay size 8: four rows of graph padding too) and
    every length 1..max_q, replayed by ``_ForwardAsReplay``."""
    graphs = DecodeGraphs(runner.model, 8, 16, 64, runner.device, sizes=(1, 2, 8),
                          tokens_per_seq=tuple(range(1, max_q + 1)))
    for size in graphs.sizes:
        for q in graphs.tokens_per_seq:
            graphs.graphs[size, q] = _ForwardAsReplay(graphs, size, q)
    runner.graphs = graphs


def _runner(path, mode: str, deterministic: bool = False) -> ModelRunner:
    config = EngineArgs(model=str(path), dtype="float32", block_size=BLOCK, num_kv_blocks=40, max_model_len=64,
                        max_num_seqs=8, device="cpu", deterministic=deterministic).create_engine_config()
    runner = ModelRunner(config)
    runner.force_decode_padding = mode == "forced"
    if mode == "graphs":
        _with_graphs(runner, 4)
    runner.seen_logits = []  # what sampling is handed, each step
    sample = runner._sample

    def recording(logits, *args, **kwargs):
        runner.seen_logits.append(logits.float().log_softmax(-1).clone())
        return sample(logits, *args, **kwargs)

    runner._sample = recording
    runner.padded_steps = 0
    forward_padded = runner._forward_padded

    def counting(*args):
        runner.padded_steps += 1
        return forward_padded(*args)

    runner._forward_padded = counting
    replay = runner._replay

    def replaying(inputs, size, q, padded):
        runner.padded_steps += padded is not None
        return replay(inputs, size, q, padded)

    runner._replay = replaying
    return runner


# prompt lengths; drafts in the two decode steps. In the first, sequences 0, 2 and 3 end on a block boundary
# (8, 8 and 12 tokens) and get 3, 2 and 1 padding tokens; in the second sequence 1 gets 3
PROMPTS = [7, 5, 6, 9]
DRAFTS = [[0, 3, 1, 2], [2, 0, 3, 1]]


def _steps(runner: ModelRunner, vocab: int):
    """Prompts, then two decode steps of mixed draft counts (random drafts, so some are rejected, and each step
    follows what the last kept); -> each step's RunnerOutput."""
    rng = np.random.default_rng(1)
    rids = [f"r{i}" for i in range(len(PROMPTS))]
    tokens = {rid: rng.integers(3, vocab, n).tolist() for rid, n in zip(rids, PROMPTS)}
    blocks, next_block = {}, 1
    computed = {rid: 0 for rid in rids}

    def grow(rid, end):
        nonlocal next_block
        need = -(-end // BLOCK) - len(blocks.setdefault(rid, []))
        new = list(range(next_block, next_block + max(need, 0)))
        next_block += len(new)
        blocks[rid] += new
        return new

    sampling = [RequestSampling(temperature=0.0, top_k=-1, top_p=1.0, min_p=0.0, seed=i, logprobs=2)
                for i in range(len(rids))]
    for rid in rids:
        grow(rid, PROMPTS[rids.index(rid)])
    plan = StepPlan(new_requests=[NewRequestData(rid, tokens[rid], n, s, [list(blocks[rid])], 0)
                                  for rid, n, s in zip(rids, PROMPTS, sampling)],
                    num_scheduled_tokens={rid: n for rid, n in zip(rids, PROMPTS)})
    outputs = [runner.execute(plan)]
    for drafts in DRAFTS:
        cached = CachedRequestData(new_block_ids=[[]], num_kept_blocks=[[]])
        plan = StepPlan(cached_requests=cached)
        for rid, d in zip(rids, drafts):
            new_tokens = outputs[-1].sampled_token_ids[rid]
            computed[rid] = len(tokens[rid]) + len(new_tokens) - 1
            tokens[rid] = tokens[rid] + new_tokens
            kept = len(blocks[rid])
            cached.append(rid, new_tokens, [grow(rid, computed[rid] + 1 + d)], [kept], computed[rid])
            plan.num_scheduled_tokens[rid] = 1 + d
            if d:
                plan.draft_token_ids[rid] = rng.integers(3, vocab, d).tolist()
        outputs.append(runner.execute(plan))
    return outputs


def _caches(runner: ModelRunner) -> list[torch.Tensor]:
    return [layer.kv_cache for layer in runner.model.attention_layers()]


@pytest.mark.parametrize("model,mode", [("llama", "forced"), ("deepseek_v2", "forced"), ("llama", "graphs"),
                                        ("deepseek_v2", "graphs")])
def test_a_padded_step_samples_what_the_unpadded_step_samples(model, mode, request):
    path = request.getfixturevalue("tiny_llama_dir" if model == "llama" else "tiny_deepseek_dir")
    plain, padded = _runner(path, "plain"), _runner(path, mode)
    if mode == "graphs":
        assert padded.decode_padding == DecodePadding(8, 4)
    vocab = plain.vocab_size
    expected, got = _steps(plain, vocab), _steps(padded, vocab)
    assert padded.padded_steps == 2 and plain.padded_steps == 0  # the prompt step is not padded (too short)
    assert len(padded.seen_logits) == len(plain.seen_logits) == 3
    for want, have in zip(plain.seen_logits, padded.seen_logits):  # every sampled row, drafts' rejected too
        assert have.shape == want.shape
        torch.testing.assert_close(have, want, atol=1e-5, rtol=0)
    for want, have in zip(expected, got):
        assert have.sampled_token_ids == want.sampled_token_ids
        for rid, lps in want.logprobs.items():
            for a, b in zip(lps, have.logprobs[rid]):
                assert a.token_ids == b.token_ids
                np.testing.assert_allclose(b.logprobs, a.logprobs, atol=1e-5, rtol=0)
    for want, have in zip(_caches(plain), _caches(padded)):  # padding stored nothing; the real tokens the same
        torch.testing.assert_close(have, want, atol=1e-5, rtol=0)


@pytest.mark.parametrize("model", ["llama", "deepseek_v2"])
def test_in_deterministic_mode_a_padded_step_is_bit_identical(model, request):
    """The batch-invariant kernels give every row the same result whatever the step's layout: padding changes
    no bit (what lets the oracle benchmark compare padded steps with speculation off in bf16)."""
    path = request.getfixturevalue("tiny_llama_dir" if model == "llama" else "tiny_deepseek_dir")
    plain, padded = _runner(path, "plain", deterministic=True), _runner(path, "forced", deterministic=True)
    assert _steps(plain, plain.vocab_size) == _steps(padded, padded.vocab_size)
    assert padded.padded_steps == 2
    assert all(torch.equal(a, b) for a, b in zip(plain.seen_logits, padded.seen_logits))
    assert all(torch.equal(a, b) for a, b in zip(_caches(plain), _caches(padded)))
