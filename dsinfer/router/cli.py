"""``dsinfer router``: ``add_router_args(parser)`` declares the options, ``run_router(args, serve_args)`` runs it.

``dsinfer router --host H --port P --replica URL [URL ...]`` (mixed replicas), ``--prefill URL ... --decode
URL ...`` (disaggregated), or ``--launch N`` / ``--launch-prefill N --launch-decode M`` with the serve flags of
the launched replicas after ``--`` (``dsinfer router --launch 2 -- MODEL --gpu-memory-utilization 0.45``).
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import time
from pathlib import Path
from types import FrameType
from typing import Any

import uvicorn

from dsinfer.router.settings import POLICIES, RouterSettings

logger = logging.getLogger("dsinfer.router")


def add_router_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on")
    parser.add_argument("--port", type=int, default=8000, help="port to listen on")
    reps = parser.add_argument_group("replicas")
    reps.add_argument("--replica", nargs="+", action="extend", default=[], metavar="URL",
                      help="mixed replicas (dsinfer serve URLs), repeatable")
    reps.add_argument("--prefill", nargs="+", action="extend", default=[], metavar="URL",
                      help="prefill replicas (P/D: they share a kv_store dir with the decode replicas)")
    reps.add_argument("--decode", nargs="+", action="extend", default=[], metavar="URL", help="decode replicas")
    reps.add_argument("--launch", type=int, default=0, metavar="N",
                      help="start N mixed replicas (dsinfer serve with the flags after --)")
    reps.add_argument("--launch-prefill", type=int, default=0, metavar="N", help="start N prefill replicas")
    reps.add_argument("--launch-decode", type=int, default=0, metavar="N", help="start N decode replicas")
    reps.add_argument("--launch-timeout", type=float, default=600.0,
                      help="seconds the launched replicas may take to become healthy")
    reps.add_argument("--launch-log-dir", default="dsinfer-router-logs", help="where launched replicas log")
    pol = parser.add_argument_group("routing")
    pol.add_argument("--policy", default="prefix_aware", choices=list(POLICIES),
                     help="how a mixed or decode replica is chosen (default: prefix_aware)")
    pol.add_argument("--balance-abs", type=float, default=4.0,
                     help="prefix_aware: a prefix's replica is passed over when it runs more than this many "
                          "requests over the least loaded one ...")
    pol.add_argument("--balance-rel", type=float, default=1.5, help="... and more than this many times as many")
    pol.add_argument("--min-prefix-tokens", type=int, default=64,
                     help="prefix_aware: a shorter cached prefix counts as a miss")
    pol.add_argument("--model", default=None,
                     help="the replicas' model (for its tokenizer and chat template; default: the bundled model, "
                          "or the one after -- with --launch)")
    pol.add_argument("--tokenizer", default=None, help="the replicas' --tokenizer")
    pol.add_argument("--chat-template", default=None, help="the replicas' --chat-template (file or text)")
    pol.add_argument("--chat-format", default="auto", help="the replicas' --chat-format")
    rel = parser.add_argument_group("reliability")
    rel.add_argument("--health-interval", type=float, default=1.0, help="seconds between health checks")
    rel.add_argument("--health-timeout", type=float, default=2.0, help="seconds a health check may take")
    rel.add_argument("--eject-after", type=int, default=2, help="failed health checks in a row that eject")
    rel.add_argument("--readmit-after", type=int, default=2, help="good health checks in a row that re-admit")
    rel.add_argument("--breaker-failures", type=int, default=3, help="failed requests in a row that open the breaker")
    rel.add_argument("--breaker-cooldown", type=float, default=5.0, help="seconds an open breaker stays open")
    rel.add_argument("--max-retries", type=int, default=3, help="retries before the first byte (connection, 503)")
    rel.add_argument("--retry-backoff", type=float, default=0.05, help="first retry's backoff in seconds (doubles)")
    rel.add_argument("--connect-timeout", type=float, default=5.0, help="seconds to connect to a replica")
    rel.add_argument("--read-timeout", type=float, default=600.0,
                     help="seconds a replica may stay silent (before its answer or between stream events): 504")
    rel.add_argument("--drain-timeout", type=float, default=30.0, help="seconds in-flight requests may finish "
                                                                        "after SIGTERM")
    rel.add_argument("--admin-key", default=None,
                     help="bearer key of /admin/replicas (default: none; then loopback clients only)")
    rel.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    return parser


def _serve_flag(serve_args: list[str], flag: str) -> str | None:
    for i, arg in enumerate(serve_args):
        if arg == flag and i + 1 < len(serve_args):
            return serve_args[i + 1]
        if arg.startswith(flag + "="):
            return arg.split("=", 1)[1]
    return None


def settings_from_args(args: argparse.Namespace, serve_args: list[str]) -> RouterSettings:
    model = args.model
    if model is None and serve_args:  # the launched replicas' model: the first word, or --model
        model = serve_args[0] if not serve_args[0].startswith("-") else _serve_flag(serve_args, "--model")
    template = args.chat_template or _serve_flag(serve_args, "--chat-template")
    if template is not None and "{" not in template and Path(template).is_file():
        template = Path(template).read_text()
    return RouterSettings(
        policy=args.policy, health_interval_s=args.health_interval, health_timeout_s=args.health_timeout,
        eject_after=args.eject_after, readmit_after=args.readmit_after, breaker_failures=args.breaker_failures,
        breaker_cooldown_s=args.breaker_cooldown, max_retries=args.max_retries, retry_backoff_s=args.retry_backoff,
        connect_timeout_s=args.connect_timeout, read_timeout_s=args.read_timeout, drain_timeout_s=args.drain_timeout,
        balance_abs=args.balance_abs, balance_rel=args.balance_rel, min_prefix_tokens=args.min_prefix_tokens,
        model=model, tokenizer=args.tokenizer or _serve_flag(serve_args, "--tokenizer"), chat_template=template,
        chat_format=args.chat_format if args.chat_format != "auto" else (_serve_flag(serve_args, "--chat-format")
                                                                          or "auto"),
        admin_key=args.admin_key)


def _replicas_of(args: argparse.Namespace) -> list[tuple[str, str]]:
    return ([(u, "mixed") for u in args.replica] + [(u, "prefill") for u in args.prefill]
            + [(u, "decode") for u in args.decode])


def check_router_args(args: argparse.Namespace, serve_args: list[str]) -> None:
    launched = args.launch + args.launch_prefill + args.launch_decode
    if min(args.launch, args.launch_prefill, args.launch_decode) < 0:
        raise ValueError("--launch, --launch-prefill and --launch-decode must be >= 0")
    if not launched and not _replicas_of(args):
        raise ValueError("no replicas: give --replica URL..., --prefill/--decode URL..., or --launch N")
    if serve_args and not launched:
        raise ValueError("serve flags after -- are for launched replicas: add --launch N")
    if bool(args.prefill or args.launch_prefill) != bool(args.decode or args.launch_decode):
        raise ValueError("prefill/decode disaggregation needs both prefill and decode replicas")


class RouterServer(uvicorn.Server):
    """uvicorn with a graceful drain: the first SIGTERM/SIGINT stops accepting (/health and new requests 503)
    and waits until no request is in flight or ``drain_timeout_s`` passes; a second one exits at once."""

    def __init__(self, config: uvicorn.Config, router: Any, drain_timeout_s: float):
        super().__init__(config)
        self.router = router
        self.drain_timeout_s = drain_timeout_s
        self._loop: asyncio.AbstractEventLoop | None = None

    async def serve(self, sockets=None) -> None:
        self._loop = asyncio.get_running_loop()
        await super().serve(sockets)

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if self.router.draining or self._loop is None:
            self.should_exit = self.force_exit = True
            return
        self.router.draining = True
        logger.info("signal %d: draining %d in-flight requests (up to %.0fs)", sig, self.router.in_flight,
                    self.drain_timeout_s)
        self._loop.call_soon_threadsafe(lambda: asyncio.ensure_future(self._drain()))

    async def _drain(self) -> None:
        deadline = time.monotonic() + self.drain_timeout_s
        while self.router.in_flight and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        if self.router.in_flight:
            logger.warning("drain timeout: %d requests still in flight are cut off", self.router.in_flight)
        self.should_exit = True


def run_router(args: argparse.Namespace, serve_args: list[str]) -> int:
    check_router_args(args, serve_args)
    settings = settings_from_args(args, serve_args)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per health check otherwise
    from dsinfer.router import launch
    from dsinfer.router.app import Router, build_app
    from dsinfer.router.prompt import PromptReader

    launch.check_serve_args(serve_args)
    reader = PromptReader.from_settings(settings)
    roles = ["mixed"] * args.launch + ["prefill"] * args.launch_prefill + ["decode"] * args.launch_decode
    launched = launch.launch(roles, serve_args, Path(args.launch_log_dir)) if roles else []
    try:
        if launched:
            launch.wait_healthy(launched, args.launch_timeout)
        router = Router(settings, _replicas_of(args) + [(r.url, r.role) for r in launched], reader)
        config = uvicorn.Config(build_app(router), host=args.host, port=args.port, log_level=args.log_level,
                                access_log=False, timeout_graceful_shutdown=5)
        RouterServer(config, router, settings.drain_timeout_s).run()
    finally:
        launch.stop(launched)
    return 0
