"""One decode step of the real LLaVA language model over a batch of paged sequences.

Each sequence feeds one token at its own position (continuing from its original prompt length m, not from
its compact cache length), and every layer attends to that sequence's blocks through the paged decode
attention kernel. The model's own modules run the step (its embedding, rotary embeddings as its family takes
them, ``common/model/families.py``, its layers and norm); only the attention function is vlkv's
(``common/model/attention.py``), and it masks a sliding-window layer to the last ``W`` entries of its cache.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from vlkv.common.handoff.quantize import quantize_k_with, quantize_v
from vlkv.common.model.attention import use_vlkv_attention
from vlkv.common.model.cache_kwarg import cache_arg
from vlkv.common.model.families import family_of
from vlkv.common.model.loading import language_model
from vlkv.decode_worker.kv_cache import KVCache
from vlkv.kernels.paged_decode import paged_decode_attention
from vlkv.kernels.paged_decode_reference import check_paged_values


@dataclass
class StepInput:
    """One sequence's part of a decode step."""

    token: int
    position: int
    tables: list[list[int]]  # per layer block ids
    lengths: list[int]  # per layer tokens already cached (the new token is appended at this index)


class PagedBatch:
    """Per-step view of the K/V cache: appends each layer's new K/V, then attends over the blocks.

    tables: ``[S, L, max_blocks]`` int32; lengths: ``[S, L]`` int32 (before this step's token);
    mass: ``[S, L, max_blocks * P]`` fp32 or None: each layer's attention mass per cached token, filled by
    ``attend`` (decode-phase re-compression).
    """

    def __init__(
        self,
        cache: KVCache,
        tables: torch.Tensor,
        lengths: torch.Tensor,
        mass: torch.Tensor | None = None,
        rows: int = 0,
        windows: tuple[int, ...] = (),
    ) -> None:
        self.cache = cache
        self.windows = windows  # per layer its sliding window (0 or (): none)
        self.tables = tables
        self.lengths = lengths
        self.mass = mass
        self.real = tables.shape[0]
        self.rows = rows  # > 0: the step carries this many rows, the first ``real`` of them sequences
        self._rows = torch.arange(tables.shape[0], device=tables.device)

    def update(self, key, value, layer_idx, *args, **kwargs):
        """key, value: ``[S, H_kv, 1, D]`` post-RoPE; written at each sequence's next slot (an 8-bit pool:
        K quantized with the layer's prefill-time channel scales, clamped; V with its own token scale)."""
        cache = self.cache
        key, value = key[: self.real], value[: self.real]  # padding rows (``rows``) write nothing
        pos = self.lengths[:, layer_idx].long()
        blocks = self.tables[self._rows, layer_idx, pos // cache.block_size].long()
        offs = pos % cache.block_size
        if cache.quantized:
            k_scale = cache.k_scale[self.tables[:, layer_idx, 0].long()]  # [S, H_kv, D]
            cache.k_scale[blocks] = k_scale  # a block new to the layer takes the layer's scales
            cache.k[blocks, :, offs] = quantize_k_with(key[:, :, 0], k_scale, cache.kv_dtype)
            qv, v_scale = quantize_v(value[:, :, 0], cache.kv_dtype)
            cache.v[blocks, :, offs] = qv
            cache.v_scale[blocks, :, offs] = v_scale
            return key, value
        cache.k[blocks, :, offs] = key[:, :, 0].to(cache.k.dtype)
        cache.v[blocks, :, offs] = value[:, :, 0].to(cache.v.dtype)
        return key, value

    def attend(self, layer_idx: int, query: torch.Tensor, scaling: float) -> torch.Tensor:
        """query ``[S, H, 1, D]`` -> output ``[S, 1, H, D]``. With ``rows``: each sequence attends alone (the
        reference pads a batch to its longest sequence, which changes the rounding of the others), and the
        padding rows get zeros."""
        if not self.rows:
            return self._attend(layer_idx, query[:, :, 0].contiguous(), scaling, slice(None)).unsqueeze(1)
        out = torch.zeros_like(query[:, :, 0])
        for i in range(self.real):
            out[i : i + 1] = self._attend(
                layer_idx, query[i : i + 1, :, 0].contiguous(), scaling, slice(i, i + 1)
            )
        return out.unsqueeze(1)

    def _attend(self, layer_idx: int, q: torch.Tensor, scaling: float, seqs: slice) -> torch.Tensor:
        return paged_decode_attention(
            q,
            self.cache.k,
            self.cache.v,
            self.tables[seqs, layer_idx].contiguous(),
            (self.lengths[seqs, layer_idx] + 1).to(torch.int32),
            scale=scaling,
            validate=False,  # ModelRunner.step checked every layer's tables and lengths
            k_scale=self.cache.k_scale,
            v_scale=self.cache.v_scale,
            kv_format="fp8" if self.cache.kv_dtype == "fp8" else "int8",  # read only by 8-bit pools
            mass_out=None if self.mass is None else self.mass[seqs, layer_idx],
            window=self.windows[layer_idx] if self.windows else 0,
        )


class ModelRunner:
    """Runs batched single-token decode steps of a LLaVA model's language model.

    ``batch_invariant`` (``PoolConfig.batch_invariant``): a sequence's logits are the bits it would get
    decoding alone, whatever else is in the batch. A matmul's rounding depends on its shape (bfloat16 most
    visibly), which can flip a greedy token under load. On CPU every step then has one shape: the batch is
    cut into groups of ``INVARIANT_ROWS`` rows, the last one padded with rows that write and read no cache,
    each sequence attends alone, and the step runs on one intra-op thread; a row's result in a matmul of one
    shape on one thread does not depend on its place or its neighbours (with two threads it can: a small
    model's row 4 of 5 did; ``tests/unit/test_batch_invariant.py`` checks the logits bit for bit at 1 and 2). On other devices
    each sequence steps as a batch of one (their kernels are not checked here).
    """

    INVARIANT_ROWS = 8

    def __init__(self, model, cache: KVCache, batch_invariant: bool = False) -> None:
        use_vlkv_attention(model)
        self.model = model
        self.lm = language_model(model)
        self.family = family_of(self.lm.config)  # ConfigError for a decoder vlkv cannot step
        windows = self.family.windows(self.lm.config)
        self.windows = windows if any(windows) else ()
        self.cache = cache
        self.device = cache.device
        self.batch_invariant = batch_invariant
        self.last_mass: torch.Tensor | None = None

    def step(self, batch: list[StepInput], mass: bool = False) -> torch.Tensor:
        """Feed one token per sequence; returns next-token logits ``[S, vocab]`` in fp32. ``mass``: also
        leave each layer's per-token attention mass in ``last_mass`` ``[S, L, max_blocks * P]`` (CPU)."""
        if not self.batch_invariant:
            return self._step(batch, mass)
        if self.device.type != "cpu":
            return self._groups(batch, mass, 1)
        threads = torch.get_num_threads()
        torch.set_num_threads(1)  # more threads split a matmul by shape-dependent rules: a row's bits move
        try:
            return self._groups(batch, mass, self.INVARIANT_ROWS)
        finally:
            torch.set_num_threads(threads)

    def _groups(self, batch: list[StepInput], mass: bool, rows: int) -> torch.Tensor:
        """``batch`` in steps of ``rows`` sequences, each padded to ``rows`` rows (1: a batch of one, unpadded)."""
        pad_to = rows if rows > 1 else 0
        logits, masses = [], []
        for i in range(0, len(batch), rows):
            logits.append(self._step(batch[i : i + rows], mass, pad_to))
            masses.append(self.last_mass)
        if mass:  # each group's mass is as wide as its own blocks: pad to the batch's widest
            width = max(m.shape[-1] for m in masses)
            self.last_mass = torch.cat([torch.nn.functional.pad(m, (0, width - m.shape[-1])) for m in masses])
        return torch.cat(logits)

    @torch.inference_mode()
    def _step(self, batch: list[StepInput], mass: bool, rows: int = 0) -> torch.Tensor:
        """One step of ``batch``; ``rows`` > 0: as ``rows`` rows, the sequences first (see the class)."""
        num_layers = len(batch[0].tables)
        max_blocks = max(len(t) for s in batch for t in s.tables)
        table_rows = [t + [-1] * (max_blocks - len(t)) for s in batch for t in s.tables]  # one tensor
        tables = torch.tensor(table_rows, dtype=torch.int32).view(len(batch), num_layers, max_blocks)
        lengths = torch.tensor([s.lengths for s in batch], dtype=torch.int32)
        # Checked once per step for every layer; the attention calls then skip their own per-layer check.
        check_paged_values(
            tables.view(-1, max_blocks), lengths.view(-1) + 1, self.cache.num_blocks, self.cache.block_size
        )
        width = max_blocks * self.cache.block_size
        masses = torch.zeros(len(batch), num_layers, width, device=self.device) if mass else None
        paged = PagedBatch(
            self.cache, tables.to(self.device), lengths.to(self.device), masses, rows, self.windows
        )
        pad = [(0, 0)] * (rows - len(batch)) if rows else []  # token 0 at position 0: written nowhere
        tokens = torch.tensor([[s.token] for s in batch] + [[t] for t, _ in pad], device=self.device)
        positions = torch.tensor([[s.position] for s in batch] + [[p] for _, p in pad], device=self.device)
        hidden = self.lm.embed_tokens(tokens)
        rope = self.family.position_embeddings(self.lm, hidden, positions)
        for layer, position_embeddings in zip(self.lm.layers[:num_layers], rope, strict=False):
            hidden = layer(
                hidden,
                attention_mask=None,
                position_ids=positions,
                **cache_arg(layer, paged),
                use_cache=True,
                position_embeddings=position_embeddings,
                vlkv_decode=paged,
            )
        hidden = self.lm.norm(hidden)
        self.last_mass = masses.cpu() if masses is not None else None
        return self.model.lm_head(hidden[:, -1]).float()[: len(batch)]
