"""The CPU's exp and SiLU (`mlx_spec.cpu_exp`) against MLX's, values and gradient."""

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from mlx_spec.cpu_exp import compiled_exp_factors, exp_factors, scaled, silu


def test_exp_is_mlxs_within_float32_rounding():
    x = mx.array(np.linspace(-87.0, 0.0, 200001, dtype=np.float32))
    for factors in (exp_factors, compiled_exp_factors):
        got, want = scaled(*factors(x)), mx.exp(x)
        assert (mx.abs(got - want) <= 4e-6 * want).all().item()
        tiny = scaled(*factors(mx.array([-200.0, -mx.inf])))  # past float32's normals: its least normal
        assert tiny.tolist() == [2.0 ** -126] * 2


def test_silu_is_mlxs_with_its_gradient():
    assert mx.default_device() == mx.cpu
    x = mx.array(np.random.default_rng(0).standard_normal((8, 3072)).astype(np.float32) * 6)
    assert mx.allclose(silu(x), nn.silu(x), rtol=1e-6, atol=1e-7).item()
    weights = mx.arange(3072) / 3072
    grads = [mx.grad(lambda x: (f(x) * weights).sum())(x) for f in (silu, nn.silu)]
    assert mx.allclose(*grads, rtol=1e-6, atol=1e-7).item()
    compiled = mx.compile(lambda x: silu(x) * 2)  # (as a compiled layer calls it)
    assert mx.allclose(compiled(x), nn.silu(x) * 2, rtol=1e-6, atol=1e-7).item()
