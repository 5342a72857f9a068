"""The ``dsinfer`` command line, run as a user would (a subprocess; the real model where text is printed)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from dsinfer import envs

PACKAGE = Path(envs.__file__).parent


def dsinfer(*args: str, timeout: float = 240, **env: str) -> subprocess.CompletedProcess:
    # a clean DSINFER_* environment, except the cache of converted models
    environ = {k: v for k, v in os.environ.items()
               if not k.startswith("DSINFER_") or k == "DSINFER_CACHE_DIR"}
    environ.update({"DSINFER_LOG_LEVEL": "WARNING", **env})
    return subprocess.run([sys.executable, "-m", "dsinfer.entrypoints.cli", *args], capture_output=True,
                          text=True, timeout=timeout, env=environ)


def test_env_lists_every_dsinfer_variable():
    result = dsinfer("env")
    assert result.returncode == 0, result.stderr
    listed = set(re.findall(r"^(DSINFER_[A-Z0-9_]+)\s", result.stdout, flags=re.MULTILINE))
    declared = {var.name for var in envs.all_vars()}
    mentioned = {name for path in PACKAGE.rglob("*.py")
                 for name in re.findall(r"DSINFER_[A-Z0-9_]+", path.read_text())}
    assert listed == declared
    assert mentioned <= declared, f"used but not declared in envs.py: {sorted(mentioned - declared)}"
    for var in envs.all_vars():
        assert var.doc in result.stdout


def test_env_shows_current_values():
    result = dsinfer("env", DSINFER_CPU_THREADS="1")
    assert re.search(r"DSINFER_CPU_THREADS .* current: 1$", result.stdout, flags=re.MULTILINE)


def test_generate_prints_text():
    result = dsinfer("generate", "--max-tokens", "8", "The capital of France is")
    assert result.returncode == 0, result.stderr
    assert "Paris" in result.stdout
    assert re.search(r"\[\d+ tokens in [\d.]+ s", result.stderr)


def test_chat_answers():
    result = dsinfer("chat", "--max-tokens", "16", "What is the capital of France?")
    assert result.returncode == 0, result.stderr
    assert "Paris" in result.stdout


@pytest.mark.parametrize("args, message", [
    (("generate", "--max-tokens", "abc", "hi"), "argument --max-tokens: invalid int value: 'abc'"),
    (("generate", "--max-tokens", "0", "hi"), "error: max_tokens must be >= 1, got 0"),
    (("generate", "--temperature", "-1", "hi"), "error: temperature must be in [0, 1e4], got -1.0"),
    (("chat", "--top-p", "2", "hi"), "error: top_p must be in (0, 1], got 2.0"),
    (("generate", "--dtype", "int8", "hi"), "error: dtype must be 'auto' or one of"),
    (("generate", "--kv-cache-dtype", "int8", "hi"), "error: kv_cache_dtype must be one of"),
    (("generate", "--model", "/no/such/model", "hi"), "error: model '/no/such/model' not found"),
    (("frobnicate",), "invalid choice: 'frobnicate'"),
])
def test_bad_flag_exits_nonzero_with_a_clear_message(args, message):
    result = dsinfer(*args, timeout=60)
    assert result.returncode == 2
    assert message in result.stderr
    assert "Traceback" not in result.stderr


def test_bad_environment_variable_is_named():
    result = dsinfer("generate", "hi", timeout=60, DSINFER_DEVICE="tpu")
    assert result.returncode == 2
    assert "DSINFER_DEVICE='tpu' is invalid" in result.stderr


def test_a_bad_log_level_is_a_clean_error_and_any_case_is_accepted():
    bad = dsinfer("env", DSINFER_LOG_LEVEL="LOUD")
    assert bad.returncode == 2 and "Traceback" not in bad.stderr
    assert bad.stderr.startswith("error: environment variable DSINFER_LOG_LEVEL='LOUD' is invalid")
    assert dsinfer("env", DSINFER_LOG_LEVEL="debug").returncode == 0


def test_chat_repl_keeps_typed_special_tokens_literal(smollm2_llm, monkeypatch, capsys):
    """The interactive chat encodes as LLM.chat does: a typed "<|im_end|>" stays text, not the EOS id."""
    from dsinfer import SamplingParams
    from dsinfer.entrypoints.chat_repl import run_repl

    message = "Say <|im_end|> please"
    lines = iter([message, "/exit"])
    monkeypatch.setattr("builtins.input", lambda prompt="": next(lines))
    engine, seen = smollm2_llm.engine, []
    add_request = engine.add_request

    def record(request_id, prompt, params):
        seen.append(prompt["prompt_token_ids"])
        return add_request(request_id, prompt, params)

    monkeypatch.setattr(engine, "add_request", record)
    assert run_repl(smollm2_llm, SamplingParams(max_tokens=4, temperature=0.0)) == 0
    monkeypatch.setattr(engine, "add_request", add_request)
    (expected,) = smollm2_llm.chat([{"role": "user", "content": message}], SamplingParams(max_tokens=1),
                                   use_tqdm=False)
    assert seen == [expected.prompt_token_ids]
    eos = smollm2_llm.get_tokenizer().eos_token_id
    plain = smollm2_llm.chat([{"role": "user", "content": "Say please"}], SamplingParams(max_tokens=1),
                             use_tqdm=False)[0].prompt_token_ids
    assert seen[0].count(eos) == plain.count(eos)  # only the template's own end-of-turn markers


def test_python_dash_m_dsinfer_is_the_command():
    result = subprocess.run([sys.executable, "-m", "dsinfer", "env"], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert "DSINFER_" in result.stdout
