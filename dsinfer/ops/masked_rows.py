"""Write rows into a flat cache where a mask says so, with no host read (graph-safe; padding rows write nothing).

``copy_rows_where(dst, index, rows, keep)`` sets ``dst[index[r]] = rows[r]`` for every r with ``keep[r]`` and leaves
every other row of ``dst`` bit-identical. A boolean-indexed copy would read the number of kept rows on the host;
here every row writes, but a dropped row writes exactly what a kept one writes (the first kept row's index and
value), or, when no row is kept, the value ``dst`` already holds at the first row's (clamped) index. Duplicate
indices therefore always carry the same value, so the result does not depend on the order of the writes.
Valid rows must not share an index (each cache row is written once per step).
"""

from __future__ import annotations

import torch


def copy_rows_where(dst: torch.Tensor, index: torch.Tensor, rows: torch.Tensor, keep: torch.Tensor) -> None:
    """dst [N, W]; index [R] int64 (out of range where not kept); rows [R, W]; keep [R] bool."""
    index = index.clamp(0, dst.shape[0] - 1)
    first = keep.to(torch.uint8).argmax().view(1)  # the first kept row; 0 when none is (a tensor: no host read)
    first_index = index.index_select(0, first)
    fallback = torch.where(keep.index_select(0, first).unsqueeze(-1), rows.index_select(0, first).to(dst.dtype),
                           dst.index_select(0, first_index))
    target = torch.where(keep, index, first_index)
    values = torch.where(keep.unsqueeze(-1), rows.to(dst.dtype), fallback)
    dst.index_put_((target,), values)


def copy_rows_where_ref(dst: torch.Tensor, index: torch.Tensor, rows: torch.Tensor, keep: torch.Tensor) -> None:
    """The plain definition (a host read of ``keep``): the reference ``copy_rows_where`` is tested against."""
    kept = keep.nonzero().flatten()
    dst[index[kept]] = rows[kept].to(dst.dtype)
