"""Target architectures and their loading."""

from mlx_spec.models.config import ModelArgs, parse_config
from mlx_spec.models.llama import Model
from mlx_spec.models.load import load_model

__all__ = ["Model", "ModelArgs", "load_model", "parse_config"]
