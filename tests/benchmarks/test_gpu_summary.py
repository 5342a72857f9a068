"""``gpu_summary.clock_line``: the busy samples of gpu_check.sh's nvidia-smi log, and why clocks dropped."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from benchmarks.gpu_summary import clock_line  # noqa: E402


def test_clock_line_reads_busy_samples_only(tmp_path):
    log = tmp_path / "smi.csv"
    log.write_text("0, 345, 3201, 75.1, 700.00, 30, 0x0000000000000001\n"  # idle: left out
                   "98, 1980, 3201, 690.5, 700.00, 61, 0x0000000000000000\n"
                   "100, 1755, 3201, 700.1, 700.00, 66, 0x0000000000000004\n"
                   "99, 1830, 3201, 699.0, 700.00, 65, 0x0000000000000044\n"
                   "[N/A], 1980, 3201\n"  # unreadable and cut lines are skipped
                   "97, 19")
    line = clock_line(log)
    assert "3 samples" in line and "1755 / 1830 / 1980 MHz" in line and "up to 700 of 700 W, up to 66 C" in line
    assert line.endswith("clocks lowered by: power cap 67%, HW thermal 33%")


def test_clock_line_without_busy_samples(tmp_path):
    log = tmp_path / "smi.csv"
    log.write_text("0, 345, 3201, 75.1, 700.00, 30, 0x0000000000000001\n")
    assert clock_line(log) is None
    assert clock_line(tmp_path / "missing.csv") is None
