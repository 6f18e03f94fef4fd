r"""BayesBiNN: the Bayesian learning rule for binary neural networks.

Meng, Bachmann & Khan (2020), "Training Binary Neural Networks using the Bayesian Learning Rule",
ICML (reference code: ``team-approx-bayes/BayesBiNN``, ``optimizers/BayesBiNN.py``); Khan & Rue
(2023), "The Bayesian learning rule", JMLR, Table 1 row "BayesBiNN / STE" (Bernoulli posterior,
Gumbel-softmax / Concrete gradient estimate).

Each binary weight :math:`w \in \{-1, +1\}` gets a Bernoulli posterior
:math:`q(w) \propto e^{\lambda w}`, with natural parameter :math:`\lambda` and expectation
:math:`\mu = \mathbb E_q[w] = \tanh\lambda`. The BLR
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

Composition (:func:`numpyro_blr.bayesbinn` in :mod:`numpyro_blr.presets`): the family
:class:`~numpyro_blr.families.SignBernoulli` x :func:`numpyro_blr.estimators.relaxation.gumbel_softmax`
(the first two lines) x :func:`numpyro_blr.rules.blr.natural_update` (the last two) on every leaf.
``init(key, params, prior_lam=None)`` takes a key first: :math:`\lambda` starts at random signs.
"""

import math
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from numpyro_blr import core
from numpyro_blr.core import Algorithm, StepInfo, all_finite, check_params, select, value_at
from numpyro_blr.families.bernoulli import SignBernoulli
from numpyro_blr.rules.blr import natural_update
from numpyro_blr.tree import uniform_like


class BayesBiNNState(NamedTuple):
    r"""Natural parameters ``lam`` :math:`\lambda`, ``momentum`` :math:`\bar m` and prior ``prior_lam``
    :math:`\lambda_0` (pytrees like the weights; a zero prior is uniform, a previous posterior gives
    continual learning); ``count`` steps taken and ``skipped`` non-finite steps, int32."""

    lam: Any
    momentum: Any
    prior_lam: Any
    count: jax.Array
    skipped: jax.Array


class BayesBiNNRule(NamedTuple):
    r"""``lr`` :math:`\alpha` (a number or a schedule ``count -> lr``), momentum ``beta``, KL weight ``reweight``."""

    lr: Any
    beta: float = 0.0
    reweight: float = 1.0


def init_bayesbinn(key, params, prior_lam=None, lam_init=10.0, lam_std=0.0):
    r""":math:`\lambda = \pm(\lambda_{\rm init} + \sqrt{\lambda_{\rm std}}\,\epsilon)`, random signs (as the
    reference); ``params`` gives the shapes only."""
    check_params(params)
    leaves, treedef = jax.tree.flatten(jax.tree.map(jnp.asarray, params))
    keys = jax.random.split(key, 2 * len(leaves))

    def start(p, k_sign, k_noise):
        sign = jnp.where(jax.random.bernoulli(k_sign, 0.5, p.shape), 1.0, -1.0).astype(p.dtype)
        return sign * (lam_init + math.sqrt(lam_std) * jax.random.normal(k_noise, p.shape, p.dtype))

    lam = jax.tree.unflatten(treedef, [start(p, keys[2 * i], keys[2 * i + 1]) for i, p in enumerate(leaves)])
    prior = jax.tree.map(jnp.zeros_like, lam) if prior_lam is None else jax.tree.map(
        lambda a, b: jnp.asarray(b, a.dtype), lam, prior_lam
    )
    zero = jnp.zeros((), jnp.int32)
    return BayesBiNNState(lam, jax.tree.map(jnp.zeros_like, lam), prior, zero, zero)


def bayesbinn_update(rule: BayesBiNNRule, state: BayesBiNNState, estimate):
    """:func:`~numpyro_blr.rules.blr.natural_update` on every leaf; a non-finite step is skipped."""
    t = state.count + 1
    lr = value_at(rule.lr, state.count)
    out = jax.tree.map(
        lambda l, m, g, l0: natural_update(l, m, g, l0, lr, rule.beta, t, rule.reweight),
        state.lam, state.momentum, estimate.grad, state.prior_lam,
    )
    lam, mom = jax.tree.transpose(jax.tree.structure(state.lam), jax.tree.structure((0, 0)), out)
    ok = all_finite(lam, mom)
    new = BayesBiNNState(select(ok, lam, state.lam), select(ok, mom, state.momentum), state.prior_lam,
                         jnp.where(ok, t, state.count), state.skipped + jnp.where(ok, 0, 1).astype(jnp.int32))
    return new, StepInfo(estimate.loss, ~ok)


def mean(state):
    r""":math:`\operatorname{sign}(\mu)` weights (:math:`-1` where :math:`\mu \le 0`)."""
    return jax.tree.map(SignBernoulli.mode, state.lam)


def sample_binary(key, state):
    r"""One exact :math:`\pm1` draw of the weights, :math:`P(+1) = (1+\mu)/2`."""
    return jax.tree.map(SignBernoulli.from_uniform, state.lam, uniform_like(key, state.lam))


def sample(key, state, num_samples):
    """``num_samples`` draws of :func:`sample_binary` (keys ``jax.random.split(key, num_samples)``), stacked."""
    return jax.vmap(sample_binary, in_axes=(0, None))(jax.random.split(key, num_samples), state)


def predictive(key, state, apply_fn, x, num_samples):
    """Mean of ``apply_fn(w, x)`` over ``num_samples`` exact binary draws."""
    return core.predictive(key, state, apply_fn, x, num_samples, sample=sample)


def bayesbinn_algorithm(estimator, rule: BayesBiNNRule, lam_init=10.0, lam_std=0.0):
    """An :class:`~numpyro_blr.core.Algorithm`: ``step`` is ``estimator`` then :func:`bayesbinn_update`."""

    def init(key, params, prior_lam=None):
        return init_bayesbinn(key, params, prior_lam, lam_init, lam_std)

    def update(state, estimate):
        return bayesbinn_update(rule, state, estimate)

    def step(key, state, loss_fn, *batch):
        return update(state, estimator(key, state, loss_fn, *batch))

    return Algorithm(init=init, step=step, sample=sample, update=update)
