r"""``BLR``: the Bayesian learning rule as an optimizer that NumPyro's ``SVI`` accepts.

``SVI(model, guide, nb.BLR(), Trace_ELBO())`` runs, for every Gaussian block of the guide
(see :mod:`numpyro_blr.layout`), the natural-gradient step of Khan & Rue (2023, eq. 11):

.. math::
    S &\leftarrow k\big((1-\rho) S + \rho \hat H\big), \\
    \bar g &\leftarrow \beta \bar g + (1-\beta) \hat g, \\
    m &\leftarrow m - \rho\, S^{-1} \bar g / (1-\beta^t),

where :math:`\hat g, \hat H` come from :mod:`numpyro_blr.estimators` and :math:`k` keeps the
precision positive definite (:mod:`numpyro_blr.rules.blr`: by default the plain step where the
precision grows and the improved-BLR step of Lin, Schmidt & Khan 2020 where it shrinks).
Robust defaults, for models nobody tuned the optimizer on:

* the step size :class:`adaptive_decay` stays at :math:`\rho_0` while successive steps agree
  (the fit is travelling), so curvature estimates taken far from the posterior (from NumPyro's
  random initialisation, on unstandardised data) are forgotten geometrically rather than
  polynomially; once the steps are Monte Carlo noise the Gaussian blocks step with
  :math:`\rho \propto t^{-1/2}` and the guide returned is the average of the iterates with weight
  :math:`\propto 1/t` (Polyak-Ruppert averaging), which removes the noise without slowing the
  fit where the fixed-point iteration contracts slowly (funnels, heavy-tailed scales);
* mean-field guides with the exact Hessian take their mean step with the dense precision across
  their blocks (``_joint_mean_step``), a Newton step rather than a damped Jacobi iteration on a
  correlated posterior; their family and fixed point are unchanged;
* a non-finite step is skipped and halves :math:`\rho`; what went wrong is reported at the end
  of the run (:mod:`numpyro_blr.report`).

Point masses (``AutoDelta``, ``AutoLaplaceApproximation``) carry their precision in the optimizer
state (delta method). Parameters outside any Gaussian go to a ``fallback`` optax optimizer or are
rejected by name.
"""

import functools
import math
import warnings
from typing import Any, Callable, NamedTuple, Optional, Union

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax import lax
from jax.scipy.linalg import solve_triangular
from numpyro.optim import _NumPyroOptim

from numpyro_blr.estimators import HESSIANS, at_mean, estimate
from numpyro_blr import expfam_blocks
from numpyro_blr.layout import DIAGONAL, EXPFAM, FULL, POINT, GuideLayoutError, read_layout
from numpyro_blr.guide_trace import (
    PLACEHOLDER_SUFFIX,
    as_optax,
    check_foreign_state,
    check_loss,
    guide_call_args,
    is_autoguide,
    passthrough_params,
    trace_layout,
)
from numpyro_blr.rules.blr import (
    diagonal_precision_update,
    full_precision_update,
    full_scale_tril_update,
    momentum_update,
    positivity_rule,
)


AUTODIFF_MAX_DIM = 256
BACKTRACK_TRIES = 8


def harmonic_decay(init_value=0.5, halving_steps=10):
    r"""The Robbins-Monro step size :math:`\rho_t = \rho_0 / (1 + t/\tau)` (``tau = halving_steps``).

    :math:`\rho_t` halves after ``halving_steps`` steps, and decays like :math:`\rho_0\tau/t`, so
    the natural parameters become a weighted average of the per-step estimates
    (Khan & Rue 2023, Sec. 3: the BLR with :math:`\rho_t \propto 1/t` averages the "new
    information"), which removes the Monte Carlo noise that a constant :math:`\rho` leaves.
    """
    init_value = _check_lr(init_value, "init_value")
    halving_steps = _check_lr(halving_steps, "halving_steps")

    def schedule(count):
        return init_value / (1.0 + count / halving_steps)

    return schedule


class adaptive_decay:  # noqa: N801 - used like a schedule function
    r"""The default step size: a Robbins-Monro decay on a clock that only counts noise-dominated steps,
    with iterate averaging (Polyak & Juditsky 1992).

    The clock :math:`c` advances at each step by
    :math:`\min(1, 2f)`, where :math:`f = \sum_j (-p_j)_+ / \sum_j |p_j|`, :math:`p_j = v_j v'_j` the
    products of the coordinates of the whitened step :math:`v` (:math:`L^\top\hat g` for the mean,
    :math:`\operatorname{diag}(L^\top \hat H L) - 1` for the precision) and of the previous one
    :math:`v'`: the size-weighted fraction of coordinates whose sign changed. This is Kesten's rule (Kesten 1958;
    multivariate: Delyon & Juditsky 1993): while the fit is still travelling, successive steps
    point the same way (:math:`f \approx 0`) and the clock stands still, so early estimates taken far
    from the posterior are forgotten geometrically; once the steps are Monte Carlo noise around the
    optimum, about half the signs change and the clock advances by about one per step.

    With ``averaging=True`` (the default) the Gaussian blocks step with
    :math:`\rho = \rho_0 / \sqrt{1 + c/\tau}` and the guide that :meth:`BLR.get_params` returns is the
    exponential average of these iterates with weight :math:`\gamma = \rho_0 / (1 + c/\tau)`
    (:meth:`__call__`), which decays like :math:`\rho_0\tau/t` and averages the Monte Carlo noise
    away; the slower :math:`t^{-1/2}` decay of the iterate's own step keeps it moving along directions
    where the fixed-point iteration contracts slowly (funnels, heavy-tailed scales), where a
    :math:`\rho_0\tau/t` step would cover a distance growing only like :math:`\log t` (Bach & Moulines
    2011: the :math:`t^{-1/2}` step with averaging is the choice robust to the conditioning).
    With ``averaging=False`` every block steps with :math:`\gamma` itself and no average is kept
    (the previous default). A step with a non-finite loss, gradient or update is skipped
    and halves the iterate's step :math:`\rho` (the clock jumps so that
    :math:`1 + c/\tau` is multiplied by :math:`2^{1/\kappa}`, :math:`\kappa` = ``power``).
    """

    adaptive = True

    def __init__(self, init_value=0.5, halving_steps=10, averaging=True):
        self.init_value = _check_lr(init_value, "init_value")
        self.halving_steps = _check_lr(halving_steps, "halving_steps")
        if not isinstance(averaging, (bool, np.bool_)):
            raise ValueError(f"averaging must be True or False, got {averaging!r}.")
        self.averaging = bool(averaging)
        # exponent of the iterate's step: t^-1/2 with averaging, t^-1 (the weight itself) without
        self.power = 0.5 if self.averaging else 1.0

    def __call__(self, clock):
        r""":math:`\gamma = \rho_0/(1 + c/\tau)`: the averaging weight (the step itself without averaging)."""
        return self.init_value / (1.0 + clock / self.halving_steps)

    def iterate(self, clock):
        r""":math:`\rho = \rho_0/(1 + c/\tau)^\kappa`: the step of the averaged (Gaussian) blocks."""
        if self.power == 1.0:
            return self(clock)
        return self.init_value * (1.0 + clock / self.halving_steps) ** -self.power

    def skipped(self, clock):
        r"""The clock after a skipped step: :math:`1 + c/\tau` times :math:`2^{1/\kappa}`, which halves
        :meth:`iterate` (:math:`2c + \tau` without averaging, :math:`4c + 3\tau` with it)."""
        factor = 2.0 ** (1.0 / self.power)
        return factor * clock + (factor - 1.0) * self.halving_steps

    def __repr__(self):
        extra = "" if self.averaging else ", averaging=False"
        return f"adaptive_decay({self.init_value}, {self.halving_steps}{extra})"


class FitTrace(NamedTuple):
    r"""What a run carries for :func:`numpyro_blr.fit_report` (fixed-shape arrays, updated every step).

    ``clock``          the adaptive step size's count of noise-dominated steps (:class:`adaptive_decay`);
    ``direction``      the previous step's whitened direction (flat), for the sign test;
    ``rho``            the step size of the last step;
    ``loss_avg``       exponential average (weight 0.1) of the finite losses;
    ``loss_var``       exponential average of their squared deviation from ``loss_avg``;
    ``loss_best``      the lowest ``loss_avg`` so far;
    ``loss_best_var``  ``loss_var`` at the step where ``loss_best`` was reached (the noise level a
                       rise is measured against; the variance at the end includes the rise itself);
    ``gradient_size``  per loc parameter, elementwise: exponential average (weight 0.2) of
                       :math:`\log|u|`, :math:`u` the whitened mean gradient :math:`L^\top\hat g` (for
                       a Gaussian posterior, the distance to the optimum in posterior sds);
    ``gradient_last``  the last :math:`u`;
    ``persistence``    exponential average (weight 0.05, from 1) of :math:`\operatorname{sign}(u_t u_{t-1})`:
                       near 1 while the mean travels one way, near 0 once :math:`u` is noise;
    ``halvings``       how many times the step size was halved after a non-finite step;
    ``damped``         how many mean steps backtracking shortened (:meth:`BLR._backtrack`);
    ``damped_recent``  exponential average (weight 0.05) of whether the mean step was shortened;
    ``damping``        the last step's factor :math:`\alpha` on the mean step (1: a full step).
    """

    clock: jax.Array
    direction: jax.Array
    rho: jax.Array
    loss_avg: jax.Array
    loss_var: jax.Array
    loss_best: jax.Array
    loss_best_var: jax.Array
    gradient_size: dict
    gradient_last: dict
    persistence: dict
    halvings: jax.Array
    damped: jax.Array
    damped_recent: jax.Array
    damping: jax.Array


class BLRState(NamedTuple):
    """Optimizer state: fixed-shape arrays only, so ``SVI.run`` can ``lax.scan`` and resume exactly.

    ``params``            unconstrained guide parameters, the iterate that the steps move (what
                          ``get_params`` returns, unless ``average`` holds them);
    ``momentum``          heavy-ball average of the mean gradient, per loc;
    ``point_precision``   joint precision of all point-mass locs (delta method), ``(0, 0)`` if none;
    ``mean_scale_tril``   for diagonal guides with the exact Hessian: Cholesky factor of the inverse
                          of the dense precision that preconditions their mean step, ``(0, 0)`` if none;
    ``fallback_state``    the fallback optax optimizer's state;
    ``nonfinite``         per parameter, whether a non-finite gradient or update was ever met;
    ``nonfinite_steps``   how many steps were skipped for that reason;
    ``trace``             :class:`FitTrace`, the evidence for the end-of-run report;
    ``average``           with :class:`adaptive_decay`'s averaging: per Gaussian block, the
                          exponential averages of the iterates' mean (under the loc's name) and of
                          their scale :math:`s` or Cholesky factor :math:`L` (under the scale's
                          name, constrained), which ``get_params`` returns; else empty.
    """

    params: dict
    momentum: dict
    point_precision: jax.Array
    mean_scale_tril: jax.Array
    fallback_state: Any
    nonfinite: dict
    nonfinite_steps: jax.Array
    trace: FitTrace
    average: dict


def _check_lr(lr, name="lr"):
    if callable(lr) and not isinstance(lr, type):
        try:
            first = float(lr(0))
        except Exception as err:  # noqa: BLE001 - any failure means it is not a schedule
            raise ValueError(f"{name} is callable but not a schedule step -> step size: calling it at 0 failed ({err}).") from err
        if not math.isfinite(first) or first <= 0:
            raise ValueError(f"{name} schedule must give positive finite step sizes, got {first} at step 0.")
        return lr
    if isinstance(lr, bool) or not isinstance(lr, (int, float, np.floating, np.integer)):
        raise ValueError(
            f"{name} must be a positive finite float or an optax schedule (a callable step -> step size), "
            f"got {lr!r} of type {type(lr).__name__}."
        )
    if not math.isfinite(lr) or lr <= 0:
        raise ValueError(f"{name} must be positive and finite, got {lr!r}.")
    return float(lr)


SCHEDULE_CHECK_STEPS = 1_000_000


def _check_step_size(lr):
    """The BLR's step size :math:`\rho`: in (0, 1] at every step. :math:`\rho = 1` replaces the natural
    parameters by the new estimate (a Newton step, exact Bayes on a conjugate model); :math:`\rho > 1`
    gives the old ones a negative weight and extrapolates past it, which the precision step cannot
    keep stable. A schedule is checked over its first ``SCHEDULE_CHECK_STEPS`` steps, before any step
    runs, so that it cannot turn negative, non-finite or above 1 in the middle of a run."""
    lr = _check_lr(lr)
    if not callable(lr):
        if lr > 1.0:
            raise ValueError(
                f"lr={lr!r} is outside (0, 1]: the BLR's step size weighs the new estimate against the old "
                "natural parameters, and lr > 1 gives the old ones a negative weight (unstable). Use lr <= 1 "
                "(lr=1 is a full Newton step), or leave lr unset for the adaptive default."
            )
        return lr
    steps = np.arange(SCHEDULE_CHECK_STEPS)
    try:
        values = np.asarray(jax.device_get(jax.jit(jax.vmap(lr))(jnp.asarray(steps))), dtype=float)
    except Exception:  # noqa: BLE001 - a schedule written for scalars only: check a geometric grid
        steps = np.unique(np.geomspace(1, SCHEDULE_CHECK_STEPS, 2000).astype(int) - 1)
        values = np.array([float(lr(int(t))) for t in steps])
    bad = ~np.isfinite(values) | (values <= 0) | (values > 1)
    if np.any(bad):
        first = int(np.argmax(bad))
        raise ValueError(
            f"the lr schedule gives {float(values[first])!r} at step {int(steps[first])}: the BLR's step size must stay "
            "in (0, 1] at every step (checked over the first "
            f"{SCHEDULE_CHECK_STEPS:,} steps). Clip the schedule, e.g. optax.schedules with an end value > 0, "
            "or leave lr unset for the adaptive default."
        )
    return lr


def _check_unit_interval(x, name):
    if isinstance(x, bool) or not isinstance(x, (int, float, np.floating, np.integer)) or not (0.0 <= x < 1.0):
        raise ValueError(f"{name} must be a float in [0, 1), got {x!r}.")
    return float(x)


def _finite_or_zero(x):
    """A control-variate term is optional: drop it (not the step) if it could not be computed."""
    return jnp.where(jnp.all(jnp.isfinite(x)), x, jnp.zeros_like(x))


class BLR(_NumPyroOptim):
    r"""The Bayesian learning rule for Gaussian guides, as a NumPyro optimizer.

    :param lr: step size :math:`\rho` (float > 0, an optax schedule ``step -> rho``, or an
        :class:`adaptive_decay`). Default: ``adaptive_decay(0.5, 10)``: on a clock :math:`c` that
        advances only while the steps are Monte Carlo noise, the Gaussian blocks step with
        :math:`0.5/\sqrt{1 + c/10}` and ``get_params`` returns the average of their iterates with
        weight :math:`0.5/(1 + c/10)`; exponential-family and point-mass blocks step with
        :math:`0.5/(1 + c/10)` (see :meth:`default_lr` for sampled Hessians on full-covariance
        guides). A float or an optax schedule is used as given, for every block, with no average.
    :param hessian: how :math:`\mathbb{E}_q[\nabla^2\ell]` is estimated: ``"reparam"`` (Price/Stein,
        from the gradient w.r.t. the scale, with a same-noise baseline: two gradient passes),
        ``"price"`` (the plain one-pass Price estimator), ``"autodiff"`` (exact Hessian at the sample;
        small models) or ``"none"`` (keep the covariance; gradient descent). Default: ``"autodiff"``
        when the Gaussian blocks hold at most 256 numbers or with ``delta=True``, ``"reparam"``
        otherwise; point masses always use ``"autodiff"`` (or ``"none"``).
    :param delta: delta method: evaluate gradient and Hessian at the mean instead of a sample.
    :param momentum: heavy-ball coefficient :math:`\beta \in [0, 1)` on the mean gradient.
    :param improved: how the precision step stays positive definite
        (:mod:`numpyro_blr.rules.blr`): ``"one-sided"`` (default: the plain step where the precision
        grows, the improved-BLR step where it shrinks: positive definite for any :math:`\hat H`
        and :math:`\rho`, and no over-shoot when the curvature is far above the initial
        precision), ``True`` (the improved BLR of Lin, Schmidt & Khan 2020 in both directions) or
        ``False`` (the plain BLR: exact for ``lr=1`` on quadratic losses, but a
        non-positive-definite update is then skipped as non-finite).
    :param init_precision: initial precision of point-mass locs (delta method), a float > 0.
    :param fallback: an ``optax.GradientTransformation`` (or a NumPyro optimizer such as
        ``numpyro.optim.Adam(1e-3)``) for parameters that are not part of a Gaussian (a model's
        ``numpyro.param``, a non-Gaussian guide's parameters, a module's weights; pytree-valued
        parameters included). Without it such parameters raise an error, except
        ``numpyro.contrib.module``'s ``"{name}$params"`` placeholders that the loss does not read,
        which are passed through unchanged.
    :param guide: optional; an autoguide or ``nb.ExpFamilyGuide`` (to read its prefix and scale
        constraints when they differ from NumPyro's defaults), or a hand-written guide function,
        which BLR traces to find which ``numpyro.param`` is the ``loc`` and which (through its
        constraint) the ``scale``/``scale_tril`` of each ``Normal``/``MultivariateNormal`` site
        (:mod:`numpyro_blr.guide_trace`).
    :param guide_args, guide_kwargs: the arguments to trace a hand-written guide with (those given
        to ``svi.run``); not needed when the guide takes none.
    :param prefix: the autoguide prefix (default ``"auto"``, or the guide's).
    :param backtrack: damp the mean step by backtracking (default ``True``): when the step raises
        this step's sample of the loss (common random numbers, control variate included), it is
        shortened by factors of 4, down to no mean step (:meth:`_backtrack`). Where the local
        quadratic model holds the full step is taken, so the fixed point and the speed near it are
        unchanged; far from the optimum (saturated logits, curvature far below the true one) it
        stops the mean from overshooting. Costs one loss evaluation per step (more only while
        damping). The run's report counts the shortened steps.
    :param seed: seed of the draws the optimizer makes itself (the score-function estimator of
        large discrete ``ExpFamilyGuide`` sites); step ``t`` uses ``fold_in(PRNGKey(seed), t)``.

    References: Khan & Rue (2023), *The Bayesian learning rule*, JMLR; Lin, Schmidt & Khan (2020),
    *Handling the positive-definite constraint in the Bayesian learning rule*, ICML.
    """

    def __init__(
        self,
        lr: Union[float, Callable, None] = None,
        *,
        hessian: Optional[str] = None,
        delta: bool = False,
        momentum: float = 0.0,
        improved: Union[bool, str] = "one-sided",
        init_precision: float = 1.0,
        fallback=None,
        guide=None,
        guide_args=None,
        guide_kwargs=None,
        prefix: Optional[str] = None,
        seed: int = 0,
        backtrack: bool = True,
    ):
        self.lr = None if lr is None else _check_step_size(lr)
        self.backtrack = bool(backtrack)
        if hessian is not None and hessian not in HESSIANS:
            raise ValueError(f"hessian must be one of {HESSIANS} or None, got {hessian!r}.")
        if delta and hessian in ("reparam", "price"):
            raise ValueError(
                f"hessian={hessian!r} reads the curvature off a sample of the guide; the delta method "
                "(delta=True) evaluates at the mean, so use hessian='autodiff' or 'none'."
            )
        self.hessian = hessian
        self.point_hessian = "none" if hessian == "none" else "autodiff"
        self.delta = bool(delta)
        self.momentum = _check_unit_interval(momentum, "momentum")
        self.improved = positivity_rule(improved)
        self.init_precision = _check_lr(init_precision, "init_precision")
        self.fallback = as_optax(fallback)
        self.guide = guide
        # a hand-written guide is read by tracing it (numpyro_blr.guide_trace), with these arguments
        self.traced = guide is not None and not is_autoguide(guide)
        if self.traced and not callable(guide):
            raise ValueError(f"guide must be a NumPyro guide (a callable), got {type(guide).__name__}.")
        self.guide_args = guide_call_args(guide, guide_args, guide_kwargs) if self.traced else None
        self._traced_layouts = {}
        self.prefix = prefix or getattr(guide, "prefix", None) or "auto"
        self.scale_constraint = getattr(guide, "scale_constraint", None)
        self.scale_tril_constraint = getattr(guide, "scale_tril_constraint", None)
        self.update_with_value = False
        # discrete ExpFamilyGuide sites: enumerate up to max_enumerate loss evaluations, else score function
        self.max_enumerate = getattr(guide, "max_enumerate", expfam_blocks.MAX_ENUMERATE)
        self.score_samples = getattr(guide, "score_samples", expfam_blocks.SCORE_SAMPLES)
        if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)):
            raise ValueError(f"seed must be an int, got {seed!r}.")
        self.seed = int(seed)
        # host-side only: what get_params already warned about in this run, and at which step
        self._reported, self._reported_step = set(), 0

    # -- structure -------------------------------------------------------------------------
    def layout(self, params):
        """The guide's Gaussian blocks read from ``params`` (raises if it cannot be read)."""
        if self.traced:
            key = tuple(sorted((k, str(jax.tree.map(jnp.shape, v))) for k, v in params.items()))  # names, shapes
            if key not in self._traced_layouts:
                args, kwargs = self.guide_args
                self._traced_layouts[key] = trace_layout(self.guide, params, args, kwargs, self.fallback)
            layout = self._traced_layouts[key]
        else:
            layout = read_layout(params, self.prefix, self.scale_constraint, self.scale_tril_constraint)
        if not layout.blocks and self.fallback is None:
            raise GuideLayoutError(
                f"nb.BLR found no Gaussian in the parameters {sorted(params)}: it expects an autoguide's "
                f"'<site>_{self.prefix}_loc'/'<site>_{self.prefix}_scale', '{self.prefix}_loc'/"
                f"'{self.prefix}_scale_tril' or point-mass '{self.prefix}_loc' parameters. Use AutoNormal, "
                "AutoDiagonalNormal, AutoMultivariateNormal or AutoDelta, or pass guide=... if it uses another prefix "
                "(for positive, unit-interval, simplex or discrete latents use nb.ExpFamilyGuide). "
                "If it is a hand-written guide, pass it: nb.BLR(guide=guide, guide_args=(...)) with the arguments "
                "you give svi.run, and BLR reads its Normal/MultivariateNormal sites by tracing it; "
                "pass fallback=optax.adam(1e-3) to fit a guide with no Gaussian."
            )
        unhandled = [k for k in layout.other if not k.endswith(PLACEHOLDER_SUFFIX)]
        if unhandled and self.fallback is None:
            raise GuideLayoutError(
                f"nb.BLR cannot treat the parameter(s) {unhandled} as part of a Gaussian guide. "
                "Pass fallback=optax.adam(1e-3) (or another optax optimizer) to update them, or remove them"
                + ("; if they belong to a hand-written guide, pass it: nb.BLR(guide=guide, guide_args=(...))."
                   if self.guide is None else ".")
            )
        return layout

    def hessian_for(self, params, layout):
        """The curvature estimator used for the Gaussian blocks (resolves ``hessian=None``)."""
        if self.hessian is not None:
            return self.hessian
        if self.delta:
            return "autodiff"
        dim = sum(int(np.prod(params[b.loc].shape)) for b in layout.blocks if b.kind in (DIAGONAL, FULL))
        return "autodiff" if dim <= AUTODIFF_MAX_DIM else "reparam"

    def _point_dim(self, params, layout):
        return sum(int(np.prod(params[b.loc].shape)) for b in layout.blocks if b.kind == POINT)

    # -- the _NumPyroOptim protocol --------------------------------------------------------
    def _joint_diagonal(self, params, layout):
        """Diagonal blocks whose mean step is preconditioned by the dense Hessian across them: with the
        exact Hessian the estimator computes it anyway, and the mean step of a mean-field guide on a
        correlated posterior is then a Newton step instead of a damped Jacobi iteration."""
        if self.hessian_for(params, layout) != "autodiff":
            return ()
        return tuple(b for b in layout.blocks if b.kind == DIAGONAL)

    def _direction_size(self, params, layout):
        """Length of the flat whitened step direction that the adaptive step size compares."""
        has_h = self.hessian_for(params, layout) != "none"
        size = 0
        for b in layout.blocks:
            n = int(np.prod(params[b.loc].shape))
            if b.kind == EXPFAM:
                size += sum(int(np.prod(params[k].shape)) for k in b.names)
            elif b.kind == POINT:
                size += n
            else:
                size += n * (2 if has_h else 1)
        return size

    def _averaged(self, params, layout):
        """The blocks whose iterates are averaged (:class:`adaptive_decay` with ``averaging=True``):
        every Gaussian block (diagonal or full); none with another step size."""
        if not getattr(self.schedule(params, layout), "averaging", False):
            return ()
        return tuple(b for b in layout.blocks if b.kind in (DIAGONAL, FULL))

    @staticmethod
    def _guide_moments(params, blocks):
        r"""``{loc: m, scale: s or L}`` of ``blocks``: the mean and the scale or Cholesky factor of
        :math:`z = m + L\varepsilon`, the form in which the iterates are averaged (averaging NumPyro's
        raw scale_tril, a row-scaled unit-triangular factor, biases a near-singular covariance)."""
        out = {}
        for b in blocks:
            out[b.loc] = params[b.loc]
            out[b.scale] = b.transform(params[b.scale])
        return out

    def init(self, params):
        layout = self.layout(params)
        dp = self._point_dim(params, layout) if self.point_hessian == "autodiff" else 0
        dtype = jnp.result_type(*[params[b.loc] for b in layout.blocks]) if layout.blocks else jnp.result_type(float)
        joint = self._joint_diagonal(params, layout)
        if joint:  # start from the guide's own (diagonal) covariance
            scales = jnp.concatenate([b.transform(params[b.scale]).reshape(-1) for b in joint])
            mean_tril = jnp.diag(scales.astype(dtype))
        else:
            mean_tril = jnp.zeros((0, 0), dtype)
        other = {k: params[k] for k in layout.other}
        locs = [b.loc for b in layout.blocks if b.kind != EXPFAM]
        zero = jnp.zeros((), dtype)
        trace = FitTrace(
            clock=zero,
            direction=jnp.zeros((self._direction_size(params, layout),), dtype),
            rho=zero,
            loss_avg=jnp.full((), jnp.nan, dtype),
            loss_var=zero,
            loss_best=jnp.full((), jnp.inf, dtype),
            loss_best_var=zero,
            gradient_size={n: jnp.zeros_like(params[n]) for n in locs},
            gradient_last={n: jnp.zeros_like(params[n]) for n in locs},
            persistence={n: jnp.ones_like(params[n]) for n in locs},
            halvings=jnp.array(0, jnp.int32),
            damped=jnp.array(0, jnp.int32),
            damped_recent=zero,
            damping=jnp.ones((), dtype),
        )
        averaged = self._averaged(params, layout)
        state = BLRState(
            params=dict(params),
            momentum={b.loc: jnp.zeros_like(params[b.loc]) for b in layout.blocks},
            point_precision=self.init_precision * jnp.eye(dp, dtype=dtype),
            mean_scale_tril=mean_tril,
            fallback_state=self.fallback.init(other) if self.fallback is not None else (),
            nonfinite={k: jnp.array(False) for k in params},
            nonfinite_steps=jnp.array(0, dtype=jnp.int32),
            trace=trace,
            average=self._guide_moments(params, averaged),
        )
        return jnp.array(0), state

    def get_params(self, state):
        """The guide's unconstrained parameters (with :class:`adaptive_decay`'s averaging, the Gaussian
        blocks hold the average of the iterates' means and scales or Cholesky factors). Outside
        ``jit`` (``SVI.run`` calls this once at the end of a run), warns about what
        :func:`numpyro_blr.fit_report` finds wrong (skipped steps, divergence, a mean still
        travelling, a collapsed variance), naming the parameters concerned and the change that fixes
        it; each problem once per run, however often this is called."""
        i, s = state
        check_foreign_state(s, BLRState)
        if not isinstance(s.nonfinite_steps, jax.core.Tracer):
            step = int(i)
            if step < self._reported_step:  # a new run: report afresh
                self._reported = set()
            if step:
                from numpyro_blr.report import fit_report  # local: report imports this module

                report = fit_report((i, s), optimizer=self)
                for key, message in zip(report.problem_keys, report.problems):
                    if key not in self._reported:
                        warnings.warn(message, RuntimeWarning, stacklevel=3)  # <- BLR.get_params <- SVI.get_params
                        self._reported.add(key)
            self._reported_step = step
        if not s.average:
            return s.params
        out = dict(s.params)
        for b in self._averaged(s.params, self.layout(s.params)):
            out[b.loc] = s.average[b.loc]
            out[b.scale] = b.transform.inv(s.average[b.scale])
        return out

    def update(self, g, state, value=None):
        raise TypeError(
            "nb.BLR needs the loss function, not only its gradient: use it through numpyro.infer.SVI "
            "(which calls eval_and_update), or call BLR.eval_and_update(loss_fn, state) yourself."
        )

    def eval_and_update(self, fn, state, forward_mode_differentiation=False):
        return self._step(fn, state, forward_mode_differentiation, stable=False)

    def eval_and_stable_update(self, fn, state, forward_mode_differentiation=False):
        return self._step(fn, state, forward_mode_differentiation, stable=True)

    # -- the step --------------------------------------------------------------------------
    def default_lr(self, params, layout):
        """The schedule used when ``lr`` is not given.

        ``adaptive_decay(0.5, 10)``, except with a sampled Hessian (``"price"``, ``"reparam"``) on a
        full-covariance block of dimension ``D``: a one-sample estimate of a ``D x D`` Hessian has
        noise of order ``D`` times the signal, so there it starts at ``min(0.5, 1/D)`` and halves
        over 100 noise-dominated steps.
        """
        full = [params[b.loc].shape[-1] for b in layout.blocks if b.kind == FULL]
        if full and self.hessian_for(params, layout) in ("price", "reparam"):
            return adaptive_decay(min(0.5, 1.0 / max(full)), 100)
        return adaptive_decay(0.5, 10)

    def schedule(self, params, layout):
        return self.lr if self.lr is not None else self.default_lr(params, layout)

    def step_size(self, i, params, layout, clock=None):
        """:math:`\\rho` at step ``i`` (counted from 0); an :class:`adaptive_decay` reads ``clock`` instead."""
        lr = self.schedule(params, layout)
        if getattr(lr, "adaptive", False):
            return lr(i if clock is None else clock)
        return lr(i) if callable(lr) else lr

    def _step(self, fn, state, forward_mode, stable):
        i, s = state
        check_foreign_state(s, BLRState)
        params = s.params
        layout = self.layout(params)
        check_loss(fn, params, layout, read_by_names=not self.traced)  # trace time only
        passthrough = passthrough_params(fn, params, layout.other, self.fallback, "nb.BLR")
        hessian = self.hessian_for(params, layout)
        (loss, aux), grads, stats, points, joint_hess = estimate(
            fn, params, layout, hessian, self.delta, forward_mode, self.point_hessian
        )
        t = i + 1
        schedule = self.schedule(params, layout)
        adaptive = getattr(schedule, "adaptive", False)
        dtype = s.trace.clock.dtype
        lr = jnp.asarray(self.step_size(i, params, layout, s.trace.clock), dtype=dtype)
        gamma = lr  # the step of the blocks that are not averaged (exponential family, point masses)
        averaging = bool(s.average)
        if averaging:  # the averaged Gaussian blocks step with rho_0 / sqrt(1 + c/tau)
            lr = jnp.asarray(schedule.iterate(s.trace.clock), dtype=dtype)
        new_params, new_mom = dict(params), dict(s.momentum)
        checked = {}  # parameter name -> arrays that must be finite for its update to be valid
        direction = {}  # block handle -> whitened step direction, for the adaptive step size
        whitened_grad = {}  # loc -> whitened mean gradient L^T g of this step (loc-shaped)
        control = {}  # loc -> control variate S (z - m) subtracted from its sampled gradient

        joint = self._joint_diagonal(params, layout)
        new_mean_tril = s.mean_scale_tril
        if joint:
            new_mean_tril = self._joint_mean_step(
                joint, params, stats, joint_hess, s, lr, t, new_params, new_mom, direction, whitened_grad, control
            )

        for j, b in enumerate(layout.blocks):
            if b.kind == EXPFAM:  # ExpFamilyGuide's Gamma/Beta/Dirichlet/Bernoulli/Categorical sites
                key = jax.random.fold_in(jax.random.fold_in(jax.random.PRNGKey(self.seed), i), j)
                new = expfam_blocks.update_block(
                    b, fn, params, grads, gamma, self.improved != "plain", key,
                    self.max_enumerate, self.score_samples,
                )
                new_params.update(new)
                direction[b.loc] = jnp.concatenate([(new[n] - params[n]).reshape(-1) for n in b.names])
                for n in b.names:
                    checked[n] = (grads[n], new[n])
                continue
            if b.kind == POINT:
                continue
            st = stats[b.loc]
            m = params[b.loc]
            g = st.g
            if b.kind == DIAGONAL:
                scale = b.transform(params[b.scale])
                if st.h is not None:
                    prec = diagonal_precision_update(scale**-2, st.h, lr, self.improved)
                    new_params[b.scale] = b.transform.inv(lax.rsqrt(prec))
                    curvature = [(scale**2 * st.h - 1.0).reshape(-1)]
                else:
                    prec, curvature = scale**-2, []
                if b in joint:  # mean already stepped with the joint preconditioner
                    direction[b.loc] = jnp.concatenate([direction[b.loc]] + curvature)
                else:
                    if st.offset is not None:
                        control[b.loc] = _finite_or_zero(st.offset / scale**2)
                        g = g - control[b.loc]
                    new_mom[b.loc], mbar = momentum_update(s.momentum[b.loc], g, self.momentum, t)
                    new_params[b.loc] = m - lr * (mbar if st.h is None else mbar / prec)
                    u = scale * g
                    whitened_grad[b.loc] = u
                    direction[b.loc] = jnp.concatenate([u.reshape(-1)] + curvature)
            else:  # FULL
                tril = b.transform(params[b.scale])
                if st.offset is not None:  # S (z - m) = L^-T L^-1 (z - m)
                    whitened = solve_triangular(tril, st.offset, lower=True)
                    control[b.loc] = _finite_or_zero(solve_triangular(tril.T, whitened, lower=False))
                    g = g - control[b.loc]
                new_mom[b.loc], mbar = momentum_update(s.momentum[b.loc], g, self.momentum, t)
                u = tril.T @ g
                whitened_grad[b.loc] = u
                if st.h is None:
                    new_params[b.loc] = m - lr * mbar
                    direction[b.loc] = u
                else:
                    w = st.whitened
                    if w is None:  # the exact Hessian: whiten it here, symmetric to rounding
                        w = tril.T @ st.h @ tril
                        w = 0.5 * (w + w.T)
                    new_tril = full_scale_tril_update(tril, None, lr, self.improved, w)
                    new_params[b.loc] = m - lr * (new_tril @ (new_tril.T @ mbar))
                    new_params[b.scale] = b.transform.inv(new_tril)
                    direction[b.loc] = jnp.concatenate([u, jnp.diagonal(w) - 1.0])
            checked[b.loc] = (st.g, new_params[b.loc])
            if st.h is not None:  # L^T H L when the estimator gave it (H itself is then not formed)
                checked[b.scale] = (st.h if st.whitened is None else st.whitened, new_params[b.scale])

        new_point_prec = s.point_precision
        if points is not None:
            names = sorted(b.loc for b in layout.blocks if b.kind == POINT)
            flat_m = jnp.concatenate([params[n].reshape(-1) for n in names])
            flat_mom = jnp.concatenate([s.momentum[n].reshape(-1) for n in names])
            flat_mom, mbar = momentum_update(flat_mom, points.g, self.momentum, t)
            if points.h is None:
                step, u = mbar, points.g
            else:
                prec = s.point_precision
                chol = jnp.linalg.cholesky(prec)
                new_point_prec = full_precision_update(prec, None, points.h, gamma, self.improved)
                step = jax.scipy.linalg.cho_solve((jnp.linalg.cholesky(new_point_prec), True), mbar)
                u = solve_triangular(chol, points.g, lower=True)
            flat_new = flat_m - gamma * step
            start = 0
            for n in names:
                size = params[n].size
                new_params[n] = flat_new[start : start + size].reshape(params[n].shape)
                new_mom[n] = flat_mom[start : start + size].reshape(params[n].shape)
                whitened_grad[n] = u[start : start + size].reshape(params[n].shape)
                checked[n] = (grads[n], new_params[n], new_point_prec)
                start += size
            direction["__points__"] = u

        damping = jnp.ones((), dtype)
        if self.backtrack:
            locs = [b.loc for b in layout.blocks if b.kind != EXPFAM]
            if locs:
                damping = self._backtrack(fn, params, new_params, locs, loss, control, self.delta and layout)
                for n in locs:
                    new_params[n] = params[n] + damping.astype(params[n].dtype) * (new_params[n] - params[n])

        new_fb = s.fallback_state
        if layout.other and not passthrough:  # passthrough placeholders stay as they are
            other_g = {k: grads[k] for k in layout.other}
            other_p = {k: params[k] for k in layout.other}
            updates, new_fb = self.fallback.update(other_g, s.fallback_state, other_p)
            for k in layout.other:  # a parameter may be a pytree (an Equinox module's weights)
                new_params[k] = optax.apply_updates(params[k], updates[k])
                checked[k] = tuple(jax.tree.leaves((grads[k], new_params[k])))

        def all_finite(arrays):
            # one reduction: x * 0 is 0 for finite x and NaN for inf/NaN, so the sum is finite iff all are
            return jnp.isfinite(sum(jnp.sum(a * 0) for a in arrays))

        loss_ok = jnp.isfinite(loss)
        finite = {k: all_finite(arrs) for k, arrs in checked.items()}
        ok = loss_ok & functools.reduce(jnp.logical_and, finite.values(), jnp.array(True))

        skipped = None
        if adaptive:  # a skipped step halves the averaged blocks' rho (without averaging: the one step size)
            skipped = schedule.skipped if averaging else (lambda c: 2.0 * c + schedule.halving_steps)
        trace = self._next_trace(s.trace, i, ok, loss, lr, direction, whitened_grad, skipped, damping)
        new_average = s.average
        if averaging:  # Polyak-Ruppert: the exponential average of the iterates, weight rho_0 / (1 + c/tau)
            weight = jnp.asarray(schedule(trace.clock), dtype=dtype)
            target = self._guide_moments(new_params, self._averaged(params, layout))
            new_average = {n: a + weight.astype(a.dtype) * (target[n] - a) for n, a in s.average.items()}
        new_state = BLRState(
            new_params, new_mom, new_point_prec, new_mean_tril, new_fb, s.nonfinite, s.nonfinite_steps, trace, new_average
        )
        # Selections, not lax.cond: a conditional inside SVI.run's scan costs about 5 us per step
        # on CPU (as much as a whole Adam step on a small model), a select is fused for free.
        keep = lambda new, old: jax.tree_util.tree_map(lambda a, b: jnp.where(ok, a, b), new, old)  # noqa: E731

        if stable:
            loss = jnp.where(ok, loss, jnp.full_like(loss, jnp.nan))
            return (loss, aux), keep((t, new_state), state)

        bad = {k: ~finite.get(k, loss_ok) | ~loss_ok for k in params}
        flags = {k: s.nonfinite[k] | (bad[k] & ~ok) for k in params}
        kept = s._replace(nonfinite=flags, nonfinite_steps=s.nonfinite_steps + 1, trace=trace)
        new_state = new_state._replace(nonfinite=flags)
        return (loss, aux), (t, keep(new_state, kept)._replace(trace=trace))

    @staticmethod
    def _backtrack(fn, params, new_params, locs, loss, control, mean_layout=None, shrink=0.25, tries=BACKTRACK_TRIES):
        r"""Damping :math:`\alpha \in [0, 1]` of the mean step: backtracking on this step's sample of the loss.

        The loss of a step is :math:`f(m) = \ell(m + L\varepsilon) + \log q`, with the draw
        :math:`\varepsilon` fixed for the step (common random numbers); its :math:`\log q` term does not
        depend on the mean. With the control variate :math:`c = S(z - m)` (zero-mean) subtracted from
        the gradient, the mean step :math:`\Delta` is a Newton step on
        :math:`\phi(m') = f(m') - (m' - m)^\top c`, whose expectation is :math:`f`'s; for a Gaussian
        posterior and :math:`S = H`, :math:`\phi(m + \Delta) - \phi(m)` is the deterministic
        :math:`-\rho(1-\rho/2)\lVert m - m^*\rVert_H^2`. So :math:`\alpha = 1` wherever the quadratic
        model holds, and the step is unchanged. Where it fails (saturated logits, a curvature far
        below the true one, a mean far in the tail), :math:`\alpha` is the first of
        :math:`1, 1/4, 1/16, \dots` at which :math:`\phi` does not rise, and 0 when none of ``tries``
        does: the mean cannot overshoot (damped Newton; Nocedal & Wright 2006, Sec. 3.1). With the
        delta method (``mean_layout``), :math:`f` is the loss at the mean. One loss evaluation per try.
        """
        delta = {n: new_params[n] - params[n] for n in locs}
        at = (lambda p: at_mean(p, mean_layout)) if mean_layout else (lambda p: p)
        loss0 = jnp.asarray(fn(at(params))[0] if mean_layout else loss)
        slope = sum((jnp.sum(delta[n] * control[n]) for n in control), jnp.zeros((), loss0.dtype))
        tol = 4.0 * jnp.finfo(loss0.dtype).eps * jnp.abs(loss0)

        def value(alpha):
            p = dict(params)
            for n in locs:
                p[n] = params[n] + alpha.astype(params[n].dtype) * delta[n]
            return jnp.asarray(fn(at(p))[0], loss0.dtype) - alpha * slope

        def cond(c):
            k, _, accepted = c
            return (~accepted) & (k < tries)

        def body(c):
            k, _, _ = c
            alpha = jnp.asarray(shrink, loss0.dtype) ** k
            val = value(alpha)
            return k + 1, alpha, jnp.isfinite(val) & (val <= loss0 + tol)

        start = (jnp.zeros((), jnp.int32), jnp.ones((), loss0.dtype), jnp.zeros((), bool))
        _, alpha, accepted = lax.while_loop(cond, body, start)
        return jnp.where(accepted, alpha, 0.0)

    def _joint_mean_step(self, joint, params, stats, hess, s, lr, t, new_params, new_mom, direction, whitened_grad, control):
        r"""Mean step of the diagonal blocks preconditioned by a dense precision :math:`P` across them.

        :math:`P` (stored as the Cholesky factor of :math:`P^{-1}`) takes the same BLR step as a
        full-covariance guide's precision, from the exact Hessian :math:`\hat H` across the blocks,
        and the means move by :math:`-\rho P^{-1}\bar g`. The fixed point is unchanged
        (:math:`\mathbb{E}_q[\nabla\ell] = 0`, the mean-field optimum's mean condition), while each
        step is a Newton step rather than a damped Jacobi iteration. The control variate is
        :math:`\hat g - P(z - m)`, zero-mean because :math:`P` does not depend on the sample.
        Returns the new factor; writes the new means and the step directions into the dicts given.
        """
        sizes = [params[b.loc].size for b in joint]
        g = jnp.concatenate([stats[b.loc].g.reshape(-1) for b in joint])
        tril = s.mean_scale_tril
        offsets = [stats[b.loc].offset for b in joint]
        if all(o is not None for o in offsets):
            offset = jnp.concatenate([o.reshape(-1) for o in offsets])
            cv = _finite_or_zero(solve_triangular(tril.T, solve_triangular(tril, offset, lower=True), lower=False))
            g = g - cv
            start = 0
            for b, size in zip(joint, sizes):
                control[b.loc] = cv[start : start + size].reshape(params[b.loc].shape)
                start += size
        mom = jnp.concatenate([s.momentum[b.loc].reshape(-1) for b in joint])
        mom, mbar = momentum_update(mom, g, self.momentum, t)
        w = tril.T @ hess @ tril
        new_tril = full_scale_tril_update(tril, None, lr, self.improved, 0.5 * (w + w.T))
        step = new_tril @ (new_tril.T @ mbar)
        u = tril.T @ g
        start = 0
        for b, size in zip(joint, sizes):
            shape = params[b.loc].shape
            new_params[b.loc] = params[b.loc] - lr * step[start : start + size].reshape(shape)
            new_mom[b.loc] = mom[start : start + size].reshape(shape)
            whitened_grad[b.loc] = u[start : start + size].reshape(shape)
            direction[b.loc] = u[start : start + size]
            start += size
        return new_tril

    @staticmethod
    def _next_trace(trace, i, ok, loss, lr, direction, whitened_grad, skipped, damping):
        """The run's evidence after this step; with the adaptive step size (``skipped``: the clock
        after a skipped step, as a function of the clock), its clock too."""
        short = damping < 1
        v = jnp.concatenate([direction[k] for k in sorted(direction)]) if direction else trace.direction
        v = v.astype(trace.direction.dtype)
        clock, halvings = trace.clock, trace.halvings
        if skipped is not None:
            # the fraction of the products of successive coordinates that are negative, weighted by
            # their size: one coordinate still travelling (a scale whose precision is far too high)
            # outweighs many that are noise, and a small bias in noisy coordinates only slows the clock
            products = v * trace.direction
            total = jnp.sum(jnp.abs(products))
            changed = jnp.where(total > 0, jnp.sum(jnp.maximum(-products, 0.0)) / jnp.where(total > 0, total, 1.0), 1.0)
            advance = jnp.where(i > 0, jnp.minimum(1.0, 2.0 * changed), 0.0)
            clock = jnp.where(ok, clock + advance, skipped(clock))
            halvings = halvings + jnp.where(ok, 0, 1).astype(halvings.dtype)
        first = jnp.isnan(trace.loss_avg)
        finite_loss = jnp.isfinite(loss)
        loss = jnp.asarray(loss, trace.loss_avg.dtype)
        avg = jnp.where(first, loss, 0.9 * trace.loss_avg + 0.1 * loss)
        var = jnp.where(first, 0.0, 0.9 * trace.loss_var + 0.1 * (loss - trace.loss_avg) ** 2)
        avg = jnp.where(finite_loss, avg, trace.loss_avg)
        var = jnp.where(finite_loss, var, trace.loss_var)
        # geometric average (weight 0.2) of |u|: forgets the huge gradients of the first steps in tens
        # of steps, where an average of u^2 would remember them for hundreds; and how persistently
        # the sign of u repeats (weight 0.05; 1 at the start: a run is not converged until shown)
        sizes, persistence = {}, {}
        for k, u in whitened_grad.items():
            log_u = jnp.log(jnp.abs(u) + jnp.finfo(u.dtype).tiny)
            sizes[k] = jnp.where(i > 0, jnp.where(ok, 0.8 * trace.gradient_size[k] + 0.2 * log_u, trace.gradient_size[k]), log_u)
            same = jnp.sign(u * trace.gradient_last[k])
            persistence[k] = jnp.where(ok & (i > 0), 0.95 * trace.persistence[k] + 0.05 * same, trace.persistence[k])
        last = {k: jnp.where(ok, whitened_grad[k], trace.gradient_last[k]) for k in whitened_grad}
        new_best = finite_loss & (avg < trace.loss_best)
        return FitTrace(
            clock=clock,
            direction=jnp.where(ok, v, trace.direction),
            rho=lr,
            loss_avg=avg,
            loss_var=var,
            loss_best=jnp.where(new_best, avg, trace.loss_best),
            loss_best_var=jnp.where(new_best, var, trace.loss_best_var),
            gradient_size=sizes,
            gradient_last=last,
            persistence=persistence,
            halvings=halvings,
            damped=trace.damped + jnp.where(ok & short, 1, 0).astype(trace.damped.dtype),
            damped_recent=jnp.where(ok, 0.95 * trace.damped_recent + 0.05 * short, trace.damped_recent),
            damping=jnp.where(ok, damping, trace.damping).astype(trace.damping.dtype),
        )


def nonfinite_parameters(state):
    """Names of the parameters whose gradient or update was ever non-finite in a BLR run.

    ``state`` is an ``SVIState`` (``svi_result.state``) or a BLR optimizer state.
    """
    opt_state = getattr(state, "optim_state", state)
    blr_state = opt_state[1]
    return sorted(k for k, v in blr_state.nonfinite.items() if bool(v))
