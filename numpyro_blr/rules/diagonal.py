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

A step whose estimate or result is not finite is skipped: the state is kept and ``skipped`` counts it.

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

from numpyro_blr.core import StepInfo, value_at
from numpyro_blr.rules.blr import diagonal_precision_update
from numpyro_blr.tree import FlatLayout, normal_like


class DiagonalPrior(NamedTuple):
    r"""A diagonal Gaussian prior :math:`\mathcal N(m_0, \operatorname{diag}(1/(N_0\,\delta_0)))` over the weights.

    ``mean``       :math:`m_0`: a pytree like the parameters (as :meth:`DiagonalState.as_prior` gives), a flat
                   vector over all weights (in ``jax.tree.leaves`` order), or a scalar;
    ``precision``  :math:`\delta_0`, the per-example precision (like ``DiagonalState.precision``): same forms,
                   every entry > 0;
    ``ess``        :math:`N_0`, the number of examples ``precision`` is per (:math:`N_0\delta_0` is the prior's
                   precision); None: the ``ess`` of the row it is given to.

    :meth:`DiagonalState.as_prior` makes one from a fitted state (the posterior of the previous task); the weight
    decay :math:`\delta` of a row is ``DiagonalPrior(0.0, delta)``. Inside a state (``state.prior``) both are pytrees
    like the parameters, in the state's dtype, and per example of that row's ``ess`` (``ess`` None).
    """

    mean: Any
    precision: Any
    ess: Optional[float] = None


class DiagonalState(NamedTuple):
    r"""State of a diagonal row: :math:`q = \mathcal N(m, \operatorname{diag}(1/(N p)))` over the weights.

    Every array is kept per leaf, a pytree like the parameters (in the state's dtype), as optax keeps its
    moments: a step is elementwise work on each leaf, with no concatenation of the gradient into one vector
    and no split of the weights back into leaves.

    ``mean``       :math:`m`, a pytree like the parameters (``params`` gives it in the parameters' dtype);
    ``precision``  :math:`p`, the per-example precision, a pytree (:math:`N p` is :math:`q`'s precision;
                   for IVON :math:`p = h + \delta`, for VOGN :math:`s + \delta`, for Adam the second
                   moment :math:`\nu = -2\lambda_2`);
    ``momentum``   :math:`\bar g`, a pytree;
    ``count``      steps taken (skipped steps are not counted), int32;
    ``skipped``    how many steps were skipped for a non-finite estimate or result, int32;
    ``layout``     the :class:`~numpyro_blr.tree.FlatLayout` of the weights (static: structure, shapes and the
                   parameters' dtype);
    ``prior``      None (the row's weight decay is the prior) or a :class:`DiagonalPrior` that replaces it
                   (pytrees like the parameters, per example of the row's ``ess``): the rows' ``prior=`` option.
    """

    mean: Any
    precision: Any
    momentum: Any
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
        return self.layout.cast(self.mean)

    def tree(self, x):
        """``x`` as the weights' pytree: a pytree like the parameters (the state's arrays are already per leaf) is
        returned as it is, a flat vector over all weights (``jax.tree.leaves`` order) is split into leaves."""
        return x if self.layout.is_tree(x) else self.layout.unravel(x)

    def flat(self, x):
        """A pytree like the parameters (``mean``, ``precision``, ...) as one flat vector, in its own dtype
        (``jax.tree.leaves`` order; for inspection and comparison, not used by the step)."""
        return flat_leaves(x)


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


def flat_leaves(tree):
    """The leaves of ``tree`` concatenated into one vector (``jax.tree.leaves`` order)."""
    leaves = [jnp.ravel(x) for x in jax.tree.leaves(tree)]
    return leaves[0] if len(leaves) == 1 else jnp.concatenate(leaves)


def init_diagonal(params, precision_init, state_dtype=None):
    """A fresh :class:`DiagonalState`: ``mean = params``, ``precision = precision_init``, zero momentum (per leaf).

    The state is kept in :func:`numpyro_blr.tree.state_dtype` (``state_dtype``; default float32 for bfloat16 or
    float16 parameters, the parameters' dtype otherwise): the loss then sees the weights in the parameters' dtype
    and its gradients may be low precision, while the mean, precision and momentum are updated in float32."""
    from numpyro_blr.core import check_params
    from numpyro_blr.tree import state_dtype as _state_dtype

    check_params(params)
    layout = FlatLayout.of(params)
    dt = _state_dtype(layout.dtype, state_dtype)
    mean = layout.treedef.unflatten([jnp.asarray(x).astype(dt) for x in layout.treedef.flatten_up_to(params)])
    zero = jnp.zeros((), jnp.int32)
    precision = jax.tree.map(lambda x: jnp.full_like(x, precision_init), mean)
    return DiagonalState(mean, precision, jax.tree.map(jnp.zeros_like, mean), zero, zero, layout)


def _check_prior_ess(ess, name):
    from numpyro_blr.core import check_positive

    return check_positive(ess, name)


def _is_concrete(x):
    return not isinstance(x, jax.core.Tracer)


def _tree_prior_array(x, layout, dtype, name):
    """``x`` (a scalar, a flat vector of ``layout.size`` entries or a pytree like the parameters) as a pytree like the
    parameters in ``dtype``."""
    size = layout.size
    leaves, treedef = jax.tree.flatten(x)
    if jax.tree_util.treedef_is_leaf(treedef):  # one array (or a number): a scalar, the flat vector or the one leaf
        arr = jnp.asarray(leaves[0]) if leaves else None
        if arr is not None and treedef == layout.treedef and (arr.shape,) == layout.shapes:
            return arr.astype(dtype)
        if arr is not None and arr.ndim == 0:
            return layout.treedef.unflatten([jnp.full(s, arr, dtype) for s in layout.shapes])
        if arr is not None and arr.shape == (size,):
            return layout.unravel(arr.astype(dtype))
        raise ValueError(
            f"{name} has shape {None if arr is None else arr.shape}: it must be a scalar, a flat vector of {size} "
            "entries (the parameters' layout, as DiagonalState.as_prior gives) or a pytree like the parameters."
        )
    if treedef != layout.treedef:
        raise ValueError(f"{name} has the structure {treedef}, but the parameters have {layout.treedef}.")
    shapes = tuple(tuple(jnp.shape(v)) for v in leaves)
    if shapes != layout.shapes:
        raise ValueError(f"{name} has leaves of shapes {shapes}, but the parameters have {layout.shapes}.")
    return treedef.unflatten([jnp.asarray(v).astype(dtype) for v in leaves])


def _all(pred, tree):
    return all(bool(jnp.all(pred(v))) for v in jax.tree.leaves(tree))


def _min(tree):
    return min(float(jnp.min(v)) for v in jax.tree.leaves(tree))


def resolve_prior(prior, layout, dtype, ess):
    """``prior`` (a :class:`DiagonalPrior`, or a :class:`DiagonalState` for its posterior at the row's ``ess``) as the
    :class:`DiagonalPrior` a state carries: pytrees like the parameters in ``dtype``, the precision per example of ``ess`` (the
    row's). Raises ``ValueError`` naming the argument for a mismatch with the parameters' layout or a precision
    that is not positive and finite."""
    if isinstance(prior, DiagonalState):
        if prior.layout != layout:
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
    mean = _tree_prior_array(prior.mean, layout, dtype, "prior.mean")
    precision = _tree_prior_array(prior.precision, layout, dtype, "prior.precision")
    if prior.ess is not None:
        if ess is None:
            raise ValueError("prior.ess is given but the row has no ess (a point estimate): leave prior.ess as None.")
        prior_ess = _check_prior_ess(prior.ess, "prior.ess")
        if prior_ess != ess:
            precision = jax.tree.map(lambda v: v * jnp.asarray(prior_ess / ess, dtype), precision)
    concrete = all(_is_concrete(v) for v in jax.tree.leaves((mean, precision)))
    if concrete and not _all(jnp.isfinite, mean):
        raise ValueError("prior.mean must be finite.")
    if concrete and not _all(lambda v: jnp.isfinite(v) & (v > 0), precision):
        raise ValueError(
            f"prior.precision must be positive and finite everywhere (smallest entry {_min(precision)!r})."
        )
    return DiagonalPrior(mean, precision)


def weight_decay_prior(mean, weight_decay):
    r"""The weight decay :math:`\delta` as the prior a state carries: mean 0, per-example precision :math:`\delta`."""
    return DiagonalPrior(jax.tree.map(jnp.zeros_like, mean), jax.tree.map(lambda x: jnp.full_like(x, weight_decay), mean))


def with_prior(state, prior, ess, weight_decay=0.0):
    """``state`` carrying ``prior``: True for the weight-decay prior (the precision is kept), else
    :func:`resolve_prior`'s, with the precision started at the prior's (the posterior starts as the prior)."""
    if prior is True:
        return state._replace(prior=weight_decay_prior(state.mean, weight_decay))
    resolved = resolve_prior(prior, state.layout, _dtype_of(state.mean), ess)
    return state._replace(precision=resolved.precision, prior=resolved)


def _dtype_of(tree):
    leaves = jax.tree.leaves(tree)
    return jnp.result_type(*leaves) if leaves else jnp.dtype(jnp.float32)


def diagonal_update(rule: DiagonalRule, state: DiagonalState, grad, hessian=None, loss=jnp.nan):
    r"""One step of the rule from :math:`\hat g` and :math:`\hat h` (``hessian``, None when ``rule.beta2`` is None),
    pytrees like the parameters (a flat vector over all weights is also accepted); returns
    ``(state, StepInfo(loss, skipped))``. The step is elementwise work on each leaf."""
    layout = state.layout
    treedef = layout.treedef
    m, p, mom = (treedef.flatten_up_to(x) for x in (state.mean, state.precision, state.momentum))
    dt = jnp.result_type(*m) if m else jnp.dtype(jnp.float32)
    grad = treedef.flatten_up_to(state.tree(grad))
    hessian = None if rule.beta2 is None else treedef.flatten_up_to(state.tree(hessian))
    t = state.count + 1
    alpha = value_at(rule.lr, state.count)
    prior = state.prior
    if prior is not None:
        prior_m, prior_p = treedef.flatten_up_to(prior.mean), treedef.flatten_up_to(prior.precision)
    debias = None
    if not rule.heavy_ball and rule.debias and rule.beta1:
        debias = 1.0 - jnp.asarray(rule.beta1, dt) ** t.astype(dt)
    debias_p = None
    if rule.sqrt_precision and rule.debias_precision:
        debias_p = 1.0 - jnp.asarray(rule.beta2, dt) ** t.astype(dt)
    scale = alpha * rule.lr_scale

    def leaf(i):
        mi, pi, momi = m[i], p[i], mom[i]
        g0 = grad[i].astype(dt)
        if prior is None:  # the weight decay: a scalar delta, N(0, 1/(N delta)); nothing when delta = 0
            delta = rule.weight_decay
            h_decay = delta if delta else None
            g_decay = delta * mi if delta else None
        else:  # the state's prior N(m_0, 1/(N delta_0)) replaces it
            h_decay = prior_p[i]
            g_decay = prior_p[i] * (mi - prior_m[i])
        if rule.beta2 is not None:
            hi = hessian[i].astype(dt)
            h = hi if h_decay is None else hi + h_decay
            p_new = diagonal_precision_update(pi, h, 1.0 - rule.beta2, rule.positivity)
        else:
            p_new = pi
        g = g0 + g_decay if (rule.decay_in_momentum and g_decay is not None) else g0
        if rule.heavy_ball:  # optax.trace: g + beta1 * trace; nesterov steps along g + beta1 * new trace
            mom_new = g + rule.beta1 * momi if rule.beta1 else g
            direction = g + rule.beta1 * mom_new if rule.nesterov else mom_new
        else:
            mom_new = rule.beta1 * momi + (1.0 - rule.beta1) * g if rule.beta1 else g
            direction = mom_new if debias is None else mom_new / debias
        if g_decay is not None and not rule.decay_in_momentum:
            direction = direction + g_decay
        if rule.sqrt_precision:
            q = p_new / debias_p if debias_p is not None else p_new
            step = direction * jax.lax.rsqrt(q + rule.eps) if rule.eps_in_sqrt else direction / (jnp.sqrt(q) + rule.eps)
        elif rule.beta2 is None:
            step = direction
        else:
            step = direction / p_new
        if rule.clip_radius != float("inf"):
            step = jnp.clip(step, -rule.clip_radius, rule.clip_radius)
        # x - x is 0 for finite x and NaN for +-inf/NaN: added to the new mean (in the fusion that computes it from
        # p_new and mom_new anyway), it makes the mean non-finite iff any of the three is, and leaves it unchanged
        # otherwise; the skip then needs one reduction per leaf (a non-finite grad or hessian makes mom_new or
        # p_new non-finite; m, p, mom are finite)
        m_new = (mi - scale * step + ((p_new - p_new) + (mom_new - mom_new))).astype(dt)
        return m_new, p_new.astype(dt), mom_new.astype(dt), jnp.sum(m_new - m_new)

    out = [leaf(i) for i in range(len(m))]
    ok = jnp.isfinite(sum((o[3] for o in out), jnp.zeros((), dt)))

    def pick(j, old):
        return treedef.unflatten([jnp.where(ok, o[j], x) for o, x in zip(out, old)])

    new = DiagonalState(
        pick(0, m),
        pick(1, p),
        pick(2, mom),
        jnp.where(ok, t, state.count),
        state.skipped + jnp.where(ok, 0, 1).astype(jnp.int32),
        layout,
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

    def init(params, prior=None):
        state = init_diagonal(params, precision_init, state_dtype)
        prior = prior if prior is not None else parts.prior
        return state if prior is None else with_prior(state, prior, ess, rule.weight_decay)

    def update(state, estimate):
        return diagonal_update(rule, state, estimate.grad, estimate.hessian, estimate.loss)

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
            return state.layout.cast(jax.tree.map(lambda x: jnp.broadcast_to(x, (n,) + x.shape), m))
        scale = jax.tree.map(lambda p, x: jax.lax.rsqrt(ess * p).astype(x.dtype), state.precision, m)
        keys = jax.random.split(key, n)
        eps = jax.vmap(lambda k: normal_like(k, m, rng=noise_rng))(keys)
        return state.layout.cast(jax.tree.map(lambda x, e, sc: x + e * sc, m, eps, scale))

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

    precision: Any
    momentum: Any
    count: jax.Array
    skipped: jax.Array
    key: jax.Array
    layout: FlatLayout
    prior: Optional[DiagonalPrior] = None

    def as_prior(self, params, ess=None):
        """The posterior (mean ``params``, this state's precision) as a :class:`DiagonalPrior` for the next task:
        ``tx.init(params, prior=opt_state.as_prior(params, ess=n_train))``; see :meth:`DiagonalState.as_prior`."""
        mean = _as_state_tree(self.layout, params, self.precision)
        if ess is not None:
            ess = _check_prior_ess(ess, "ess")
        return DiagonalPrior(mean, self.precision, ess)


def _as_state_tree(layout, params, like):
    """``params`` (a pytree like the parameters) with each leaf in the dtype of ``like``'s (the state's) leaf."""
    return layout.treedef.unflatten([jnp.asarray(x).astype(y.dtype) for x, y in
                                     zip(layout.treedef.flatten_up_to(params), layout.treedef.flatten_up_to(like))])


def _noise(parts, state):

    if parts.ess is None or not parts.estimator.sampled:
        return None
    key = state.key
    if parts.axis_name is not None:  # inside shard_map/pmap: each device its own draw (as step does)
        key = jax.random.fold_in(key, jax.lax.axis_index(parts.axis_name))
    eps = normal_like(key, state.precision, rng=parts.noise_rng)
    return jax.tree.map(lambda e, p: e * jax.lax.rsqrt(parts.ess * p).astype(p.dtype), eps, state.precision)


def perturbed(algorithm, params, opt_state):
    r"""The weights at which to evaluate the gradient for :func:`as_optax`'s next ``update``:
    ``params`` plus this step's draw :math:`\sigma\epsilon` (``params`` itself for the delta-method rows).
    A row whose parts give their own view (the Lie-group rows, :mod:`numpyro_blr.rules.liegroup`) draws its own."""
    if hasattr(algorithm.parts, "perturbed"):
        return algorithm.parts.perturbed(params, opt_state)
    noise = _noise(algorithm.parts, opt_state)
    if noise is None:
        return params
    layout = opt_state.layout
    return layout.treedef.unflatten([(jnp.asarray(x).astype(e.dtype) + e).astype(x.dtype) for x, e in
                                     zip(layout.treedef.flatten_up_to(params), layout.treedef.flatten_up_to(noise))])


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
        mean = _as_state_tree(layout, params, opt_state.precision)
        state = DiagonalState(mean, opt_state.precision, opt_state.momentum, opt_state.count, opt_state.skipped, layout,
                              opt_state.prior)
        estimate = parts.estimator.from_grads(state, grads, _noise(parts, opt_state), **extra)
        if parts.axis_name is not None:  # one reduction: the devices' gradient and curvature statistics averaged
            estimate = jax.lax.pmean(estimate, parts.axis_name)
        new, _ = diagonal_update(parts.rule, state, estimate.grad, estimate.hessian, estimate.loss)
        key, _ = jax.random.split(opt_state.key)
        new_opt_state = TransformState(new.precision, new.momentum, new.count, new.skipped, key, layout, new.prior)
        updates = [(a - b).astype(jnp.result_type(x)) for a, b, x in zip(
            layout.treedef.flatten_up_to(new.mean), layout.treedef.flatten_up_to(mean), layout.treedef.flatten_up_to(params))]
        return layout.treedef.unflatten(updates), new_opt_state

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
