"""Request identity (issue 45): ids a client supplies (``X-Request-Id``, body fields such as ``request_id`` or
``user``) are labels only; the engine's ids are the server's own, so colliding or guessed ids never abort, read
or stream another client's request. A client that hangs up aborts its own request, never one sharing its
label or one whose server id it names."""

from __future__ import annotations

import json
import threading

import httpx

from .live_server import API_KEY

LABEL = "same-label"
LONG = {"max_tokens": 24, "ignore_eos": True, "temperature": 0}


def _headers(request_id: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {API_KEY}", "X-Request-Id": request_id}


def _stream_whole(url: str, body: dict, request_id: str, out: dict) -> None:
    body = {**body, "stream": True, "stream_options": {"include_usage": True}}
    with httpx.stream("POST", f"{url}/v1/completions", json=body, headers=_headers(request_id), timeout=60) as r:
        out["status"], out["echoed"] = r.status_code, r.headers.get("x-request-id")
        events = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    out["ids"] = {e["id"] for e in events}
    out["tokens"] = events[-1]["usage"]["completion_tokens"]
    out["text"] = "".join(c["text"] for e in events for c in e["choices"])
    out["finish"] = [c["finish_reason"] for e in events for c in e["choices"] if c["finish_reason"]]


def _hang_up_after_first_event(url: str, body: dict, request_id: str) -> str:
    with httpx.stream("POST", f"{url}/v1/completions", json={**body, "stream": True}, headers=_headers(request_id),
                      timeout=60) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                return json.loads(line[6:])["id"]
    raise AssertionError("no event came")


def test_a_client_hanging_up_with_the_same_label_aborts_only_its_own_request(server):
    body = {"prompt": "Once upon a time", **LONG, "request_id": LABEL, "user": LABEL}
    results: list[dict] = [{} for _ in range(3)]
    keepers = [threading.Thread(target=_stream_whole, args=(server.url, body, LABEL, out)) for out in results]
    for t in keepers:
        t.start()
    for _ in range(3):  # colliding labels hanging up while the others stream
        _hang_up_after_first_event(server.url, body, LABEL)
    for t in keepers:
        t.join(60)
    assert not any(t.is_alive() for t in keepers)
    for out in results:
        assert out["status"] == 200 and out["echoed"] == LABEL
        assert out["tokens"] == LONG["max_tokens"] and out["text"] and out["finish"] == ["length"]  # not cut
    ids = [next(iter(out["ids"])) for out in results]
    assert all(len(out["ids"]) == 1 for out in results) and len(set(ids)) == 3 and LABEL not in ids


def test_naming_another_requests_server_id_neither_aborts_nor_reads_it(server):
    body = {"prompt": "The history of Rome", **LONG}
    victim: dict = {}
    first_id: list[str] = []

    def victim_stream() -> None:
        with httpx.stream("POST", f"{server.url}/v1/completions", json={**body, "stream": True, "stream_options": {
                "include_usage": True}}, headers=_headers("victim"), timeout=60) as r:
            events = []
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    events.append(json.loads(line[6:]))
                    if len(events) == 1:
                        first_id.append(events[0]["id"])
                        seen.set()
                        go_on.wait(30)
        victim["ids"] = {e["id"] for e in events}
        victim["tokens"] = events[-1]["usage"]["completion_tokens"]
        victim["finish"] = [c["finish_reason"] for e in events for c in e["choices"] if c["finish_reason"]]

    seen, go_on = threading.Event(), threading.Event()
    t = threading.Thread(target=victim_stream)
    t.start()
    assert seen.wait(30)
    guessed = first_id[0]
    # the guesser names the victim's id as its label and in the body, reads one event, then hangs up
    own = _hang_up_after_first_event(server.url, {"prompt": "Hi", **LONG, "request_id": guessed}, guessed)
    answer = server.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 2, "request_id": guessed},
                         **{"X-Request-Id": guessed})
    go_on.set()
    t.join(60)
    assert own != guessed and answer.status_code == 200 and answer.json()["id"] != guessed
    assert victim["ids"] == {guessed} and victim["tokens"] == LONG["max_tokens"] and victim["finish"] == ["length"]
