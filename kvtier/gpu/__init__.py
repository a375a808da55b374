"""CUDA data path (CuPy): block-copy kernels, batched DMA, host registration, the CUDA backend.

Every module here imports CuPy inside functions only; importing `kvtier.gpu` never touches CUDA.
CPU-only code paths (the daemon, the CPU transfer backend, the CLI) never import this package.
"""

from __future__ import annotations


def available() -> bool:
    """True when CuPy imports and sees at least one CUDA device."""
    try:
        import cupy

        return int(cupy.cuda.runtime.getDeviceCount()) > 0
    except Exception:
        return False
