r"""``IVON`` as a NumPyro optimizer: ``SVI(model, guide, IVON(), Trace_ELBO())``, or with IVON's own
hyper-parameters ``IVON(lr=..., ess=N, ...)``.

``IVON()`` needs no tuning (issue 25): without an ``lr`` it takes IVON's step with ``nb.BLR()``'s adaptive step
size and iterate averaging, reads ``ess`` from the model, and reports at the end of the run whether it converged
(:func:`ivon_default_algorithm`). With an ``lr`` every step is exactly IVON's, as below.

The guide must be a diagonal Gaussian over unconstrained latents (``AutoNormal``:
``{site}_auto_loc``/``{site}_auto_scale``; ``AutoDiagonalNormal``: ``auto_loc``/``auto_scale``;
scales through ``softplus`` or any other elementwise bijection). Its mean :math:`m` is the
``loc`` and its standard deviation :math:`\sigma` the constrained ``scale``.

**Mapping ELBO -> IVON.** SVI minimises :math:`L(m, \sigma) = \mathbb E_q[U(z)] - \mathbb H[q]`
with :math:`U(z) = -\log p(\mathcal D, z)`, a *sum* over the data set plus the prior (and any
Jacobian). IVON works with the per-example average loss and a sample size :math:`\lambda`
(``ess``). We set

.. math::
    \bar\ell(z) = U(z) / \lambda, \qquad \lambda (h + \delta) = 1/\sigma^2,

i.e. the guide's precision plays IVON's :math:`\lambda(h+\delta)` and :math:`\delta` is
``weight_decay`` (an *extra* Gaussian prior of precision :math:`\lambda\delta` applied by the
optimizer, on top of the model's prior; default 0, because the model already has its prior).
With the reparametrised sample :math:`z = m + \sigma\epsilon` (fixed within a step, as SVI
fixes the key), the ELBO gradients are

.. math::
    \partial L/\partial m = \nabla U(z), \qquad
    \partial L/\partial\sigma + 1/\sigma = \epsilon \odot \nabla U(z)
    \quad\text{(Price/Stein)},

averaged over particles with ``Trace_ELBO(num_particles=S)``. :math:`\partial L/\partial\sigma`
is obtained from the raw-scale gradient by the vjp of the inverse scale transform. IVON's
Monte Carlo means are therefore

.. math::
    \hat g = \frac{1}{\lambda}\frac{\partial L}{\partial m}, \qquad
    \overline{\text{noise}\odot\nabla\bar\ell} = \frac{\sigma}{\lambda}
        \Big(\frac{\partial L}{\partial\sigma} + \frac1\sigma\Big), \qquad
    h = \frac{1}{\lambda\sigma^2} - \delta,

and the step is exactly :func:`numpyro_blr.deep.ivon`'s (momentum, improved-BLR :math:`h`
update with :math:`\beta_2`, mean step with ``rescale_lr`` and clipping), after which the scale
is written back as :math:`\sigma = 1/\sqrt{\lambda(h+\delta)}`. Consequences:

* The fixed point does not depend on ``ess``: the mean step is
  :math:`\alpha c\,(\nabla U + \lambda\delta m)/(\nabla^2 U + \lambda\delta)` and the precision
  tracks :math:`\mathbb E_q[\nabla^2 U] + \lambda\delta`. ``ess`` sets the units of ``hess_init``
  and ``weight_decay`` (per-example, as in :func:`~numpyro_blr.deep.ivon`): use the number of data
  points the likelihood sums over, then IVON's usual hyper-parameters carry over.
* ``hess_init`` overwrites the guide's initial scales with :math:`1/\sqrt{\lambda(h_0+\delta)}`
  (as IVON's init does); ``hess_init=None`` keeps the guide's ``init_scale`` and turns
  ``rescale_lr`` off (:math:`c = 1`).
* Steps with a non-finite loss, statistic or update are skipped (parameters and momentum kept),
  counted in the state (``svi_result.state.optim_state[1].skipped``) and reported at the end of the
  run, as for every optimizer of :mod:`numpyro_blr.svi`.
* Parameters outside the Gaussian are updated by ``fallback``. Without one, the only ones allowed
  are the ``"{name}$params"`` placeholders of ``numpyro.contrib.module``'s ``random_*_module``
  that the loss does not read (every module weight has a prior and is a latent site): they are
  passed through unchanged. Whether the loss reads them is decided exactly, from the traced
  ELBO (no operation of its jaxpr takes them as input); if it does (a module weight without a
  prior), tracing the step raises ``GuideLayoutError`` asking for ``fallback=``.
"""

from typing import NamedTuple, Optional

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from numpyro.optim import _value_and_grad

from numpyro_blr.estimators import Estimate, estimate, hoist_constant_work
from numpyro_blr.layout import DIAGONAL, GuideLayoutError
from numpyro_blr.presets import ivon
from numpyro_blr.optim import BLR
from numpyro_blr.report import (
    CONDITION_MAX_DIM,
    MIN_STEPS,
    UNCONVERGED_PERSISTENCE,
    UNCONVERGED_SDS,
    FitTrace,
    LossTrace,
    _by_site,
    _moved_sites,
    collapsed_sd,
    is_block_end,
    empty_loss_blocks,
    init_loss_trace,
    loss_trace_problems,
    next_loss_trace,
    next_trace,
)
from numpyro_blr.rules.diagonal import DiagonalState, diagonal_update
from numpyro_blr.rules.schedules import adaptive_decay
from numpyro_blr.svi import GuideAlgorithm, GuideOptimizer, GuideStep, commit_if_finite, skipped_report
from numpyro_blr.tree import FlatLayout


class IVONSVIState(NamedTuple):
    r"""IVON's state over the guide's locs: ``momentum`` (IVON's gradient EMA per loc, in per-example
    units :math:`\nabla U/\lambda`), ``count`` (IVON steps taken) and ``trace`` (the losses the end-of-run report
    reads: a :class:`~numpyro_blr.report.LossTrace` with an explicit ``lr``, ``nb.BLR``'s
    :class:`~numpyro_blr.report.FitTrace` with the default one, whose ``clock`` sets the step size).

    With the default step size only (:func:`ivon_default_algorithm`; None otherwise): ``average`` (per block, the
    Polyak-Ruppert average of the iterates' loc and standard deviation, what ``get_params`` returns), ``snapshot``
    (the averaged locs and scales when the last block of losses began, for the report) and ``grams``
    (:class:`GradientBlocks`: the report's estimate of how far the means are from the optimum)."""

    momentum: dict
    count: jax.Array
    trace: LossTrace = None
    average: dict = None
    snapshot: dict = None
    grams: "GradientBlocks" = None


def _check_layout(layout, params, prefix):
    """IVON's guide: diagonal Gaussian blocks only (a ``GuideLayoutError`` naming the parameters otherwise)."""
    bad = [b.loc for b in layout.blocks if b.kind != DIAGONAL]
    if bad or not layout.blocks:
        raise GuideLayoutError(
            f"IVON needs a diagonal Gaussian guide ('<site>_{prefix}_loc'/'<site>_{prefix}_scale' "
            f"or '{prefix}_loc'/'{prefix}_scale': AutoNormal, AutoDiagonalNormal); "
            f"got parameters {sorted(params)}" + (f" (not diagonal Gaussian: {bad})" if bad else "") + "."
        )


def _initial_scales(params, layout, ess, hess_init, weight_decay):
    """The guide's scales set to IVON's initial s.d. :math:`1/\\sqrt{N(h_0 + \\delta)}` (``hess_init`` None: kept)."""
    if hess_init is not None:
        sd = (ess * (hess_init + weight_decay)) ** -0.5
        for b in layout.blocks:
            params[b.scale] = b.transform.inv(jnp.full_like(params[b.scale], sd))
    return params


def ivon_guide_algorithm(lr, ess, hess_init=1.0, beta1=0.9, beta2=0.99999, weight_decay=0.0,
                         clip_radius=float("inf"), rescale_lr=True):
    """IVON over a guide's diagonal Gaussian blocks, for :class:`~numpyro_blr.svi.GuideOptimizer`
    (the mapping in the module docstring)."""
    algorithm = ivon(lr, ess, hess_init=1.0 if hess_init is None else hess_init, beta1=beta1, beta2=beta2,
                     weight_decay=weight_decay, clip_radius=clip_radius,
                     rescale_lr=bool(rescale_lr) and hess_init is not None)
    lam, delta = float(ess), float(weight_decay)

    def init(params, layout):
        params = _initial_scales(params, layout, lam, hess_init, delta)
        momentum = {b.loc: jnp.zeros_like(params[b.loc]) for b in layout.blocks}
        dtype = jnp.result_type(*[params[b.loc] for b in layout.blocks])
        return params, IVONSVIState(momentum, jnp.zeros((), jnp.int32), init_loss_trace(dtype))

    def step(fn, params, s, layout, i, forward_mode):
        (loss, aux), grads = _value_and_grad(fn, x=params, forward_mode_differentiation=forward_mode)
        locs = {b.loc: params[b.loc] for b in layout.blocks}
        flat = FlatLayout.of(locs)
        precision, stat = {}, {}
        for b in layout.blocks:
            sd = b.transform(params[b.scale])
            _, vjp = jax.vjp(b.transform.inv, sd)
            (dl_dsd,) = vjp(grads[b.scale])  # dL/dsigma from dL/draw
            precision[b.loc] = 1.0 / (lam * sd**2)  # lambda (h + delta) = 1 / sigma^2
            stat[b.loc] = (sd * dl_dsd + 1.0) / lam  # sigma*eps * grad(U/lambda) = noise * grad
        zero = jnp.zeros((), jnp.int32)
        state = DiagonalState(flat.ravel(locs), flat.ravel(precision), flat.ravel(s.momentum), s.count, zero, flat)
        g_bar = flat.ravel({b.loc: grads[b.loc] for b in layout.blocks}) / lam  # grad of U/lambda at z
        new, _ = algorithm.update(state, Estimate(loss, g_bar, lam * state.precision * flat.ravel(stat)))
        new_params, new_locs, new_precision = dict(params), new.params, new.tree(new.precision)
        checked = {}
        for b in layout.blocks:
            new_params[b.loc] = new_locs[b.loc]
            new_params[b.scale] = b.transform.inv(lax.rsqrt(lam * new_precision[b.loc]))
            checked[b.loc] = (grads[b.loc], new_params[b.loc])
            checked[b.scale] = (grads[b.scale], new_params[b.scale])
        trace = None if s.trace is None else next_loss_trace(s.trace, i, loss)  # kept only with the step (commit)
        return GuideStep(loss, aux, grads, new_params, IVONSVIState(new.tree(new.momentum), new.count, trace), checked)

    skipped = skipped_report("IVON", "Pass a smaller lr or a larger hess_init, or check the model's log density at "
                                     "the current guide.")

    def report(state, optimizer):
        """Skipped steps (and an implausible ``ess``), then what the losses show: divergence or a loss still
        falling at the end (issue 25: IVON's fits that ended thousands of nats short were silent)."""
        out = skipped(state, optimizer)
        i, s = state
        if getattr(s.algorithm, "trace", None) is not None:
            out += loss_trace_problems(
                s.algorithm.trace, int(i), "IVON",
                f"Pass a smaller lr (this run used {lr!r}) or a larger hess_init, or fit with nb.BLR() (no step size to "
                "tune).",
                "Continue the run (svi.run(key, steps, ..., init_state=svi_result.state)), or fit with nb.BLR() (its "
                "Newton-like steps do not depend on the data's scale).",
            )
        return out

    return GuideAlgorithm("IVON", init, step, commit_if_finite, report, _check_layout)



DEFAULT_STEP_SIZE = adaptive_decay(0.5, 10)  # nb.BLR()'s default step size (rules/schedules.py)
SHORTFALL_NATS = 0.5  # the report: means estimated this many nats of ELBO short of the optimum (an underestimate:
# 0.5-0.65 where the bench's gap was 0.77-1.16, 4-31 where it was 8-313; at most 0.2 on the converged cases)


class GradientBlocks(NamedTuple):
    r"""The whitened mean gradients :math:`u = \bar\sigma\odot\nabla U(z)` of the run's last two blocks of steps (the
    blocks of :attr:`~numpyro_blr.report.FitTrace.loss_blocks`; :math:`\bar\sigma` the averaged scales when the block
    began): ``count`` (2,), and the sums of :math:`d = u - u_0` and :math:`d d^\top` (``total`` (2, D), ``outer``
    (2, D, D)) with ``shift`` :math:`u_0` (2, D) the block's first :math:`u` (shifted sums: the covariance is not lost
    to rounding where the mean is large), ``[previous, current]`` (:func:`mean_shortfall`)."""

    count: jax.Array
    shift: jax.Array
    total: jax.Array
    outer: jax.Array


def _next_gradient_blocks(blocks, i, use, u):
    """:class:`GradientBlocks` after step ``i``: a new block from each power-of-two step count (as the loss blocks),
    and ``u`` added to the current one where ``use``."""
    boundary = is_block_end(i)

    def roll(x):
        return jnp.stack([jnp.where(boundary, x[1], x[0]), jnp.where(boundary, jnp.zeros_like(x[1]), x[1])])

    count, shift, total, outer = (roll(x) for x in blocks)
    shift = shift.at[1].set(jnp.where((count[1] == 0) & use, u, shift[1]))
    d = jnp.where(use, u - shift[1], 0.0)
    w = jnp.where(use, 1.0, 0.0).astype(u.dtype)
    return GradientBlocks(count.at[1].add(w), shift, total.at[1].add(d), outer.at[1].add(jnp.outer(d, d)))


def mean_shortfall(blocks):
    r"""How far the means are from the optimum, in nats of ELBO, from the whitened gradients of the last block of
    steps (:class:`GradientBlocks`; the block before it while the last holds fewer than ``max(32, 2D)`` steps).

    Near the fit, :math:`u = \bar\sigma\odot\nabla U(z) = C(x - x^*) + C\epsilon`, with
    :math:`C = \operatorname{diag}(\bar\sigma)\,\mathbb E_q[\nabla^2 U]\operatorname{diag}(\bar\sigma)` the whitened
    curvature and :math:`x - x^*` the means' distance to the optimum in the guide's sds. So the block's mean
    :math:`\bar u` estimates :math:`C(x - x^*)` (zero at the mean-field optimum of any posterior:
    :math:`\mathbb E_q[\nabla U] = 0`), its covariance :math:`S` estimates :math:`C^2`, and the ELBO the means still
    lack, :math:`\tfrac12 (x - x^*)^\top C (x - x^*)`, is :math:`\tfrac12\bar u^\top C^{-1}\bar u`, less its noise
    :math:`\operatorname{tr}(C^{-1}S)/2n`, with :math:`C = S^{1/2}`. Along the directions where :math:`C` is small (a
    posterior that correlates sites, on which IVON's diagonal steps crawl) this sees what neither the loss nor the
    gradient's sign can: their signal is :math:`\lambda\delta`, their noise of order one, while the projection of
    :math:`u` on such a direction has noise :math:`\lambda` too.

    Returns ``(nats, vector, eigenvalue, count)``: the estimate, the eigenvector of :math:`C` that carries most of
    it and its eigenvalue, and the number of steps read; None without enough steps.
    """
    eps = float(np.finfo(np.asarray(blocks.total).dtype).eps)
    count = np.asarray(blocks.count, np.float64)
    shift, total, outer = (np.asarray(x, np.float64) for x in blocks[1:])
    need = max(32, 2 * total.shape[-1])
    k = 1 if count[1] >= need else 0
    n = count[k]
    if n < need:
        return None
    offset = total[k] / n
    mean = shift[k] + offset
    cov = (outer[k] - n * np.outer(offset, offset)) / (n - 1)
    if not (np.all(np.isfinite(cov)) and np.all(np.isfinite(mean))):
        return None
    values, vectors = np.linalg.eigh(0.5 * (cov + cov.T))
    if not values[-1] > 0:
        return None
    # a variance below the rounding of the sums (float32: about one epsilon of the largest) is not resolved: it is
    # raised to 16 epsilons, which only lowers that direction's share (a lower bound there, not rounding noise divided
    # by rounding noise)
    root = np.sqrt(np.maximum(values, 16.0 * eps * float(values[-1])))  # the eigenvalues of C
    along = (vectors.T @ mean) ** 2 / root  # u-bar' C^-1 u-bar, direction by direction
    nats = 0.5 * (float(np.sum(along)) - float(np.sum(root)) / n)
    j = int(np.argmax(along))
    return nats, vectors[:, j], float(root[j]), int(n)


def ivon_default_algorithm(ess, hess_init=1.0, beta1=0.0, beta2=None, weight_decay=0.0, clip_radius=float("inf"),
                           layout_of=None):
    r"""IVON over a guide's diagonal Gaussian blocks with the default step size (``nb.IVON()``, ``lr=None``).

    IVON's step (:func:`numpyro_blr.deep.ivon`'s :func:`~numpyro_blr.rules.diagonal.diagonal_update`: the precision
    step, then the mean step :math:`m \leftarrow m - \alpha c\,\bar g/p`) in the units where its natural step size
    is :math:`\rho = \alpha c` (``lr * (hess_init + weight_decay)`` with ``rescale_lr``), made robust with what makes
    ``nb.BLR()``'s default robust:

    * :math:`\rho` is :class:`~numpyro_blr.rules.schedules.adaptive_decay` ``(0.5, 10)`` on Kesten's clock, which
      counts only the steps that are Monte Carlo noise; the precision step :math:`1 - \beta_2` is the same
      :math:`\rho` (unless ``beta2`` is given), and ``get_params`` returns the Polyak-Ruppert average of the
      iterates' means and standard deviations, weight :math:`\rho_0/(1 + c/\tau)`;
    * the curvature is the Price estimate with ``nb.BLR(hessian="reparam")``'s baseline (the same draw at a
      hundredth of the scale, subtracted: IVON's own estimate :math:`\epsilon\nabla U(z)/\sigma` carries the noise
      :math:`\epsilon\nabla U(m)/\sigma`, which far from the optimum is thousands of times the curvature and blew
      the precision up); the precision step is the plain one where the precision grows and the improved-BLR one
      where it shrinks (``nb.BLR()``'s ``improved="one-sided"``: the improved step's
      :math:`\rho^2(\hat h - p)^2/2p` term, negligible at IVON's :math:`1-\beta_2 = 10^{-5}`, multiplied
      precisions by up to :math:`10^{14}` in one step at :math:`\rho = 0.5`);
    * the mean step is backtracked on the step's sampled loss (``nb.BLR``'s :meth:`~numpyro_blr.BLR._backtrack`):
      a diagonal Newton step overshoots on a correlated posterior (breast cancer, raw: diverged without it);
    * no momentum (``beta1=0.0`` unless given): an average of past gradients divided by the current precision
      overshoots where the curvature changes by orders of magnitude on the way (a log-scale site).

    The end-of-run report (:func:`default_report`) adds to IVON's (skipped steps, divergence, a loss still falling)
    ``nb.BLR``'s checks (too few steps to judge, means whose whitened gradient keeps its sign, a standard deviation
    collapsed to rounding) and, for guides of at most ``CONDITION_MAX_DIM`` numbers, an estimate of how many nats of
    ELBO the means still lack (:func:`mean_shortfall`): on a correlated posterior IVON's diagonal steps crawl along
    the narrow directions, where neither the loss nor the gradient's sign shows it.
    """
    schedule = DEFAULT_STEP_SIZE
    base = ivon(1.0, ess, hess_init=1.0 if hess_init is None else hess_init, beta1=beta1,
                beta2=0.99999 if beta2 is None else beta2, weight_decay=weight_decay, clip_radius=clip_radius,
                rescale_lr=False)
    rule0 = base.parts.rule._replace(positivity="one-sided")  # lr and beta2 are set at each step
    lam, delta = float(ess), float(weight_decay)

    def init(params, layout):
        params = _initial_scales(params, layout, lam, hess_init, delta)
        locs = {b.loc: params[b.loc] for b in layout.blocks}
        dtype = jnp.result_type(*locs.values())
        size = sum(int(np.prod(jnp.shape(v))) for v in locs.values())

        def full(shape, value=0.0, dt=dtype):
            return jnp.full(shape, value, dt)

        trace = FitTrace(
            clock=full(()), direction=full((2 * size,)), rho=full(()), loss_avg=full((), np.nan), loss_var=full(()),
            loss_best=full((), np.inf), loss_best_var=full(()),
            gradient_size={n: jnp.zeros_like(v) for n, v in locs.items()},
            gradient_last={n: jnp.zeros_like(v) for n, v in locs.items()},
            persistence={n: jnp.ones_like(v) for n, v in locs.items()},
            halvings=full((), 0, jnp.int32), damped=full((), 0, jnp.int32), damped_recent=full(()), damping=full((), 1.0),
            loss_blocks=empty_loss_blocks(dtype),
        )
        average = {}
        for b in layout.blocks:
            average[b.loc], average[b.scale] = params[b.loc], b.transform(params[b.scale])
        dim = size if size <= CONDITION_MAX_DIM else 0  # the correlation check: blocks up to CONDITION_MAX_DIM numbers
        grams = GradientBlocks(full((2,)), full((2, dim)), full((2, dim)), full((2, dim, dim)))
        momentum = {n: jnp.zeros_like(v) for n, v in locs.items()}
        return params, IVONSVIState(momentum, full((), 0, jnp.int32), trace, average, dict(average), grams)

    def step(fn, params, s, layout, i, forward_mode):
        fn = hoist_constant_work(fn, params)  # the loss is evaluated several times at this step's draw
        (loss, aux), grads, stats, *_ = estimate(fn, params, layout, "reparam", False, forward_mode, "none")
        locs = {b.loc: params[b.loc] for b in layout.blocks}
        flat = FlatLayout.of(locs)
        dtype = s.trace.clock.dtype
        precision, hess, direction, whitened = {}, {}, {}, {}
        for b in layout.blocks:
            sd = b.transform(params[b.scale])
            precision[b.loc] = 1.0 / (lam * sd**2)  # lambda (h + delta) = 1 / sigma^2
            hess[b.loc] = stats[b.loc].h / lam  # per example
            whitened[b.loc] = sd * stats[b.loc].g  # u = sigma * grad U(z): the distance to the optimum in sds
            # the direction Kesten's clock compares from step to step: nb.BLR's (whitened mean and curvature steps)
            direction[b.loc] = jnp.concatenate([whitened[b.loc].reshape(-1), (sd**2 * stats[b.loc].h - 1.0).reshape(-1)])
        rho = jnp.asarray(schedule.iterate(s.trace.clock), dtype)
        rule = rule0._replace(lr=rho, beta2=(1.0 - rho) if beta2 is None else beta2)
        zero = jnp.zeros((), jnp.int32)
        state = DiagonalState(flat.ravel(locs), flat.ravel(precision), flat.ravel(s.momentum), s.count, zero, flat)
        g_bar = flat.ravel({b.loc: grads[b.loc] for b in layout.blocks}) / lam
        new, _ = diagonal_update(rule, state, g_bar, flat.ravel(hess), loss)
        new_params, new_precision = dict(params), new.tree(new.precision)
        proposed = new.params
        damping = BLR._backtrack(fn, params, {**params, **proposed}, sorted(proposed), loss, {})
        checked, target = {}, {}
        for b in layout.blocks:
            m = params[b.loc]
            new_params[b.loc] = m + damping.astype(m.dtype) * (proposed[b.loc] - m)
            target[b.scale] = lax.rsqrt(lam * new_precision[b.loc])
            new_params[b.scale] = b.transform.inv(target[b.scale])
            target[b.loc] = new_params[b.loc]
            checked[b.loc] = (grads[b.loc], new_params[b.loc])
            checked[b.scale] = (grads[b.scale], new_params[b.scale])
        momentum = new.tree(new.momentum)
        # the gradient for the correlation check, whitened by the averaged scales of when its block of steps began (fixed
        # within the block): the iterate's own scales, which fluctuate by tens of percent at rho ~ 0.05, mix the fast
        # directions' noise into the slow one (kidiq: its eigenvalue read 0.31, not 0.011; 0.06 with the running average)
        scales = {b.scale: jnp.where(is_block_end(i), s.average[b.scale], s.snapshot[b.scale]) for b in layout.blocks}
        u = flat.ravel({b.loc: scales[b.scale] * stats[b.loc].g for b in layout.blocks}).astype(dtype)

        def finish(old, ok):
            """The state once the adapter knows whether the step was finite: the trace records the step either way
            (a skipped step advances the clock, halving rho); the rest is kept only if ``ok``."""
            trace = next_trace(old.trace, i, ok, loss, rho, direction, whitened, schedule.skipped, damping)
            weight = jnp.asarray(schedule(trace.clock), dtype)  # Polyak-Ruppert, as nb.BLR's
            average = {n: a + weight.astype(a.dtype) * (target[n] - a) for n, a in old.average.items()}
            snapshot = {**{n: jnp.where(is_block_end(i), average[n], old.snapshot[n]) for n in locs}, **scales}
            grams = old.grams
            if grams.total.shape[-1]:
                grams = _next_gradient_blocks(grams, i, ok & jnp.all(jnp.isfinite(u)), u)
            kept = IVONSVIState(momentum, old.count + 1, trace, average, snapshot, grams)
            return jax.tree.map(lambda a, b: jnp.where(ok, a, b), kept, old._replace(trace=trace))

        return GuideStep(loss, aux, grads, new_params, finish, checked)

    def commit(old, finish, ok):
        return finish(old, ok)

    def result(state, params):
        """The averaged iterates (means and standard deviations), as ``get_params`` returns them."""
        out = dict(params)
        for b in layout_of(params).blocks:
            out[b.loc] = state.average[b.loc]
            out[b.scale] = b.transform.inv(state.average[b.scale])
        return out

    skipped = skipped_report("IVON", "Check the model's log density at the current guide (a scale or rate that reaches "
                                     "0, an overflowing exp), or fit with nb.BLR().")

    def report(state, optimizer):
        return skipped(state, optimizer) + default_report(state, optimizer)

    return GuideAlgorithm("IVON", init, step, commit, report, _check_layout, result=result)


def default_report(state, optimizer):
    """``[(key, message)]``: what the evidence of a default run shows (:func:`ivon_default_algorithm`), with
    ``nb.BLR``'s tests and thresholds (:func:`numpyro_blr.fit_report`): too few steps to judge, divergence, means
    still travelling (named), a loss still falling (naming the means that moved most), means an estimated
    ``SHORTFALL_NATS`` or more nats of ELBO from the optimum (:func:`mean_shortfall`, naming the sites of the direction
    that carries most of it), a standard deviation collapsed to rounding."""
    i, s = state
    steps = int(i)
    a = s.algorithm
    tr = a.trace
    if steps < MIN_STEPS:
        return [(("too short", steps), f"IVON ran only {steps} step(s): too short to judge whether it converged (the "
                 f"report's checks average over at least {MIN_STEPS} steps), so its result may be far from the "
                 "optimum. Continue the run (svi.run(key, steps, ..., init_state=svi_result.state)) or run more steps.")]
    guide = getattr(optimizer, "guide", None)
    try:
        layout = optimizer.layout(s.params)
    except Exception:  # noqa: BLE001 - no names without the layout
        layout = None
    problems = loss_trace_problems(
        tr, steps, "IVON",
        "Fit with nb.BLR() (its curvature is exact where IVON's is a one-sample estimate, and its mean step uses the "
        "curvature across sites).",
        "Continue the run (svi.run(key, steps, ..., init_state=svi_result.state)) until this stops, or fit with "
        "nb.BLR() (its mean step uses the curvature across sites).",
    )
    if any(key[0] == "diverged" for key, _ in problems):
        return problems
    unconverged = {}
    for name, size in tr.gradient_size.items():
        sds = np.exp(np.asarray(size, dtype=float))  # geometric average of |u|, u = sigma * grad U(z)
        travelling = np.where(np.asarray(tr.persistence[name], dtype=float) > UNCONVERGED_PERSISTENCE, sds, 0.0)
        for site, v in _by_site(name, travelling, guide).items():
            worst = float(np.max(v)) if np.size(v) else 0.0
            if not np.isfinite(worst) or worst > UNCONVERGED_SDS:
                unconverged[site] = worst
    if unconverged:
        listed = ", ".join(f"{k} ({v:.3g} sd)" for k, v in sorted(unconverged.items(), key=lambda kv: -kv[1]))
        problems = [(("unconverged",) + tuple(sorted(unconverged)),
                     f"IVON has not converged after {steps} steps: the means of {listed} are still that many posterior "
                     "standard deviations from where the expected gradient vanishes. Continue the run (svi.run(key, "
                     "steps, ..., init_state=svi_result.state)), or fit with nb.BLR() (its mean step uses the "
                     "curvature across sites).")]
    elif problems:  # the loss still falls: name the means that moved most since its last block of steps began
        moved = _moved_sites(s, layout, guide, optimizer)
        if moved:
            (key, message), = problems
            named = ("The means that moved most since then: " + ", ".join(f"{k} ({v:.2g} sd)" for k, v in moved)
                     + ". Continue the run")
            problems = [(key + tuple(k for k, _ in moved), message.replace("Continue the run", named, 1))]
    else:
        short = mean_shortfall(a.grams) if a.grams.total.shape[-1] else None
        if short is not None and layout is not None and short[0] > SHORTFALL_NATS:
            nats, vector, lam, n = short
            names = _direction_sites(layout, s.params, vector, guide)
            along = ("that combines " + " and ".join(names)) if len(names) > 1 else f"within {names[0]}"
            problems = [(("shortfall",) + tuple(names),
                         f"IVON has likely not converged after {steps} steps: its gradients over the last {n} steps put "
                         f"the means an estimated {nats:.3g} nats of ELBO short of the optimum, mostly along a direction "
                         f"{along}, where the posterior is so correlated that IVON's diagonal mean steps "
                         f"are slow (the whitened curvature there is {lam:.2g}, against 1 without correlation). The "
                         "means there may still be many posterior sds off, while the loss hardly moves. Fit with "
                         "nb.BLR() (its mean step uses the curvature across sites), or reparameterise the model to "
                         "remove the correlation (centre and scale the predictors).")]
    collapsed = []
    for b in getattr(layout, "blocks", ()):  # nb.BLR's test: a standard deviation at the rounding level of its mean
        m = np.asarray(s.params[b.loc])
        sd = np.asarray(b.transform(s.params[b.scale]))
        if np.any(collapsed_sd(sd, m, m.dtype)):
            collapsed.append(b.scale)
    if collapsed:
        problems.append((("collapsed",) + tuple(collapsed),
                         f"IVON: after {steps} steps the guide's standard deviation collapsed to the rounding level of "
                         f"the mean in {collapsed}: its one-sample curvature estimate is then rounding noise (a design "
                         "on a scale far from 1 in float32), or the posterior there is degenerate. Enable 64-bit floats "
                         "(numpyro.enable_x64()), rescale the predictors, or fit with nb.BLR() (exact curvature)."))
    return problems


def _direction_sites(layout, params, vector, guide, top=4):
    """The sites (parameters) that carry most of a unit vector over the guide's locs (raveled by sorted name)."""
    weights, start = {}, 0
    for name in sorted(b.loc for b in layout.blocks):
        size = int(np.prod(np.shape(params[name])))
        part = np.asarray(vector[start:start + size]) ** 2
        start += size
        for site, v in _by_site(name, part.reshape(np.shape(params[name])) if size > 1 else part, guide).items():
            weights[site] = weights.get(site, 0.0) + float(np.sum(v))
    ranked = sorted(weights.items(), key=lambda kv: -kv[1])
    return [k for k, w in ranked[:top] if w >= 0.05] or [ranked[0][0]]


class IVON(GuideOptimizer):
    r"""IVON (Shen et al. 2024) for SVI with a diagonal Gaussian guide; see the module docstring.

    ``IVON()`` (no ``lr``) needs no tuning: :func:`ivon_default_algorithm` (``nb.BLR()``'s adaptive step size on
    Kesten's clock with iterate averaging, the baselined Price curvature, a backtracked mean step, no momentum) and
    an end-of-run report that says whether it converged, where not, and what to change. With an ``lr`` the step is
    IVON's own, exactly as published (its hyper-parameters are then the user's to tune).

    :param lr: learning rate :math:`\alpha` (float or optax schedule of the step count); None (default): the
        default step size above, in units where the natural step is :math:`\rho = \alpha(h_0 + \delta)`.
    :param ess: effective sample size :math:`\lambda`: the number of data points the model's
        likelihood sums over. Required with an ``lr``; with the default step size, None reads it at ``svi.init``
        from the model: the largest, over its observed sites, of the product of the site's plate sizes (without
        plates, its leading batch size; :func:`numpyro_blr.svi.observation_count`), and 1 for a model without
        observed sites (it sets only the initial scales :math:`1/\sqrt{\lambda(h_0+\delta)}` and the units of
        ``hess_init`` and ``weight_decay``: the default step does not depend on it).
    :param hess_init: initial :math:`h_0` (sets the initial scales); ``None`` keeps the guide's.
    :param beta1: momentum (default 0.9 with an ``lr``, 0 with the default step size).
    :param beta2: precision averaging (default 0.99999 with an ``lr``; with the default step size the precision
        steps with the same :math:`\rho` as the mean, :math:`1 - \beta_2 = \rho`).
    :param clip_radius, rescale_lr: as in :func:`numpyro_blr.ivon` (``rescale_lr`` is moot with the default step).
    :param weight_decay: :math:`\delta`, an extra prior precision per example added by the
        optimizer (default 0: the model's prior is already in the ELBO).
    :param fallback: optax ``GradientTransformation`` (or NumPyro optimizer) for parameters outside the
        Gaussian (not needed for ``numpyro.contrib.module``'s unread ``"{name}$params"`` placeholders).
    :param guide, prefix: to read a non-default autoguide prefix or scale constraint.
    """

    def __init__(self, lr=None, ess=None, hess_init: Optional[float] = 1.0, beta1=None, beta2=None,
                 weight_decay=0.0, clip_radius=float("inf"), rescale_lr=True, *, fallback=None,
                 guide=None, prefix=None):
        # every option is an attribute: nb.fit keys its compiled programs by them
        self.lr, self.hess_init, self.beta1, self.beta2 = lr, hess_init, beta1, beta2
        self.weight_decay, self.clip_radius, self.rescale_lr = weight_decay, clip_radius, rescale_lr
        self.ess_option = ess
        if lr is None:  # the options are checked now (ess=1 stands in for the data's size until svi.init reads it)
            algorithm = self._default_algorithm(1.0 if ess is None else ess)
        else:
            algorithm = ivon_guide_algorithm(lr, ess, hess_init, 0.9 if beta1 is None else beta1,
                                             0.99999 if beta2 is None else beta2, weight_decay, clip_radius, rescale_lr)
        super().__init__(algorithm, fallback=fallback, guide=guide, prefix=prefix)
        self.ess = ess  # read by the end-of-run report (an ess far below the data's size is named there)

    RUN_STATE = ("data_size", "ess", "algorithm")  # the default ess is the data's size, read at svi.init

    def _default_algorithm(self, ess):
        return ivon_default_algorithm(ess, self.hess_init, 0.0 if self.beta1 is None else self.beta1, self.beta2,
                                      self.weight_decay, self.clip_radius, layout_of=self.layout)

    def init(self, params):
        if self.lr is None and self.ess_option is None:  # the default ess: the data's size, read by svi.init
            ess = float(self.data_size) if self.data_size else 1.0
            if ess != self.ess:
                self.ess = ess
                self.algorithm = self._default_algorithm(ess)
        return super().init(params)

    def check_data(self, model, args, kwargs):
        super().check_data(model, args, kwargs)
        # tracers (nb.fit's program, svi.run): the data's size from the shapes, for the default ess and for the report,
        # which names an ess far below it
        if self.data_size is None or any(isinstance(x, jax.core.Tracer) for x in jax.tree.leaves((args, kwargs))):
            self.data_size = _observations_of(model, args, kwargs)


def _observations_of(model, args, kwargs):
    """:func:`numpyro_blr.svi.observation_count` of the model on these arguments (tracers allowed: only the
    shapes are read), or None where the model cannot be traced so."""
    from numpyro_blr.compile_once import _trace_model
    from numpyro_blr.svi import observation_count

    try:
        return observation_count(_trace_model(model, args, kwargs))
    except Exception:  # noqa: BLE001 - NumPyro's own initialisation says what fails
        return None
