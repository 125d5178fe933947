"""`mlx-spec doctor`: what MLX runs on here, and how to make it faster."""

from __future__ import annotations

import platform
import sys
import warnings

from mlx_spec import _blas


def backend() -> str:
    import mlx.core as mx

    if mx.metal.is_available():
        name = mx.device_info().get("device_name", "Apple GPU") if hasattr(mx, "device_info") else "Apple GPU"
        return f"Metal ({name})"
    if hasattr(mx, "cuda") and mx.cuda.is_available():
        return "CUDA"
    return "CPU"


def advice(backend_name: str) -> list[str]:
    tips = []
    if sys.platform.startswith("linux") and not _blas.loaded:
        if _blas.reason.startswith("disabled"):
            tips.append(f"unset {_blas.DISABLE_ENV} to use OpenBLAS (30-60x faster float32 matmul)")
        else:
            tips.append(
                "install OpenBLAS for 30-60x faster float32 matmul on the CPU: "
                "sudo apt-get install libopenblas0-pthread (Debian/Ubuntu)"
            )
    if backend_name == "CPU":
        tips.append("the CPU backend computes in float32; an Apple Silicon Mac (Metal) is much faster")
    return tips


def tree_attention_path() -> str:
    """Which tree-attention path verification uses here, and why."""
    from mlx_spec.attention import default_backend

    # The line carries the reason, so the fallback's warning would only repeat it.
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return default_backend.describe()


def report() -> str:
    import mlx.core as mx

    name = backend()
    lines = [
        f"mlx-spec  {sys.modules['mlx_spec'].__version__}",
        f"python    {platform.python_version()} ({platform.system()} {platform.machine()})",
        f"mlx       {mx.__version__}",
        f"backend   {name}",
        f"blas      {_blas.describe()}",
        f"threads   {_blas.describe_threads()}",
        f"tree attn {tree_attention_path()}",
    ]
    lines += architectures()
    tips = advice(name)
    lines += [f"tip       {t}" for t in tips] or ["tip       nothing to do: this is as fast as MLX gets here"]
    return "\n".join(lines)


def architectures() -> list[str]:
    """The targets mlx-spec runs, by model_type, and the drafts they verify."""
    from mlx_spec.models.config import ARCHITECTURES
    from mlx_spec.models.mlxlm import FAMILIES, HYBRID
    from mlx_spec.models.whole import CHECKED

    own = ", ".join(ARCHITECTURES)
    trees = ", ".join(f for f in FAMILIES if f not in HYBRID)
    chains = ", ".join(f for f in FAMILIES if f in HYBRID)
    whole = ", ".join(CHECKED)
    return [f"targets   {own}: every drafter, chains and trees (mlx-spec's own model code)",
            f"targets   {trees}: every drafter, chains and trees (mlx-lm's model code)",
            f"targets   {chains}: every drafter, chains (linear-attention layers rolled back exactly; mlx-lm's model code)",
            f"targets   {whole}: chains, every drafter but layerskip and skip (mlx-lm's forward, whole)",
            "targets   any other family mlx-lm implements (keys and values its only state): as the line above; "
            "runs on mlx-lm's code, not checked against transformers"]
