"""Triton kernels of the batch-invariant mode (CUDA path; also run by TRITON_INTERPRET=1 in the tests).

- ``matmul_invariant_triton``: C = A @ B with one fixed tile configuration (no autotuning on M, no split-K):
  every output element accumulates over K in the same BLOCK_K steps whatever M is or where its row falls;
  a batch of products ([G, M, K] @ [G, K, N]) is one launch of the same kernel (grid axis 2 = the product).
- ``paged_attention_invariant_triton``: one program per (query row, query head); keys are visited in fixed
  BLOCK_N blocks from position 0 with an online softmax, so a row's result never depends on its companions,
  on being part of a prefill chunk or a decode batch, or on the batch's longest sequence.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK_M, BLOCK_N, BLOCK_K = 64, 64, 32
ATTN_BLOCK_N = 64


@triton.jit
def _matmul_kernel(a_ptr, b_ptr, c_ptr, M, N, K, sag, sam, sak, sbg, sbk, sbn, scg, scm, scn,
                   BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    g = tl.program_id(2).to(tl.int64)
    a_ptr += g * sag
    b_ptr += g * sbg
    c_ptr += g * scg
    rm = pid_m * BM + tl.arange(0, BM)
    rn = pid_n * BN + tl.arange(0, BN)
    rk = tl.arange(0, BK)
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    for k0 in range(0, K, BK):
        ks = k0 + rk
        a = tl.load(a_ptr + rm[:, None] * sam + ks[None, :] * sak, mask=(rm[:, None] < M) & (ks[None, :] < K),
                    other=0.0)
        b = tl.load(b_ptr + ks[:, None] * sbk + rn[None, :] * sbn, mask=(ks[:, None] < K) & (rn[None, :] < N),
                    other=0.0)
        acc += tl.dot(a, b, input_precision="ieee")
    c = acc.to(c_ptr.dtype.element_ty)
    tl.store(c_ptr + rm[:, None] * scm + rn[None, :] * scn, c, mask=(rm[:, None] < M) & (rn[None, :] < N))


def matmul_invariant_triton(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a [M, K] @ b [K, N] -> [M, N], or a [G, M, K] @ b [G, K, N] -> [G, M, N], in a's dtype (float32
    accumulation)."""
    batched = a.dim() == 3
    a3, b3 = (a, b) if batched else (a.unsqueeze(0), b.unsqueeze(0))
    g, m, k = a3.shape
    n = b3.shape[2]
    out = torch.empty(g, m, n, dtype=a.dtype, device=a.device)
    if g and m and n:
        grid = (triton.cdiv(m, BLOCK_M), triton.cdiv(n, BLOCK_N), g)
        _matmul_kernel[grid](a3, b3, out, m, n, k, a3.stride(0), a3.stride(1), a3.stride(2),
                             b3.stride(0), b3.stride(1), b3.stride(2), out.stride(0), out.stride(1), out.stride(2),
                             BM=BLOCK_M, BN=BLOCK_N, BK=BLOCK_K)
    return out if batched else out[0]


@triton.jit
def _attention_kernel(q_ptr, kv_ptr, bt_ptr, qsl_ptr, sl_ptr, row_seq_ptr, out_ptr, sinks_ptr, scale, v_scale,
                      window, num_seqs,
                      sq_t, sq_h, skv_kv, skv_b, skv_s, skv_h, sbt, so_t, so_h,
                      HQ: tl.constexpr, HKV: tl.constexpr, D: tl.constexpr, BLOCK_SIZE: tl.constexpr,
                      BN: tl.constexpr, BD: tl.constexpr, USE_WINDOW: tl.constexpr, HAS_SINKS: tl.constexpr):
    t = tl.program_id(0)
    h = tl.program_id(1)
    if t >= tl.load(qsl_ptr + num_seqs):
        return  # padding row (a CUDA graph's batch is padded past the real rows)
    seq = tl.load(row_seq_ptr + t)
    q_start = tl.load(qsl_ptr + seq)
    q_end = tl.load(qsl_ptr + seq + 1)
    seq_len = tl.load(sl_ptr + seq)
    pos = seq_len - (q_end - q_start) + (t - q_start)
    kvh = h // (HQ // HKV)
    d = tl.arange(0, BD)
    dmask = d < D
    q = tl.load(q_ptr + t * sq_t + h * sq_h + d, mask=dmask, other=0.0).to(tl.float32)
    m_i = float("-inf")
    l_i = 0.0
    acc = tl.zeros((BD,), dtype=tl.float32)
    for start in range(0, pos + 1, BN):
        kp = start + tl.arange(0, BN)
        visible = kp <= pos
        if USE_WINDOW:
            visible = visible & (kp > pos - window)
        block = tl.load(bt_ptr + seq * sbt + kp // BLOCK_SIZE, mask=kp <= pos, other=0)
        base = block * skv_b + (kp % BLOCK_SIZE) * skv_s + kvh * skv_h
        kmask = visible[:, None] & dmask[None, :]
        k = tl.load(kv_ptr + base[:, None] + d[None, :], mask=kmask, other=0.0).to(tl.float32)
        v = tl.load(kv_ptr + skv_kv + base[:, None] + d[None, :], mask=kmask, other=0.0).to(tl.float32)
        s = tl.sum(k * q[None, :], axis=1) * scale
        s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=0))
        alpha = tl.exp(m_i - m_new)
        p = tl.exp(s - m_new)
        l_i = l_i * alpha + tl.sum(p, axis=0)
        acc = acc * alpha + tl.sum(p[:, None] * v, axis=0)
        m_i = m_new
    if HAS_SINKS:  # the head's sink logit joins the denominator after the keys, in the same order everywhere
        sink = tl.load(sinks_ptr + h).to(tl.float32)
        m_new = tl.maximum(m_i, sink)
        alpha = tl.exp(m_i - m_new)
        l_i = l_i * alpha + tl.exp(sink - m_new)
        acc = acc * alpha
    out = acc / l_i * v_scale
    tl.store(out_ptr + t * so_t + h * so_h + d, out.to(out_ptr.dtype.element_ty), mask=dmask)


def paged_attention_invariant_triton(q, kv_cache, block_tables, query_start_loc, seq_lens, scale,
                                     sliding_window=None, v_scale=1.0, sinks=None):
    """Same contract as ``ops.paged_attention`` (kv_cache [2, num_blocks, block_size, Hkv, D])."""
    num_tokens, hq, d = q.shape
    out = torch.empty_like(q)
    if num_tokens == 0:
        return out
    # each row's sequence by binary search (no host sync, and rows past the batch's last query row, CUDA-graph
    # padding, map to the last sequence; the kernel skips them)
    num_seqs = seq_lens.shape[0]
    rows = torch.arange(num_tokens, device=q.device, dtype=query_start_loc.dtype)
    row_seq = torch.searchsorted(query_start_loc[1:].contiguous(), rows, right=True)
    row_seq = row_seq.clamp_max_(max(num_seqs - 1, 0)).to(torch.int32)
    _, _, block_size, hkv, _ = kv_cache.shape
    _attention_kernel[(num_tokens, hq)](
        q, kv_cache, block_tables, query_start_loc, seq_lens, row_seq, out, q if sinks is None else sinks, scale,
        float(v_scale),
        sliding_window or 0, num_seqs,
        q.stride(0), q.stride(1), kv_cache.stride(0), kv_cache.stride(1), kv_cache.stride(2), kv_cache.stride(3),
        block_tables.stride(0), out.stride(0), out.stride(1),
        HQ=hq, HKV=hkv, D=d, BLOCK_SIZE=block_size, BN=ATTN_BLOCK_N, BD=triton.next_power_of_2(d),
        USE_WINDOW=sliding_window is not None, HAS_SINKS=sinks is not None)
    return out
