"""speculative_config, vLLM's names: validated offline (a ValueError naming the field) and by ``dsinfer serve``
(exit 2, ``error: --speculative-config ...``) before any weights load."""

from __future__ import annotations

import argparse
import json

import pytest

from dsinfer.config import SpeculativeConfig
from dsinfer.engine.arg_utils import EngineArgs
from dsinfer.entrypoints.cli import main


@pytest.mark.parametrize(("value", "field"), [
    ({"method": "eagle", "num_speculative_tokens": 3}, "speculative_config.method"),
    ({"method": "ngram", "num_speculative_tokens": 0}, "speculative_config.num_speculative_tokens"),
    ({"method": "ngram", "num_speculative_tokens": 17}, "speculative_config.num_speculative_tokens"),
    ({"method": "ngram", "num_speculative_tokens": True}, "speculative_config.num_speculative_tokens"),
    ({"method": "ngram"}, "speculative_config.num_speculative_tokens is required"),
    ({"num_speculative_tokens": 3, "prompt_lookup_min": 5, "prompt_lookup_max": 2},
     r"speculative_config.prompt_lookup_min \(5\) must be <= prompt_lookup_max \(2\)"),
    ({"num_speculative_tokens": 3, "prompt_lookup_min": 0}, "speculative_config.prompt_lookup_min"),
    ({"num_speculative_tokens": 3, "acceptance": "lossy"}, "speculative_config.acceptance"),
    ({"num_speculative_tokens": 3, "confidence_scheduling": "yes"}, "speculative_config.confidence_scheduling"),
    ({"num_speculative_tokens": 3, "draft_model": "x"}, r"unknown key\(s\) \['draft_model'\]"),
    ("ngram", "speculative_config must be a dict"),
])
def test_bad_speculative_config_names_the_field(tiny_llama_dir, value, field):
    with pytest.raises(ValueError, match=field):
        EngineArgs(model=str(tiny_llama_dir), speculative_config=value).create_engine_config()


def test_the_config_tree_holds_what_was_asked_and_one_lookup_bound_sets_both(tiny_llama_dir):
    config = EngineArgs(model=str(tiny_llama_dir), speculative_config={
        "method": "ngram", "num_speculative_tokens": 5, "prompt_lookup_max": 3, "acceptance": "rejection",
        "confidence_scheduling": True}).create_engine_config()
    assert config.speculative == SpeculativeConfig(5, "ngram", 3, 3, "rejection", True)
    assert SpeculativeConfig.from_dict({"num_speculative_tokens": 2, "prompt_lookup_min": 6}).prompt_lookup_max == 6
    assert not EngineArgs(model=str(tiny_llama_dir)).create_engine_config().speculative.enabled
    assert SpeculativeConfig.from_dict({}) == SpeculativeConfig()


def test_mtp_needs_mtp_layers(tiny_llama_dir, tiny_deepseek_dir):
    mtp = {"method": "mtp", "num_speculative_tokens": 1}
    with pytest.raises(ValueError, match=r"speculative_config.method='mtp' needs a checkpoint with MTP layers "
                                         r"\(num_nextn_predict_layers >= 1\)"):
        EngineArgs(model=str(tiny_llama_dir), speculative_config=mtp).create_engine_config()
    # a checkpoint with an MTP layer passes that check (tests/spec_decode/test_mtp.py drafts with it)
    args = EngineArgs(model=str(tiny_deepseek_dir), speculative_config=mtp,
                      hf_overrides={"num_nextn_predict_layers": 1})
    assert args.create_engine_config().speculative.method == "mtp"


@pytest.mark.parametrize(("value", "message"), [
    ({"method": "eagle", "num_speculative_tokens": 3}, "speculative_config.method must be one of"),
    ({"num_speculative_tokens": 99}, "speculative_config.num_speculative_tokens must be an integer in"),
    ({"num_speculative_tokens": 2, "prompt_lookup_min": 4, "prompt_lookup_max": 3}, "prompt_lookup_min"),
])
def test_serve_exits_2_naming_the_flag(capsys, value, message):
    pytest.importorskip("fastapi")
    assert main(["serve", "--speculative-config", json.dumps(value), "--port", "1"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: --speculative-config {") and message in err


def test_serve_refuses_mtp_for_a_checkpoint_without_mtp_layers(capsys, tiny_llama_dir):
    pytest.importorskip("fastapi")
    from dsinfer.server.cli import add_serve_args, build_engine

    args = add_serve_args(argparse.ArgumentParser()).parse_args(
        [str(tiny_llama_dir), "--speculative-config", '{"method": "mtp", "num_speculative_tokens": 2}'])
    args.model_flag = None
    with pytest.raises(ValueError, match=r"^--speculative-config \{.*needs a checkpoint with MTP layers"):
        build_engine(args)
