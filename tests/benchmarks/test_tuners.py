"""The kernel tuner runs end to end on tiny shapes (``--smoke``: CPU through Triton's interpreter) and writes
config tables in the repo's format."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

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
