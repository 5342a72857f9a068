"""Prefill/decode disaggregation through the shared KV store (``kv_store.dir`` the same on every replica).

1. The prefill replica (``PrefillBuckets``: by prompt length bucket) gets the request with one output token, not
   streamed, and ``x-dsinfer-kv-flush`` (``server/load.py``): it computes the prompt, its KV store saves every
   full grain to the shared directory, and it answers once they are written. Its first token is not relayed;
2. the decode replica (the router's policy) gets the client's request unchanged: its scheduler finds the
   prompt's grains in the directory, loads them, recomputes the tail (the tokens after the last full grain, at
   least the last prompt token, whose logits give the first output token) and decodes; its answer or stream
   goes to the client as it comes. So its output is the one a single replica gives (greedy: the same tokens).

A prompt shorter than the prefill replicas' grain has nothing to store: it goes to a decode replica directly.
So does every request while no prefill replica is available, and a prefill answer other than 200 (a 400 for
a bad request) is the client's answer.
"""

from __future__ import annotations

import json
import time
from typing import Any

from starlette.responses import Response

from dsinfer.router.policy import PrefillBuckets
from dsinfer.router.proxy import Chooser, Forward, Opened, Proxy, answer_headers

FLUSH_HEADER = "x-dsinfer-kv-flush"
# body fields that only shape the output: the prefill step leaves them out (its one token is thrown away)
_OUTPUT_ONLY = ("stream", "stream_options", "n", "best_of", "echo", "prompt_logprobs", "min_tokens",
                "max_completion_tokens", "logprobs", "top_logprobs")


def prefill_body(path: str, body: dict[str, Any]) -> dict[str, Any]:
    """The request for the prefill step: the same prompt, one output token, no stream."""
    out = {k: v for k, v in body.items() if k not in _OUTPUT_ONLY}
    out["max_output_tokens" if path == "/v1/responses" else "max_tokens"] = 1
    return out


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
            else:
                self.proxy.metrics.decisions.labels("prefill_failed").inc()
        else:
            self.proxy.metrics.decisions.labels("decode_only").inc()
        return await self.proxy.send(fwd, decode)
