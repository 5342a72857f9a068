"""What the decode attention kernel compiles to on Hopper, checked on any machine (``tests/ops/hopper_asm.py``:
Triton compiles for sm_90 without a GPU). An FP8 cache's value tiles are the transposed operand of the product,
and FP8 has no transposing shared-memory load: left to Triton, the conversion moves behind the load and every
value is read from shared memory one byte at a time (the H200 ran such a kernel at half its bytes' rate)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _instructions(*args: str) -> dict[str, int]:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}  # the interpreter compiles nothing
    env["PYTHONPATH"] = str(ROOT)
    done = subprocess.run([sys.executable, "-m", "tests.ops.hopper_asm", *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout.splitlines()[-1])["instructions"]


def _byte_loads(counts: dict[str, int]) -> int:
    return sum(n for name, n in counts.items() if name.startswith("ld.shared") and name.endswith(("b8", "u8", "s8")))


@pytest.mark.parametrize("cache", ["fp8e4nv", "fp8e5"])
def test_fp8_values_reach_the_product_through_16_bit_transposing_loads(cache):
    counts = _instructions("--cache", cache)
    assert _byte_loads(counts) == 0
    assert counts.get("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16", 0) > 0


def test_the_check_sees_byte_loads_when_triton_places_the_conversion():
    assert _byte_loads(_instructions("--cache", "fp8e4nv", "--no-fp8-cvt")) >= 64


def test_bf16_cache_decode_has_no_conversions():
    counts = _instructions("--cache", "bf16", "--block-n", "32", "--stages", "2")
    assert _byte_loads(counts) == 0
    assert not any(name.startswith("cvt.rn.f16x2.e") for name in counts)
