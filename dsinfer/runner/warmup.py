"""Compile the kernels of prefill-sized steps at start-up, not inside the first large batches.

Decode steps are compiled by the CUDA-graph capture. A prefill or mixed step runs eagerly, and Triton compiles a
kernel the first time it meets a new tile config (the fused MoE picks its tiles by pairs per expert) or a new
specialization of an integer argument (Triton specializes on ``% 16 == 0`` and ``== 1``). On a fresh machine
that was seconds of compiles inside the first batches: DeepSeek-V2-Lite offline, 512 x 1000 in / 100 out, took
22 s in a new process and 8 s once compiled (H200, 2026-11-29).

The warm-up runs the model on dummy prefill batches at token counts from one token to the step budget (powers
of two and one less), split into sequences of up to 1k tokens as prompts would be. Nothing is stored (every
slot is -1); the logits of each sequence's last token are computed, as a step would, and dropped.
"""

from __future__ import annotations

import logging
import time

import torch
from torch import nn

from dsinfer.runner.forward_batch import ForwardBatch

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


def dummy_prefill_batch(num_tokens: int, max_seq_tokens: int, block_size: int, device: torch.device) -> ForwardBatch:
    """``num_tokens`` prompt tokens in sequences of ``max_seq_tokens`` (the last one shorter), stored nowhere."""
    full, rest = divmod(num_tokens, max_seq_tokens)
    lens = [max_seq_tokens] * full + ([rest] if rest else [])
    lengths = torch.tensor(lens, dtype=torch.int32)
    cu = torch.zeros(len(lens) + 1, dtype=torch.int32)
    torch.cumsum(lengths, 0, out=cu[1:])
    positions = torch.cat([torch.arange(n) for n in lens])
    width = -(-max(lens) // block_size)
    return ForwardBatch(
        input_ids=torch.zeros(num_tokens, dtype=torch.int64, device=device),
        positions=positions.to(device),
        slot_mapping=torch.full((num_tokens,), -1, dtype=torch.int64, device=device),
        block_tables=torch.zeros(len(lens), width, dtype=torch.int32, device=device),
        query_start_loc=cu.to(device),
        seq_lens=lengths.to(device),
        logits_indices=(cu[1:] - 1).long().to(device),
        max_query_len=max(lens),
        max_seq_len=max(lens),
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
            batch = dummy_prefill_batch(n, seq_tokens, block_size, device)
            hidden = model(batch.input_ids, batch.positions, batch)
            model.compute_logits(hidden[batch.logits_indices])
        if device.type == "cuda":
            torch.cuda.synchronize(device)
    except Exception as exc:  # noqa: BLE001 (a warm-up must not stop the engine)
        logger.warning("prefill warm-up failed (%s: %s); kernels compile on first use", type(exc).__name__, exc)
        return
    logger.info("prefill warm-up: %d step sizes up to %d tokens in %.1f s", len(counts), max_tokens,
                time.perf_counter() - started)
