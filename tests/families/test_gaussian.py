"""Gaussian families against independent references.

* expectation parameters are the gradient of the log-partition (``mu = grad A(lam)``), taken by
  ``jax.grad`` of :meth:`log_partition` and compared with the closed form in :meth:`expectation`;
* natural <-> expectation <-> (mean, precision) round trips;
* entropy and log density against ``numpyro.distributions.Normal`` / ``MultivariateNormal``;
* samples have the right mean and covariance within Monte Carlo error;
* ``precision_to_scale_tril`` / ``scale_tril_to_precision`` give the covariance's Cholesky factor.

Every test runs under 64-bit floats through a per-test ``jax.enable_x64`` context (the ``x64``
fixture below), so the tight tolerances hold and nothing leaks to other test files.
"""

import jax
import jax.numpy as jnp
import numpy as np
import numpyro.distributions as dist
import pytest

from numpyro_blr.families.gaussian import (
    DiagonalGaussian,
    FullGaussian,
    GaussianExpectation,
    GaussianNatural,
    precision_to_scale_tril,
    scale_tril_to_precision,
)


@pytest.fixture(autouse=True)
def x64():
    # a context manager, so the flag is restored after each test (no leak to other test files)
    with jax.enable_x64(True):
        yield


def random_spd(rng, d, log10_range=(-1.5, 1.5)):
    """Symmetric positive definite matrix with a random eigenbasis and log-uniform eigenvalues."""
    q, _ = np.linalg.qr(rng.normal(size=(d, d)))
    eig = 10.0 ** rng.uniform(*log10_range, size=d)
    s = (q * eig) @ q.T
    return 0.5 * (s + s.T)


def diag_case(seed, shape=(3, 2)):
    rng = np.random.default_rng(seed)
    mean = jnp.asarray(rng.normal(size=shape) * 3.0)
    precision = jnp.asarray(10.0 ** rng.uniform(-2, 2, size=shape))
    return mean, precision


def full_case(seed, d):
    rng = np.random.default_rng(seed)
    mean = jnp.asarray(rng.normal(size=d) * 3.0)
    precision = jnp.asarray(random_spd(rng, d))
    return mean, precision


SEEDS = [0, 1, 2]
DIMS = [1, 3]


# -- mu = grad A(lambda) ------------------------------------------------------------------------


def test_diagonal_expectation_is_grad_log_partition():
    for seed in SEEDS:
        mean, precision = diag_case(seed)
        nat = DiagonalGaussian.to_natural(mean, precision)
        grad = jax.grad(DiagonalGaussian.log_partition)(nat)
        expect = DiagonalGaussian.expectation(nat)
        assert grad.eta1.dtype == jnp.float64
        np.testing.assert_allclose(grad.eta1, expect.mu1, rtol=1e-12, atol=1e-12)
        np.testing.assert_allclose(grad.eta2, expect.mu2, rtol=1e-12, atol=1e-12)
        # and both are the moments E[x], E[x^2] written independently
        np.testing.assert_allclose(expect.mu1, mean, rtol=1e-12)
        np.testing.assert_allclose(expect.mu2, mean**2 + 1.0 / precision, rtol=1e-12)


@pytest.mark.parametrize("d", DIMS)
def test_full_expectation_is_grad_log_partition(d):
    for seed in SEEDS:
        mean, precision = full_case(seed, d)
        nat = FullGaussian.to_natural(mean, precision)
        grad = jax.grad(FullGaussian.log_partition)(nat)
        expect = FullGaussian.expectation(nat)
        cov = np.linalg.inv(np.asarray(precision))
        np.testing.assert_allclose(grad.eta1, expect.mu1, rtol=1e-9, atol=1e-9)
        # eta2 is a general matrix argument of A; its gradient is E[x x^T] (symmetric)
        np.testing.assert_allclose(grad.eta2, expect.mu2, rtol=1e-9, atol=1e-9)
        np.testing.assert_allclose(expect.mu1, mean, rtol=1e-9, atol=1e-12)
        np.testing.assert_allclose(expect.mu2, np.outer(mean, mean) + cov, rtol=1e-9, atol=1e-9)


@pytest.mark.parametrize("d", DIMS)
def test_full_log_partition_normalises_the_density(d):
    """A(lam) = log of the integral of exp(<lam, T(x)>): checked against the Gaussian integral."""
    mean, precision = full_case(7, d)
    nat = FullGaussian.to_natural(mean, precision)
    # log int exp(eta1.x + x^T eta2 x) dx = 1/2 m^T S m - 1/2 logdet S + d/2 log 2 pi
    ref = 0.5 * mean @ precision @ mean - 0.5 * np.linalg.slogdet(np.asarray(precision))[1] + 0.5 * d * np.log(2 * np.pi)
    np.testing.assert_allclose(FullGaussian.log_partition(nat), ref, rtol=1e-10)
    # log q(x) = <lam, T(x)> - A(lam) equals the family's log density
    x = mean + 0.3
    lp = nat.eta1 @ x + x @ nat.eta2 @ x - FullGaussian.log_partition(nat)
    np.testing.assert_allclose(lp, FullGaussian.log_prob(x, mean, precision), rtol=1e-10)


def test_normalising_constants_are_exact_in_x64():
    """Standard normal: entropy (1 + log 2 pi)/2, log density at 0 -log(2 pi)/2, A(0, -1/2) = log(2 pi)/2.

    Catches a ``log(2 pi)`` constant that was rounded to float32 (an error of ~3e-8 per dimension).
    """
    half_log_2pi = 0.5 * np.log(2 * np.pi)
    one, zero = jnp.ones(1), jnp.zeros(1)
    np.testing.assert_allclose(DiagonalGaussian.entropy(one), half_log_2pi + 0.5, rtol=1e-14)
    np.testing.assert_allclose(FullGaussian.entropy(jnp.eye(1)), half_log_2pi + 0.5, rtol=1e-14)
    np.testing.assert_allclose(DiagonalGaussian.log_prob(zero, zero, one), -half_log_2pi, rtol=1e-14)
    np.testing.assert_allclose(FullGaussian.log_prob(zero, zero, jnp.eye(1)), -half_log_2pi, rtol=1e-14)
    np.testing.assert_allclose(DiagonalGaussian.log_partition(GaussianNatural(zero, -0.5 * one)), half_log_2pi, rtol=1e-14)
    np.testing.assert_allclose(FullGaussian.log_partition(GaussianNatural(zero, -0.5 * jnp.eye(1))), half_log_2pi, rtol=1e-14)


def test_diagonal_log_partition_matches_full_on_diagonal_matrices():
    mean, precision = diag_case(3, shape=(4,))
    diag_a = DiagonalGaussian.log_partition(DiagonalGaussian.to_natural(mean, precision))
    full_a = FullGaussian.log_partition(FullGaussian.to_natural(mean, jnp.diag(precision)))
    np.testing.assert_allclose(diag_a, full_a, rtol=1e-12)


# -- round trips ---------------------------------------------------------------------------------


def test_diagonal_round_trips():
    for seed in SEEDS:
        mean, precision = diag_case(seed)
        nat = DiagonalGaussian.to_natural(mean, precision)
        np.testing.assert_allclose(nat.eta1, precision * mean, rtol=1e-15)
        np.testing.assert_allclose(nat.eta2, -0.5 * precision, rtol=1e-15)
        m2, p2 = DiagonalGaussian.from_natural(nat)
        np.testing.assert_allclose(m2, mean, rtol=1e-12, atol=1e-14)
        np.testing.assert_allclose(p2, precision, rtol=1e-14)
        nat2 = DiagonalGaussian.from_expectation(DiagonalGaussian.expectation(nat))
        # mu2 - mu1^2 cancels up to |m|^2 p relative rounding; these cases keep that below 1e5
        np.testing.assert_allclose(nat2.eta1, nat.eta1, rtol=1e-9, atol=1e-12)
        np.testing.assert_allclose(nat2.eta2, nat.eta2, rtol=1e-9)
        exp = GaussianExpectation(mean, mean**2 + 1.0 / precision)
        exp2 = DiagonalGaussian.expectation(DiagonalGaussian.from_expectation(exp))
        np.testing.assert_allclose(exp2.mu1, exp.mu1, rtol=1e-12, atol=1e-14)
        np.testing.assert_allclose(exp2.mu2, exp.mu2, rtol=1e-12)


@pytest.mark.parametrize("d", DIMS)
def test_full_round_trips(d):
    for seed in SEEDS:
        mean, precision = full_case(seed, d)
        nat = FullGaussian.to_natural(mean, precision)
        np.testing.assert_allclose(nat.eta1, precision @ mean, rtol=1e-12)
        np.testing.assert_allclose(nat.eta2, -0.5 * precision, rtol=1e-15)
        m2, p2 = FullGaussian.from_natural(nat)
        np.testing.assert_allclose(m2, mean, rtol=1e-9, atol=1e-10)
        np.testing.assert_allclose(p2, precision, rtol=1e-14)
        nat2 = FullGaussian.from_expectation(FullGaussian.expectation(nat))
        np.testing.assert_allclose(nat2.eta1, nat.eta1, rtol=1e-7, atol=1e-7)
        np.testing.assert_allclose(nat2.eta2, nat.eta2, rtol=1e-7, atol=1e-7)


# -- entropy and log density against numpyro.distributions ---------------------------------------


@jax.jit
def _diag_vs_numpyro(mean, precision, x):
    ref = dist.Normal(mean, 1.0 / jnp.sqrt(precision)).to_event(mean.ndim)
    ours = (DiagonalGaussian.entropy(precision), DiagonalGaussian.log_prob(x, mean, precision))
    return ours, (ref.entropy(), ref.log_prob(x))


@jax.jit
def _full_vs_numpyro(mean, precision, x):
    ref = dist.MultivariateNormal(mean, covariance_matrix=jnp.linalg.inv(precision))
    ours = (FullGaussian.entropy(precision), FullGaussian.log_prob(x, mean, precision))
    return ours, (ref.entropy(), ref.log_prob(x))


def test_diagonal_entropy_and_log_prob_match_numpyro():
    for seed in SEEDS:
        mean, precision = diag_case(seed)
        x = DiagonalGaussian.sample(jax.random.PRNGKey(seed), mean, precision, (7,))
        assert x.shape == (7,) + mean.shape
        (ent, lp), (ref_ent, ref_lp) = _diag_vs_numpyro(mean, precision, x)
        assert lp.shape == (7,)
        np.testing.assert_allclose(ent, ref_ent, rtol=1e-12)
        np.testing.assert_allclose(lp, ref_lp, rtol=1e-12)
    # scalar (0-d) parameters
    (ent, lp), (ref_ent, ref_lp) = _diag_vs_numpyro(mean[0, 0], precision[0, 0], jnp.asarray(0.5))
    np.testing.assert_allclose(ent, ref_ent, rtol=1e-12)
    np.testing.assert_allclose(lp, ref_lp, rtol=1e-12)


@pytest.mark.parametrize("d", DIMS)
def test_full_entropy_and_log_prob_match_numpyro(d):
    for seed in SEEDS:
        mean, precision = full_case(seed, d)
        x = FullGaussian.sample(jax.random.PRNGKey(seed), mean, precision, (7,))
        assert x.shape == (7, d)
        (ent, lp), (ref_ent, ref_lp) = _full_vs_numpyro(mean, precision, x)
        np.testing.assert_allclose(ent, ref_ent, rtol=1e-10)
        np.testing.assert_allclose(lp, ref_lp, rtol=1e-10)


# -- sampling ------------------------------------------------------------------------------------

N_SAMPLES = 200_000
# With N independent draws the sample mean of x_i has standard error sd_i / sqrt(N), and the
# sample covariance entry C_ij has standard error sqrt((S_ii S_jj + S_ij^2) / N) (Gaussian fourth
# moments; it is sd_i^2 sqrt(2/N) on the diagonal). 5 standard errors is a two-sided bound that a
# correct sampler violates with probability < 1e-6 per entry; the seeds are fixed in any case.
N_SE = 5.0


def test_diagonal_sample_moments():
    for seed in SEEDS:
        mean, precision = diag_case(seed)
        x = DiagonalGaussian.sample(jax.random.PRNGKey(10 + seed), mean, precision, (N_SAMPLES,))
        var = 1.0 / precision
        se_mean = jnp.sqrt(var / N_SAMPLES)
        se_var = var * jnp.sqrt(2.0 / N_SAMPLES)
        assert np.all(np.abs(x.mean(0) - mean) < N_SE * se_mean)
        assert np.all(np.abs(x.var(0) - var) < N_SE * se_var)


@pytest.mark.parametrize("d", [3])
def test_full_sample_moments(d):
    for seed in SEEDS:
        mean, precision = full_case(seed, d)
        cov = np.linalg.inv(np.asarray(precision))
        x = np.asarray(FullGaussian.sample(jax.random.PRNGKey(20 + seed), mean, precision, (N_SAMPLES,)))
        sd = np.sqrt(np.diag(cov))
        assert np.all(np.abs(x.mean(0) - mean) < N_SE * sd / np.sqrt(N_SAMPLES))
        se_cov = np.sqrt((np.outer(np.diag(cov), np.diag(cov)) + cov**2) / N_SAMPLES)
        assert np.all(np.abs(np.cov(x, rowvar=False) - cov) < N_SE * se_cov)


def test_sample_is_reparameterised():
    """The draw is m + L eps with L the covariance's Cholesky factor, the same eps as jax.random.normal."""
    mean, precision = full_case(4, 3)
    key = jax.random.PRNGKey(3)
    eps = jax.random.normal(key, (5, 3), dtype=jnp.float64)
    ref = mean + eps @ np.linalg.cholesky(np.linalg.inv(np.asarray(precision))).T
    np.testing.assert_allclose(FullGaussian.sample(key, mean, precision, (5,)), ref, rtol=1e-9, atol=1e-10)
    mean, precision = diag_case(4)
    eps = jax.random.normal(key, (5,) + mean.shape, dtype=jnp.float64)
    np.testing.assert_allclose(DiagonalGaussian.sample(key, mean, precision, (5,)), mean + eps / jnp.sqrt(precision), rtol=1e-12)


# -- precision <-> Cholesky factor of the covariance ---------------------------------------------


@pytest.mark.parametrize("d", [1, 3, 8])
@pytest.mark.parametrize("log10_range", [(-1.5, 1.5), (-4.0, 4.0)])
def test_precision_to_scale_tril(d, log10_range):
    for seed in SEEDS:
        rng = np.random.default_rng(seed)
        precision = random_spd(rng, d, log10_range)
        cov = np.linalg.inv(precision)
        L = np.asarray(precision_to_scale_tril(jnp.asarray(precision)))
        assert L.shape == (d, d)
        assert np.all(np.triu(L, k=1) == 0.0), "not lower triangular"
        assert np.all(np.diag(L) > 0), "diagonal not positive"
        cond = np.linalg.cond(precision)
        # backward-stable factorisation: error relative to |cov| grows like cond(S) * eps
        tol = 1e-13 * cond
        np.testing.assert_allclose(L @ L.T, cov, rtol=0, atol=tol * np.abs(cov).max())
        # the Cholesky factor with positive diagonal is unique
        np.testing.assert_allclose(L, np.linalg.cholesky(cov), rtol=0, atol=tol * np.abs(L).max())
        # and back
        np.testing.assert_allclose(
            scale_tril_to_precision(jnp.asarray(L)), precision, rtol=0, atol=tol * np.abs(precision).max()
        )


def test_precision_to_scale_tril_batched():
    rng = np.random.default_rng(5)
    precision = np.stack([random_spd(rng, 3) for _ in range(4)]).reshape(2, 2, 3, 3)
    L = np.asarray(precision_to_scale_tril(jnp.asarray(precision)))
    assert L.shape == (2, 2, 3, 3)
    for idx in np.ndindex(2, 2):
        np.testing.assert_allclose(L[idx], np.linalg.cholesky(np.linalg.inv(precision[idx])), rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(scale_tril_to_precision(jnp.asarray(L)), precision, rtol=1e-10, atol=1e-10)


def test_scale_tril_to_precision_inverts_covariance():
    rng = np.random.default_rng(6)
    d = 4
    L = np.tril(rng.normal(size=(d, d)), k=-1) + np.diag(rng.uniform(0.5, 2.0, size=d))
    S = np.asarray(scale_tril_to_precision(jnp.asarray(L)))
    np.testing.assert_allclose(S, S.T, rtol=0, atol=1e-12)
    np.testing.assert_allclose(S @ (L @ L.T), np.eye(d), rtol=0, atol=1e-10)


def test_float32_without_x64_context():
    """The functions keep the input dtype (float32 is what SVI uses by default)."""
    with jax.enable_x64(False):
        mean, precision = jnp.zeros(3), jnp.eye(3) * 2.0
        assert precision_to_scale_tril(precision).dtype == jnp.float32
        assert FullGaussian.sample(jax.random.PRNGKey(0), mean, precision, (2,)).dtype == jnp.float32
        assert DiagonalGaussian.sample(jax.random.PRNGKey(0), mean, jnp.ones(3)).dtype == jnp.float32
        nat = FullGaussian.to_natural(mean, precision)
        assert isinstance(nat, GaussianNatural) and nat.eta2.dtype == jnp.float32
