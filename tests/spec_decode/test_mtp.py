"""MTP drafting on a tiny DeepSeek-V3 with one MTP layer, written by transformers: greedy (and seeded, "exact"
acceptance) outputs are token for token those without speculation, for k = 1 and k = 2 (the MTP layer chained on
its own output), through mixed batches, chunked prefill, preemption and the worker process; the first draft is
the MTP module of the checkpoint's weights computed in plain torch.

The main model keeps transformers' own init (std 0.02): its residual stream stays close to the embeddings, so
its next token depends mostly on the current one. The MTP layer's eh_proj passes the next token's embedding
through and its shared head is the model's final norm and lm_head, so it predicts what the target will say after
that token: drafts are often kept, which a fully random MTP layer (1 / 256) would not show."""

from __future__ import annotations

import json

import pytest
import torch

from dsinfer import LLM, SamplingParams
from tests.models.test_deepseek import _mtp_reference, append_tensors, mtp_tensors, randomize, v3_config
from tests.models.test_deepseek_v32 import v32_config

transformers = pytest.importorskip("transformers")

MAX_TOKENS = 12


class _Ckpt:
    def __init__(self, path, hf, donor):
        self.path, self.hf, self.donor = path, hf, donor


def write_predictive_mtp(path, cls, config) -> _Ckpt:
    """Layers 0-1 of a 3-layer donor (transformers' init) are the model; the donor's layer 2 is the MTP layer's
    block, its eh_proj / enorm / head those that predict the target (see the module doc)."""
    torch.manual_seed(0)
    donor = cls(config(num_hidden_layers=3)).eval()
    hf = cls(config()).eval()
    hf.load_state_dict({k: v for k, v in donor.state_dict().items() if not k.startswith("model.layers.2.")})
    hf.save_pretrained(path)
    cfg = json.loads((path / "config.json").read_text())  # transformers' V3.2 config has none; DeepSeek's has 1
    (path / "config.json").write_text(json.dumps(cfg | {"num_nextn_predict_layers": 1}))
    tensors = mtp_tensors(donor, donor_layer=2, index=2, seed=3)
    hidden = hf.config.hidden_size
    tensors["model.layers.2.eh_proj.weight"] = torch.cat((torch.eye(hidden), torch.zeros(hidden, hidden)), 1)
    tensors["model.layers.2.enorm.weight"] = torch.ones(hidden)
    tensors["model.layers.2.shared_head.norm.weight"] = hf.model.norm.weight.detach().clone()
    tensors["model.layers.2.shared_head.head.weight"] = hf.lm_head.weight.detach().clone()
    tensors["model.layers.2.embed_tokens.weight"] = hf.model.embed_tokens.weight.detach().clone()
    append_tensors(path, tensors)
    return _Ckpt(path, hf, donor)


@pytest.fixture(scope="module")
def v3_mtp(tmp_path_factory) -> _Ckpt:
    return write_predictive_mtp(tmp_path_factory.mktemp("deepseek-v3-mtp"), transformers.DeepseekV3ForCausalLM,
                                v3_config)


@pytest.fixture(scope="module")
def v3_random(tmp_path_factory) -> _Ckpt:
    """Every weight re-drawn at unit scale (``randomize``), the MTP layer's too: attention visibly shapes its
    output, so a wrong MTP KV entry shows in its draft's probability."""
    torch.manual_seed(0)
    donor = transformers.DeepseekV3ForCausalLM(v3_config(num_hidden_layers=3)).eval()
    randomize(donor, seed=2)
    hf = transformers.DeepseekV3ForCausalLM(v3_config()).eval()
    hf.load_state_dict({k: v for k, v in donor.state_dict().items() if not k.startswith("model.layers.2.")})
    path = tmp_path_factory.mktemp("deepseek-v3-mtp-random")
    hf.save_pretrained(path)
    append_tensors(path, mtp_tensors(donor, donor_layer=2, index=2, seed=3))
    return _Ckpt(path, hf, donor)


def prompts(count: int, seed: int = 1) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 256, (int(n),), generator=gen).tolist()
            for n in torch.randint(3, 30, (count,), generator=gen)]


def run(llm: LLM, ids: list[list[int]], params) -> list[list[int]]:
    outs = llm.generate([{"prompt_token_ids": p} for p in ids], params, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]


GREEDY = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)


@pytest.fixture(scope="module")
def baseline(v3_mtp):
    llm = LLM(str(v3_mtp.path), enable_prefix_caching=False)
    ids = prompts(6)
    return ids, run(llm, ids, GREEDY)


@pytest.mark.parametrize("k", [1, 2])
def test_greedy_with_mtp_equals_greedy_without(v3_mtp, baseline, k):
    ids, expected = baseline
    llm = LLM(str(v3_mtp.path), speculative_config={"method": "mtp", "num_speculative_tokens": k})
    assert run(llm, ids, GREEDY) == expected
    stats = llm.engine.get_stats()["spec_decode"]
    assert stats["num_draft_tokens"] > 0 and stats["num_accepted_tokens"] > 0
    if k == 2:
        assert stats["accepted_per_position"][1] > 0  # the chained draft is kept too


def test_confidence_scheduled_mtp_keeps_greedy_outputs(v3_mtp, baseline, tmp_path):
    """The MTP model runs no dummy batches: the step-latency curve starts empty (every draft verified) and is
    built from the real steps, after which a steep curve verifies only the likeliest drafts."""
    from dsinfer.core.step_latency import StepLatencyCurve

    ids, expected = baseline
    llm = LLM(str(v3_mtp.path), step_latency_dir=str(tmp_path),
              speculative_config={"method": "mtp", "num_speculative_tokens": 2, "confidence_scheduling": True})
    assert not llm.engine.step_latency.ready
    assert run(llm, ids, GREEDY) == expected
    assert llm.engine.step_latency.ready
    llm.engine.scheduler.confidence.curve = StepLatencyCurve({1: 1.0, 64: 64.0})  # a draft costs what a token gives
    before = llm.engine.get_stats()["spec_decode"]
    assert run(llm, ids, GREEDY) == expected
    after = llm.engine.get_stats()["spec_decode"]
    verified = after["num_draft_tokens"] - before["num_draft_tokens"]
    assert verified < after["num_proposed_tokens"] - before["num_proposed_tokens"]


def test_chunked_prefill_and_preemption_keep_greedy_outputs(v3_mtp, baseline):
    ids, expected = baseline
    spec = {"method": "mtp", "num_speculative_tokens": 2}
    chunked = LLM(str(v3_mtp.path), speculative_config=spec, max_num_batched_tokens=8, enable_prefix_caching=False)
    assert run(chunked, ids, GREEDY) == expected
    tight = LLM(str(v3_mtp.path), speculative_config=spec, num_kv_blocks=6, enable_prefix_caching=False)
    preempted = []
    original = tight.engine.scheduler._preempt
    tight.engine.scheduler._preempt = lambda request: (preempted.append(request), original(request))
    assert run(tight, ids, GREEDY) == expected
    assert preempted, "the KV cache was large enough: nothing was preempted"
    assert tight.engine.get_stats()["spec_decode"]["num_accepted_tokens"] > 0


def test_prefix_cache_hits_keep_greedy_outputs(v3_mtp):
    gen = torch.Generator().manual_seed(4)
    stem = torch.randint(0, 256, (20,), generator=gen).tolist()
    ids = [stem + torch.randint(0, 256, (n,), generator=gen).tolist() for n in (3, 7, 12)]
    expected = run(LLM(str(v3_mtp.path), enable_prefix_caching=False), ids, GREEDY)
    llm = LLM(str(v3_mtp.path), speculative_config={"method": "mtp", "num_speculative_tokens": 2})
    assert run(llm, ids[:1], GREEDY) == expected[:1]
    assert run(llm, ids, GREEDY) == expected
    assert llm.engine.get_stats()["prefix_cache_hits"] > 0


def test_mixed_batch_of_greedy_and_seeded_requests_is_unchanged(v3_mtp):
    ids = prompts(4, seed=2)
    params = [GREEDY, SamplingParams(temperature=0.8, top_p=0.9, seed=7, max_tokens=MAX_TOKENS, ignore_eos=True),
              GREEDY, SamplingParams(temperature=1.0, seed=3, max_tokens=MAX_TOKENS - 4, ignore_eos=True)]
    plain = run(LLM(str(v3_mtp.path)), ids, params)
    spec = {"method": "mtp", "num_speculative_tokens": 2, "acceptance": "exact"}
    assert run(LLM(str(v3_mtp.path), speculative_config=spec), ids, params) == plain
    # rejection sampling keeps the distribution, not the tokens: its greedy requests are still unchanged
    rejection = run(LLM(str(v3_mtp.path), speculative_config=dict(spec, acceptance="rejection")), ids, params)
    assert [rejection[0], rejection[2]] == [plain[0], plain[2]]
    assert [len(out) for out in rejection] == [len(out) for out in plain]


@pytest.mark.parametrize("chunk", [None, 8])
def test_first_draft_is_the_checkpoints_mtp_module(v3_random, chunk):
    """The draft after a prompt's prefill: argmax of the MTP module at the prompt's last position (the target's
    hidden state there, the first sampled token), confidence its softmax probability, in plain torch; also when
    the prompt is prefilled in chunks of 8 (the MTP KV of each chunk's last position reads the next chunk's
    first token)."""
    kwargs = {} if chunk is None else {"max_num_batched_tokens": chunk}
    llm = LLM(str(v3_random.path), speculative_config={"method": "mtp", "num_speculative_tokens": 1}, **kwargs)
    received = []
    original = llm.engine.drafter.receive
    llm.engine.drafter.receive = lambda request, ids, conf: (
        received.append((list(request.all_token_ids), ids, conf)), original(request, ids, conf))
    prompt = torch.randint(0, 256, (24,), generator=torch.Generator().manual_seed(5)).tolist()
    run(llm, [prompt], SamplingParams(temperature=0, max_tokens=2, ignore_eos=True))
    tokens, ids, conf = received[0]
    assert tokens[:len(prompt)] == prompt and len(tokens) == len(prompt) + 1 and len(prompt) > 16
    with torch.no_grad():
        hidden = v3_random.hf.model(torch.tensor([prompt])).last_hidden_state[0]
    logits = _mtp_reference(v3_random, hidden, torch.tensor(tokens[1:]))[-1]
    probs = logits.softmax(-1)
    assert ids == [int(probs.argmax())]
    assert conf == pytest.approx([float(probs.max())], rel=1e-4)


def test_v32_greedy_with_mtp_equals_greedy_without(tmp_path):
    """V3.2: the MTP block's attention is indexed sparse MLA (top 8 tokens of up to 40), its indexer keys in the
    MTP layer's own pages; prompts of up to 29 tokens, chunked prefill of 8 tokens."""
    ckpt = write_predictive_mtp(tmp_path, transformers.DeepseekV32ForCausalLM, v32_config)
    ids = prompts(4, seed=3)
    expected = run(LLM(str(ckpt.path), enable_prefix_caching=False), ids, GREEDY)
    spec = {"method": "mtp", "num_speculative_tokens": 2}
    for kwargs in ({}, {"max_num_batched_tokens": 8}):
        llm = LLM(str(ckpt.path), speculative_config=spec, enable_prefix_caching=False, **kwargs)
        assert run(llm, ids, GREEDY) == expected
        assert llm.engine.get_stats()["spec_decode"]["num_accepted_tokens"] > 0


def test_mp_worker_drafts_with_mtp(v3_mtp, baseline):
    ids, expected = baseline
    llm = LLM(str(v3_mtp.path), speculative_config={"method": "mtp", "num_speculative_tokens": 2},
              distributed_executor_backend="mp", enable_prefix_caching=False)
    try:
        assert run(llm, ids[:3], GREEDY) == expected[:3]
        assert llm.engine.get_stats()["spec_decode"]["num_accepted_tokens"] > 0
    finally:
        llm.engine.shutdown()


def test_mtp_on_a_checkpoint_without_mtp_layers_names_the_field(v3_mtp, tmp_path):
    cfg = json.loads((v3_mtp.path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps(dict(cfg, num_nextn_predict_layers=0)))
    (tmp_path / "model.safetensors").symlink_to(v3_mtp.path / "model.safetensors")
    with pytest.raises(ValueError, match="speculative_config.method='mtp'.*num_nextn_predict_layers"):
        LLM(str(tmp_path), speculative_config={"method": "mtp", "num_speculative_tokens": 1})
