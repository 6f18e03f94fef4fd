r"""The Gumbel-softmax (Concrete) relaxation: :math:`\nabla_\mu \mathbb E_q[\ell]` for :math:`\pm1` Bernoulli weights.

For :math:`q(w) \propto e^{\lambda w}` on :math:`\{-1, +1\}` (:class:`~numpyro_blr.families.SignBernoulli`,
:math:`\mu = \tanh\lambda`), BayesBiNN (Meng, Bachmann & Khan 2020; Khan & Rue 2023, Table 1)
differentiates through the relaxed draw :math:`w_r = \tanh a`, :math:`a = (\lambda + \tfrac12\log\frac{u}{1-u})/\tau`,
by the chain rule :math:`\partial/\partial\mu = (\partial w_r/\partial\lambda)/(\partial\mu/\partial\lambda)`:

.. math::
    \hat g = N\,\frac1S \sum_s \frac{1 - w_{r,s}^2}{\tau\,(1 - \mu^2)}\,\nabla\bar\ell(w_{r,s}),

:math:`\bar\ell` the **average** mini-batch loss, :math:`N` = ``ess``. The ratio
:math:`\operatorname{sech}^2 a/\operatorname{sech}^2\lambda` is formed in log space (exact in float32 where
:math:`\tanh` saturates) and capped at ``max_scale`` (:math:`10^{10}`, the effective cap of the reference's
``+1e-10`` guards). The :class:`~numpyro_blr.estimators.Estimate` has ``loss`` the mean of :math:`\bar\ell`
over the draws and ``grad`` :math:`\hat g`, a pytree like ``state.lam`` (:math:`\mu` is elementwise).
"""

import math

import jax
import jax.numpy as jnp

from numpyro_blr.estimators import Estimate
from numpyro_blr.families.bernoulli import SignBernoulli
from numpyro_blr.tree import stack_samples, uniform_like


def gradient_scale(lam, u, temperature, max_scale=1e10):
    r""":math:`(1 - w_r^2)/(\tau(1-\mu^2))` for the relaxed draw :math:`w_r` of ``u``, in log space, capped at ``max_scale``."""
    a = SignBernoulli.relaxed_argument(lam, u, temperature)
    log_ratio = SignBernoulli.log_variance(a) - SignBernoulli.log_variance(lam) - math.log(temperature)
    return jnp.exp(jnp.minimum(log_ratio, math.log(max_scale)))


def relaxed_sample(key, lam, temperature):
    """One relaxed draw ``w_r`` of the pytree ``lam`` and its uniforms ``u`` (one draw for the whole tree)."""
    u = uniform_like(key, lam)
    return jax.tree.map(lambda l, uu: SignBernoulli.relaxed_from_uniform(l, uu, temperature), lam, u), u


def gumbel_softmax_from_grads(state, grads, us, ess, temperature, max_scale=1e10):
    r""":math:`\hat g` from gradients ``grads`` of the mean loss at the relaxed draws made from the uniforms
    ``us``: one pytree each, pytrees with a leading sample axis, or lists of pytrees."""
    grads = stack_samples(grads, state.lam, "grads")
    us = stack_samples(us, state.lam, "us")

    def g_hat(l, g, u):
        return ess * jnp.mean(gradient_scale(l[None], u, temperature, max_scale) * g, axis=0)

    return Estimate(jnp.nan, jax.tree.map(g_hat, state.lam, grads, us))


def gumbel_softmax(ess, temperature=1.0, mc_samples=1, max_scale=1e10):
    """BayesBiNN's estimator: ``mc_samples`` relaxed draws (key ``s`` of ``jax.random.split(key, mc_samples)``)."""

    def estimate(key, state, loss_fn, *batch):
        keys = jax.random.split(key, mc_samples)
        ws, us = jax.vmap(relaxed_sample, in_axes=(0, None, None))(keys, state.lam, temperature)
        losses, grads = jax.vmap(lambda w: jax.value_and_grad(loss_fn)(w, *batch))(ws)
        return gumbel_softmax_from_grads(state, grads, us, ess, temperature, max_scale)._replace(loss=jnp.mean(losses))

    return estimate
