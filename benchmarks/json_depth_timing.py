"""The server's JSON depth check on a hostile body (an unterminated string of escaped quotes): the linear scan
against the regex it replaced (read from git, commit 6566ec9~1), which was quadratic there. CPU only.

    python3 benchmarks/json_depth_timing.py
"""

from __future__ import annotations

import subprocess
import sys
import time
import types
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from dsinfer.server.json_depth import json_depth  # noqa: E402


def seconds(fn, body: bytes) -> float:
    started = time.perf_counter()
    fn(body)
    return time.perf_counter() - started


def hostile(n: int) -> bytes:
    return b'{"prompt": "' + b'\\"' * n


def main() -> None:
    old_src = subprocess.run(["git", "-C", str(ROOT), "show", "6566ec9~1:dsinfer/server/json_depth.py"],
                             capture_output=True, text=True, check=True).stdout
    old = types.ModuleType("old_json_depth")
    exec(old_src, old.__dict__)
    for n in (8_000, 32_000):
        body = hostile(n)
        print(f"{len(body) / 1e3:7.0f} KB: regex {seconds(old.json_depth, body):.3f} s, "
              f"scan {seconds(json_depth, body) * 1e3:.2f} ms")
    for n in (1_000_000, 4_000_000):
        body = hostile(n)
        print(f"{len(body) / 1e6:7.1f} MB: scan {seconds(json_depth, body) * 1e3:.1f} ms")


if __name__ == "__main__":
    main()
