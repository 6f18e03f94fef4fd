r""":math:`\mathbb E_q[\nabla\ell]` and :math:`\mathbb E_q[\nabla^2\ell]` of a function of the value, for a Gaussian :math:`q`.

The BLR's Gaussian step (:func:`numpyro_blr.rules.blr.gaussian_update`) needs
:math:`\hat g \approx \mathbb E_q[\nabla\ell]` and :math:`\hat H \approx \mathbb E_q[\nabla^2\ell]` (Bonnet's and Price's
theorems, Khan & Rue 2023, Sec. 4.2). Here :math:`\ell` is a plain function of the value :math:`z`, not SVI's
loss over guide parameters (:mod:`.svi`): non-conjugate message passing (:mod:`numpyro_blr.infer.vmp`) reads it
off the model's expected log factors. :math:`z` has leading *element* axes and a last axis of size :math:`B`;
:math:`q` is a dense Gaussian per element, and :math:`\ell` is a sum over elements of terms each reading one
element (mean field across elements), so each element's :math:`B \times B` Hessian block is read with :math:`B`
Hessian-vector products along the same direction in every element.

``method``:

* ``"delta"``: at the mean (the delta method; with :math:`\rho = 1`, Newton's method, Table 1);
* ``"cubature"``: the :math:`2B`-point spherical cubature rule of degree 3
  (:meth:`~numpyro_blr.families.FullGaussian.quadrature`), gradient and exact Hessian at each point;
  deterministic, so a fit converges to a fixed point (exact for cubic :math:`\ell`);
* ``"autodiff"``: Monte Carlo, exact Hessian at ``num_samples`` draws (antithetic pairs);
* ``"reparam"``: Monte Carlo, Price's reparameterisation estimate :math:`\hat H` with
  :math:`\operatorname{tril}(\hat H L) = \operatorname{tril}(\nabla\ell(z)\,\epsilon^\top)` (:func:`.svi.reparam_hessian_full`),
  gradients only.
"""

import jax
import jax.numpy as jnp

from numpyro_blr.estimators import Estimate
from numpyro_blr.estimators.svi import reparam_hessian_full
from numpyro_blr.families.gaussian import FullGaussian, precision_to_scale_tril

METHODS = ("cubature", "delta", "autodiff", "reparam")


def grad_and_block_hessian(loss_fn, z):
    r"""``(loss, grad, hessian)`` of ``loss_fn`` at ``z`` (``(..., B)``), the Hessian as per-element ``(..., B, B)``
    blocks from :math:`B` Hessian-vector products (valid when elements do not interact, module docstring)."""
    value, grad_fn = loss_fn(z), jax.grad(loss_fn)
    g = grad_fn(z)
    b = z.shape[-1]

    def column(i):
        v = jnp.zeros_like(z).at[..., i].set(1.0)
        return jax.jvp(grad_fn, (z,), (v,))[1]

    cols = jax.vmap(column)(jnp.arange(b))  # (B, ..., B): column i of every block
    return value, g, jnp.moveaxis(cols, 0, -1)


def estimate(loss_fn, mean, precision, method="cubature", key=None, num_samples=8):
    r""":class:`~numpyro_blr.estimators.Estimate` of :math:`\mathbb E_q[\ell]` with ``grad`` :math:`\hat g` (shaped like
    ``mean``, ``(..., B)``) and ``hessian`` :math:`\hat H` (``(..., B, B)``) for :math:`q = \mathcal N(\text{mean},
    \text{precision}^{-1})` per element; ``loss_fn(z)`` is a scalar (module docstring)."""
    if method not in METHODS:
        raise ValueError(f"method must be one of {METHODS}, got {method!r}.")
    if method == "delta":
        value, g, h = grad_and_block_hessian(loss_fn, mean)
        return Estimate(value, g, h)
    if method == "cubature":
        natural = FullGaussian.to_natural(mean, precision)
        points, w = FullGaussian.quadrature(FullGaussian.expectation(natural), natural)
        points = jax.lax.stop_gradient(points)
        value, g, h = jax.vmap(lambda z: grad_and_block_hessian(loss_fn, z))(points)
        return Estimate(jnp.tensordot(w, value, 1), jnp.tensordot(w, g, 1), jnp.tensordot(w, h, 1))
    if key is None:
        raise ValueError(f"method={method!r} draws from q: it needs a random key.")
    half = max(num_samples // 2, 1)
    scale_tril = precision_to_scale_tril(precision)
    eps = jax.random.normal(key, (half,) + mean.shape, mean.dtype)
    eps = jnp.concatenate([eps, -eps])
    z = mean[None] + jnp.einsum("...ij,s...j->s...i", scale_tril, eps)
    if method == "autodiff":
        value, g, h = jax.vmap(lambda x: grad_and_block_hessian(loss_fn, x))(z)
        return Estimate(jnp.mean(value), jnp.mean(g, 0), jnp.mean(h, 0))
    value, g = jax.vmap(jax.value_and_grad(loss_fn))(z)
    a = jnp.mean(jnp.tril(g[..., :, None] * eps[..., None, :]), 0)  # tril(grad eps^T), averaged
    lead = mean.shape[:-1]
    flat_l, flat_a = scale_tril.reshape((-1,) + scale_tril.shape[-2:]), a.reshape((-1,) + a.shape[-2:])
    h = jax.vmap(reparam_hessian_full)(flat_l, flat_a).reshape(lead + a.shape[-2:])
    return Estimate(jnp.mean(value), jnp.mean(g, 0), h)


def laplace_gap(loss_fn, mean, scale_tril, key, num_samples=256):
    r"""How far a Laplace approximation is from Gaussian: ``(gap, standard_error)`` in nats.

    For :math:`q = \mathcal N(m, LL^\top)` with :math:`(LL^\top)^{-1} = \nabla^2\ell(m)` at a mode
    :math:`m` of :math:`\ell` (minus the log joint, ``loss_fn`` of a flat vector), the Laplace
    evidence is :math:`\log Z_L = -\ell(m) + \mathcal H(q) - D/2` and the ELBO of :math:`q` is
    :math:`-\mathbb E_q[\ell] + \mathcal H(q)`, so

    .. math:: \delta = \log Z_L - \mathrm{ELBO}(q) = \mathbb E_q[\ell(z)] - \ell(m) - D/2,

    zero when :math:`\ell` is quadratic (a Gaussian posterior) and the ELBO's shortfall from the
    Laplace evidence otherwise: the nats that :math:`q`'s own second-order model of the posterior
    misses. Estimated with ``num_samples`` antithetic draws (:math:`\pm\varepsilon`, which cancel the
    odd orders of :math:`\ell` around :math:`m`) and the control variate :math:`\tfrac12\lVert\varepsilon\rVert^2`
    in place of :math:`D/2` (the same mean), so a quadratic :math:`\ell` gives exactly 0 at every draw;
    the standard error is that of the pair means.
    On ``gp_pois_regr`` (bench/robustness_cases.py) ``nb.laplace()`` converges to a mode
    (gradient 2e-8, Hessian positive definite) whose Gaussian has :math:`\delta \approx 67` nats:
    its ELBO is 88 nats below ``nb.BLR()``'s, a correct Laplace approximation of a posterior that
    is far from Gaussian at its mode.
    """
    half = max(int(num_samples) // 2, 1)
    eps = jax.random.normal(key, (half,) + jnp.shape(mean), jnp.result_type(mean))
    dz = eps @ jnp.swapaxes(scale_tril, -1, -2)
    values = jax.vmap(loss_fn)(jnp.concatenate([mean + dz, mean - dz]))
    pairs = 0.5 * (values[:half] + values[half:])
    # minus 0.5 |eps|^2 (mean D/2): the pair's excess is then exactly 0 for a quadratic loss
    excess = pairs - loss_fn(mean) - 0.5 * jnp.sum(eps * eps, axis=-1)
    return jnp.mean(excess), jnp.std(excess) / jnp.sqrt(half)


def laplace_gap_from_losses(loss, mean_loss, log_det_scale, dim):
    r"""One draw of :func:`laplace_gap`'s :math:`\delta` from the two ELBO losses a delta-method BLR step
    already evaluates at one random key (``nb.laplace()``, ``nb.newton()``: ``estimators.svi.estimate``
    with ``delta=True``).

    ``loss`` is the ELBO loss at the guide's parameters, :math:`\ell(m + L\varepsilon) + \log q(z)` with
    :math:`\log q(z) = -\tfrac D2\log 2\pi - \log\lvert L\rvert - \tfrac12\lVert\varepsilon\rVert^2`;
    ``mean_loss`` the same loss with every scale set to :math:`\tau = \epsilon_{\rm dtype}^2`
    (``estimators.svi.at_mean``). There the sample :math:`m + \tau\varepsilon` rounds to :math:`m`
    (:math:`\tau\lvert\varepsilon\rvert` is far below the spacing of the floats at :math:`m` unless
    a mean is within :math:`\sim\epsilon_{\rm dtype}` of 0), so its log-density reads
    :math:`-\tfrac D2\log 2\pi - D\log\tau` with no :math:`\tfrac12\lVert\varepsilon\rVert^2`, and

    .. math:: \text{loss} - \text{mean\_loss} + \log\lvert L\rvert - D\log\tau
              = \ell(m + L\varepsilon) - \ell(m) - \tfrac12\lVert\varepsilon\rVert^2,

    whose mean over steps (common random numbers within a step) is
    :math:`\mathbb E_q[\ell] - \ell(m) - D/2 = \delta`. ``log_det_scale`` is :math:`\log\lvert L\rvert`
    summed over the Gaussian blocks, ``dim`` their total size :math:`D`.
    """
    loss = jnp.asarray(loss)
    log_tiny = 2.0 * jnp.log(jnp.finfo(loss.dtype).eps)
    return loss - mean_loss + log_det_scale - dim * log_tiny
