r"""The BLR for a diagonal Gaussian over a network's weights: one rule, configured per Table-1 row.

Every deep-learning row of Khan & Rue (2023, Table 1) learns
:math:`q(\theta) = \mathcal N(m, \operatorname{diag}(1/(N p)))` over a flat weight vector, with
:math:`N` the effective sample size (``ess``, the number of training examples) and :math:`p` the
per-example ``precision``; its loss is the **average** per-example loss :math:`\bar\ell` of a
mini-batch (what SGD or Adam would be given) and its prior a Gaussian of precision
:math:`N\delta` (``weight_decay`` :math:`\delta`). Given an :class:`~numpyro_blr.estimators.Estimate`
of :math:`\hat g \approx \mathbb E_q[\nabla\bar\ell]` and :math:`\hat h \approx \mathbb E_q[\nabla^2\bar\ell]`,
one step is

.. math::
    p &\leftarrow k\big((1-\rho_2)\, p + \rho_2 (\hat h + \delta)\big)
        \qquad (\rho_2 = 1 - \beta_2, \text{ the precision step of } :mod:`numpyro_blr.rules.blr`), \\
    \bar g &\leftarrow \beta_1 \bar g + (1-\beta_1)\, (\hat g\ [+\ \delta m]), \\
    m &\leftarrow m - \alpha\, c\, \operatorname{clip}\Big(\frac{\bar g/(1-\beta_1^t)\ [+\ \delta m]}{p}, \pm r\Big),

where :math:`k` is the positivity rule (``"improved"``: :math:`p_{\rm new} \ge p/2` for any
:math:`\hat h`; ``"plain"``: a convex combination, for estimates that are never negative), the
weight decay enters either the momentum or the step (``decay_in_momentum``), and
``sqrt_precision`` replaces the division by :math:`p` with :math:`\sqrt{p} + \epsilon` (Adam, RMSprop:
Table 1's square-root scaling). :math:`N` only sets the sampling scale, so it lives in the
estimator (:mod:`numpyro_blr.estimators.weights`), not here.

==========================  =========================  ===========  ============================
row                         :math:`\hat h`             positivity   mean step
==========================  =========================  ===========  ============================
IVON (Shen et al. 2024)     Price, sampled             improved     :math:`c = p_0`, clipped
VOGN / OGN (Khan 2018)      per-example GN             plain        :math:`(\bar g + \delta m)/p`
bSAM (Moellenhoff 2023)     :math:`\sqrt p|g| + \gamma`  plain        decay in momentum, no debias
Adam / RMSprop              :math:`g^2` at the mean    plain        :math:`\sqrt p + \epsilon`
SGD                         none (:math:`p = 1`)       --           heavy ball
==========================  =========================  ===========  ============================

A step whose estimate is not finite is skipped: the state is kept and ``skipped`` counts it (on CPU also a step
whose result overflows; on an accelerator an entry that would overflow keeps its old values:
:func:`~numpyro_blr.core.skip_decision`).

**A Gaussian prior carried by the state (continual learning).** With a :class:`DiagonalPrior`
:math:`\mathcal N(m_0, \operatorname{diag}(1/(N\delta_0)))` in ``state.prior`` (per-example precision
:math:`\delta_0`, a vector), the weight decay is replaced by it: :math:`\hat h + \delta_0` in the precision step and
:math:`\delta_0\odot(m - m_0)` for :math:`\delta m`. The posterior of task :math:`t`,
:math:`\mathcal N(m_t, \operatorname{diag}(1/(N_t p_t)))`, as the prior of task :math:`t+1` (``ess`` :math:`N'`) is
:math:`m_0 = m_t`, :math:`\delta_0 = N_t p_t / N'` (:meth:`DiagonalState.as_prior`; the rows' ``prior=`` option,
``algorithm.init(params, prior=...)``). The prior's arrays are state, so a jitted step serves every task without
recompiling; a state without a prior (``prior=None``, the default) takes exactly the step above.
"""

from typing import Any, NamedTuple, Optional

import jax
import jax.numpy as jnp

from numpyro_blr.core import StepInfo, skip_decision, value_at
from numpyro_blr.rules.blr import diagonal_precision_update
from numpyro_blr.tree import FlatLayout, finite_check


class DiagonalPrior(NamedTuple):
    r"""A diagonal Gaussian prior :math:`\mathcal N(m_0, \operatorname{diag}(1/(N_0\,\delta_0)))` over the weights.

    ``mean``       :math:`m_0`: a flat vector (the state's layout, with or without its padding), a pytree like the
                   parameters, or a scalar;
    ``precision``  :math:`\delta_0`, the per-example precision (like ``DiagonalState.precision``): same forms,
                   every entry > 0;
    ``ess``        :math:`N_0`, the number of examples ``precision`` is per (:math:`N_0\delta_0` is the prior's
                   precision); None: the ``ess`` of the row it is given to.

    :meth:`DiagonalState.as_prior` makes one from a fitted state (the posterior of the previous task); the weight
    decay :math:`\delta` of a row is ``DiagonalPrior(0.0, delta)``. Inside a state (``state.prior``) both arrays are
    flat, in the state's dtype, and per example of that row's ``ess`` (``ess`` None).
    """

    mean: Any
    precision: Any
    ess: Optional[float] = None


class DiagonalState(NamedTuple):
    r"""State of a diagonal row: :math:`q = \mathcal N(m, \operatorname{diag}(1/(N p)))` over flat weights.

    ``mean``       :math:`m`, flat (``params`` gives it as the weights' pytree);
    ``precision``  :math:`p`, the per-example precision, flat (:math:`N p` is :math:`q`'s precision;
                   for IVON :math:`p = h + \delta`, for VOGN :math:`s + \delta`, for Adam the second
                   moment :math:`\nu = -2\lambda_2`);
    ``momentum``   :math:`\bar g`, flat;
    ``count``      steps taken (skipped steps are not counted), int32;
    ``skipped``    how many steps were skipped for a non-finite estimate, int32;
    ``layout``     the :class:`~numpyro_blr.tree.FlatLayout` of the weights (static). The flat vectors have
                   ``layout.length`` entries: the weights, then from ``tree.PAD_FROM`` weights on a padding to a
                   multiple of ``tree.PAD_MULTIPLE`` (mean and momentum 0 there, no gradient reaches it), so that
                   XLA's CPU backend splits each pass into whole parts per thread;
    ``prior``      None (the row's weight decay is the prior) or a :class:`DiagonalPrior` that replaces it
                   (flat arrays, per example of the row's ``ess``): the rows' ``prior=`` option.
    """

    mean: jax.Array
    precision: jax.Array
    momentum: jax.Array
    count: jax.Array
    skipped: jax.Array
    layout: FlatLayout
    prior: Optional[DiagonalPrior] = None

    def as_prior(self, ess=None):
        r"""This state's :math:`q = \mathcal N(m, \operatorname{diag}(1/(N p)))` as a :class:`DiagonalPrior`, for the
        next task (continual learning): mean :math:`m`, per-example precision :math:`p` at ``ess`` :math:`N` (the
        ``ess`` of the row that fitted it; None: the same as the next row's). Pass it as
        ``algorithm.init(params, prior=...)`` (or the rows' ``prior=``)."""
        if ess is not None:
            ess = _check_prior_ess(ess, "ess")
        return DiagonalPrior(self.mean, self.precision, ess)

    @property
    def params(self):
        """The mean as the weights' pytree (in the parameters' dtype: bfloat16 parameters keep a float32 state)."""
        return self.layout.to_params(self.mean)

    def tree(self, flat):
        """Any flat vector of the state (``precision``, ``momentum``) as the weights' pytree."""
        return self.layout.unravel(flat)


class DiagonalRule(NamedTuple):
    """The options of :func:`diagonal_update` (module docstring); every field is static."""

    lr: Any  # alpha: a float or a schedule count -> alpha
    beta1: float = 0.0  # momentum of the mean gradient
    beta2: Optional[float] = None  # precision averaging, rho_2 = 1 - beta2; None keeps p fixed (SGD)
    positivity: str = "plain"  # "improved" or "plain" (numpyro_blr.rules.blr)
    weight_decay: float = 0.0  # delta
    decay_in_momentum: bool = False  # bSAM: delta m enters the momentum, not the step
    debias: bool = True  # divide the momentum by 1 - beta1^t
    debias_precision: bool = False  # Adam: divide p by 1 - beta2^t in the step
    sqrt_precision: bool = False  # Adam / RMSprop: scale by 1/(sqrt(p) + eps)
    eps: float = 0.0
    eps_in_sqrt: bool = False  # RMSprop: 1/sqrt(p + eps)
    clip_radius: float = float("inf")
    lr_scale: float = 1.0  # IVON's rescale_lr: c = p_0
    heavy_ball: bool = False  # SGD: the momentum is optax's trace g + beta1 * trace (nesterov: see below)
    nesterov: bool = False


def init_diagonal(params, precision_init, state_dtype=None):
    """A fresh :class:`DiagonalState`: ``mean = params`` (flattened), ``precision = precision_init``, zero momentum.

    The state is kept in :func:`numpyro_blr.tree.state_dtype` (``state_dtype``; default float32 for bfloat16 or
    float16 parameters, the parameters' dtype otherwise): the loss then sees the weights in the parameters' dtype
    and its gradients may be low precision, while the mean, precision and momentum are updated in float32."""
    from numpyro_blr.core import check_params
    from numpyro_blr.tree import state_dtype as _state_dtype

    check_params(params)
    layout = FlatLayout.of(params, padded=True)  # whole parts for every CPU thread (FlatLayout)
    mean = layout.ravel(jax.tree.map(jnp.asarray, params)).astype(_state_dtype(layout.dtype, state_dtype))
    zero = jnp.zeros((), jnp.int32)
    return DiagonalState(mean, jnp.full_like(mean, precision_init), jnp.zeros_like(mean), zero, zero, layout)


def _check_prior_ess(ess, name):
    from numpyro_blr.core import check_positive

    return check_positive(ess, name)


def _is_concrete(x):
    return not isinstance(x, jax.core.Tracer)


def _flat_prior_array(x, layout, dtype, name, fill):
    """``x`` (a scalar, a flat vector of ``layout.length`` or ``layout.size`` entries or a pytree like the parameters)
    as a flat vector of the state's layout (a padded layout's padding ``fill``)."""
    size, length = layout.size, layout.length
    leaves, treedef = jax.tree.flatten(x)
    if jax.tree_util.treedef_is_leaf(treedef):  # one array (or a number): a scalar, the flat vector or the one leaf
        arr = jnp.asarray(leaves[0]) if leaves else None
        if arr is not None and arr.ndim == 0:
            return jnp.full((length,), arr, dtype)
        if arr is not None and arr.shape == (length,):
            return arr.astype(dtype)
        if arr is not None and treedef == layout.treedef and (arr.shape,) == layout.shapes:  # the one leaf
            return layout.ravel(x, fill, dtype)
        if arr is not None and arr.shape == (size,):  # the weights' flat vector without a padded layout's padding
            return layout.ravel(layout.unravel(arr), fill, dtype)
        sizes = f"{size}" if size == length else f"{length} (as DiagonalState.as_prior gives) or {size}"
        raise ValueError(
            f"{name} has shape {None if arr is None else arr.shape}: it must be a scalar, a flat vector of {sizes} "
            "entries (the parameters' layout) or a pytree like the parameters."
        )
    if treedef != layout.treedef:
        raise ValueError(f"{name} has the structure {treedef}, but the parameters have {layout.treedef}.")
    shapes = tuple(tuple(jnp.shape(v)) for v in leaves)
    if shapes != layout.shapes:
        raise ValueError(f"{name} has leaves of shapes {shapes}, but the parameters have {layout.shapes}.")
    return layout.ravel(x, fill, dtype)


def resolve_prior(prior, layout, dtype, ess):
    """``prior`` (a :class:`DiagonalPrior`, or a :class:`DiagonalState` for its posterior at the row's ``ess``) as the
    :class:`DiagonalPrior` a state carries: flat arrays in ``dtype``, the precision per example of ``ess`` (the
    row's). Raises ``ValueError`` naming the argument for a mismatch with the parameters' layout or a precision
    that is not positive and finite."""
    if isinstance(prior, DiagonalState):
        if prior.layout._replace(pad=0) != layout._replace(pad=0):  # a padding of its own is read off (as_prior)
            raise ValueError(
                f"prior: the state given as the prior has the layout {prior.layout.shapes}, but the parameters have "
                f"{layout.shapes}."
            )
        prior = prior.as_prior()
    if not isinstance(prior, DiagonalPrior):
        raise ValueError(
            "prior must be a DiagonalPrior (state.as_prior(ess=...) for a fitted state's posterior) or a "
            f"DiagonalState, got {type(prior).__name__}."
        )
    mean = _flat_prior_array(prior.mean, layout, dtype, "prior.mean", 0.0)
    precision = _flat_prior_array(prior.precision, layout, dtype, "prior.precision", 1.0)
    if prior.ess is not None:
        if ess is None:
            raise ValueError("prior.ess is given but the row has no ess (a point estimate): leave prior.ess as None.")
        prior_ess = _check_prior_ess(prior.ess, "prior.ess")
        if prior_ess != ess:
            precision = precision * jnp.asarray(prior_ess / ess, dtype)
    if _is_concrete(mean) and not bool(jnp.all(jnp.isfinite(mean))):
        raise ValueError("prior.mean must be finite.")
    if _is_concrete(precision) and not bool(jnp.all(jnp.isfinite(precision) & (precision > 0))):
        raise ValueError(
            f"prior.precision must be positive and finite everywhere (smallest entry {float(jnp.min(precision))!r})."
        )
    return DiagonalPrior(mean, precision)


def weight_decay_prior(mean, weight_decay):
    r"""The weight decay :math:`\delta` as the prior a state carries: mean 0, per-example precision :math:`\delta`."""
    return DiagonalPrior(jnp.zeros_like(mean), jnp.full_like(mean, weight_decay))


def with_prior(state, prior, ess, weight_decay=0.0):
    """``state`` carrying ``prior``: True for the weight-decay prior (the precision is kept), else
    :func:`resolve_prior`'s, with the precision started at the prior's (the posterior starts as the prior)."""
    if prior is True:
        return state._replace(prior=weight_decay_prior(state.mean, weight_decay))
    resolved = resolve_prior(prior, state.layout, state.mean.dtype, ess)
    return state._replace(precision=resolved.precision, prior=resolved)


def diagonal_update(rule: DiagonalRule, state: DiagonalState, grad, hessian=None, loss=jnp.nan, check=None):
    """One step of the rule from flat :math:`\\hat g` and :math:`\\hat h` (``hessian``, None when
    ``rule.beta2`` is None); returns ``(state, StepInfo(loss, skipped))``.

    A non-finite estimate skips the step: the state is kept and ``skipped`` counts it
    (:func:`~numpyro_blr.core.skip_decision`; ``check`` is :attr:`~numpyro_blr.estimators.Estimate.check`). On CPU an
    overflowing result skips it too; on an accelerator the decision is made before the update, so that the update is
    one fused pass that writes each state vector once, and an entry that would overflow from a finite estimate keeps
    its old mean, precision and momentum (the other entries step)."""
    m, p, mom = state.mean, state.precision, state.momentum
    dt = m.dtype
    t = state.count + 1
    alpha = value_at(rule.lr, state.count)
    prior = state.prior
    if prior is None:  # the weight decay: a scalar delta, N(0, 1/(N delta)); nothing when delta = 0
        delta = rule.weight_decay
        h_decay = delta if delta else None
        g_decay = delta * m if delta else None
    else:  # the state's prior N(m_0, 1/(N delta_0)) replaces it
        h_decay = prior.precision
        g_decay = prior.precision * (m - prior.mean)
    if rule.beta2 is not None:
        h = hessian if h_decay is None else hessian + h_decay
        p_new = diagonal_precision_update(p, h, 1.0 - rule.beta2, rule.positivity)
    else:
        p_new = p
    g = grad + g_decay if (rule.decay_in_momentum and g_decay is not None) else grad
    if rule.heavy_ball:  # optax.trace: g + beta1 * trace; nesterov steps along g + beta1 * new trace
        mom_new = g + rule.beta1 * mom if rule.beta1 else g
        direction = g + rule.beta1 * mom_new if rule.nesterov else mom_new
    else:
        mom_new = rule.beta1 * mom + (1.0 - rule.beta1) * g if rule.beta1 else g
        direction = mom_new
        if rule.debias and rule.beta1:
            direction = direction / (1.0 - jnp.asarray(rule.beta1, dt) ** t.astype(dt))
    if g_decay is not None and not rule.decay_in_momentum:
        direction = direction + g_decay
    if rule.sqrt_precision:
        q = p_new / (1.0 - jnp.asarray(rule.beta2, dt) ** t.astype(dt)) if rule.debias_precision else p_new
        step = direction * jax.lax.rsqrt(q + rule.eps) if rule.eps_in_sqrt else direction / (jnp.sqrt(q) + rule.eps)
    elif rule.beta2 is None:
        step = direction
    else:
        step = direction / p_new
    if rule.clip_radius != float("inf"):
        step = jnp.clip(step, -rule.clip_radius, rule.clip_radius)
    # x - x is 0 for finite x and NaN for +-inf/NaN: added to the new mean (in the fusion that computes it from
    # p_new and mom_new anyway), it makes the mean non-finite iff any of the three is, so that one elementwise test
    # guards all three vectors
    m_new = (m - alpha * rule.lr_scale * step + ((p_new - p_new) + (mom_new - mom_new))).astype(dt)
    ok, step_entry = skip_decision(check, (grad, hessian), m_new)
    new = DiagonalState(
        jnp.where(step_entry, m_new, m),
        jnp.where(step_entry, p_new, p),
        jnp.where(step_entry, mom_new, mom),
        jnp.where(ok, t, state.count),
        state.skipped + jnp.where(ok, 0, 1).astype(jnp.int32),
        state.layout,
        prior,
    )
    return new, StepInfo(loss, ~ok)


def diagonal_algorithm(estimator, rule: DiagonalRule, precision_init, ess=None, axis_name=None, noise_rng="jax",
                       state_dtype=None, prior=None):
    r"""A diagonal row as an :class:`~numpyro_blr.core.Algorithm`: ``step`` = ``estimator`` then
    :func:`diagonal_update`.

    ``estimator(key, state, loss_fn, *batch) -> Estimate`` (:mod:`numpyro_blr.estimators.weights`);
    ``precision_init`` the initial per-example precision :math:`p_0`; ``ess`` :math:`N` for ``sample``
    (None: :math:`q` is a point mass at the mean, ``sample`` returns the mean). With ``axis_name``
    (inside ``shard_map``/``pmap``), each device folds its index into the key and the estimate is
    ``lax.pmean``-ed over that axis: one reduction per step. ``state_dtype``: :func:`init_diagonal`.

    ``prior`` (None, True, a :class:`DiagonalPrior` or a :class:`DiagonalState`): the prior ``init`` puts in the
    state (module docstring); ``init(params, prior=...)`` gives another one (the next task's) to the same algorithm,
    so a jitted ``step`` is reused. True is the weight decay as a state-carried prior (mean 0, per-example
    precision :math:`\delta`, the precision started at ``precision_init``); a given prior also starts the
    precision at the prior's, and the mean at ``params``.
    """
    from jax import lax

    from numpyro_blr.tree import standard_normal

    def init(params, prior=None):
        state = init_diagonal(params, precision_init, state_dtype)
        prior = prior if prior is not None else parts.prior
        return state if prior is None else with_prior(state, prior, ess, rule.weight_decay)

    def update(state, estimate):
        return diagonal_update(rule, state, estimate.grad, estimate.hessian, estimate.loss, estimate.check)

    def step(key, state, loss_fn, *batch):
        if axis_name is not None and key is not None:
            key = jax.random.fold_in(key, lax.axis_index(axis_name))
        est = estimator(key, state, loss_fn, *batch)
        if axis_name is not None:
            est = lax.pmean(est, axis_name)
        return update(state, est)

    def sample(key, state, n):
        """``n`` draws of the weights (pytree, leading axis ``n``); draw ``s`` uses ``jax.random.split(key, n)[s]``."""
        m = state.mean
        if ess is None:
            return state.layout.to_params(jnp.broadcast_to(m, (n,) + m.shape))
        scale = jax.lax.rsqrt(ess * state.precision).astype(m.dtype)
        keys = jax.random.split(key, n)
        eps = jax.vmap(lambda k: standard_normal(k, m.shape[0], m.dtype, noise_rng))(keys)
        return state.layout.to_params(m + eps * scale)

    from numpyro_blr.core import Algorithm

    parts = DiagonalParts(estimator, rule, precision_init, ess, noise_rng, axis_name, state_dtype, prior)
    return Algorithm(init=init, step=step, sample=sample, update=update, parts=parts)


class DiagonalParts(NamedTuple):
    """What a diagonal row is made of (``Algorithm.parts``): its estimator, its rule and the family's options."""

    estimator: Any
    rule: DiagonalRule
    precision_init: float
    ess: Optional[float]
    noise_rng: str
    axis_name: Optional[str] = None  # the mapped axis (shard_map/pmap) over which each device draws its own sample
    state_dtype: Any = None  # the state's dtype (None: float32 for bfloat16/float16 parameters, else theirs)
    prior: Any = None  # what init puts in the state: None, True (the weight decay), a DiagonalPrior or DiagonalState


class TransformState(NamedTuple):
    """State of :func:`as_optax`'s transformation: a :class:`DiagonalState` without the mean (optax keeps
    the parameters) and with the key of the current weight draw (:func:`perturbed`) and the prior
    (``DiagonalState.prior``)."""

    precision: jax.Array
    momentum: jax.Array
    count: jax.Array
    skipped: jax.Array
    key: jax.Array
    layout: FlatLayout
    prior: Optional[DiagonalPrior] = None

    def as_prior(self, params, ess=None):
        """The posterior (mean ``params``, this state's precision) as a :class:`DiagonalPrior` for the next task:
        ``tx.init(params, prior=opt_state.as_prior(params, ess=n_train))``; see :meth:`DiagonalState.as_prior`."""
        mean = self.layout.ravel(params).astype(self.precision.dtype)
        if ess is not None:
            ess = _check_prior_ess(ess, "ess")
        return DiagonalPrior(mean, self.precision, ess)


def _noise_key(parts, state):
    key = state.key
    if parts.axis_name is not None:  # inside shard_map/pmap: each device its own draw (as step does)
        key = jax.random.fold_in(key, jax.lax.axis_index(parts.axis_name))
    return key


def _noise(parts, state):
    """The flat offset :math:`\\sigma\\epsilon` of the current draw (None for the delta-method rows): an expression the
    update reads (on accelerators the normals are recomputed there, :class:`~numpyro_blr.tree.NoiseSlices`)."""
    from numpyro_blr.tree import NoiseSlices

    if parts.ess is None or not parts.estimator.sampled:
        return None
    p = state.precision
    eps = NoiseSlices(_noise_key(parts, state), p.shape[0], p.dtype, parts.noise_rng).all()
    return eps * jax.lax.rsqrt(parts.ess * p).astype(p.dtype)


def perturbed(algorithm, params, opt_state):
    r"""The weights at which to evaluate the gradient for :func:`as_optax`'s next ``update``:
    ``params`` plus this step's draw :math:`\sigma\epsilon` (``params`` itself for the delta-method rows).
    A row whose parts give their own view (the Lie-group rows, :mod:`numpyro_blr.rules.liegroup`) draws its own.
    Each leaf is formed from its slice of the noise and of the precision and written once."""
    from numpyro_blr.tree import NoiseSlices, leaf_slices

    if hasattr(algorithm.parts, "perturbed"):
        return algorithm.parts.perturbed(params, opt_state)
    parts = algorithm.parts
    if parts.ess is None or not parts.estimator.sampled:
        return params
    layout, p = opt_state.layout, opt_state.precision
    eps = NoiseSlices(_noise_key(parts, opt_state), p.shape[0], p.dtype, parts.noise_rng)
    out = []
    for leaf, (start, size) in zip(layout.treedef.flatten_up_to(params), leaf_slices(layout)):
        offset = eps(start, size) * jax.lax.rsqrt(parts.ess * p[start:start + size]).astype(p.dtype)
        out.append((jnp.reshape(jnp.asarray(leaf), (-1,)).astype(p.dtype) + offset).reshape(jnp.shape(leaf)))
    return layout.to_params_leaves(out)


def as_optax(algorithm, seed=0):
    r"""A diagonal row as an ``optax.GradientTransformationExtraArgs``, for Flax / Equinox training loops.

    The transformation keeps the row's precision and momentum (the parameters are the mean, held by
    the caller) and the key of the current weight draw. A training step is::

        tx = nb.as_optax(nb.ivon(lr, ess=n_train))
        opt_state = tx.init(params)
        theta = nb.perturbed(algo, params, opt_state)     # params + sigma * eps (params for Adam, SGD, OGN)
        grads = jax.grad(loss_fn)(theta, batch)
        updates, opt_state = tx.update(grads, opt_state, params)
        params = optax.apply_updates(params, updates)

    ``update`` forms the row's estimate from ``grads`` and the same draw (the estimator's
    ``from_grads``), applies the row's rule (:func:`diagonal_update`) and draws the next key. The
    Gauss-Newton rows (VOGN, OGN) also take ``squared_grads=`` (the mean over the batch of the
    per-example squared gradients). bSAM needs two gradient evaluations per step and has no such
    view: use its ``step``. Skipped (non-finite) steps return zero updates and count in the state.

    With the rows' ``prior=`` option the state carries the prior; ``tx.init(params, prior=...)`` starts the next
    task (continual learning) with the same ``update``: ``tx.init(params, prior=opt_state.as_prior(params))``.

    The Lie-group rows (``nb.lie_additive``, ``nb.lie_affine``, ``nb.lie_multiplicative``) have the same view,
    given by their parts (:func:`numpyro_blr.rules.liegroup.lie_as_optax`): ``perturbed`` draws
    :math:`\theta = g\cdot\xi` and ``update`` takes the gradient there.
    """
    import optax

    parts = algorithm.parts
    if hasattr(parts, "as_optax"):
        return parts.as_optax(seed)
    if not isinstance(parts, DiagonalParts) or not hasattr(parts.estimator, "from_grads"):
        raise ValueError(
            "as_optax takes a diagonal row whose estimate can be formed from one gradient (nb.ivon, nb.vogn, "
            "nb.ogn, nb.adam_blr, nb.rmsprop_blr, nb.sgd_blr) or a Lie-group row (nb.lie_additive, nb.lie_affine, "
            "nb.lie_multiplicative); bSAM needs two gradient evaluations per step: "
            "use its step function."
        )

    def init(params, prior=None):
        state = init_diagonal(params, parts.precision_init, parts.state_dtype)
        prior = prior if prior is not None else parts.prior
        if prior is not None:
            state = with_prior(state, prior, parts.ess, parts.rule.weight_decay)
        key = jax.random.key(seed)
        return TransformState(state.precision, state.momentum, state.count, state.skipped, key, state.layout,
                              state.prior)

    def update(grads, opt_state, params=None, **extra):
        if params is None:
            raise ValueError("the BLR's optax view needs params (the mean): call tx.update(grads, opt_state, params).")
        layout = opt_state.layout
        mean = layout.ravel(params).astype(opt_state.precision.dtype)
        state = DiagonalState(mean, opt_state.precision, opt_state.momentum, opt_state.count, opt_state.skipped, layout,
                              opt_state.prior)
        estimate = parts.estimator.from_grads(state, layout.ravel(grads), _noise(parts, opt_state), **extra)
        if estimate.check is None:  # the estimate is formed from these and finite noise: one read of each decides
            estimate = estimate._replace(check=finite_check((grads, extra)))
        if parts.axis_name is not None:  # one reduction: the devices' gradient and curvature statistics averaged
            estimate = jax.lax.pmean(estimate, parts.axis_name)
        new, _ = diagonal_update(parts.rule, state, estimate.grad, estimate.hessian, estimate.loss, estimate.check)
        key, _ = jax.random.split(opt_state.key)
        new_opt_state = TransformState(new.precision, new.momentum, new.count, new.skipped, key, layout, new.prior)
        return layout.to_params(new.mean - mean), new_opt_state

    return optax.GradientTransformationExtraArgs(init, update)


def check_prior_option(prior):
    """The rows' ``prior=`` option checked: None (or False), True, a :class:`DiagonalPrior` or a :class:`DiagonalState`
    (its layout and values are checked against the parameters by ``init``)."""
    if prior is None or prior is False:
        return None
    if prior is True or isinstance(prior, (DiagonalPrior, DiagonalState)):
        return prior
    raise ValueError(
        "prior must be None (the weight decay), True (the weight decay carried by the state, to be replaced by the "
        "next task's prior through init(params, prior=...)), a DiagonalPrior or a DiagonalState (a fitted state's "
        f"posterior: state.as_prior(ess=n_train)), got {type(prior).__name__}."
    )
