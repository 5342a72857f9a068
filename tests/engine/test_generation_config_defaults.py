"""The default sampling values from generation_config.json, one rule for the offline LLM and the server
(``generation_config_sampling_defaults``, resolved by EngineArgs into ``ModelConfig.sampling_defaults``), and
EngineArgs' ``generation_config`` / ``override_generation_config`` (vLLM's --generation-config and
--override-generation-config)."""

from __future__ import annotations

import json
import shutil

import pytest

from dsinfer.engine.arg_utils import EngineArgs
from dsinfer.engine.sampling_params import SamplingParams, generation_config_sampling_defaults

FILE = {"temperature": 0.6, "top_k": 1, "max_new_tokens": 5}


def test_only_values_unlike_transformers_defaults_are_taken():
    config = {"temperature": 0.6, "top_p": 1.0, "top_k": 50, "min_p": None, "repetition_penalty": 1.1,
              "max_new_tokens": 7, "do_sample": True, "eos_token_id": 2, "presence_penalty": 0.5}
    assert generation_config_sampling_defaults(config) == {"temperature": 0.6, "repetition_penalty": 1.1,
                                                           "max_tokens": 7}
    assert generation_config_sampling_defaults({"top_k": 20, "min_p": 0.05, "top_p": 0.9, "temperature": 1}) == {
        "top_k": 20, "min_p": 0.05, "top_p": 0.9}
    assert generation_config_sampling_defaults({"bos_token_id": 1, "eos_token_id": 2}) == {}


def test_overrides_apply_after_the_comparison():
    config = {"temperature": 0.6, "top_p": 0.9}
    # a transformers default given as an override counts; None drops the file's value; other keys are ignored
    got = generation_config_sampling_defaults(config, {"top_k": 50, "top_p": None, "max_new_tokens": 3,
                                                       "eos_token_id": 9, "seed": 1})
    assert got == {"temperature": 0.6, "top_k": 50, "max_tokens": 3}
    assert config == {"temperature": 0.6, "top_p": 0.9}  # not changed in place


@pytest.fixture()
def model_dir(tiny_llama_dir, tmp_path):
    model = tmp_path / "model"
    shutil.copytree(tiny_llama_dir, model)
    config = json.loads((model / "generation_config.json").read_text())
    (model / "generation_config.json").write_text(json.dumps({**config, **FILE}))
    return model


def _model_config(model, **kwargs):
    return EngineArgs(model=str(model), device="cpu", **kwargs).create_engine_config().model


def test_auto_takes_the_models_file_as_defaults_only(model_dir):
    config = _model_config(model_dir)
    assert config.sampling_defaults == {"temperature": 0.6, "top_k": 1, "max_tokens": 5}
    assert config.max_tokens_limit is None  # the model's max_new_tokens is no ceiling
    config = _model_config(model_dir, override_generation_config={"temperature": 0.2, "max_new_tokens": 8})
    assert config.sampling_defaults == {"temperature": 0.2, "top_k": 1, "max_tokens": 8}
    assert config.max_tokens_limit == 8  # an override's is


def test_vllm_ignores_the_models_file(model_dir):
    config = _model_config(model_dir, generation_config="vllm")
    assert (config.sampling_defaults, config.max_tokens_limit) == ({}, None)
    assert config.eos_token_ids  # the file still gives the stop tokens
    config = _model_config(model_dir, generation_config="vllm", override_generation_config={"top_p": 0.5})
    assert (config.sampling_defaults, config.max_tokens_limit) == ({"top_p": 0.5}, None)


def test_a_folder_replaces_the_models_file_and_caps_max_tokens(model_dir, tmp_path):
    folder = tmp_path / "recommended"
    folder.mkdir()
    (folder / "generation_config.json").write_text(json.dumps({"top_p": 0.8, "max_new_tokens": 9}))
    config = _model_config(model_dir, generation_config=str(folder))
    assert (config.sampling_defaults, config.max_tokens_limit) == ({"top_p": 0.8, "max_tokens": 9}, 9)
    assert config.generation_config["top_k"] == 1  # the model's own file is still read (its eos_token_id)


def test_bad_generation_configs_fail_at_startup(model_dir, tmp_path):
    with pytest.raises(ValueError, match="holds none"):
        _model_config(model_dir, generation_config=str(tmp_path / "missing"))
    with pytest.raises(ValueError, match="override_generation_config must be a dict"):
        _model_config(model_dir, override_generation_config='{"temperature": 0.5}')
    with pytest.raises(ValueError, match="temperature"):
        _model_config(model_dir, override_generation_config={"temperature": -1.0})
    with pytest.raises(ValueError, match="max_tokens"):
        _model_config(model_dir, override_generation_config={"max_new_tokens": 0})
    (model_dir / "generation_config.json").write_text(json.dumps({"top_p": 0.0}))
    with pytest.raises(ValueError, match="generation_config.json.*top_p"):
        _model_config(model_dir)
    _model_config(model_dir, generation_config="vllm")  # not read for sampling then


def test_llm_defaults_follow_the_engine_arguments(model_dir):
    from dsinfer import LLM

    llm = LLM(str(model_dir), generation_config="vllm", override_generation_config={"top_k": 50,
                                                                                   "max_new_tokens": 2})
    assert llm.get_default_sampling_params() == SamplingParams(top_k=50, max_tokens=2)
    (out,) = llm.generate({"prompt_token_ids": [5, 6, 7]}, use_tqdm=False)
    assert len(out.outputs[0].token_ids) <= 2
