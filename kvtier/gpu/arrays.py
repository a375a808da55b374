"""Describing an array from any framework (numpy, torch, CuPy, DLPack) without importing one:
shape, byte strides, dtype, device and data pointer, which is all the transfer engine needs."""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import numpy as np


class ArrayInfo(NamedTuple):
    """What the engine needs to know about a numpy array, torch tensor or CuPy array."""

    shape: tuple[int, ...]
    strides: tuple[int, ...]  # bytes
    itemsize: int
    dtype: str
    device: str  # "cpu" | "cuda"
    ptr: int


def array_info(x: Any) -> ArrayInfo:
    """Describe `x` without importing torch or CuPy (duck typing; `__cuda_array_interface__`).

    Other DLPack producers are viewed through `numpy.from_dlpack` (CPU) or `cupy.from_dlpack`
    (CUDA; CuPy is imported only then). The caller keeps `x` alive while the pointer is used.
    """
    if isinstance(x, np.ndarray):
        return ArrayInfo(x.shape, x.strides, x.itemsize, str(x.dtype), "cpu", x.ctypes.data)
    if hasattr(x, "data_ptr") and hasattr(x, "element_size"):
        size = int(x.element_size())
        dev = "cuda" if x.device.type == "cuda" else x.device.type
        return ArrayInfo(tuple(x.shape), tuple(s * size for s in x.stride()), size,
                         str(x.dtype).removeprefix("torch."), dev, int(x.data_ptr()))
    cai = getattr(x, "__cuda_array_interface__", None)
    if cai is not None:
        shape = tuple(int(d) for d in cai["shape"])
        item = np.dtype(cai["typestr"]).itemsize
        strides = cai.get("strides") or tuple(
            item * math.prod(shape[i + 1:]) for i in range(len(shape)))
        return ArrayInfo(shape, tuple(strides), item, str(np.dtype(cai["typestr"])), "cuda",
                         int(cai["data"][0]))
    if hasattr(x, "__dlpack__") and hasattr(x, "__dlpack_device__"):
        kind = int(x.__dlpack_device__()[0])
        if kind == 1:  # kDLCPU
            return array_info(np.from_dlpack(x))
        if kind == 2:  # kDLCUDA
            import cupy

            return array_info(cupy.from_dlpack(x))
    raise ValueError(f"unsupported array type {type(x)!r}: use numpy, torch or CuPy")
