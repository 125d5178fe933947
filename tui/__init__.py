"""The Textual terminal chat of mlx-spec (installed as `mlx_spec.tui`)."""
