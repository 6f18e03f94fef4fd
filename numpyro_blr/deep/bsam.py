r"""Bayesian SAM (bSAM) as pure JAX functions.

Möllenhoff & Khan (2023), "SAM as an Optimal Relaxation of Bayes", ICLR 2023 (Algorithm 1;
reference code team-approx-bayes/bayesian-sam, ``optim.py``).

bSAM learns a diagonal Gaussian :math:`q(\theta) = \mathcal N(w, \operatorname{diag}(1/(N s)))`
(``ess`` :math:`= N`). One step, in the order of the paper's Algorithm 1:

.. math::
    \theta &= w + \epsilon / \sqrt{N s}, \quad \epsilon \sim \mathcal N(0, I), \qquad
        g = \nabla\bar\ell(\theta), \\
    e &= \rho\, g / s, \qquad g_\rho = \nabla\bar\ell(w + e), \\
    g_m &\leftarrow \beta_1 g_m + (1-\beta_1)(g_\rho + \delta w), \\
    s &\leftarrow \beta_2 s + (1-\beta_2)(\sqrt{s}\,|g| + \delta + \gamma), \\
    w &\leftarrow w - \alpha\, g_m / s,

with :math:`\delta` the weight decay (prior precision per example), :math:`\gamma` the damping
and :math:`\bar\ell` the average mini-batch loss. There is no bias correction. The reference
code takes the :math:`w` step with the *old* :math:`s` and updates :math:`s` afterwards; here the
paper's order is followed (the two differ by one step of the slowly moving :math:`s`).

With ``msharpness = m > 1`` (the reference's ``batchsplit``) ``step`` splits the batch into
``m`` groups; each group draws its own :math:`\epsilon`, takes its own perturbation and gradient,
and :math:`\sqrt{s}|g|` and :math:`g_\rho` are averaged over the groups.
"""

from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from numpyro_blr.deep.ivon import (
    _all_finite,
    _check_beta,
    _check_ess,
    _check_lr,
    _check_positive,
    _lr_at,
    _select,
    _stack_samples,
    init_diagonal_state,
    normal_like,
    predictive,
)


class BSAMState(NamedTuple):
    """``params``: the mean :math:`w`; ``prec``: :math:`s` (variance ``1/(ess*s)``);
    ``momentum``: :math:`g_m`; ``count``, ``nonfinite``, ``skipped`` as in :class:`IVONState`."""

    params: Any
    prec: Any
    momentum: Any
    count: jax.Array
    nonfinite: jax.Array
    skipped: jax.Array


class BSAM(NamedTuple):
    """``init``, ``sample``, ``perturb``, ``update``, ``step``, ``predictive`` (all pure)."""

    init: Callable
    sample: Callable
    perturb: Callable
    update: Callable
    step: Callable
    predictive: Callable


def bsam(lr, ess=None, rho=0.01, beta1=0.9, beta2=0.999, weight_decay=1e-4, damping=0.1,
         s_init=1.0, msharpness=1) -> BSAM:
    """Build bSAM (Möllenhoff & Khan 2023):

    ``init(params) -> BSAMState`` (``s = s_init``, zero momentum);
    ``sample(key, state) -> (theta, noise)``, ``noise = eps/sqrt(ess*s)``;
    ``perturb(grads, state) -> w + rho*grads/s``;
    ``update(grads, perturbed_grads, state) -> BSAMState``: ``grads`` at the samples, ``perturbed_grads``
    at the perturbed means (one pytree, or with a leading group axis / a list: averaged);
    ``step(key, state, loss_fn, *args) -> (state, loss at the perturbed point)``; with ``msharpness > 1``
    every array in ``args`` is split along its leading (batch) axis into ``msharpness`` groups;
    ``predictive(key, state, apply_fn, x, num_samples)``.
    """
    lr = _check_lr(lr)
    ess = _check_ess(ess)
    rho = _check_positive(rho, "rho", allow_zero=True)
    beta1 = _check_beta(beta1, "beta1")
    beta2 = _check_beta(beta2, "beta2")
    delta = _check_positive(weight_decay, "weight_decay", allow_zero=True)
    damping = _check_positive(damping, "damping", allow_zero=True)
    s_init = _check_positive(s_init, "s_init")
    if isinstance(msharpness, bool) or not isinstance(msharpness, (int, np.integer)) or msharpness < 1:
        raise ValueError(f"msharpness must be an integer >= 1, got {msharpness!r}.")
    msharpness = int(msharpness)

    def init(params):
        return init_diagonal_state(BSAMState, params, s_init)

    def sample(key, state):
        eps = normal_like(key, state.params)
        noise = jax.tree.map(lambda e, s: e * lax.rsqrt(ess * s), eps, state.prec)
        return jax.tree.map(jnp.add, state.params, noise), noise

    def perturb(grads, state):
        return jax.tree.map(lambda w, g, s: w + rho * g / s, state.params, grads, state.prec)

    def _apply(gs, g_rho, state):
        """The step from the group means of sqrt(s)|g| and of the perturbed gradient."""
        alpha = _lr_at(lr, state.count)
        mom = jax.tree.map(lambda gm, g, w: beta1 * gm + (1.0 - beta1) * (g + delta * w),
                           state.momentum, g_rho, state.params)
        prec = jax.tree.map(lambda s, a: beta2 * s + (1.0 - beta2) * (a + delta + damping), state.prec, gs)
        params = jax.tree.map(lambda w, gm, s: (w - alpha * gm / s).astype(w.dtype), state.params, mom, prec)
        ok = _all_finite(gs, g_rho, params, prec, mom)
        return BSAMState(
            params=_select(ok, params, state.params),
            prec=_select(ok, prec, state.prec),
            momentum=_select(ok, mom, state.momentum),
            count=jnp.where(ok, state.count + 1, state.count),
            nonfinite=~ok,
            skipped=state.skipped + jnp.where(ok, 0, 1).astype(jnp.int32),
        )

    def update(grads, perturbed_grads, state):
        grads = _stack_samples(grads, state.params, "grads")
        perturbed_grads = _stack_samples(perturbed_grads, state.params, "perturbed_grads")
        gs = jax.tree.map(lambda g, s: jnp.mean(jnp.sqrt(s) * jnp.abs(g), axis=0), grads, state.prec)
        return _apply(gs, jax.tree.map(lambda g: jnp.mean(g, axis=0), perturbed_grads), state)

    def _group(key, state, loss_fn, args):
        theta, _ = sample(key, state)
        g = jax.grad(loss_fn)(theta, *args)
        loss, g_rho = jax.value_and_grad(loss_fn)(perturb(g, state), *args)
        return g, g_rho, loss

    def step(key, state, loss_fn, *args):
        keys = jax.random.split(key, msharpness)
        if msharpness == 1:
            g, g_rho, loss = _group(keys[0], state, loss_fn, args)
            return update(g, g_rho, state), loss

        def split(a):
            a = jnp.asarray(a)
            if a.ndim == 0 or a.shape[0] % msharpness:
                raise ValueError(f"msharpness={msharpness}: every batch array needs a leading axis divisible by it, got shape {a.shape}.")
            return a.reshape(msharpness, a.shape[0] // msharpness, *a.shape[1:])

        groups = jax.tree.map(split, args)
        g, g_rho, loss = jax.vmap(lambda k, a: _group(k, state, loss_fn, a))(keys, groups)
        return update(g, g_rho, state), jnp.mean(loss)

    def _predictive(key, state, apply_fn, x, num_samples):
        return predictive(key, state, apply_fn, x, num_samples, sample=sample)

    return BSAM(init, sample, perturb, update, step, _predictive)
