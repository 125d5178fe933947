"""Checkpoint readers and converters for published drafters (installed as `mlx_spec.convert`)."""
