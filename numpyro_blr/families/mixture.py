r"""Mixture of :math:`K` Gaussians over a flat vector: log densities, derivatives of :math:`\log q`, sampling.

.. math::
    q(\theta) = \sum_{c=1}^K \pi_c\, \mathcal N(\theta \mid m_c, S_c^{-1}),
    \qquad v_c = \log(\pi_c / \pi_K) \ (v_K = 0).

Every function takes the mixture as ``q``, any object with fields ``means`` (K, d), ``precision``
(K, d, d), or (K, d) for diagonal components, and ``logits`` :math:`v` (K,): a
:class:`~numpyro_blr.mixture.MixtureState`. Whether the components are diagonal is read from the
shape of ``precision``. With :math:`S_c = R_c R_c^\top` (:func:`precision_cholesky`), the
responsibilities :math:`r_c = q(c\mid\theta) = \pi_c\mathcal N_c(\theta)/q(\theta)` and
:math:`a_c = -S_c(\theta - m_c)`, the derivatives of :math:`\log q` are exact
(Lin, Khan & Schmidt 2019):

.. math::
    \nabla\log q = \bar a = \sum_c r_c a_c, \qquad
    \nabla^2\log q = \sum_c r_c (a_c a_c^\top - S_c) - \bar a\bar a^\top.
"""

import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.scipy.linalg import solve_triangular
from jax.scipy.special import logsumexp

_LOG_2PI = math.log(2 * math.pi)


def is_diagonal(q):
    """Whether the components' precisions are diagonals (shape (K, d))."""
    return q.precision.ndim == 2


def log_weights(logits):
    r""":math:`\log\pi_c = v_c - \operatorname{logsumexp}(v)`."""
    return logits - logsumexp(logits)


def weights(q):
    r"""Mixture weights :math:`\pi = \operatorname{softmax}(v)`."""
    return jax.nn.softmax(q.logits)


def precision_cholesky(q):
    """Lower Cholesky factors :math:`R_c` of :math:`S_c` (the square root of a diagonal)."""
    return jnp.sqrt(q.precision) if is_diagonal(q) else jnp.linalg.cholesky(q.precision)


def component_log_probs(x, means, chols):
    r""":math:`\log\mathcal N(x \mid m_c, S_c^{-1})` for ``x`` (n, d) from the factors ``chols``: (n, K)."""
    d = means.shape[-1]
    diff = x[:, None, :] - means[None]  # (n, K, d)
    if chols.ndim == means.ndim:
        maha = jnp.sum((chols[None] * diff) ** 2, -1)
        logdet = jnp.sum(jnp.log(chols), -1)
    else:
        proj = jnp.einsum("kji,nkj->nki", chols, diff)  # R_c^T (x - m_c)
        maha = jnp.sum(proj**2, -1)
        logdet = jnp.sum(jnp.log(jnp.diagonal(chols, axis1=-2, axis2=-1)), -1)
    return -0.5 * d * _LOG_2PI + logdet[None] - 0.5 * maha


class LogQ(NamedTuple):
    """At ``n`` points: log q (n,), log N_c (n, K), responsibilities (n, K), gradient (n, d), Hessian
    (n, d, d) or its diagonal (n, d)."""

    value: jax.Array
    components: jax.Array
    responsibilities: jax.Array
    grad: jax.Array
    hessian: jax.Array


def log_q_terms(x, q, chols=None):
    """:math:`\\log q`, its components, responsibilities, gradient and Hessian at ``x`` (n, d) (module docstring)."""
    chols = precision_cholesky(q) if chols is None else chols
    log_n = component_log_probs(x, q.means, chols)
    joint = log_n + log_weights(q.logits)[None]
    log_q = logsumexp(joint, axis=-1)
    r = jnp.exp(joint - log_q[:, None])  # (n, K)
    diff = x[:, None, :] - q.means[None]
    if is_diagonal(q):
        a = -q.precision[None] * diff  # (n, K, d)
        a_bar = jnp.einsum("nk,nkd->nd", r, a)
        hess = jnp.einsum("nk,nkd->nd", r, a * a - q.precision[None]) - a_bar**2
    else:
        a = -jnp.einsum("kij,nkj->nki", q.precision, diff)
        a_bar = jnp.einsum("nk,nkd->nd", r, a)
        hess = (
            jnp.einsum("nk,nki,nkj->nij", r, a, a)
            - jnp.einsum("nk,kij->nij", r, q.precision)
            - a_bar[:, :, None] * a_bar[:, None, :]
        )
    return LogQ(log_q, log_n, r, a_bar, hess)


def log_prob(q, x):
    """:math:`\\log q(x)` for ``x`` of shape (d,) or (n, d)."""
    x = jnp.asarray(x, q.means.dtype)
    flat = x.reshape(-1, q.means.shape[1])
    out = logsumexp(component_log_probs(flat, q.means, precision_cholesky(q)) + log_weights(q.logits), -1)
    return out.reshape(x.shape[:-1])


def sample(key, q, num_samples):
    """``num_samples`` ancestral draws from the mixture: (num_samples, d)."""
    k1, k2 = jax.random.split(key)
    comp = jax.random.categorical(k1, q.logits, shape=(num_samples,))
    eps = jax.random.normal(k2, (num_samples, q.means.shape[1]), q.means.dtype)
    chols = precision_cholesky(q)[comp]
    if is_diagonal(q):
        return q.means[comp] + eps / chols
    return q.means[comp] + jax.vmap(lambda r, e: solve_triangular(r.T, e, lower=False))(chols, eps)


def sample_components(key, q, num_samples, chols=None):
    r"""``num_samples`` draws from every component, :math:`\theta_{cs} = m_c + R_c^{-\top}\epsilon_{cs}`:
    (K * num_samples, d), component-major (stratified sampling of :math:`q`)."""
    chols = precision_cholesky(q) if chols is None else chols
    K, d = q.means.shape
    eps = jax.random.normal(key, (K, num_samples, d), q.means.dtype)
    if is_diagonal(q):
        noise = eps / chols[:, None, :]
    else:
        noise = solve_triangular(jnp.swapaxes(chols, -1, -2), jnp.swapaxes(eps, -1, -2), lower=False)
        noise = jnp.swapaxes(noise, -1, -2)
    return (q.means[:, None, :] + noise).reshape(K * num_samples, d)
