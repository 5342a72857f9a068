"""Engine logprobs → the OpenAI chat and completions wire shapes."""

from __future__ import annotations

import math
from typing import Any

from dsinfer.engine.outputs import Logprob


def _finite(value: float) -> float:
    return value if math.isfinite(value) else -9999.0


def _token_text(tokenizer: Any, token_id: int, lp: Logprob | None) -> str:
    if lp is not None and lp.decoded_token is not None:
        return lp.decoded_token
    return tokenizer.decode([token_id], skip_special_tokens=False)


def _top(position: dict[int, Logprob], k: int) -> list[tuple[int, Logprob]]:
    ranked = sorted(position.items(), key=lambda kv: (kv[1].rank or 1 << 30, -kv[1].logprob))
    return ranked[:k]


def chat_logprobs(
    tokenizer: Any, token_ids: list[int], positions: list[dict[int, Logprob]] | None, top_k: int
) -> list[dict[str, Any]]:
    """``choices[i].logprobs.content`` entries for the given tokens."""
    content = []
    for tid, position in zip(token_ids, positions or []):
        lp = position.get(tid)
        text = _token_text(tokenizer, tid, lp)
        top = [
            {
                "token": (t := _token_text(tokenizer, i, p)),
                "logprob": _finite(p.logprob),
                "bytes": list(t.encode()),
            }
            for i, p in _top(position, top_k)
        ]
        content.append(
            {
                "token": text,
                "logprob": _finite(lp.logprob if lp else -math.inf),
                "bytes": list(text.encode()),
                "top_logprobs": top,
            }
        )
    return content


def completion_logprobs(
    tokenizer: Any,
    token_ids: list[int],
    positions: list[dict[int, Logprob]] | None,
    top_k: int,
    text_offset: int = 0,
) -> dict[str, Any]:
    """``choices[i].logprobs`` of the legacy completions API."""
    tokens, token_logprobs, tops, offsets = [], [], [], []
    for tid, position in zip(token_ids, positions or []):
        lp = position.get(tid)
        text = _token_text(tokenizer, tid, lp)
        tokens.append(text)
        token_logprobs.append(_finite(lp.logprob if lp else -math.inf))
        tops.append({_token_text(tokenizer, i, p): _finite(p.logprob) for i, p in _top(position, top_k)})
        offsets.append(text_offset)
        text_offset += len(text)
    return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": tops, "text_offset": offsets}


def prompt_completion_logprobs(
    tokenizer: Any, prompt_ids: list[int], positions: list[dict[int, Logprob] | None], top_k: int
) -> dict[str, Any]:
    """The echoed prompt's part of ``choices[i].logprobs`` (completions with ``echo``): the first token has no
    logprob (nothing precedes it), so its entries are null, as in OpenAI's legacy API."""
    out = completion_logprobs(tokenizer, prompt_ids[1:], [p or {} for p in positions[1:]], top_k)
    first = _token_text(tokenizer, prompt_ids[0], None)
    out["text_offset"] = [0] + [o + len(first) for o in out["text_offset"]]
    out["tokens"].insert(0, first)
    out["token_logprobs"].insert(0, None)
    out["top_logprobs"].insert(0, None)
    return out
