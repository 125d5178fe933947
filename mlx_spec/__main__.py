"""`python -m mlx_spec`: the same as the `mlx-spec` command."""

from mlx_spec.cli import main

raise SystemExit(main())
