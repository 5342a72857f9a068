"""``dsinfer serve``: ``add_serve_args(parser)`` declares the options, ``run_serve(args)`` runs the server."""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import socket
from collections.abc import Callable
from pathlib import Path
from typing import Any

from dsinfer.config import (
    EXECUTOR_BACKENDS,
    KV_CACHE_DTYPES,
    PARALLEL_SIZES,
    QUANTIZATIONS,
    SCHEDULING_POLICIES,
    EplbConfig,
    KVStoreConfig,
    SpeculativeConfig,
    check_parallel_size,
)
from dsinfer.engine.sampling_params import DEFAULT_MAX_LOGPROBS
from dsinfer.protocol.chat_formats import BUILTIN_TEMPLATES
from dsinfer.protocol.tool_parsers import TOOL_PARSERS

_ENGINE_ARGS = (
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

logger = logging.getLogger("dsinfer.server")


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
    srv.add_argument("--reasoning-parser", default="auto", choices=["auto", "think", "none", *_THINK_ALIASES],
                     help="think: <think>...</think> at the start of the answer is reasoning_content "
                          f"({', '.join(_THINK_ALIASES)}: vLLM's names, the same as think)")
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
_THINK_ALIASES = ("deepseek_r1", "qwen3")


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


def check_serve_args(args: argparse.Namespace) -> None:
    """Settle ``args.model`` and refuse (ValueError naming the flag and why) the vLLM flag values that dsinfer
    cannot honour; needs no model. ``--quantization`` is checked against the checkpoint in ``build_engine``."""
    if args.model_flag is not None:
        if args.model is not None and args.model != args.model_flag:
            raise ValueError(f"MODEL {args.model!r} and --model {args.model_flag!r} disagree: give one of them")
        args.model = args.model_flag
    if args.model is None and getattr(args, "_greedy", None):
        flag, values = args._greedy[0]
        raise ValueError(f"{flag} took {len(values)} values {values} and no model was given: if the last one is "
                         f"the model, put MODEL before {flag} or pass --model")
    for name in PARALLEL_SIZES:
        value = getattr(args, name)
        if value is not None:
            check_parallel_size(value, f"--{name.replace('_', '-')} {value}")
    if args.data_parallel_size is not None and args.data_parallel_size < 1:
        raise ValueError(f"--data-parallel-size {args.data_parallel_size}: must be >= 1")
    if (args.data_parallel_size or 1) > 1 and not args.enable_expert_parallel:
        raise ValueError(f"--data-parallel-size {args.data_parallel_size}: dsinfer has no data parallelism "
                         "without --enable-expert-parallel (DP attention for DeepSeek MoE); for replicas of a "
                         "model run one server per GPU behind `dsinfer router`")
    if args.tensor_parallel_size is not None and args.tensor_parallel_size < 1:
        raise ValueError(f"--tensor-parallel-size {args.tensor_parallel_size}: must be >= 1")
    for flag, value in (("--max-waiting-tokens", args.max_waiting_tokens), ("--header-timeout", args.header_timeout),
                        ("--body-timeout", args.body_timeout), ("--max-header-kb", args.max_header_kb),
                        ("--limit-concurrency", args.limit_concurrency)):
        if value is not None and not value > 0:
            raise ValueError(f"{flag} {value}: must be > 0")
    if args.enable_log_requests:
        raise ValueError("--enable-log-requests: dsinfer has no request log (GET /metrics counts requests by "
                         "path and status); drop the flag")
    if args.kv_cache_dtype not in (None, *KV_CACHE_DTYPES):
        raise ValueError(f"--kv-cache-dtype {args.kv_cache_dtype}: dsinfer's KV cache dtypes are "
                         f"{', '.join(KV_CACHE_DTYPES)}")
    if args.speculative_config is not None:
        try:
            SpeculativeConfig.from_dict(args.speculative_config)
        except ValueError as exc:
            raise ValueError(f"--speculative-config {json.dumps(args.speculative_config)}: {exc}") from None
    if args.kv_store is not None:  # the grain's multiple is checked against the model's block size in build_engine
        try:
            KVStoreConfig.from_dict(args.kv_store, 1)
        except ValueError as exc:
            raise ValueError(f"--kv-store {json.dumps(args.kv_store)}: {exc}") from None
    if args.eplb_config is not None:
        try:
            EplbConfig.from_dict(args.eplb_config)
        except ValueError as exc:
            raise ValueError(f"--eplb-config {json.dumps(args.eplb_config)}: {exc}") from None
        if args.eplb_config.get("num_redundant_experts") and not args.enable_eplb:
            raise ValueError("--eplb-config num_redundant_experts needs --enable-eplb")
    if args.max_logprobs is not None and args.max_logprobs < -1:
        raise ValueError(f"--max-logprobs {args.max_logprobs}: must be >= 0, or -1 (up to the vocabulary size)")
    if args.swap_space is not None and args.swap_space < 0:
        raise ValueError(f"--swap-space {args.swap_space}: must be >= 0")
    if args.response_role is not None and not args.response_role:
        raise ValueError("--response-role '': the role of chat answers must not be empty")
    if args.chat_template_content_format == "openai":
        raise ValueError("--chat-template-content-format openai: dsinfer renders message content as one string "
                         "(text parts joined); only 'auto' and 'string' are accepted")
    if args.tokenizer is not None and not Path(args.tokenizer).expanduser().is_dir():
        raise ValueError(f"--tokenizer {args.tokenizer!r}: not a local directory (dsinfer downloads nothing; "
                         "pass the directory holding tokenizer.json)")
    if args.quantization not in (None, "fp8", *QUANTIZATIONS):
        raise ValueError(f"--quantization {args.quantization}: dsinfer runs FP8 (fp8) and GGUF (gguf) checkpoints "
                         "as they are and does not quantize on load, except int8 / int4 weight-only on CPU")
    if args.quantization == "gguf" and args.model is not None and not str(args.model).endswith(".gguf"):
        raise ValueError(f"--quantization gguf: the model {args.model!r} is not a .gguf file")
    if (args.ssl_keyfile is None) != (args.ssl_certfile is None):
        raise ValueError("--ssl-keyfile and --ssl-certfile: HTTPS needs both")


def _check_quantization(method: str | None, hf_config: dict[str, Any]) -> None:
    if method != "fp8":
        return
    declared = (hf_config.get("quantization_config") or {}).get("quant_method")
    if declared != "fp8":
        raise ValueError(f"--quantization fp8: the checkpoint is not FP8 (its quantization_config.quant_method is "
                         f"{declared!r}); dsinfer does not quantize on load")


def _json_object(text: str) -> dict[str, Any]:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise argparse.ArgumentTypeError(f"not valid JSON: {exc}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"expected a JSON object, got {type(value).__name__}")
    return value


def _template_text(value: str | None) -> str | None:
    if value is None:
        return None
    path = Path(value)
    return path.read_text() if "{" not in value and path.is_file() else value


def engine_args(args: argparse.Namespace) -> Any:
    """The ``EngineArgs`` of the engine flags that were given (the others keep their defaults)."""
    from dsinfer.engine.arg_utils import EngineArgs

    names = {f.name for f in dataclasses.fields(EngineArgs)}
    kwargs = {k: getattr(args, k) for k in _ENGINE_ARGS if k in names and getattr(args, k) is not None}
    if getattr(args, "quantization", None) in QUANTIZATIONS:  # fp8 is the checkpoint's own: a check only
        kwargs["quantization"] = args.quantization
    return EngineArgs(model=args.model, **kwargs)


def build_engine(args: argparse.Namespace) -> Any:
    from dsinfer.engine.llm_engine import LLMEngine

    eargs = engine_args(args)
    if eargs.kv_store:
        try:
            eargs.create_engine_config("server")
        except ValueError as exc:
            if not str(exc).startswith("kv_store"):
                raise
            raise ValueError(f"--kv-store {json.dumps(eargs.kv_store)}: {exc}") from None
    if eargs.speculative_config:  # the checkpoint decides whether its method can draft (MTP layers)
        try:
            eargs.create_engine_config("server")
        except ValueError as exc:
            if not str(exc).startswith("speculative_config"):
                raise
            raise ValueError(f"--speculative-config {json.dumps(eargs.speculative_config)}: {exc}") from None
    if getattr(args, "quantization", None) == "fp8":
        # the checkpoint's config.json decides, before any weights load
        _check_quantization("fp8", eargs.create_engine_config().model.hf_config)
    if eargs.data_parallel_size > 1:
        from dsinfer.engine.dp_engine import DataParallelEngine

        return DataParallelEngine.from_engine_args(eargs, usage="server")
    return LLMEngine.from_engine_args(eargs, usage="server")


def settings_from_args(args: argparse.Namespace, engine: Any) -> Any:
    from dsinfer.server.settings import ServerSettings

    names = tuple(args.served_model_name) or tuple(
        n for n in (getattr(engine.model_config, "served_model_name", None), args.model) if n
    )
    return ServerSettings(
        served_model_names=names,
        api_keys=tuple(args.api_key),
        max_body_bytes=int(args.max_body_mb * (1 << 20)),
        max_json_depth=args.max_json_depth,
        max_waiting_requests=args.max_waiting_requests,
        max_waiting_tokens=args.max_waiting_tokens,
        drain_timeout_s=args.drain_timeout,
        chat_template=_template_text(args.chat_template),
        chat_format=args.chat_format if args.chat_format != "auto" else "auto",
        tool_call_parser=args.tool_call_parser,
        reasoning_parser="think" if args.reasoning_parser in _THINK_ALIASES else args.reasoning_parser,
        trust_request_chat_template=args.trust_request_chat_template,
        exclude_tools_when_tool_choice_none=args.exclude_tools_when_tool_choice_none,
        **_cors_settings(args),
        root_path=(args.root_path or "").rstrip("/"),
        return_tokens_as_token_ids=bool(args.return_tokens_as_token_ids),
        response_role=args.response_role or "assistant",
    )


def _cors_settings(args: argparse.Namespace) -> dict[str, Any]:
    given = {k: getattr(args, k) for k in ("allowed_origins", "allowed_methods", "allowed_headers",
                                            "allow_credentials")}
    if all(v is None for v in given.values()):
        return {}
    # any CORS flag turns CORS on; the others take vLLM's defaults (every origin, method and header)
    return {"cors_allowed_origins": tuple(given["allowed_origins"] or ["*"]),
            "cors_allowed_methods": tuple(given["allowed_methods"] or ["*"]),
            "cors_allowed_headers": tuple(given["allowed_headers"] or ["*"]),
            "cors_allow_credentials": bool(given["allow_credentials"])}


def uvicorn_options(args: argparse.Namespace) -> dict[str, Any]:
    """``uvicorn.Config`` keyword arguments of the HTTP flags (``--root-path`` is the app's, see ``RootPath``)."""
    from dsinfer.server.http_limits import bounded_h11

    options: dict[str, Any] = {"host": args.host, "port": args.port,
                               "log_level": args.uvicorn_log_level or args.log_level,
                               "http": bounded_h11(args.header_timeout, args.body_timeout,
                                                   int(args.max_header_kb * 1024)),
                               "limit_concurrency": args.limit_concurrency}
    for name in ("ssl_keyfile", "ssl_certfile", "ssl_ca_certs", "ssl_cert_reqs"):
        if getattr(args, name) is not None:
            options[name] = getattr(args, name)
    return options


def check_address_free(host: str, port: int) -> None:
    """ValueError when ``host:port`` cannot be listened on (taken by another server, or not this machine's
    address): said before the model loads, as vLLM binds its socket first, not after minutes of loading."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn binds it
        try:
            sock.bind((host, port))
        except OSError as exc:
            raise ValueError(f"--port {port}: cannot listen on {host}:{port}: {exc.strerror or exc}") from None


def run_serve(
    args: argparse.Namespace, engine_factory: Callable[[argparse.Namespace], Any] | None = None
) -> int:
    """Build the engine, then serve until SIGTERM/SIGINT (drained gracefully: exit code 0) or until the engine
    dies (exit code 1, for an orchestrator to restart the server)."""
    check_serve_args(args)  # before the model loads: a refused flag costs nothing
    from dsinfer.entrypoints.launch import follow_if_launched

    followed = follow_if_launched(engine_args(args), "server")  # a launched job's rank >= 1 serves no HTTP
    if followed is not None:
        return followed
    check_address_free(args.host, args.port)  # and a taken port
    import uvicorn

    from dsinfer.entrypoints.async_engine import AsyncEngine
    from dsinfer.server.app import build_app
    from dsinfer.server.lifecycle import DrainingServer

    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    engine = (engine_factory or build_engine)(args)
    settings = settings_from_args(args, engine)
    async_engine = AsyncEngine(engine, max_waiting=settings.max_waiting_requests,
                               max_waiting_tokens=settings.max_waiting_tokens)
    app = build_app(async_engine, settings)
    config = uvicorn.Config(app, **uvicorn_options(args), timeout_graceful_shutdown=5, access_log=False)
    server = DrainingServer(config, async_engine, settings.drain_timeout_s)
    server.run()
    if server.engine_error is not None:
        logger.error("engine died: %s; exiting", server.engine_error)
        return 1
    return 0


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


def main(argv: list[str] | None = None) -> None:
    import sys

    parser = add_serve_args(argparse.ArgumentParser(prog="dsinfer serve", description=__doc__))
    args = parser.parse_args(vllm_spelling(sys.argv[1:] if argv is None else argv))
    try:
        code = run_serve(args)
    except (ValueError, FileNotFoundError) as exc:  # as ``dsinfer serve``: the reason, exit 2
        print(f"error: {exc}", file=sys.stderr)
        sys.exit(2)
    sys.exit(code)
