"""MLA decode tile configs (absorbed, latent rows 512 + 64 bf16, 64-token blocks) at 16 and 128 heads, for
``tune_deepseek.py --only mla``: tile configs first at B=128 ctx 4k, then the best few with several grid fills
(``programs_per_sm`` of the split heuristic) over every shape, CUDA-graph timed, each checked against a float32
reference."""

from __future__ import annotations

import torch

from benchmarks import tuning
from benchmarks.tuning import LOG, TABLE, Budget, graph_bench, rate_note, rel_err

R, P = 512, 64  # kv_lora_rank, qk_rope_head_dim (V2-Lite and V3)
SHAPES = [(b, ctx) for ctx in (4096, 1024) for b in (128, 1, 64, 256)]  # the first is the tile-sweep shape


def _mla_ref(q, qp, cache, tables, scale, chunk: int = 16) -> torch.Tensor:
    """Absorbed decode, one query row per sequence over its whole table (float32, chunks of sequences: no
    per-head copy of the latent, unlike SDPA's GQA fallback)."""
    out = []
    for i in range(0, q.shape[0], chunk):
        ctx = cache[tables[i:i + chunk].long()].flatten(1, 2).float()  # [b, L, R + P]
        qq = torch.cat((q[i:i + chunk], qp[i:i + chunk]), -1).float()  # [b, H, R + P]
        att = (torch.einsum("bhd,bld->bhl", qq, ctx) * scale).softmax(-1)
        out.append(torch.einsum("bhl,blr->bhr", att, ctx[..., :R]))
    return torch.cat(out)


def tune_mla(budget: Budget, table: dict, shapes: list[tuple[int, int]] = SHAPES) -> None:
    from dsinfer.ops.triton.mla import decode_config, mla_decode_triton

    # (block_h, block_n, num_warps, num_stages[, extra config keys]), most promising first (the current config
    # is measured first). Tried and dropped (H200): heads-major tiles padded to 64 rows (session 3, 2-5x
    # slower), latent-chunked scores and keys-major tiles with the heads on the wgmma N side (session 4,
    # 0-30% slower), 64-row key tiles at 16 heads (session 6, B=256 1k at 16 programs per SM: 0.190-0.197 ms
    # against 0.153 for 32-row tiles), the TMA kernel holding the query in registers instead of re-reading it
    # every tile (session 10, same shape: 0.185 ms against 0.152), 2-warp tiles (session 10: 16-key 0.162 ms,
    # 32-key 1.128 ms, 64-key 1.755 ms: the [16, 512] float32 accumulator no longer fits two warps' registers).
    # Session 13 (Triton 3.6, compiled for sm_90 on a CPU): at 16 heads, 32-key tiles and 4 warps, num_stages 2-4
    # give the TMA loads one shared buffer (each tile's copy is issued only after the previous tile is used);
    # 5 gives two, 7 three. The block-table read that feeds the copy takes pipeline stages of its own. Session 14
    # (H200): 6 stages B=128 4k 0.1616 ms against 0.1858 with 4, 5 within 0.3% of 6, 7 slower (0.2945 at 16/SM).
    tma = dict(tma=True)
    tiles = {16: [(16, 32, 4, 3, tma), (16, 32, 4, 5, tma), (16, 32, 4, 6, tma), (16, 32, 4, 7, tma),
                  (16, 32, 4, 2, tma), (16, 32, 4, 4, tma), (16, 16, 4, 3, tma),
                  (16, 32, 8, 3, tma), (16, 32, 4, 2, dict(reload_q=True))],
             128: [(64, 32, 8, 3, tma), (64, 64, 8, 2, tma), (64, 16, 8, 3, tma), (64, 64, 8, 2), (64, 32, 8, 3),
                   (32, 32, 4, 3, tma)]}
    fills = {16: [2, 3, 4, 6, 8, 16], 128: [2, 4, 8]}
    for heads in (16, 128):
        sub = Budget(budget.left() * (0.6 if heads == 16 else 1.0))
        cases = {}
        for b, ctx in shapes:
            block = 64
            nblk = b * ctx // block
            cache = torch.randn(nblk, block, R + P, device=tuning.DEV, dtype=torch.bfloat16)
            tables = torch.randperm(nblk, device=tuning.DEV, dtype=torch.int32).view(b, -1)
            seq_lens = torch.full((b,), ctx, device=tuning.DEV, dtype=torch.int32)
            qsl = torch.arange(b + 1, device=tuning.DEV, dtype=torch.int32)
            q = torch.randn(b, heads, R, device=tuning.DEV, dtype=torch.bfloat16)
            qp = torch.randn(b, heads, P, device=tuning.DEV, dtype=torch.bfloat16)
            args = (q, qp, cache, tables, qsl, seq_lens, 192**-0.5)
            cases[(b, ctx)] = (args, _mla_ref(q, qp, cache, tables, args[-1]))
        current = dict(decode_config(heads, True))
        current.setdefault("programs_per_sm", 4)
        out_box = {}

        def runner(case, cfg, cases=cases, out_box=out_box):
            args = cases[case][0]
            return lambda: out_box.__setitem__("o", mla_decode_triton(*args, max_seq_len=case[1], config=cfg))

        # Stage 1: tiles at B=128 ctx 4k (CUDA-graph timed), at a fine grid fill (16 programs per SM: several
        # waves, so a tile's occupancy does not decide by wave quantization); the fill is tuned in stage 2.
        key_case = shapes[0]
        tile_keys = ("block_h", "block_n", "num_warps", "num_stages")
        cur_tile = tuple(current[k] for k in tile_keys)
        first = dict(current, programs_per_sm=16)
        cands = [first] + [c for c in (dict(zip(tile_keys, t[:4]), programs_per_sm=16, **(t[4] if len(t) > 4 else {}))
                                       for t in tiles[heads]) if c != first]
        stage1 = []
        tile_budget = Budget(sub.left() * 0.45)
        for i, cfg in enumerate(cands):
            if i and tile_budget.left() <= 0:
                print(f"  mla H={heads}: budget spent in tile sweep, {len(cands) - i} skipped", flush=True)
                break
            res = _mla_one(f"mla H={heads} B={key_case[0]} ctx={key_case[1]}", cfg, runner(key_case, cfg), out_box,
                           cases[key_case][1])
            if res is not None:
                stage1.append((res, cfg))
        if not stage1:
            continue
        stage1.sort(key=lambda r: r[0])
        top = [cfg for _, cfg in stage1[:3]]
        if not any(tuple(c[k] for k in tile_keys) == cur_tile for c in top):
            top.append(dict(current))
        # Stage 2: grid fills over every shape for the best tiles.
        cands2 = []
        for cfg in top:
            for pps in fills[heads]:
                c = dict(cfg, programs_per_sm=pps)
                if c not in cands2:
                    cands2.append(c)
        if current in cands2:
            cands2.remove(current)
        cands2.insert(0, current)
        times: dict[int, dict] = {}
        for ci, cfg in enumerate(cands2):
            if ci and sub.left() <= 0:
                print(f"  mla H={heads}: budget spent, {len(cands2) - ci} fill candidates skipped", flush=True)
                break
            row = {}
            for case in shapes:
                ms = _mla_one(f"mla H={heads} B={case[0]} ctx={case[1]}", cfg, runner(case, cfg), out_box,
                              cases[case][1], quiet=True)
                if ms is None:
                    row = None
                    break
                row[case] = ms
            if row:
                times[ci] = row
                print(f"  mla H={heads} {cfg}: " + ", ".join(f"B{b}/{c // 1024}k {t:.4f}" for (b, c), t in row.items()),
                      flush=True)
        if not times:
            continue
        best_per = {case: min(r[case] for r in times.values()) for case in shapes}
        score = {ci: sum(r[case] / best_per[case] for case in shapes) / len(shapes) for ci, r in times.items()}
        win = min(score, key=score.get)
        best = cands2[win]
        table[str(heads)] = best
        for case in shapes:
            b, ctx = case
            base = times[0][case] if 0 in times else float("nan")
            nbytes = b * ctx * (R + P) * 2 + b * heads * (2 * R + P) * 2
            flops = 2 * b * heads * ctx * (R + P + R)
            TABLE.append(f"| mla decode (graph) | H={heads} B={b} ctx={ctx} | {base:.4f} | {times[win][case]:.4f} | "
                         f"{rate_note(times[win][case], nbytes, flops, False)} | {best} (mean {score[win]:.3f}x of "
                         f"per-shape best) |")
        tuning.empty_cache()


def _mla_one(label, cfg, fn, out_box, ref, quiet=False):
    try:
        fn()
        tuning.sync()
        err = rel_err(out_box["o"], ref)
        if not err < 2e-2:
            print(f"  {label} {cfg}: WRONG (rel err {err:.3g})", flush=True)
            LOG.append(dict(label=label, cfg=cfg, error=f"rel err {err}"))
            return None
        ms = graph_bench(fn)
    except Exception as exc:  # noqa: BLE001
        msg = f"{type(exc).__name__}: {str(exc).splitlines()[0][:160] if str(exc) else ''}"
        print(f"  {label} {cfg}: failed {msg}", flush=True)
        LOG.append(dict(label=label, cfg=cfg, error=msg))
        return None
    LOG.append(dict(label=label, cfg=cfg, ms=ms, err=err))
    if not quiet:
        print(f"  {label} {cfg}: {ms:.4f} ms (err {err:.1e})", flush=True)
    return ms
