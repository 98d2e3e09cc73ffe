"""Rotary-embedding frequencies (default, linear, llama3 and YaRN scaling): the fp32 numbers both
lowerings bake in, computed once here so that the eager op and the TensorRT network rotate alike."""
from __future__ import annotations

import math

import torch


def rope_inv_freq(theta, rotary_dim, scaling=None) -> torch.Tensor:
    """fp32 inverse frequencies [rotary_dim // 2] of a Llama rotary embedding (shared by lowerings)."""
    rotary_dim = int(rotary_dim)
    if rotary_dim <= 0 or rotary_dim % 2:
        raise ValueError(f"rope: rotary_dim must be a positive even number, got {rotary_dim}")
    exponents = torch.arange(0, rotary_dim, 2, dtype=torch.int64).to(torch.float32) / rotary_dim
    inv_freq = 1.0 / (float(theta) ** exponents)
    kind = None if scaling is None else (scaling.get("rope_type") or scaling.get("type") or "default")
    if kind in (None, "default"):
        return inv_freq
    if kind == "linear":
        return inv_freq / float(scaling["factor"])
    if kind == "llama3":
        factor = float(scaling["factor"])
        low, high = float(scaling["low_freq_factor"]), float(scaling["high_freq_factor"])
        context = float(scaling["original_max_position_embeddings"])
        wavelen = 2 * math.pi / inv_freq
        # long wavelengths (low frequencies) are slowed by ``factor``, short ones kept, and the band
        # between the two thresholds interpolates smoothly between the two
        scaled = torch.where(wavelen > context / low, inv_freq / factor, inv_freq)
        smooth = (context / wavelen - low) / (high - low)
        blended = (1 - smooth) * scaled / factor + smooth * scaled
        middle = ~(wavelen < context / high) & ~(wavelen > context / low)
        return torch.where(middle, blended, scaled)
    if kind == "yarn":
        return _yarn(inv_freq, theta, rotary_dim, scaling)
    raise ValueError(f"rope: unsupported rope_scaling type {kind!r} (supported: default, linear, llama3, yarn)")


def _yarn(inv_freq, theta, rotary_dim, scaling):
    """YaRN (NTK-by-parts): channels rotating fewer than ``beta_slow`` times over the original context
    are interpolated (divided by ``factor``), those rotating more than ``beta_fast`` times kept, a
    linear ramp over the dimensions between."""
    factor = float(scaling["factor"])
    context = float(scaling["original_max_position_embeddings"])
    fast, slow = float(scaling.get("beta_fast") or 32), float(scaling.get("beta_slow") or 1)

    def dim_of(rotations):  # the dimension whose wavelength fits ``rotations`` times in the context
        return rotary_dim * math.log(context / (rotations * 2 * math.pi)) / (2 * math.log(float(theta)))
    low, high = dim_of(fast), dim_of(slow)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, rotary_dim - 1)
    high = high + 0.001 if low == high else high
    ramp = ((torch.arange(rotary_dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    return inv_freq / factor * ramp + inv_freq * (1 - ramp)


def rope_attention_scale(scaling=None) -> float:
    """The factor YaRN multiplies cos and sin by (``attention_factor``, else from ``factor`` and
    ``mscale`` / ``mscale_all_dim``: 0.1 ln(factor) + 1); 1 for the other rope types."""
    kind = None if scaling is None else (scaling.get("rope_type") or scaling.get("type") or "default")
    if kind != "yarn":
        return 1.0
    if scaling.get("attention_factor") is not None:
        return float(scaling["attention_factor"])
    factor = float(scaling["factor"])

    def mscale(m=1.0):
        return 1.0 if factor <= 1 else 0.1 * m * math.log(factor) + 1.0
    m, m_all = scaling.get("mscale"), scaling.get("mscale_all_dim")
    return mscale(float(m)) / mscale(float(m_all)) if m and m_all else mscale()
