"""Starting and stopping a live dsinfer server on 127.0.0.1 (default model) in a subprocess."""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import httpx

API_KEY = "sk-test-key"
MAX_MODEL_LEN = 512
REPO = Path(__file__).resolve().parents[2]
# Extra engine flags for the server under test (prefix caching stays on, as users run it). float32: the exact path
# the protocol tests compare logprobs on (the CPU default for the bundled GGUF is its 4-bit blocks, whose own
# tests are tests/engine/test_cpu_quantization.py)
ENGINE_FLAGS: tuple[str, ...] = ("--dtype", "float32")


@dataclass
class LiveServer:
    url: str
    proc: subprocess.Popen
    log: Path

    @property
    def v1(self) -> str:
        return f"{self.url}/v1"

    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {API_KEY}"}

    def post(self, path: str, json=None, content=None, timeout: float = 120.0, **headers) -> httpx.Response:
        return httpx.post(
            f"{self.url}{path}",
            json=json,
            content=content,
            timeout=timeout,
            headers={**self.headers(), **headers},
        )

    def gauge(self, name: str) -> float:
        """A metric's value from ``/metrics`` (an unlabelled gauge or counter)."""
        text = httpx.get(f"{self.url}/metrics", timeout=30).text
        return float(re.search(rf"^{name} (\S+)$", text, re.M).group(1))

    def await_gauge_at_least(self, name: str, value: float, timeout: float = 60.0) -> bool:
        """Whether ``name`` reaches ``value`` within ``timeout``. At least, not equal: the session's server is
        shared, and another test's request may still be finishing. The engine's stats are refreshed just after a
        step's outputs go out, so a client's first token can beat them."""
        deadline = time.monotonic() + timeout
        while self.gauge(name) < value:
            if time.monotonic() > deadline:
                return False
            time.sleep(0.05)
        return True

    def wait_idle(self, timeout: float = 60.0) -> float:
        """Wait until no request runs and no KV block is held; the time it was seen so."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.gauge("dsinfer_num_requests_running") == 0 and self.gauge("dsinfer_kv_cache_usage_ratio") == 0:
                return time.monotonic()
            time.sleep(0.1)
        raise AssertionError("an aborted request still holds the engine")

    def alive(self) -> bool:
        return self.proc.poll() is None and httpx.get(f"{self.url}/health", timeout=10).status_code == 200


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(tmp: Path, *extra: str, timeout: float = 240.0) -> LiveServer:
    port = free_port()
    log = tmp / f"server-{port}.log"
    cmd = [
        sys.executable,
        "-m",
        "dsinfer.server",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--api-key",
        API_KEY,
        "--max-model-len",
        str(MAX_MODEL_LEN),
        "--log-level",
        "warning",
        *ENGINE_FLAGS,
        *extra,
    ]
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.Popen(cmd, stdout=log.open("w"), stderr=subprocess.STDOUT, env=env, cwd=REPO)
    server = LiveServer(f"http://127.0.0.1:{port}", proc, log)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode}:\n{log.read_text()[-4000:]}")
        try:
            if httpx.get(f"{server.url}/health", timeout=2).status_code == 200:
                return server
        except httpx.TransportError:
            pass
        time.sleep(0.3)
    proc.kill()
    raise RuntimeError(f"server did not become healthy in {timeout}s:\n{log.read_text()[-4000:]}")


def stop_server(server: LiveServer) -> None:
    if server.proc.poll() is None:
        server.proc.kill()
        server.proc.wait(30)


def start_tiny_server(tmp: Path, model: Path, tokenizer: Path, backend: str = "uni", *extra: str,
                      env: dict[str, str] | None = None) -> tuple[subprocess.Popen, str, Path]:
    """A server of a tiny random model (``tiny_llama_dir``, ``write_tiny_tokenizer``) named "tiny", on CPU;
    ``env``: variables added to the server's environment. Returns the process, its URL and its log."""
    port, log = free_port(), tmp / "server.log"
    cmd = [sys.executable, "-m", "dsinfer.server", str(model), "--tokenizer", str(tokenizer), "--device", "cpu",
           "--distributed-executor-backend", backend, "--served-model-name", "tiny", "--host", "127.0.0.1",
           "--port", str(port), "--api-key", API_KEY, "--max-model-len", "512", "--log-level", "warning", *extra]
    proc = subprocess.Popen(cmd, stdout=log.open("w"), stderr=subprocess.STDOUT, cwd=REPO,
                            env={**os.environ, "PYTHONPATH": str(REPO), **(env or {})})
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 45
    while time.monotonic() < deadline:
        assert proc.poll() is None, f"server exited with {proc.returncode}:\n{log.read_text()[-4000:]}"
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return proc, url, log
        except httpx.TransportError:
            pass
        time.sleep(0.2)
    proc.kill()
    raise AssertionError(f"server not healthy in 45s:\n{log.read_text()[-4000:]}")
