r"""Beta exponential family, elementwise over arrays of any shape.

:math:`q(x) = \mathrm{Beta}(x \mid a, b) = x^{a-1}(1-x)^{b-1} / B(a, b)` is an exponential family with
base measure 1 and

* sufficient statistics  :math:`T(x) = (\log x,\ \log(1 - x))`,
* natural parameters     :math:`\lambda = (a - 1,\ b - 1)`,
* expectation parameters :math:`\mu = \nabla A(\lambda) = (\psi(a) - \psi(a + b),\ \psi(b) - \psi(a + b))`,
* log-partition          :math:`A(\lambda) = \log\Gamma(a) + \log\Gamma(b) - \log\Gamma(a + b)`,

valid for :math:`a, b > 0`. It is the two-category Dirichlet with :math:`x = (x, 1 - x)`, and its
BLR update is the Dirichlet's (see :mod:`numpyro_blr.families.dirichlet`): with the target
:math:`(\hat a, \hat b) = 1 - \nabla_\mu \mathbb E_q[\ell]` and :math:`d = (\hat a - a, \hat b - b)`,

.. math::
    a \leftarrow a + \rho d_a + \frac{\rho^2 d_a^2}{2a} = \frac a2 + \frac{(a + \rho d_a)^2}{2a} > 0,

and the same for :math:`b` (Lin, Schmidt & Khan 2020 retraction; Khan & Rue 2023).
"""

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpyro.distributions as dist
from jax.scipy.special import digamma, gammaln

from numpyro_blr.families.dirichlet import dirichlet_from_mean_log, simplex_two_point, trusted_step


class BetaNatural(NamedTuple):
    """Natural parameters ``(eta1, eta2) = (a - 1, b - 1)`` for ``(log x, log(1 - x))``."""

    eta1: jax.Array
    eta2: jax.Array


class BetaExpectation(NamedTuple):
    """Expectation parameters ``(E[log x], E[log(1 - x)])``."""

    mu1: jax.Array
    mu2: jax.Array


class Beta:
    r"""Beta family :math:`\prod_i \mathrm{Beta}(a_i, b_i)`; ``a`` = ``concentration1``, ``b`` = ``concentration0``."""

    Natural = BetaNatural
    Expectation = BetaExpectation

    @staticmethod
    def to_natural(concentration1, concentration0):
        r""":math:`\lambda = (a - 1, b - 1)`."""
        return BetaNatural(concentration1 - 1.0, concentration0 - 1.0)

    @staticmethod
    def from_natural(natural):
        """``(concentration1, concentration0) = (a, b)``."""
        return natural.eta1 + 1.0, natural.eta2 + 1.0

    @staticmethod
    def expectation(natural):
        r""":math:`\mu = (\psi(a) - \psi(a+b),\ \psi(b) - \psi(a+b))`."""
        a, b = Beta.from_natural(natural)
        s = digamma(a + b)
        return BetaExpectation(digamma(a) - s, digamma(b) - s)

    @staticmethod
    def sufficient_statistics(x):
        r""":math:`T(x) = (\log x,\ \log(1 - x))`, in the layout of the expectation parameters."""
        return BetaExpectation(jnp.log(x), jnp.log1p(-x))

    @staticmethod
    def to_numpyro(concentration1, concentration0):
        """The NumPyro distribution (elementwise, batch shape of the parameters)."""
        return dist.Beta(concentration1, concentration0)

    @staticmethod
    def from_numpyro(d):
        """``(concentration1, concentration0)`` of a NumPyro ``Beta``."""
        return d.concentration1, d.concentration0

    @staticmethod
    def from_expectation(expectation):
        """Inverse of :meth:`expectation` (the two-category Dirichlet solver, Minka 2000)."""
        alpha = dirichlet_from_mean_log(jnp.stack([expectation.mu1, expectation.mu2], -1))
        return Beta.to_natural(alpha[..., 0], alpha[..., 1])

    @staticmethod
    def quadrature(expectation, natural=None):
        r"""A two-point rule exact for every function affine in :math:`(\log x, \log(1-x))`, elementwise: the
        two-category case of :func:`~numpyro_blr.families.dirichlet.simplex_two_point` on :math:`(x, 1-x)`.
        ``(points, weights)``, points of shape ``(2,) + mu1.shape``, weights ``(1/2, 1/2)``."""
        del natural
        plus, minus = simplex_two_point(jnp.stack([expectation.mu1, expectation.mu2], -1))
        return jnp.stack([plus[..., 0], minus[..., 0]]), jnp.full((2,), 0.5, plus.dtype)

    @staticmethod
    def log_partition(natural):
        r"""Sum over entries of :math:`\log\Gamma(a) + \log\Gamma(b) - \log\Gamma(a+b)`."""
        a, b = Beta.from_natural(natural)
        return jnp.sum(gammaln(a) + gammaln(b) - gammaln(a + b))

    @staticmethod
    def entropy(concentration1, concentration0):
        r"""Sum over entries of :math:`\log B(a,b) - (a-1)\psi(a) - (b-1)\psi(b) + (a+b-2)\psi(a+b)`."""
        a, b = concentration1, concentration0
        log_b = gammaln(a) + gammaln(b) - gammaln(a + b)
        return jnp.sum(log_b - (a - 1.0) * digamma(a) - (b - 1.0) * digamma(b) + (a + b - 2.0) * digamma(a + b))

    @staticmethod
    def sample(key, concentration1, concentration0, sample_shape=()):
        """Implicitly reparameterised draw ``g1 / (g1 + g2) = sigmoid(log g1 - log g2)`` from two Gamma
        variates, drawn in log space (``jax.random.loggamma``) so small concentrations do not underflow."""
        shape = tuple(sample_shape) + jnp.broadcast_shapes(jnp.shape(concentration1), jnp.shape(concentration0))
        k1, k2 = jax.random.split(key)
        dtype = jnp.result_type(concentration1, concentration0)
        lg1 = jax.random.loggamma(k1, concentration1, shape, dtype=dtype)
        lg2 = jax.random.loggamma(k2, concentration0, shape, dtype=dtype)
        return jax.nn.sigmoid(lg1 - lg2)

    @staticmethod
    def log_prob(x, concentration1, concentration0):
        """Log density summed over the parameter's dimensions (extra leading axes of ``x`` are kept)."""
        a, b = concentration1, concentration0
        lp = (a - 1.0) * jnp.log(x) + (b - 1.0) * jnp.log1p(-x) - (gammaln(a) + gammaln(b) - gammaln(a + b))
        return jnp.sum(lp, axis=tuple(range(-jnp.ndim(a), 0)))

    @staticmethod
    def natural_gradient(natural, grad_mu):
        r""":math:`\nabla_\mu\mathcal L = \lambda + \nabla_\mu\mathbb E_q[\ell]` (Khan & Rue 2023)."""
        return BetaNatural(natural.eta1 + grad_mu.mu1, natural.eta2 + grad_mu.mu2)

    @staticmethod
    def blr_update(natural, grad_mu, lr, improved=True, max_step=None):
        r"""One BLR step; ``improved=True`` keeps :math:`a, b > 0` for any gradient (module docstring),
        and with ``max_step`` shrinks :math:`\rho` per element so that neither :math:`|\rho d_a|/a` nor
        :math:`|\rho d_b|/b` exceeds it (:func:`~numpyro_blr.families.dirichlet.trusted_step`).

        ``grad_mu`` holds :math:`\nabla_\mu \mathbb E_q[\ell]` (a :class:`BetaExpectation`).
        ``improved=False`` is the plain BLR, exact at ``lr = 1`` for conjugate terms.
        """
        if not improved:  # (1 - lr) lam - lr grad_mu: exactly -grad_mu at lr = 1
            return BetaNatural(*[(1.0 - lr) * lam - lr * g for lam, g in zip(natural, grad_mu)])
        g = Beta.natural_gradient(natural, grad_mu)
        a, b = Beta.from_natural(natural)
        d_a, d_b = -g.eta1, -g.eta2
        lr = trusted_step(lr, (d_a / a, d_b / b), max_step)
        a_new = a + lr * d_a + 0.5 * (lr * d_a) ** 2 / a
        b_new = b + lr * d_b + 0.5 * (lr * d_b) ** 2 / b
        return Beta.to_natural(a_new, b_new)

    @staticmethod
    def is_valid(natural):
        """``True`` where ``a > 0`` and ``b > 0`` (and finite)."""
        a, b = Beta.from_natural(natural)
        return jnp.isfinite(a) & jnp.isfinite(b) & (a > 0) & (b > 0)
