"""Prefill/decode disaggregation through the shared KV store (``kv_store.dir`` the same on every replica).

1. The prefill replica (``PrefillBuckets``: by prompt length bucket) gets the request with one output token, not
   streamed, and ``x-dsinfer-kv-flush`` (``server/load.py``): it computes the prompt, its KV store saves every
   full grain to the shared directory, and it answers once they are written, with its token's id
   (``return_token_ids``) on the chat and text completion routes;
2. the decode replica (the router's policy) gets the client's request unchanged, plus ``x-dsinfer-first-token``
   with that id when the request can take it (``carries_first_token``): its engine appends the token as its first
   sample and sends it out at once, before any step (the client's first token comes when the prefill is done),
   then finds the prompt's grains in the directory, loads them, computes the tail (the tokens after the last full
   grain, and the first token) and decodes from there. Its answer or stream goes to the client as it comes: the
   one a single replica gives (greedy: the same tokens; usage counts the first token as generated). Without the
   header (the Responses and Messages routes, logprobs, n > 1, structured outputs), the decode replica samples
   the first token again from the recomputed tail: the same output, the first token later.

A prompt shorter than the prefill replicas' grain has nothing to store: it goes to a decode replica directly.
So does every request while no prefill replica is available, and a prefill answer other than 200 (a 400 for
a bad request) is the client's answer.
"""

from __future__ import annotations

import dataclasses
import json
import time
from typing import Any

from starlette.responses import Response

from dsinfer.router.policy import PrefillBuckets
from dsinfer.router.proxy import Chooser, Forward, Opened, Proxy, answer_headers

FLUSH_HEADER = "x-dsinfer-kv-flush"
FIRST_TOKEN_HEADER = "x-dsinfer-first-token"
FIRST_TOKEN_ROUTES = ("/v1/completions", "/v1/chat/completions")  # answers with ``return_token_ids``
# fields under which a preset first token cannot stand for the decode replica's first sample (its engine refuses
# it: logprobs it lacks, a grammar it must advance, several samples, or an answer that is not the generation)
_OWN_FIRST_SAMPLE = ("logprobs", "top_logprobs", "echo", "best_of", "use_beam_search", "response_format",
                     "structured_outputs", "guided_json", "guided_regex", "guided_choice", "guided_grammar")
# body fields that only shape the output: the prefill step leaves them out (its one token is thrown away)
_OUTPUT_ONLY = ("stream", "stream_options", "n", "best_of", "echo", "prompt_logprobs", "min_tokens",
                "max_completion_tokens", "logprobs", "top_logprobs")


def carries_first_token(path: str, body: dict[str, Any]) -> bool:
    """Whether the decode step can start from the prefill's first token: one sample of one prompt on a chat or
    text completion route, none of the fields under which the token must be the decode replica's own sample."""
    if path not in FIRST_TOKEN_ROUTES or body.get("n", 1) != 1 or body.get("max_tokens") == 0:
        return False
    if any(body.get(k) is not None and body.get(k) is not False for k in _OWN_FIRST_SAMPLE
           if k != "response_format"):  # logprobs: 0 asks for them (the chosen token's)
        return False
    if (body.get("response_format") or {"type": "text"}).get("type", "text") != "text":
        return False
    tool_choice = body.get("tool_choice")
    if isinstance(tool_choice, dict) or (tool_choice == "required" and body.get("tools")):
        return False
    prompt = body.get("prompt")
    return not (isinstance(prompt, list) and prompt and isinstance(prompt[0], str | list))  # one prompt


def prefill_body(path: str, body: dict[str, Any]) -> dict[str, Any]:
    """The request for the prefill step: the same prompt, one output token, no stream; its token's id in the
    answer where the decode step will start from it."""
    out = {k: v for k, v in body.items() if k not in _OUTPUT_ONLY}
    out["max_output_tokens" if path == "/v1/responses" else "max_tokens"] = 1
    if carries_first_token(path, body):
        out["return_token_ids"] = True
    return out


def first_token_of(answer: bytes) -> int | None:
    """The first output token id of a prefill answer (``return_token_ids``); None when it holds none."""
    try:
        ids = json.loads(answer)["choices"][0]["token_ids"]
    except (ValueError, KeyError, IndexError, TypeError):
        return None
    return ids[0] if isinstance(ids, list) and ids and isinstance(ids[0], int) else None


class Disaggregation:
    def __init__(self, proxy: Proxy, buckets: PrefillBuckets):
        self.proxy = proxy
        self.pool = proxy.pool
        self.buckets = buckets

    def prefill_chooser(self, fwd: Forward) -> Chooser:
        def choose(tried: set[str]):
            replicas = self.pool.available(("prefill",))
            left = [r for r in replicas if r.url not in tried] or replicas
            return self.buckets.choose(left, fwd.info, time.monotonic()) if left else None

        return choose

    def worth_prefilling(self, fwd: Forward) -> bool:
        grains = [r.load.get("kv_store_grain") for r in self.pool.available(("prefill",))]
        grain = min((g for g in grains if g), default=None)
        return grain is not None and fwd.info.num_tokens >= grain

    async def serve(self, fwd: Forward, body: dict[str, Any] | None, decode: Chooser) -> Response:
        if body is not None and self.worth_prefilling(fwd):
            content = json.dumps(prefill_body(fwd.path, body)).encode()
            headers = [*[(k, v) for k, v in fwd.headers if k.lower() != "content-type"],
                       ("content-type", "application/json"), (FLUSH_HEADER, "1")]
            step = Forward(fwd.method, fwd.path, content, headers, False, fwd.info, fwd.started,
                           remember_prefix=False)
            opened = await self.proxy.open_answer(step, self.prefill_chooser(fwd))
            if isinstance(opened, Opened):
                last = opened.response.status_code != 200
                self.proxy.finished(opened, step, last=last)
                if last:
                    return Response(opened.first, opened.response.status_code,
                                    headers=answer_headers(opened.response, opened.replica))
                first = first_token_of(opened.first) if carries_first_token(fwd.path, body) else None
                if first is not None:
                    self.proxy.metrics.first_tokens.inc()
                    headers = [(k, v) for k, v in fwd.headers if k.lower() != FIRST_TOKEN_HEADER]
                    fwd = dataclasses.replace(fwd, headers=[*headers, (FIRST_TOKEN_HEADER, str(first))])
            else:
                self.proxy.metrics.decisions.labels("prefill_failed").inc()
        else:
            self.proxy.metrics.decisions.labels("decode_only").inc()
        return await self.proxy.send(fwd, decode)
