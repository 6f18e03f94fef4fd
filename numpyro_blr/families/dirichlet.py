r"""Dirichlet exponential family over the last axis (leading axes are a batch).

:math:`q(x) = \mathrm{Dir}(x \mid \alpha) = \frac{\Gamma(\alpha_0)}{\prod_k\Gamma(\alpha_k)}\prod_k x_k^{\alpha_k - 1}`
on the simplex, :math:`\alpha_0 = \sum_k \alpha_k`, is an exponential family with base measure 1 and

* sufficient statistics  :math:`T(x) = \log x` (one entry per category),
* natural parameters     :math:`\lambda = \alpha - 1`,
* expectation parameters :math:`\mu = \nabla A(\lambda) = \psi(\alpha) - \psi(\alpha_0)`,
* log-partition          :math:`A(\lambda) = \sum_k \log\Gamma(\alpha_k) - \log\Gamma(\alpha_0)`,

valid for :math:`\alpha > 0` (Khan & Rue 2023, App. B; Winn & Bishop 2005; BayesPy stores
:math:`\alpha` itself).

BLR update and positivity. The BLR natural gradient in :math:`\alpha` is
:math:`\nabla_\mu \mathcal L = \lambda + \nabla_\mu \mathbb E_q[\ell] = \alpha - \hat\alpha` with the
target :math:`\hat\alpha = 1 - \nabla_\mu \mathbb E_q[\ell]`, so the plain BLR is
:math:`\alpha \leftarrow \alpha + \rho\,d`, :math:`d = \hat\alpha - \alpha` (Khan & Rue 2023).
A gradient estimate can make :math:`\hat\alpha` (and the plain step) negative. The improved BLR
(Lin, Schmidt & Khan 2020) replaces the straight line by a retraction; we use, elementwise,

.. math::
    \alpha \leftarrow \alpha + \rho d + \frac{\rho^2 d^2}{2\alpha}
      = \frac{\alpha}{2} + \frac{(\alpha + \rho d)^2}{2\alpha} \;\ge\; \frac{\alpha}{2} > 0,

the second-order expansion of the multiplicative (exponential-map) step
:math:`\alpha\,e^{\rho d/\alpha}`, i.e. the retraction with Christoffel symbol
:math:`\Gamma^k_{kk} = -1/\alpha_k` — the same term Lin et al. use for the Gamma's inverse-mean
coordinate and for the Gaussian precision (:math:`S + \rho G + \tfrac{\rho^2}{2} G S^{-1} G`).
It agrees with the natural-gradient step to first order in :math:`\rho` (so it is a retraction
and the fixed points are the same), and keeps every :math:`\alpha_k > 0` for any gradient and any
:math:`\rho > 0`, without clipping.
"""

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpyro.distributions as dist
from jax.scipy.special import digamma, gammaln, polygamma


def trusted_step(lr, relative_steps, max_step, event_dim=0):
    r"""The step size :math:`\rho` per distribution, shrunk so that no relative first-order change
    :math:`|\rho\, d_j / \theta_j|` of a positive parameter :math:`\theta_j` exceeds ``max_step``:

    .. math:: \rho' = \rho \min\Big(1, \frac{r}{\rho \max_j |d_j/\theta_j|}\Big).

    A trust region for the improved BLR's retraction (which keeps :math:`\theta_j > 0` but not its
    size): with :math:`r = 1` one step moves each parameter within :math:`[\theta/2, 5\theta/2]`.
    A single-sample estimate of :math:`\nabla_\mu\mathbb E_q[\ell]` is the product of the sampled
    gradient with :math:`(\partial\mu/\partial\theta)^{-\top}`, whose smallest singular value falls
    like :math:`1/\alpha_0` as the distribution concentrates; far from the optimum (large gradients at
    the mean) it can ask for concentrations 1e3-1e6 times too large, which then overflow the float32
    log-densities. The fixed points are unchanged (:math:`d = 0` there). ``relative_steps`` is a
    tuple of arrays :math:`d_j/\theta_j` (broadcastable to the batch), ``event_dim`` the trailing axes
    one distribution spans; ``max_step=None`` returns ``lr`` unchanged."""
    if max_step is None:
        return lr
    axes = tuple(range(-event_dim, 0))
    worst = None
    for r in relative_steps:
        r = jnp.max(jnp.abs(r), axis=axes, keepdims=True) if axes else jnp.abs(r)
        worst = r if worst is None else jnp.maximum(worst, r)
    worst = jnp.where(jnp.isfinite(worst), worst, jnp.inf)  # a non-finite step stays non-finite below
    return lr * jnp.minimum(1.0, max_step / jnp.maximum(lr * worst, jnp.finfo(worst.dtype).tiny))


class DirichletNatural(NamedTuple):
    """Natural parameter ``eta = alpha - 1`` for the statistic ``log x``."""

    eta: jax.Array


class DirichletExpectation(NamedTuple):
    """Expectation parameter ``mu = E[log x] = digamma(alpha) - digamma(alpha_0)``."""

    mu: jax.Array


def dirichlet_from_mean_log(mu, num_iter=60):
    r"""Solve :math:`\psi(\alpha_k) - \psi(\sum_j\alpha_j) = \mu_k` for :math:`\alpha > 0` (last axis).

    This is :math:`\nabla A(\lambda) = \mu`, i.e. the minimiser of the strictly convex
    :math:`f(\alpha) = A(\alpha - 1) - (\alpha - 1)^\top\mu`. We take damped Newton steps
    (Minka 2000, "Estimating a Dirichlet distribution": the Hessian
    :math:`\mathrm{diag}(\psi'(\alpha)) - \psi'(\alpha_0)11^\top` is inverted by Sherman–Morrison),
    halving each step until it stays in :math:`\alpha > 0` and does not increase :math:`f`. Globally
    convergent from :math:`\alpha = 1`, quadratically near the solution.
    """
    mu = jnp.asarray(mu)
    halvings = 2.0 ** -jnp.arange(40, dtype=mu.dtype)  # candidate step sizes, largest first

    def objective(alpha):
        return jnp.sum(gammaln(alpha), -1) - gammaln(jnp.sum(alpha, -1)) - jnp.sum((alpha - 1.0) * mu, -1)

    def newton(alpha, check_objective):
        a0 = jnp.sum(alpha, -1, keepdims=True)
        g = digamma(alpha) - digamma(a0) - mu
        q = polygamma(1, alpha)
        z = polygamma(1, a0)
        b = jnp.sum(g / q, -1, keepdims=True) / (-1.0 / z + jnp.sum(1.0 / q, -1, keepdims=True))
        step = (g - b) / q
        cands = alpha - halvings.reshape((-1,) + (1,) * alpha.ndim) * step  # (J, ..., K)
        ok = jnp.all(cands > 0, -1)
        if check_objective:
            f_c = jnp.where(ok, objective(jnp.where(cands > 0, cands, 1.0)), jnp.inf)
            ok = ok & (f_c <= objective(alpha) + 1e-12 * jnp.abs(objective(alpha)))
        first = jnp.argmax(ok, 0)  # first (largest) acceptable step
        chosen = jnp.take_along_axis(cands, first[None, ..., None], 0)[0]
        return jnp.where(jnp.any(ok, 0)[..., None], chosen, alpha)

    alpha = jax.lax.fori_loop(0, num_iter, lambda _, a: newton(a, True), jnp.ones_like(mu))
    # polish: near the solution the objective is flat to round-off, so finish with plain Newton
    # steps (kept positive), which converge quadratically from there
    return jax.lax.fori_loop(0, 4, lambda _, a: newton(a, False), alpha)


def simplex_two_point(mean_log, num_iter=60):
    r"""Two points :math:`x_\pm` on the simplex (last axis) with :math:`\tfrac12(\log x_+ + \log x_-) = e`
    for given :math:`e = \mathbb E[\log x]`: a two-point rule with weights :math:`\tfrac12`, exact for every
    function affine in :math:`\log x` (a Dirichlet's statistics; a Beta's as the two-category case).

    :math:`x_\pm = \mathrm{softmax}(e \pm s u)` for a fixed non-constant direction :math:`u`; then
    :math:`\tfrac12(\log x_+ + \log x_-) = e - \tfrac12 F(s)` with
    :math:`F(s) = \mathrm{LSE}(e + su) + \mathrm{LSE}(e - su)`, which is convex and even in :math:`s`, negative
    at 0 (:math:`\sum_k e^{e_k} < 1`, Jensen) and unbounded, so :math:`F(s) = 0` has one root :math:`s > 0`.
    Newton's method from the right of it (:math:`s_0 = -(e_i + e_j)/(u_i - u_j)` for the largest and smallest
    :math:`u`, where :math:`F \ge 0`) decreases monotonically to it. One last Newton step with the derivative
    held fixed carries the implicit-function derivative :math:`\partial s/\partial e = -F_e/F_s`, so that
    autodiff through the points is exact. Returns ``(x_plus, x_minus)``.
    """
    k = mean_log.shape[-1]
    u = (jnp.arange(k, dtype=mean_log.dtype) - 0.5 * (k - 1)) / max(0.5 * (k - 1), 0.5)

    def value_and_slope(s, e):
        lp, lm = e + s[..., None] * u, e - s[..., None] * u
        f = jax.nn.logsumexp(lp, -1) + jax.nn.logsumexp(lm, -1)
        slope = jnp.sum(u * (jax.nn.softmax(lp, -1) - jax.nn.softmax(lm, -1)), -1)
        return f, slope

    e0 = jax.lax.stop_gradient(mean_log)
    s0 = -(e0[..., -1] + e0[..., 0]) / (u[-1] - u[0]) + 1e-3

    def body(_, s):
        f, slope = value_and_slope(s, e0)
        return jnp.maximum(s - f / slope, 0.0)

    s = jax.lax.fori_loop(0, num_iter, body, s0)
    f, slope = value_and_slope(s, mean_log)
    s = s - f / jax.lax.stop_gradient(slope)
    return jax.nn.softmax(mean_log + s[..., None] * u, -1), jax.nn.softmax(mean_log - s[..., None] * u, -1)


class Dirichlet:
    r"""Dirichlet family :math:`\mathrm{Dir}(\alpha)` over the last axis of ``concentration``."""

    Natural = DirichletNatural
    Expectation = DirichletExpectation

    @staticmethod
    def to_natural(concentration):
        r""":math:`\lambda = \alpha - 1`."""
        return DirichletNatural(concentration - 1.0)

    @staticmethod
    def from_natural(natural):
        """The concentration ``alpha``."""
        return natural.eta + 1.0

    @staticmethod
    def expectation(natural):
        r""":math:`\mu = \psi(\alpha) - \psi(\alpha_0)`."""
        alpha = Dirichlet.from_natural(natural)
        return DirichletExpectation(digamma(alpha) - digamma(jnp.sum(alpha, -1, keepdims=True)))

    @staticmethod
    def sufficient_statistics(x):
        r""":math:`T(x) = \log x`, in the layout of the expectation parameter."""
        return DirichletExpectation(jnp.log(x))

    @staticmethod
    def to_numpyro(concentration):
        """The NumPyro distribution (event shape ``K``, batch shape the leading axes)."""
        return dist.Dirichlet(concentration)

    @staticmethod
    def from_numpyro(d):
        """The concentration of a NumPyro ``Dirichlet``."""
        return d.concentration

    @staticmethod
    def from_expectation(expectation):
        """Inverse of :meth:`expectation` (:func:`dirichlet_from_mean_log`)."""
        return Dirichlet.to_natural(dirichlet_from_mean_log(expectation.mu))

    @staticmethod
    def quadrature(expectation, natural=None):
        r"""A two-point rule exact for every function affine in :math:`\log x` (:func:`simplex_two_point`):
        ``(points, weights)`` with points of shape ``(2,) + mu.shape`` on the simplex and weights ``(1/2, 1/2)``.
        The points are functions of the expectation parameters (``natural`` is not needed)."""
        del natural
        plus, minus = simplex_two_point(expectation.mu)
        return jnp.stack([plus, minus]), jnp.full((2,), 0.5, plus.dtype)

    @staticmethod
    def log_partition(natural):
        r"""Sum over the batch of :math:`\sum_k\log\Gamma(\alpha_k) - \log\Gamma(\alpha_0)`."""
        alpha = Dirichlet.from_natural(natural)
        return jnp.sum(gammaln(alpha)) - jnp.sum(gammaln(jnp.sum(alpha, -1)))

    @staticmethod
    def entropy(concentration):
        r"""Sum over the batch of :math:`\log B(\alpha) + (\alpha_0 - K)\psi(\alpha_0) - \sum_k(\alpha_k - 1)\psi(\alpha_k)`."""
        alpha = concentration
        a0 = jnp.sum(alpha, -1)
        k = alpha.shape[-1]
        log_b = jnp.sum(gammaln(alpha), -1) - gammaln(a0)
        return jnp.sum(log_b + (a0 - k) * digamma(a0) - jnp.sum((alpha - 1.0) * digamma(alpha), -1))

    @staticmethod
    def sample(key, concentration, sample_shape=()):
        """Implicitly reparameterised draw: normalised Gamma variates, drawn in log space
        (``softmax`` of ``jax.random.loggamma``) so small concentrations do not underflow."""
        shape = tuple(sample_shape) + jnp.shape(concentration)
        log_g = jax.random.loggamma(key, concentration, shape, dtype=jnp.result_type(concentration))
        return jax.nn.softmax(log_g, -1)

    @staticmethod
    def log_prob(x, concentration):
        """Log density summed over the batch dimensions (extra leading axes of ``x`` are kept)."""
        alpha = concentration
        log_b = jnp.sum(gammaln(alpha), -1) - gammaln(jnp.sum(alpha, -1))
        lp = jnp.sum(jax.scipy.special.xlogy(alpha - 1.0, x), -1) - log_b
        return jnp.sum(lp, axis=tuple(range(-(jnp.ndim(alpha) - 1), 0))) if jnp.ndim(alpha) > 1 else lp

    @staticmethod
    def natural_gradient(natural, grad_mu):
        r""":math:`\nabla_\mu\mathcal L = \lambda + \nabla_\mu\mathbb E_q[\ell]` (Khan & Rue 2023)."""
        return DirichletNatural(natural.eta + grad_mu.mu)

    @staticmethod
    def blr_update(natural, grad_mu, lr, improved=True, max_step=None):
        r"""One BLR step on :math:`\alpha`; see the module docstring.

        ``grad_mu`` holds :math:`\nabla_\mu \mathbb E_q[\ell]` (a :class:`DirichletExpectation`).
        ``improved=False``: :math:`\lambda \leftarrow (1-\rho)\lambda - \rho\nabla_\mu\mathbb E_q[\ell]`
        (exact at ``lr = 1`` for conjugate terms). ``improved=True``:
        :math:`\alpha \leftarrow \alpha + \rho d + \rho^2 d^2/(2\alpha)`, positive for any gradient;
        with ``max_step`` (:func:`trusted_step`) each distribution's :math:`\rho` is shrunk so that no
        :math:`|\rho d_k| / \alpha_k` exceeds it.
        """
        if not improved:  # (1 - lr) lam - lr grad_mu: exactly -grad_mu at lr = 1
            return DirichletNatural((1.0 - lr) * natural.eta - lr * grad_mu.mu)
        d = -Dirichlet.natural_gradient(natural, grad_mu).eta
        alpha = Dirichlet.from_natural(natural)
        lr = trusted_step(lr, (d / alpha,), max_step, event_dim=1)
        return Dirichlet.to_natural(alpha + lr * d + 0.5 * (lr * d) ** 2 / alpha)

    @staticmethod
    def is_valid(natural):
        """``True`` per batch element where every ``alpha_k > 0`` (and finite)."""
        alpha = Dirichlet.from_natural(natural)
        return jnp.all(jnp.isfinite(alpha) & (alpha > 0), axis=-1)
