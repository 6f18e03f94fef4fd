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
