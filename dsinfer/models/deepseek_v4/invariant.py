"""V4 attention in the deterministic mode: a query row gets the same bits in a prefill, a chunk, a decode batch.

The fast path lays a sequence's keys out as the step happens to hold them (ring rows, then the step's rows, then
the entries), so a query's sums run in an order that depends on how its sequence was chunked. Here every query
reads a layout fixed by its own position: its window by offset (key j at position t - j, W slots) and the
compressed entries by index, each part zero-padded to a multiple of ``CHUNK`` keys. Softmax weights are summed
with a sequential ``cumsum`` and the weighted values per fixed ``CHUNK``-key chunk, accumulated over the chunks in
order (masked keys and padding add exact zeros, so more padding never changes a bit), as
``batch_invariant.attention`` does for paged attention; the matmuls go through the mode's invariant ones.
"""

from __future__ import annotations

import torch

CHUNK = 64


def _pad(x: torch.Tensor, dim: int, value: float | bool) -> torch.Tensor:
    """Pad ``dim`` of x to a multiple of CHUNK (at least one chunk) with ``value``."""
    size = x.shape[dim]
    padded = max(-(-size // CHUNK), 1) * CHUNK
    if padded == size:
        return x
    shape = list(x.shape)
    shape[dim] = padded - size
    return torch.cat((x, x.new_full(shape, value)), dim=dim)


def attend_invariant(q: torch.Tensor, window: torch.Tensor, window_valid: torch.Tensor, entries: torch.Tensor,
                     entry_visible: torch.Tensor, sink: torch.Tensor, scale: float) -> torch.Tensor:
    """q [n, H, D]; each query's window keys by offset [n, W, D] and which exist [n, W]; the sequence's entries
    [m, D] and which each query sees [n, m]; the per-head sink logits [H] -> [n, H, D] (float32). K is V."""
    n, heads, d = q.shape
    q = q.float()
    window, valid = _pad(window.float(), 1, 0.0), _pad(window_valid, 1, False)
    entries, visible = _pad(entries.float(), 0, 0.0), _pad(entry_visible, 1, False)
    scores = torch.cat((torch.bmm(q, window.transpose(1, 2)),
                        (q.reshape(n * heads, d) @ entries.t()).view(n, heads, -1)), dim=-1) * scale
    mask = torch.cat((valid, visible), dim=1).unsqueeze(1)
    scores = scores.masked_fill(~mask, float("-inf"))
    sink = sink.float().view(1, heads, 1)
    peak = torch.maximum(scores.amax(-1, keepdim=True), sink)
    probs = torch.exp(scores - peak)
    denom = probs.cumsum(-1)[..., -1:] + torch.exp(sink - peak)
    w = window.shape[1]
    parts = [torch.bmm(probs[..., c:c + CHUNK], window[:, c:c + CHUNK]) for c in range(0, w, CHUNK)]
    flat = probs[..., w:].reshape(n * heads, -1)
    parts += [(flat[:, c:c + CHUNK] @ entries[c:c + CHUNK]).view(n, heads, d)
              for c in range(0, entries.shape[0], CHUNK)]
    return torch.stack(parts).cumsum(0)[-1] / denom
