"""Safetensors files read memory-mapped and written one tensor at a time.

``safetensors.torch.load_file`` / ``safe_open(...).get_tensor`` copy every tensor into process memory
and ``save_file`` serialises the whole dict into one buffer before writing: at full width (16 GB of
bf16 weights for Nemotron-H-8B) both double the peak. Here:

* :func:`mmap_tensors` maps a file copy-on-write (``mmap.ACCESS_COPY``: pages are read from the page
  cache on first touch and never written back) and returns ``name -> tensor`` views of it; no byte is
  read until a tensor is used, and handing a view to TensorRT (``trt.Weights`` over its pointer)
  copies nothing.
* :func:`write_safetensors` writes the header from the names, dtypes and shapes first, then each
  tensor's bytes as a ``produce(name)`` call returns it, so at most one tensor is held at a time.

The file format (https://github.com/huggingface/safetensors, ``README.md``): an 8-byte little-endian
header length, a JSON header ``{name: {"dtype", "shape", "data_offsets": [begin, end]}, "__metadata__":
{...}}`` padded with spaces to a multiple of 8, then the tensors' bytes (C order) back to back.
"""
from __future__ import annotations

import ctypes
import functools
import json
import mmap
import os
import struct
from pathlib import Path
from typing import Callable, Iterable, Mapping, Sequence

import torch

from builder.errors import CheckpointError

__all__ = ["DTYPE_CODES", "read_header", "mmap_tensors", "write_safetensors", "tensor_bytes", "stack", "own_storage"]

DTYPE_CODES = {
    torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16", torch.float64: "F64",
    torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
    torch.bool: "BOOL", torch.float8_e4m3fn: "F8_E4M3", torch.float8_e5m2: "F8_E5M2",
}
_CODE_DTYPES = {v: k for k, v in DTYPE_CODES.items()}
_MAX_HEADER = 100 << 20  # safetensors' own limit on the JSON header


def tensor_bytes(dtype: torch.dtype, shape: Sequence[int]) -> int:
    n = 1
    for d in shape:
        n *= int(d)
    return n * torch.empty((), dtype=dtype).element_size()


def read_header(path: str | os.PathLike) -> tuple[dict, int]:
    """(header without ``__metadata__``, byte offset of the data section). Raises CheckpointError."""
    path = Path(path)
    try:
        with open(path, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                raise CheckpointError(f"{path}: not a safetensors file (shorter than its 8-byte header length)")
            (n,) = struct.unpack("<Q", head)
            if n > _MAX_HEADER or n + 8 > path.stat().st_size:
                raise CheckpointError(f"{path}: not a safetensors file (header length {n} exceeds the file)")
            header = json.loads(f.read(n).decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{path}: not a readable safetensors file (header: {' '.join(str(e).split())})") from None
    if not isinstance(header, dict):
        raise CheckpointError(f"{path}: not a readable safetensors file (header is not a JSON object)")
    header.pop("__metadata__", None)
    return header, 8 + n


_FINITE_CHUNK = 1 << 24   # elements per isfinite pass: a bounded bool buffer, whatever the tensor's size


def check_finite(tensor: torch.Tensor, path, stored: str, scale: bool = False, cast: torch.dtype | None = None) -> None:
    """A checkpoint's floating-point tensor (FP8 scales included) holds no NaN or inf: one that did
    built and generated a stream of token 0 with exit 0. A ``scale`` (NVFP4's block and global
    scales, magnitudes by definition) holds no negative value either: one flipped its blocks' signs.
    ``cast``: the dtype it will be cast to, whose range its values must fit (float16's 65504: a
    larger value became inf after this check)."""
    if not tensor.is_floating_point() or tensor.numel() == 0:
        return
    flat = tensor.reshape(-1)
    for i in range(0, flat.numel(), _FINITE_CHUNK):
        part = flat[i:i + _FINITE_CHUNK]
        if part.element_size() == 1:   # FP8: isfinite has no kernel for it
            part = part.float()
        if not torch.isfinite(part).all():
            raise CheckpointError(f"{path}: tensor {stored!r} holds NaN or inf values")
        if scale and (part < 0).any():
            raise CheckpointError(f"{path}: tensor {stored!r} holds negative scales; expected values >= 0")
        if cast is not None and cast.is_floating_point and torch.finfo(cast).max < torch.finfo(part.dtype).max:
            big = part.abs().max().item()
            if big > torch.finfo(cast).max:
                name = str(cast).removeprefix("torch.")
                raise CheckpointError(f"{path}: tensor {stored!r} holds {big:g}, beyond {name}'s range "
                                      f"({torch.finfo(cast).max:g}); build with --dtype bfloat16 or float32")


def mmap_tensors(path: str | os.PathLike, names: Iterable[str] | None = None) -> dict[str, torch.Tensor]:
    """``name -> tensor`` viewing a copy-on-write mapping of ``path`` (all tensors, or ``names``).

    The mapping lives as long as any returned tensor does. Writing to a tensor changes only this
    process's private copy of that page, never the file.
    """
    path = Path(path)
    header, start = read_header(path)
    size = path.stat().st_size
    with open(path, "rb") as f:
        mapped = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY) if size else None
    out: dict[str, torch.Tensor] = {}
    # one storage over the data section: tensors that lie back to back can be stacked without a copy
    base = torch.frombuffer(mapped, dtype=torch.uint8, count=size - start, offset=start) if size > start else None
    if base is not None:
        _MAPPED.append((base.data_ptr() - start, size))
    for name in header if names is None else names:
        entry = header.get(name)
        if not isinstance(entry, dict):
            raise CheckpointError(f"{path}: no tensor {name!r} in the header")
        dtype = _CODE_DTYPES.get(entry.get("dtype"))
        if dtype is None:
            raise CheckpointError(f"{path}: tensor {name!r} has dtype {entry.get('dtype')!r}, which cannot be read")
        shape = [int(d) for d in entry["shape"]]
        begin, end = (int(o) for o in entry["data_offsets"])
        if end - begin != tensor_bytes(dtype, shape) or start + end > size:
            raise CheckpointError(f"{path}: tensor {name!r}: data_offsets {[begin, end]} do not hold "
                                  f"{entry.get('dtype')} {shape}")
        count = end - begin
        if count == 0:
            out[name] = torch.empty(shape, dtype=dtype)
            continue
        item = tensor_bytes(dtype, ())
        if begin % item == 0:
            flat = base[begin:end]
        else:  # misaligned for its dtype inside the shared storage: a storage of its own
            flat = torch.frombuffer(mapped, dtype=torch.uint8, count=count, offset=start + begin)
        out[name] = flat.view(dtype).reshape(shape)
    return out


def own_storage(t):
    """``t`` itself, or a copy of it when it views a larger storage (every tensor of
    :func:`mmap_tensors` views one storage over its file). Whatever pickles a tensor writes its whole
    storage: a compiled draft step's saved guards pickled each draft weight with the whole mapped file
    (the wide eagle3 draft's steps 95 MB for 7 MB of weights, mtp's 3.5 GB: 18 x the 195 MB target)."""
    if isinstance(t, torch.Tensor) and t.untyped_storage().nbytes() > t.numel() * t.element_size():
        return t.clone()
    return t


_MAPPED: list[tuple[int, int]] = []  # (address, length) of every file mapping made here
_PAGE = mmap.PAGESIZE
_MADV_DONTNEED = 4


def release_pages(t: torch.Tensor) -> None:
    """Drop the resident pages of a tensor that views one of :func:`mmap_tensors`' mappings (after
    copying it out: streaming 16 GB through a mapping would otherwise leave 16 GB resident). The
    mapping stays valid; a later read pages the bytes in again from the file."""
    if not t.numel():
        return
    begin = t.data_ptr()
    end = begin + t.numel() * t.element_size()
    for address, length in _MAPPED:
        if address <= begin and end <= address + length:
            lo = (begin + _PAGE - 1) // _PAGE * _PAGE  # whole pages inside the tensor only
            hi = end // _PAGE * _PAGE
            if hi > lo:
                _libc().madvise(ctypes.c_void_p(lo), ctypes.c_size_t(hi - lo), _MADV_DONTNEED)
            return


@functools.lru_cache(maxsize=1)
def _libc():
    return ctypes.CDLL(None, use_errno=True)


def stack(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """``torch.stack(tensors)``, as a view without a copy when they lie back to back in one storage
    (experts of a layer as :func:`write_safetensors` callers here order them, memory-mapped)."""
    first = tensors[0]
    if all(getattr(t, "is_nvfp4", False) for t in tensors):  # NVFP4 experts stay packed (NVFP4Weight.stack)
        return type(first).stack(tensors)
    if any(type(t) is not torch.Tensor for t in tensors):
        return torch.stack(list(tensors))
    step = first.numel()
    adjacent = all(t.dtype == first.dtype and t.shape == first.shape and t.is_contiguous() and
                   t.untyped_storage().data_ptr() == first.untyped_storage().data_ptr() and
                   t.storage_offset() == first.storage_offset() + i * step for i, t in enumerate(tensors))
    if not adjacent:
        return torch.stack(list(tensors))
    return torch.as_strided(first, (len(tensors), *first.shape), (step, *first.stride()), first.storage_offset())


def write_safetensors(path: str | os.PathLike, specs: Mapping[str, tuple[torch.dtype, Sequence[int]]],
                      produce: Callable[[str], torch.Tensor], metadata: Mapping[str, str] | None = None) -> int:
    """Write ``specs`` (name -> (dtype, shape), in file order) to ``path``; ``produce(name)`` returns
    each tensor when its turn comes (its dtype and shape must match the spec), or None for all-zero
bytes (left as a hole of a sparse file). Returns the file size."""
    header: dict = {"__metadata__": dict(metadata or {"format": "pt"})}
    offset = 0
    for name, (dtype, shape) in specs.items():
        n = tensor_bytes(dtype, shape)
        header[name] = {"dtype": DTYPE_CODES[dtype], "shape": [int(d) for d in shape], "data_offsets": [offset, offset + n]}
        offset += n
    raw = json.dumps(header, separators=(",", ":")).encode("utf-8")
    raw += b" " * (-len(raw) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw)))
        f.write(raw)
        for name, (dtype, shape) in specs.items():
            t = produce(name)
            if t is None:  # all zero bytes: a hole in a sparse file
                f.seek(tensor_bytes(dtype, shape), os.SEEK_CUR)
                continue
            if t.dtype != dtype or tuple(t.shape) != tuple(int(d) for d in shape):
                raise ValueError(f"{path}: tensor {name} is {t.dtype} {list(t.shape)}, its header says {dtype} {list(shape)}")
            if t.numel():
                f.write(memoryview(t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy()))
                release_pages(t)
            del t
        f.truncate(8 + len(raw) + offset)
    return 8 + len(raw) + offset
