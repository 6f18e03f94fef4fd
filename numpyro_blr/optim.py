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

from typing import Callable, NamedTuple, Optional, Union

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.scipy.linalg import solve_triangular

from numpyro_blr import expfam_blocks
from numpyro_blr.core import backtracking_factor
from numpyro_blr.estimators import HESSIANS, at_mean, estimate, hoist_constant_work
from numpyro_blr.estimators.gaussian import laplace_gap_from_losses
from numpyro_blr.estimators.svi import (
    BASELINE_SHRINK,
    extra_draws,
    finite_or_zero,
    loss_particles,
    reads_sample_offsets,
    shifted_draw_params,
)
from numpyro_blr.layout import DIAGONAL, EXPFAM, FULL, POINT, apply_transform
from numpyro_blr.parallel import check_guide_memory
from numpyro_blr.report import FitTrace, empty_loss_band, empty_loss_blocks, fit_report, is_block_end, next_trace
from numpyro_blr.rules.blr import (
    diagonal_precision_update,
    full_precision_update,
    full_scale_tril_update,
    momentum_update,
    positivity_rule,
)
from numpyro_blr.rules.schedules import adaptive_decay, check_lr, check_step_size, check_unit_interval
from numpyro_blr.svi import GuideAlgorithm, GuideOptimizer, GuideStep


AUTODIFF_MAX_DIM = 256
# a guide of full-covariance blocks only keeps the exact Hessian up to this many numbers: its step is O(D^3) anyway,
# and the sampled full estimate ("reparam", rho_0 = 1/D) was 528-685 nats short after 1,000 steps at D = 304-404
# where the exact Hessian reached the best full Gaussian in 100 steps (bench/robustness_cases.py's
# varying_intercepts_300, hierarchical_logistic_400; docs/robustness.md)
FULL_AUTODIFF_MAX_DIM = 1024
BACKTRACK_TRIES = 8
GAP_WINDOW = 200  # Laplace-gap draws kept for the end-of-run report (delta method)
CURVATURE_DRAWS = 8  # draws per step once the one-draw curvature is too noisy (default: on a rerun only, BLR.rerun_optimizer)
NOISE_TOLERANCE = 0.05  # the improved rule's fixed-point bias of a precision from negative single-draw curvature
NOISE_WEIGHT = 0.05  # weight of the running average of the squared negative whitened curvature


class BLRState(NamedTuple):
    """The BLR's own state over the guide's blocks (``GuideState.algorithm``): fixed-shape arrays only,
    so ``SVI.run`` can ``lax.scan`` and resume exactly. The parameters, the fallback optimizer's
    state and the non-finite bookkeeping are the adapter's (:class:`numpyro_blr.svi.GuideState`).

    ``momentum``         heavy-ball average of the mean gradient, per loc;
    ``point_precision``  joint precision of all point-mass locs (delta method), ``(0, 0)`` if none;
    ``mean_scale_tril``  for diagonal guides with the exact Hessian: Cholesky factor of the inverse
                         of the dense precision that preconditions their mean step, ``(0, 0)`` if none;
    ``trace``            :class:`~numpyro_blr.report.FitTrace`, the evidence for the end-of-run report;
    ``laplace_gap``      with the delta method and a curvature (``nb.laplace()``, ``nb.newton()``,
                         ``delta=True``): the last ``GAP_WINDOW`` draws of the Laplace gap
                         (:func:`~numpyro_blr.estimators.gaussian.laplace_gap_from_losses`, read off the
                         two losses the step evaluates anyway; NaN where none was drawn), a circular
                         buffer indexed by the step; shape ``(0,)`` otherwise;
    ``snapshot``         per Gaussian block's loc, its mean (averaged, when the iterates are) when the
                         trace's last block of losses began (:func:`~numpyro_blr.report.is_block_end`):
                         the report names the sites that moved most since then when the loss still falls;
    ``average``          with :class:`adaptive_decay`'s averaging: per Gaussian block, the
                         exponential averages of the iterates' mean (under the loc's name) and of
                         their scale :math:`s` or Cholesky factor :math:`L` (under the scale's
                         name, constrained), and per exponential-family block the average of its
                         natural parameters (field ``k`` under the block's ``k``-th parameter name),
                         which ``get_params`` returns; else empty. The weight
                         is ``rho_0 / (1 + c/tau)`` on the clock ``c``, so that an iterate taken at
                         clock ``c`` counts like ``(c + 6)(c + 7)(c + 8)(c + 9)`` (default
                         schedule): :class:`adaptive_decay` says what this keeps of the approach
                         and of the Monte Carlo noise, and why it is not a plain mean.
    """

    momentum: dict
    point_precision: jax.Array
    mean_scale_tril: jax.Array
    trace: FitTrace
    average: dict
    laplace_gap: jax.Array = None
    snapshot: dict = None
    curvature_noise: dict = None
    curvature_switched: jax.Array = None


class BLR(GuideOptimizer):
    r"""The Bayesian learning rule for Gaussian guides, as a NumPyro optimizer.

    :param lr: step size :math:`\rho` (float > 0, an optax schedule ``step -> rho``, or an
        :class:`adaptive_decay`). Default: ``adaptive_decay(0.5, 10)``: on a clock :math:`c` that
        advances only while the steps are Monte Carlo noise, the Gaussian blocks step with
        :math:`0.5/\sqrt{1 + c/10}` and ``get_params`` returns the average of their iterates with
        weight :math:`0.5/(1 + c/10)`; exponential-family and point-mass blocks step with
        :math:`0.5/(1 + c/10)`, and ``get_params`` returns the exponential-family blocks
        (``ExpFamilyGuide``'s Gamma, Beta, Dirichlet, Bernoulli, Categorical sites) as the average of
        their iterates' natural parameters with the same weight (:meth:`_guide_moments` says why
        natural ones) (see :meth:`default_lr` for sampled Hessians on full-covariance guides). A float
        or an optax schedule is used as given, for every block, with no average.
    :param hessian: how :math:`\mathbb{E}_q[\nabla^2\ell]` is estimated: ``"reparam"`` (Price/Stein,
        from the gradient w.r.t. the scale, with a same-noise baseline: two gradient passes),
        ``"price"`` (the plain one-pass Price estimator), ``"hutchinson"`` (the diagonal of the exact
        Hessian at the sample from one whitened Rademacher probe per block, one forward-over-reverse pass;
        full-covariance blocks take ``"reparam"``'s estimate), ``"autodiff"`` (exact Hessian at the sample;
        small models) or ``"none"`` (keep the covariance; gradient descent). Default: ``"autodiff"``
        when the Gaussian blocks hold at most 256 numbers (1,024 when all of them are full-covariance
        blocks, whose step is :math:`O(D^3)` anyway) or with ``delta=True``, ``"hutchinson"``
        otherwise; point masses always use ``"autodiff"`` (or ``"none"``). With ``"hutchinson"`` and one
        draw of ``Trace_ELBO``, the mean gradient of diagonal blocks has the control variate
        :math:`\nabla^2\ell(m)(z - m)` (:func:`~numpyro_blr.estimators.svi.sample_control`: one more pass,
        at the mean).
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
        (:mod:`numpyro_blr.guide_trace`). Under ``SVI`` and ``nb.fit`` it is not needed: they hand their
        guide and arguments over (:meth:`~numpyro_blr.svi.GuideOptimizer.bound_to`), as this would.
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
        large discrete ``ExpFamilyGuide`` sites, the extra curvature draws); step ``t`` uses
        ``fold_in(PRNGKey(seed), t)``.
    :param curvature_draws: with the exact Hessian at a sample (``hessian="autodiff"``, the default for small
        guides), the number of draws of :math:`q` whose Hessians and gradients a step averages once the
        one-draw curvature has shown negative values with a heavy tail (hierarchical log-scales), which bias
        the precision step (:meth:`_curvature_draws`: the decision, the maths and the cost). ``None`` (the
        default): every step decides as with 8 (``CURVATURE_DRAWS``) whether the one-draw curvature is too
        noisy, but takes the one-draw step; ``SVI.run`` and ``nb.fit`` rerun a fit whose steps found it too noisy
        *and* whose end-of-run report finds a problem with ``curvature_draws=8`` (:meth:`rerun_optimizer`), from
        the same key: the result is that of ``curvature_draws=8`` (whose steps up to the switch are those of the
        one-draw run). So the averaged branch, which takes the step's object code from 351 to 536 KB on breast
        cancer (``AutoMultivariateNormal``, about 45% more compile time), is compiled only for the fits that need
        it: NumPyro's hierarchical-scales logistic regression (docs/robustness.md); ``ucbadmit_glmm``,
        ``gp_pois_regr`` and ``sblri_blr`` (``AutoMultivariateNormal``) also switch but converge with one draw, so
        they are not rerun. An int: that many draws from the switch on, compiled into every step (1: one draw,
        always). A loop of ``svi.update`` (and the workflow's many-fit programs) runs the steps as given; the
        report then proposes ``curvature_draws=8``.

    References: Khan & Rue (2023), *The Bayesian learning rule*, JMLR; Lin, Schmidt & Khan (2020),
    *Handling the positive-definite constraint in the Bayesian learning rule*, ICML.
    """

    reads_packed_sites = True  # AutoDiagonalNormal: a Hutchinson probe per site (estimators.svi.probe_directions)

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
        curvature_draws: Optional[int] = None,
    ):
        self.lr = None if lr is None else check_step_size(lr)
        if curvature_draws is not None and (isinstance(curvature_draws, bool) or
                                            not isinstance(curvature_draws, (int, np.integer)) or curvature_draws < 1):
            raise ValueError(f"curvature_draws must be None (the default) or an int >= 1, got {curvature_draws!r}.")
        # None: the steps detect the noisy curvature but do not average; svi.run and nb.fit rerun such a fit with
        # CURVATURE_DRAWS when its report finds a problem (rerun_optimizer)
        self.draws_on_rerun = curvature_draws is None
        self.curvature_draws = CURVATURE_DRAWS if curvature_draws is None else int(curvature_draws)
        self.backtrack = bool(backtrack)
        if hessian is not None and hessian not in HESSIANS:
            raise ValueError(f"hessian must be one of {HESSIANS} or None, got {hessian!r}.")
        if delta and hessian in ("reparam", "price", "hutchinson"):
            raise ValueError(
                f"hessian={hessian!r} reads the curvature off a sample of the guide; the delta method "
                "(delta=True) evaluates at the mean, so use hessian='autodiff' or 'none'."
            )
        self.hessian = hessian
        self.point_hessian = "none" if hessian == "none" else "autodiff"
        self.delta = bool(delta)
        self.momentum = check_unit_interval(momentum, "momentum")
        self.improved = positivity_rule(improved)
        self.init_precision = check_lr(init_precision, "init_precision")
        if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)):
            raise ValueError(f"seed must be an int, got {seed!r}.")
        self.seed = int(seed)
        algorithm = GuideAlgorithm(
            name="nb.BLR", init=self._init_state, step=self._propose, commit=_commit, report=_report,
            result=self._result,
        )
        super().__init__(algorithm, fallback=fallback, guide=guide, guide_args=guide_args, guide_kwargs=guide_kwargs,
                         prefix=prefix)
        # discrete ExpFamilyGuide sites: enumerate up to max_enumerate loss evaluations, else score function
        self.max_enumerate = getattr(guide, "max_enumerate", expfam_blocks.MAX_ENUMERATE)
        self.score_samples = getattr(guide, "score_samples", expfam_blocks.SCORE_SAMPLES)

    # -- structure -------------------------------------------------------------------------
    def hessian_for(self, params, layout):
        """The curvature estimator used for the Gaussian blocks (resolves ``hessian=None``)."""
        if self.hessian is not None:
            return self.hessian
        if self.delta:
            return "autodiff"
        gauss = [b for b in layout.blocks if b.kind in (DIAGONAL, FULL)]
        dim = sum(int(np.prod(params[b.loc].shape)) for b in gauss)
        if dim <= AUTODIFF_MAX_DIM or (all(b.kind == FULL for b in gauss) and dim <= FULL_AUTODIFF_MAX_DIM):
            return "autodiff"
        return "hutchinson"

    def _point_dim(self, params, layout):
        return sum(int(np.prod(params[b.loc].shape)) for b in layout.blocks if b.kind == POINT)

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

    def _tracks_laplace_gap(self, params, layout):
        r"""Whether the run records the Laplace gap (:class:`BLRState`'s ``laplace_gap``): the delta method
        with a curvature, on a guide with Gaussian blocks, whose precision then tracks
        :math:`\nabla^2\ell(m)` (Newton's method; with ``lr=1`` the Laplace approximation)."""
        return self.delta and self.hessian_for(params, layout) != "none" and any(
            b.kind in (DIAGONAL, FULL) for b in layout.blocks)

    def _averaged(self, params, layout):
        """The blocks whose iterates are averaged (:class:`adaptive_decay` with ``averaging=True``):
        every Gaussian block (diagonal or full) and every exponential-family block of an
        :class:`~numpyro_blr.guides.ExpFamilyGuide`; none with another step size."""
        if not getattr(self.schedule(params, layout), "averaging", False):
            return ()
        return tuple(b for b in layout.blocks if b.kind in (DIAGONAL, FULL, EXPFAM))

    @staticmethod
    def _guide_moments(params, blocks, scales=None):
        r"""The form in which the iterates of ``blocks`` are averaged.

        Gaussian blocks: ``{loc: m, scale: s or L}``, the mean and the scale or Cholesky factor of
        :math:`z = m + L\varepsilon` (averaging NumPyro's raw scale_tril, a row-scaled unit-triangular
        factor, biases a near-singular covariance). ``scales``: the scales already known (a step's new
        ``s`` or ``L``, not read back through the raw parameter: that round trip costs a transcendental
        kernel to compile, 6-10 KB of code).

        Exponential-family blocks (Gamma, Beta, Dirichlet, Bernoulli, Categorical): the natural
        parameters :math:`\lambda`, the ``k``-th field of the family's natural NamedTuple under the
        block's ``k``-th parameter name (:func:`~numpyro_blr.expfam_blocks.natural_parameters`): the
        BLR is the recursion :math:`\lambda \leftarrow (1-\rho)\lambda + \rho\hat\lambda` on them,
        so their average is the average of the per-step targets :math:`\hat\lambda = -\nabla_\mu
        \mathbb E_q[\ell]` (unbiased on conjugate terms, where :math:`\mathbb E\hat\lambda` is the
        posterior's :math:`\lambda`), and their domain is convex, so the average is a valid
        distribution (:mod:`numpyro_blr.expfam_blocks`)."""
        out = {}
        for b in blocks:
            if b.kind == EXPFAM:
                out.update(zip(b.names, expfam_blocks.natural_parameters(b, params)))
                continue
            out[b.loc] = params[b.loc]
            out[b.scale] = scales[b.scale] if scales and b.scale in scales else b.transform(params[b.scale])
        return out

    def _init_state(self, params, layout):
        """The BLR's initial state (:class:`BLRState`). Its constant arrays are made with NumPy and placed with ``jax.device_put``:
        built with ``jnp.zeros_like`` and the like (or ``jnp.asarray``), each new shape compiled a
        program of its own (14 on ``ucbadmit_glmm`` with ``AutoNormal``: 0.1-0.7 s of the user's
        first ``svi.init``, 0.04 s now, the guide's scale transform)."""
        if self.point_hessian == "autodiff":  # numpyro_blr.parallel: the point masses' joint D x D precision must fit
            check_guide_memory(params, layout, points=True)
        dp = self._point_dim(params, layout) if self.point_hessian == "autodiff" else 0
        dtype = jnp.result_type(*[params[b.loc] for b in layout.blocks]) if layout.blocks else jnp.result_type(float)

        def full(shape, value, dt=dtype):
            return jax.device_put(np.full(shape, value, dtype=dt))

        joint = self._joint_diagonal(params, layout)
        if joint:  # start from the guide's own (diagonal) covariance
            scales = [b.transform(params[b.scale]).reshape(-1) for b in joint]
            if any(isinstance(x, jax.core.Tracer) for x in scales):  # init under jit (monitor.elbo_curve)
                mean_tril = jnp.diag(jnp.concatenate(scales).astype(dtype))
            else:
                mean_tril = jax.device_put(np.diag(np.concatenate([np.asarray(x, dtype=dtype) for x in scales])))
        else:
            mean_tril = full((0, 0), 0)
        locs = [b.loc for b in layout.blocks if b.kind != EXPFAM]
        trace = FitTrace(
            clock=full((), 0),
            direction=full((self._direction_size(params, layout),), 0),
            rho=full((), 0),
            loss_avg=full((), np.nan),
            loss_var=full((), 0),
            loss_best=full((), np.inf),
            loss_best_var=full((), 0),
            gradient_size={n: full(np.shape(params[n]), 0, jnp.result_type(params[n])) for n in locs},
            gradient_last={n: full(np.shape(params[n]), 0, jnp.result_type(params[n])) for n in locs},
            persistence={n: full(np.shape(params[n]), 1, jnp.result_type(params[n])) for n in locs},
            halvings=full((), 0, np.int32),
            damped=full((), 0, np.int32),
            damped_recent=full((), 0),
            damping=full((), 1),
            loss_blocks=empty_loss_blocks(dtype),
            loss_blocks_clipped=empty_loss_blocks(dtype),
            loss_band=empty_loss_band(dtype),
        )
        averaged = self._averaged(params, layout)
        draws = self._draws(params, layout)
        state = BLRState(
            momentum={b.loc: full(np.shape(params[b.loc]), 0, jnp.result_type(params[b.loc])) for b in layout.blocks},
            point_precision=jax.device_put(self.init_precision * np.eye(dp, dtype=dtype)),
            mean_scale_tril=mean_tril,
            trace=trace,
            average=self._guide_moments(params, averaged),
            laplace_gap=full((GAP_WINDOW if self._tracks_laplace_gap(params, layout) else 0,), np.nan),
            snapshot={b.loc: params[b.loc] for b in layout.blocks if b.kind in (DIAGONAL, FULL)},
            curvature_noise={b.loc: full((int(np.prod(np.shape(params[b.loc]))),), 0)
                             for b in layout.blocks if b.kind in (DIAGONAL, FULL)} if draws > 1 else {},
            curvature_switched=full((0,) if draws < 2 else (), False, bool),
        )
        return params, state

    def rerun_optimizer(self, state):
        """The optimizer to rerun a finished fit with, or ``None`` to keep it (``SVI.run``, ``nb.fit``).

        With ``curvature_draws=None`` (the default): ``nb.BLR(curvature_draws=8)`` with this one's other options
        where the run's steps found the one-draw curvature too noisy (:meth:`_curvature_draws`) and its end-of-run
        report finds a problem (a loss still falling, a divergence, ...). ``state`` is the optimizer's state
        (``svi_result.state.optim_state``)."""
        if not self.draws_on_rerun:
            return None
        i, s = state
        switched = getattr(getattr(s, "algorithm", None), "curvature_switched", None)
        if switched is None or np.shape(switched) != () or isinstance(switched, jax.core.Tracer) or not bool(switched):
            return None
        if not int(i):  # no step taken
            return None
        if not self.algorithm.report((i, s), self):
            return None
        return self.with_curvature_draws(self.curvature_draws)

    def with_curvature_draws(self, draws):
        """A copy of this optimizer with ``curvature_draws=draws`` (its steps averaging from the switch on)."""
        new = self._rebound()
        new.draws_on_rerun = False
        new.curvature_draws = int(draws)
        return new

    def keep_rerun(self, first, second):
        """Whether the rerun's fit replaces the first (``first``, ``second``: ``(optim_state, losses)``): unless
        its report finds a problem too and the first fit's average loss over its last tenth of steps is lower (a
        non-finite average counts as infinite)."""
        (_, losses), (state2, losses2) = first, second
        if not self.algorithm.report(state2, self):
            return True

        def tail(losses):
            x = np.asarray(losses, np.float64)
            x = x[-max(1, x.size // 10):]
            return float(np.mean(x)) if np.all(np.isfinite(x)) else np.inf

        return not tail(losses) < tail(losses2)

    def _draws(self, params, layout):
        """How many draws of the exact Hessian a step averages while its one-draw curvature is too noisy
        (:meth:`_curvature_draws`): ``curvature_draws`` with the exact Hessian at a sample, else 1."""
        if self.curvature_draws < 2 or self.delta or self.hessian_for(params, layout) != "autodiff":
            return 1
        return self.curvature_draws if any(b.kind in (DIAGONAL, FULL) for b in layout.blocks) else 1

    def _result(self, state, params):
        """The parameters ``get_params`` returns: with :class:`adaptive_decay`'s averaging, the Gaussian
        blocks hold the average of the iterates' means and scales or Cholesky factors, the
        exponential-family blocks that of their natural parameters."""
        if not state.average:
            return params
        out = dict(params)
        for b in self._averaged(params, self.layout(params)):
            if b.kind == EXPFAM:  # the average of the natural parameters, back in the raw ones
                out.update(expfam_blocks.from_natural_parameters(b, [state.average[n] for n in b.names], params))
                continue
            out[b.loc] = state.average[b.loc]
            out[b.scale] = apply_transform(b, state.average[b.scale], inverse=True)
        return out

    # -- the step --------------------------------------------------------------------------
    def default_lr(self, params, layout):
        """The schedule used when ``lr`` is not given.

        ``adaptive_decay(0.5, 10)``, except with a sampled Hessian (``"price"``, ``"reparam"``) on a
        full-covariance block of dimension ``D``: a one-sample estimate of a ``D x D`` Hessian has
        noise of order ``D`` times the signal, so there it starts at ``min(0.5, 1/D)`` and halves
        over 100 noise-dominated steps.
        """
        full = [params[b.loc].shape[-1] for b in layout.blocks if b.kind == FULL]
        if full and self.hessian_for(params, layout) in ("price", "reparam", "hutchinson"):
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

    def _propose(self, fn, params, s, layout, i, forward_mode):
        """One BLR step over the guide's blocks (the adapter, :class:`~numpyro_blr.svi.GuideOptimizer`,
        updates the other parameters, checks finiteness and calls :func:`_commit`)."""
        # the loss is evaluated several times per step at one key: its parameter-free work (the draws
        # of epsilon above all) is done once (estimators.hoist_constant_work: a smaller program to compile)
        loss_fn, fn = fn, hoist_constant_work(fn, params)
        hessian = self.hessian_for(params, layout)
        gap_on = s.laplace_gap is not None and s.laplace_gap.shape[0] > 0
        # the control variate needs the sample's offset, which a loss averaged over particles does not give
        (loss, aux), grads, stats, points, joint_hess, *mean_loss = estimate(
            fn, params, layout, hessian, self.delta, forward_mode, self.point_hessian,
            with_mean_loss=self.backtrack or gap_on, control_variate=loss_particles(loss_fn) == 1,
            sample_offsets=reads_sample_offsets(loss_fn),
            key=jax.random.fold_in(jax.random.fold_in(jax.random.PRNGKey(self.seed), i), 0x7FFFFFFE),  # the probes
        )
        # The estimates pass an optimization barrier: materialised once, where XLA would otherwise fuse
        # copies of the estimator's internals (the loss's tail, the Hessian's last products) into the
        # many small kernels of the update and of the fit trace that read them. Measured on the 1000-step
        # scan: kidiq AutoMultivariateNormal 4,789 -> 3,758 optimised HLO operations (compile CPU time
        # 2.95 -> 2.69 s), ucbadmit_glmm AutoNormal 16,094 -> 10,155 (6.9 -> 5.7 s); step time unchanged.
        # The Gaussian blocks' scale gradients stay outside: no later code reads them, so XLA drops them.
        unread = {b.scale for b in layout.blocks if b.kind in (DIAGONAL, FULL)}
        kept = {k: v for k, v in grads.items() if k not in unread}
        loss, kept, stats, points, joint_hess, mean_loss = lax.optimization_barrier((loss, kept, stats, points, joint_hess, mean_loss))
        grads = {**grads, **kept}
        t = i + 1
        schedule = self.schedule(params, layout)
        adaptive = getattr(schedule, "adaptive", False)
        dtype = s.trace.clock.dtype
        lr = jnp.asarray(self.step_size(i, params, layout, s.trace.clock), dtype=dtype)
        # the step of the point masses (not averaged) and of the exponential-family blocks: these are averaged
        # too, but keep the 1/t step (their iterate is already an average of the per-step targets; with the
        # Gaussian blocks' t^-1/2 step the improved-BLR retraction's second-order term, >= 0, biased the
        # concentration upwards under the score-function noise of the time: nb.online.Stream of 6 Gamma-Poisson
        # batches ended 1.6-2.3x overconfident; the path-derivative estimate now has no noise at a conjugate
        # site's fixed point, estimators.implicit)
        gamma = lr
        averaging = bool(s.average)
        if averaging:  # the averaged Gaussian blocks step with rho_0 / sqrt(1 + c/tau)
            lr = jnp.asarray(schedule.iterate(s.trace.clock), dtype=dtype)
        new_noise, switched, draws = s.curvature_noise, s.curvature_switched, None
        if s.curvature_noise:  # several draws of the curvature once one is too noisy (_curvature_draws)
            stats, joint_hess, new_noise, switched, draws = self._curvature_draws(
                fn, params, layout, stats, joint_hess, s.curvature_noise, s.curvature_switched, lr, i, forward_mode)
        new_params, new_mom = dict(params), dict(s.momentum)
        checked = {}  # parameter name -> arrays that must be finite for its update to be valid
        direction = {}  # block handle -> whitened step direction, for the adaptive step size
        whitened_grad = {}  # loc -> whitened mean gradient L^T g of this step (loc-shaped)
        control = {}  # loc -> control variate S (z - m) subtracted from its sampled gradient
        new_scales = {}  # scale name -> the block's new s or L (the averaging's target)

        joint = self._joint_diagonal(params, layout)
        new_mean_tril = s.mean_scale_tril
        if joint:
            new_mean_tril = self._joint_mean_step(
                joint, params, stats, joint_hess, s, lr, t, new_params, new_mom, direction, whitened_grad, control
            )

        for j, b in enumerate(layout.blocks):
            if b.kind == EXPFAM:  # ExpFamilyGuide's Gamma/Beta/Dirichlet/Bernoulli/Categorical sites
                key = jax.random.fold_in(jax.random.fold_in(jax.random.PRNGKey(self.seed), i), j)
                new = expfam_blocks.update_block(  # the loss itself, not its hoisted copy
                    b, loss_fn, params, grads, gamma, self.improved != "plain", key,
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
                    new_scales[b.scale] = lax.rsqrt(prec)
                    new_params[b.scale] = b.transform.inv(new_scales[b.scale])
                    curvature = [(scale**2 * st.h - 1.0).reshape(-1)]
                else:
                    prec, curvature = scale**-2, []
                if b in joint:  # mean already stepped with the joint preconditioner
                    direction[b.loc] = jnp.concatenate([direction[b.loc]] + curvature)
                else:
                    if st.control is not None:  # the estimator's own (estimators.svi.sample_control)
                        control[b.loc] = st.control
                        g = g - control[b.loc]
                    elif st.offset is not None:
                        control[b.loc] = finite_or_zero(st.offset / scale**2)
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
                    control[b.loc] = finite_or_zero(solve_triangular(tril.T, whitened, lower=False))
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
                    new_scales[b.scale] = new_tril
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
                loss0 = mean_loss[0] if self.delta else loss  # the delta method compares losses at the mean
                damping = self._backtrack(fn, params, new_params, locs, loss0, control, self.delta and layout,
                                          draws=draws and (layout,) + draws)
                for n in locs:
                    new_params[n] = params[n] + damping.astype(params[n].dtype) * (new_params[n] - params[n])

        new_gap = s.laplace_gap
        if gap_on:  # one draw of E_q[l] - l(m) - D/2 from the two losses at this step's key (no evaluation added)
            log_det, dim = jnp.zeros((), dtype), 0
            for b in layout.blocks:
                if b.kind == DIAGONAL:
                    log_det = log_det + jnp.sum(jnp.log(b.transform(params[b.scale]))).astype(dtype)
                elif b.kind == FULL:
                    log_det = log_det + jnp.sum(jnp.log(jnp.diagonal(b.transform(params[b.scale])))).astype(dtype)
                else:
                    continue
                dim += int(np.prod(params[b.loc].shape))
            draw = jnp.asarray(laplace_gap_from_losses(loss, mean_loss[0], log_det, dim), s.laplace_gap.dtype)
            new_gap = s.laplace_gap.at[i % s.laplace_gap.shape[0]].set(jnp.where(jnp.isfinite(draw), draw, jnp.nan))

        skipped = None
        if adaptive:  # a skipped step halves the averaged blocks' rho (without averaging: the one step size)
            skipped = schedule.skipped if averaging else (lambda c: 2.0 * c + schedule.halving_steps)
        proposed = s._replace(momentum=new_mom, point_precision=new_point_prec, mean_scale_tril=new_mean_tril,
                              laplace_gap=new_gap, curvature_noise=new_noise, curvature_switched=switched)
        target = self._guide_moments(new_params, self._averaged(params, layout), new_scales) if averaging else {}

        def finish(old, ok):
            """The state once the adapter knows whether the step was finite: the trace records the step
            either way (a skipped step advances the clock, halving rho); the rest is kept only if ``ok``."""
            trace = next_trace(old.trace, i, ok, loss, lr, direction, whitened_grad, skipped, damping)
            average = old.average
            if averaging:  # Polyak-Ruppert: the exponential average of the iterates, weight rho_0 / (1 + c/tau)
                weight = jnp.asarray(schedule(trace.clock), dtype=dtype)
                average = {n: a + weight.astype(a.dtype) * (target[n] - a) for n, a in old.average.items()}
            new = proposed._replace(trace=trace, average=average)
            if old.snapshot:  # the means when the report's last block of losses began
                now = {n: average[n] if n in average else new_params[n] for n in old.snapshot}
                new = new._replace(snapshot={n: jnp.where(is_block_end(i), now[n], v) for n, v in old.snapshot.items()})
            return jax.tree.map(lambda a, b: jnp.where(ok, a, b), new, old._replace(trace=trace))

        return GuideStep(loss=loss, aux=aux, grads=grads, params=new_params, state=finish, checked=checked)

    def _curvature_draws(self, fn, params, layout, stats, joint_hess, noise, switched, lr, i, forward_mode):
        r"""The exact Hessian and the mean gradient averaged over :math:`K` draws of :math:`q` (``curvature_draws``)
        once the one-draw curvature has shown the heavy negative tail that biases the precision step.

        **The bias.** With one draw :math:`z \sim q`, :math:`\hat H = \nabla^2\ell(z)` is unbiased, but the precision
        step is not linear in it. In whitened coordinates (:math:`S = I`, :math:`M = L^\top\hat H L`) the one-sided
        rule (:mod:`numpyro_blr.rules.blr`) maps :math:`b = 1 + \rho(M - 1)` to :math:`k(b) = b + \tfrac12(1-b)^2`
        where :math:`b < 1` (for a dense block: in every direction, once one eigenvalue of :math:`B` is below
        :math:`1/2`), so its fixed point :math:`\mathbb E[k(b)] = 1` is not :math:`\mathbb E[M] = 1` but

        .. math:: \mathbb E[M_{ii}] = 1 - \tfrac\rho2\,\mathbb E\big[(1 - M_{ii})^2\,\mathbb 1_{b_i<1}\big]:

        the precision is too high by the relative amount :math:`\tfrac\rho2\mathbb E[(1-M_{ii})^2\mathbb 1_{b_i<1}]`.
        Where the model's Hessian is positive semi-definite at every draw (log-concave models: the GLMs with
        Gaussian priors) the improved branch only sees :math:`0 \le M < 1` and this is at most :math:`\rho/2` of a
        step that averages itself out. A draw with negative curvature, :math:`M_{ii} < 0`, has no such bound: on
        hierarchical log-scales :math:`\partial^2\ell/\partial\log\tau^2` contains
        :math:`e^{\log\tau}\beta\,\partial\ell/\partial\beta`, negative in 10-18% of draws down to :math:`M = -12`;
        the bias then grows with that tail's second moment, the scales it feeds collapse and the means they hold
        drift (docs/robustness.md: 10 nats short after 1,000 steps, the loss still falling). Averaging
        :math:`K` independent draws divides the variance of :math:`\hat H` (hence this bias) by :math:`K` and leaves
        the fixed point :math:`\mathbb E_q[\nabla^2\ell] = S` unchanged.

        **When.** Each step reads its own (first) draw's negative curvature beyond rounding,
        :math:`n_i = (-M_{ii})_+` with :math:`M_{ii} = s_i^2\hat h_i` or the diagonal of :math:`L^\top\hat H L` (less
        :math:`64\varepsilon\sum_{jk}|L_{ji}\hat H_{jk}L_{ki}|`), into a running average :math:`\nu_i` of
        :math:`n_i^2` (weight ``NOISE_WEIGHT``, corrected for its zero start as Adam's). The bias that negative curvature
        alone puts into the fixed point, :math:`\tfrac\rho2\nu_i`, is compared with ``NOISE_TOLERANCE`` (5%) using
        the draws before this step (so that the choice does not depend on the draw it averages); the first time
        it is exceeded, in any coordinate, the run switches to :math:`K` draws for good: the heavy tail is a
        property of the model, and the precision it biased is rebuilt only if the averaging continues. A model whose
        single-draw curvature is never negative (log-concave models) never switches: its steps, results and cost
        are those of before. On the robustness suite (bench/bench_robustness.py, 1,000 steps) the runs that switch
        are ``hierarchical_scales_logistic`` (within its first 20 steps), ``ucbadmit_glmm``, ``gp_pois_regr`` and
        ``sblri_blr`` with ``AutoMultivariateNormal`` (the noise scale's coupling to the coefficients makes its
        Hessian indefinite at some draws); the other 16 cases' rows are unchanged.

        **How.** Draw :math:`k = 1..K-1` moves the means to :math:`m + \sqrt{1-c^2}\,L\varepsilon'_k` and shrinks
        the scales to :math:`cL` (:func:`~numpyro_blr.estimators.svi.shifted_draw_params`, :math:`c` =
        ``BASELINE_SHRINK``), so the loss, at its own fixed :math:`\varepsilon`, evaluates the exact draw
        :math:`z_k = m + L(\sqrt{1-c^2}\,\varepsilon'_k + c\varepsilon)` of :math:`q`; its gradient and Hessian w.r.t.
        the means are :math:`\nabla\ell(z_k)` and :math:`\nabla^2\ell(z_k)` (the guide's :math:`\log q` does not
        depend on its means; :func:`~numpyro_blr.estimators.svi.extra_draws`, one ``vmap``). The step uses
        :math:`\bar H = \tfrac1K\sum_k\nabla^2\ell(z_k)` (the dense joint Hessian of a mean-field guide too),
        :math:`\bar g = \tfrac1K\sum_k\nabla\ell(z_k)` and the average offset :math:`\overline{z - m}`, so that the
        control variate :math:`S\,\overline{z - m}` (zero mean) and the backtracking of the mean step (on the
        average of the :math:`K` losses, :meth:`_backtrack`) are those of a :math:`K`-sample step: on a quadratic
        loss every draw gives the same :math:`\nabla\ell(z_k) - S(z_k - m)`, and the step is exactly the one-draw
        step. A draw whose loss, gradient or Hessian is not finite is left out of the average. The loss
        reported is still the first draw's ELBO sample. Inside ``lax.cond``: the steps before the switch do not
        pay for the draws (on ``hierarchical_scales_logistic`` they take 1,000 steps from 0.3-0.4 s to 1.0-1.3 s).

        Returns ``(stats, joint_hess, noise, switched, draws)``, ``draws = (used, K, shifts, losses)`` for
        :meth:`_backtrack` (``losses`` NaN for the draws left out).
        """
        K = self._draws(params, layout)
        gauss = [b for b in layout.blocks if b.kind in (DIAGONAL, FULL)]
        # the decision, from the draws before this one (the running averages corrected for their zero start)
        dt = noise[gauss[0].loc].dtype
        corr = jnp.maximum(1.0 - (1.0 - NOISE_WEIGHT) ** jnp.asarray(i, dt), NOISE_WEIGHT)
        worst = jnp.max(jnp.stack([jnp.max(v) for v in noise.values()])) / corr
        used = switched | (0.5 * lr.astype(dt) * worst > NOISE_TOLERANCE)
        new_noise = {}
        for b in gauss:
            st = stats[b.loc]
            if b.kind == DIAGONAL:
                negative = jnp.maximum(-(b.transform(params[b.scale]) ** 2 * st.h).reshape(-1), 0.0)
            else:  # the diagonal of L^T H L, negative beyond its rounding
                tril = b.transform(params[b.scale])
                m = jnp.einsum("ji,jk,ki->i", tril, st.h, tril)
                size = jnp.einsum("ji,jk,ki->i", jnp.abs(tril), jnp.abs(st.h), jnp.abs(tril))
                negative = jnp.maximum(-m - 64.0 * jnp.finfo(m.dtype).eps * size, 0.0)
            x = (negative**2).astype(dt)
            x = jnp.where(jnp.isfinite(x), x, noise[b.loc])
            new_noise[b.loc] = noise[b.loc] + NOISE_WEIGHT * (x - noise[b.loc])
        if self.draws_on_rerun:  # the default: the decision is recorded (rerun_optimizer reads it), the step is one draw's
            return stats, joint_hess, new_noise, used, None
        names = sorted(b.loc for b in gauss)
        offsets, start = {}, 0
        for n in names:
            size = params[n].size
            offsets[n] = (start, start + size)
            start += size
        diag = [b.loc for b in gauss if b.kind == DIAGONAL]
        key = jax.random.fold_in(jax.random.fold_in(jax.random.PRNGKey(self.seed), i), 0x7FFFFFFF)  # apart from the expfam blocks' keys

        def averaged(_):
            losses, g_k, h_k, dz_k = extra_draws(fn, params, layout, key, K - 1, forward_mode)
            # a draw whose loss, gradient or Hessian is not finite (a model's Cholesky that fails far in the
            # tail) is left out of the average, not the step
            finite = jnp.isfinite(losses) & jnp.all(jnp.isfinite(h_k.reshape(K - 1, -1)), axis=1)
            for n in names:
                finite = finite & jnp.all(jnp.isfinite(g_k[n].reshape(K - 1, -1)), axis=1)
            count = 1.0 + jnp.sum(finite)

            def total(x):  # the sum over the finite draws
                w = finite.reshape((-1,) + (1,) * (x.ndim - 1))
                return jnp.sum(jnp.where(w, x, 0.0), 0)

            h_sum = total(h_k)
            out = dict(stats)
            for b in gauss:
                st = stats[b.loc]
                lo, hi = offsets[b.loc]
                sub = h_sum[lo:hi, lo:hi]
                extra = jnp.diagonal(sub).reshape(st.g.shape) if b.kind == DIAGONAL else sub
                n_b = count.astype(st.g.dtype)
                offset = st.offset
                if offset is not None:  # z_k - m = sqrt(1 - c^2) L eps'_k + c (z - m)
                    offset = (offset * (1.0 + BASELINE_SHRINK * (n_b - 1.0)) + total(dz_k[b.loc])) / n_b
                out[b.loc] = st._replace(g=(st.g + total(g_k[b.loc])) / n_b, h=(st.h + extra) / n_b, offset=offset)
            joint = joint_hess
            if joint is not None:
                idx = np.concatenate([np.arange(*offsets[n]) for n in diag])
                joint = (joint + h_sum[np.ix_(idx, idx)]) / count.astype(joint.dtype)
            return out, joint, dz_k, jnp.where(finite, losses, jnp.nan)

        def single(_):
            dz = {b.loc: jnp.zeros((K - 1,) + jnp.shape(params[b.loc]), jnp.result_type(params[b.loc])) for b in gauss}
            return stats, joint_hess, dz, jnp.full((K - 1,), jnp.nan, jnp.result_type(stats[gauss[0].loc].g))

        stats, joint_hess, dz, losses = lax.cond(used, averaged, single, None)
        return stats, joint_hess, new_noise, used, (used, K, dz, losses)

    @staticmethod
    def _backtrack(fn, params, new_params, locs, loss, control, mean_layout=None, shrink=0.25, tries=BACKTRACK_TRIES,
                   draws=None):
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
        delta method (``mean_layout``), :math:`f` is the loss at the mean, and ``loss`` is :math:`f(m)`
        (the estimate's evaluation: ``estimate(..., with_mean_loss=True)``). One loss evaluation per try.
        ``draws`` (``(layout, used, K, shifts, losses)``, :meth:`_curvature_draws`): where ``used``, :math:`f` is the
        average of the losses at the step's :math:`K` draws (``losses`` those of the other draws at the step's
        start), the objective whose gradient and control variate the step used; :math:`K` evaluations per try.
        """
        delta = {n: new_params[n] - params[n] for n in locs}
        at = (lambda p: at_mean(p, mean_layout)) if mean_layout else (lambda p: p)
        loss0 = jnp.asarray(loss)
        slope = sum((jnp.sum(delta[n] * control[n]) for n in control), jnp.zeros((), loss0.dtype))

        def value(alpha):
            p = dict(params)
            for n in locs:
                p[n] = params[n] + alpha.astype(params[n].dtype) * delta[n]
            v = jnp.asarray(fn(at(p))[0], loss0.dtype)
            if draws is not None:
                layout, used, k, shifts, _ = draws
                root = jnp.sqrt(1.0 - BASELINE_SHRINK**2)

                kept = jnp.isfinite(jnp.asarray(draws[4]))  # the draws in the step's average

                def others(_):
                    one = lambda sh: fn(shifted_draw_params(p, layout, {n: (root * d).astype(d.dtype) for n, d in sh.items()}))[0]
                    return jnp.sum(jnp.where(kept, jnp.asarray(jax.vmap(one)(shifts), loss0.dtype), 0.0))

                v = (v + lax.cond(used, others, lambda _: jnp.zeros((), loss0.dtype), None)) / (1.0 + jnp.sum(kept))
            return v - alpha * slope

        if mean_layout:
            # the loss at the mean carries log q at scale eps^2: D |log eps^2| nats (72 per number in float64) that
            # cancel between the two evaluations, but whose rounding (here from the Hessian's forward-mode trace,
            # there from a plain one) is far above 4 ulps of the total; at a converged mode the step is below
            # rounding, and without this every step read as a rise (a converged nb.laplace() fit reported as damped)
            dim = sum(int(np.prod(params[b.loc].shape)) for b in mean_layout.blocks if b.kind in (DIAGONAL, FULL))
            eps = jnp.finfo(loss0.dtype).eps
            loss0 = loss0 + 16.0 * eps * (jnp.abs(loss0) + dim * 2.0 * jnp.abs(jnp.log(eps)))
        if draws is not None:  # the average of the K losses at the step's start
            losses = jnp.asarray(draws[4], loss0.dtype)
            kept = jnp.isfinite(losses)  # NaN: a draw left out of the step's average (or none drawn)
            count = 1.0 + jnp.sum(kept)
            scale = jnp.abs(loss0) + jnp.sum(jnp.where(kept, jnp.abs(losses), 0.0))
            loss0 = (loss0 + jnp.sum(jnp.where(kept, losses, 0.0))) / count
            # each loss is read again in another trace (vmapped, not under jacfwd): allow for its rounding
            loss0 = loss0 + 16.0 * jnp.finfo(loss0.dtype).eps * scale / count
        return backtracking_factor(value, loss0, shrink, tries)

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
            cv = finite_or_zero(solve_triangular(tril.T, solve_triangular(tril, offset, lower=True), lower=False))
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


def _commit(old, finish, ok):
    """The BLR's proposal is a function of whether the adapter keeps the step (:meth:`BLR._propose`)."""
    return finish(old, ok)


def _report(state, optimizer):
    """``(key, message)`` for each problem :func:`numpyro_blr.fit_report` finds (the messages carry the
    step count, so each is shown once per run by Python's warning registry)."""
    report = fit_report(state, optimizer=optimizer)
    return list(zip(report.problem_keys, report.problems))
