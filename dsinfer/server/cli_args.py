"""``dsinfer serve``'s options: ``add_serve_args(parser)`` declares them (vLLM's names, ours beside), ``vllm_spelling``
reads vLLM's underscore spellings; ``server.cli`` checks them and runs the server."""


from __future__ import annotations

import argparse
import json
from typing import Any

from dsinfer.config import (
    EXECUTOR_BACKENDS,
    SCHEDULING_POLICIES,
)
from dsinfer.engine.sampling_params import DEFAULT_MAX_LOGPROBS
from dsinfer.protocol.chat_formats import BUILTIN_TEMPLATES
from dsinfer.protocol.tool_parsers import TOOL_PARSERS

ENGINE_ARGS = (
    "kv_store",
    "deterministic",
    "dtype",
    "max_model_len",
    "max_num_seqs",
    "max_num_batched_tokens",
    "enable_chunked_prefill",
    "enable_prefix_caching",
    "block_size",
    "tokenizer",
    "kv_cache_memory_gb",
    "gpu_memory_utilization",
    "seed",
    "load_format",
    "device",
    "enforce_eager",
    "max_prefill_graph_tokens",
    "generation_config",
    "override_generation_config",
    "max_logprobs",
    "kv_cache_dtype",
    "scheduling_policy",
    "distributed_executor_backend",
    "tensor_parallel_size",
    "enable_expert_parallel",
    "data_parallel_size",
    "speculative_config",
    "enable_eplb",
    "eplb_config",
)


class _Extend(argparse.Action):
    """vLLM's list flags (``--served-model-name a b``, also repeatable). One occurrence that takes several values is
    noted: when no model was given, its last value may be the model path it swallowed (``--api-key K /models/x``)."""

    def __call__(self, parser, namespace, values, option_string=None):
        setattr(namespace, self.dest, [*(getattr(namespace, self.dest) or []), *values])
        if len(values) > 1:
            namespace._greedy = [*getattr(namespace, "_greedy", []), (option_string, values)]


def add_serve_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    parser.add_argument(
        "model", nargs="?", default=None, help="model dir, HF id or GGUF file (default: bundled)"
    )
    parser.add_argument("--model", dest="model_flag", default=None, metavar="MODEL",
                        help="the same as MODEL (vLLM's spelling)")
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on")
    parser.add_argument("--port", type=int, default=8000, help="port to listen on")
    parser.add_argument("--api-key", action=_Extend, nargs="+", default=[],
                        help="accepted API key(s) (repeatable)")
    parser.add_argument("--served-model-name", action=_Extend, nargs="+", default=[],
                        help="model name(s) to answer to")
    eng = parser.add_argument_group("engine")
    eng.add_argument("--dtype", default=None, help="weight/activation dtype")
    eng.add_argument("--max-model-len", type=_max_model_len, default=None,
                     help="context length (prompt + completion); -1: the model's own")
    eng.add_argument("--max-num-seqs", type=int, default=None, help="requests decoded together")
    eng.add_argument("--max-num-batched-tokens", type=int, default=None,
                     help="token budget per step (default: 8192 on a GPU of 70 GiB or more, else 2048)")
    eng.add_argument("--enable-chunked-prefill", action=argparse.BooleanOptionalAction, default=None,
                     help="split long prompts across steps (default: on)")
    eng.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=None)
    eng.add_argument("--scheduling-policy", default=None, choices=list(SCHEDULING_POLICIES),
                     help="fcfs (default: arrival order) or priority (a request's 'priority' field, lower first, "
                          "then arrival; the lowest is preempted first)")
    eng.add_argument("--block-size", type=int, default=None,
                     help="tokens per KV block, a power of two (default: 64 for MLA models on CUDA, else 16)")
    eng.add_argument("--kv-cache-memory-gb", type=float, default=None, help="KV cache size in GiB")
    eng.add_argument("--gpu-memory-utilization", type=float, default=None,
                     help="this process's fraction of GPU memory for weights, activations and the KV cache "
                          "(two replicas at 0.45 share one GPU)")
    eng.add_argument("--seed", type=int, default=None, help="engine seed")
    eng.add_argument("--device", default=None, help="cuda | cpu (default: cuda when available)")
    eng.add_argument("--distributed-executor-backend", default=None, choices=list(EXECUTOR_BACKENDS),
                     help="where the model runs: uni (default at one rank: in the server's process) or mp (in "
                          "worker processes, one per rank; should one die, the server exits with code 1)")
    eng.add_argument("--tensor-parallel-size", "-tp", dest="tensor_parallel_size", type=int, default=None,
                     help="split the model over this many GPUs (ranks spawned here; under torchrun / SLURM the "
                          "job's WORLD_SIZE, RANK 0 serving; see the README)")
    eng.add_argument("--enable-expert-parallel", dest="enable_expert_parallel", action="store_true",
                     default=None, help="DeepSeek V2 / V3: partition the routed experts over the ranks (EP size = "
                                        "--tensor-parallel-size) instead of splitting each expert's columns")
    eng.add_argument("--enforce-eager", action=argparse.BooleanOptionalAction, default=None, help="no CUDA graphs")
    eng.add_argument("--max-prefill-graph-tokens", type=int, default=None,
                     help="steps with prompt tokens up to this many replay piecewise CUDA graphs (0: eager)")
    eng.add_argument("--load-format", default=None, help="auto | safetensors | gguf | dummy")
    eng.add_argument("--tokenizer", default=None,
                     help="local directory of the tokenizer files (and chat template) to use instead of the model's")
    eng.add_argument("--deterministic", action="store_true", default=None,
                     help="batch-invariant mode: a request's output does not depend on its batch")
    eng.add_argument("--generation-config", default=None,
                     help="where the sampling fields a request leaves unset take their values, as vLLM's: 'auto' "
                          "(default: the model's generation_config.json), 'vllm' (none of it), or a folder holding "
                          "a generation_config.json (whose max_new_tokens then caps every request)")
    eng.add_argument("--override-generation-config", type=_json_object, default=None,
                     help='JSON sampling values over the generation config\'s, e.g. \'{"temperature": 0.5}\' '
                          "(temperature, top_p, top_k, min_p, repetition_penalty; max_new_tokens caps max_tokens)")
    eng.add_argument("--speculative-config", type=_json_object, default=None,
                     help='speculative decoding as vLLM\'s, e.g. \'{"method": "ngram", "num_speculative_tokens": '
                          '3, "prompt_lookup_max": 4}\' (also prompt_lookup_min, "acceptance": "exact" | '
                          '"rejection", "confidence_scheduling": true)')
    eng.add_argument("--kv-store", type=_json_object, default=None,
                     help='the KV cache store beyond GPU memory, e.g. \'{"host_gb": 64, "dir": "/mnt/3fs/kv", '
                          '"dir_gb": 4096, "grain": 128, "ttl_s": {"agent": 259200, "chat": 604800}}\'; a request '
                          'names its class in the body field "kv_retention"')
    eng.add_argument("--enable-eplb", action="store_true", default=None,
                     help="expert-parallel load balancing (DeepSeek V2 / V3 / V3.2): expert load counters, redundant "
                          "experts and periodic rebalances that never stall a step")
    eng.add_argument("--eplb-config", type=_json_object, default=None,
                     help='EPLB settings as vLLM\'s, e.g. \'{"window_size": 1000, "step_interval": 3000, '
                          '"num_redundant_experts": 32, "log_balancedness": true}\'')
    srv = parser.add_argument_group("server")
    srv.add_argument("--max-waiting-requests", type=int, default=256,
                     help="queued requests before 429 (529 on Anthropic routes)")
    srv.add_argument("--max-waiting-tokens", type=int, default=None,
                     help="queued prompt tokens (not yet computed) before 429 / 529; a request finding an empty "
                          "queue is always taken (default: no bound)")
    srv.add_argument("--max-body-mb", type=float, default=8.0, help="request bodies above this get 413")
    srv.add_argument("--header-timeout", type=float, default=10.0,
                     help="seconds a request's headers may take to arrive (then 408 and the connection closed)")
    srv.add_argument("--body-timeout", type=float, default=30.0,
                     help="seconds a request body may pause between reads (then the connection is closed)")
    srv.add_argument("--max-header-kb", type=float, default=32.0, help="request headers above this get 431")
    srv.add_argument("--limit-concurrency", type=int, default=4096,
                     help="connections and requests open at once before uvicorn answers 503")
    srv.add_argument("--max-json-depth", type=int, default=64, help="deeper JSON nesting gets 400")
    srv.add_argument(
        "--drain-timeout",
        type=float,
        default=30.0,
        help="seconds in-flight requests may finish after SIGTERM",
    )
    srv.add_argument(
        "--chat-template", default=None, help="chat template file (or text) replacing the model's"
    )
    srv.add_argument(
        "--chat-format",
        default="auto",
        choices=["auto", *BUILTIN_TEMPLATES],
        help="built-in template to use instead of the model's (auto: the model's own)",
    )
    srv.add_argument("--tool-call-parser", default="auto", choices=["auto", *TOOL_PARSERS])
    srv.add_argument("--reasoning-parser", default="auto", choices=["auto", "think", "none", *THINK_ALIASES],
                     help="think: <think>...</think> at the start of the answer is reasoning_content "
                          f"({', '.join(THINK_ALIASES)}: vLLM's names, the same as think)")
    srv.add_argument(
        "--trust-request-chat-template",
        action="store_true",
        help="accept a chat_template field in requests (it runs in a jinja2 sandbox)",
    )
    srv.add_argument(
        "--exclude-tools-when-tool-choice-none",
        action="store_true",
        help='leave the tools out of the prompt when tool_choice is "none" (default: they stay, as vLLM)',
    )
    srv.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    srv.add_argument("--uvicorn-log-level", default=None,
                     choices=["critical", "error", "warning", "info", "debug", "trace"],
                     help="log level of the HTTP server (default: --log-level)")
    srv.add_argument("--root-path", default=None,
                     help="path prefix under which a proxy serves this server; paths with or without it are served")
    srv.add_argument("--allowed-origins", type=_json_list, default=None,
                     help='CORS: JSON list of origins, e.g. \'["https://ui.example"]\' (no CORS headers unless '
                          'one of the CORS flags is given; then the others default to ["*"], as vLLM\'s)')
    srv.add_argument("--allowed-methods", type=_json_list, default=None, help="CORS: JSON list of methods")
    srv.add_argument("--allowed-headers", type=_json_list, default=None, help="CORS: JSON list of headers")
    srv.add_argument("--allow-credentials", action="store_true", default=None, help="CORS: allow credentials")
    srv.add_argument("--ssl-keyfile", default=None, help="serve HTTPS with this private key file")
    srv.add_argument("--ssl-certfile", default=None, help="serve HTTPS with this certificate file")
    srv.add_argument("--ssl-ca-certs", default=None, help="CA certificates file (client certificates)")
    srv.add_argument("--ssl-cert-reqs", type=int, default=None,
                     help="whether a client certificate is required (Python ssl.CERT_* value: 0 none, 2 required)")
    _add_vllm_args(parser.add_argument_group(
        "vLLM flags", "vllm serve flags that deployment scripts carry: accepted where dsinfer does what vLLM "
                      "would, refused (exit 2, with the reason) where it cannot"))
    return parser


# vLLM's reasoning parsers that are dsinfer's "think" parser: <think>...</think> opens the answer (or the prompt
# already opened it)
THINK_ALIASES = ("deepseek_r1", "qwen3")


# vLLM's on/off flags that change nothing here (and one, --enable-log-requests, refused in check_serve_args)
_SWITCHES = (
    ("--disable-log-requests", "accepted: dsinfer does not log requests"),
    ("--enable-log-requests", "refused: dsinfer has no request log (GET /metrics counts requests)"),
    ("--disable-log-stats", "accepted: dsinfer logs no periodic stats (GET /metrics has them)"),
    ("--disable-uvicorn-access-log", "accepted: dsinfer has no access log"),
    ("--disable-fastapi-docs", "accepted: dsinfer serves no OpenAPI docs"),
    ("--enable-auto-tool-choice", 'accepted: tool_choice "auto" is always served (see --tool-call-parser)'),
)


def _add_vllm_args(grp: Any) -> None:
    for flags, dest in ((("--pipeline-parallel-size", "-pp"), "pipeline_parallel_size"),
                        (("--data-parallel-size", "-dp"), "data_parallel_size")):
        grp.add_argument(*flags, dest=dest, type=int, default=None,
                         help="1 only: one GPU per process" if dest == "pipeline_parallel_size" else
                         "with --enable-expert-parallel: DP attention over this many ranks (each its own "
                         "scheduler and KV cache, the MoE experts across all)")
    grp.add_argument("--trust-remote-code", action=argparse.BooleanOptionalAction, default=None,
                     help="accepted: dsinfer never runs a model's own Python code")
    for flag, why in _SWITCHES:
        grp.add_argument(flag, action="store_true", default=None, help=why)
    grp.add_argument("--kv-cache-dtype", default=None,
                     help="auto (the model's dtype) | fp8 = fp8_e4m3 | fp8_e5m2: an FP8 cache holds twice the tokens "
                          "(GQA models: per-layer k/v scales from the checkpoint, else 1.0; MLA: scale 1.0)")
    grp.add_argument("--quantization", "-q", default=None,
                     help="fp8 for an FP8 checkpoint, gguf for a .gguf file (its own 4/8-bit blocks: the CPU "
                          "default for a GGUF at --dtype auto), int8 | int4: weight-only quantized linears on CPU "
                          "(any Llama-family checkpoint, quantized once at load)")
    grp.add_argument("--revision", default=None,
                     help="accepted: models are local paths only, where vLLM ignores the revision too")
    grp.add_argument("--download-dir", default=None,
                     help="accepted: models are local paths only, which vLLM never downloads either")
    grp.add_argument("--max-logprobs", type=int, default=None,
                     help="the most logprobs / top_logprobs (and echoed prompt logprobs) a request may ask for "
                          f"(default {DEFAULT_MAX_LOGPROBS}); -1: up to the vocabulary size")
    grp.add_argument("--swap-space", type=float, default=None,
                     help="accepted: preempted requests are recomputed, never swapped to CPU (as in vLLM V1)")
    grp.add_argument("--response-role", default=None,
                     help="the role of chat completion answers after a generation prompt (default: assistant)")
    grp.add_argument("--return-tokens-as-token-ids", action="store_true", default=None,
                     help='logprobs tokens as "token_id:N" rather than their text (a request\'s '
                          "return_tokens_as_token_ids overrides it)")
    grp.add_argument("--chat-template-content-format", default=None, choices=["auto", "string", "openai"],
                     help="auto | string: message content reaches the template as one string (text parts joined)")


def _max_model_len(text: str) -> int | None:
    value = int(text)
    return None if value == -1 else value  # vLLM's -1: the model's own maximum


def _json_list(text: str) -> list[str]:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise argparse.ArgumentTypeError(f"not valid JSON: {exc}") from None
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise argparse.ArgumentTypeError(f"expected a JSON list of strings, e.g. '[\"*\"]', got {text!r}")
    return value


def _json_object(text: str) -> dict[str, Any]:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise argparse.ArgumentTypeError(f"not valid JSON: {exc}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"expected a JSON object, got {type(value).__name__}")
    return value


def vllm_spelling(argv: list[str]) -> list[str]:
    """vLLM's parser also takes ``--tensor_parallel_size=2``: option names with underscores become dashes. Values
    stay as they are: argparse reads a separate word starting with "--" as an option, never as a value, so only
    ``--flag=value`` can carry one, and only its name part is changed; everything after ``--`` is left alone."""
    out: list[str] = []
    for i, arg in enumerate(argv):
        if arg == "--":
            return out + argv[i:]
        if arg.startswith("--"):
            name, sep, value = arg.partition("=")
            arg = name.replace("_", "-") + sep + value
        out.append(arg)
    return out
