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


def _token(tokenizer: Any, token_id: int, lp: Logprob | None, as_token_ids: bool) -> str:
    """A logprobs entry's ``token``: the text, or vLLM's ``token_id:N`` (``--return-tokens-as-token-ids``, or the
    request's ``return_tokens_as_token_ids``) for clients that need the exact ids, which text cannot always give
    back (a byte of a multi-byte character decodes to U+FFFD)."""
    return f"token_id:{token_id}" if as_token_ids else _token_text(tokenizer, token_id, lp)


def _top(position: dict[int, Logprob], k: int) -> list[tuple[int, Logprob]]:
    ranked = sorted(position.items(), key=lambda kv: (kv[1].rank or 1 << 30, -kv[1].logprob))
    return ranked[:k]


def chat_logprobs(
    tokenizer: Any, token_ids: list[int], positions: list[dict[int, Logprob]] | None, top_k: int,
    as_token_ids: bool = False,
) -> list[dict[str, Any]]:
    """``choices[i].logprobs.content`` entries for the given tokens. With ``as_token_ids`` the tokens are
    ``token_id:N``; as vLLM, the sampled token's ``bytes`` stay those of its text, the top entries' are those of
    their ``token`` string."""
    content = []
    for tid, position in zip(token_ids, positions or []):
        lp = position.get(tid)
        top = [
            {
                "token": (t := _token(tokenizer, i, p, as_token_ids)),
                "logprob": _finite(p.logprob),
                "bytes": list(t.encode()),
            }
            for i, p in _top(position, top_k)
        ]
        content.append(
            {
                "token": _token(tokenizer, tid, lp, as_token_ids),
                "logprob": _finite(lp.logprob if lp else -math.inf),
                "bytes": list(_token_text(tokenizer, tid, lp).encode()),
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
    as_token_ids: bool = False,
) -> tuple[dict[str, Any], int]:
    """``choices[i].logprobs`` of the legacy completions API, and the text offset after these tokens. The
    offsets count the tokens' text, also when ``as_token_ids`` writes them as ``token_id:N`` (vLLM counts the
    ``token_id:N`` strings, which would point past the text). ``top_logprobs`` holds the chosen token besides
    the ``top_k`` most likely ones, so up to ``top_k + 1`` entries, as OpenAI's legacy API and vLLM answer."""
    tokens, token_logprobs, tops, offsets = [], [], [], []
    for tid, position in zip(token_ids, positions or []):
        lp = position.get(tid)
        token = _token(tokenizer, tid, lp, as_token_ids)
        tokens.append(token)
        token_logprobs.append(_finite(lp.logprob if lp else -math.inf))
        chosen = {token: _finite(lp.logprob)} if lp is not None else {}
        tops.append(chosen | {_token(tokenizer, i, p, as_token_ids): _finite(p.logprob)
                              for i, p in _top(position, top_k)})
        offsets.append(text_offset)
        text_offset += len(_token_text(tokenizer, tid, lp))
    logprobs = {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": tops, "text_offset": offsets}
    return logprobs, text_offset


def prompt_completion_logprobs(
    tokenizer: Any, prompt_ids: list[int], positions: list[dict[int, Logprob] | None], top_k: int,
    as_token_ids: bool = False,
) -> dict[str, Any]:
    """The echoed prompt's part of ``choices[i].logprobs`` (completions with ``echo``): the first token has no
    logprob (nothing precedes it), so its entries are null, as in OpenAI's legacy API."""
    first = _token_text(tokenizer, prompt_ids[0], None)
    out, _ = completion_logprobs(tokenizer, prompt_ids[1:], [p or {} for p in positions[1:]], top_k, len(first),
                                 as_token_ids)
    out["text_offset"].insert(0, 0)
    out["tokens"].insert(0, _token(tokenizer, prompt_ids[0], None, as_token_ids))
    out["token_logprobs"].insert(0, None)
    out["top_logprobs"].insert(0, None)
    return out


def prompt_logprobs_entries(tokenizer: Any, positions: list[dict[int, Logprob] | None] | None,
                            ) -> list[dict[str, dict[str, Any]] | None] | None:
    """vLLM's ``prompt_logprobs`` of a chat or completions answer: per prompt position None (the first) or
    ``{token_id: {"logprob", "rank", "decoded_token"}}``, -inf clamped to -9999.0 as vLLM's."""
    if positions is None:
        return None
    return [
        None if position is None else {
            str(tid): {"logprob": _finite(lp.logprob), "rank": lp.rank,
                       "decoded_token": _token_text(tokenizer, tid, lp)}
            for tid, lp in position.items()
        }
        for position in positions
    ]
