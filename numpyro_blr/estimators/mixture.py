r"""Estimators for a mixture of Gaussians (:mod:`numpyro_blr.families.mixture`): per-component expectations.

The mixture BLR (Lin, Khan & Schmidt 2019) needs, for every component :math:`c` and with
:math:`f = \ell + \log q`, the expectations :math:`\mathbb E_c[\nabla f]`, :math:`\mathbb E_c[\nabla^2 f]`
and :math:`\mathbb E_c[f]` under :math:`\mathcal N(m_c, S_c^{-1})`. Each constructor returns
``estimate(key, state, loss_fn, *args) -> Estimate`` with

==============  =====================================================================================
``loss``        :func:`reparam`: :math:`\mathbb E_q[\ell + \log q]`, the negative ELBO up to :math:`\log Z`;
                :func:`delta`: :math:`\ell(m_c)`, one per component (K,)
``grad``        a :class:`MixtureGrad`, shaped like the state's ``means`` and ``logits``:
                ``means`` :math:`\mathbb E_c[\nabla f]` (K, d), the mean step's gradient;
                ``logits`` :math:`\mathbb E_c[f] - \mathbb E_K[f]` (K,), the natural gradient of the
                weights' logits :math:`v_c = \log(\pi_c/\pi_K)` (last entry 0)
``hessian``     :math:`G_c = \mathbb E_c[\nabla^2 f]`, (K, d, d), or the diagonals (K, d); the
                precision step reads :math:`\hat H_c = S_c + G_c` (:math:`\mathbb E[\nabla^2\ell]` when K = 1)
==============  =====================================================================================

:func:`reparam` draws stratified samples of :math:`q` (``num_samples`` per component,
:math:`\theta = m_{c'} + R_{c'}^{-\top}\epsilon`, each of mass :math:`\pi_{c'}/S`) and re-weights a
component-:math:`c` expectation by the responsibility ratio,

.. math::
    \mathbb E_c[h] = \mathbb E_q\Big[\frac{q(c\mid\theta)}{\pi_c} h(\theta)\Big]
      \approx \frac{\sum_n \alpha_{nc} h(\theta_n)}{\sum_n \alpha_{nc}},\qquad
      \alpha_{nc} = \frac{\pi_{c'(n)}}{S}\,\frac{\mathcal N(\theta_n\mid m_c, S_c^{-1})}{q(\theta_n)},

self-normalised so that a constant added to :math:`\ell` changes nothing. A draw where the loss, its gradient or
Hessian is not finite is left out of every expectation, and a component whose own draws are not all finite gets
NaN estimates (:func:`numpyro_blr.mixture.mixture_update` holds it while the others step). :math:`\nabla\log q` and
:math:`\nabla^2\log q` are exact (:func:`~numpyro_blr.families.mixture.log_q_terms`); :math:`\nabla^2\ell`
is exact (``hessian="autodiff"``, ``jax.hessian``; the diagonal of it for diagonal components) or
Price's / Stein's estimate :math:`\mathbb E_c[S_c(\theta - m_c)\nabla\ell^\top]` (``hessian="price"``,
gradients only, symmetrised).

:func:`delta` (multimodal optimisation, Khan & Rue 2023, Table 1): every :math:`\mathbb E_c[h]` is
:math:`h(m_c)`, exact Hessians; separated components are assumed (:math:`\nabla\log q(m_c) \approx 0`,
:math:`\nabla^2\log q(m_c) \approx -S_c`, :math:`\log q(m_c) \approx \log\pi_c + \tfrac12\log|S_c|` + const)
unless ``repulsion``, which takes :math:`\log q` exactly at the means (overlapping components repel).
"""

import math
from typing import NamedTuple

import jax
import jax.numpy as jnp

from numpyro_blr.core import backtracking_factor
from numpyro_blr.estimators import Estimate
from numpyro_blr.families import mixture as family

HESSIANS = ("autodiff", "price")


class MixtureGrad(NamedTuple):
    r"""``Estimate.grad`` of a mixture: ``means`` :math:`\mathbb E_c[\nabla f]` (K, d) and ``logits``
    :math:`\mathbb E_c[f] - \mathbb E_K[f]` (K,)."""

    means: jax.Array
    logits: jax.Array


def _sym(a):
    return 0.5 * (a + jnp.swapaxes(a, -1, -2))


def reparam(hessian="autodiff", num_samples=1):
    """Responsibility-weighted Monte Carlo over ``num_samples`` draws per component (module docstring)."""
    if hessian not in HESSIANS:
        raise ValueError(f"hessian must be one of {HESSIANS}, got {hessian!r}.")
    S = num_samples

    def estimate(key, state, loss_fn, *args):
        chols = family.precision_cholesky(state)
        x = family.sample_components(key, state, S, chols)
        K = state.means.shape[0]
        log_mass = jnp.repeat(family.log_weights(state.logits), S) - math.log(S)  # pi_{c'} / S
        fn = lambda th: loss_fn(th, *args)  # noqa: E731
        losses, grads = jax.vmap(jax.value_and_grad(fn))(x)
        lq = family.log_q_terms(x, state, chols)
        h_l = None
        if hessian == "autodiff":
            h_l = jax.vmap(jax.hessian(fn))(x)
            if family.is_diagonal(state):
                h_l = jnp.diagonal(h_l, axis1=-2, axis2=-1)
        # a draw where the loss, its gradient or Hessian (or log q's terms) is not finite is left out of every
        # component's expectation; a component whose own draws are not all finite gets NaN (mixture_update holds it)
        finite = [losses, grads, lq.value, lq.grad, lq.hessian] + ([] if h_l is None else [h_l])
        ok = jnp.all(jnp.stack([jnp.all(jnp.isfinite(v).reshape(v.shape[0], -1), axis=1) for v in finite]), axis=0)
        own = jnp.all(ok.reshape(K, S), axis=1)  # (K,)
        clean = lambda v: jnp.where(ok.reshape((-1,) + (1,) * (v.ndim - 1)), v, 0.0)  # noqa: E731
        losses, grads, lq = clean(losses), clean(grads), lq._replace(value=clean(lq.value), grad=clean(lq.grad),
                                                                       hessian=clean(lq.hessian))
        # alpha_{nc} ∝ (pi_{c'}/S) N_c(x_n)/q(x_n), self-normalised over n for each c
        log_alpha = jnp.where(ok[:, None], log_mass[:, None] + lq.components - lq.value[:, None], -jnp.inf)
        alpha = jax.nn.softmax(log_alpha, axis=0)  # (n, K)
        alpha = jnp.where(jnp.isfinite(alpha), alpha, 0.0)
        f = losses + lq.value
        value = alpha.T @ f
        if hessian == "autodiff":
            hess = jnp.einsum("nk,n...->k...", alpha, clean(h_l) + lq.hessian)
        else:
            diff = x[:, None, :] - state.means[None]  # (n, K, d)
            if family.is_diagonal(state):
                h_l = jnp.einsum("nk,nkd,nd->kd", alpha, state.precision[None] * diff, grads)
            else:
                sd = jnp.einsum("kij,nkj->nki", state.precision, diff)
                h_l = _sym(jnp.einsum("nk,nki,nj->kij", alpha, sd, grads))
            hess = h_l + jnp.einsum("nk,n...->k...", alpha, lq.hessian)
        nan = lambda v: jnp.where(own.reshape((K,) + (1,) * (v.ndim - 1)), v, jnp.nan)  # noqa: E731
        value = nan(value)
        grad = MixtureGrad(nan(alpha.T @ (grads + lq.grad)), value - value[-1])
        mass = jnp.exp(log_mass)  # a left-out draw of a component of zero weight does not change E_q[f]
        loss = jnp.where(jnp.all(ok | (mass == 0)), jnp.sum(mass * f), jnp.nan)
        return Estimate(loss, grad, nan(hess))

    return estimate


def mean_backtracking(num_samples=1, shrink=0.25, tries=8):
    r"""Damping :math:`\alpha_c \in [0, 1]` of each component's mean step (``nb.BLR()``'s ``backtrack``, per
    component): ``damping(key, state, new_means, loss_fn, *args) -> alpha`` (K,) with the draws of
    :func:`reparam` at the same ``key`` (common random numbers). The step :math:`\Delta_c` is a Newton step on
    :math:`\phi_c(m') = \tfrac1S\sum_s \ell(\theta_{cs} + m' - m_c) - (m' - m_c)^\top S_c(\theta_{cs} - m_c)`, the
    sample of :math:`\mathbb E_c[\ell]` with its control variate (for separated components
    :math:`\nabla\log q(\theta) = -S_c(\theta - m_c)`, the term of :math:`\mathbb E_c[\nabla f]` that has mean 0);
    :math:`\alpha_c` is the first of :math:`1, s, s^2, \dots` (``shrink`` :math:`s`, ``tries``) at which
    :math:`\phi_c` is finite and does not rise, 0 when none is (:func:`~numpyro_blr.core.backtracking_factor`).
    Where the local quadratic model holds the full step is taken; far from the posterior (a first step from a
    wide initial component over a saturating likelihood, a draw that overflows) the mean cannot overshoot."""
    S = num_samples

    def damping(key, state, new_means, loss_fn, *args):
        chols = family.precision_cholesky(state)
        x = family.sample_components(key, state, S, chols)
        K, d = state.means.shape
        x = x.reshape(K, S, d)
        fn = lambda th: loss_fn(th, *args)  # noqa: E731
        diff = x - state.means[:, None, :]  # (K, S, d)
        if family.is_diagonal(state):
            control = state.precision[:, None, :] * diff
        else:
            control = jnp.einsum("kij,ksj->ksi", state.precision, diff)
        step = new_means - state.means

        def one(xs, delta, ctrl):
            slope = jnp.mean(ctrl @ delta)
            loss0 = jnp.mean(jax.vmap(fn)(xs))

            def value(alpha):
                return jnp.mean(jax.vmap(fn)(xs + alpha.astype(xs.dtype) * delta)) - alpha * slope

            return backtracking_factor(value, loss0, shrink, tries)

        return jax.vmap(one)(x, step, control).astype(state.means.dtype)

    return damping


def delta(repulsion=False):
    """The delta method at every component mean (module docstring); ``key`` is not read (pass None)."""

    def estimate(key, state, loss_fn, *args):
        del key
        fn = lambda th: loss_fn(th, *args)  # noqa: E731
        x = state.means
        losses, grads = jax.vmap(jax.value_and_grad(fn))(x)
        h_l = jax.vmap(jax.hessian(fn))(x)
        if family.is_diagonal(state):
            h_l = jnp.diagonal(h_l, axis1=-2, axis2=-1)
        chols = family.precision_cholesky(state)
        if repulsion:
            lq = family.log_q_terms(x, state, chols)
            value = losses + lq.value
            return Estimate(losses, MixtureGrad(grads + lq.grad, value - value[-1]), h_l + lq.hessian)
        # separated components: log q(m_c) ~ log pi_c + log N_c(m_c), grad 0, Hessian -S_c
        log_det = jnp.sum(jnp.log(chols if family.is_diagonal(state) else jnp.diagonal(chols, axis1=-2, axis2=-1)), -1)
        value = losses + family.log_weights(state.logits) + log_det
        return Estimate(losses, MixtureGrad(grads, value - value[-1]), h_l - state.precision)

    return estimate
