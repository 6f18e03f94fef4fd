r"""Gamma exponential family, elementwise over arrays of any shape.

:math:`q(x) = \mathrm{Gamma}(x \mid a, b) = \frac{b^a}{\Gamma(a)} x^{a-1} e^{-b x}` (shape :math:`a`,
rate :math:`b`) is an exponential family with base measure 1 and

* sufficient statistics  :math:`T(x) = (\log x,\ x)`,
* natural parameters     :math:`\lambda = (a - 1,\ -b)`,
* expectation parameters :math:`\mu = \nabla A(\lambda) = (\psi(a) - \log b,\ a / b)`,
* log-partition          :math:`A(\lambda) = \log\Gamma(\lambda_1 + 1) - (\lambda_1 + 1)\log(-\lambda_2)`,

valid for :math:`\lambda_1 > -1,\ \lambda_2 < 0` (Khan & Rue 2023, Sec. 1.3 and App. B; BayesPy
stores the same pair in the order :math:`(-b, a)`).

BLR update and positivity (Lin, Schmidt & Khan 2020, "Handling the positive-definite constraint in
the Bayesian learning rule", the Gamma example; reference code
``yorkerlin/iBayesLRule``, ``gamma/gfm/algorithms/gammaSGVB_rgvi.m``): in the parameterisation
:math:`\eta = (a,\ r)` with :math:`r = b / a` (the inverse mean) the Fisher information is diagonal,
:math:`F(\eta) = \mathrm{diag}(\psi'(a) - 1/a,\ a / r^2)`, and the Riemannian-gradient step with the
second-order retraction

.. math::
    a &\leftarrow a + \rho d_a - \tfrac{\rho^2}{2}\,\Gamma^a_{aa}\, d_a^2,
       \qquad \Gamma^a_{aa} = \frac{a\psi''(a) + 1/a}{2(a\psi'(a) - 1)}, \\
    r &\leftarrow r + \rho d_r + \tfrac{\rho^2}{2 r}\, d_r^2 \qquad (\Gamma^r_{rr} = -1/r),

keeps both positive for any direction :math:`d` and any :math:`\rho > 0`, because
:math:`-\Gamma^a_{aa} \ge 1/a` gives :math:`a_{\text{new}} \ge \tfrac a2 + \tfrac{(a + \rho d_a)^2}{2a} > 0`
and likewise :math:`r_{\text{new}} = \tfrac r2 + \tfrac{(r + \rho d_r)^2}{2r} > 0`. The direction is the
natural gradient :math:`d = -F(\eta)^{-1}\nabla_\eta \mathcal L = -J^{-1}\nabla_\mu \mathcal L` with
:math:`J = \partial\lambda/\partial\eta` and :math:`\nabla_\mu\mathcal L = \lambda + \nabla_\mu
\mathbb E_q[\ell]` (Khan & Rue 2023; the base measure is 1 so :math:`\nabla_\mu \mathbb E_q[\log q] = \lambda`).
"""

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpyro.distributions as dist
from jax.scipy.special import digamma, gammaln, polygamma

from numpyro_blr.families.dirichlet import trusted_step


class GammaNatural(NamedTuple):
    """Natural parameters ``(eta1, eta2) = (a - 1, -b)`` for the statistics ``(log x, x)``."""

    eta1: jax.Array
    eta2: jax.Array


class GammaExpectation(NamedTuple):
    """Expectation parameters ``(mu1, mu2) = (E[log x], E[x]) = (digamma(a) - log b, a / b)``."""

    mu1: jax.Array
    mu2: jax.Array


def _neg_christoffel_shape(a):
    r""":math:`-\Gamma^a_{aa}(a) = -\frac{a\psi''(a) + 1/a}{2(a\psi'(a) - 1)}`, which lies in :math:`(1/a, 1.1/a)`.

    For large ``a`` the closed form cancels catastrophically, so the asymptotic series
    :math:`\psi'(a) \sim 1/a + 1/(2a^2) + 1/(6a^3) - 1/(30a^5)`,
    :math:`\psi''(a) \sim -1/a^2 - 1/a^3 - 1/(2a^4) + 1/(6a^6)` is used there; the result is
    finally bounded below by ``1/a``, the only property the positivity argument needs.
    """
    safe_small = jnp.minimum(a, 20.0)
    exact = -(safe_small * polygamma(2, safe_small) + 1.0 / safe_small) / (
        2.0 * (safe_small * polygamma(1, safe_small) - 1.0)
    )
    big = jnp.maximum(a, 20.0)
    num = 1.0 / big**2 + 0.5 / big**3 - 1.0 / (6.0 * big**5)
    den = 1.0 / big + 1.0 / (3.0 * big**2) - 1.0 / (15.0 * big**4)
    series = num / den
    return jnp.maximum(jnp.where(a < 20.0, exact, series), 1.0 / a)


def _inverse_digamma_minus_log(s, num_iter=12):
    r"""Solve :math:`\log a - \psi(a) = s` for :math:`a > 0` (``s > 0``), Minka (2002) Newton on ``1/a``."""
    a = (3.0 - s + jnp.sqrt((s - 3.0) ** 2 + 24.0 * s)) / (12.0 * s)

    def body(_, a):
        f = jnp.log(a) - digamma(a) - s
        fprime = 1.0 / a - polygamma(1, a)
        # Newton on 1/a (Minka 2002, eq. 8), which stays positive for this convex problem
        inv = 1.0 / a + f / (a**2 * fprime)
        return 1.0 / inv

    return jax.lax.fori_loop(0, num_iter, body, a)


def log_minus_digamma(a):
    r""":math:`\log a - \psi(a) > 0` without cancellation for large :math:`a` (asymptotic series from 10 on:
    :math:`\tfrac{1}{2a} + \tfrac{1}{12a^2} - \tfrac{1}{120a^4} + \tfrac{1}{252a^6}`)."""
    small = jnp.minimum(a, 10.0)
    big = jnp.maximum(a, 10.0)
    inv2 = 1.0 / big**2
    series = 0.5 / big + inv2 * (1.0 / 12.0 - inv2 * (1.0 / 120.0 - inv2 / 252.0))
    return jnp.where(a < 10.0, jnp.log(small) - digamma(small), series)


class Gamma:
    r"""Gamma family :math:`\prod_i \mathrm{Gamma}(a_i, b_i)` (shape ``a`` = concentration, ``b`` = rate)."""

    Natural = GammaNatural
    Expectation = GammaExpectation

    @staticmethod
    def to_natural(concentration, rate):
        r""":math:`\lambda = (a - 1, -b)`."""
        return GammaNatural(concentration - 1.0, -rate)

    @staticmethod
    def from_natural(natural):
        """``(concentration, rate)`` from natural parameters."""
        return natural.eta1 + 1.0, -natural.eta2

    @staticmethod
    def expectation(natural):
        r""":math:`\mu = (\psi(a) - \log b,\ a/b) = \nabla A(\lambda)`."""
        a, b = Gamma.from_natural(natural)
        return GammaExpectation(digamma(a) - jnp.log(b), a / b)

    @staticmethod
    def sufficient_statistics(x):
        r""":math:`T(x) = (\log x,\ x)`, in the layout of the expectation parameters."""
        return GammaExpectation(jnp.log(x), x)

    @staticmethod
    def to_numpyro(concentration, rate):
        """The NumPyro distribution (elementwise, batch shape of the parameters)."""
        return dist.Gamma(concentration, rate)

    @staticmethod
    def from_numpyro(d):
        """``(concentration, rate)`` of a NumPyro ``Gamma`` or ``Exponential`` (shape 1)."""
        if isinstance(d, dist.Exponential):
            return jnp.ones_like(d.rate), d.rate
        return d.concentration, d.rate

    @staticmethod
    def from_expectation(expectation):
        r"""Inverse of :meth:`expectation`: solve :math:`\log a - \psi(a) = \log\mu_2 - \mu_1` (Newton), then :math:`b = a/\mu_2`."""
        s = jnp.log(expectation.mu2) - expectation.mu1
        a = _inverse_digamma_minus_log(s)
        return Gamma.to_natural(a, a / expectation.mu2)

    @staticmethod
    def quadrature(expectation, natural=None):
        r"""A two-point rule exact for every function affine in :math:`T(x) = (\log x, x)`, elementwise:
        :math:`x_\pm = m(1 \pm r)` with weights :math:`\tfrac12`, :math:`m = \mathbb E[x]`,
        :math:`r = \sqrt{1 - e^{-2d}}`, :math:`d = \log\mathbb E[x] - \mathbb E[\log x] > 0` (Jensen), so that
        :math:`\tfrac12(\log x_+ + \log x_-) = \log m - d` and :math:`\tfrac12(x_+ + x_-) = m`.
        Returns ``(points, weights)``, points of shape ``(2,) + m.shape``. The points are functions of the
        expectation parameters; with ``natural``, :math:`d`'s value is :math:`\log a - \psi(a)`
        (:func:`log_minus_digamma`, no cancellation for a large shape) and its derivative is taken through them.
        """
        m = expectation.mu2
        d = jnp.log(m) - expectation.mu1
        if natural is not None:
            a, _ = Gamma.from_natural(natural)
            d = log_minus_digamma(a) + (d - jax.lax.stop_gradient(d))
        r = jnp.sqrt(-jnp.expm1(-2.0 * d))
        return jnp.stack([m * (1.0 + r), m * (1.0 - r)]), jnp.full((2,), 0.5, m.dtype)

    @staticmethod
    def log_partition(natural):
        r"""Sum over entries of :math:`\log\Gamma(\lambda_1 + 1) - (\lambda_1 + 1)\log(-\lambda_2)`."""
        a = natural.eta1 + 1.0
        return jnp.sum(gammaln(a) - a * jnp.log(-natural.eta2))

    @staticmethod
    def entropy(concentration, rate):
        r"""Sum over entries of :math:`a - \log b + \log\Gamma(a) + (1 - a)\psi(a)`."""
        a = concentration
        return jnp.sum(a - jnp.log(rate) + gammaln(a) + (1.0 - a) * digamma(a))

    @staticmethod
    def sample(key, concentration, rate, sample_shape=()):
        """Implicitly reparameterised draw ``exp(log g) / b``, ``log g = jax.random.loggamma(a)`` (implicit
        differentiation w.r.t. ``a``; the same sampler as :class:`Beta` and :class:`Dirichlet`)."""
        shape = tuple(sample_shape) + jnp.shape(concentration)
        return jnp.exp(jax.random.loggamma(key, concentration, shape, dtype=jnp.result_type(concentration))) / rate

    @staticmethod
    def log_prob(x, concentration, rate):
        """Log density summed over the parameter's dimensions (extra leading axes of ``x`` are kept)."""
        a, b = concentration, rate
        lp = a * jnp.log(b) - gammaln(a) + (a - 1.0) * jnp.log(x) - b * x
        return jnp.sum(lp, axis=tuple(range(-jnp.ndim(a), 0)))

    @staticmethod
    def natural_gradient(natural, grad_mu):
        r""":math:`\nabla_\mu \mathcal L = \lambda + \nabla_\mu \mathbb E_q[\ell]`, the natural gradient of
        :math:`\mathcal L(\lambda) = \mathbb E_q[\ell] - \mathcal H(q)` (Khan & Rue 2023)."""
        return GammaNatural(natural.eta1 + grad_mu.mu1, natural.eta2 + grad_mu.mu2)

    @staticmethod
    def blr_update(natural, grad_mu, lr, improved=True, max_step=None):
        r"""One BLR step :math:`\lambda \leftarrow \lambda - \rho\,(\lambda + \nabla_\mu\mathbb E_q[\ell])`.

        ``grad_mu`` is a :class:`GammaExpectation`-shaped pair holding
        :math:`\nabla_\mu \mathbb E_q[\ell]` for the loss :math:`\ell` (minus the log joint, prior
        included). With ``improved=False`` this is the plain BLR (Khan & Rue 2023), exact for
        conjugate terms at ``lr = 1`` but invalid for a bad gradient. With ``improved=True`` the step is
        taken in :math:`\eta = (a, b/a)` with the retraction in the module docstring (Lin, Schmidt &
        Khan 2020), so shape and rate stay positive for any ``grad_mu`` and any ``lr > 0``, without clipping;
        ``max_step`` shrinks :math:`\rho` per element so that neither :math:`|\rho d_a|/a` nor
        :math:`|\rho d_r|/r` exceeds it (:func:`~numpyro_blr.families.dirichlet.trusted_step`).
        """
        if not improved:  # (1 - lr) lam - lr grad_mu: exactly -grad_mu at lr = 1
            return GammaNatural(*[(1.0 - lr) * lam - lr * g for lam, g in zip(natural, grad_mu)])
        a, b = Gamma.from_natural(natural)
        r = b / a
        u = Gamma.natural_gradient(natural, grad_mu)
        # d = -J^{-1} u with J = d(lambda)/d(a, r) = [[1, 0], [-r, -a]]
        d_a = -u.eta1
        d_r = (u.eta2 + r * u.eta1) / a
        lr = trusted_step(lr, (d_a / a, d_r / r), max_step)
        a_new = a + lr * d_a + 0.5 * (lr * d_a) ** 2 * _neg_christoffel_shape(a)
        r_new = r + lr * d_r + 0.5 * (lr * d_r) ** 2 / r
        return Gamma.to_natural(a_new, a_new * r_new)

    @staticmethod
    def is_valid(natural):
        """``True`` where ``a > 0`` and ``b > 0`` (and finite)."""
        a, b = Gamma.from_natural(natural)
        return jnp.isfinite(a) & jnp.isfinite(b) & (a > 0) & (b > 0)
