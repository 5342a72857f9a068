"""Batch-invariant (deterministic) mode: every op on the forward path reduces in an order that does not depend
on the batch size, a row's position in the batch, chunked prefill or prefix-cache hits.

``batch_invariant(enabled)`` is a context manager (the runner enters it around the forward pass; nesting is
refused). Inside it:
- matmuls (``aten.linear/mm/addmm/bmm/matmul``) go to ``matmul.py``: on CPU, MKL is called only with exactly 16
  rows (the last block padded: MKL's accumulation order depends on the row count for some shapes, not on a
  row's place among a fixed count); on CUDA a Triton GEMM with one fixed tile configuration and
  no split-K;
- ``ops.paged_attention`` goes to ``attention.py``: every query row, prefill or decode, is computed the same way
  (fixed 64-key chunks combined sequentially), whatever its companions;
- DeepSeek MLA (``mla.py``): every row, prefill, chunk, prefix hit or decode, attends in the absorbed form over
  the paged latent cache by one fixed-order recipe (``layers.mla`` switches to it in this mode);
- MoE (``moe.py``): experts ordered by id per token, weights normalized and the top-k pairs summed sequentially
  in that order, expert GEMMs with row-independent results (fixed Triton tiles on CUDA, FP8 linears too);
- on CPU, ``aten.sigmoid`` and ``aten.silu`` go to ``elementwise.py``: torch's CPU kernels give an element other
  bits in a vectorized loop's scalar tail, and where the tails fall depends on the batch;
- norms, rotary, other activations, sampling and logprobs are already per-row (one row's reduction never depends
  on other rows) and stay as they are.
"""

from dsinfer.batch_invariant.mode import batch_invariant, is_enabled

__all__ = ["batch_invariant", "is_enabled"]
