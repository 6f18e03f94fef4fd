r"""SGD, RMSprop and Adam as Bayesian-learning-rule updates (Khan & Rue 2023, Table 1 and Sec. 4).

The BLR updates the natural parameter :math:`\lambda` of a candidate :math:`q` along the gradient
of the expected loss with respect to the expectation parameter :math:`\mu`,
:math:`\lambda \leftarrow (1-\rho)\lambda - \rho\nabla_\mu \mathbb E_q[\ell]` (the prior is inside
:math:`\ell`; the entropy gives the :math:`(1-\rho)\lambda` term). For a Gaussian
:math:`\mathcal N(m, S^{-1})`, :math:`\lambda = (Sm, -S/2)`, and
:math:`\nabla_\mu \mathbb E_q[\ell] = (\mathbb E[\nabla\ell] - \mathbb E[\nabla^2\ell] m,\
\tfrac12\mathbb E[\nabla^2\ell])`, so the step reads :math:`S \leftarrow (1-\rho)S + \rho
\mathbb E[\nabla^2\ell]`, :math:`m \leftarrow m - \rho S^{-1}\mathbb E[\nabla\ell]`.

Table 1 rows implemented here (the "delta method" evaluates the expectations at the mean,
:math:`\mathbb E_q[f(\theta)] \approx f(m)`, so no sampling happens):

* **SGD** (:func:`sgd_blr`): :math:`q = \mathcal N(m, I)` with the covariance held fixed; then
  :math:`\lambda = m = \mu` and the BLR is :math:`m \leftarrow m - \rho \nabla\ell(m)`. Heavy-ball
  momentum (optax's ``trace``) is a running sum of the BLR gradient.
* **RMSprop** (:func:`rmsprop_blr`): diagonal :math:`q = \mathcal N(m, \operatorname{diag}(S)^{-1})`,
  the natural parameter :math:`\lambda_2 = -S/2` gets the BLR step with :math:`\rho_2 = 1-\beta_2`
  and the Hessian replaced by the squared gradient, :math:`\lambda_2 \leftarrow (1-\rho_2)\lambda_2
  - \rho_2 \nabla\ell(m)^2/2`; the mean step uses the square root,
  :math:`m \leftarrow m - \alpha \nabla\ell(m)/\sqrt{S + \epsilon}`.
* **Adam** (:func:`adam_blr`): as RMSprop, plus a momentum (slow-moving average, :math:`\beta_1`)
  on the gradient, bias correction of both averages and :math:`\epsilon` outside the root:
  :math:`m \leftarrow m - \alpha \hat g_m / (\sqrt{\hat S} + \epsilon)`.

The states carry the natural parameter :math:`\lambda_2` (``nat2``) rather than optax's
"second moment": they are the same numbers up to the exact factor :math:`-1/2`, which is the
point of Table 1. Each reproduces the corresponding optax optimizer (``optax.sgd``,
``optax.rmsprop``, ``optax.adam`` with default options) given the same gradients.
"""

from typing import Any, Callable, NamedTuple, Optional

import jax
import jax.numpy as jnp

from numpyro_blr.deep.ivon import _check_beta, _check_lr, _check_positive, _lr_at, check_params


class BLROptimizer(NamedTuple):
    """``init(params) -> state``; ``update(grads, state) -> state`` (grads at the mean: delta
    method); ``step(key, state, loss_fn, *args) -> (state, loss)`` (``key`` unused)."""

    init: Callable
    update: Callable
    step: Callable


class SGDBLRState(NamedTuple):
    """``params``: the mean, which *is* the natural parameter of :math:`\\mathcal N(m, I)`;
    ``trace``: momentum accumulator (zeros without momentum); ``count``: int32."""

    params: Any
    trace: Any
    count: jax.Array


class GaussBLRState(NamedTuple):
    """``params``: the mean :math:`m`; ``nat2``: :math:`\\lambda_2 = -S/2` (diagonal precision
    :math:`S` built from squared gradients); ``momentum``: gradient EMA (Adam only); ``count``."""

    params: Any
    nat2: Any
    momentum: Any
    count: jax.Array


def _step_fn(update):
    def step(key, state, loss_fn, *args):
        del key  # delta method: the expectation is evaluated at the mean, nothing is sampled
        loss, g = jax.value_and_grad(loss_fn)(state.params, *args)
        return update(g, state), loss

    return step


def sgd_blr(lr, momentum: Optional[float] = None, nesterov: bool = False) -> BLROptimizer:
    """SGD as the BLR with a fixed-covariance Gaussian + delta method (reproduces ``optax.sgd``)."""
    lr = _check_lr(lr)
    if momentum is not None:
        momentum = _check_beta(momentum, "momentum")

    def init(params):
        check_params(params)
        params = jax.tree.map(jnp.asarray, params)
        return SGDBLRState(params, jax.tree.map(jnp.zeros_like, params), jnp.zeros((), jnp.int32))

    def update(grads, state):
        # BLR: lambda <- lambda - rho * grad_mu E_q[loss]; lambda = mu = m, grad_mu E_q[loss] ~ grad loss(m).
        if momentum is None:
            direction, trace = grads, state.trace
        else:
            trace = jax.tree.map(lambda g, t: g + momentum * t, grads, state.trace)
            direction = jax.tree.map(lambda g, t: g + momentum * t, grads, trace) if nesterov else trace
        rho = _lr_at(lr, state.count)
        params = jax.tree.map(lambda lam, d: lam - rho * d, state.params, direction)
        return SGDBLRState(params, trace, state.count + 1)

    return BLROptimizer(init, update, _step_fn(update))


def _gauss_blr(lr, beta1, beta2, eps, eps_in_sqrt, debias):
    lr = _check_lr(lr)

    def init(params):
        check_params(params)
        params = jax.tree.map(jnp.asarray, params)
        zeros = jax.tree.map(jnp.zeros_like, params)
        return GaussBLRState(params, zeros, zeros, jnp.zeros((), jnp.int32))

    def update(grads, state):
        t = state.count + 1
        rho2 = 1.0 - beta2
        # Natural-parameter BLR step on lambda2 = -S/2 with E_q[Hessian] ~ grad(m)**2 (delta method +
        # squared-gradient Hessian); a small rho2 (beta2 near 1) is the "slow-moving scale".
        nat2 = jax.tree.map(lambda l2, g: (1.0 - rho2) * l2 + rho2 * (-0.5 * g * g), state.nat2, grads)
        mom = jax.tree.map(lambda m, g: beta1 * m + (1.0 - beta1) * g, state.momentum, grads)

        def mean_step(m, gm, l2):
            dt = m.dtype
            prec = -2.0 * l2
            if debias:
                gm = gm / (1.0 - jnp.asarray(beta1, dt) ** t.astype(dt))
                prec = prec / (1.0 - jnp.asarray(beta2, dt) ** t.astype(dt))
            # square-root scaling of the precision: S^{-1/2} instead of S^{-1}
            scale = jax.lax.rsqrt(prec + eps) if eps_in_sqrt else 1.0 / (jnp.sqrt(prec) + eps)
            return m - _lr_at(lr, state.count) * (gm * scale)

        params = jax.tree.map(mean_step, state.params, mom, nat2)
        return GaussBLRState(params, nat2, mom, t)

    return BLROptimizer(init, update, _step_fn(update))


def adam_blr(lr, b1=0.9, b2=0.999, eps=1e-8) -> BLROptimizer:
    """Adam as a BLR update: diagonal Gaussian + delta method + squared-gradient Hessian +
    square-root scaling + slow-moving scale (reproduces ``optax.adam(lr, b1, b2, eps)``)."""
    return _gauss_blr(
        lr, _check_beta(b1, "b1"), _check_beta(b2, "b2"), _check_positive(eps, "eps", allow_zero=True),
        eps_in_sqrt=False, debias=True,
    )


def rmsprop_blr(lr, decay=0.9, eps=1e-8) -> BLROptimizer:
    """RMSprop as a BLR update (no momentum, no bias correction, eps inside the root;
    reproduces ``optax.rmsprop(lr, decay, eps)``)."""
    return _gauss_blr(
        lr, 0.0, _check_beta(decay, "decay"), _check_positive(eps, "eps", allow_zero=True),
        eps_in_sqrt=True, debias=False,
    )
