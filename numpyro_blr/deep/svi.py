r"""``IVON`` as a NumPyro optimizer: ``SVI(model, guide, IVON(lr=..., ess=N), Trace_ELBO())``.

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
from jax import lax
from numpyro.optim import _value_and_grad

from numpyro_blr.estimators import Estimate
from numpyro_blr.layout import DIAGONAL, GuideLayoutError
from numpyro_blr.presets import ivon
from numpyro_blr.report import LossTrace, init_loss_trace, loss_trace_problems, next_loss_trace
from numpyro_blr.rules.diagonal import DiagonalState
from numpyro_blr.svi import GuideAlgorithm, GuideOptimizer, GuideStep, commit_if_finite, skipped_report
from numpyro_blr.tree import FlatLayout


class IVONSVIState(NamedTuple):
    r"""IVON's state over the guide's locs: ``momentum`` (IVON's gradient EMA per loc, in per-example
    units :math:`\nabla U/\lambda`), ``count`` (IVON steps taken) and ``trace``
    (:class:`~numpyro_blr.report.LossTrace`: the losses the end-of-run report reads)."""

    momentum: dict
    count: jax.Array
    trace: LossTrace = None


def ivon_guide_algorithm(lr, ess, hess_init=1.0, beta1=0.9, beta2=0.99999, weight_decay=0.0,
                         clip_radius=float("inf"), rescale_lr=True):
    """IVON over a guide's diagonal Gaussian blocks, for :class:`~numpyro_blr.svi.GuideOptimizer`
    (the mapping in the module docstring)."""
    algorithm = ivon(lr, ess, hess_init=1.0 if hess_init is None else hess_init, beta1=beta1, beta2=beta2,
                     weight_decay=weight_decay, clip_radius=clip_radius,
                     rescale_lr=bool(rescale_lr) and hess_init is not None)
    lam, delta = float(ess), float(weight_decay)

    def check_layout(layout, params, prefix):
        bad = [b.loc for b in layout.blocks if b.kind != DIAGONAL]
        if bad or not layout.blocks:
            raise GuideLayoutError(
                f"IVON needs a diagonal Gaussian guide ('<site>_{prefix}_loc'/'<site>_{prefix}_scale' "
                f"or '{prefix}_loc'/'{prefix}_scale': AutoNormal, AutoDiagonalNormal); "
                f"got parameters {sorted(params)}" + (f" (not diagonal Gaussian: {bad})" if bad else "") + "."
            )

    def init(params, layout):
        if hess_init is not None:
            sd = (lam * (hess_init + delta)) ** -0.5
            for b in layout.blocks:
                params[b.scale] = b.transform.inv(jnp.full_like(params[b.scale], sd))
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

    return GuideAlgorithm("IVON", init, step, commit_if_finite, report, check_layout)


class IVON(GuideOptimizer):
    r"""IVON (Shen et al. 2024) for SVI with a diagonal Gaussian guide; see the module docstring.

    :param lr: learning rate :math:`\alpha` (float or optax schedule of the step count).
    :param ess: effective sample size :math:`\lambda`: the number of data points the model's
        likelihood sums over.
    :param hess_init: initial :math:`h_0` (sets the initial scales); ``None`` keeps the guide's.
    :param beta1, beta2, clip_radius, rescale_lr: as in :func:`numpyro_blr.ivon`.
    :param weight_decay: :math:`\delta`, an extra prior precision per example added by the
        optimizer (default 0: the model's prior is already in the ELBO).
    :param fallback: optax ``GradientTransformation`` (or NumPyro optimizer) for parameters outside the
        Gaussian (not needed for ``numpyro.contrib.module``'s unread ``"{name}$params"`` placeholders).
    :param guide, prefix: to read a non-default autoguide prefix or scale constraint.
    """

    def __init__(self, lr, ess=None, hess_init: Optional[float] = 1.0, beta1=0.9, beta2=0.99999,
                 weight_decay=0.0, clip_radius=float("inf"), rescale_lr=True, *, fallback=None,
                 guide=None, prefix=None):
        algorithm = ivon_guide_algorithm(lr, ess, hess_init, beta1, beta2, weight_decay, clip_radius, rescale_lr)
        super().__init__(algorithm, fallback=fallback, guide=guide, prefix=prefix)
        self.ess = ess  # read by the end-of-run report (an ess far below the data's size is named there)
