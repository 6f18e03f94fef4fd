"""The gather-based copy of NumPyro's ScaledUnitLowerCholeskyTransform used by nb.BLR must agree
with NumPyro's own transform: values, inverse, log-Jacobian and the vector-Jacobian product."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from numpyro.distributions import constraints
from numpyro.distributions.transforms import biject_to

from numpyro_blr.layout import FULL, GatherScaledUnitLowerCholesky, GaussianBlock


@pytest.mark.parametrize("d", [1, 2, 5, 31])
@pytest.mark.parametrize("batch", [(), (3,)])
def test_gather_transform_equals_numpyro(d, batch):
    numpyro_t, ours = biject_to(constraints.scaled_unit_lower_cholesky), GatherScaledUnitLowerCholesky()
    x = jax.random.normal(jax.random.PRNGKey(d), batch + (d * (d + 1) // 2,))

    def values(t):  # one compiled program per transform (eagerly: about 40 one-operation programs each)
        return jax.jit(lambda x: (t(x), t.inv(numpyro_t(x)), t.log_abs_det_jacobian(x, t(x))))(x)

    # the same operations on the same values: equal bit for bit
    for a, b in zip(values(ours), values(numpyro_t)):
        np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("d", [1, 3, 8])
def test_cotangent_to_tril_is_the_vjp_of_the_inverse(d):
    ours = GatherScaledUnitLowerCholesky()
    with jax.enable_x64(True):
        x = jax.random.normal(jax.random.PRNGKey(d), (d * (d + 1) // 2,), dtype=jnp.float64)
        c = jax.random.normal(jax.random.PRNGKey(d + 1), x.shape, dtype=jnp.float64)

        @jax.jit  # one program (eagerly: about 60 one-operation programs)
        def values(x, c):
            y = biject_to(constraints.scaled_unit_lower_cholesky)(x)
            _, vjp = jax.vjp(biject_to(constraints.scaled_unit_lower_cholesky).inv, y)
            return jnp.tril(vjp(c)[0]), ours.cotangent_to_tril(y, c), ours.cotangent_to_tril(y, c, transpose=True)

        expected, got, got_t = values(x, c)
        np.testing.assert_allclose(got, expected, rtol=1e-12, atol=1e-12)
        np.testing.assert_allclose(got_t, expected.T, rtol=1e-12, atol=1e-12)


def test_full_block_uses_the_gather_transform_only_for_numpyros_default():
    default = GaussianBlock(FULL, "auto_loc", "auto_scale_tril", constraints.scaled_unit_lower_cholesky)
    other = GaussianBlock(FULL, "auto_loc", "auto_scale_tril", constraints.lower_cholesky)
    assert isinstance(default.transform, GatherScaledUnitLowerCholesky)
    assert not isinstance(other.transform, GatherScaledUnitLowerCholesky)


@pytest.mark.parametrize(
    "kind, constraint, size",
    [
        ("diagonal", constraints.softplus_positive, 4),
        ("diagonal", constraints.positive, 4),
        (FULL, constraints.scaled_unit_lower_cholesky, 10),  # d = 4
        (FULL, constraints.lower_cholesky, 10),
    ],
)
def test_scaling_tangent_is_the_derivative_of_the_scaled_raw_parameter(kind, constraint, size):
    """d/dc T^-1(c T(x)) at c = 1, closed form for NumPyro's defaults, a JVP otherwise; and moving x
    along it scales s or L (to first order)."""
    block = GaussianBlock(kind, "auto_loc", "auto_scale", constraint)
    with jax.enable_x64(True):
        x = jax.random.normal(jax.random.PRNGKey(size), (size,), dtype=jnp.float64)
        x = x.at[-4:].set(jnp.array([-30.0, -2.0, 0.5, 40.0]))  # tiny to large scales
        t = block.transform
        expected = jax.jvp(lambda c: t.inv(c * t(x)), (1.0,), (1.0,))[1]
        got = block.scaling_tangent(x)
        np.testing.assert_allclose(got, expected, rtol=1e-10, atol=1e-12)
        h = 1e-6
        np.testing.assert_allclose((t(x + h * got) - t(x - h * got)) / (2 * h), t(x), rtol=1e-6, atol=1e-12)


@pytest.mark.parametrize("constraint,shape", [
    (constraints.softplus_positive, (7,)), (constraints.positive, (3, 4)),
    (constraints.scaled_unit_lower_cholesky, (1,)), (constraints.scaled_unit_lower_cholesky, (55,)),
    (constraints.scaled_unit_lower_cholesky, (2, 10)),
])
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_report_reads_scales_in_numpy_equal_to_the_transform(constraint, shape, dtype):
    """apply_transform on concrete values (the end-of-run report) uses NumPy for the common constraints (no
    compilation per process): the same values as the guide's transform, to rounding; the inverse and other
    constraints still go through JAX."""
    from numpyro_blr.layout import _numpy_forward, apply_transform

    x = (np.random.default_rng(0).normal(size=shape) * 3).astype(dtype)
    block = GaussianBlock(FULL, "loc", "scale", constraint)
    with jax.enable_x64(dtype == np.float64):
        ref = np.asarray(block.transform(jnp.asarray(x)))
        y = apply_transform(block, x)
        assert isinstance(y, np.ndarray) and y.dtype == dtype and y.shape == ref.shape
        np.testing.assert_allclose(y, ref, rtol=4 * np.finfo(dtype).eps, atol=0)
        np.testing.assert_allclose(np.asarray(apply_transform(block, y, inverse=True)), x, rtol=1e-4 if dtype == np.float32 else 1e-10)
    assert _numpy_forward(constraints.interval(0.0, 1.0), x) is None
