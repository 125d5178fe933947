"""mlx-spec: speculative decoding and knowledge distillation for MLX."""

from mlx_spec import _blas

_blas.preload()  # must run before the first `import mlx.core`
_blas.pin_threads()

__version__ = "0.1.0"
