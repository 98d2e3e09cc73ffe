"""The NVFP4 number format in NVIDIA ModelOpt's Hugging Face checkpoint layout: E2M1 codes, packing,
FP8 (E4M3) block scales, quantize and dequantize, and :class:`NVFP4Weight`, a packed weight bound to
a model in place of a tensor. The checkpoint side (the quantization config, which tensors are
quantized, tensor dicts <-> NVFP4 weights) is :mod:`builder.quantization`.

The format (checked against ``nvidia-modelopt`` 0.47.0: ``torch/quantization/qtensor/nvfp4_tensor.py``,
``torch/export/unified_export_hf.py``, ``torch/export/quant_utils.py``, ``torch/export/convert_hf_config.py``,
and vLLM's ``ModelOptNvFp4W4A16LinearMethod``). For a linear module ``X`` with a weight of logical
shape ``[out, in]`` (``in`` a multiple of 16):

* ``X.weight`` -- uint8 ``[out, in/2]``: FP4 E2M1 codes, two per byte along ``in``; element ``2i`` in
  the **low** nibble, ``2i+1`` in the high nibble. A code is sign bit (8) + magnitude index into
  ``0, 0.5, 1, 1.5, 2, 3, 4, 6``. TensorRT's FP4 constants use the same byte order, so the bytes go
  into the engine as they are.
* ``X.weight_scale`` -- float8_e4m3fn ``[out, in/16]``: one scale per block of 16 input elements.
* ``X.weight_scale_2`` -- float32 scalar: the global scale, ``amax(|W|) / (6 * 448)``.
* ``X.input_scale`` -- float32 scalar, only in W4A4 (``NVFP4``) checkpoints; W4A16 ignores it.

``W = e2m1(X.weight) * (float(X.weight_scale) * X.weight_scale_2)`` block by block. Quantizing
follows ModelOpt: ``scale = fp8(clamp(block_amax / (6 * scale_2), 2**-9, 448))`` (an all-zero block
gets scale 1), then each element is ``w / (scale * scale_2)`` rounded to the nearest E2M1 value
(ties to the even code, saturating at 6).
"""
from __future__ import annotations

from typing import Sequence

import torch

__all__ = [
    "BLOCK_SIZE", "E2M1_MAX", "E4M3_MAX", "E2M1_VALUES",
    "fp4_encode", "fp4_decode", "pack_fp4", "unpack_fp4", "quantize_nvfp4", "dequantize_nvfp4",
    "global_scale_shape", "quantization_error_bound", "NVFP4Weight",
]

BLOCK_SIZE = 16
E2M1_MAX = 6.0
E4M3_MAX = 448.0

#: E2M1 value of each 4-bit code (bit 3 is the sign)
E2M1_VALUES = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0,
                            -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0], dtype=torch.float32)
# midpoints between neighbouring magnitudes; a value exactly on one rounds to the even code
_MIDPOINTS = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0], dtype=torch.float32)
_ODD_MIDPOINTS = torch.tensor([0.75, 1.75, 3.5], dtype=torch.float32)  # ties whose lower code is odd


# --- the number format ------------------------------------------------------------------------------
def fp4_encode(x: torch.Tensor) -> torch.Tensor:
    """uint8 E2M1 codes of fp32 values (round to nearest, ties to the even code, saturating at +-6)."""
    x = x.float()
    mag = x.abs()
    # midpoints strictly below |x| (bucketize with right=False), plus one on a tie whose lower code is
    # odd; written as comparisons, which run ~3x faster than bucketize + isin on large weights
    code = sum((mag > m).to(torch.uint8) for m in _MIDPOINTS.tolist())
    code = code + sum((mag == m).to(torch.uint8) for m in _ODD_MIDPOINTS.tolist())
    return (code + 8 * (x < 0)).to(torch.uint8)


def fp4_decode(codes: torch.Tensor) -> torch.Tensor:
    """fp32 values of uint8 E2M1 codes."""
    return E2M1_VALUES.to(codes.device)[codes.long()]


def pack_fp4(codes: torch.Tensor) -> torch.Tensor:
    """[..., K] codes -> [..., K/2] bytes: element 2i in the low nibble, 2i+1 in the high one."""
    if codes.shape[-1] % 2:
        raise ValueError(f"pack_fp4: the last dim ({codes.shape[-1]}) must be even")
    codes = codes.to(torch.uint8)
    return codes[..., 0::2] | (codes[..., 1::2] << 4)


def unpack_fp4(packed: torch.Tensor) -> torch.Tensor:
    """[..., K/2] bytes -> [..., K] codes (inverse of :func:`pack_fp4`)."""
    return torch.stack([packed & 0x0F, packed >> 4], dim=-1).flatten(-2)


def quantize_nvfp4(w: torch.Tensor, block_size: int = BLOCK_SIZE, scale_2: torch.Tensor | None = None):
    """NVFP4-quantize ``w [..., out, in]`` as ModelOpt does.

    Returns ``(packed uint8 [..., out, in/2], scale float8_e4m3fn [..., out, in/block_size],
    scale_2 float32 0-d)``. Raises ValueError for a last dim that is not a multiple of the block size
    or non-finite values.
    """
    if w.dim() < 1 or w.shape[-1] % block_size or w.shape[-1] == 0 or block_size % 2:
        raise ValueError(f"NVFP4 needs the input dim (last, {w.shape[-1] if w.dim() else None}) to be a "
                         f"positive multiple of the block size {block_size}")
    w32 = w.detach().to("cpu", torch.float32)
    if not bool(torch.isfinite(w32).all()):
        raise ValueError("NVFP4 quantization of non-finite values")
    if scale_2 is None:
        amax = w32.abs().amax()
        scale_2 = amax / (E2M1_MAX * E4M3_MAX) if amax > 0 else torch.tensor(1.0)
    scale_2 = torch.as_tensor(scale_2, dtype=torch.float32).reshape(())
    blocks = w32.unflatten(-1, (w32.shape[-1] // block_size, block_size))
    per_block = blocks.abs().amax(-1) / (E2M1_MAX * scale_2)
    per_block = torch.where(per_block == 0, torch.ones_like(per_block), per_block)
    scale = per_block.clamp(2.0 ** -9, E4M3_MAX).to(torch.float8_e4m3fn)
    scaled = blocks / (scale.float() * scale_2)[..., None]
    packed = pack_fp4(fp4_encode(scaled).flatten(-2))
    return packed.contiguous(), scale.contiguous(), scale_2


def _check_layout(packed, scale, scale_2, shape, block_size=BLOCK_SIZE, name="weight"):
    """One-line ValueError naming the tensor when packed/scale/scale_2 do not fit ``shape``."""
    shape = tuple(int(d) for d in shape)
    if len(shape) < 2 or shape[-1] <= 0 or shape[-1] % block_size:
        raise ValueError(f"{name}: logical shape {list(shape)} has an input dim that is not a multiple of the "
                         f"NVFP4 block size {block_size}")
    if packed.dtype != torch.uint8:
        raise ValueError(f"{name}: packed FP4 weight has dtype {_dtype_name(packed.dtype)}, expected uint8 "
                         "(two E2M1 values per byte)")
    want = shape[:-1] + (shape[-1] // 2,)
    if tuple(packed.shape) != want:
        raise ValueError(f"{name}: packed FP4 weight has shape {list(packed.shape)}, expected {list(want)} for "
                         f"logical shape {list(shape)} (two values per byte along the input dim; odd or "
                         "wrong packed length)")
    if scale is None:
        raise ValueError(f"{name}_scale: missing FP8 block scales of the NVFP4 weight {name}")
    if scale.dtype != torch.float8_e4m3fn:
        raise ValueError(f"{name}_scale: block scales have dtype {_dtype_name(scale.dtype)}, expected float8_e4m3fn")
    want = shape[:-1] + (shape[-1] // block_size,)
    if tuple(scale.shape) != want:
        raise ValueError(f"{name}_scale: block scales have shape {list(scale.shape)}, expected {list(want)}: one "
                         f"scale per {block_size} input elements of logical shape {list(shape)} (the scale shape "
                         "does not match the block size)")
    if scale_2 is None:
        raise ValueError(f"{name}_scale_2: missing FP32 global scale of the NVFP4 weight {name}")
    lead = shape[:-2]  # a stack of weights (a MoE layer's experts): one global scale, or one per matrix
    if scale_2.dtype != torch.float32 or not (global_scale_shape(scale_2, shape) or
                                              (scale_2.numel() == 1 and scale_2.dim() <= 1)):
        raise ValueError(f"{name}_scale_2: global scale has dtype {_dtype_name(scale_2.dtype)} and shape "
                         f"{list(scale_2.shape)}, expected a float32 scalar"
                         f"{' or shape ' + str(list(lead)) + ' (one per stacked matrix)' if lead else ''}")
    bad = ~(torch.isfinite(scale_2) & (scale_2 > 0)).reshape(-1)
    if bool(bad.any()):
        at = int(bad.nonzero()[0])
        raise ValueError(f"{name}_scale_2: global scale{f' {at}' if lead else ''} is {float(scale_2.reshape(-1)[at])}, "
                         "expected a finite positive number")


def global_scale_shape(scale_2: torch.Tensor, shape: Sequence[int]) -> tuple:
    """``shape[:-2]`` when ``scale_2`` holds one global scale per stacked matrix of logical ``shape``,
    else ``()`` (one for the whole tensor)."""
    lead = tuple(int(d) for d in shape[:-2])
    return lead if lead and tuple(scale_2.shape) == lead else ()


def dequantize_nvfp4(packed: torch.Tensor, scale: torch.Tensor, scale_2: torch.Tensor,
                     shape: Sequence[int], dtype: torch.dtype = torch.float32,
                     block_size: int = BLOCK_SIZE) -> torch.Tensor:
    """The weight of logical ``shape`` in ``dtype``.

    Two steps, as the TensorRT lowering computes it: block scales ``fp8 * scale_2`` (fp32, rounded to
    ``dtype``), then ``e2m1 * block scale`` (fp32, rounded to ``dtype``). In fp32 this is exactly
    ModelOpt's ``NVFP4QTensor.dequantize``. Raises ValueError when the tensors do not fit ``shape``.
    """
    shape = tuple(int(d) for d in shape)
    _check_layout(packed, scale, scale_2, shape, block_size)
    block_scale = (scale.float() * scale_2.float().reshape(global_scale_shape(scale_2, shape) + (1, 1))).to(dtype)
    values = fp4_decode(unpack_fp4(packed)).unflatten(-1, (shape[-1] // block_size, block_size))
    return (values * block_scale.float()[..., None]).flatten(-2).to(dtype).reshape(shape)


def quantization_error_bound(w: torch.Tensor, scale: torch.Tensor, scale_2: torch.Tensor,
                             block_size: int = BLOCK_SIZE) -> torch.Tensor:
    """Per-element bound on ``|w - dequantize(quantize(w))|`` (fp32 dequantization).

    With the block's effective scale ``s = fp8(scale) * scale_2`` and ``y = |w| / s``: rounding to
    E2M1 errs by at most half the E2M1 step at ``y`` (0.25 below 2, 0.5 in [2, 4), 1 in [4, 6]), times
    ``s``. The FP8 rounding of the scale can push ``y`` above 6 (by at most 1/16 relative, E4M3's
    half ulp); such values saturate and err by ``|w| - 6 s`` more. Plus one fp32 rounding.
    """
    w32 = w.detach().float()
    s = (scale.float() * scale_2.float().reshape(()))
    s = s.repeat_interleave(block_size, dim=-1)
    y = w32.abs() / s
    half_step = torch.where(y < 2, 0.25, torch.where(y < 4, 0.5, 1.0))
    overflow = (w32.abs() - E2M1_MAX * s).clamp(min=0)
    return half_step * s + overflow + w32.abs() * 2.0 ** -23


def _dtype_name(dtype) -> str:
    return str(dtype).replace("torch.", "")


# --- a bound NVFP4 weight ----------------------------------------------------------------------------
class NVFP4Weight:
    """An NVFP4 weight bound to a model in place of a torch tensor.

    ``functional.linear`` recognises it (``is_nvfp4``) and lowers to ``linear_nvfp4``: in TensorRT an
    FP4 constant + FP8 block scales + FP32 global scale -> dequantize -> matmul; eagerly a dequantize
    (on the fly, in the activation dtype) then matmul. ``.to(dtype)`` sets the compute dtype and keeps
    the packed data. Any other torch function given one (``torch.stack`` of expert weights, ``F.linear``)
    sees the dequantized tensor.
    """

    is_nvfp4 = True

    def __init__(self, packed: torch.Tensor, scale: torch.Tensor, scale_2: torch.Tensor, shape: Sequence[int],
                 dtype: torch.dtype = torch.float32, name: str = "weight"):
        shape = tuple(int(d) for d in shape)
        _check_layout(packed, scale, scale_2, shape, BLOCK_SIZE, name)
        self.packed, self.scale = packed, scale
        self.scale_2 = scale_2.to(torch.float32).reshape(global_scale_shape(scale_2, shape))
        self.logical_shape, self._dtype, self.name = shape, dtype, name

    @classmethod
    def quantize(cls, w: torch.Tensor, name: str = "weight", dtype: torch.dtype | None = None) -> "NVFP4Weight":
        packed, scale, scale_2 = quantize_nvfp4(w)
        return cls(packed, scale, scale_2, w.shape, w.dtype if dtype is None else dtype, name)

    @classmethod
    def stack(cls, weights: Sequence["NVFP4Weight"]) -> "NVFP4Weight":
        """E weights of one shape as one ``[E, out, in]`` weight (a MoE layer's experts): packed bytes,
        block scales and global scales each stacked, as views when they lie back to back in a mapped
        file (:func:`builder.checkpoint.storage_order`), so the stack stays FP4."""
        from builder.safetensors_io import stack
        first = weights[0]
        if any(w.logical_shape != first.logical_shape or w.ndim != 2 for w in weights):
            raise ValueError(f"{first.name}: cannot stack NVFP4 weights of shapes "
                             f"{sorted({tuple(w.logical_shape) for w in weights})} (expected one 2-D shape)")
        return cls(stack([w.packed for w in weights]), stack([w.scale for w in weights]),
                   stack([w.scale_2.reshape(()) for w in weights]), (len(weights), *first.logical_shape),
                   first.dtype, first.name)

    # tensor-like surface used by model code (``.to(dtype)``, ``.shape``) and builders
    @property
    def shape(self) -> torch.Size:
        return torch.Size(self.logical_shape)

    @property
    def dtype(self) -> torch.dtype:
        return self._dtype

    @property
    def device(self) -> torch.device:
        return self.packed.device

    @property
    def ndim(self) -> int:
        return len(self.logical_shape)

    def dim(self) -> int:
        return self.ndim

    def numel(self) -> int:
        n = 1
        for d in self.logical_shape:
            n *= d
        return n

    def is_floating_point(self) -> bool:
        return True

    def contiguous(self) -> "NVFP4Weight":
        return self

    def detach(self) -> "NVFP4Weight":
        return self

    def to(self, *args, **kwargs) -> "NVFP4Weight":
        dtype = kwargs.get("dtype")
        for a in args:
            if isinstance(a, torch.dtype):
                dtype = a
        if dtype is None or dtype == self._dtype:
            return self
        if not dtype.is_floating_point:
            raise TypeError(f"{self.name}: an NVFP4 weight computes in a floating dtype, not {dtype}")
        return NVFP4Weight(self.packed, self.scale, self.scale_2, self.logical_shape, dtype, self.name)

    def float(self) -> "NVFP4Weight":
        return self.to(torch.float32)

    def dequantize(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        return dequantize_nvfp4(self.packed, self.scale, self.scale_2, self.logical_shape,
                                self._dtype if dtype is None else dtype)

    def tensors(self, name: str | None = None) -> dict[str, torch.Tensor]:
        """The ModelOpt tensors of this weight under ``name`` (``X.weight``)."""
        name = self.name if name is None else name
        return {name: self.packed, name + "_scale": self.scale, name + "_scale_2": self.scale_2}

    def __repr__(self) -> str:
        return f"NVFP4Weight({self.name!r}, shape={list(self.logical_shape)}, dtype={_dtype_name(self._dtype)})"

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        def plain(a):
            if isinstance(a, NVFP4Weight):
                return a.dequantize()
            if isinstance(a, (list, tuple)):
                return type(a)(plain(b) for b in a)
            return a
        return func(*plain(args), **{k: plain(v) for k, v in (kwargs or {}).items()})

