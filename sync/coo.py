"""Change detection and the 2-D COO index format of a patch.

Every tensor is seen as a matrix: a scalar as (1, 1), a vector as (1, N), a matrix as is, and a tensor
of rank >= 3 as (shape[0], prod(shape[1:])). A changed element is addressed by (row, col) in that view.

With delta encoding, rows are sent as differences to the previous changed element's row, and cols as
differences to the previous col within the same row, or as the absolute col when a new row starts.
Both are then non-negative and usually small, so they fit narrower index dtypes and compress better.
"""

import torch

# Index dtypes from narrowest to widest; the code of a dtype is its position (it travels in patch tables).
INDEX_DTYPES = (torch.uint8, torch.int16, torch.int32, torch.int64)
_INDEX_LIMITS = (2**8 - 1, 2**15 - 1, 2**31 - 1, 2**63 - 1)
_BITS_DTYPES = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def view_2d(t: torch.Tensor) -> torch.Tensor:
    """The (rows, cols) view of a contiguous tensor, sharing its memory."""
    if t.dim() == 0:
        return t.view(1, 1)
    if t.dim() == 1:
        return t.view(1, -1)
    return t.view(t.shape[0], -1)


def shape_2d(shape: torch.Size | tuple) -> tuple[int, int]:
    if len(shape) == 0:
        return 1, 1
    if len(shape) == 1:
        return 1, shape[0]
    return shape[0], int(torch.Size(shape[1:]).numel())


def as_bits(t: torch.Tensor) -> torch.Tensor:
    """Integer view of the same memory: equal bits compare equal, so NaN == NaN and -0.0 != 0.0."""
    return t.view(_BITS_DTYPES[t.element_size()])


def changed_mask(current: torch.Tensor, snapshot: torch.Tensor) -> torch.Tensor:
    """Boolean (rows, cols) mask of elements whose bit pattern differs; both tensors in the receiver dtype."""
    return view_2d(as_bits(current) != as_bits(snapshot))


def encode(rows: torch.Tensor, cols: torch.Tensor, delta: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Row-major sorted coordinates (as from nonzero()) -> the coordinates to send (int64)."""
    if not delta or rows.numel() == 0:
        return rows, cols
    row_steps = torch.diff(rows, prepend=rows.new_zeros(1))
    col_steps = torch.diff(cols, prepend=cols.new_zeros(1))
    new_row = row_steps != 0
    new_row[0] = True
    return row_steps, torch.where(new_row, cols, col_steps)


def decode(rows: torch.Tensor, cols: torch.Tensor, delta: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Inverse of `encode`, vectorized (no host synchronization); returns int64 coordinates."""
    rows, cols = rows.to(torch.int64), cols.to(torch.int64)
    if not delta or rows.numel() == 0:
        return rows, cols
    new_row = rows != 0
    new_row[0] = True
    rows = torch.cumsum(rows, 0)
    running = torch.cumsum(cols, 0)
    # Each row restarts the running sum: subtract the sum accumulated before the row began. That
    # baseline never decreases (all steps are >= 0), so a running max carries it along the row.
    before_row = torch.where(new_row, running - cols, torch.zeros_like(running))
    return rows, running - torch.cummax(before_row, 0).values


def smallest_index_dtype(max_value: int) -> int:
    """Code (position in INDEX_DTYPES) of the narrowest dtype holding 0..max_value."""
    for code, limit in enumerate(_INDEX_LIMITS):
        if max_value <= limit:
            return code
    raise ValueError(f"weight sync: index {max_value} does not fit in int64")
