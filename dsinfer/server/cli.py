"""``dsinfer serve``: ``check_serve_args`` checks the options ``cli_args.add_serve_args`` declares (re-exported
here), ``run_serve(args)`` runs the server."""

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
    KV_CACHE_DTYPES,
    PARALLEL_SIZES,
    QUANTIZATIONS,
    EplbConfig,
    KVStoreConfig,
    SpeculativeConfig,
    check_parallel_size,
)
from dsinfer.server.cli_args import ENGINE_ARGS, THINK_ALIASES, add_serve_args, vllm_spelling

logger = logging.getLogger("dsinfer.server")


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


def _template_text(value: str | None) -> str | None:
    if value is None:
        return None
    path = Path(value)
    return path.read_text() if "{" not in value and path.is_file() else value


def engine_args(args: argparse.Namespace) -> Any:
    """The ``EngineArgs`` of the engine flags that were given (the others keep their defaults)."""
    from dsinfer.engine.arg_utils import EngineArgs

    names = {f.name for f in dataclasses.fields(EngineArgs)}
    kwargs = {k: getattr(args, k) for k in ENGINE_ARGS if k in names and getattr(args, k) is not None}
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
        reasoning_parser="think" if args.reasoning_parser in THINK_ALIASES else args.reasoning_parser,
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
