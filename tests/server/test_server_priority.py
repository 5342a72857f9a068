"""vLLM's ``priority`` request field: 400 (param "priority") on a server that schedules first come, first served;
on one started with ``--scheduling-policy priority`` the more urgent of two waiting requests runs first."""

from __future__ import annotations

import threading
import time

import pytest

from .live_server import start_server, stop_server

CHAT = {"max_tokens": 4, "messages": [{"role": "user", "content": "Hello"}]}
COMPLETION = {"max_tokens": 4, "prompt": "Hello"}


@pytest.mark.parametrize("path, body", [("/v1/chat/completions", CHAT), ("/v1/completions", COMPLETION),
                                        ("/v1/responses", {"max_output_tokens": 4, "input": "Hi"})])
def test_fcfs_server_answers_400_for_a_priority_other_than_zero(server, model, path, body):
    body = {**body, "model": model}
    for value in (1, -3):
        r = server.post(path, json={**body, "priority": value})
        assert r.status_code == 400, r.text
        error = r.json()["error"]
        assert error["param"] == "priority" and "priority scheduling is not enabled" in error["message"]
    assert server.post(path, json={**body, "priority": 0}).status_code == 200


@pytest.mark.parametrize("value", ["high", 1.5, True, 1 << 31, -(1 << 31) - 1])
def test_a_priority_that_is_not_a_32_bit_integer_is_400(server, model, value):
    r = server.post("/v1/chat/completions", json={**CHAT, "model": model, "priority": value})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == "priority"


@pytest.fixture(scope="module")
def priority_server(tmp_path_factory):
    live = start_server(tmp_path_factory.mktemp("priority"), "--scheduling-policy", "priority", "--max-num-seqs", "1")
    yield live
    stop_server(live)


def test_the_more_urgent_waiting_request_runs_first(priority_server):
    """One sequence slot: a long request holds it while a request of priority 5, then one of priority -5, queue
    up; the second overtakes the first."""
    finished: list[str] = []
    lock = threading.Lock()

    def ask(name: str, priority: int, max_tokens: int) -> None:
        body = {**COMPLETION, "max_tokens": max_tokens, "ignore_eos": True, "priority": priority}
        r = priority_server.post("/v1/completions", json=body)
        assert r.status_code == 200, r.text
        with lock:
            finished.append(name)

    threads = [threading.Thread(target=ask, args=args) for args in
               [("holder", 0, 160), ("later", 5, 4), ("urgent", -5, 4)]]
    for thread in threads:
        thread.start()
        time.sleep(0.3)
    for thread in threads:
        thread.join(120)
    assert finished == ["holder", "urgent", "later"]


def test_the_flag_is_checked_at_startup(tmp_path):
    with pytest.raises(RuntimeError, match="invalid choice"):
        start_server(tmp_path, "--scheduling-policy", "lifo", timeout=60)
