r"""VOGN and OGN: variational / online Gauss-Newton as pure JAX functions.

Khan, Nielsen, Tangkaratt, Lin, Gal & Srivastava (2018), "Fast and Scalable Bayesian Deep
Learning by Weight-Perturbation in Adam" (VOGN, eq. 12); Osawa, Swaroop, Jain, Eschenhagen,
Turner, Yokota & Khan (2019), "Practical Deep Learning with Bayesian Principles" (momentum).

With :math:`q = \mathcal N(\mu, \operatorname{diag}(\sigma^2))`, :math:`\sigma^2 = 1/(N(s+\tilde\lambda))`
(:math:`N` = ``ess``, :math:`\tilde\lambda` = ``weight_decay``, the prior precision divided by
:math:`N`), a mini-batch :math:`\mathcal M` of size :math:`M` and per-example gradients
:math:`g_i = \nabla \ell_i(\theta)` at :math:`\theta \sim q`:

.. math::
    \hat g &= \tfrac1M \textstyle\sum_{i\in\mathcal M} g_i, \qquad
    \hat s = \tfrac1M \textstyle\sum_{i\in\mathcal M} g_i^2
        \quad \text{(diagonal Gauss-Newton from per-example squared gradients)}, \\
    s &\leftarrow \beta_2 s + (1-\beta_2) \hat s, \qquad
    g_m \leftarrow \beta_1 g_m + (1-\beta_1) \hat g, \\
    \mu &\leftarrow \mu - \alpha\, \frac{g_m/(1-\beta_1^t) + \tilde\lambda \mu}{s + \tilde\lambda}.

``s`` is an average of squares, so it never goes negative (no improved-BLR correction needed).
OGN is the same update evaluated at :math:`\theta = \mu` (no sampling): :func:`ogn`.
Per-example gradients come from ``jax.vmap(jax.grad(per_example_loss), in_axes=(None, 0, ...))``.
"""

from typing import Any, Callable, NamedTuple, Optional

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
    init_diagonal_state,
    normal_like,
    predictive,
)


class VOGNState(NamedTuple):
    """VOGN/OGN state: ``params`` (mean :math:`\\mu`), ``curv`` (:math:`s`), ``momentum``,
    ``count`` (int32 steps taken), ``nonfinite`` (last step skipped), ``skipped`` (int32 count)."""

    params: Any
    curv: Any
    momentum: Any
    count: jax.Array
    nonfinite: jax.Array
    skipped: jax.Array


class VOGN(NamedTuple):
    """Pure functions returned by :func:`vogn` / :func:`ogn`."""

    init: Callable
    sample: Callable
    update: Callable
    step: Callable
    predictive: Callable


def per_example_grads(per_example_loss, params, *batch):
    """``jax.vmap(jax.grad(per_example_loss))`` over the leading axis of every ``batch`` array."""
    in_axes = (None,) + (0,) * len(batch)
    return jax.vmap(jax.grad(per_example_loss), in_axes=in_axes)(params, *batch)


def _to_samples(grads, like):
    """Per-example gradients -> leaves of shape (S, M, *param_shape)."""
    struct = jax.tree.structure(like)
    if isinstance(grads, (list, tuple)) and grads and jax.tree.structure(grads) != struct:
        if not all(jax.tree.structure(g) == struct for g in grads):
            raise ValueError("per-example grads must be a pytree like the parameters or a list of such pytrees.")
        grads = jax.tree.map(lambda *xs: jnp.stack(xs), *grads)
    if jax.tree.structure(grads) != struct:
        raise ValueError("per-example grads must be a pytree like the parameters or a list of such pytrees.")
    extra = {jnp.ndim(g) - jnp.ndim(p) for g, p in zip(jax.tree.leaves(grads), jax.tree.leaves(like))}
    if extra == {1}:
        return jax.tree.map(lambda g: g[None], grads)
    if extra == {2}:
        return grads
    raise ValueError(
        "per-example grads need a leading example axis (M, *shape) or sample and example axes (S, M, *shape)."
    )


def _make(lr, ess, weight_decay, beta1, beta2, hess_init, mc_samples, axis_name, sampling):
    lr = _check_lr(lr)
    lam = _check_positive(weight_decay, "weight_decay", allow_zero=True)
    beta1 = _check_beta(beta1, "beta1")
    beta2 = _check_beta(beta2, "beta2")
    hess_init = _check_positive(hess_init, "hess_init")
    if isinstance(mc_samples, bool) or not isinstance(mc_samples, (int, np.integer)) or mc_samples < 1:
        raise ValueError(f"mc_samples must be an integer >= 1, got {mc_samples!r}.")
    mc_samples = int(mc_samples) if sampling else 1

    def init(params):
        return init_diagonal_state(VOGNState, params, hess_init)

    def sample(key, state):
        if not sampling:
            return state.params, jax.tree.map(jnp.zeros_like, state.params)
        noise = jax.tree.map(
            lambda e, s: e * lax.rsqrt(ess * (s + lam)), normal_like(key, state.params), state.curv
        )
        return jax.tree.map(jnp.add, state.params, noise), noise

    def update(grads, state):
        """``grads``: per-example gradients, leaves (M, *shape) or (S, M, *shape), or a list over samples."""
        grads = _to_samples(grads, state.params)
        g_bar = jax.tree.map(lambda g: jnp.mean(g, axis=(0, 1)), grads)
        s_hat = jax.tree.map(lambda g: jnp.mean(g * g, axis=(0, 1)), grads)
        if axis_name is not None:
            g_bar, s_hat = lax.pmean((g_bar, s_hat), axis_name)
        t = state.count + 1
        alpha = _lr_at(lr, state.count)
        curv = jax.tree.map(lambda s, sh: beta2 * s + (1.0 - beta2) * sh, state.curv, s_hat)
        mom = jax.tree.map(lambda m, g: beta1 * m + (1.0 - beta1) * g, state.momentum, g_bar)

        def mean_step(mu, gm, s):
            debias = 1.0 - jnp.asarray(beta1, mu.dtype) ** t.astype(mu.dtype)
            return (mu - alpha * (gm / debias + lam * mu) / (s + lam)).astype(mu.dtype)

        params = jax.tree.map(mean_step, state.params, mom, curv)
        ok = _all_finite(g_bar, s_hat, params, curv, mom)
        return VOGNState(
            params=_select(ok, params, state.params),
            curv=_select(ok, curv, state.curv),
            momentum=_select(ok, mom, state.momentum),
            count=jnp.where(ok, t, state.count),
            nonfinite=~ok,
            skipped=state.skipped + jnp.where(ok, 0, 1).astype(jnp.int32),
        )

    def step(key, state, per_example_loss, *batch):
        """Sample, per-example ``vmap(grad)`` for each MC sample, update. Returns ``(state, mean loss)``."""
        if not sampling:  # OGN: evaluate at the mean, the key is not used (may be None)
            thetas = jax.tree.map(lambda p: p[None], state.params)
        else:
            if axis_name is not None:
                key = jax.random.fold_in(key, lax.axis_index(axis_name))
            keys = jax.random.split(key, mc_samples)
            thetas, _ = jax.vmap(sample, in_axes=(0, None))(keys, state)
        in_axes = (None,) + (0,) * len(batch)
        vg = jax.vmap(jax.value_and_grad(per_example_loss), in_axes=in_axes)
        losses, grads = jax.vmap(lambda th: vg(th, *batch))(thetas)
        loss = jnp.mean(losses)
        if axis_name is not None:
            loss = lax.pmean(loss, axis_name)
        return update(grads, state), loss

    def _predictive(key, state, apply_fn, x, num_samples):
        return predictive(key, state, apply_fn, x, num_samples, sample=sample)

    return VOGN(init=init, sample=sample, update=update, step=step, predictive=_predictive)


def vogn(
    lr,
    ess=None,
    weight_decay=1e-4,
    beta1=0.9,
    beta2=0.999,
    hess_init=1.0,
    mc_samples=1,
    axis_name: Optional[str] = None,
) -> VOGN:
    """VOGN (Khan et al. 2018; Osawa et al. 2019). Pure functions:

    ``init(params) -> VOGNState``; ``sample(key, state) -> (theta, noise)`` with
    ``noise ~ N(0, 1/(ess*(curv + weight_decay)))``; ``update(per_example_grads, state) -> state``;
    ``step(key, state, per_example_loss, *batch) -> (state, loss)`` where
    ``per_example_loss(params, *example)`` is the loss of one example and ``batch`` arrays carry a
    leading example axis; ``predictive(key, state, apply_fn, x, num_samples)``.
    """
    ess = _check_ess(ess)
    return _make(lr, ess, weight_decay, beta1, beta2, hess_init, mc_samples, axis_name, True)


def ogn(lr, weight_decay=1e-4, beta1=0.9, beta2=0.999, hess_init=1.0, axis_name: Optional[str] = None) -> VOGN:
    """OGN: VOGN's update at the mean (no weight sampling); ``sample`` returns the mean and zero noise."""
    return _make(lr, 1.0, weight_decay, beta1, beta2, hess_init, 1, axis_name, False)
