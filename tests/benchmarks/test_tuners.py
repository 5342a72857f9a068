"""The kernel tuner runs end to end on tiny shapes (``--smoke``: CPU through Triton's interpreter) and writes
config tables in the repo's format."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def test_tune_deepseek_smoke_writes_mla_and_moe_tables(tmp_path):
    env = dict(os.environ, TRITON_INTERPRET="1", DSINFER_USE_TRITON="always")
    run = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "tune_deepseek.py"), "--smoke", "--only",
                          "mla,dense", "--budget-s", "4", "--out", str(tmp_path)],
                         env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-2000:]
    mla = json.loads((tmp_path / "mla_decode.json").read_text())
    assert {"16", "128"} <= set(mla) and all({"block_h", "block_n", "num_warps"} <= set(c) for c in mla.values())
    moe = json.loads((tmp_path / "moe.json").read_text())
    assert "dense,256,512,fp8" in moe  # the smoke shape of the dense FP8 GEMM was tuned and written
    assert "| mla decode (graph) | H=16" in run.stdout and "| mla decode (graph) | H=128" in run.stdout


def test_tune_gemv_smoke_writes_a_dense_and_a_gated_entry(tmp_path):
    env = dict(os.environ, TRITON_INTERPRET="1")
    run = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "tune_gemv.py"), "--smoke", "--budget-s", "2",
                          "--out", str(tmp_path)], env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-2000:]
    entry = json.loads((tmp_path / "moe.json").read_text())["dense,48,256,bfloat16"]["1"]
    # the interpreter loses to torch, so the entry says cuBLAS; a tile would carry its split
    assert entry == {"cublas": True} or {"block_n", "split_k"} <= set(entry)
    assert "| smoke | 1x48x256 |" in run.stdout
    gated = json.loads((tmp_path / "moe.json").read_text())["dense_silu_mul,24,256,bfloat16"]["1"]
    assert gated == {"unfused": True} or gated["split_k"] == 1  # the fused SiLU-mul needs whole sums
    assert "| smoke gated | 1x48x256 |" in run.stdout


def test_moe_bucket_of_a_batch_1_decode_is_found_by_the_lookup(monkeypatch):
    """Batch-1 decode has fewer pairs than stack slots (V2-Lite: 8 of 66, 0.12 rows per expert): its bucket keeps
    two digits, so the 4x window of ``nearest_config`` finds it, and batch 2 (0.24) uses it too."""
    sys.path.insert(0, str(ROOT))
    from benchmarks.tune_deepseek import _bucket
    from dsinfer.ops.triton import moe

    assert (_bucket(8 / 66), _bucket(9 / 257), _bucket(64 * 8 / 66), _bucket(2.4)) == ("0.12", "0.035", "8", "2")
    table = {"k": {_bucket(8 / 66): {"block_n": 32}, "8": {"block_n": 64}}}
    monkeypatch.setattr(moe, "_config_table", lambda: table)
    assert moe.nearest_config("k", 8 / 66, True) == {"block_n": 32}
    assert moe.nearest_config("k", 16 / 66, True) == {"block_n": 32}
    assert moe.nearest_config("k", 64 * 8 / 66, True) == {"block_n": 64}


def test_moe_tuner_pairs_sorted_tiles_only_with_sorted_tiles_of_the_same_block_m():
    sys.path.insert(0, str(ROOT))
    from benchmarks.tune_deepseek import _best_pair

    gathered = [(1.0, dict(block_m=64)), (0.9, dict(block_m=128))]
    srt = [(0.5, dict(block_m=64, sorted=True)), (0.2, dict(block_m=128, sorted=True))]
    # the fastest sorted gate/up (0.2, block_m 128) needs a sorted down of block_m 128 (3.0): 3.2 in all
    down = [(1.0, dict(block_m=32)), (0.4, dict(block_m=64, sorted=True)), (3.0, dict(block_m=128, sorted=True))]
    assert _best_pair(gathered + srt, down) == (srt[0], down[1])
    assert _best_pair(gathered, down) == (gathered[1], down[0])
    assert _best_pair(srt[1:], down[:2]) is None


@pytest.mark.parametrize("fp8", [False, True])
def test_moe_tuner_times_and_checks_sorted_and_gathered_tiles(fp8, monkeypatch, tmp_path):
    """``tune_moe`` on tiny experts (CPU interpreter) with one gathered and one sorted candidate per GEMM: both
    pass the output check against the reference and the table gets the faster consistent pair."""
    sys.path.insert(0, str(ROOT))
    from benchmarks import tune_deepseek, tuning

    monkeypatch.setattr(tuning, "SMOKE", True)
    monkeypatch.setattr(tuning, "DEV", "cpu")
    monkeypatch.setattr(tuning, "LOG", [])
    monkeypatch.setattr(tune_deepseek, "LOG", tuning.LOG)
    tile = dict(block_m=16, block_n=32, block_k=32, group_m=1, num_warps=4, num_stages=1)
    cands = [dict(tile), dict(tile, sorted=True, tma=True)]
    monkeypatch.setattr(tune_deepseek, "moe_grids", lambda fp8, rows: (cands, cands))
    table = {}
    shape = (4, 256, 128, 2, 1) if fp8 else (4, 64, 48, 2, 2)
    tune_deepseek.tune_moe("tiny", *shape, fp8=fp8, token_counts=(24,), budget=tuning.Budget(600), table=table)
    runs = [r for r in tuning.LOG if r["label"].startswith("tiny")]
    assert all("ms" in r for r in runs), runs  # no candidate failed or was wrong
    assert sum(bool(r["cfg"].get("sorted")) for r in runs) >= 2  # a sorted gate/up and a sorted down ran
    (entry,) = table.values()
    assert len(entry) == 1
