"""Make MLX's Linux CPU backend use a system OpenBLAS.

The `mlx[cpu]` wheel links the reference Netlib BLAS: float32 matmul runs at a
few GFLOP/s. Loading OpenBLAS with RTLD_GLOBAL *before* `mlx.core` is imported
makes MLX's `cblas_*` calls resolve to it (30-60x faster). Set
MLX_SPEC_NO_OPENBLAS=1 to keep the reference BLAS, whose T=1 and T=k logits
are bit-identical (what the exactness tests rely on).

OpenBLAS picks its kernels by the CPU model it knows; a CPU newer than the
OpenBLAS installed gets its oldest (Prescott's SSE3: float32 GEMM at 67
GFLOP/s on an AVX-512 Xeon that OpenBLAS 0.3.21 did not know). Unless
OPENBLAS_CORETYPE says otherwise, a CPU with AVX-512 gets SkylakeX's kernels
(204-321 GFLOP/s there; a 0.2B model's forward of 1 token 8% faster than with
Haswell's, of 5 tokens 17%), one with AVX2 and FMA Haswell's (184).

OpenBLAS's helper threads then get cores of their own (`pin_threads`): left to
the scheduler, they share a core with the Python thread now and then, and every
step runs slower by turns. Set MLX_SPEC_NO_PIN=1 to leave them be.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import sys

DISABLE_ENV = "MLX_SPEC_NO_OPENBLAS"
NO_PIN_ENV = "MLX_SPEC_NO_PIN"
CORE_ENV = "OPENBLAS_CORETYPE"

_CANDIDATES = (
    "libopenblas.so.0",
    "libopenblasp-r0.so",
    "libopenblas.so",
)

# Path of the OpenBLAS we loaded, or None.
loaded: str | None = None
# Why we did not load one (shown by `mlx-spec doctor`).
reason: str = ""
# OpenBLAS's helper threads (started as it loads), the cores `pin_threads` gave them, or why it did not.
helpers: set[int] = set()
pinned: list[int] = []
unpinned: str = ""


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
    if CORE_ENV not in os.environ and (core := kernels()):
        os.environ[CORE_ENV] = core  # read as OpenBLAS loads
    for name in names:
        before = _threads()
        try:
            ctypes.CDLL(name, mode=os.RTLD_GLOBAL)
        except OSError:
            continue
        loaded = name
        helpers.update(_threads() - before)
        return
    reason = "no system OpenBLAS found"


AVX512 = {"avx512f", "avx512cd", "avx512bw", "avx512dq", "avx512vl"}  # what OpenBLAS's SkylakeX kernels use


def kernels(cpuinfo: str = "/proc/cpuinfo") -> str | None:
    """The OpenBLAS kernels for this CPU: SkylakeX's where it has AVX-512, Haswell's where it has AVX2 and FMA,
    else None (OpenBLAS's choice)."""
    try:
        with open(cpuinfo) as f:
            flags = next(set(line.split(":", 1)[1].split()) for line in f if line.startswith("flags"))
    except (OSError, StopIteration, IndexError):
        return None
    return "SkylakeX" if AVX512 <= flags else "Haswell" if {"avx2", "fma"} <= flags else None


def _threads() -> set[int]:
    return {int(t) for t in os.listdir("/proc/self/task")}


def pin_threads() -> None:
    """Give OpenBLAS's helper threads cores of their own, and the rest of the process the others.

    OpenBLAS splits a matrix product between the thread that calls it (MLX's
    compute thread) and its helpers, which spin while they wait for the next.
    Where there are no more cores than those, the scheduler puts the Python
    thread (building the next graph while the last one computes) beside a helper
    now and then: that helper's share of every product then waits, and decoding
    runs about 1.3x slower, in stretches of a fraction of a second, which no
    speed measurement can tell from a real cost (on 2 cores the demo's plain
    decoding read 220-348 tokens/s over a bench's runs; pinned, 322-340). The
    Python and compute threads take turns more than they overlap: they share
    what is left. Not under mlx.launch (its processes would pin their helpers to
    the same cores)."""
    global pinned, unpinned
    cores = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
    if not helpers:
        unpinned = "OpenBLAS started no helper threads" if loaded else reason
    elif os.environ.get(NO_PIN_ENV, "") not in ("", "0"):
        unpinned = f"{NO_PIN_ENV} is set"
    elif "MLX_RANK" in os.environ:
        unpinned = "under mlx.launch"
    elif len(cores) <= len(helpers):
        unpinned = f"{len(cores)} cores for {len(helpers)} OpenBLAS helper threads"
    if unpinned:
        return
    own, rest = cores[-len(helpers):], cores[: -len(helpers)]
    try:
        for tid, core in zip(sorted(helpers), own):
            os.sched_setaffinity(tid, {core})
        for tid in _threads() - helpers:  # threads started later inherit their starter's cores: these
            os.sched_setaffinity(tid, rest)
    except OSError as e:  # a thread that ended meanwhile
        unpinned = f"could not pin: {e}"
        return
    pinned = own


def describe_threads() -> str:
    """One line saying where the threads that compute run."""
    if pinned:
        where = f"core{'s' if len(pinned) > 1 else ''} {', '.join(map(str, pinned))}"
        return (f"OpenBLAS's helper threads on {where}, mlx-spec's on the others "
                f"({NO_PIN_ENV}=1 leaves them to the scheduler)")
    return f"left to the scheduler ({unpinned})"


def describe() -> str:
    """One line naming the BLAS MLX's CPU backend uses."""
    if loaded:
        core = getattr(ctypes.CDLL(loaded), "openblas_get_corename", None)
        if core is not None:
            core.restype = ctypes.c_char_p
        kernels = f"; {core().decode()} kernels" if core is not None else ""
        return f"OpenBLAS ({loaded}, preloaded by mlx-spec{kernels})"
    if sys.platform == "darwin":
        return "Accelerate"
    return f"reference BLAS bundled with mlx[cpu] ({reason})"
