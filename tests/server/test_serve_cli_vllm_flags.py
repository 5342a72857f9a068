"""`vllm serve` command lines given to `dsinfer serve`: accepted with vLLM's meaning, or refused (exit 2, the flag and
the reason). Parser-level except for one live server (CORS and --root-path change what the HTTP server answers)."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from types import SimpleNamespace

import httpx
import pytest

from dsinfer.server.cli import (
    _check_quantization,
    add_serve_args,
    check_serve_args,
    engine_args,
    settings_from_args,
    uvicorn_options,
    vllm_spelling,
)

from .live_server import API_KEY, REPO, start_server, stop_server

ENGINE = SimpleNamespace(model_config=SimpleNamespace())  # settings_from_args reads only the served name


def _parse(*argv: str) -> argparse.Namespace:
    args = add_serve_args(argparse.ArgumentParser()).parse_args(vllm_spelling(list(argv)))
    check_serve_args(args)
    return args


def test_model_as_a_flag_is_the_positional_model():
    assert engine_args(_parse("--model", "/m")).model == "/m"
    assert engine_args(_parse("/m", "--model", "/m")).model == "/m"
    with pytest.raises(ValueError, match="MODEL '/a' and --model '/b' disagree"):
        _parse("/a", "--model", "/b")


def test_a_typical_vllm_line_is_accepted_and_its_no_ops_change_nothing(tmp_path):
    from dsinfer.engine.arg_utils import EngineArgs

    args = _parse("--model", "/m", "-tp", "1", "--pipeline-parallel-size", "1", "-dp", "1", "--trust-remote-code",
                  "--disable-log-requests", "--disable-log-stats", "--disable-uvicorn-access-log",
                  "--disable-fastapi-docs", "--enable-auto-tool-choice", "--kv-cache-dtype", "auto",
                  "--revision", "main", "--download-dir", str(tmp_path), "--swap-space", "4", "--max-logprobs", "20",
                  "--response-role", "assistant", "--chat-template-content-format", "string")
    assert engine_args(args) == EngineArgs(model="/m")
    assert settings_from_args(args, ENGINE) == settings_from_args(_parse("/m"), ENGINE)


def test_vllm_engine_flags_reach_engine_args(tmp_path):
    args = engine_args(_parse("/m", "--no-enable-chunked-prefill", "--block-size", "32", "--tokenizer",
                              str(tmp_path), "--max-model-len", "-1", "--no-enforce-eager"))
    assert (args.enable_chunked_prefill, args.block_size, args.tokenizer) == (False, 32, str(tmp_path))
    assert (args.max_model_len, args.enforce_eager) == (None, False)  # -1: the model's own length, as vLLM


def test_underscore_spellings_are_vllms_dash_flags_and_values_are_untouched():
    assert vllm_spelling(["--max_model_len=8", "--served_model_name", "a_b", "--api-key=--k_x", "--", "--x_y"]) == [
        "--max-model-len=8", "--served-model-name", "a_b", "--api-key=--k_x", "--", "--x_y"]
    assert engine_args(_parse("/m", "--gpu_memory_utilization", "0.5")).gpu_memory_utilization == 0.5


def test_list_flags_take_several_values_as_vllm_and_can_repeat():
    args = _parse("/m", "--served-model-name", "a", "b", "--api-key", "k1", "k2", "--api-key", "k3")
    settings = settings_from_args(args, ENGINE)
    assert (settings.served_model_names, settings.api_keys) == (("a", "b"), ("k1", "k2", "k3"))


def test_a_model_swallowed_by_a_list_flag_is_an_error_not_the_bundled_model():
    with pytest.raises(ValueError, match=r"--served-model-name took 2 values \['a', '/models/x'\]"):
        _parse("--served-model-name", "a", "/models/x")


@pytest.mark.parametrize("argv, message", [
    (("-tp", "0"), "--tensor-parallel-size 0: must be >= 1"),
    (("--pipeline-parallel-size", "4"), "--pipeline-parallel-size 4: dsinfer has no pipeline parallelism"),
    (("-dp", "2"), "--data-parallel-size 2: dsinfer has no data parallelism"),
    (("--enable-log-requests",), "--enable-log-requests: dsinfer has no request log"),
    (("--kv-cache-dtype", "fp8_inc"), "--kv-cache-dtype fp8_inc: dsinfer's KV cache dtypes are auto, fp8, "),
    (("--max-logprobs", "-2"), r"--max-logprobs -2: must be >= 0, or -1 \(up to the vocabulary size\)"),
    (("--response-role", ""), "--response-role '': the role of chat answers must not be empty"),
    (("--chat-template-content-format", "openai"), "--chat-template-content-format openai"),
    (("-q", "awq"), "--quantization awq: dsinfer runs FP8 .* and does not quantize on load, except int8 / int4"),
    (("--quantization", "gguf"), "--quantization gguf: the model '/m' is not a .gguf file"),
    (("--tokenizer", "org/tok"), "--tokenizer 'org/tok': not a local directory"),
    (("--ssl-keyfile", "k.pem"), "--ssl-keyfile and --ssl-certfile: HTTPS needs both"),
    (("--swap-space", "-1"), "--swap-space -1.0: must be >= 0"),
])
def test_values_dsinfer_cannot_honour_are_refused_naming_the_flag(argv, message):
    with pytest.raises(ValueError, match=message):
        _parse("/m", *argv)


def test_tensor_parallel_size_reaches_the_engine():
    assert engine_args(_parse("/m", "-tp", "2")).tensor_parallel_size == 2
    assert engine_args(_parse("/m", "--tensor_parallel_size=4")).tensor_parallel_size == 4  # vLLM spelling
    assert engine_args(_parse("/m")).tensor_parallel_size == 1


def test_answer_flags_reach_the_engine_and_the_settings():
    args = _parse("/m", "--max-logprobs", "5", "--response-role", "bot", "--return-tokens-as-token-ids")
    assert engine_args(args).max_logprobs == 5
    settings = settings_from_args(args, ENGINE)
    assert (settings.response_role, settings.return_tokens_as_token_ids) == ("bot", True)
    assert engine_args(_parse("/m", "--max-logprobs", "-1")).max_logprobs == -1  # vLLM's: up to the vocab size
    assert engine_args(_parse("/m", "--kv-cache-dtype", "fp8")).kv_cache_dtype == "fp8"
    default = settings_from_args(_parse("/m"), ENGINE)
    assert (default.response_role, default.return_tokens_as_token_ids) == ("assistant", False)


def test_quantization_fp8_needs_an_fp8_checkpoint():
    _check_quantization("fp8", {"quantization_config": {"quant_method": "fp8", "weight_block_size": [128, 128]}})
    with pytest.raises(ValueError, match="--quantization fp8: the checkpoint is not FP8 .*None"):
        _check_quantization("fp8", {})
    _parse("/m.gguf", "--quantization", "gguf")  # the file's own format: accepted


def test_vllm_reasoning_parser_names_are_the_think_parser():
    assert settings_from_args(_parse("/m", "--reasoning-parser", "deepseek_r1"), ENGINE).reasoning_parser == "think"
    assert settings_from_args(_parse("/m", "--reasoning-parser", "qwen3"), ENGINE).reasoning_parser == "think"


def test_http_flags_reach_uvicorn_and_the_settings():
    args = _parse("/m", "--uvicorn-log-level", "trace", "--ssl-keyfile", "k.pem", "--ssl-certfile", "c.pem",
                  "--ssl-cert-reqs", "2", "--root-path", "/api/", "--allow-credentials")
    options = uvicorn_options(args)
    assert (options["log_level"], options["ssl_keyfile"], options["ssl_certfile"]) == ("trace", "k.pem", "c.pem")
    assert options["ssl_cert_reqs"] == 2 and "ssl_ca_certs" not in options
    assert uvicorn_options(_parse("/m", "--log-level", "warning"))["log_level"] == "warning"
    settings = settings_from_args(args, ENGINE)
    assert settings.root_path == "/api"
    assert (settings.cors_allowed_origins, settings.cors_allow_credentials) == (("*",), True)  # vLLM's defaults
    assert settings_from_args(_parse("/m"), ENGINE).cors_allowed_origins is None  # no flag: no CORS headers


@pytest.mark.parametrize("entry", [["dsinfer.entrypoints.cli", "serve"], ["dsinfer.server"]])
def test_both_entry_points_refuse_with_exit_2_before_loading_a_model(entry):
    result = subprocess.run([sys.executable, "-m", *entry, "--model", "/no/such/model", "--pipeline_parallel_size=2"],
                            capture_output=True, text=True, timeout=120, cwd=REPO,
                            env={**os.environ, "PYTHONPATH": str(REPO)})
    assert result.returncode == 2
    assert "error: --pipeline-parallel-size 2: dsinfer has no pipeline parallelism" in result.stderr
    assert "Traceback" not in result.stderr


def test_cors_and_root_path_on_a_live_server(tmp_path):
    live = start_server(tmp_path, "--allowed-origins", json.dumps(["https://ui.example"]), "--root-path", "/api",
                        "--trust-remote-code", "-tp", "1", "--disable-log-requests")
    try:
        preflight = {"Origin": "https://ui.example", "Access-Control-Request-Method": "POST",
                     "Access-Control-Request-Headers": "authorization,content-type"}
        r = httpx.options(f"{live.url}/api/v1/chat/completions", headers=preflight, timeout=30)
        assert r.status_code == 200  # answered without an API key, as a browser sends none on a preflight
        assert r.headers["access-control-allow-origin"] == "https://ui.example"
        other = httpx.get(f"{live.url}/v1/models", headers={"Origin": "https://evil.example"}, timeout=30)
        assert other.status_code == 401 and "access-control-allow-origin" not in other.headers
        # behind the proxy prefix, and without it (a proxy that strips it): the same routes and public paths
        assert httpx.get(f"{live.url}/api/health", timeout=30).status_code == 200
        for path in ("/api/v1/models", "/v1/models"):
            r = httpx.get(f"{live.url}{path}", headers={"Authorization": f"Bearer {API_KEY}"}, timeout=30)
            assert r.status_code == 200 and r.json()["data"], path
    finally:
        stop_server(live)


def test_quantization_int4_reaches_the_engine_args():
    assert engine_args(_parse("/m", "--quantization", "int4")).quantization == "int4"
    assert engine_args(_parse("/m.gguf", "-q", "gguf")).quantization == "gguf"
    assert engine_args(_parse("/m", "--quantization", "fp8")).quantization is None  # a check of the checkpoint
