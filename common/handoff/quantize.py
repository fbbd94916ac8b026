"""8-bit compact caches: KIVI-style int8 (``--kv-dtype int8``) or fp8 (``--kv-dtype fp8``) storage of the
kept K/V.

The arrangement follows KIVI (Liu et al., 2024): keys have outlier *channels*, values do not, so

- K is quantized per (layer, KV head, channel): ``k_scale`` ``[H_kv, D]``, one scale per channel over the
  layer's kept tokens, computed once on the prefill worker after token selection;
- V is quantized per token: ``v_scale`` ``[H_kv, k]``, one scale per (KV head, token).

Symmetric int8 (``round(x / scale)`` clamped to [-127, 127], ``scale = absmax / 127``), scales in fp16 (the
pool keeps them beside the blocks; fp16 halves their bytes and its relative error, 2^-11, is far below the
int8 step). Tokens appended while decoding reuse the layer's prefill-time K scales (``quantize_k_with``):
a channel that outgrows its scale is clamped at +-127 steps. KIVI instead keeps a residual window of recent
tokens in fp16; vlkv does not, so the pool holds one dtype and the paged kernel one dequantization path.
V's per-token scale is computed for each appended token, so values are never clamped.

``kv_dtype`` names: ``fp16`` (no quantization: the model's own dtype, whatever it is), ``int8``, ``fp8``.

``fp8`` is OCP FP8 E4M3 (``torch.float8_e4m3fn``: 4 exponent bits, 3 mantissa bits, max 448) with the same
scales (``scale = absmax / 448``): the same arrangement, a different code for each byte. Its bytes travel
and sit in the pool as ``torch.int8`` tensors holding the E4M3 bit patterns, so the wire format, the pool,
NIXL's regions and admission treat both 8-bit formats alike and only encoding and decoding differ
(``decode_codes``; the paged kernel decodes a byte through a 256-entry table, ``kernels.fp8_table``,
which runs on every GPU Triton supports and in its interpreter, where a native FP8 cast needs sm_89+).
E4M3 keeps a relative step of 2^-3 at every magnitude where int8 keeps a uniform step: finer near zero,
coarser near the scale's top.
"""

from __future__ import annotations

import torch
from vlkv.common.handoff.compact_kv import CompactKV

KV_DTYPES = ("fp16", "int8", "fp8")
QMAX = 127.0
FP8_MAX = 448.0  # largest finite float8_e4m3fn
_QMAX = {"int8": QMAX, "fp8": FP8_MAX}
SCALE_DTYPE = torch.float16
# Smallest scale kept: fp16's smallest normal number, so 1 / scale stays finite and an all-zero channel
# still quantizes (to zeros).
MIN_SCALE = 2.0**-14


def check_kv_dtype(name: str) -> str:
    if name not in KV_DTYPES:
        raise ValueError(f"kv dtype must be one of {KV_DTYPES}, got {name!r}")
    return name


def _scale(absmax: torch.Tensor, fmt: str = "int8") -> torch.Tensor:
    return (absmax.float() / _QMAX[fmt]).clamp_(min=MIN_SCALE).to(SCALE_DTYPE)


def _round(x: torch.Tensor, scale: torch.Tensor, fmt: str = "int8") -> torch.Tensor:
    """``x / scale`` as one byte per element (``torch.int8``): an int8 step or an E4M3 bit pattern."""
    y = x.float() / scale.float()
    if fmt == "fp8":
        return y.clamp_(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn).view(torch.int8)
    return torch.round(y).clamp_(-QMAX, QMAX).to(torch.int8)


def decode_codes(q: torch.Tensor, fmt: str = "int8") -> torch.Tensor:
    """The fp32 values of 8-bit codes ``q`` (``torch.int8``) before scaling."""
    return q.view(torch.float8_e4m3fn).float() if fmt == "fp8" else q.float()


def quantize_k(k: torch.Tensor, fmt: str = "int8") -> tuple[torch.Tensor, torch.Tensor]:
    """``k`` ``[H, n, D]`` -> (codes ``[H, n, D]``, fp16 scale ``[H, D]``: per channel over the n tokens)."""
    scale = _scale(k.abs().amax(dim=1), fmt)
    return _round(k, scale[:, None, :], fmt), scale


def quantize_k_with(k: torch.Tensor, scale: torch.Tensor, fmt: str = "int8") -> torch.Tensor:
    """``k`` ``[..., H, D]`` with fixed per-channel ``scale`` ``[..., H, D]`` (clamped: decode-time appends)."""
    return _round(k, scale, fmt)


def quantize_v(v: torch.Tensor, fmt: str = "int8") -> tuple[torch.Tensor, torch.Tensor]:
    """``v`` ``[..., D]`` -> (codes ``[..., D]``, fp16 scale ``[...]``: per token)."""
    scale = _scale(v.abs().amax(dim=-1), fmt)
    return _round(v, scale[..., None], fmt), scale


def dequantize_k(
    q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32, fmt: str = "int8"
) -> torch.Tensor:
    """codes ``[H, n, D]`` and scale ``[H, D]`` -> ``[H, n, D]`` in ``dtype``."""
    return (decode_codes(q, fmt) * scale.float()[:, None, :]).to(dtype)


def dequantize_v(
    q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32, fmt: str = "int8"
) -> torch.Tensor:
    """codes ``[..., D]`` and scale ``[...]`` -> ``[..., D]`` in ``dtype``."""
    return (decode_codes(q, fmt) * scale.float()[..., None]).to(dtype)


def quantize_compact(ckv: CompactKV, kv_dtype: str) -> CompactKV:
    """``ckv`` stored as ``kv_dtype``: itself for ``fp16`` (or when already quantized), else a new 8-bit
    ``CompactKV`` with scales."""
    fmt = check_kv_dtype(kv_dtype)
    if fmt == "fp16" or ckv.quantized:
        return ckv
    keys, values, k_scales, v_scales = [], [], [], []
    for k, v in zip(ckv.keys, ckv.values, strict=True):
        qk, sk = quantize_k(k, fmt)
        qv, sv = quantize_v(v, fmt)
        keys.append(qk)
        values.append(qv)
        k_scales.append(sk)
        v_scales.append(sv)
    return CompactKV(
        keys,
        values,
        prompt_length=ckv.prompt_length,
        first_token=ckv.first_token,
        kept_indices=ckv.kept_indices,
        k_scales=k_scales,
        v_scales=v_scales,
        source_dtype=ckv.dtype,
        qformat=fmt,
        prompt_scores=ckv.prompt_scores,
    )


def dequantize_compact(ckv: CompactKV, dtype: torch.dtype | None = None) -> CompactKV:
    """An 8-bit ``CompactKV`` back in floating point (``dtype``, else the dtype it was quantized from)."""
    if not ckv.quantized:
        return ckv
    dtype, fmt = dtype or ckv.source_dtype or torch.float32, ckv.qformat
    keys = [dequantize_k(k, s, dtype, fmt) for k, s in zip(ckv.keys, ckv.k_scales, strict=True)]
    values = [dequantize_v(v, s, dtype, fmt) for v, s in zip(ckv.values, ckv.v_scales, strict=True)]
    return CompactKV(keys, values, prompt_length=ckv.prompt_length, first_token=ckv.first_token)
