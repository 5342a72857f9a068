"""Replicas started by the router (``--launch N``, ``--launch-prefill N --launch-decode M``): ``dsinfer serve``
subprocesses on 127.0.0.1 with the serve flags given after ``--``, each on a free port, logs beside each other in
``--launch-log-dir``. They are stopped (SIGTERM: they drain; SIGKILL after ``stop_timeout_s``) when the router
exits."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import httpx


@dataclass
class Launched:
    url: str
    role: str
    proc: subprocess.Popen
    log: Path


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def check_serve_args(serve_args: list[str]) -> None:
    for flag in ("--host", "--port"):
        if any(a == flag or a.startswith(flag + "=") for a in serve_args):
            raise ValueError(f"{flag} is the router's to choose for the replicas it launches; leave it out of the "
                             "serve flags after --")


def launch(roles: list[str], serve_args: list[str], log_dir: Path) -> list[Launched]:
    """Start one ``dsinfer serve`` per entry of ``roles`` (without waiting for them)."""
    check_serve_args(serve_args)
    log_dir.mkdir(parents=True, exist_ok=True)
    out = []
    for i, role in enumerate(roles):
        port = free_port()
        log = log_dir / f"replica-{i}-{role}-{port}.log"
        cmd = [sys.executable, "-m", "dsinfer.server", *serve_args, "--host", "127.0.0.1", "--port", str(port)]
        proc = subprocess.Popen(cmd, stdout=log.open("w"), stderr=subprocess.STDOUT, env=dict(os.environ))
        out.append(Launched(f"http://127.0.0.1:{port}", role, proc, log))
    return out


def wait_healthy(replicas: list[Launched], timeout_s: float) -> None:
    """Until every launched replica answers /health 200; RuntimeError (with its log's tail) when one exits or
    the time runs out."""
    deadline = time.monotonic() + timeout_s
    waiting = list(replicas)
    while waiting:
        for r in list(waiting):
            if r.proc.poll() is not None:
                raise RuntimeError(f"replica {r.url} exited with {r.proc.returncode}:\n"
                                   f"{r.log.read_text()[-3000:]}")
            try:
                if httpx.get(f"{r.url}/health", timeout=2).status_code == 200:
                    waiting.remove(r)
            except httpx.TransportError:
                pass
        if waiting and time.monotonic() > deadline:
            raise RuntimeError(f"replicas not healthy within {timeout_s:.0f}s: {[r.url for r in waiting]} "
                               f"(logs: {[str(r.log) for r in waiting]})")
        time.sleep(0.3)


def stop(replicas: list[Launched], stop_timeout_s: float = 30.0) -> None:
    for r in replicas:
        if r.proc.poll() is None:
            r.proc.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + stop_timeout_s
    for r in replicas:
        try:
            r.proc.wait(max(deadline - time.monotonic(), 0.1))
        except subprocess.TimeoutExpired:
            r.proc.kill()
            r.proc.wait(10)
