"""Make MLX's Linux CPU backend use a system OpenBLAS.

The `mlx[cpu]` wheel links the reference Netlib BLAS: float32 matmul runs at a
few GFLOP/s. Loading OpenBLAS with RTLD_GLOBAL *before* `mlx.core` is imported
makes MLX's `cblas_*` calls resolve to it (30-60x faster). Set
MLX_SPEC_NO_OPENBLAS=1 to keep the reference BLAS, whose T=1 and T=k logits
are bit-identical (what the exactness tests rely on).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import sys

DISABLE_ENV = "MLX_SPEC_NO_OPENBLAS"

_CANDIDATES = (
    "libopenblas.so.0",
    "libopenblasp-r0.so",
    "libopenblas.so",
)

# Path of the OpenBLAS we loaded, or None.
loaded: str | None = None
# Why we did not load one (shown by `mlx-spec doctor`).
reason: str = ""


def preload() -> None:
    """Load a system OpenBLAS into the global symbol namespace, once."""
    global loaded, reason
    if loaded or reason:
        return
    if not sys.platform.startswith("linux"):
        reason = "not Linux (MLX uses Accelerate on macOS)"
        return
    if os.environ.get(DISABLE_ENV, "") not in ("", "0"):
        reason = f"disabled by {DISABLE_ENV}"
        return
    if "mlx.core" in sys.modules:
        reason = "mlx.core was imported before mlx_spec"
        return
    names = list(_CANDIDATES)
    found = ctypes.util.find_library("openblas")
    if found:
        names.append(found)
    for name in names:
        try:
            ctypes.CDLL(name, mode=os.RTLD_GLOBAL)
        except OSError:
            continue
        loaded = name
        return
    reason = "no system OpenBLAS found"


def describe() -> str:
    """One line naming the BLAS MLX's CPU backend uses."""
    if loaded:
        return f"OpenBLAS ({loaded}, preloaded by mlx-spec)"
    if sys.platform == "darwin":
        return "Accelerate"
    return f"reference BLAS bundled with mlx[cpu] ({reason})"
