"""copy_rows_where: kept rows land where their index says, every other cache row keeps its bits."""

from __future__ import annotations

import pytest
import torch

from dsinfer.ops.masked_rows import copy_rows_where, copy_rows_where_ref


@pytest.mark.parametrize("keep", [[True, False, True, False, False], [False, True, False, True, True],
                                  [False] * 5, [True] * 5], ids=["first_kept", "first_dropped", "none", "all"])
def test_copy_rows_where_matches_the_masked_copy(keep):
    gen = torch.Generator().manual_seed(0)
    dst = torch.randn(12, 3, generator=gen)
    rows = torch.randn(5, 3, generator=gen)
    keep = torch.tensor(keep)
    # kept rows at distinct indices; dropped ones anywhere: out of range, or at a kept row's index
    index = torch.where(keep, torch.tensor([4, 0, 9, 11, 2]), torch.tensor([0, -1, 4, 30, 9]))
    want = dst.clone()
    copy_rows_where_ref(want, index, rows, keep)
    copy_rows_where(dst, index, rows, keep)
    assert torch.equal(dst, want)
