"""The GPU memory a runner may take: its own share, not charged for other processes (two replicas at 0.45)."""

from dsinfer.runner.memory import memory_left_to_take

GiB = 1 << 30
TOTAL = 140 * GiB


def test_a_second_replica_gets_its_share_beside_the_first():
    first_holds = 63 * GiB  # the first replica at 0.45: weights + KV
    second = memory_left_to_take(free=TOTAL - first_holds - GiB, total=TOTAL, own=16 * GiB, utilization=0.45)
    assert second == int(TOTAL * 0.45) - 16 * GiB  # its 0.45 less its own weights, whatever the first holds


def test_never_more_than_is_free():
    assert memory_left_to_take(free=10 * GiB, total=TOTAL, own=16 * GiB, utilization=0.9) == 10 * GiB


def test_what_it_holds_counts_against_its_share():
    assert memory_left_to_take(free=100 * GiB, total=TOTAL, own=70 * GiB, utilization=0.45) == int(TOTAL * 0.45) \
        - 70 * GiB < 0
