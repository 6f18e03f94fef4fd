r"""Estimators of the Lie-group BLR (:mod:`numpyro_blr.rules.liegroup`): the algebra gradient from gradients at
:math:`\theta = g\cdot\xi` (the reparameterisation trick, Kiral, Moellenhoff & Khan 2023, Sec. 3.3).

Each constructor returns ``estimate(key, state, loss_fn, *batch) -> Estimate`` with ``loss_fn(params, *batch)``
the average mini-batch loss :math:`\bar\ell`; :math:`G = \nabla\bar\ell(\theta) + \delta\theta` (``weight_decay``
:math:`\delta`) at ``mc_samples`` draws (key ``s`` of ``jax.random.split(key, mc_samples)``), and

==================  =====================================================================================
:func:`additive`    ``grad`` :math:`= \operatorname{mean} G` at :math:`\theta = w + \xi` (per-example units)
:func:`affine`      ``grad`` = :class:`~numpyro_blr.rules.liegroup.AffineGrad`:
                    :math:`X_b = \tfrac{N}{T} A\operatorname{mean}G`,
                    :math:`X_A = \tfrac{N}{T}\operatorname{mean}(A\epsilon G) - 1` at :math:`\theta = b + A\epsilon`
:func:`multiplicative`  ``grad`` = :class:`~numpyro_blr.rules.liegroup.MultiplicativeGrad`:
                    :math:`X_\pm = \operatorname{mean}(\pm g_\pm\xi_\pm G) - T/N` at
                    :math:`\theta = g_+\xi_+ - g_-\xi_-` (:math:`g\xi` unsigned)
==================  =====================================================================================

(:math:`N` = ``ess``, :math:`T` = ``temperature``). The noise is one flat draw of every weight from
:math:`q_0` per sample and step (:func:`draw_base`), from the step's JAX key: fresh at every step, for every
:math:`q_0` and every leaf (leaves of the same shape get different noise); the weights the loss reads are built leaf by
leaf from slices of the flat state and of the noise (:class:`BaseSlices`). Each estimator also has
``draw(key, state) -> (theta, noise)`` (flat) and ``from_grads(state, grad, noise)`` (the estimate from one
flat gradient at that draw: the optax view, :func:`numpyro_blr.as_optax`).
"""

import jax
import jax.numpy as jnp
import numpyro.distributions as dist

from numpyro_blr.estimators import Estimate
from numpyro_blr.estimators.weights import _monte_carlo
from numpyro_blr.rules.liegroup import AffineGrad, MultiplicativeGrad, Rayleigh
from numpyro_blr import tree
from numpyro_blr.tree import NoiseSlices, finite_check, leaves_from

# q0 whose inverse CDF numpyro computes in closed form: drawn from one batch of uniforms
_ICDF = (dist.Laplace, dist.Logistic, dist.Cauchy, dist.Uniform, dist.Gumbel)


def _from_uniform(base):
    """``u -> x`` for the :math:`q_0` drawn through one uniform per value (None for the others)."""
    # -log(u) for u uniform on (0, 1) is Exponential(1): one log (cheaper than the icdf's log1p(-u) on CPU)
    if isinstance(base, Rayleigh):
        return lambda u: base.scale * jnp.sqrt(-2.0 * jnp.log(u))
    if isinstance(base, dist.Weibull):
        return lambda u: base.scale * (-jnp.log(u)) ** (1.0 / base.concentration)
    if isinstance(base, dist.Exponential):
        return lambda u: -jnp.log(u) / base.rate
    if isinstance(base, _ICDF):
        return base.icdf
    return None


class BaseSlices:
    r"""One flat draw of ``n`` values from :math:`q_0`, read by slices: ``xi(start, size)`` and ``xi.all()``
    (:class:`~numpyro_blr.tree.NoiseSlices` for the base distributions; :func:`draw_base` is ``xi.all()``).

    ``base=None`` (a Dirac :math:`q_0`) gives zeros. A Normal is ``loc + scale * z`` with
    :func:`~numpyro_blr.tree.standard_normal`; Laplace, logistic, Cauchy, uniform, Gumbel, exponential,
    :class:`~numpyro_blr.rules.liegroup.Rayleigh` and Weibull go through their inverse CDF of one batch of
    uniforms (:func:`~numpyro_blr.tree.uniform`); with ``rng='hash'`` (default) both use the counter hash of
    :func:`~numpyro_blr.tree.hash_normal` (several times cheaper than threefry on CPU, and recomputed where it is read
    on accelerators). Any other :math:`q_0` uses its own ``sample`` (threefry; Student-t and Gamma through JAX's
    gamma sampler), drawn once and stored."""

    def __init__(self, base, key, n, dtype=jnp.float32, rng="hash", regenerate=None):
        self.n, self.dtype = int(n), dtype
        self.base, self.transform, self.source = base, None, None
        if base is None:
            return
        if isinstance(base, dist.Normal):
            self.source = NoiseSlices(key, self.n, dtype, rng, "normal", regenerate)
            self.transform = lambda z: base.loc + base.scale * z
        elif _from_uniform(base) is not None:
            self.source = NoiseSlices(key, self.n, dtype, rng, "uniform", regenerate)
            self.transform = _from_uniform(base)
        else:
            self.stored = jax.lax.optimization_barrier(base.sample(key, (self.n,)).astype(dtype))

    def __call__(self, start, size):
        if self.base is None:
            return jnp.zeros((size,), self.dtype)
        if self.source is None:
            return self.stored[start:start + size]
        return self.transform(self.source(start, size)).astype(self.dtype)

    def all(self):
        return self(0, self.n)


def draw_base(base, key, n, dtype=jnp.float32, rng="hash"):
    r"""``n`` independent draws from :math:`q_0` (flat), from ``key``: :class:`BaseSlices` as one vector."""
    return BaseSlices(base, key, n, dtype, rng).all()


def _grad_at(loss_fn, layout, weights, theta, args, weight_decay):
    """``(loss, G, check)`` at the weights (a pytree; ``theta()`` the same flat, as an expression): the flat
    :math:`G = \\nabla\\bar\\ell + \\delta\\theta` and the finiteness check of the gradient (Estimate.check)."""
    loss, g = jax.value_and_grad(loss_fn)(weights, *args)
    check = finite_check(g)
    g = layout.ravel(g)
    return loss, (g + weight_decay * theta() if weight_decay else g), check


def additive(base, weight_decay=0.0, mc_samples=1, noise_rng="hash", vmap_samples=True):
    r"""The additive group's estimator: :math:`\hat G = \operatorname{mean}_s [\nabla\bar\ell(\theta_s) + \delta\theta_s]`,
    :math:`\theta_s = w + \xi_s` (``base=None``: :math:`\theta = w`, gradient descent)."""

    def draw(key, state):
        noise = draw_base(base, key, state.loc.shape[0], state.loc.dtype, noise_rng)
        return state.loc + noise, noise

    def estimate(key, state, loss_fn, *args):
        loc = state.loc

        def one(k):
            xi = BaseSlices(base, k, loc.shape[0], loc.dtype, noise_rng)
            weights = leaves_from(state.layout, lambda s, n: loc[s:s + n] + xi(s, n))
            return _grad_at(loss_fn, state.layout, weights, lambda: loc + xi.all(), args, weight_decay)

        loss, g, check = _monte_carlo(one, jax.random.split(key, mc_samples), vmap_samples)
        return Estimate(loss, g, None, check)

    def from_grads(state, g, noise):
        return Estimate(jnp.nan, g + weight_decay * (state.loc + noise) if weight_decay else g)

    estimate.draw, estimate.from_grads, estimate.sampled = draw, from_grads, base is not None
    return estimate


def affine(base, ess, temperature=1.0, weight_decay=0.0, mc_samples=1, noise_rng="hash", vmap_samples=True):
    r"""The affine group's estimator at :math:`\theta_s = b + A\epsilon_s`, :math:`\epsilon_s \sim q_0`:
    :math:`X_b = \tfrac{N}{T} A\operatorname{mean}_s G_s`, :math:`X_A = \tfrac{N}{T}\operatorname{mean}_s(A\epsilon_s G_s) - 1`."""
    c = float(ess) / float(temperature)

    def draw(key, state):
        eps = draw_base(base, key, state.loc.shape[0], state.loc.dtype, noise_rng)
        return state.loc + state.scale * eps, eps

    def stats(state, g, eps):
        return state.scale * g, state.scale * eps * g

    def algebra(v, u):
        return AffineGrad(c * v, c * u - 1.0)

    def estimate(key, state, loss_fn, *args):
        loc, scale = state.loc, state.scale

        def one(k):
            eps = BaseSlices(base, k, loc.shape[0], loc.dtype, noise_rng)
            weights = leaves_from(state.layout, lambda s, n: loc[s:s + n] + scale[s:s + n] * eps(s, n))
            loss, g, check = _grad_at(loss_fn, state.layout, weights, lambda: loc + scale * eps.all(), args,
                                      weight_decay)
            return (loss,) + stats(state, g, eps.all()) + (check,)

        loss, v, u, check = _monte_carlo(one, jax.random.split(key, mc_samples), vmap_samples)
        return Estimate(loss, algebra(v, u), None, check)

    def from_grads(state, g, eps):
        if weight_decay:
            g = g + weight_decay * (state.loc + state.scale * eps)
        return Estimate(jnp.nan, algebra(*stats(state, g, eps)))

    estimate.draw, estimate.from_grads, estimate.sampled = draw, from_grads, True
    return estimate


def multiplicative(base, ess, temperature=1.0, weight_decay=0.0, mc_samples=1, signed=True, noise_rng="hash",
                   vmap_samples=True):
    r"""The multiplicative group's estimator at :math:`\theta_s = g_+\xi_{+,s} - g_-\xi_{-,s}` (``signed``; else
    :math:`g\xi_s`), :math:`\xi \sim q_0` independently for :math:`g_+` and :math:`g_-`, in per-example units
    (the paper's Algorithm 2): :math:`X_\pm = \operatorname{mean}_s(\pm g_\pm\xi_{\pm,s} G_s) - T/N`."""
    tau = float(temperature) / float(ess)

    def theta(state, xi):
        d = state.scale * xi  # (g+ xi+, g- xi-) end to end: one pass
        n = state.layout.length
        return d[:n] - d[n:] if signed else d

    def theta_slice(state, xi, start, size):
        """Elements ``start .. start + size`` of :func:`theta` from slices of the scale and the noise."""
        scale, n = state.scale, state.layout.length
        d = scale[start:start + size] * xi(start, size)
        return d - scale[n + start:n + start + size] * xi(n + start, size) if signed else d

    def draw(key, state):
        xi = draw_base(base, key, state.scale.shape[0], state.scale.dtype, noise_rng)
        return theta(state, xi), xi

    def algebra(state, g, xi):
        # X = (g+ xi+ G, -g- xi- G) - T/N
        if not signed:
            return state.scale * xi * g - tau
        if not tree.split_loops():
            return state.scale * xi * jnp.concatenate([g, -g]) - tau
        # where XLA's CPU backend splits loops between threads: as two rows (g+ and g-) against G broadcast with its
        # sign, the rows split between the threads, instead of a concatenation fused into the loop, which picks its
        # operand element by element (tree.split_loops; on one thread the fused concatenation is the faster). The
        # values are the same.
        n = g.shape[0]
        sign = jnp.asarray([[1.0], [-1.0]], g.dtype)
        return (state.scale.reshape(2, n) * xi.reshape(2, n) * (sign * g) - tau).reshape(-1)

    def estimate(key, state, loss_fn, *args):
        scale = state.scale

        def one(k):
            xi = BaseSlices(base, k, scale.shape[0], scale.dtype, noise_rng)
            weights = leaves_from(state.layout, lambda s, n: theta_slice(state, xi, s, n))
            loss, g, check = _grad_at(loss_fn, state.layout, weights, lambda: theta(state, xi.all()), args,
                                      weight_decay)
            return loss, algebra(state, g, xi.all()), check

        loss, x, check = _monte_carlo(one, jax.random.split(key, mc_samples), vmap_samples)
        return Estimate(loss, MultiplicativeGrad(x), None, check)

    def from_grads(state, g, xi):
        if weight_decay:
            g = g + weight_decay * theta(state, xi)
        return Estimate(jnp.nan, MultiplicativeGrad(algebra(state, g, xi)))

    estimate.draw, estimate.from_grads, estimate.sampled = draw, from_grads, True
    return estimate
