"""Every kernel launch the product makes, recorded from the launchers themselves (for ahead-of-time compiles).

:func:`launch_specs` calls :func:`~.paged_decode.paged_decode_attention` and
:func:`~.attention_stats.attention_stats` over the configurations a deployment can run (the tables below)
on fake CUDA tensors (``torch``'s ``FakeTensorMode``: shapes, strides and dtypes, no memory, no GPU), with
each ``@triton.jit`` kernel of those modules swapped for a recorder, so what comes back is exactly the
arguments and meta-parameters the launchers would pass on a GPU, with no second copy of their logic.
``vlkv kernels compile`` turns each launch into the program Triton's JIT would build for it on a given
target (same specialization rules) and compiles each distinct program once.

Shapes per configuration: the paged kernels at batch 1 / 32 / 128 (1 / several / many splits, a ragged
and an aligned length), with and without decode-phase re-compression's attention mass; the statistics at
prompt lengths of one LLaVA-1.5 image (ragged), 2K and 32K with 1, 37 and 50 post-vision rows.
"""

from __future__ import annotations

import contextlib
import itertools
import warnings
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch

from . import attention_stats as stats_mod
from . import paged_decode as decode_mod
from .paged_decode_reference import _TABLES as _FP8_TABLES

HEAD_DIMS = (64, 128)
GROUPS = (1, 4, 8)  # query heads per KV head (GQA)
ACTIVATIONS = (torch.float16, torch.bfloat16)  # the model's dtype on a GPU
# "model": K/V stored in the activations' dtype (--kv-dtype fp16); int8 / fp8: 8-bit bytes with fp16
# scales (decode_worker/kv_cache.py's layout: k_scale [blocks, H_kv, D], v_scale [blocks, H_kv, P]).
POOLS = ("model", "int8", "fp8")
PAGES = (16, 32)  # tokens per KV block (--block-size)
SCALE_DTYPE = torch.float16
# (sequences, cached tokens each, splits): one 4K sequence split 33 ways (H100: 2 x 132 SMs / 8 KV
# heads), a batch in 2 splits, a large batch in 1; lengths ragged and block-aligned.
DECODE_POINTS = ((1, 4133, 33), (32, 2048, 2), (128, 205, 1))
# (prompt tokens m, query rows Tq): one 576-token image plus text, 2K and 32K prompts.
STATS_POINTS = ((613, 37), (2048, 50), (32768, 50), (613, 1))

PAGED_KERNELS = ("_split_kernel", "_combine_kernel", "_mass_kernel")
STATS_KERNELS = ("_row_stats_kernel", "_col_stats_kernel", "_sum_counts_kernel")


@dataclass
class Launch:
    """One kernel launch: the kernel (a ``JITFunction``), its grid, arguments and meta-parameters."""

    kernel: object
    grid: tuple
    args: tuple
    kwargs: dict
    config: dict = field(default_factory=dict)  # the product configuration that made it

    @property
    def name(self) -> str:
        return self.kernel.__name__


class _Recorder:
    def __init__(self, kernel, sink: list[Launch], config: dict) -> None:
        self.kernel, self.sink, self.config = kernel, sink, config

    def __getitem__(self, grid):
        def record(*args, **kwargs):
            self.sink.append(Launch(self.kernel, tuple(grid), args, kwargs, dict(self.config)))

        return record


@contextlib.contextmanager
def _recording(module, names: tuple[str, ...], sink: list[Launch], config: dict) -> Iterator[None]:
    saved = {n: getattr(module, n) for n in names}
    try:
        for n in names:
            setattr(module, n, _Recorder(saved[n], sink, config))
        yield
    finally:
        for n, k in saved.items():
            setattr(module, n, k)


def _paged_launches(sink: list[Launch]) -> None:
    cuda = torch.device("cuda")
    for dim, group, act, pool, page in itertools.product(HEAD_DIMS, GROUPS, ACTIVATIONS, POOLS, PAGES):
        n_heads = 32 if dim == 128 else 16
        n_kv = n_heads // group
        for (n_seq, length, splits), mass in itertools.product(DECODE_POINTS, (False, True)):
            config = dict(
                family="paged_decode", head_dim=dim, group=group, act=str(act)[6:], pool=pool, page=page,
                batch=n_seq, length=length, splits=splits, mass=mass,
            )  # fmt: skip
            width = -(-length // page) + 1
            n_blocks = n_seq * width + 1
            store = act if pool == "model" else torch.int8
            q = torch.empty(n_seq, n_heads, dim, device=cuda, dtype=act)
            k = torch.empty(n_blocks, n_kv, page, dim, device=cuda, dtype=store)
            scales = {}
            if pool != "model":
                scales = dict(
                    k_scale=torch.empty(n_blocks, n_kv, dim, device=cuda, dtype=SCALE_DTYPE),
                    v_scale=torch.empty(n_blocks, n_kv, page, device=cuda, dtype=SCALE_DTYPE),
                    kv_format=pool,
                )
            mass_out = torch.empty(n_seq, width * page, device=cuda) if mass else None
            with _recording(decode_mod, PAGED_KERNELS, sink, config):
                decode_mod.paged_decode_attention(
                    q, k, torch.empty_like(k),
                    torch.empty(n_seq, width, device=cuda, dtype=torch.int32),
                    torch.empty(n_seq, device=cuda, dtype=torch.int32),
                    scale=dim**-0.5, max_length=length, num_splits=splits, validate=False,
                    mass_out=mass_out, **scales,
                )  # fmt: skip


def _stats_launches(sink: list[Launch]) -> None:
    cuda = torch.device("cuda")
    for dim, group, act in itertools.product(HEAD_DIMS, GROUPS, ACTIVATIONS):
        n_heads = 32 if dim == 128 else 16
        for m, tq in STATS_POINTS:
            config = dict(family="attention_stats", head_dim=dim, group=group, act=str(act)[6:], m=m, tq=tq)
            # As the prefill worker passes them: views of the layer's [1, H, m, D] query and key states
            # (query[0, :, m - tq:], key[0]; indexing a fake CUDA tensor needs a CUDA build, views do not).
            query = torch.empty(1, n_heads, m, dim, device=cuda, dtype=act)
            key = torch.empty(1, n_heads // group, m, dim, device=cuda, dtype=act)
            with _recording(stats_mod, STATS_KERNELS, sink, config):
                q, k = query.select(0, 0).narrow(1, m - tq, tq), key.select(0, 0)
                stats_mod.attention_stats(q, k, q_start=m - tq, scale=dim**-0.5)


def launch_specs() -> list[Launch]:
    """Every launch of the product configurations above, as the launchers make them on a GPU."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    sink: list[Launch] = []
    tables = dict(_FP8_TABLES)  # the fp8 launches cache a (fake) table for the cuda device: drop it after
    try:
        with warnings.catch_warnings(), FakeTensorMode(allow_non_fake_inputs=True):
            warnings.simplefilter(
                "ignore"
            )  # FakeTensor.data_ptr() is deprecated: Triton reads it for alignment
            _paged_launches(sink)
            _stats_launches(sink)
    finally:
        _FP8_TABLES.clear()
        _FP8_TABLES.update(tables)
    return sink
