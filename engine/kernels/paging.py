"""Device-side form of the paged-cache bookkeeping that the scheduler hands over as Python lists."""
from __future__ import annotations

import torch


def block_table_tensor(block_tables: list[list[int]], device: torch.device) -> torch.Tensor:
    """[B, max blocks] int32; short rows are padded with 0, which kernels never read because
    they mask every key position at or past the sequence's context length."""
    width = max((len(t) for t in block_tables), default=0) or 1
    rows = [t + [0] * (width - len(t)) for t in block_tables]
    return torch.tensor(rows, dtype=torch.int32, device=device).reshape(len(block_tables), width)
