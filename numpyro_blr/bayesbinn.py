r"""BayesBiNN: the Bayesian learning rule for binary neural networks, as pure JAX functions.

Meng, Bachmann & Khan (2020), "Training Binary Neural Networks using the Bayesian Learning Rule",
ICML (reference code: ``team-approx-bayes/BayesBiNN``, ``optimizers/BayesBiNN.py``); Khan & Rue
(2023), "The Bayesian learning rule", JMLR, Table 1 row "BayesBiNN / STE" (Bernoulli posterior,
Gumbel-softmax / Concrete gradient estimate).

Each binary weight :math:`w \in \{-1, +1\}` gets a Bernoulli posterior
:math:`q(w) \propto e^{\lambda w}`, with natural parameter :math:`\lambda` and expectation
:math:`\mu = \mathbb E_q[w] = \tanh\lambda` (``families.Bernoulli`` in :math:`\pm1` units). The BLR
:math:`\lambda \leftarrow (1-\rho)\lambda + \rho\lambda_0 - \rho\nabla_\mu\mathbb E_q[\ell]` (prior
natural parameter :math:`\lambda_0`) needs :math:`\nabla_\mu \mathbb E_q[\ell]`, which BayesBiNN
estimates with the Gumbel-softmax relaxation at temperature :math:`\tau`:

.. math::
    \delta &= \tfrac12 \log\frac{u}{1-u},\quad u \sim \mathcal U(0, 1), \qquad
    w_r = \tanh\big((\lambda + \delta)/\tau\big), \\
    \hat g &= N\,\frac{1}{S}\sum_s \frac{1 - w_{r,s}^2}{\tau\,(1 - \mu^2)}\,\nabla\bar\ell(w_{r,s}), \\
    \bar m &\leftarrow \beta \bar m + (1-\beta)\big(\hat g + \kappa(\lambda - \lambda_0)\big), \\
    \lambda &\leftarrow \lambda - \alpha\, \bar m / (1 - \beta^t),

with :math:`\bar\ell` the **average** mini-batch loss, :math:`N` = ``ess`` (training-set size),
:math:`\kappa` = ``reweight`` (KL weight, 1 for the BLR) and :math:`\alpha` the learning rate
(:math:`\beta = 0` gives the plain BLR with :math:`\rho = \alpha`). At test time use
:math:`\operatorname{sign}(\mu)` (:math:`-1` where :math:`\mu \le 0`) or average predictions over
exact Bernoulli draws :math:`P(w = +1) = (1+\mu)/2 = \sigma(2\lambda)`.

Numerics: :math:`(1-w_r^2)/(1-\mu^2) = \operatorname{sech}^2(a)/\operatorname{sech}^2(\lambda)` is
computed in log space (:math:`\log\operatorname{sech}^2 x = \log 4 - 2|x| - 2\log(1+e^{-2|x|})`), so it
is exact in float32 where :math:`\tanh` saturates, and capped at ``max_scale`` (default
:math:`10^{10}`, the effective cap of the reference's ``+1e-10`` guards).
"""

import math
from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from numpyro_blr.core import all_finite as _all_finite
from numpyro_blr.core import check_params
from numpyro_blr.core import select as _select
from numpyro_blr.tree import stack_samples as _stack_samples


class BayesBiNNState(NamedTuple):
    """BayesBiNN state (fixed-shape arrays only).

    ``lam``        natural parameters :math:`\\lambda` (pytree like the network's weights);
    ``momentum``   the momentum :math:`\\bar m` (same pytree);
    ``prior_lam``  prior natural parameters :math:`\\lambda_0` (same pytree; 0 = uniform prior,
                   or the previous task's posterior for continual learning);
    ``count``      int32 steps taken; ``nonfinite`` bool, last step skipped; ``skipped`` int32.
    """

    lam: Any
    momentum: Any
    prior_lam: Any
    count: jax.Array
    nonfinite: jax.Array
    skipped: jax.Array


class BayesBiNNFunctions(NamedTuple):
    """The pure functions returned by :func:`bayesbinn`."""

    init: Callable
    sample: Callable
    update: Callable
    step: Callable
    mean: Callable
    sample_binary: Callable
    predictive: Callable


def relaxed_weights(lam, u, temperature):
    r"""Gumbel-softmax relaxed :math:`\pm1` weights :math:`\tanh((\lambda + \tfrac12\log\frac{u}{1-u})/\tau)` (elementwise)."""
    return jnp.tanh((lam + 0.5 * (jnp.log(u) - jnp.log1p(-u))) / temperature)


def _log_sech2(x):
    ax = jnp.abs(x)
    return math.log(4.0) - 2.0 * ax - 2.0 * jnp.log1p(jnp.exp(-2.0 * ax))


def gradient_scale(lam, u, temperature, max_scale=1e10):
    r""":math:`(1 - w_r^2)/(\tau(1-\mu^2))` with :math:`w_r` = :func:`relaxed_weights`, :math:`\mu = \tanh\lambda`,
    evaluated stably in log space and capped at ``max_scale``."""
    a = (lam + 0.5 * (jnp.log(u) - jnp.log1p(-u))) / temperature
    log_ratio = _log_sech2(a) - _log_sech2(lam) - math.log(temperature)
    return jnp.exp(jnp.minimum(log_ratio, math.log(max_scale)))


def _uniform_like(key, tree):
    leaves, treedef = jax.tree.flatten(tree)
    sizes = [int(np.prod(jnp.shape(x))) for x in leaves]
    dtype = jnp.result_type(leaves[0])
    tiny = float(jnp.finfo(dtype).tiny)
    flat = jax.random.uniform(key, (sum(sizes),), dtype, minval=tiny, maxval=1.0)
    flat = jnp.minimum(flat, 1.0 - float(jnp.finfo(dtype).epsneg))
    out, start = [], 0
    for x, n in zip(leaves, sizes):
        out.append(flat[start:start + n].reshape(jnp.shape(x)))
        start += n
    return jax.tree.unflatten(treedef, out)


def _check(x, name, allow_zero=False):
    if callable(x) and name == "lr":
        return x
    if isinstance(x, bool) or not isinstance(x, (int, float, np.integer, np.floating)) or not math.isfinite(x):
        raise ValueError(f"{name} must be a finite number, got {x!r}.")
    if x < 0 or (x == 0 and not allow_zero):
        raise ValueError(f"{name} must be {'>= 0' if allow_zero else '> 0'}, got {x}.")
    return float(x)


def bayesbinn(
    lr,
    ess,
    temperature=1.0,
    beta=0.0,
    mc_samples=1,
    lam_init=10.0,
    lam_std=0.0,
    reweight=1.0,
    max_scale=1e10,
) -> BayesBiNNFunctions:
    r"""Build BayesBiNN (Meng, Bachmann & Khan 2020); equations in the module docstring.

    Arguments: ``lr`` :math:`\alpha` (number or schedule ``count -> lr``); ``ess`` :math:`N`, the
    training-set size (``loss_fn`` is the *mean* mini-batch loss); ``temperature`` :math:`\tau`;
    ``beta`` the momentum (reference default 0); ``mc_samples`` :math:`S`; ``lam_init`` /
    ``lam_std``: :math:`\lambda` starts at :math:`\pm(\lambda_{\rm init} + \sqrt{\lambda_{\rm std}}\,\epsilon)`
    with random signs (as in the reference); ``reweight`` :math:`\kappa`, the KL weight.

    Returns a :class:`BayesBiNNFunctions`:

    ``init(key, params, prior_lam=None) -> BayesBiNNState``   (``params`` gives the shapes only)
    ``sample(key, state) -> (w_relaxed, u)``                   one relaxed sample and its uniforms
    ``update(grads, us, state) -> BayesBiNNState``
        ``grads`` of the mean loss at the relaxed weights made from the uniforms ``us`` (one pytree,
        a stacked pytree with a leading sample axis, or a list); non-finite steps are skipped.
    ``step(key, state, loss_fn, *args) -> (state, loss)``     jit-able
    ``mean(state)``           :math:`\operatorname{sign}(\mu)` weights (:math:`-1` where :math:`\mu\le0`)
    ``sample_binary(key, state)``  exact :math:`\pm1` draw, :math:`P(+1) = (1+\mu)/2`
    ``predictive(key, state, apply_fn, x, num_samples)``  mean of ``apply_fn`` over binary draws
    """
    lr = _check(lr, "lr")
    ess = _check(ess, "ess")
    temperature = _check(temperature, "temperature")
    if not isinstance(beta, (int, float)) or isinstance(beta, bool) or not 0.0 <= beta < 1.0:
        raise ValueError(f"beta must be a number in [0, 1), got {beta!r}.")
    beta = float(beta)
    if isinstance(mc_samples, bool) or not isinstance(mc_samples, (int, np.integer)) or mc_samples < 1:
        raise ValueError(f"mc_samples must be an integer >= 1, got {mc_samples!r}.")
    lam_init = _check(lam_init, "lam_init", allow_zero=True)
    lam_std = _check(lam_std, "lam_std", allow_zero=True)
    reweight = _check(reweight, "reweight", allow_zero=True)
    max_scale = _check(max_scale, "max_scale")

    def init(key, params, prior_lam=None):
        check_params(params)
        leaves, treedef = jax.tree.flatten(params)
        keys = jax.random.split(key, 2 * len(leaves))
        lam = []
        for i, p in enumerate(leaves):
            p = jnp.asarray(p)
            dtype = p.dtype if jnp.issubdtype(p.dtype, jnp.floating) else jnp.float32
            sign = jnp.where(jax.random.bernoulli(keys[2 * i], 0.5, p.shape), 1.0, -1.0).astype(dtype)
            noise = math.sqrt(lam_std) * jax.random.normal(keys[2 * i + 1], p.shape, dtype)
            lam.append(sign * (lam_init + noise))
        lam = jax.tree.unflatten(treedef, lam)
        prior = jax.tree.map(jnp.zeros_like, lam) if prior_lam is None else jax.tree.map(
            lambda a, b: jnp.asarray(b, a.dtype), lam, prior_lam
        )
        return BayesBiNNState(
            lam=lam,
            momentum=jax.tree.map(jnp.zeros_like, lam),
            prior_lam=prior,
            count=jnp.zeros((), jnp.int32),
            nonfinite=jnp.zeros((), bool),
            skipped=jnp.zeros((), jnp.int32),
        )

    def sample(key, state):
        u = _uniform_like(key, state.lam)
        return jax.tree.map(lambda l, uu: relaxed_weights(l, uu, temperature), state.lam, u), u

    def update(grads, us, state):
        grads = _stack_samples(grads, state.lam, "grads")
        us = _stack_samples(us, state.lam, "us")
        t = state.count + 1
        alpha = lr(state.count) if callable(lr) else lr

        def g_hat(l, g, u):
            return ess * jnp.mean(gradient_scale(l[None], u, temperature, max_scale) * g, axis=0)

        gh = jax.tree.map(g_hat, state.lam, grads, us)
        mom = jax.tree.map(
            lambda m, g, l, l0: beta * m + (1.0 - beta) * (g + reweight * (l - l0)),
            state.momentum, gh, state.lam, state.prior_lam,
        )

        def lam_step(l, m):
            debias = 1.0 - jnp.asarray(beta, l.dtype) ** t.astype(l.dtype)
            return (l - alpha * m / debias).astype(l.dtype)

        lam = jax.tree.map(lam_step, state.lam, mom)
        ok = _all_finite(lam, mom)
        return BayesBiNNState(
            lam=_select(ok, lam, state.lam),
            momentum=_select(ok, mom, state.momentum),
            prior_lam=state.prior_lam,
            count=jnp.where(ok, t, state.count),
            nonfinite=~ok,
            skipped=state.skipped + jnp.where(ok, 0, 1).astype(jnp.int32),
        )

    def step(key, state, loss_fn, *args):
        keys = jax.random.split(key, mc_samples)
        ws, us = jax.vmap(sample, in_axes=(0, None))(keys, state)
        losses, grads = jax.vmap(lambda w: jax.value_and_grad(loss_fn)(w, *args))(ws)
        return update(grads, us, state), jnp.mean(losses)

    def mean(state):
        return jax.tree.map(lambda l: jnp.where(l <= 0, -1.0, 1.0).astype(l.dtype), state.lam)

    def sample_binary(key, state):
        u = _uniform_like(key, state.lam)
        return jax.tree.map(
            lambda l, uu: jnp.where(uu < jax.nn.sigmoid(2.0 * l), 1.0, -1.0).astype(l.dtype), state.lam, u
        )

    def predictive(key, state, apply_fn, x, num_samples):
        keys = jax.random.split(key, num_samples)
        return jnp.mean(jax.vmap(lambda k: apply_fn(sample_binary(k, state), x))(keys), axis=0)

    return BayesBiNNFunctions(
        init=init, sample=sample, update=update, step=step, mean=mean, sample_binary=sample_binary,
        predictive=predictive,
    )
