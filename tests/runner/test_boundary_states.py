"""State slot rows kept in a block at its end and restored from it (``runner.boundary_states``), on plain tensors."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from dsinfer.core.kv_cache_spec import BoundaryStateSpec
from dsinfer.runner import boundary_states


def _layer(ring_rows: int, rows: int, width: int = 3, slots: int = 2, blocks: int = 4):
    spec = BoundaryStateSpec(8, (("window", rows, width),), torch.float32)
    return SimpleNamespace(state={"window": torch.zeros(slots, ring_rows, width)}, boundary=spec.allocate(blocks,
                                                                                                          "cpu"))


def _fill(layer, slot: int, end: int) -> None:
    """Ring rows as a sequence leaves them at ``end``: position p (its value p) at row p % rows."""
    ring = layer.state["window"]
    for p in range(max(end - ring.shape[1], 0), end):
        ring[slot, p % ring.shape[1]] = p


def test_a_block_end_saved_from_the_rings_is_restored_into_another_slot_at_the_same_positions():
    layer = _layer(ring_rows=10, rows=7)  # a window of 8 with 2 drafts: 7 rows at a block end
    _fill(layer, 0, 18)  # two tokens past the block end 16 (a step with a draft)
    boundary_states.save([layer], [(0, 16, 3)])
    assert layer.boundary.rings["window"][3, :, 0].tolist() == list(range(9, 16))
    boundary_states.restore([layer], 1, 16, 3)
    ring = layer.state["window"][1, :, 0]
    assert [ring[p % 10].item() for p in range(9, 16)] == list(range(9, 16))
    assert ring[16 % 10].item() == ring[17 % 10].item() == 0  # rows after the block end are not the state's


def test_rows_of_positions_before_the_first_token_are_never_restored():
    layer = _layer(ring_rows=10, rows=7)
    layer.boundary.rings["window"][2] = torch.arange(7.0).unsqueeze(-1)  # rows for positions -3 .. 3
    layer.state["window"][1] = -1.0
    boundary_states.restore([layer], 1, 4, 2)
    ring = layer.state["window"][1, :, 0].tolist()
    assert [ring[p] for p in range(4)] == [3.0, 4.0, 5.0, 6.0]
    assert ring[4:] == [-1.0] * 6  # the rows positions -3 .. -1 would map to keep what they held


def test_the_runner_takes_the_block_ends_the_rings_still_hold():
    """A decode step (1 token, or 1 + 2 drafts) reaching a block end, a chunk ending on one: the runner's; a long
    chunk passing one: the layers' (captured during the forward)."""
    assert boundary_states.boundaries_after_step(15, 1, 8, 0) == [16]
    assert boundary_states.boundaries_after_step(14, 3, 8, 2) == [16]
    assert boundary_states.boundaries_after_step(4, 12, 8, 0) == [16]
    assert boundary_states.boundaries_after_step(0, 20, 8, 0) == []  # 8 and 16: 4 rows on, the ring moved past
