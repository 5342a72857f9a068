"""The prompts a serving benchmark sends: random token ids, random ids behind shared prefixes, or a JSONL file.

A JSONL line is one request: ``{"prompt": "text"}``, ``{"prompt_token_ids": [1, 2, 3]}`` or
``{"messages": [{"role": "user", "content": "..."}]}`` (sent to the chat endpoint), with an optional
``"output_len"`` (the request's ``max_tokens``; default ``--random-output-len``)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

DATASETS = ("random", "shared-prefix", "jsonl")
MIN_TOKEN_ID = 100  # random ids start above the special tokens most vocabularies put first


@dataclass(frozen=True)
class BenchRequest:
    """One request to send: exactly one of ``prompt`` (text or token ids) and ``messages`` is set."""

    prompt: str | list[int] | None
    messages: list[dict[str, Any]] | None
    prompt_len: int  # tokens for id prompts; for text, the server's usage count replaces it in the result
    output_len: int


def _lengths(rng: np.random.Generator, mean: int, range_ratio: float, count: int) -> np.ndarray:
    """vLLM's ``--random-range-ratio``: lengths uniform in [mean * (1 - r), mean * (1 + r)]."""
    if not 0.0 <= range_ratio < 1.0:
        raise ValueError(f"--random-range-ratio must be in [0, 1), got {range_ratio}")
    low, high = int(mean * (1 - range_ratio)), int(mean * (1 + range_ratio))
    return rng.integers(max(low, 1), max(high, 1) + 1, size=count)


def random_requests(num_prompts: int, input_len: int, output_len: int, vocab_size: int, seed: int = 0,
                    range_ratio: float = 0.0, prefix_len: int = 0) -> list[BenchRequest]:
    """Random token-id prompts of about ``input_len`` tokens, each behind the same ``prefix_len`` random ids."""
    if vocab_size <= MIN_TOKEN_ID:
        raise ValueError(f"--random-vocab-size must exceed {MIN_TOKEN_ID}, got {vocab_size}")
    rng = np.random.default_rng(seed)
    prefix = rng.integers(MIN_TOKEN_ID, vocab_size, size=prefix_len).tolist()
    in_lens = _lengths(rng, input_len, range_ratio, num_prompts)
    out_lens = _lengths(rng, output_len, range_ratio, num_prompts)
    out = []
    for n_in, n_out in zip(in_lens, out_lens):
        ids = prefix + rng.integers(MIN_TOKEN_ID, vocab_size, size=int(n_in)).tolist()
        out.append(BenchRequest(ids, None, len(ids), int(n_out)))
    return out


def shared_prefix_requests(num_prompts: int, num_prefixes: int, prefix_len: int, suffix_len: int,
                           output_len: int, vocab_size: int, seed: int = 0) -> list[BenchRequest]:
    """``num_prefixes`` random prefixes of ``prefix_len`` ids, each request one of them (in turn) followed by its
    own ``suffix_len`` random ids: the prefix cache's best case once each prefix has been prefilled."""
    if num_prefixes < 1:
        raise ValueError(f"--shared-prefix-num-prefixes must be at least 1, got {num_prefixes}")
    rng = np.random.default_rng(seed)
    prefixes = [rng.integers(MIN_TOKEN_ID, vocab_size, size=prefix_len).tolist() for _ in range(num_prefixes)]
    out = []
    for i in range(num_prompts):
        ids = prefixes[i % num_prefixes] + rng.integers(MIN_TOKEN_ID, vocab_size, size=suffix_len).tolist()
        out.append(BenchRequest(ids, None, len(ids), output_len))
    return out


def jsonl_requests(path: str | Path, num_prompts: int, output_len: int) -> list[BenchRequest]:
    """The first ``num_prompts`` lines of a JSONL file (cycled when the file has fewer)."""
    lines = [line for line in Path(path).read_text().splitlines() if line.strip()]
    if not lines:
        raise ValueError(f"--dataset-path {path} holds no requests")
    out = []
    for i in range(num_prompts):
        row = json.loads(lines[i % len(lines)])
        n_out = int(row.get("output_len", output_len))
        if "messages" in row:
            out.append(BenchRequest(None, row["messages"], 0, n_out))
        elif "prompt_token_ids" in row:
            out.append(BenchRequest(list(row["prompt_token_ids"]), None, len(row["prompt_token_ids"]), n_out))
        elif "prompt" in row:
            out.append(BenchRequest(row["prompt"], None, 0, n_out))
        else:
            raise ValueError(f"{path} line {i % len(lines) + 1}: expected 'prompt', 'prompt_token_ids' or "
                             f"'messages', got keys {sorted(row)}")
    return out


def build_requests(args) -> list[BenchRequest]:
    """The requests of ``dsinfer bench serve``'s dataset flags."""
    if args.dataset_name == "random":
        return random_requests(args.num_prompts, args.random_input_len, args.random_output_len,
                               args.random_vocab_size, args.seed, args.random_range_ratio, args.random_prefix_len)
    if args.dataset_name == "shared-prefix":
        return shared_prefix_requests(args.num_prompts, args.shared_prefix_num_prefixes, args.shared_prefix_len,
                                      args.random_input_len, args.random_output_len, args.random_vocab_size,
                                      args.seed)
    if args.dataset_name == "jsonl":
        if not args.dataset_path:
            raise ValueError("--dataset-name jsonl needs --dataset-path FILE")
        return jsonl_requests(args.dataset_path, args.num_prompts, args.random_output_len)
    raise ValueError(f"--dataset-name must be one of {', '.join(DATASETS)}, got {args.dataset_name!r}")
