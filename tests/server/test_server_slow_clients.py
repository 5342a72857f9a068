"""Slow and oversized clients are bounded (issue 45): headers that never finish get 408 and a closed connection,
a body that stops arriving gets its connection closed, headers over the limit get 431, and ordinary requests
(kept-alive ones included) are unaffected."""

from __future__ import annotations

import socket
import time
from urllib.parse import urlparse

import httpx
import pytest

from ..protocol.tiny_tokenizer import write_tiny_tokenizer
from .live_server import API_KEY, start_tiny_server

HEADERS = {"Authorization": f"Bearer {API_KEY}"}


@pytest.fixture(scope="module")
def url(tiny_llama_dir, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("slow")
    proc, url, _ = start_tiny_server(tmp, tiny_llama_dir, write_tiny_tokenizer(tmp / "tok"), "uni",
                                     "--header-timeout", "1", "--body-timeout", "1", "--max-header-kb", "8")
    yield url
    proc.terminate()
    proc.wait(30)


def _talk(url: str, data: bytes, wait_s: float = 6.0) -> tuple[bytes, float]:
    """Send ``data``, then read until the server closes the connection: what it sent, and after how long."""
    address = urlparse(url)
    with socket.create_connection((address.hostname, address.port), timeout=wait_s) as sock:
        started = time.monotonic()
        sock.sendall(data)
        received = b""
        while chunk := sock.recv(65536):
            received += chunk
        return received, time.monotonic() - started


def test_headers_that_never_finish_get_408_and_the_connection_closed(url):
    reply, took = _talk(url, b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")
    assert reply.startswith(b"HTTP/1.1 408 ") and b"did not arrive within 1s" in reply and took < 3
    reply, took = _talk(url, b"")  # a connection that sends nothing at all
    assert reply.startswith(b"HTTP/1.1 408 ") and took < 3


def test_a_body_that_stops_arriving_gets_the_connection_closed(url):
    head = (f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {API_KEY}\r\n"
            "Content-Type: application/json\r\nContent-Length: 999999999999\r\n\r\n{").encode()
    reply, took = _talk(url, head)
    assert took < 4, took
    assert not reply.startswith(b"HTTP/1.1 200")


def test_headers_over_the_limit_get_431(url):
    big = b"GET /health HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * 9000 + b"\r\n\r\n"
    reply, _ = _talk(url, big)
    assert reply.startswith(b"HTTP/1.1 431 ") and b"limit of 8192 bytes" in reply


def test_ordinary_and_kept_alive_requests_are_unaffected(url):
    with httpx.Client(headers=HEADERS, timeout=30) as client:
        for _ in range(2):
            r = client.post(f"{url}/v1/completions", json={"model": "tiny", "prompt": [5] * 4000, "max_tokens": 3,
                                                           "ignore_eos": True})
            assert r.status_code == 400 and "context length" in r.text  # a 12 KB body is read whole
            time.sleep(1.5)  # idle past the header timeout between requests: keep-alive's bound, not the head's
            r = client.post(f"{url}/v1/completions", json={"model": "tiny", "prompt": [5, 6, 7], "max_tokens": 3,
                                                           "ignore_eos": True})
            assert r.status_code == 200, r.text
        assert client.get(f"{url}/health").status_code == 200


def test_the_bounds_reach_uvicorn_and_non_positive_values_are_refused():
    import argparse

    from dsinfer.server.cli import add_serve_args, check_serve_args, uvicorn_options

    parser = add_serve_args(argparse.ArgumentParser())
    options = uvicorn_options(parser.parse_args(["m", "--limit-concurrency", "64"]))
    assert options["limit_concurrency"] == 64 and options["http"].__name__ == "BoundedH11Protocol"
    for flag in ("--max-waiting-tokens", "--header-timeout", "--body-timeout", "--max-header-kb",
                 "--limit-concurrency"):
        with pytest.raises(ValueError, match=f"{flag} 0(\\.0)?: must be > 0"):
            check_serve_args(parser.parse_args(["m", flag, "0"]))
