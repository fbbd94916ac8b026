"""Random paged-decode problems for the paged decode kernel tests: a pool, a block table and one query per
sequence; ``DEVICE`` is where the kernels run (CPU under ``TRITON_INTERPRET=1``, else CUDA). Import it after the
test module has set ``TRITON_INTERPRET`` (``tests/triton_interpret.py``)."""

from __future__ import annotations

import math

import torch
from triton_interpret import INTERPRET

DEVICE = "cpu" if INTERPRET else "cuda"


def make_case(lengths, n_heads, n_kv, dim, page, n_blocks, dtype, *, top=False, seed=0):
    """Random pool, a table whose unused entries are -1, and one query per sequence."""
    g = torch.Generator().manual_seed(seed)
    lengths_t = torch.tensor(lengths, dtype=torch.int32)
    need = [math.ceil(n / page) for n in lengths]
    width = max(need) + 1
    ids = torch.randperm(min(n_blocks, 4 * sum(need) + 8), generator=g)[: sum(need)]
    if top:  # the highest ids of the pool
        ids = n_blocks - 1 - ids
    table = torch.full((len(lengths), width), -1, dtype=torch.int32)
    pos = 0
    for s, n in enumerate(need):
        table[s, :n] = ids[pos : pos + n].int()
        pos += n
    k_pool = torch.randn(n_blocks, n_kv, page, dim, generator=g).to(dtype)
    v_pool = torch.randn(n_blocks, n_kv, page, dim, generator=g).to(dtype)
    q = (torch.randn(len(lengths), n_heads, dim, generator=g) * 1.5).to(dtype)
    return q, k_pool, v_pool, table, lengths_t
