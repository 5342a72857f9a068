"""MTP drafting on a tiny DeepSeek-V4 (every attention kind, 2 hyper-connection streams: ``v4_fixture``) with one
MTP layer, in fp32 on CPU.

transformers' V4 has no MTP forward (it drops the ``mtp.*`` tensors on load), so the reference is a hand-run of
its modules in the order DeepSeek's ``MTPBlock`` runs them: a 5-layer transformers V4 whose first 4 layers are
the target and whose layer 4 (sliding attention, top-k MoE, as the published checkpoint's MTP layer) is the MTP
block, fed through a pre-hook with ``e_proj(enorm(embed(t_{i+1}))) + h_proj(hnorm(H_i))`` (H: layer 3's streams),
its streams collapsed by a transformers ``DeepseekV4HyperHead`` holding the MTP layer's ``hc_head`` weights, its
``norm`` and the shared ``lm_head``.
"""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from dsinfer import LLM, SamplingParams
from tests.models.hf_reference import record_preemptions
from tests.models.v4_fixture import LAYER_TYPES, randomize, v4_config

transformers = pytest.importorskip("transformers")

HIDDEN, HC = 32, 2
SLIDING, CSA = "sliding_attention", "compressed_sparse_attention"
GREEDY = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)


class _Ckpt:
    def __init__(self, path, hf5, extras):
        self.path, self.hf5, self.extras = path, hf5, extras


def _donor(seed: int, mtp_kind: str = SLIDING):
    """The 5-layer transformers V4: layers 0-3 the target, layer 4 (of ``mtp_kind``) the MTP block."""
    torch.manual_seed(seed)
    cfg = v4_config(transformers, num_hidden_layers=5, layer_types=LAYER_TYPES + [mtp_kind],
                    mlp_layer_types=["hash_moe", "moe", "moe", "moe", "moe"])
    hf5 = transformers.DeepseekV4ForCausalLM(cfg).eval()
    randomize(hf5, seed)
    return hf5


def _extras(seed: int) -> dict[str, torch.Tensor]:
    """The MTP layer's own tensors beside its block, at unit scale (published names)."""
    gen = torch.Generator().manual_seed(seed)
    return {"mtp.0.e_proj.weight": torch.randn(HIDDEN, HIDDEN, generator=gen) / HIDDEN ** 0.5,
            "mtp.0.h_proj.weight": torch.randn(HIDDEN, HIDDEN, generator=gen) / HIDDEN ** 0.5,
            "mtp.0.enorm.weight": 1 + 0.2 * torch.randn(HIDDEN, generator=gen),
            "mtp.0.hnorm.weight": 1 + 0.2 * torch.randn(HIDDEN, generator=gen),
            "mtp.0.norm.weight": 1 + 0.2 * torch.randn(HIDDEN, generator=gen),
            "mtp.0.hc_head_fn": torch.randn(HC, HC * HIDDEN, generator=gen) / (HC * HIDDEN) ** 0.5,
            "mtp.0.hc_head_base": 0.5 * torch.randn(HC, generator=gen),
            "mtp.0.hc_head_scale": 1 + 0.3 * torch.randn(1, generator=gen)}


def write_v4_mtp(path, hf5, extras: dict[str, torch.Tensor]) -> _Ckpt:
    """The target (layers 0-3 of ``hf5``) as transformers saves it, config ``num_nextn_predict_layers=1``, and the
    MTP layer's tensors under ``mtp.0.``: layer 4 of ``hf5`` as saved, and ``extras``. A compressed MTP layer is
    named by a fifth ``layer_types`` entry (as the published ``compress_ratios`` lists it); a sliding one is the
    default, unnamed."""
    hf5.save_pretrained(path / "donor")
    donor = load_file(path / "donor" / "model.safetensors")
    tensors = {k: v for k, v in donor.items() if not k.startswith("model.layers.4.")}
    tensors |= {"mtp.0." + k.removeprefix("model.layers.4."): v for k, v in donor.items()
                if k.startswith("model.layers.4.")}
    tensors |= extras
    cfg = json.loads((path / "donor" / "config.json").read_text())
    kind = cfg["layer_types"][4]
    cfg |= {"num_hidden_layers": 4, "layer_types": LAYER_TYPES + ([kind] if kind != SLIDING else []),
            "mlp_layer_types": cfg["mlp_layer_types"][:4], "num_nextn_predict_layers": 1}
    (path / "config.json").write_text(json.dumps(cfg))
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    return _Ckpt(path, hf5, extras)


@pytest.fixture(scope="module")
def v4_random(tmp_path_factory) -> _Ckpt:
    return write_v4_mtp(tmp_path_factory.mktemp("deepseek-v4-mtp"), _donor(0), _extras(3))


@pytest.fixture(scope="module")
def v4_csa_mtp(tmp_path_factory) -> _Ckpt:
    """The MTP layer a CSA one (rate 4, the indexer's top-3): its compressed entries and indexer keys paged in the
    request's blocks, its compressors' rows in its state slot."""
    return write_v4_mtp(tmp_path_factory.mktemp("deepseek-v4-csa-mtp"), _donor(2, CSA), _extras(5))


def _rms(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    norm = transformers.models.deepseek_v4.modeling_deepseek_v4.DeepseekV4RMSNorm(x.shape[-1], 1e-6)
    norm.weight.data.copy_(weight)
    return norm(x)


def hand_run_mtp(ckpt: _Ckpt, input_ids: list[int], next_ids: list[int], chained: int = 0) -> torch.Tensor:
    """MTP logits [N, vocab] of each position of ``input_ids`` (N tokens) whose next token is ``next_ids``; the
    last ``chained`` positions take the MTP layer's own streams of the position before them instead of the
    target's (a chained draft)."""
    hf5, ex = ckpt.hf5, ckpt.extras
    layers = hf5.model.layers
    captured = {}
    hooks = [layers[3].register_forward_hook(lambda m, a, out: captured.__setitem__("target", out)),
             layers[4].register_forward_hook(lambda m, a, out: captured.__setitem__("mtp", out))]
    embed = hf5.model.embed_tokens(torch.tensor([next_ids]))
    e = torch.nn.functional.linear(_rms(embed, ex["mtp.0.enorm.weight"]), ex["mtp.0.e_proj.weight"])

    def mtp_input(hidden: torch.Tensor) -> torch.Tensor:
        h = torch.nn.functional.linear(_rms(hidden, ex["mtp.0.hnorm.weight"]), ex["mtp.0.h_proj.weight"])
        return e.unsqueeze(2) + h

    streams = None
    try:
        with torch.no_grad():
            for _ in range(chained + 1):  # each pass fixes one more chained position's input
                def pre(module, args, kwargs, streams=streams):
                    hidden = captured["target"].clone()
                    if streams is not None and chained:
                        hidden[:, -chained:] = streams[:, -chained - 1:-1]
                    return (mtp_input(hidden),), kwargs | {"input_ids": torch.tensor([next_ids])}

                handle = layers[4].register_forward_pre_hook(pre, with_kwargs=True)
                try:
                    hf5(torch.tensor([input_ids]), use_cache=False)
                finally:
                    handle.remove()
                streams = captured["mtp"]
            head = transformers.models.deepseek_v4.modeling_deepseek_v4.DeepseekV4HyperHead(hf5.config)
            head.hc_fn.data.copy_(ex["mtp.0.hc_head_fn"])
            head.hc_base.data.copy_(ex["mtp.0.hc_head_base"])
            head.hc_scale.data.copy_(ex["mtp.0.hc_head_scale"])
            return hf5.lm_head(_rms(head(streams), ex["mtp.0.norm.weight"]))[0]
    finally:
        for hook in hooks:
            hook.remove()


def _prompt(n: int, seed: int) -> list[int]:
    return torch.randint(2, 128, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.mark.parametrize("fixture", ["v4_random", "v4_csa_mtp"])
def test_mtp_logits_equal_a_hand_run_of_transformers_modules(fixture, request):
    """A 30-token prompt (past the window, several CSA / HCA windows) in one prefill: the MTP layer's logits at
    every position (next token: the prompt's next, then the first sampled token) equal the hand-run's; the first
    two drafts (k = 2: the second chains the MTP layer on its own streams at the next position) are the
    hand-run's argmaxes, with its probabilities as confidences. The MTP layer sliding (as published) or CSA."""
    v4_random = request.getfixturevalue(fixture)
    llm = LLM(str(v4_random.path), speculative_config={"method": "mtp", "num_speculative_tokens": 2})
    layer = llm.engine.executor.runner.model.mtp.layers[0]
    assert layer.attn.kind == (CSA if fixture == "v4_csa_mtp" else SLIDING)
    logits = []
    layer.register_forward_hook(lambda m, a, out: logits.append(layer.shared_head(out)))
    received = []
    original = llm.engine.drafter.receive
    llm.engine.drafter.receive = lambda request, ids, conf: (received.append((ids, conf)),
                                                             original(request, ids, conf))
    prompt = _prompt(30, 5)
    out = llm.generate([{"prompt_token_ids": prompt}], SamplingParams(temperature=0, max_tokens=2, ignore_eos=True),
                       use_tqdm=False)
    first = out[0].outputs[0].token_ids[0]
    want = hand_run_mtp(v4_random, prompt, prompt[1:] + [first])
    torch.testing.assert_close(logits[0], want, rtol=1e-4, atol=1e-4)
    ids, conf = received[0]
    probs = want[-1].softmax(-1)
    assert ids[0] == int(probs.argmax()) and conf[0] == pytest.approx(float(probs.max()), rel=1e-4)
    chained = hand_run_mtp(v4_random, prompt + [first], prompt[1:] + [first, ids[0]], chained=1)[-1].softmax(-1)
    assert ids[1] == int(chained.argmax()) and conf[1] == pytest.approx(float(chained.max()), rel=1e-4)


def _prompts() -> list[list[int]]:
    return [_prompt(n, 10 + n) for n in (3, 9, 17, 26, 40)]


def _run(llm: LLM, prompts: list[list[int]]) -> list[list[int]]:
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]


def test_greedy_with_mtp_equals_greedy_without(v4_random):
    """Five prompts of 3 to 40 tokens in one batch, k = 2; then in 16-token prefill chunks beside decodes; then
    in 7 blocks of 16 tokens, where requests are preempted (state slot and blocks freed, MTP ring included) and
    recomputed."""
    prompts = _prompts()
    expected = _run(LLM(str(v4_random.path)), prompts)
    spec = {"method": "mtp", "num_speculative_tokens": 2}
    batched = LLM(str(v4_random.path), speculative_config=spec)
    assert _run(batched, prompts) == expected
    assert batched.engine.get_stats()["spec_decode"]["num_draft_tokens"] > 0
    chunked = LLM(str(v4_random.path), speculative_config=spec, max_num_batched_tokens=16, max_num_seqs=4)
    assert _run(chunked, prompts) == expected
    tight = LLM(str(v4_random.path), speculative_config=spec, block_size=16, num_kv_blocks=7)
    preempted = record_preemptions(tight)
    assert _run(tight, prompts) == expected
    assert preempted, "the KV cache was large enough: nothing was preempted"


def test_greedy_with_a_csa_mtp_layer_equals_greedy_without(v4_csa_mtp):
    """A compressed MTP layer (entries in the request's blocks), k = 3: a batch, then 16-token prefill chunks."""
    prompts = _prompts()
    expected = _run(LLM(str(v4_csa_mtp.path)), prompts)
    spec = {"method": "mtp", "num_speculative_tokens": 3}
    assert _run(LLM(str(v4_csa_mtp.path), speculative_config=spec), prompts) == expected
    chunked = LLM(str(v4_csa_mtp.path), speculative_config=spec, max_num_batched_tokens=16, max_num_seqs=4)
    assert _run(chunked, prompts) == expected


def test_greedy_with_mtp_across_prefix_hits_equals_greedy_without(v4_csa_mtp):
    """16-token blocks: a second turn hits the first turn's blocks (the target's state slot restored from the
    last; the MTP layer's compressed entries in those blocks, its rings not restored) and its greedy tokens are
    those of a cold run without MTP."""
    turn1 = _prompt(40, 3)
    cold = LLM(str(v4_csa_mtp.path), block_size=16, enable_prefix_caching=False)
    llm = LLM(str(v4_csa_mtp.path), block_size=16, speculative_config={"method": "mtp", "num_speculative_tokens": 2})
    first = _run(llm, [turn1])[0]
    assert first == _run(cold, [turn1])[0]
    turn2 = turn1 + first + _prompt(7, 4)
    out = llm.generate([{"prompt_token_ids": turn2}], GREEDY, use_tqdm=False)[0]
    assert out.num_cached_tokens == 48 and list(out.outputs[0].token_ids) == _run(cold, [turn2])[0]


@pytest.fixture(scope="module")
def v4_predictive(tmp_path_factory) -> _Ckpt:
    """Every block's output projections zeroed (attention wo_b, experts' and shared expert's w2): a block adds
    nothing and the doubly-stochastic stream mixing keeps equal streams equal, so the target's next token is a
    function of its current one, f(t) = argmax head(norm(embed(t))) (the norms undo every scale). The MTP layer's
    block zeroed the same way, h_proj 0, e_proj the identity, enorm's weight 1 and its norm the model's: it
    predicts f(t_{i+1}), which is what the target says next, so its drafts are kept."""
    hf5 = _donor(1)
    with torch.no_grad():
        for name, param in hf5.named_parameters():
            if name.endswith(("o_b_proj.weight", "experts.down_proj", "shared_experts.down_proj.weight")):
                param.zero_()
    extras = _extras(4)
    extras["mtp.0.h_proj.weight"] = torch.zeros(HIDDEN, HIDDEN)
    extras["mtp.0.e_proj.weight"] = torch.eye(HIDDEN)
    extras["mtp.0.enorm.weight"] = torch.ones(HIDDEN)
    extras["mtp.0.norm.weight"] = hf5.model.norm.weight.detach().clone()
    return write_v4_mtp(tmp_path_factory.mktemp("deepseek-v4-mtp-predictive"), hf5, extras)


def test_drafts_that_agree_with_the_target_are_accepted(v4_predictive):
    """k = 3: nearly every draft is kept, at every depth (the chained ones too), and the output is unchanged."""
    prompts = _prompts()
    expected = _run(LLM(str(v4_predictive.path)), prompts)
    llm = LLM(str(v4_predictive.path), speculative_config={"method": "mtp", "num_speculative_tokens": 3})
    assert _run(llm, prompts) == expected
    stats = llm.engine.get_stats()["spec_decode"]
    assert stats["num_draft_tokens"] > 20
    assert stats["num_accepted_tokens"] >= 0.9 * stats["num_draft_tokens"]
    assert min(stats["accepted_per_position"]) > 0
