"""Compile the kernels of prefill-sized steps at start-up, not inside the first large batches.

Decode steps are compiled by the CUDA-graph capture. A prefill or mixed step runs eagerly, and Triton compiles a
kernel the first time it meets a new tile config (the fused MoE picks its tiles by pairs per expert) or a new
specialization of an integer argument (Triton specializes on ``% 16 == 0`` and ``== 1``). On a fresh machine
that was seconds of compiles inside the first batches: DeepSeek-V2-Lite offline, 512 x 1000 in / 100 out, took
22 s in a new process and 8 s once compiled (H200, 2026-11-29).

The warm-up runs the model on dummy prefill batches at token counts from one token to the step budget (powers
of two and one less), split into sequences of up to 1k tokens as prompts would be, and again with a sixteenth
of the tokens as one-token decode rows over a short context (a mixed step). Nothing is stored (every slot is
-1); the logits of each sequence's last token are computed, as a step would, and dropped.
"""

from __future__ import annotations

import logging
import time

import torch
from torch import nn

from dsinfer.core.forward_batch import ForwardBatch

logger = logging.getLogger("dsinfer")

SEQUENCE_TOKENS = 1024  # the prompt length the dummy sequences are cut to


def prefill_token_counts(max_tokens: int) -> list[int]:
    """1, then 2^k - 1 and 2^k for 16 <= 2^k < max_tokens, then max_tokens - 1 and max_tokens."""
    counts = {1, max_tokens, max(1, max_tokens - 1)}
    n = 16
    while n < max_tokens:
        counts.update((n - 1, n))
        n *= 2
    return sorted(counts)


def dummy_prefill_batch(num_tokens: int, max_seq_tokens: int, block_size: int, device: torch.device,
                        decode_rows: int = 0, decode_context: int = 64) -> ForwardBatch:
    """``num_tokens`` tokens: ``decode_rows`` one-token rows with ``decode_context`` tokens of context (decode
    requests riding along a chunked prefill), then prompt tokens in sequences of ``max_seq_tokens`` (the last
    one shorter). Stored nowhere (slots -1); the context rows read block 0."""
    prompt = num_tokens - decode_rows
    full, rest = divmod(prompt, max_seq_tokens)
    q_lens = [1] * decode_rows + [max_seq_tokens] * full + ([rest] if rest else [])
    ctx_lens = [decode_context] * decode_rows + q_lens[decode_rows:]
    cu = torch.zeros(len(q_lens) + 1, dtype=torch.int32)
    torch.cumsum(torch.tensor(q_lens, dtype=torch.int32), 0, out=cu[1:])
    positions = torch.cat([torch.arange(c - q, c) for q, c in zip(q_lens, ctx_lens)])
    width = -(-max(ctx_lens) // block_size)
    return ForwardBatch(
        input_ids=torch.zeros(num_tokens, dtype=torch.int64, device=device),
        positions=positions.to(device),
        slot_mapping=torch.full((num_tokens,), -1, dtype=torch.int64, device=device),
        block_tables=torch.zeros(len(q_lens), width, dtype=torch.int32, device=device),
        query_start_loc=cu.to(device),
        seq_lens=torch.tensor(ctx_lens, dtype=torch.int32, device=device),
        logits_indices=(cu[1:] - 1).long().to(device),
        max_query_len=max(q_lens),
        max_seq_len=max(ctx_lens),
    )


@torch.inference_mode()
def warm_up_prefill(model: nn.Module, max_tokens: int, max_model_len: int, block_size: int,
                    device: torch.device) -> None:
    """Run the prefill forward at every count of ``prefill_token_counts(max_tokens)``; a failure is logged and
    left to the real steps (which would meet the same error)."""
    started = time.perf_counter()
    counts = prefill_token_counts(max_tokens)
    seq_tokens = max(1, min(SEQUENCE_TOKENS, max_model_len))
    try:
        for n in counts:
            # a prompt-only step, and from 32 tokens on one with decode rows riding along (a mixed step)
            for decode_rows in (0, n // 16) if n >= 32 else (0,):
                batch = dummy_prefill_batch(n, seq_tokens, block_size, device, decode_rows,
                                            min(64, max_model_len))
                hidden = model(batch.input_ids, batch.positions, batch)
                model.compute_logits(hidden[batch.logits_indices])
        if device.type == "cuda":
            torch.cuda.synchronize(device)
    except Exception as exc:  # noqa: BLE001 (a warm-up must not stop the engine)
        logger.warning("prefill warm-up failed (%s: %s); kernels compile on first use", type(exc).__name__, exc)
        return
    logger.info("prefill warm-up: %d step sizes up to %d tokens in %.1f s", len(counts), max_tokens,
                time.perf_counter() - started)


@torch.inference_mode()
def measure_step_latency(model: nn.Module, token_counts: list[int], max_model_len: int, block_size: int,
                         device: torch.device, repeats: int = 3) -> dict[int, float]:
    """Seconds of a decode step of each of ``token_counts`` tokens (that many one-token rows over a short
    context, every row's logits computed), the median of ``repeats`` runs after one unmeasured run: the
    step-latency curve's first points (``core.step_latency``). Nothing is stored (every slot is -1)."""
    context = max(1, min(64, max_model_len))
    points: dict[int, float] = {}
    for n in token_counts:
        batch = dummy_prefill_batch(n, 1, block_size, device, decode_rows=n, decode_context=context)
        times = []
        for i in range(repeats + 1):
            started = time.perf_counter()
            hidden = model(batch.input_ids, batch.positions, batch)
            model.compute_logits(hidden[batch.logits_indices])
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            if i:
                times.append(time.perf_counter() - started)
        points[n] = sorted(times)[len(times) // 2]
    return points
