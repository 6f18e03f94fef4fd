r"""Bernoulli exponential family, elementwise over arrays of any shape.

:math:`q(x) = p^x (1-p)^{1-x}` on :math:`x \in \{0, 1\}` is an exponential family with base measure 1 and

* sufficient statistic  :math:`T(x) = x`,
* natural parameter     :math:`\lambda = \log\frac{p}{1-p}` (the logit, unconstrained),
* expectation parameter :math:`\mu = \nabla A(\lambda) = p = \sigma(\lambda)`,
* log-partition         :math:`A(\lambda) = \log(1 + e^\lambda)` (softplus).

The BLR (Khan & Rue 2023) is :math:`\lambda \leftarrow (1-\rho)\lambda - \rho\,
\nabla_\mu \mathbb E_q[\ell]`; every real :math:`\lambda` is valid, so no correction is needed.

:class:`SignBernoulli` is the same family on :math:`\pm1` weights, BayesBiNN's units (Meng et al. 2020).
"""

import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpyro.distributions as dist


class BernoulliNatural(NamedTuple):
    """Natural parameter: the logit."""

    logits: jax.Array


class BernoulliExpectation(NamedTuple):
    """Expectation parameter: the probability ``p = E[x]``."""

    probs: jax.Array


class Bernoulli:
    """Bernoulli family :math:`\\prod_i \\mathrm{Bern}(\\sigma(\\lambda_i))`; user parameter: the logits."""

    Natural = BernoulliNatural
    Expectation = BernoulliExpectation

    @staticmethod
    def to_natural(logits):
        """The natural parameter is the logit itself."""
        return BernoulliNatural(logits)

    @staticmethod
    def from_natural(natural):
        """The logits."""
        return natural.logits

    @staticmethod
    def from_probs(probs):
        """Natural parameter from probabilities ``p`` (``log p - log(1 - p)``)."""
        return BernoulliNatural(jnp.log(probs) - jnp.log1p(-probs))

    @staticmethod
    def expectation(natural):
        r""":math:`\mu = \sigma(\lambda)`."""
        return BernoulliExpectation(jax.nn.sigmoid(natural.logits))

    @staticmethod
    def sufficient_statistics(x):
        """:math:`T(x) = x`, in the layout of the expectation parameter."""
        return BernoulliExpectation(x)

    @staticmethod
    def to_numpyro(logits):
        """The NumPyro distribution (elementwise, batch shape of the logits)."""
        return dist.Bernoulli(logits=logits)

    @staticmethod
    def from_numpyro(d):
        """The logits of a NumPyro ``Bernoulli`` (``BernoulliProbs`` or ``BernoulliLogits``)."""
        return d.logits

    @staticmethod
    def from_expectation(expectation):
        r""":math:`\lambda = \log\mu - \log(1-\mu)`."""
        return Bernoulli.from_probs(expectation.probs)

    @staticmethod
    def quadrature(expectation, natural=None):
        r"""Enumeration, exact for every function of :math:`x`: points ``(0, 1)`` (shape ``(2,) + p.shape``) with
        weights :math:`(1 - p, p)`, affine in :math:`\mu = p`. With ``natural``, :math:`1 - p`'s value is
        :math:`\sigma(-\lambda)` (no cancellation) and its derivative is still taken through :math:`\mu`."""
        p = expectation.probs
        q = 1.0 - p
        if natural is not None:
            q = jax.nn.sigmoid(-natural.logits) + (q - jax.lax.stop_gradient(q))
        points = jnp.stack([jnp.zeros_like(p), jnp.ones_like(p)])
        return points, jnp.stack([q, p])

    @staticmethod
    def log_partition(natural):
        r"""Sum of :math:`\mathrm{softplus}(\lambda)`."""
        return jnp.sum(jax.nn.softplus(natural.logits))

    @staticmethod
    def entropy(logits):
        r"""Sum over entries of :math:`A(\lambda) - \lambda\sigma(\lambda)`."""
        return jnp.sum(jax.nn.softplus(logits) - logits * jax.nn.sigmoid(logits))

    @staticmethod
    def sample(key, logits, sample_shape=()):
        """Exact draw in {0, 1} (not reparameterisable; see :meth:`relaxed_sample`)."""
        shape = tuple(sample_shape) + jnp.shape(logits)
        return jax.random.bernoulli(key, jax.nn.sigmoid(logits), shape).astype(jnp.result_type(logits))

    @staticmethod
    def relaxed_sample(key, logits, temperature, sample_shape=()):
        r"""Reparameterised Concrete / Gumbel-softmax relaxation :math:`\sigma((\lambda + \log\frac{u}{1-u})/\tau)`
        (Maddison et al. 2017; Jang et al. 2017; used by BayesBiNN, Meng et al. 2020)."""
        shape = tuple(sample_shape) + jnp.shape(logits)
        u = jax.random.uniform(key, shape, dtype=jnp.result_type(logits), minval=1e-12, maxval=1.0 - 1e-7)
        return jax.nn.sigmoid((logits + jnp.log(u) - jnp.log1p(-u)) / temperature)

    @staticmethod
    def log_prob(x, logits):
        """Log mass summed over the parameter's dimensions (extra leading axes of ``x`` are kept)."""
        lp = x * logits - jax.nn.softplus(logits)
        return jnp.sum(lp, axis=tuple(range(-jnp.ndim(logits), 0)))

    @staticmethod
    def natural_gradient(natural, grad_mu):
        r""":math:`\nabla_\mu\mathcal L = \lambda + \nabla_\mu\mathbb E_q[\ell]` (Khan & Rue 2023)."""
        return BernoulliNatural(natural.logits + grad_mu.probs)

    @staticmethod
    def blr_update(natural, grad_mu, lr, improved=True, max_step=None):
        r"""One BLR step :math:`\lambda \leftarrow (1-\rho)\lambda - \rho\nabla_\mu\mathbb E_q[\ell]` on the logits.

        ``grad_mu`` is a :class:`BernoulliExpectation` holding :math:`\nabla_\mu\mathbb E_q[\ell]`. The logit
        space is all of :math:`\mathbb R`, so ``improved`` changes nothing (kept for a uniform signature).
        """
        del improved, max_step  # the natural parameters are unconstrained
        return BernoulliNatural((1.0 - lr) * natural.logits - lr * grad_mu.probs)

    @staticmethod
    def is_valid(natural):
        """``True`` where the logit is finite (every real logit is valid)."""
        return jnp.isfinite(natural.logits)


class SignBernoulli:
    r"""The Bernoulli family on :math:`w = 2x - 1 \in \{-1, +1\}`, elementwise: :math:`q(w) \propto e^{\lambda w}`.

    :math:`\lambda` is half :class:`Bernoulli`'s logit, :math:`\mu = \mathbb E[w] = \tanh\lambda` and
    :math:`\operatorname{Var}[w] = 1 - \mu^2 = \partial\mu/\partial\lambda`. Draws are maps of uniforms ``u`` in
    (0, 1), which an estimator can then reuse: exact, or the Concrete / Gumbel-softmax relaxation at
    temperature :math:`\tau` (Maddison et al. 2017; Jang et al. 2017; :meth:`Bernoulli.relaxed_sample` in these units).
    """

    @staticmethod
    def expectation(lam):
        return jnp.tanh(lam)

    @staticmethod
    def log_variance(lam):
        r""":math:`\log(1 - \tanh^2\lambda) = \log 4 - 2|\lambda| - 2\log(1 + e^{-2|\lambda|})`, exact where
        :math:`\tanh` saturates."""
        a = jnp.abs(lam)
        return math.log(4.0) - 2.0 * a - 2.0 * jnp.log1p(jnp.exp(-2.0 * a))

    @staticmethod
    def mode(lam):
        r""":math:`\operatorname{sign}\mu`, :math:`-1` where :math:`\mu \le 0`."""
        return jnp.where(lam <= 0, -1.0, 1.0).astype(lam.dtype)

    @staticmethod
    def from_uniform(lam, u):
        r"""Exact draw: :math:`+1` where :math:`u < \sigma(2\lambda) = P(w = +1)`."""
        return jnp.where(u < jax.nn.sigmoid(2.0 * lam), 1.0, -1.0).astype(lam.dtype)

    @staticmethod
    def relaxed_argument(lam, u, temperature):
        r""":math:`a = (\lambda + \tfrac12\log\frac{u}{1-u})/\tau`."""
        return (lam + 0.5 * (jnp.log(u) - jnp.log1p(-u))) / temperature

    @staticmethod
    def relaxed_from_uniform(lam, u, temperature):
        r"""Relaxed draw :math:`w_r = \tanh a` (:meth:`relaxed_argument`), differentiable in :math:`\lambda`."""
        return jnp.tanh(SignBernoulli.relaxed_argument(lam, u, temperature))
