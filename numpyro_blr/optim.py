r"""``BLR``: the Bayesian learning rule as an optimizer that NumPyro's ``SVI`` accepts.

``SVI(model, guide, nb.BLR(), Trace_ELBO())`` runs, for every Gaussian block of the guide
(see :mod:`numpyro_blr.layout`), the natural-gradient step of Khan & Rue (2023, eq. 11) with the
improved-BLR positivity correction (Lin, Schmidt & Khan 2020):

.. math::
    S &\leftarrow S + \rho G + \tfrac{\rho^2}{2} G S^{-1} G, \quad G = \hat H - S, \\
    \bar g &\leftarrow \beta \bar g + (1-\beta) \hat g, \\
    m &\leftarrow m - \rho\, S^{-1} \bar g / (1-\beta^t),

where :math:`\hat g, \hat H` come from :mod:`numpyro_blr.estimators`. Point masses (``AutoDelta``,
``AutoLaplaceApproximation``) carry their precision in the optimizer state (delta method).
Parameters outside any Gaussian go to a ``fallback`` optax optimizer or are rejected by name.
"""

import functools
import math
import warnings
from typing import Any, Callable, NamedTuple, Optional, Union

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.scipy.linalg import solve_triangular
from numpyro.optim import _NumPyroOptim

from numpyro_blr.estimators import HESSIANS, estimate
from numpyro_blr import expfam_blocks
from numpyro_blr.layout import DIAGONAL, EXPFAM, FULL, POINT, GuideLayoutError, read_layout
from numpyro_blr.rules.blr import (
    diagonal_precision_update,
    full_precision_update,
    full_scale_tril_update,
    momentum_update,
)


AUTODIFF_MAX_DIM = 256


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


class BLRState(NamedTuple):
    """Optimizer state: fixed-shape arrays only, so ``SVI.run`` can ``lax.scan`` and resume exactly.

    ``params``            unconstrained guide parameters (what ``get_params`` returns);
    ``momentum``          heavy-ball average of the mean gradient, per loc;
    ``point_precision``   joint precision of all point-mass locs (delta method), ``(0, 0)`` if none;
    ``fallback_state``    the fallback optax optimizer's state;
    ``nonfinite``         per parameter, whether a non-finite gradient or update was ever met;
    ``nonfinite_steps``   how many steps were skipped for that reason.
    """

    params: dict
    momentum: dict
    point_precision: jax.Array
    fallback_state: Any
    nonfinite: dict
    nonfinite_steps: jax.Array


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


def _check_unit_interval(x, name):
    if isinstance(x, bool) or not isinstance(x, (int, float, np.floating, np.integer)) or not (0.0 <= x < 1.0):
        raise ValueError(f"{name} must be a float in [0, 1), got {x!r}.")
    return float(x)


def _finite_or_zero(x):
    """A control-variate term is optional: drop it (not the step) if it could not be computed."""
    return jnp.where(jnp.all(jnp.isfinite(x)), x, jnp.zeros_like(x))


def _report_nonfinite(flags, skipped):
    names = sorted(k for k, v in flags.items() if bool(v))
    warnings.warn(
        f"nb.BLR skipped {skipped} step(s) because of a non-finite loss, gradient or update, for "
        f"parameter(s) {names}; those steps kept the last finite values. Check the model's log density "
        "at the current guide, lower lr, or use SVI.run(..., stable_update=True).",
        RuntimeWarning,
        stacklevel=4,  # _report_nonfinite <- BLR.get_params <- SVI.get_params <- the caller
    )


class BLR(_NumPyroOptim):
    r"""The Bayesian learning rule for Gaussian guides, as a NumPyro optimizer.

    :param lr: step size :math:`\rho` (float > 0 or an optax schedule ``step -> rho``). Default:
        :func:`harmonic_decay` ``0.5 / (1 + t/10)`` (see :meth:`default_lr` for sampled Hessians
        on full-covariance guides).
    :param hessian: how :math:`\mathbb{E}_q[\nabla^2\ell]` is estimated: ``"reparam"`` (Price/Stein,
        from the gradient w.r.t. the scale, with a same-noise baseline: two gradient passes),
        ``"price"`` (the plain one-pass Price estimator), ``"autodiff"`` (exact Hessian at the sample;
        small models) or ``"none"`` (keep the covariance; gradient descent). Default: ``"autodiff"``
        when the Gaussian blocks hold at most 256 numbers or with ``delta=True``, ``"reparam"``
        otherwise; point masses always use ``"autodiff"`` (or ``"none"``).
    :param delta: delta method: evaluate gradient and Hessian at the mean instead of a sample.
    :param momentum: heavy-ball coefficient :math:`\beta \in [0, 1)` on the mean gradient.
    :param improved: apply the improved-BLR correction (positive definite for any :math:`\hat H`
        and :math:`\rho`). With ``False`` the plain BLR is used: exact for ``lr=1`` on quadratic
        losses, but a non-positive-definite update is then skipped as non-finite.
    :param init_precision: initial precision of point-mass locs (delta method), a float > 0.
    :param fallback: an ``optax.GradientTransformation`` for parameters that are not part of a
        Gaussian (a model's ``numpyro.param``...). Without it such parameters raise an error.
    :param guide: optional; the guide, to read its prefix and scale constraints when they differ
        from NumPyro's defaults.
    :param prefix: the autoguide prefix (default ``"auto"``, or the guide's).
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
        improved: bool = True,
        init_precision: float = 1.0,
        fallback=None,
        guide=None,
        prefix: Optional[str] = None,
        seed: int = 0,
    ):
        self.lr = None if lr is None else _check_lr(lr)
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
        self.improved = bool(improved)
        self.init_precision = _check_lr(init_precision, "init_precision")
        if fallback is not None and not (hasattr(fallback, "init") and hasattr(fallback, "update")):
            raise ValueError(f"fallback must be an optax GradientTransformation, got {type(fallback).__name__}.")
        self.fallback = fallback
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
        self._reported_skips = 0  # host-side only: how many skipped steps get_params already reported

    # -- structure -------------------------------------------------------------------------
    def layout(self, params):
        """The guide's Gaussian blocks read from ``params`` (raises if it cannot be read)."""
        layout = read_layout(params, self.prefix, self.scale_constraint, self.scale_tril_constraint)
        if not layout.blocks:
            raise GuideLayoutError(
                f"nb.BLR found no Gaussian in the parameters {sorted(params)}: it expects an autoguide's "
                f"'<site>_{self.prefix}_loc'/'<site>_{self.prefix}_scale', '{self.prefix}_loc'/"
                f"'{self.prefix}_scale_tril' or point-mass '{self.prefix}_loc' parameters. Use AutoNormal, "
                "AutoDiagonalNormal, AutoMultivariateNormal or AutoDelta, or pass guide=... if it uses another prefix "
                "(for positive, unit-interval, simplex or discrete latents use nb.ExpFamilyGuide)."
            )
        if layout.other and self.fallback is None:
            raise GuideLayoutError(
                f"nb.BLR cannot treat the parameter(s) {list(layout.other)} as part of a Gaussian guide. "
                "Pass fallback=optax.adam(1e-3) (or another optax optimizer) to update them, or remove them."
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
    def init(self, params):
        layout = self.layout(params)
        dp = self._point_dim(params, layout) if self.point_hessian == "autodiff" else 0
        dtype = jnp.result_type(*[params[b.loc] for b in layout.blocks])
        other = {k: params[k] for k in layout.other}
        state = BLRState(
            params=dict(params),
            momentum={b.loc: jnp.zeros_like(params[b.loc]) for b in layout.blocks},
            point_precision=self.init_precision * jnp.eye(dp, dtype=dtype),
            fallback_state=self.fallback.init(other) if self.fallback is not None else (),
            nonfinite={k: jnp.array(False) for k in params},
            nonfinite_steps=jnp.array(0, dtype=jnp.int32),
        )
        return jnp.array(0), state

    def get_params(self, state):
        """The guide's unconstrained parameters. Outside ``jit`` (``SVI.run`` calls this once at the
        end of a run), warns if steps were skipped because of non-finite values since the last
        warning, and names the parameters concerned."""
        s = state[1]
        if not isinstance(s.nonfinite_steps, jax.core.Tracer):
            skipped = int(s.nonfinite_steps)
            if skipped and skipped != self._reported_skips:
                _report_nonfinite(s.nonfinite, skipped)
            self._reported_skips = skipped
        return s.params

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

        ``harmonic_decay(0.5, 10)``, except with a sampled Hessian (``"price"``, ``"reparam"``) on a
        full-covariance block of dimension ``D``: a one-sample estimate of a ``D x D`` Hessian has
        noise of order ``D`` times the signal, so there the schedule starts at ``min(0.5, 1/D)``
        and halves over 100 steps.
        """
        full = [params[b.loc].shape[-1] for b in layout.blocks if b.kind == FULL]
        if full and self.hessian_for(params, layout) in ("price", "reparam"):
            return harmonic_decay(min(0.5, 1.0 / max(full)), 100)
        return harmonic_decay(0.5, 10)

    def step_size(self, i, params, layout):
        """:math:`\\rho` at step ``i`` (counted from 0) for a guide with these ``params``."""
        lr = self.lr if self.lr is not None else self.default_lr(params, layout)
        return lr(i) if callable(lr) else lr

    def _step(self, fn, state, forward_mode, stable):
        i, s = state
        params = s.params
        layout = self.layout(params)
        (loss, aux), grads, stats, points = estimate(
            fn, params, layout, self.hessian_for(params, layout), self.delta, forward_mode, self.point_hessian
        )
        t = i + 1
        lr = jnp.asarray(self.step_size(i, params, layout), dtype=jnp.result_type(float))
        new_params, new_mom = dict(params), dict(s.momentum)
        checked = {}  # parameter name -> arrays that must be finite for its update to be valid

        for j, b in enumerate(layout.blocks):
            if b.kind == EXPFAM:  # ExpFamilyGuide's Gamma/Beta/Dirichlet/Bernoulli/Categorical sites
                key = jax.random.fold_in(jax.random.fold_in(jax.random.PRNGKey(self.seed), i), j)
                new = expfam_blocks.update_block(
                    b, fn, params, grads, lr, self.improved, key,
                    self.max_enumerate, self.score_samples,
                )
                new_params.update(new)
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
                if st.offset is not None:
                    g = g - _finite_or_zero(st.offset / scale**2)
                new_mom[b.loc], mbar = momentum_update(s.momentum[b.loc], g, self.momentum, t)
                if st.h is None:
                    new_params[b.loc] = m - lr * mbar
                else:
                    prec = diagonal_precision_update(scale**-2, st.h, lr, self.improved)
                    new_params[b.loc] = m - lr * mbar / prec
                    new_params[b.scale] = b.transform.inv(lax.rsqrt(prec))
            else:  # FULL
                tril = b.transform(params[b.scale])
                if st.offset is not None:  # S (z - m) = L^-T L^-1 (z - m)
                    whitened = solve_triangular(tril, st.offset, lower=True)
                    g = g - _finite_or_zero(solve_triangular(tril.T, whitened, lower=False))
                new_mom[b.loc], mbar = momentum_update(s.momentum[b.loc], g, self.momentum, t)
                if st.h is None:
                    new_params[b.loc] = m - lr * mbar
                else:
                    new_tril = full_scale_tril_update(tril, st.h, lr, self.improved, st.whitened)
                    new_params[b.loc] = m - lr * (new_tril @ (new_tril.T @ mbar))
                    new_params[b.scale] = b.transform.inv(new_tril)
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
                step = mbar
            else:
                prec = s.point_precision
                cov = jax.scipy.linalg.cho_solve((jnp.linalg.cholesky(prec), True), jnp.eye(prec.shape[0], dtype=prec.dtype))
                new_point_prec = full_precision_update(prec, cov, points.h, lr, self.improved)
                step = jax.scipy.linalg.cho_solve((jnp.linalg.cholesky(new_point_prec), True), mbar)
            flat_new = flat_m - lr * step
            start = 0
            for n in names:
                size = params[n].size
                new_params[n] = flat_new[start : start + size].reshape(params[n].shape)
                new_mom[n] = flat_mom[start : start + size].reshape(params[n].shape)
                checked[n] = (grads[n], new_params[n], new_point_prec)
                start += size

        new_fb = s.fallback_state
        if layout.other:
            other_g = {k: grads[k] for k in layout.other}
            other_p = {k: params[k] for k in layout.other}
            updates, new_fb = self.fallback.update(other_g, s.fallback_state, other_p)
            for k in layout.other:
                new_params[k] = params[k] + updates[k]
                checked[k] = (grads[k], new_params[k])

        def all_finite(arrays):
            # one reduction: x * 0 is 0 for finite x and NaN for inf/NaN, so the sum is finite iff all are
            return jnp.isfinite(sum(jnp.sum(a * 0) for a in arrays))

        loss_ok = jnp.isfinite(loss)
        finite = {k: all_finite(arrs) for k, arrs in checked.items()}
        ok = loss_ok & functools.reduce(jnp.logical_and, finite.values(), jnp.array(True))
        new_state = BLRState(new_params, new_mom, new_point_prec, new_fb, s.nonfinite, s.nonfinite_steps)
        # Selections, not lax.cond: a conditional inside SVI.run's scan costs about 5 us per step
        # on CPU (as much as a whole Adam step on a small model), a select is fused for free.
        keep = lambda new, old: jax.tree_util.tree_map(lambda a, b: jnp.where(ok, a, b), new, old)  # noqa: E731

        if stable:
            loss = jnp.where(ok, loss, jnp.full_like(loss, jnp.nan))
            return (loss, aux), keep((t, new_state), state)

        bad = {k: ~finite.get(k, loss_ok) | ~loss_ok for k in params}
        flags = {k: s.nonfinite[k] | (bad[k] & ~ok) for k in params}
        kept = BLRState(params, s.momentum, s.point_precision, s.fallback_state, flags, s.nonfinite_steps + 1)
        return (loss, aux), (t, keep(new_state._replace(nonfinite=flags), kept))


def nonfinite_parameters(state):
    """Names of the parameters whose gradient or update was ever non-finite in a BLR run.

    ``state`` is an ``SVIState`` (``svi_result.state``) or a BLR optimizer state.
    """
    opt_state = getattr(state, "optim_state", state)
    blr_state = opt_state[1]
    return sorted(k for k, v in blr_state.nonfinite.items() if bool(v))
