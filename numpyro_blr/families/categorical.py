r"""Categorical exponential family over :math:`K` categories (last axis; leading axes are a batch).

In its minimal form, with the last category as reference, :math:`q(x = k) = p_k` is an exponential
family with base measure 1 and

* sufficient statistics  :math:`T(x) = (\mathbb 1[x = 0], \dots, \mathbb 1[x = K-2])` (:math:`K - 1` entries),
* natural parameters     :math:`\lambda_k = \log(p_k / p_{K-1})`, :math:`k < K - 1` (unconstrained),
* expectation parameters :math:`\mu_k = p_k = \mathrm{softmax}(\lambda, 0)_k`,
* log-partition          :math:`A(\lambda) = \log\bigl(1 + \sum_k e^{\lambda_k}\bigr)`.

User parameters are the :math:`K` logits (any shift; :meth:`Categorical.from_natural` returns the ones
whose last entry is 0). The BLR (Khan & Rue 2023) is
:math:`\lambda \leftarrow (1-\rho)\lambda - \rho\nabla_\mu\mathbb E_q[\ell]`; every real
:math:`\lambda` is valid, so no correction is needed.
"""

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpyro.distributions as dist


class CategoricalNatural(NamedTuple):
    """Natural parameters ``log(p[:-1] / p[-1])``, shape ``(..., K - 1)``."""

    eta: jax.Array


class CategoricalExpectation(NamedTuple):
    """Expectation parameters ``p[:-1]``, shape ``(..., K - 1)``."""

    probs: jax.Array


def _full_logits(eta):
    return jnp.concatenate([eta, jnp.zeros_like(eta[..., :1])], -1)


class Categorical:
    """Categorical family over the last axis; user parameter: ``K`` logits."""

    Natural = CategoricalNatural
    Expectation = CategoricalExpectation

    @staticmethod
    def to_natural(logits):
        r""":math:`\lambda = \text{logits}_{:K-1} - \text{logits}_{K-1}`."""
        return CategoricalNatural(logits[..., :-1] - logits[..., -1:])

    @staticmethod
    def from_natural(natural):
        """``K`` logits with the last one 0."""
        return _full_logits(natural.eta)

    @staticmethod
    def from_probs(probs):
        r"""Natural parameters :math:`\log(p_{:K-1}/p_{K-1})` from ``K`` probabilities."""
        return CategoricalNatural(jnp.log(probs[..., :-1]) - jnp.log(probs[..., -1:]))

    @staticmethod
    def probs(natural):
        """All ``K`` probabilities."""
        return jax.nn.softmax(_full_logits(natural.eta), -1)

    @staticmethod
    def expectation(natural):
        r""":math:`\mu = p_{:K-1} = \mathrm{softmax}(\lambda, 0)_{:K-1} = \nabla A(\lambda)`."""
        return CategoricalExpectation(Categorical.probs(natural)[..., :-1])

    @staticmethod
    def sufficient_statistics(x, num_categories):
        r""":math:`T(x) = \text{one-hot}(x)_{:K-1}` of integer ``x``, in the layout of the expectation parameter."""
        return CategoricalExpectation(jax.nn.one_hot(x, num_categories)[..., :-1])

    @staticmethod
    def to_numpyro(logits):
        """The NumPyro distribution over the last axis of ``logits``."""
        return dist.Categorical(logits=logits)

    @staticmethod
    def from_numpyro(d):
        """The ``K`` logits of a NumPyro ``Categorical`` (``CategoricalProbs`` or ``CategoricalLogits``)."""
        return d.logits

    @staticmethod
    def from_expectation(expectation):
        r""":math:`\lambda_k = \log\mu_k - \log(1 - \sum_j\mu_j)`."""
        p = expectation.probs
        last = 1.0 - jnp.sum(p, -1, keepdims=True)
        return CategoricalNatural(jnp.log(p) - jnp.log(last))

    @staticmethod
    def quadrature(expectation, natural=None):
        r"""Enumeration, exact for every function of :math:`x`: points :math:`0, \dots, K-1` (shape ``(K,) + batch``,
        integer) with weights :math:`p_k` (shape ``(K,) + batch``), affine in :math:`\mu = p_{:K-1}`. With ``natural``,
        :math:`p_{K-1} = 1 - \sum_k \mu_k`'s value is the softmax's (no cancellation), its derivative through :math:`\mu`."""
        p = expectation.probs
        last = 1.0 - jnp.sum(p, -1)
        if natural is not None:
            last = Categorical.probs(natural)[..., -1] + (last - jax.lax.stop_gradient(last))
        k = p.shape[-1] + 1
        weights = jnp.moveaxis(jnp.concatenate([p, last[..., None]], -1), -1, 0)
        points = jnp.broadcast_to(jnp.arange(k).reshape((k,) + (1,) * (p.ndim - 1)), weights.shape)
        return points, weights

    @staticmethod
    def log_partition(natural):
        r"""Sum over the batch of :math:`\log(1 + \sum_k e^{\lambda_k})`."""
        return jnp.sum(jax.nn.logsumexp(_full_logits(natural.eta), -1))

    @staticmethod
    def entropy(logits):
        r"""Sum over the batch of :math:`-\sum_k p_k \log p_k`."""
        logp = jax.nn.log_softmax(logits, -1)
        return -jnp.sum(jnp.exp(logp) * logp)

    @staticmethod
    def sample(key, logits, sample_shape=()):
        """Exact integer draw (not reparameterisable; see :meth:`relaxed_sample`)."""
        return jax.random.categorical(key, logits, -1, tuple(sample_shape) + jnp.shape(logits)[:-1])

    @staticmethod
    def relaxed_sample(key, logits, temperature, sample_shape=()):
        r"""Reparameterised Gumbel-softmax draw :math:`\mathrm{softmax}((\text{logits} + g)/\tau)` on the simplex
        (Jang et al. 2017; Maddison et al. 2017)."""
        g = jax.random.gumbel(key, tuple(sample_shape) + jnp.shape(logits), dtype=jnp.result_type(logits))
        return jax.nn.softmax((logits + g) / temperature, -1)

    @staticmethod
    def log_prob(x, logits):
        """Log mass of integer ``x``, summed over the batch dimensions (extra leading axes kept)."""
        logp = jax.nn.log_softmax(logits, -1)
        lp = jnp.take_along_axis(jnp.broadcast_to(logp, jnp.shape(x) + logp.shape[-1:]), jnp.asarray(x)[..., None], -1)[..., 0]
        nb = jnp.ndim(logits) - 1
        return jnp.sum(lp, axis=tuple(range(-nb, 0))) if nb else lp

    @staticmethod
    def natural_gradient(natural, grad_mu):
        r""":math:`\nabla_\mu\mathcal L = \lambda + \nabla_\mu\mathbb E_q[\ell]` (Khan & Rue 2023)."""
        return CategoricalNatural(natural.eta + grad_mu.probs)

    @staticmethod
    def blr_update(natural, grad_mu, lr, improved=True, max_step=None):
        r"""One BLR step on the (unconstrained) natural parameters; ``improved`` changes nothing."""
        del improved, max_step  # the natural parameters are unconstrained
        return CategoricalNatural((1.0 - lr) * natural.eta - lr * grad_mu.probs)

    @staticmethod
    def is_valid(natural):
        """``True`` per batch element where every natural parameter is finite."""
        return jnp.all(jnp.isfinite(natural.eta), -1)
