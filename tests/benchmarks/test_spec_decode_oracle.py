"""``benchmarks/spec_decode_oracle.py``: the oracle drafter proposes a reference corrupted to a rate (through
``spec_decode.register_drafter``), and a tiny run of both parts completes with greedy outputs unchanged."""

from __future__ import annotations

import pytest

from benchmarks.spec_decode_oracle import OracleBook, OracleDrafter, engine_kwargs, install, main, parse_args
from dsinfer import LLM
from dsinfer.config import SpeculativeConfig
from dsinfer.core.plan import RequestSampling
from dsinfer.core.request import Request
from dsinfer.spec_decode import make_drafter, register_drafter


def _request(prompt, outputs=()):
    sampling = RequestSampling(temperature=0.0, top_k=-1, top_p=1.0, min_p=0.0, seed=0)
    request = Request("r", list(prompt), params=None, seed=0, max_tokens=32, sampling=sampling)
    for token in outputs:
        request.append_token(token)
    return request


def test_the_oracle_proposes_the_reference_corrupted_to_the_rate():
    key = (1, 2, 3)
    reference = [(10 + p) % 100 for p in range(2000)]
    book = OracleBook(vocab_size=100, rates={key: 1.0})
    book.learn(list(key), reference)
    drafter = OracleDrafter(book, k=3)
    assert drafter.propose(_request(key, [10, 11]), 3).token_ids == [12, 13, 14]
    assert drafter.propose(_request(key), 4).token_ids == [10, 11, 12, 13]  # k + 1: one ahead
    assert drafter.propose(_request((9,)), 3).token_ids == []  # no reference: no draft
    assert drafter.propose(_request(key, [10, 99]), 3).token_ids == []  # off every known path: no draft
    book.rates[key] = 0.3
    drafts = [book.draft(key, p, tuple([*key, *reference][p - 1:p + 3]), 1) for p in range(1, 2000)]
    right = [d == [reference[p]] for p, d in zip(range(1, 2000), drafts)]
    assert 0.25 < sum(right) / len(right) < 0.35
    assert drafts[:50] == [book.draft(key, p, tuple([*key, *reference][p - 1:p + 3]), 1) for p in range(1, 51)]
    assert all(len(d) == 1 and 0 <= d[0] < 100 for d in drafts)


def test_the_oracle_follows_a_branch_an_earlier_run_took():
    """A run that decided a near-tie otherwise left the reference at position 2: once learned, that branch is
    proposed after its own tokens, and the reference still after the reference's."""
    key = (1, 2, 3)
    reference, branch = [10, 11, 12, 13, 14, 15], [10, 11, 50, 51, 52, 53]
    book = OracleBook(vocab_size=100, rates={key: 1.0})
    book.learn(list(key), reference)
    drafter = OracleDrafter(book, k=3)
    assert drafter.propose(_request(key, [10, 11, 50]), 3).token_ids == []
    book.learn(list(key), branch)
    assert drafter.propose(_request(key, [10, 11, 50]), 3).token_ids == [51, 52, 53]
    assert drafter.propose(_request(key, [10, 11, 12]), 3).token_ids == [13, 14, 15]
    assert drafter.propose(_request(key, [10, 11]), 3).token_ids == [50, 51, 52]  # the latest run's choice


def test_a_registered_drafter_is_the_methods_drafter_and_builtins_are_refused(tiny_llama_dir):
    made = []
    register_drafter("test-registered", lambda config: made.append(config) or OracleDrafter(OracleBook(10), 2))
    assert SpeculativeConfig.from_dict({"method": "test-registered", "num_speculative_tokens": 2}).enabled
    llm = LLM(str(tiny_llama_dir), num_kv_blocks=32, speculative_config={"method": "test-registered",
                                                                         "num_speculative_tokens": 2})
    assert isinstance(llm.engine.drafter, OracleDrafter) and made[0] is llm.engine.config
    assert isinstance(make_drafter(llm.engine.config), OracleDrafter)
    with pytest.raises(ValueError, match="built-in"):
        register_drafter("ngram", lambda config: None)
    with pytest.raises(ValueError, match="speculative_config.method must be one of"):
        SpeculativeConfig.from_dict({"method": "never-registered", "num_speculative_tokens": 2})


def test_both_parts_run_and_keep_greedy_outputs(tiny_llama_dir, tmp_path):
    import json

    out = tmp_path / "oracle.json"
    assert main(["--model", str(tiny_llama_dir), "--batch-sizes", "1", "2", "--input-len", "8", "--output-len",
                 "12", "--step-latency-dir", str(tmp_path), "--json-out", str(out)]) == 0
    result = json.loads(out.read_text())
    for part, names in (("speedup", ("off", "on")), ("confidence", ("off", "on", "confidence"))):
        assert [row["batch"] for row in result[part]] == [1, 2]
        for row in result[part]:
            assert all(row[name]["identical"] and row[name]["tok_s"] > 0 for name in names)
            assert row["on"]["num_draft_tokens"] > 0 and row["on"]["num_accepted_tokens"] > 0
    install(OracleBook(10))  # the benchmark's registration is repeatable


def test_profile_steps_reports_the_steps_and_the_hosts_functions(tiny_llama_dir, tmp_path, capsys):
    """``--profile-steps`` (the GPU run's first measurement) runs on CPU too: no device part, the host's part."""
    assert main(["--model", str(tiny_llama_dir), "--part", "speedup", "--batch-sizes", "2", "--input-len", "8",
                 "--output-len", "8", "--step-latency-dir", str(tmp_path), "--profile-steps", "3"]) == 0
    out = capsys.readouterr().out
    for name in ("off", "on"):
        assert f"profile, batch 2, {name}: wall " in out
    assert "GPU busy 0.00 ms/step" in out and "ncalls  tottime" in out


def test_the_cuda_engines_take_a_fixed_kv_budget_and_valid_engine_args():
    from dsinfer.engine.arg_utils import EngineArgs

    args = parse_args(["--device", "cuda", "--dtype", "bfloat16", "--load-format", "dummy", "--model",
                       "benchmarks/configs/llama-3.1-8b", "--part", "confidence", "--batch-sizes", "16", "64", "128"])
    kwargs = engine_kwargs(args, {"method": "oracle", "num_speculative_tokens": 3, "confidence_scheduling": True})
    assert kwargs["kv_cache_memory_gb"] == 8.0 and kwargs["max_num_seqs"] == 128
    assert kwargs["max_prefill_graph_tokens"] == 0 and kwargs["load_format"] == "dummy"
    EngineArgs(**kwargs)._validate()
