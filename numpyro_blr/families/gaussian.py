r"""Gaussian exponential families, diagonal and full covariance.

A Gaussian :math:`q(\theta) = \mathcal{N}(m, S^{-1})` with mean :math:`m` and
precision :math:`S` is an exponential family with sufficient statistics
:math:`T(\theta) = (\theta, \theta\theta^\top)` and

* natural parameters     :math:`\lambda = (S m, -\tfrac12 S)`,
* expectation parameters :math:`\mu = (m, m m^\top + S^{-1})`,
* log-partition          :math:`A(\lambda) = -\tfrac14 \lambda_1^\top \lambda_2^{-1}\lambda_1
  - \tfrac12 \log\det(-2\lambda_2) + \tfrac{D}{2}\log 2\pi`,

so that :math:`\mu = \nabla A(\lambda)` (Khan & Rue 2023, Sec. 1.3 and App. B).
The diagonal family is the same with every matrix diagonal, stored as a vector
(elementwise over arrays of any shape).

All functions are pure and work on the last axis (full) or elementwise (diagonal).
"""

import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpyro.distributions as dist
from jax.scipy.linalg import solve_triangular

_LOG_2PI = math.log(2 * math.pi)  # a Python float: follows the dtype of the inputs


class GaussianNatural(NamedTuple):
    """Natural parameters ``(eta1, eta2) = (S m, -S/2)``."""

    eta1: jax.Array
    eta2: jax.Array


class GaussianExpectation(NamedTuple):
    """Expectation parameters ``(mu1, mu2) = (E[x], E[x x^T])`` (``E[x^2]`` elementwise when diagonal)."""

    mu1: jax.Array
    mu2: jax.Array


def _solve(matrix, vector):
    """``matrix^-1 vector`` over the last axes; leading axes are a batch."""
    return jnp.linalg.solve(matrix, vector[..., None])[..., 0]


def precision_to_scale_tril(precision):
    r"""Lower Cholesky factor :math:`L` of :math:`S^{-1}` from the precision :math:`S`, with one Cholesky.

    With the reversal permutation :math:`J`, write :math:`J S J = K K^\top`. Then
    :math:`S^{-1} = (J K^{-\top} J)(J K^{-\top} J)^\top` and :math:`J K^{-\top} J` is lower
    triangular with a positive diagonal, so it is the Cholesky factor of the covariance.
    No explicit inverse of :math:`S` is formed.
    """
    flipped = jnp.flip(precision, axis=(-2, -1))
    k = jnp.linalg.cholesky(flipped)
    eye = jnp.broadcast_to(jnp.eye(precision.shape[-1], dtype=precision.dtype), precision.shape)
    k_inv = solve_triangular(k, eye, lower=True)
    return jnp.flip(jnp.swapaxes(k_inv, -1, -2), axis=(-2, -1))


def scale_tril_to_precision(scale_tril):
    r"""Precision :math:`S = L^{-\top} L^{-1}` from the covariance's Cholesky factor :math:`L`."""
    eye = jnp.broadcast_to(jnp.eye(scale_tril.shape[-1], dtype=scale_tril.dtype), scale_tril.shape)
    l_inv = solve_triangular(scale_tril, eye, lower=True)
    return jnp.swapaxes(l_inv, -1, -2) @ l_inv


class DiagonalGaussian:
    r"""Mean-field Gaussian :math:`\prod_i \mathcal{N}(m_i, 1/p_i)`, elementwise over arrays of any shape."""

    Natural = GaussianNatural
    Expectation = GaussianExpectation

    @staticmethod
    def sufficient_statistics(x):
        r""":math:`T(x) = (x,\ x^2)` elementwise, in the layout of the expectation parameters."""
        return GaussianExpectation(x, x * x)

    @staticmethod
    def to_numpyro(mean, precision):
        return dist.Normal(mean, jax.lax.rsqrt(precision))

    @staticmethod
    def from_numpyro(d):
        """``(mean, precision)`` of a NumPyro ``Normal`` (elementwise)."""
        return d.loc, 1.0 / d.scale**2

    @staticmethod
    def to_natural(mean, precision):
        return GaussianNatural(precision * mean, -0.5 * precision)

    @staticmethod
    def from_natural(natural):
        """``(mean, precision)`` from natural parameters."""
        precision = -2.0 * natural.eta2
        return natural.eta1 / precision, precision

    @staticmethod
    def expectation(natural):
        mean, precision = DiagonalGaussian.from_natural(natural)
        return GaussianExpectation(mean, mean**2 + 1.0 / precision)

    @staticmethod
    def from_expectation(expectation):
        """Natural parameters from expectation parameters (the inverse of :meth:`expectation`)."""
        mean = expectation.mu1
        precision = 1.0 / (expectation.mu2 - mean**2)
        return DiagonalGaussian.to_natural(mean, precision)

    @staticmethod
    def log_partition(natural):
        """Sum over all entries of ``-eta1^2/(4 eta2) - log(-2 eta2)/2 + log(2 pi)/2``."""
        a = -(natural.eta1**2) / (4.0 * natural.eta2) - 0.5 * jnp.log(-2.0 * natural.eta2) + 0.5 * _LOG_2PI
        return jnp.sum(a)

    @staticmethod
    def entropy(precision):
        """Sum over entries of ``(log(2 pi e) - log p)/2``."""
        return jnp.sum(0.5 * (_LOG_2PI + 1.0 - jnp.log(precision)))

    @staticmethod
    def sample(key, mean, precision, sample_shape=()):
        """Reparameterised draw ``m + eps / sqrt(p)``."""
        eps = jax.random.normal(key, tuple(sample_shape) + jnp.shape(mean), dtype=jnp.result_type(mean))
        return mean + eps * jax.lax.rsqrt(precision)

    @staticmethod
    def log_prob(x, mean, precision):
        return jnp.sum(0.5 * (jnp.log(precision) - _LOG_2PI) - 0.5 * precision * (x - mean) ** 2, axis=tuple(range(-jnp.ndim(mean), 0)))


class FullGaussian:
    r"""Gaussian :math:`\mathcal{N}(m, S^{-1})` over a vector, with a dense precision matrix :math:`S`."""

    Natural = GaussianNatural
    Expectation = GaussianExpectation

    @staticmethod
    def to_natural(mean, precision):
        """Natural parameters; leading axes of ``mean`` (``(..., D)``) and ``precision`` (``(..., D, D)``) are a batch."""
        return GaussianNatural(jnp.einsum("...ij,...j->...i", precision, mean), -0.5 * precision)

    @staticmethod
    def sufficient_statistics(x):
        r""":math:`T(x) = (x,\ x x^\top)` over the last axis, in the layout of the expectation parameters."""
        return GaussianExpectation(x, x[..., :, None] * x[..., None, :])

    @staticmethod
    def to_numpyro(mean, precision):
        return dist.MultivariateNormal(mean, precision_matrix=precision)

    @staticmethod
    def from_numpyro(d):
        """``(mean, precision)`` of a NumPyro ``MultivariateNormal``, or of a ``Normal`` over a vector
        (a diagonal precision)."""
        if isinstance(d, dist.Normal):
            return d.loc, jnp.diag(1.0 / d.scale**2)
        return d.loc, d.precision_matrix

    @staticmethod
    def from_natural(natural):
        precision = -2.0 * natural.eta2
        return _solve(precision, natural.eta1), precision

    @staticmethod
    def expectation(natural):
        mean, precision = FullGaussian.from_natural(natural)
        return GaussianExpectation(mean, mean[..., :, None] * mean[..., None, :] + jnp.linalg.inv(precision))

    @staticmethod
    def from_expectation(expectation):
        mean = expectation.mu1
        precision = jnp.linalg.inv(expectation.mu2 - mean[..., :, None] * mean[..., None, :])
        return FullGaussian.to_natural(mean, precision)

    @staticmethod
    def log_partition(natural):
        r""":math:`A(\lambda)`, summed over leading (batch) axes."""
        neg2eta2 = -2.0 * natural.eta2
        d = natural.eta1.shape[-1]
        quad = jnp.einsum("...i,...i->...", natural.eta1, _solve(neg2eta2, natural.eta1))
        return jnp.sum(0.5 * quad - 0.5 * jnp.linalg.slogdet(neg2eta2)[1] + 0.5 * d * _LOG_2PI)

    @staticmethod
    def quadrature(expectation, natural=None):
        r"""A quadrature rule exact for every function that is quadratic in :math:`x` (affine in :math:`T(x)`):
        the :math:`2D` points :math:`m \pm \sqrt{D} L e_i` (:math:`LL^\top = \Sigma`) with weights :math:`1/(2D)`,
        so that :math:`\sum_j w_j T(x_j) = \mu` (the degree-3 spherical cubature rule of Arasaratnam & Haykin 2009).
        Returns ``(points, weights)``: ``points`` of shape ``(2D,) + mean.shape``, ``weights`` of shape ``(2D,)``.

        The points are functions of the expectation parameters, so that autodiff through them gives
        :math:`\nabla_\mu`; with ``natural`` the covariance's *value* is :math:`S^{-1}` (no cancellation in
        :math:`\mu_2 - \mu_1\mu_1^\top`) while its derivative is still taken through :math:`\mu`.
        """
        mean = expectation.mu1
        cov = expectation.mu2 - mean[..., :, None] * mean[..., None, :]
        if natural is not None:
            stable = jnp.linalg.inv(-2.0 * natural.eta2)
            cov = stable + (cov - jax.lax.stop_gradient(cov))
        cov = 0.5 * (cov + jnp.swapaxes(cov, -1, -2))
        chol = jnp.linalg.cholesky(cov)
        d = mean.shape[-1]
        u = math.sqrt(d) * jnp.concatenate([jnp.eye(d, dtype=mean.dtype), -jnp.eye(d, dtype=mean.dtype)])
        points = mean[None] + jnp.einsum("pj,...ij->p...i", u, chol)
        return points, jnp.full((2 * d,), 1.0 / (2 * d), mean.dtype)

    @staticmethod
    def entropy(precision):
        """Entropy per leading (batch) index of ``precision``."""
        d = precision.shape[-1]
        return 0.5 * d * (_LOG_2PI + 1.0) - 0.5 * jnp.linalg.slogdet(precision)[1]

    @staticmethod
    def sample(key, mean, precision, sample_shape=()):
        """Reparameterised draw ``m + L eps`` with ``L L^T = S^{-1}``."""
        scale_tril = precision_to_scale_tril(precision)
        eps = jax.random.normal(key, tuple(sample_shape) + jnp.shape(mean), dtype=jnp.result_type(mean))
        return mean + eps @ scale_tril.T

    @staticmethod
    def log_prob(x, mean, precision):
        d = mean.shape[-1]
        diff = x - mean
        quad = jnp.einsum("...i,ij,...j->...", diff, precision, diff)
        return 0.5 * (jnp.linalg.slogdet(precision)[1] - d * _LOG_2PI - quad)

    @staticmethod
    def natural_gradient(natural, grad_mu):
        r""":math:`\nabla_\mu\mathcal L = \lambda + \nabla_\mu\mathbb E_q[\ell]` (Khan & Rue 2023)."""
        return GaussianNatural(natural.eta1 + grad_mu.mu1, natural.eta2 + grad_mu.mu2)

    @staticmethod
    def blr_update(natural, grad_mu, lr, improved=True):
        r"""One BLR step; ``grad_mu`` holds :math:`\nabla_\mu\mathbb E_q[\ell]` (a :class:`GaussianExpectation`).

        ``improved=False``: :math:`\lambda \leftarrow (1-\rho)\lambda - \rho\nabla_\mu\mathbb E_q[\ell]`,
        exactly :math:`-\nabla_\mu\mathbb E_q[\ell]` at ``lr = 1`` (conjugate updates). Otherwise the
        precision takes the positivity-preserving step of :mod:`numpyro_blr.rules.blr` (``improved`` is
        its rule) with :math:`\hat H = 2\nabla_{\mu_2}\mathbb E_q[\ell]` (Price) and the mean
        :math:`m \leftarrow m - \rho S_{\rm new}^{-1}\hat g`, :math:`\hat g = \nabla_{\mu_1}\mathbb E_q[\ell] + \hat H m`
        (Bonnet), which is the plain step when the precision step is.
        """
        if improved is False or improved == "plain":
            return GaussianNatural(*[(1.0 - lr) * lam - lr * g for lam, g in zip(natural, grad_mu)])
        from numpyro_blr.rules.blr import full_precision_update  # rules.blr imports this module

        mean, precision = FullGaussian.from_natural(natural)
        hess = 2.0 * grad_mu.mu2
        new_precision = full_precision_update(precision, None, hess, lr, improved)
        new_mean = mean - lr * jnp.linalg.solve(new_precision, grad_mu.mu1 + hess @ mean)
        return FullGaussian.to_natural(new_mean, new_precision)

    @staticmethod
    def is_valid(natural):
        """``True`` where the precision is positive definite (its Cholesky factor is finite) and
        the natural parameters are finite."""
        chol = jnp.linalg.cholesky(-2.0 * natural.eta2)
        return jnp.all(jnp.isfinite(chol)) & jnp.all(jnp.isfinite(natural.eta1))
