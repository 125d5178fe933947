"""Converters for the drafters people publish, into mlx-spec folders (installed as `mlx_spec.convert`).

The top layer: it reads checkpoints with `mlx_spec.weights` and writes folders the
drafters load; nothing below imports it."""
