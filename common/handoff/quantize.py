"""8-bit compact caches: KIVI-style int8 quantization of the kept K/V (``--kv-dtype int8``).

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

``kv_dtype`` names: ``fp16`` (no quantization: the model's own dtype, whatever it is), ``int8``. An fp8
format (``torch.float8_e4m3fn``) is not implemented: it would need its own pool dtype and kernel path.
"""

from __future__ import annotations

import torch
from vlkv.common.handoff.compact_kv import CompactKV

KV_DTYPES = ("fp16", "int8")
QMAX = 127.0
SCALE_DTYPE = torch.float16
# Smallest scale kept: fp16's smallest normal number, so 1 / scale stays finite and an all-zero channel
# still quantizes (to zeros).
MIN_SCALE = 2.0**-14


def check_kv_dtype(name: str) -> str:
    if name not in KV_DTYPES:
        raise ValueError(f"kv dtype must be one of {KV_DTYPES}, got {name!r}")
    return name


def _scale(absmax: torch.Tensor) -> torch.Tensor:
    return (absmax.float() / QMAX).clamp_(min=MIN_SCALE).to(SCALE_DTYPE)


def _round(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return torch.round(x.float() / scale.float()).clamp_(-QMAX, QMAX).to(torch.int8)


def quantize_k(k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``k`` ``[H, n, D]`` -> (int8 ``[H, n, D]``, fp16 scale ``[H, D]``: per channel over the n tokens)."""
    scale = _scale(k.abs().amax(dim=1))
    return _round(k, scale[:, None, :]), scale


def quantize_k_with(k: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """``k`` ``[..., H, D]`` with fixed per-channel ``scale`` ``[..., H, D]`` (clamped: decode-time appends)."""
    return _round(k, scale)


def quantize_v(v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``v`` ``[..., D]`` -> (int8 ``[..., D]``, fp16 scale ``[...]``: per token)."""
    scale = _scale(v.abs().amax(dim=-1))
    return _round(v, scale[..., None]), scale


def dequantize_k(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """int8 ``[H, n, D]`` and scale ``[H, D]`` -> ``[H, n, D]`` in ``dtype``."""
    return (q.float() * scale.float()[:, None, :]).to(dtype)


def dequantize_v(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """int8 ``[..., D]`` and scale ``[...]`` -> ``[..., D]`` in ``dtype``."""
    return (q.float() * scale.float()[..., None]).to(dtype)


def quantize_compact(ckv: CompactKV, kv_dtype: str) -> CompactKV:
    """``ckv`` stored as ``kv_dtype``: itself for ``fp16``, else a new int8 ``CompactKV`` with scales."""
    if check_kv_dtype(kv_dtype) == "fp16" or ckv.quantized:
        return ckv
    keys, values, k_scales, v_scales = [], [], [], []
    for k, v in zip(ckv.keys, ckv.values, strict=True):
        qk, sk = quantize_k(k)
        qv, sv = quantize_v(v)
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
    )


def dequantize_compact(ckv: CompactKV, dtype: torch.dtype | None = None) -> CompactKV:
    """An int8 ``CompactKV`` back in floating point (``dtype``, else the dtype it was quantized from)."""
    if not ckv.quantized:
        return ckv
    dtype = dtype or ckv.source_dtype or torch.float32
    keys = [dequantize_k(k, s, dtype) for k, s in zip(ckv.keys, ckv.k_scales, strict=True)]
    values = [dequantize_v(v, s, dtype) for v, s in zip(ckv.values, ckv.v_scales, strict=True)]
    return CompactKV(keys, values, prompt_length=ckv.prompt_length, first_token=ckv.first_token)
