r"""What a :class:`~numpyro_blr.BLR` run says about itself: :func:`fit_report`.

Every BLR step updates a :class:`FitTrace` (:func:`next_trace`) in the optimizer state (fixed-shape
arrays, no host round-trip). At the end of ``SVI.run`` (or on the caller's ``svi.get_params``)
``BLR.get_params`` turns it into a report and warns about each problem it finds (Python's default
filter shows a message once; the messages carry the step count), naming the
parameters (and, with the guide, the sites) concerned and the one change that fixes it:

* **skipped steps**: a non-finite loss, gradient or update; the step kept the last finite values
  and, with the default adaptive step size, halved :math:`\rho`;
* **divergence**: the running average of the loss ended far above its best value (by more than
  ``DIVERGENCE_NATS`` nats, ``DIVERGENCE_SDS`` times the loss's noise sd when the best was
  reached, and ``DIVERGENCE_FRACTION`` of the best value: the losses of the first steps from a
  far initialisation swing by tens of percent without anything going wrong);
* **not converged**: some mean's whitened gradient :math:`u = L^\top\hat g` (the distance to the
  optimum in posterior standard deviations, for a Gaussian posterior) keeps its sign from step
  to step (``FitTrace.persistence`` above ``UNCONVERGED_PERSISTENCE``; Monte Carlo noise gives
  0 +- 0.16) while its geometric average is above ``UNCONVERGED_SDS``;
* **collapsed variance**: a standard deviation at the rounding level of its mean
  (below ``COLLAPSE_EPS`` machine epsilons times :math:`|m|`: :func:`collapsed_sd`);
* **unbounded variance**: a standard deviation above ``DIFFUSE_SD`` times :math:`\max(1, |m|)`: no term of the
  model's density depends on the coordinate (its curvature is 0, so the precision decays by :math:`1-\rho` per
  step and the entropy term lowers the loss without end), as in the entries at observed rows of the
  ``<site>_unobserved`` latent that ``obs_mask`` creates; the "still falling" check is then left out (that loss
  falls for this reason);
* **ill-conditioned for the dtype**: the condition number :math:`\kappa` of the posterior's correlation
  matrix (read off the guide's full covariance, or off the dense precision that preconditions a
  mean-field guide's mean step; blocks up to ``CONDITION_MAX_DIM`` numbers) exceeds ``ILL_CONDITIONED`` over the machine epsilon: a relative
  perturbation of order :math:`\varepsilon` then moves the narrowest direction by more than itself,
  and a fit can end far off with no other sign. Its scale does not count (floating point is
  relative per coordinate: a design multiplied by 1e3 is no harder), its correlations do: on the
  robustness bench the collinear design has :math:`\kappa \approx 2\times10^8`, every other case at
  most :math:`6.4\times10^4`, and only that one fails in float32 (:math:`1/\varepsilon = 8.4\times10^6`);
  a float32 regression with :math:`\kappa = 3\times10^6` still ends with means within 0.002 sd and
  sds 4% low;
* **too short to judge**: a run of fewer than ``MIN_STEPS`` steps, where the convergence checks above
  (averages over the steps) have nothing to go on, says so instead of finding no problem;
* **still damped**: backtracking (:meth:`~numpyro_blr.BLR._backtrack`) still shortened the mean
  step on more than ``DAMPED_FRACTION`` of the recent steps (``FitTrace.damped_recent``): the
  local quadratic model of the loss keeps failing where the fit ended. Steps damped early in a
  run, while the fit travels from a far initialisation, are the mechanism working as intended
  and are only counted in the report's summary line;
* **still falling**: the average loss of the run's last block of steps (from the last power-of-two step
  count on, ``FitTrace.loss_blocks``) is more than ``STILL_FALLING_NATS`` nats and ``STILL_FALLING_SES``
  standard errors below that of the block before it (steps 512-1,000 against 256-511 in a 1,000-step
  run): the fit is still improving, whatever the other checks say. It catches the drift that the
  step-size clock and the sign test miss when single-sample curvature noise swamps it (the
  per-coefficient log-scales of ``hierarchical_scales_logistic``, bench/robustness_cases.py: the ELBO
  still rises by tens of nats from step 500 to 3,000 while every whitened gradient reads as noise),
  naming the sites whose means moved most since the last block began. The same comparison is also made on
  the losses winsorised at their running average +- ``CLIP_SDS`` running sds (``FitTrace.loss_blocks_clipped``),
  and either firing reports: a few far draws on a log-scale site (single losses of 300-730 nats against a
  median near 100, float32 ``AutoNormal`` on that case) set the plain blocks' standard error (a drop of
  3.6 +- 2.5 nats, silent before) where the winsorised ones still show the drift (5.0 +- 1.3); the band follows
  the winsorised losses (``FitTrace.loss_band``), so that a burst of far losses does not widen it, and their drop
  must exceed ``STILL_FALLING_CLIPPED_NATS``. A drop
  is only reported when some mean also moved at least ``MOVED_SDS`` sds since the last block began, or the
  drop exceeds ``STILL_FALLING_ALONE_NATS``: the losses are those of the iterates, which jitter around the
  optimum less as the step size decays, so their average can fall by a few nats while the returned (averaged)
  fit stays where it is (float32 ``AutoMultivariateNormal`` on that case: 2.24 +- 0.74 nats, the means moved
  at most 0.17 sd, the averaged parameters' ELBO -71.34 at step 500 and -71.24 at step 1,000); the fits still
  drifting moved their means 1.7-5 sds;
* **a Laplace approximation far from Gaussian** (the delta method with a curvature: ``nb.laplace()``,
  ``nb.newton()``, ``nb.BLR(delta=True)``): the guide is then Gaussian at the mode with the curvature
  there, which is the best Gaussian only for a Gaussian posterior. The run records
  :math:`\delta = \mathbb E_q[\ell] - \ell(m) - D/2` (:func:`~numpyro_blr.estimators.gaussian.laplace_gap`;
  0 for a Gaussian posterior), the nats by which the ELBO of :math:`q` falls short of the Laplace
  evidence, one draw per step from the two losses the step evaluates anyway
  (:func:`~numpyro_blr.estimators.gaussian.laplace_gap_from_losses`). When its mean over the last
  steps exceeds ``LAPLACE_GAP_NATS`` (and ``LAPLACE_GAP_SES`` standard errors) the report says so,
  naming the sites and ``nb.BLR()``'s defaults (the ELBO's Gaussian) as the fix.
"""

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from numpyro_blr.layout import DIAGONAL, FULL, apply_transform
from numpyro_blr.rules.schedules import clock_advance

DIVERGENCE_NATS = 10.0
DIVERGENCE_SDS = 6.0
DIVERGENCE_FRACTION = 0.25
UNCONVERGED_SDS = 1.0
UNCONVERGED_PERSISTENCE = 0.7
COLLAPSE_EPS = 10.0
DIFFUSE_SD = 1e6  # a guide sd this many times max(1, |mean|): no density holds the coordinate (an unbounded ELBO;
# such sds grow about 1e4-fold per 50 steps, so 100-200 steps pass it; a real posterior would need its mean within
# 1e-6 sds of 0 and an sd above 1e6)
ILL_CONDITIONED = 1.0  # kappa * eps above which the correlation matrix's narrowest direction is not resolved
CONDITION_MAX_DIM = 256  # larger dense blocks are not checked: an eigendecomposition on the host at every get_params (5 ms at 256)
MIN_STEPS = 10  # no verdict on convergence before this many steps: a shorter run is reported as too short to judge
DAMPED_FRACTION = 0.3
STILL_FALLING_NATS = 1.5  # the mean loss of the last block of steps this far below the previous one: not converged (healthy runs of the suite: at most 0.61)
STILL_FALLING_CLIPPED_NATS = 2.0  # the same for the losses winsorised in the trace's own band (FitTrace.loss_band): it
# clips the heavy right tail of log-scale models harder, and the jitter that a decaying step size takes out of the
# iterates' losses then reads as a significant drop of up to 1.56 nats on converged fits (float64, 1,000 steps:
# hierarchical_scales_logistic AutoMultivariateNormal 1.56 +- 0.40, the horseshoe 1.33 +- 0.25; 3,000 steps raise
# their ELBOs by 0.1 nats or less); fits still drifting dropped 3.6-67.5 nats, the digits softmax regression 50
STILL_FALLING_SES = 3.0  # ... by this many standard errors (the nats threshold keeps healthy runs out: at most 0.5 nats on the suite)
STILL_FALLING_MIN = 32  # ... with at least this many losses in the previous block
MOVED_SDS = 0.5  # a site whose mean moved this many posterior sds since the last block began is named; a loss
# still falling with no mean moved that far is the step size's decay (see STILL_FALLING_ALONE_NATS)
STILL_FALLING_ALONE_NATS = 10.0  # a drop this large is reported even with the means still (a drift of the sds alone);
# measured: the decay alone gave 2.24 +- 0.74 nats (float32 hierarchical_scales_logistic, AutoMultivariateNormal, means
# moved at most 0.17 sd), fits still drifting 3.6-67.5 nats with means moved 1.7-5 sd
CLIP_SDS = 2.0  # loss_blocks_clipped: losses winsorised at the running average +- this many running sds (issue 25: see FitTrace)
LAPLACE_GAP_NATS = 1.0  # mean Laplace gap (nats) above which a delta-method fit is reported as far from Gaussian
LAPLACE_GAP_SES = 2.0  # ... and this many standard errors above 0 (one-sided: the draws are heavy-tailed where it is large)


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
    ``damped``         how many mean steps backtracking shortened (``BLR``'s backtracking);
    ``damped_recent``  exponential average (weight 0.05) of whether the mean step was shortened;
    ``damping``        the last step's factor :math:`\alpha` on the mean step (1: a full step);
    ``loss_blocks``    the finite losses of two adjacent blocks of steps, ``[previous, current]``, each
                       ``[count, shift c, sum(x - c), sum((x - c)^2)]``: a block ends at every step count
                       :math:`t = 2^k \ge 16`, so at the end of a run they are its last two doublings
                       (steps 256-511 and 512-1000 of a 1,000-step run): whether the loss still falls
                       (:func:`fit_report`). None in a trace that does not keep them.
    ``loss_blocks_clipped``  the same blocks of the losses winsorised at ``loss_avg`` +- ``CLIP_SDS`` times
                       ``sqrt(loss_var)`` (the trace's values before the step's loss): the losses' heavy right
                       tail (a draw far out on a log-scale site) swamps the plain blocks' mean and standard
                       error, where the winsorised ones still show the drift; between two blocks of one
                       stationary run both are clipped alike, so a converged fit's drop stays near 0 (at most
                       0.66 nats on the robustness suite, both precisions). None in a trace that does not keep them.
    ``loss_band``      ``[centre, variance]`` of the winsorising band, when the trace keeps one of its own
                       (:func:`empty_loss_band`): exponential averages (weight 0.1) of the *winsorised* losses, so a
                       burst of far losses cannot widen the band that clips it (Huber's recursion). The plain
                       ``loss_avg`` +- ``loss_var`` band followed such a burst: on a digits softmax regression (650
                       weights, ``AutoNormal``) one step's loss of 4,185 against about 800, decaying over 20 steps,
                       widened it until the winsorised blocks read 15 +- 22 nats of drop where the fit was still
                       falling 49 +- 11 nats (this band), 35 nats short of its optimum. Its variance can grow by at
                       most 1.3x per step (a deviation is clipped at ``CLIP_SDS`` = 2 sds), so a real rise of the
                       noise is followed within tens of steps. None: the band of ``loss_avg`` and ``loss_var``.
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
    loss_blocks: jax.Array = None
    loss_blocks_clipped: jax.Array = None
    loss_band: jax.Array = None


BLOCK_START = 16  # the first step count at which a block of losses ends (loss_blocks)


def collapse_floor(dtype):
    r"""The smallest :math:`|m|` the collapsed-variance check (:func:`collapsed_sd`) measures a standard deviation
    against: the square root of the dtype's smallest normal number (1.1e-19 in float32), so that a mean at zero does
    not hide a variance that collapses without end."""
    return float(np.sqrt(np.finfo(dtype).tiny))


def collapsed_sd(sd, mean, dtype):
    r"""Where a guide's standard deviation is at the rounding level of its mean, :math:`s <` ``COLLAPSE_EPS``
    :math:`\epsilon\max(|m|, f)` (:math:`\epsilon` the dtype's machine epsilon, :math:`f` = :func:`collapse_floor`):
    the guide can no longer represent the spread (or the posterior there is degenerate). The check of ``nb.BLR``,
    ``nb.LieGroupBLR`` and ``nb.IVON`` under SVI. It used :math:`\max(1, |m|)` before: a posterior sd of 1e-6 about a
    mean of 1e-3 (a coefficient of a predictor in the thousands, the robustness suite's float32 ``sblri_X1e3``) was
    reported as collapsed, though the mean's rounding level there is 1.2e-10."""
    return np.asarray(sd) < COLLAPSE_EPS * np.finfo(dtype).eps * np.maximum(np.abs(np.asarray(mean, float)),
                                                                              collapse_floor(dtype))


def empty_loss_blocks(dtype):
    """The initial ``FitTrace.loss_blocks`` (no loss yet in either block)."""
    return jax.device_put(np.zeros((2, 4), dtype=dtype))


def is_block_end(i):
    """Whether step ``i`` (counted from 0) starts a new block of ``FitTrace.loss_blocks``: ``i + 1`` is a power
    of two from ``BLOCK_START`` on."""
    t = jnp.asarray(i).astype(jnp.int32) + 1
    return (t >= BLOCK_START) & (jnp.bitwise_and(t, t - 1) == 0)


def _next_loss_blocks(blocks, i, use, loss):
    """``FitTrace.loss_blocks`` after step ``i``: a new block from each power-of-two step count, and ``loss``
    added to the current one where ``use`` (a finite loss of a kept step)."""
    boundary = is_block_end(i)
    prev = jnp.where(boundary, blocks[1], blocks[0])
    cur = jnp.where(boundary, jnp.zeros_like(blocks[1]), blocks[1])
    x = jnp.asarray(loss, blocks.dtype)
    c = jnp.where(cur[0] == 0, x, cur[1])
    d = jnp.where(use, x - c, 0.0)
    added = jnp.stack([cur[0] + 1, c, cur[2] + d, cur[3] + d * d])
    return jnp.stack([prev, jnp.where(use, added, cur)])


def empty_loss_band(dtype):
    """The initial :class:`FitTrace` ``loss_band``: no centre yet (NaN), no spread."""
    return jax.device_put(np.array([np.nan, 0.0], dtype=dtype))


def _next_loss_band(band, loss, keep):
    """``(band after this loss, the loss winsorised in the band before it)``: ``band`` ``[centre, variance]`` follows
    the winsorised losses (:class:`FitTrace`'s ``loss_band``); the first finite loss sets the centre."""
    avg, var = band[0], band[1]
    clipped = _clipped_loss(loss, avg, var)
    first = jnp.isnan(avg)
    new_avg = jnp.where(first, clipped, 0.9 * avg + 0.1 * clipped)
    new_var = jnp.where(first, 0.0, 0.9 * var + 0.1 * (clipped - avg) ** 2)
    new = jnp.stack([new_avg, new_var]).astype(band.dtype)
    return jnp.where(keep, new, band), clipped


def _clipped_loss(loss, avg, var):
    """``loss`` winsorised at ``avg +- CLIP_SDS sqrt(var)`` (the exponential averages before it); unchanged while
    there is no spread yet (the first steps, or a deterministic loss)."""
    x = jnp.asarray(loss, avg.dtype)
    sd = jnp.sqrt(jnp.maximum(var, 0.0))
    ready = jnp.isfinite(avg) & (sd > 0)
    lo = jnp.where(ready, avg - CLIP_SDS * sd, -jnp.inf)
    hi = jnp.where(ready, avg + CLIP_SDS * sd, jnp.inf)
    return jnp.clip(x, lo, hi)


def next_trace(trace, i, ok, loss, lr, direction, whitened_grad, skipped, damping):
    """The run's evidence after this step; with the adaptive step size (``skipped``: the clock
    after a skipped step, as a function of the clock), its clock too."""
    short = damping < 1
    v = jnp.concatenate([direction[k] for k in sorted(direction)]) if direction else trace.direction
    v = v.astype(trace.direction.dtype)
    clock, halvings = trace.clock, trace.halvings
    if skipped is not None:
        advance = clock_advance(v, trace.direction, i)  # Kesten's rule
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
    band = trace.loss_band
    if band is None:  # a trace without a band of its own: winsorise at loss_avg +- loss_var
        clipped = _clipped_loss(loss, trace.loss_avg, trace.loss_var)
    else:
        band, clipped = _next_loss_band(band, loss, ok & finite_loss)
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
        loss_blocks=None if trace.loss_blocks is None else _next_loss_blocks(trace.loss_blocks, i, ok & finite_loss, loss),
        loss_blocks_clipped=None if trace.loss_blocks_clipped is None else _next_loss_blocks(
            trace.loss_blocks_clipped, i, ok & finite_loss, clipped),
        loss_band=band,
    )


class LossTrace(NamedTuple):
    """The loss-only evidence of a run, for optimizers without :class:`FitTrace` (``nb.IVON`` under ``SVI``):
    :class:`FitTrace`'s ``loss_avg``, ``loss_var``, ``loss_best``, ``loss_best_var`` and ``loss_blocks``,
    updated by :func:`next_loss_trace` and read by :func:`loss_trace_problems` (divergence, still falling)."""

    loss_avg: jax.Array
    loss_var: jax.Array
    loss_best: jax.Array
    loss_best_var: jax.Array
    loss_blocks: jax.Array


def init_loss_trace(dtype):
    """An empty :class:`LossTrace` (NumPy constants placed with ``jax.device_put``: no program compiled)."""
    dtype = np.dtype(dtype)
    return LossTrace(*(jax.device_put(np.asarray(v, dtype)) for v in (np.nan, 0.0, np.inf, 0.0)),
                     empty_loss_blocks(dtype))


def next_loss_trace(trace, i, loss):
    """:class:`LossTrace` after a kept step ``i`` (counted from 0) with ``loss`` (as :func:`next_trace`)."""
    first = jnp.isnan(trace.loss_avg)
    finite = jnp.isfinite(loss)
    x = jnp.asarray(loss, trace.loss_avg.dtype)
    avg = jnp.where(first, x, 0.9 * trace.loss_avg + 0.1 * x)
    var = jnp.where(first, 0.0, 0.9 * trace.loss_var + 0.1 * (x - trace.loss_avg) ** 2)
    avg, var = jnp.where(finite, avg, trace.loss_avg), jnp.where(finite, var, trace.loss_var)
    new_best = finite & (avg < trace.loss_best)
    return LossTrace(avg, var, jnp.where(new_best, avg, trace.loss_best),
                     jnp.where(new_best, var, trace.loss_best_var),
                     _next_loss_blocks(trace.loss_blocks, i, finite, x))


def _is_diverged(avg, best, best_sd, steps):
    """``fit_report``'s divergence test: the loss average ended far above its best (or is not finite)."""
    if not np.isfinite(avg):
        return steps > 0
    return bool(np.isfinite(best) and avg - best > max(DIVERGENCE_NATS, DIVERGENCE_SDS * best_sd,
                                                       DIVERGENCE_FRACTION * abs(best)))


def loss_trace_problems(trace, steps, name, diverged_fix, falling_fix):
    """``[(key, message), ...]`` for what a :class:`LossTrace` shows: the run diverged, or its loss still fell at the
    end (:func:`fit_report`'s tests, with the same thresholds); ``name`` the optimizer, the fixes its advice."""
    avg, best = float(trace.loss_avg), float(trace.loss_best)
    best_sd = float(np.sqrt(float(trace.loss_best_var)))
    if steps < MIN_STEPS:
        return []
    if _is_diverged(avg, best, best_sd, steps):
        return [(("diverged", steps), f"{name} diverged: after {steps} steps the average loss ended at {avg:.6g}, "
                                      f"{avg - best:.3g} above its best value {best:.6g} in this run. {diverged_fix}")]
    drop = _loss_drop(trace.loss_blocks, steps)
    if drop is not None:
        d, se, n_prev, start_prev, start_cur = drop
        if n_prev >= STILL_FALLING_MIN and d > STILL_FALLING_NATS and d > STILL_FALLING_SES * se:
            return [(("still falling", steps), f"{name} has likely not converged after {steps} steps: the loss was still "
                     f"falling at the end, its average over steps {start_cur}-{steps} {d:.3g} +- {se:.2g} nats below that "
                     f"over steps {start_prev}-{start_cur - 1}, so the fit may be far from the optimum. {falling_fix}")]
    return []


class FitReport(NamedTuple):
    """The evidence of one run and the problems found in it (``problems``: messages, empty if none)."""

    steps: int
    skipped_steps: int
    nonfinite_parameters: list
    step_size: float
    halvings: int
    loss_average: float
    loss_best: float
    loss_sd: float
    diverged: bool
    unconverged: dict  # parameter or site -> largest whitened gradient (posterior sds)
    collapsed: list  # scale parameters at the rounding level of their means
    problems: list
    problem_keys: list  # one hashable key per problem (its kind and the names concerned), for warning once
    damped_steps: int = 0  # mean steps shortened by backtracking
    damped_recent: float = 0.0  # recent fraction of such steps (exponential average, weight 0.05)
    ill_conditioned: dict = {}  # scale parameter -> condition number of the correlations it carries (dtype-limited)
    name: str = "nb.BLR"  # the optimizer the run used (its header line)
    laplace_gap: tuple = None  # delta method: (mean, standard error, draws) of E_q[l] - l(m) - D/2 over the last steps
    loss_drop: tuple = None  # (mean loss of the previous block - of the last, its standard error, first step of each)
    loss_drop_clipped: tuple = None  # the same of the winsorised losses (FitTrace.loss_blocks_clipped)
    unread: str = None  # why the checks that read the guide's blocks were not made (None: they were)

    def __str__(self):
        lines = [
            f"{self.name} fit: {self.steps} steps, step size now {self.step_size:.3g}, loss average {self.loss_average:.6g} "
            f"(best {self.loss_best:.6g}, noise sd {self.loss_sd:.3g}), {self.skipped_steps} skipped step(s), "
            f"{self.damped_steps} mean step(s) shortened by backtracking"
        ]
        if self.laplace_gap is not None:
            lines[0] += (f", Laplace gap {self.laplace_gap[0]:.3g} +- {self.laplace_gap[1]:.2g} nats "
                         f"(last {self.laplace_gap[2]} steps)")
        lines += [f"  - {p}" for p in self.problems] or ["  no problem found"]
        if self.unread:
            lines.append(f"  (not checked: {self.unread})")
        return "\n".join(lines)


def _opt_state(obj):
    """``(step, GuideState)`` from an SVIRunResult, an SVIState or the optimizer state itself."""
    obj = getattr(obj, "state", obj)
    obj = getattr(obj, "optim_state", obj)
    if not (isinstance(obj, tuple) and len(obj) == 2 and hasattr(getattr(obj[1], "algorithm", None), "trace")):
        raise TypeError(
            "fit_report expects the result of SVI.run with nb.BLR (svi_result), its .state, or the BLR "
            f"optimizer state; got {type(obj).__name__}."
        )
    return obj


def _by_site(name, values, guide):
    """Split a per-coordinate array of ``auto_loc`` into the guide's sites when the guide can unpack it."""
    unpack = getattr(guide, "_unpack_latent", None)
    if unpack is None or values.ndim != 1:
        return {name: values}
    try:
        sites = unpack(values)
    except Exception:  # noqa: BLE001 - an uninitialised or foreign guide: report by parameter
        return {name: values}
    return {k: np.asarray(v) for k, v in sites.items()}


def correlation_condition(scale_tril):
    r"""Condition number of the correlation matrix of :math:`\Sigma = L L^\top` (computed in float64 on
    the host); ``inf`` when it is singular, NaN when :math:`L` is not finite."""
    factor = np.asarray(scale_tril, dtype=np.float64)
    if not np.all(np.isfinite(factor)):
        return float("nan")
    cov = factor @ factor.T
    sd = np.sqrt(np.diag(cov))
    if np.any(sd == 0):
        return float("inf")
    eig = np.linalg.eigvalsh(cov / np.outer(sd, sd))
    return float(eig[-1] / eig[0]) if eig[0] > 0 else float("inf")


def check_guide_params(guide, params, where, args=(), kwargs=None, unconstrained=False):
    """Raise ``ValueError`` naming the parameters where ``params`` are not ``guide``'s: a parameter the guide
    declares that ``params`` lack, or one whose shape differs (the guide of another model, or an
    ``AutoMultivariateNormal``'s parameters given with an ``AutoNormal``). ``params`` may hold more (the
    model's own ``numpyro.param``). The guide is run once with ``args``/``kwargs`` (without them, an
    autoguide that is set up still runs); a guide that cannot be run so is not checked.
    ``unconstrained``: ``params`` are SVI's unconstrained values (the optimizer state's), not
    ``svi_result.params``."""
    from numpyro import handlers
    from numpyro.distributions import constraints
    from numpyro.distributions.distribution import validation_enabled
    from numpyro.distributions.transforms import biject_to

    if guide is None or not callable(guide) or not hasattr(params, "keys"):
        return
    declared = {}  # name: the shape the guide declares (None: not an array)

    def shapes():
        # run abstractly (jax.eval_shape), without NumPyro's checks of the guide's own initial constants: run
        # eagerly, with them, a guide is tens of one-operation programs, each compiled on first use
        with handlers.block(), validation_enabled(False):
            tr = handlers.trace(handlers.seed(guide, 0)).get_trace(*args, **(kwargs or {}))
        for n, site in tr.items():
            if site["type"] != "param":
                continue
            value = site["value"]
            if hasattr(value, "shape") and unconstrained:
                value = biject_to(site["kwargs"].get("constraint", constraints.real)).inv(value)
            declared[n] = tuple(jnp.shape(value)) if hasattr(value, "shape") else None

    from numpyro_blr.compile_once import DATA_IN_PYTHON, _assign_vars, _vars_copy

    saved = _vars_copy(guide) if hasattr(guide, "prototype_trace") else None  # nothing traced is left in it
    try:
        try:
            jax.eval_shape(shapes)
        except DATA_IN_PYTHON:  # the guide (or the model it sets up from) reads a value in Python: run it eagerly
            if saved is not None:
                _assign_vars(guide, saved)
            declared.clear()
            shapes()
    except Exception:  # noqa: BLE001 - a guide that cannot run without its arguments (or not set up): not checked
        return
    finally:
        if saved is not None:
            _assign_vars(guide, saved)
    missing = sorted(n for n in declared if n not in params)
    wrong = []
    for n, want in declared.items():
        if n not in params or not hasattr(params[n], "shape") or want is None:
            continue
        if tuple(jnp.shape(params[n])) != want:
            wrong.append(f"{n!r} has shape {tuple(jnp.shape(params[n]))} where the guide's has {want}")
    if not missing and not wrong:
        return
    told = []
    if missing:
        told.append(f"the guide declares {missing}, which the parameters lack (they hold {sorted(params)})")
    if wrong:
        told.append("; ".join(wrong))
    raise ValueError(
        f"{where}: the parameters are not those of this guide ({type(guide).__name__}): {'; '.join(told)}. Is it the "
        "guide of another model, or another kind of guide? Pass the guide the parameters were fitted with."
    )


def _params_dtype(params):
    """The floating dtype of the guide's parameters (``None`` when there is none)."""
    for v in jax.tree.leaves(params):
        dtype = getattr(v, "dtype", None)
        dtype = np.dtype(dtype if dtype is not None else np.asarray(v).dtype)
        if np.issubdtype(dtype, np.floating):
            return dtype
    return None


def fit_report(result, optimizer=None, guide=None):
    """The :class:`FitReport` of a BLR run.

    :param result: ``svi_result`` (from ``SVI.run``), ``svi_state`` or the optimizer's state.
    :param optimizer: the :class:`~numpyro_blr.BLR` instance (to read the guide's blocks with its
        prefix and constraints); default ``nb.BLR()``'s.
    :param guide: the guide, to name sites inside ``AutoMultivariateNormal``/``AutoDiagonalNormal``'s
        single vector. It must be the guide the run fitted: parameters it declares that the run lacks, or
        with other shapes, raise ``ValueError`` naming them (:func:`check_guide_params`).

    A run shorter than ``MIN_STEPS`` steps is reported as too short to judge (its convergence checks are
    averages over the steps).
    """
    from numpyro_blr.liegroup_guide import LieGroupBLR, LieSVIState, liegroup_fit_report

    _, s = _opt_state(result)
    if isinstance(s.algorithm, LieSVIState):  # a LieGroupBLR run gets its own report
        return liegroup_fit_report(result, optimizer if isinstance(optimizer, LieGroupBLR) else LieGroupBLR(guide=guide))
    return evidence_report(result, optimizer, guide)


def evidence_report(result, optimizer=None, guide=None):
    """:func:`fit_report`'s checks on any run whose optimizer keeps a :class:`FitTrace` (the evidence the Lie-group
    report reads and words for its guide)."""
    from numpyro_blr.optim import BLR  # local: optim imports this module lazily

    step, s = _opt_state(result)
    optimizer = optimizer or BLR()
    if guide is not None and guide is not getattr(optimizer, "guide", None):  # the optimizer's own guide is read
        check_guide_params(guide, s.params, "fit_report", unconstrained=True)  # by its layout: no extra trace
    guide = guide if guide is not None else getattr(optimizer, "guide", None)
    tr = s.algorithm.trace
    steps = int(step)
    skipped = int(s.skipped)
    bad_params = sorted(k for k, v in s.nonfinite.items() if bool(v))
    rho, halvings = float(tr.rho), int(tr.halvings)
    avg, best, sd = float(tr.loss_avg), float(tr.loss_best), float(np.sqrt(float(tr.loss_var)))
    best_sd = float(np.sqrt(float(tr.loss_best_var)))
    problems, keys = [], []

    low_precision = _params_dtype(s.params) == np.float32
    float32 = (" In float32 an exp or a power of data on a large scale overflows far sooner (float32's largest "
               "value is 3.4e38): enable 64-bit floats (numpyro.enable_x64() at the start of the program) or put "
               "the data on a unit scale (times in years, not days; standardised predictors)."
               if low_precision else "")
    if steps and skipped >= steps:  # no step was kept: the guide is where it started, and that is all to say
        sampled = f" (its sampled losses were {best:.3g} and above)" if np.isfinite(best) else ""
        halved = f", and the step size was halved {halvings} time(s), to {rho:.3g}" if halvings else ""
        problems.append(
            f"nb.BLR kept none of its {steps} steps: at every step the loss, its gradient or the update was non-finite "
            f"(for parameter(s) {bad_params}), so the guide is still at its initial values{sampled}{halved}. Either "
            "the model's log density is not finite near those values, or it or its derivatives overflow there: by "
            "default NumPyro's autoguides start from init_to_uniform (unconstrained values uniform in (-2, 2), spread "
            "by init_scale=0.1), which puts a linear predictor far out of exp's range when predictors are in raw "
            "units (a column in the hundreds). Put the predictors on a unit scale (standardise them: a coefficient "
            "per sd instead of per unit), or start the guide where you know the log density is finite "
            "(init_loc_fn=init_to_value(values=...), a smaller init_scale)."
            + float32
        )
        keys.append(("never moved", skipped))
        return FitReport(steps, skipped, bad_params, rho, halvings, avg, best, sd, False, {}, [], problems, keys)
    if skipped:
        damped = f", and the step size was halved {halvings} time(s), to {rho:.3g}" if halvings else ""
        problems.append(
            f"nb.BLR skipped {skipped} step(s) (step count {steps}) because of a non-finite loss, gradient or update, for "
            f"parameter(s) {bad_params}; those steps kept the last finite values{damped}. Check the model's "
            "log density at the current guide (a scale or rate that reaches 0, an overflowing exp: predictors in raw "
            "units, a column in the hundreds, put exp(X @ beta) out of range from NumPyro's default start, so "
            "standardise them), pass a smaller lr, or use SVI.run(..., stable_update=True)." + float32
        )
        keys.append(("skipped", skipped))

    diverged = _is_diverged(avg, best, best_sd, steps)
    if diverged:
        if getattr(optimizer, "lr", None) is not None:
            fix = f"Pass a smaller lr (this run used {optimizer.lr!r}), or leave lr unset for the adaptive default."
        else:
            fix = (
                "Pass hessian='reparam' (its curvature estimate does not use second derivatives at a single "
                "sample, which can explode on log-scale parameters)."
            )
        problems.append(
            f"nb.BLR diverged: after {steps} steps the average loss ended at {avg:.6g}, {avg - best:.3g} above its best value "
            f"{best:.6g} in this run. {fix}"
        )
        keys.append(("diverged",))

    if steps < MIN_STEPS and not diverged:
        problems.append(
            f"nb.BLR ran only {steps} step(s): too short to judge whether it converged (the report's checks average over "
            f"at least {MIN_STEPS} steps), so its result may be far from the optimum. Continue the run "
            "(svi.run(key, steps, ..., init_state=svi_result.state)) or run more steps."
        )
        keys.append(("too short", steps))

    unconverged = {}
    for name, size in tr.gradient_size.items():
        sds = np.exp(np.asarray(size, dtype=float))  # geometric average of |L^T g|
        travelling = np.where(np.asarray(tr.persistence[name], dtype=float) > UNCONVERGED_PERSISTENCE, sds, 0.0)
        for site, v in _by_site(name, travelling, guide).items():
            worst = float(np.max(v)) if np.size(v) else 0.0
            if not np.isfinite(worst) or worst > UNCONVERGED_SDS:
                unconverged[site] = worst
    if unconverged and not diverged and steps >= MIN_STEPS:
        listed = ", ".join(f"{k} ({v:.3g} sd)" for k, v in sorted(unconverged.items(), key=lambda kv: -kv[1]))
        problems.append(
            f"nb.BLR has not converged after {steps} steps: the means of {listed} are still that many "
            "posterior standard deviations from where the expected gradient vanishes. Continue the run "
            "(svi.run(key, steps, ..., init_state=svi_result.state)); if this persists with a mean-field "
            "guide (AutoNormal) on a correlated posterior, use AutoMultivariateNormal."
        )
        keys.append(("unconverged",) + tuple(sorted(unconverged)))

    collapsed = []
    diffuse = {}  # site or parameter -> (coordinates, of how many, largest sd): sds growing without bound
    dense = []  # (name, Cholesky factor of a covariance, a loc of its dtype): the conditioning check below
    try:
        layout = optimizer.layout(s.params)
        unread = None
    except Exception:  # noqa: BLE001 - another optimizer configuration, or a hand-written guide it was not given
        layout = None
        unread = ("the guide's Gaussian blocks could not be read from the parameters' names, so the checks on its "
                  "scales (collapsed, unbounded, ill-conditioned) and the sites that moved were not made: pass the "
                  "optimizer the fit ran with (nb.fit_report(result, svi.optim)), which svi.init gave the guide")
    for b in getattr(layout, "blocks", ()):
        if b.kind not in (DIAGONAL, FULL):
            continue
        m = np.asarray(s.params[b.loc])
        scale = np.asarray(apply_transform(b, s.params[b.scale]))
        marginal_sd = scale if b.kind == DIAGONAL else np.sqrt(np.sum(scale**2, axis=-1))
        small = collapsed_sd(marginal_sd, m, m.dtype)
        if np.any(small):
            collapsed.append(b.scale)
        wide = marginal_sd > DIFFUSE_SD * np.maximum(1.0, np.abs(m))
        for site, v in _by_site(b.scale, np.where(wide, marginal_sd, 0.0), guide).items():
            if np.any(v > 0):
                diffuse[site] = (int(np.sum(v > 0)), int(np.size(v)), float(np.max(v)))
        if b.kind == FULL:
            dense.append((b.scale, scale, m))
    if collapsed and not diverged:
        problems.append(
            f"nb.BLR: after {steps} steps the guide's standard deviation collapsed to the rounding level of the mean in {collapsed}: "
            "the posterior there is degenerate (a hierarchical scale going to 0, a flat direction with a "
            "hard constraint) or the precision step over-shot. Reparameterise the site (LocScaleReparam "
            "for a hierarchical scale) or pass a smaller lr."
        )
        keys.append(("collapsed",) + tuple(collapsed))

    if diffuse and not diverged:
        listed = ", ".join(f"{k} ({n} of {size} coordinate(s), sd up to {v:.3g})" for k, (n, size, v) in diffuse.items())
        problems.append(
            f"nb.BLR: after {steps} steps the guide's standard deviation grows without bound in {listed}: nothing in "
            "the model's density depends on those coordinates, so the ELBO's entropy term alone grows with them, the "
            "loss falls without end, and the fit there means nothing. Typical causes: a latent site whose density is "
            "masked where the model does not use it (numpyro.sample(..., obs_mask=...) creates a '<site>_unobserved' "
            "latent with one entry per row, and its entries at observed rows have no density), or a latent that no "
            "prior or likelihood term reads. Give those coordinates a density, or sample only the ones the model "
            "uses (x_missing = numpyro.sample('x_missing', dist.Normal(...).expand([n_missing])), then "
            "x.at[missing_rows].set(x_missing))."
        )
        keys.append(("diffuse",) + tuple(diffuse))

    ill = {}
    joint = [b for b in getattr(layout, "blocks", ()) if b.kind == DIAGONAL]
    mean_tril = getattr(s.algorithm, "mean_scale_tril", None)
    if joint and mean_tril is not None and np.size(mean_tril):  # the mean-field guide's dense preconditioner
        dense.append((", ".join(b.scale for b in joint), mean_tril, np.asarray(s.params[joint[0].loc])))
    for name, tril, loc in dense:
        if np.ndim(tril) != 2 or np.shape(tril)[-1] > CONDITION_MAX_DIM:
            continue
        kappa = correlation_condition(tril)
        eps = float(np.finfo(loc.dtype).eps)
        if kappa * eps > ILL_CONDITIONED:  # NaN compares false: a non-finite factor is reported above
            ill[name] = kappa
    if ill:
        dtype = np.asarray(s.params[next(b.loc for b in layout.blocks if b.kind in (DIAGONAL, FULL))]).dtype
        listed = ", ".join(f"{k} ({v:.3g})" for k, v in ill.items())
        problems.append(
            f"nb.BLR: after {steps} steps the posterior's correlations are too ill-conditioned for {dtype.name} "
            f"(condition number of the correlation matrix carried by {listed}; {dtype.name} resolves about "
            f"{ILL_CONDITIONED / np.finfo(dtype).eps:.3g}): its narrowest directions are lost to rounding and the fit "
            "may be wrong. Enable 64-bit floats (numpyro.enable_x64() at the start of the program)"
            + (f". The run also skipped {skipped} non-finite step(s): these correlations may be those of a fit that "
               "overflowed rather than the posterior's (see the skipped steps)." if skipped else
               ", or remove the near-collinear directions from the model (drop or combine predictors that nearly "
               "repeat each other).")
        )
        keys.append(("ill-conditioned",) + tuple(ill))

    damped = int(getattr(tr, "damped", 0))
    damped_recent = float(getattr(tr, "damped_recent", 0.0))
    if damped_recent > DAMPED_FRACTION and steps >= MIN_STEPS and not diverged:
        problems.append(
            f"nb.BLR: the mean step was still shortened by backtracking on {100 * damped_recent:.0f}% of the "
            f"recent steps ({damped} of {steps} in all): the loss is far from quadratic where the fit ended "
            "(saturated likelihood terms, a funnel or heavy-tailed posterior), so the fit may be short of the "
            "optimum. Reparameterise the site (LocScaleReparam for a hierarchical scale), or pass "
            "hessian='reparam'."
        )
        keys.append(("damped",))

    loss_drop = _loss_drop(getattr(tr, "loss_blocks", None), steps)
    clipped_drop = _loss_drop(getattr(tr, "loss_blocks_clipped", None), steps)
    if not diverged and not unconverged and not diffuse and steps >= MIN_STEPS:  # an unbounded loss falls forever
        band = getattr(tr, "loss_band", None) is not None  # winsorised in the trace's own band: a higher threshold
        falling = [(d, how) for d, how, nats in (
            (loss_drop, "", STILL_FALLING_NATS),
            (clipped_drop, f" (losses winsorised at their running average +- {CLIP_SDS:g} sds)",
             STILL_FALLING_CLIPPED_NATS if band else STILL_FALLING_NATS)) if _is_falling(d, nats)]
        moved = _moved_sites(s, layout, guide, optimizer) if falling else []
        if falling and not moved and max(d[0] for d, _ in falling) <= STILL_FALLING_ALONE_NATS and _has_snapshot(s, layout):
            falling = []  # the iterates' loss falls as the step size decays, the returned means stay put: converged
        if falling:
            (drop, se, n_prev, start_prev, start_cur), how = falling[0]
            named = ""
            if moved:
                named = (" The means that moved most since step "
                         f"{start_cur}: " + ", ".join(f"{k} ({v:.2g} sd)" for k, v in moved) + ".")
            problems.append(
                f"nb.BLR has likely not converged after {steps} steps: the loss was still falling at the end, its "
                f"average over steps {start_cur}-{steps} {drop:.3g} +- {se:.2g} nats below that over steps "
                f"{start_prev}-{start_cur - 1}{how}.{named} " + (_sampled_falling_fix if _sampled_curvature(optimizer, s, layout) else
                "The step size decayed while the fit still drifted (single-sample "
                "curvature noise, as on hierarchical log-scale sites, hides the drift from the step-size clock). "
                "Average the curvature over several draws: nb.BLR(curvature_draws=8) (only once the single-draw "
                "curvature turns negative; svi.run and nb.fit rerun a default nb.BLR() fit so when its steps found "
                "that, a loop of svi.update does not) or loss=Trace_ELBO(num_particles=8) (on NumPyro's hierarchical-scales "
                "logistic regression, 1,000 steps then reach the best Gaussian with either), or continue the "
                "run (svi.run(key, steps, ..., init_state=svi_result.state)) until this stops, or pass "
                "hessian='reparam' (a less noisy curvature estimate on such sites).")
            )
            keys.append(("still falling",) + tuple(k for k, _ in moved))

    gap = _laplace_gap_summary(getattr(s.algorithm, "laplace_gap", None), steps)
    if gap is not None and steps >= MIN_STEPS and not diverged and not unconverged:
        mean, se, n = gap
        if mean > LAPLACE_GAP_NATS and mean > LAPLACE_GAP_SES * se:
            names = [b.loc for b in getattr(layout, "blocks", ()) if b.kind in (DIAGONAL, FULL)]
            sites = []
            for name in names:
                sites += list(_by_site(name, np.zeros(np.shape(s.params[name])), guide))
            problems.append(
                f"nb.BLR (delta method: the Laplace approximation): after {steps} steps the Gaussian at the mode of "
                f"{', '.join(sites)} has an ELBO {mean:.3g} +- {se:.2g} nats below its own Laplace evidence estimate "
                f"(E_q[l] - l(mode) - D/2 over the last {n} steps; 0 for a Gaussian posterior): the posterior is not "
                "Gaussian around its mode (a skewed scale, a funnel, a mean far from the mode), so this "
                "Gaussian is not the best one and its means and sds can be far off. For the Gaussian that "
                "maximises the ELBO, fit with nb.BLR() (its defaults: delta=False); use the Laplace "
                "approximation only where this gap is small."
            )
            keys.append(("laplace gap",) + tuple(sites))

    return FitReport(steps, skipped, bad_params, rho, halvings, avg, best, sd, diverged, unconverged, collapsed,
                     problems, keys, damped, damped_recent, ill, laplace_gap=gap, loss_drop=loss_drop,
                     loss_drop_clipped=clipped_drop, unread=unread)


_sampled_falling_fix = (
    "The step size decayed while the fit still drifted. Continue the run (svi.run(key, steps, ..., "
    "init_state=svi_result.state)) until this stops. The curvature is sampled here (hessian='hutchinson', the default "
    "above 256 latent numbers, or 'reparam'/'price'), so a mean-field guide's means step with their own precisions "
    "only: where the posterior couples many coordinates strongly (a softmax's classes, collinear predictors) that is "
    "a slow iteration; nb.BLR(hessian='autodiff') takes Newton steps across the sites instead, at one forward-mode "
    "pass per latent number and step."
)


def _sampled_curvature(optimizer, s, layout):
    """Whether the run's Gaussian blocks took a sampled curvature (``hessian`` resolved to other than ``"autodiff"``)."""
    hessian_for = getattr(optimizer, "hessian_for", None)
    if hessian_for is None or layout is None:
        return False
    try:
        return hessian_for(s.params, layout) in ("hutchinson", "reparam", "price")
    except Exception:  # noqa: BLE001 - a layout the optimizer cannot read: the general advice
        return False


def _is_falling(loss_drop, nats=STILL_FALLING_NATS):
    """Whether a :func:`_loss_drop` reads as a loss still falling (``STILL_FALLING_*``; by more than ``nats``)."""
    if loss_drop is None:
        return False
    drop, se, n_prev = loss_drop[:3]
    return n_prev >= STILL_FALLING_MIN and drop > nats and drop > STILL_FALLING_SES * se


def _loss_drop(blocks, steps):
    """``(drop, standard error, count of the previous block, first step of the previous block, of the last)`` from
    ``FitTrace.loss_blocks``: the previous block's mean loss minus the last one's; None without two blocks."""
    if blocks is None:
        return None
    b = np.asarray(blocks, dtype=np.float64)
    if b.shape != (2, 4) or b[0, 0] < 2 or b[1, 0] < 2:
        return None
    means, variances = [], []
    for n, c, s1, s2 in b:
        m = s1 / n
        means.append(c + m)
        variances.append(max(s2 / n - m * m, 0.0) * n / (n - 1))
    drop = means[0] - means[1]
    se = float(np.sqrt(variances[0] / b[0, 0] + variances[1] / b[1, 0]))
    start_cur = 1 << (int(steps).bit_length() - 1)  # the last power of two <= steps
    return float(drop), se, int(b[0, 0]), start_cur // 2, start_cur


def _has_snapshot(s, layout):
    """Whether the state holds the means of every Gaussian block as the report's last block of steps began."""
    snapshot = getattr(s.algorithm, "snapshot", None)
    locs = [b.loc for b in getattr(layout, "blocks", ()) if b.kind in (DIAGONAL, FULL)]
    return bool(snapshot) and bool(locs) and all(n in snapshot for n in locs)


def _moved_sites(s, layout, guide, optimizer, top=5):
    """``[(site, sds), ...]``: the Gaussian means that moved most since the last block of steps began (the state's
    ``snapshot``, against the means ``get_params`` returns), in the guide's marginal sds, at least ``MOVED_SDS``."""
    snapshot = getattr(s.algorithm, "snapshot", None)
    if not snapshot or layout is None:
        return []
    try:
        params = optimizer.algorithm.result(s.algorithm, s.params)
    except Exception:  # noqa: BLE001 - another optimizer's state: no names
        params = s.params
    out = {}
    for b in layout.blocks:
        if b.kind not in (DIAGONAL, FULL) or b.loc not in snapshot:
            continue
        m = np.asarray(params[b.loc], dtype=np.float64)
        scale = np.asarray(apply_transform(b, params[b.scale]), dtype=np.float64)
        sd = scale if b.kind == DIAGONAL else np.sqrt(np.sum(scale**2, axis=-1))
        moved = np.abs(m - np.asarray(snapshot[b.loc], dtype=np.float64)) / sd
        for site, v in _by_site(b.loc, moved, guide).items():
            worst = float(np.max(v)) if np.size(v) else 0.0
            if worst >= MOVED_SDS:
                out[site] = worst
    return sorted(out.items(), key=lambda kv: -kv[1])[:top]


def _laplace_gap_summary(draws, steps):
    """``(mean, standard error, count)`` of the finite Laplace-gap draws a delta-method run recorded (the last
    ``optim.GAP_WINDOW`` steps), or None when the run records none."""
    if draws is None or np.size(draws) == 0:
        return None
    d = np.asarray(draws, dtype=np.float64)
    d = d[np.isfinite(d)]
    if d.size < 2:
        return None
    return float(np.mean(d)), float(np.std(d, ddof=1) / np.sqrt(d.size)), int(d.size)
