"""``dsinfer serve``: ``add_serve_args(parser)`` declares the options, ``run_serve(args)`` runs the server."""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

from dsinfer.protocol.chat_formats import BUILTIN_TEMPLATES
from dsinfer.protocol.tool_parsers import TOOL_PARSERS

_ENGINE_ARGS = (
    "deterministic",
    "dtype",
    "max_model_len",
    "max_num_seqs",
    "max_num_batched_tokens",
    "enable_prefix_caching",
    "kv_cache_memory_gb",
    "gpu_memory_utilization",
    "seed",
    "load_format",
    "device",
    "enforce_eager",
    "max_prefill_graph_tokens",
    "generation_config",
    "override_generation_config",
)


def add_serve_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    parser.add_argument(
        "model", nargs="?", default=None, help="model dir, HF id or GGUF file (default: bundled)"
    )
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on")
    parser.add_argument("--port", type=int, default=8000, help="port to listen on")
    parser.add_argument("--api-key", action="append", default=[], help="accepted API key (repeatable)")
    parser.add_argument("--served-model-name", action="append", default=[], help="model name(s) to answer to")
    eng = parser.add_argument_group("engine")
    eng.add_argument("--dtype", default=None, help="weight/activation dtype")
    eng.add_argument("--max-model-len", type=int, default=None, help="context length (prompt + completion)")
    eng.add_argument("--max-num-seqs", type=int, default=None, help="requests decoded together")
    eng.add_argument("--max-num-batched-tokens", type=int, default=None, help="token budget per step")
    eng.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=None)
    eng.add_argument("--kv-cache-memory-gb", type=float, default=None, help="KV cache size in GiB")
    eng.add_argument("--gpu-memory-utilization", type=float, default=None,
                     help="fraction of GPU memory for weights, activations and the KV cache")
    eng.add_argument("--seed", type=int, default=None, help="engine seed")
    eng.add_argument("--device", default=None, help="cuda | cpu (default: cuda when available)")
    eng.add_argument("--enforce-eager", action="store_true", default=None, help="no CUDA graphs")
    eng.add_argument("--max-prefill-graph-tokens", type=int, default=None,
                     help="steps with prompt tokens up to this many replay piecewise CUDA graphs (0: eager)")
    eng.add_argument("--load-format", default=None, help="auto | safetensors | gguf | dummy")
    eng.add_argument("--deterministic", action="store_true", default=None,
                     help="batch-invariant mode: a request's output does not depend on its batch")
    eng.add_argument("--generation-config", default=None,
                     help="where the sampling fields a request leaves unset take their values, as vLLM's: 'auto' "
                          "(default: the model's generation_config.json), 'vllm' (none of it), or a folder holding "
                          "a generation_config.json (whose max_new_tokens then caps every request)")
    eng.add_argument("--override-generation-config", type=_json_object, default=None,
                     help='JSON sampling values over the generation config\'s, e.g. \'{"temperature": 0.5}\' '
                          "(temperature, top_p, top_k, min_p, repetition_penalty; max_new_tokens caps max_tokens)")
    srv = parser.add_argument_group("server")
    srv.add_argument("--max-waiting-requests", type=int, default=256, help="queued requests before 429")
    srv.add_argument("--max-body-mb", type=float, default=8.0, help="request bodies above this get 413")
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
    srv.add_argument("--reasoning-parser", default="auto", choices=["auto", "think", "none"])
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
    return parser


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
    from dsinfer.config import EngineArgs

    names = {f.name for f in dataclasses.fields(EngineArgs)}
    kwargs = {k: getattr(args, k) for k in _ENGINE_ARGS if k in names and getattr(args, k) is not None}
    return EngineArgs(model=args.model, **kwargs)


def build_engine(args: argparse.Namespace) -> Any:
    from dsinfer.engine.llm_engine import LLMEngine

    return LLMEngine.from_engine_args(engine_args(args))


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
        drain_timeout_s=args.drain_timeout,
        chat_template=_template_text(args.chat_template),
        chat_format=args.chat_format if args.chat_format != "auto" else "auto",
        tool_call_parser=args.tool_call_parser,
        reasoning_parser=args.reasoning_parser,
        trust_request_chat_template=args.trust_request_chat_template,
        exclude_tools_when_tool_choice_none=args.exclude_tools_when_tool_choice_none,
    )


def run_serve(
    args: argparse.Namespace, engine_factory: Callable[[argparse.Namespace], Any] | None = None
) -> None:
    """Build the engine, then serve until SIGTERM/SIGINT (drained gracefully)."""
    import uvicorn

    from dsinfer.entrypoints.async_engine import AsyncEngine
    from dsinfer.server.app import build_app
    from dsinfer.server.lifecycle import DrainingServer

    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    engine = (engine_factory or build_engine)(args)
    settings = settings_from_args(args, engine)
    async_engine = AsyncEngine(engine, max_waiting=settings.max_waiting_requests)
    app = build_app(async_engine, settings)
    config = uvicorn.Config(
        app,
        host=args.host,
        port=args.port,
        log_level=args.log_level,
        timeout_graceful_shutdown=5,
        access_log=False,
    )
    DrainingServer(config, async_engine, settings.drain_timeout_s).run()


def main(argv: list[str] | None = None) -> None:
    parser = add_serve_args(argparse.ArgumentParser(prog="dsinfer serve", description=__doc__))
    run_serve(parser.parse_args(argv))
