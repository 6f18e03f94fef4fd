r"""The Bayesian learning rule for mixtures of Gaussians, and multimodal optimisation.

Lin, Khan & Schmidt (2019), "Fast and simple natural-gradient variational inference with mixture
of exponential-family approximations", ICML; improved (positive-definite) version from Lin,
Schmidt & Khan (2020), "Handling the positive-definite constraint in the Bayesian learning rule",
ICML (reference code: ``yorkerlin/iBayesLRule``, ``MoG/src/mix_gauss_iBayesLRule.m``).
Khan & Rue (2023), "The Bayesian learning rule", JMLR, Table 1 rows "mixture of Gaussians"
and "multimodal optimisation".

The posterior approximation is a mixture of :math:`K` Gaussians
:math:`q(\theta) = \sum_c \pi_c \mathcal N(\theta \mid m_c, S_c^{-1})`, :math:`v_c = \log(\pi_c/\pi_K)`
(:mod:`numpyro_blr.families.mixture`), and the target is :math:`\bar p(\theta) \propto e^{-\ell(\theta)}`
with ``loss_fn`` :math:`=\ell` (minus an unnormalised log density). The BLR minimises
:math:`\mathbb E_q[\ell] - \mathcal H(q) = \mathbb E_q[f]` with :math:`f = \ell + \log q`.
Treating :math:`(\theta, c)` as a joint (minimal, conditional) exponential family, the natural
gradient splits per component (Lin et al. 2019, Thm. 3): with
:math:`\mathbb E_c[\cdot] = \mathbb E_{\mathcal N(m_c, S_c^{-1})}[\cdot]`,

.. math::
    S_c &\leftarrow S_c + \rho\, G_c + \tfrac{\rho^2}{2} G_c S_c^{-1} G_c,
        \qquad G_c = \mathbb E_c[\nabla^2 f] = \mathbb E_c[\nabla^2\ell + \nabla^2 \log q], \\
    m_c &\leftarrow m_c - \rho\, S_c^{-1} \mathbb E_c[\nabla f],
        \qquad \text{(new } S_c\text{)} \\
    v_c &\leftarrow v_c - \rho_\pi \big(\mathbb E_c[f] - \mathbb E_K[f]\big).

The first two lines are the Gaussian BLR step of each component with :math:`\hat H_c = S_c + G_c`
(:func:`numpyro_blr.rules.blr.gaussian_update`); its second-order term is the improved BLR: the new
precision is :math:`\tfrac12 S_c + \tfrac12 (S_c + \rho G_c) S_c^{-1}(S_c + \rho G_c) \succ 0` for
*any* symmetric :math:`G_c`. The third is the plain BLR on the weights' natural parameters
:math:`v`. For :math:`K = 1`, :math:`\nabla^2\log q = -S` and it is the Gaussian BLR
:math:`S \leftarrow (1-\rho) S + \rho\,\mathbb E[\nabla^2\ell]` (+ the correction).

**Composition** (family x estimator x rule, in :mod:`numpyro_blr.presets`): :func:`~numpyro_blr.mixture_blr`
is the mixture family x responsibility-weighted Monte Carlo (:func:`numpyro_blr.estimators.mixture.reparam`)
x :func:`mixture_update`; :func:`~numpyro_blr.multimodal_optimization` the same with the delta method
(:func:`numpyro_blr.estimators.mixture.delta`: every :math:`\mathbb E_c[h]` is :math:`h(m_c)`).

**The default step size** (``nb.mixture_blr()``, ``lr=None``; :func:`default_lr`) is ``nb.BLR()``'s adaptive
clock without iterate averaging: :math:`\rho_t = \rho_0/(1 + c_t/\tau)`, :math:`\rho_0 = 1/2`,
:math:`\tau = 10`, with

.. math::
    c_{t+1} = c_t + \min(1, 2 f_t),\qquad
    f_t = \frac{\sum_j (-u_j u'_j)_+}{\sum_j |u_j u'_j|},\qquad
    u = \big(\sqrt{\pi_c}\,R_c^{-1}\mathbb E_c[\nabla f],\;
        \sqrt{\pi_c}\,(\operatorname{diag}(R_c^{-1}\hat H_c R_c^{-\top}) - 1),\;
        \sqrt{\pi_c}\,(\mathbb E_c[f] - \mathbb E_K[f])\big)_{c=1..K},

:math:`S_c = R_c R_c^\top`, :math:`u'` the previous step's :math:`u` (:func:`step_direction`,
:func:`~numpyro_blr.rules.schedules.clock_advance`). :math:`f_t` is the size-weighted fraction of coordinates whose sign changed (Kesten
1958; Delyon & Juditsky 1993): about 0 while the fit travels (the clock stands still and :math:`\rho` stays at
:math:`\rho_0`), about 1/2 once the steps are Monte Carlo noise around the optimum (the clock then counts about
one per step, and :math:`\rho` decays like Robbins & Monro's :math:`\rho_0\tau/t`, which averages the noise into the last iterate). The weight
:math:`\pi_c` is the joint family's Fisher metric (component :math:`c`'s block of the Fisher information of
:math:`(\theta, c)` is :math:`\pi_c` times its Gaussian one): a component that dies far off keeps a persistent
direction, and without it would hold the clock still. With ``hessian='price'`` on full covariances
:math:`\rho_0 = \min(1/2, 1/d)`, :math:`\tau = 100` (``nb.BLR``'s :meth:`~numpyro_blr.BLR.default_lr`).
Each component's mean step is backtracked on its sample of :math:`\mathbb E_c[\ell]`
(:func:`numpyro_blr.estimators.mixture.mean_backtracking`), and a component whose own draws are not finite is
held while the others step (:func:`mixture_update`).

**Multimodal optimisation**: with the delta method each component takes an (improved, hence always
positive-definite, so a descent step even at saddles and maxima) Newton step on :math:`f` at its own
mean. Separated components run Newton's method in parallel, :math:`S_c \to \nabla^2\ell(m_c)` and
:math:`\pi_c \propto e^{-\ell(m_c)}|S_c|^{-1/2}` (each minimum's Laplace evidence); overlapping ones repel.

Both are :class:`~numpyro_blr.core.Algorithm` s over a :class:`MixtureState` (``init(means, precision=None,
logits=None)``; multimodal optimisation's ``step`` reads no key: pass None); :func:`weights`,
:func:`log_prob`, :func:`sample` and :func:`modes` are functions of the state. :math:`\theta` is a flat
vector (``jax.flatten_util.ravel_pytree`` for pytrees).
"""

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.scipy.linalg import solve_triangular

from numpyro_blr.core import Algorithm, StepInfo, select, value_at
from numpyro_blr.families.mixture import log_prob, log_weights, sample, weights
from numpyro_blr.report import LossTrace, init_loss_trace, loss_trace_problems, next_loss_trace
from numpyro_blr.rules.blr import gaussian_update
from numpyro_blr.rules.schedules import adaptive_decay, clock_advance

COVARIANCES = ("full", "diagonal")

__all__ = ["COVARIANCES", "MixtureRule", "MixtureState", "check", "clock_advance", "default_lr", "init_mixture",
           "log_prob", "log_weights", "mixture_algorithm", "mixture_update", "modes", "report", "sample",
           "step_direction", "weights"]


class MixtureState(NamedTuple):
    r"""``means`` (K, d) :math:`m_c`; ``precision`` (K, d, d) :math:`S_c`, or (K, d) diagonals; ``logits`` (K,)
    :math:`v_c = \log(\pi_c/\pi_K)`, last entry 0; ``count`` steps taken and ``skipped`` non-finite steps, int32
    (each skipped step halves both step sizes: :math:`\rho\,2^{-\text{skipped}}`); ``trace`` the
    :class:`~numpyro_blr.report.LossTrace` of the kept steps' losses (the evidence of :func:`report`); ``best``
    ``(means, precision, logits)`` of the step whose loss set the trace's best average, the state a skipped step
    returns to; ``clock`` the count of noise-dominated steps that the default step size
    (:class:`~numpyro_blr.rules.schedules.adaptive_decay`) reads and ``direction`` the last kept step's whitened
    direction it compares the next one with (:func:`step_direction`; both stay 0 with a number or a schedule);
    ``held`` (K,) the steps in which each component was held (its own draws or update not finite, the others
    stepping): each returned it to its ``best`` entry and halved its step sizes,
    :math:`\rho\,2^{-\text{skipped}-\text{held}_c}`."""

    means: jax.Array
    precision: jax.Array
    logits: jax.Array
    count: jax.Array
    skipped: jax.Array
    trace: LossTrace
    best: Any
    clock: Any = None
    direction: Any = None
    held: Any = None


class MixtureRule(NamedTuple):
    """Options of :func:`mixture_update`: ``lr`` :math:`\\rho` and ``weight_lr`` :math:`\\rho_\\pi` (numbers,
    schedules ``count -> rate``, :class:`~numpyro_blr.rules.schedules.adaptive_decay` s, or None: :func:`default_lr`),
    ``improved``, the positivity rule of :mod:`numpyro_blr.rules.blr`, and ``sampled_hessian`` (Price's estimate:
    :func:`default_lr` starts lower on full covariances)."""

    lr: Any = None
    weight_lr: Any = None
    improved: Any = "improved"
    sampled_hessian: bool = False


def default_lr(dim, sampled_hessian=False, diagonal=False):
    r"""The step size when none is given: ``nb.BLR()``'s adaptive clock (:class:`~numpyro_blr.rules.schedules.
    adaptive_decay`) without iterate averaging, :math:`\rho = \rho_0/(1 + c/\tau)`: :math:`\rho_0 = 1/2`,
    :math:`\tau = 10`; with a sampled (Price) Hessian on full covariances of dimension ``dim`` :math:`d`, :math:`\rho_0 = \min(1/2, 1/d)`,
    :math:`\tau = 100` (a one-draw estimate of a :math:`d\times d` Hessian has noise of order :math:`d` times the
    signal; :meth:`numpyro_blr.BLR.default_lr`). Without averaging the rate decays like :math:`\rho_0\tau/t` once the
    clock counts (Robbins-Monro), so the last iterate, which is the fit, averages the Monte Carlo noise away."""
    if sampled_hessian and not diagonal:
        return adaptive_decay(min(0.5, 1.0 / dim), 100, averaging=False)
    return adaptive_decay(0.5, 10, averaging=False)


def step_sizes(rule, state):
    """``(lr, weight_lr)`` of ``rule`` for ``state``: :func:`default_lr` (from the state's shape) where None."""
    lr = rule.lr
    if lr is None:
        lr = default_lr(state.means.shape[1], rule.sampled_hessian, state.precision.ndim == state.means.ndim)
    return lr, (lr if rule.weight_lr is None else rule.weight_lr)


def init_mixture(means, precision, logits, num_components, covariance, precision_init):
    """A fresh :class:`MixtureState`; ``precision`` defaults to ``precision_init`` times the identity,
    ``logits`` to equal weights."""
    means = jnp.asarray(means)
    if not jnp.issubdtype(means.dtype, jnp.floating):
        means = means.astype(jnp.float32)
    if means.ndim != 2 or (num_components is not None and means.shape[0] != num_components):
        raise ValueError(f"means must have shape (num_components, d) = ({num_components}, d), got {means.shape}.")
    (K, d), dtype = means.shape, means.dtype
    diagonal = covariance == "diagonal"
    if precision is None:
        eye = jnp.ones((d,), dtype) if diagonal else jnp.eye(d, dtype=dtype)
        precision = jnp.broadcast_to(precision_init * eye, (K,) + eye.shape)
    precision = jnp.asarray(precision, dtype)
    want = (K, d) if diagonal else (K, d, d)
    if precision.shape != want:
        raise ValueError(f"precision must have shape {want}, got {precision.shape}.")
    logits = jnp.zeros((K,), dtype) if logits is None else jnp.asarray(logits, dtype)
    if logits.shape != (K,):
        raise ValueError(f"logits must have shape ({K},), got {logits.shape}.")
    zero = jnp.zeros((), jnp.int32)
    logits = logits - logits[-1]
    clock, direction = jnp.zeros((), dtype), jnp.zeros((K * (2 * d + 1),), dtype)
    return MixtureState(means, precision, logits, zero, zero, init_loss_trace(dtype), (means, precision, logits),
                        clock, direction, jnp.zeros((K,), jnp.int32))


def step_direction(precision, grad_means, hess, grad_logits, pis=None):
    r"""The whitened step that the adaptive step size's clock compares between steps (Kesten's rule, as
    ``nb.BLR()``'s :func:`~numpyro_blr.report.next_trace`): per component, the mean's :math:`R_c^{-1}\,\mathbb
    E_c[\nabla f]` and the precision's :math:`\operatorname{diag}(R_c^{-1}\hat H_c R_c^{-\top}) - 1`
    (:math:`S_c = R_c R_c^\top`, :math:`\hat H_c = S_c + G_c`: 0 at the fixed point), and the weights' natural
    gradient :math:`\mathbb E_c[f] - \mathbb E_K[f]`; flat, (K (2d + 1),)."""
    if precision.ndim == grad_means.ndim:  # diagonal
        root = jnp.sqrt(precision)
        u, curvature = grad_means / root, hess / precision - 1.0
    else:
        chol = jnp.linalg.cholesky(precision)
        u = jax.vmap(lambda r, g: solve_triangular(r, g, lower=True))(chol, grad_means)
        half = jax.vmap(lambda r, h: solve_triangular(r, h, lower=True))(chol, hess)  # R^-1 H
        white = jax.vmap(lambda r, a: solve_triangular(r, a.T, lower=True))(chol, half)  # R^-1 H R^-T (symmetric)
        curvature = jnp.diagonal(white, axis1=-2, axis2=-1) - 1.0
    if pis is not None:  # the joint family's Fisher metric: component c's block carries pi_c
        root = jnp.sqrt(pis)
        u, curvature, grad_logits = u * root[:, None], curvature * root[:, None], grad_logits * root
    return jnp.concatenate([u.reshape(-1), curvature.reshape(-1), jnp.ravel(grad_logits)])


def mixture_update(rule: MixtureRule, state: MixtureState, estimate, line_search=None):
    """One BLR step of every component and of the weights from an
    :class:`~numpyro_blr.estimators.Estimate` of :mod:`numpyro_blr.estimators.mixture`, at the step sizes of
    :func:`step_sizes` (the default's clock advanced by :func:`clock_advance`); ``line_search(new_means) -> alpha``
    (K,) damps the mean steps (:func:`numpyro_blr.estimators.mixture.mean_backtracking`). A component whose
    estimate (its own draws) or update is not finite is held: returned to its entry of ``state.best`` with its
    step sizes halved for the rest of the run, while the others step. When no component can step, the step is
    skipped, as ``nb.BLR()`` and ``nb.LieGroupBLR()`` skip one: it halves every step size for the rest of the run
    and returns the components and weights to ``state.best``, the iterate whose loss set the run's best average
    (a run that diverged through finite steps before the first non-finite one restarts from before the
    divergence, with a shorter step). Returns ``(state, StepInfo(estimate.loss, skipped))``; :func:`report` reads
    the skipped steps, the held components and the losses."""
    dtype = state.means.dtype
    # 1 until a step is skipped (all components) or a component held (that one): healthy runs are unchanged
    skips = state.skipped if state.held is None else state.skipped + state.held  # (K,) or ()
    damping = jnp.broadcast_to(jnp.exp2(-skips.astype(dtype)), state.logits.shape)
    clock = jnp.zeros((), dtype) if state.clock is None else state.clock
    lr, weight_lr = step_sizes(rule, state)
    adaptive = any(getattr(x, "adaptive", False) for x in (lr, weight_lr))
    lr, weight_lr = rate(lr, state.count, clock) * damping, rate(weight_lr, state.count, clock) * damping
    hess = state.precision + estimate.hessian  # H_c = S_c + G_c
    if hess.ndim == 3:
        hess = 0.5 * (hess + jnp.swapaxes(hess, -1, -2))
    direction = state.direction
    if adaptive and direction is not None:  # the clock of the default step size (Kesten's rule)
        new_direction = step_direction(state.precision, estimate.grad.means, hess, estimate.grad.logits,
                                       weights(state))
        new_direction = jnp.where(jnp.isfinite(new_direction), new_direction, 0.0).astype(dtype)  # a held component: 0
        clock = clock + clock_advance(new_direction, direction, state.count).astype(dtype)
        direction = new_direction
    step = lambda m, p, g, h, r: gaussian_update(m, p, g, h, r, rule.improved)  # noqa: E731
    means, precision = jax.vmap(step)(state.means, state.precision, estimate.grad.means, hess, lr)
    if line_search is not None:  # backtracking on each component's mean step (estimators.mixture.mean_backtracking)
        alpha = jax.lax.stop_gradient(line_search(means))
        means = state.means + alpha[:, None] * (means - state.means)
    logits = state.logits - weight_lr * estimate.grad.logits
    # per component: one whose estimate (its own draws) or update is not finite is held (returned to its best
    # iterate, its step sizes halved) while the others step; when none can step, the step is skipped (all
    # components and weights back to the best iterate, every step size halved)
    rows = lambda a: jnp.all(jnp.isfinite(a).reshape(a.shape[0], -1), axis=1)  # noqa: E731
    moved = rows(means) & rows(precision)
    ok = jnp.any(moved)
    current = (state.means, state.precision, state.logits)
    best_means, best_precision, _ = state.best
    means = jnp.where(moved[:, None], means, best_means)
    precision = jnp.where(moved.reshape((-1,) + (1,) * (precision.ndim - 1)), precision, best_precision)
    logits = jnp.where(jnp.isfinite(logits) & moved, logits, state.logits)
    logits = logits - logits[-1]
    means, precision, logits = select(ok, (means, precision, logits), state.best)
    loss = jnp.mean(jnp.asarray(estimate.loss, dtype))  # multimodal optimisation: the mean of l(m_c)
    trace = next_loss_trace(state.trace, state.count, loss)
    improved = ok & jnp.isfinite(loss) & (trace.loss_best < state.trace.loss_best)
    trace = select(ok, trace, state.trace)
    best = select(improved, current, state.best)
    if state.clock is not None:  # a skipped step leaves the clock and the direction as they were
        clock, direction = select(ok, (clock, direction), (state.clock, state.direction))
    held = None if state.held is None else state.held + (ok & ~moved).astype(state.held.dtype)
    new = MixtureState(means, precision, logits, jnp.where(ok, state.count + 1, state.count),
                       state.skipped + jnp.where(ok, 0, 1).astype(jnp.int32), trace, best, clock, direction, held)
    return new, StepInfo(estimate.loss, ~ok)


def rate(lr, count, clock):
    """A step size at this step: an :class:`~numpyro_blr.rules.schedules.adaptive_decay` read at ``clock``
    (:meth:`~numpyro_blr.rules.schedules.adaptive_decay.iterate`: no iterate is averaged here), a schedule at
    ``count``, or the number."""
    if getattr(lr, "adaptive", False):
        return lr.iterate(clock)
    return value_at(lr, count)


def mixture_algorithm(estimator, rule: MixtureRule, num_components, covariance="full", precision_init=1.0,
                      backtrack=None):
    """A mixture row as an :class:`~numpyro_blr.core.Algorithm`: ``step`` is ``estimator`` then :func:`mixture_update`
    (with ``backtrack``, :func:`numpyro_blr.estimators.mixture.mean_backtracking`'s damping of the mean steps at the
    step's draws)."""
    if covariance not in COVARIANCES:
        raise ValueError(f"covariance must be one of {COVARIANCES}, got {covariance!r}.")

    def init(means, precision=None, logits=None):
        return init_mixture(means, precision, logits, num_components, covariance, precision_init)

    def update(state, estimate):
        return mixture_update(rule, state, estimate)

    def step(key, state, loss_fn, *args):
        estimate = estimator(key, state, loss_fn, *args)
        if backtrack is None:
            return update(state, estimate)
        return mixture_update(rule, state, estimate, lambda means: backtrack(key, state, means, loss_fn, *args))

    return Algorithm(init=init, step=step, sample=sample, update=update)


def report(state, name="nb.mixture_blr"):
    """``[(key, message), ...]``: the problems the end state of a run shows (host-side, outside ``jit``), each
    naming what to change: steps skipped as non-finite (each halved the step sizes and returned to the best
    iterate), components held (the same, for one component, while the others stepped; shown when the component's
    weight is above the float epsilon: a component that died far off does not change :math:`q`), a run that diverged or whose loss was still falling at the end (:func:`numpyro_blr.report.
    loss_trace_problems`, the tests and thresholds of ``nb.BLR()``'s and ``nb.IVON``'s reports). Empty when
    none. ``name``: the row in the messages (``"nb.multimodal_optimization"`` for that row)."""
    steps, skipped = int(state.count), int(state.skipped)
    out = []
    if skipped:
        total = steps + skipped
        unusable = (" The fit is not usable: most of its steps were skipped, and the last finite state is kept."
                    if 2 * skipped > total else "")
        out.append((("skipped", skipped, total),
                    f"{name} skipped {skipped} of {total} step(s) because of a non-finite estimate or update (a draw "
                    "where the loss, its gradient or Hessian overflowed, or a precision that left float range); each "
                    "skipped step returned the components and weights to the best iterate so far and halved both step "
                    f"sizes, now {2.0 ** -skipped:.3g} times their schedule.{unusable} Pass a smaller lr (and "
                    "weight_lr; the default starts at 0.5), a larger precision_init (narrower initial components), or means started nearer the mode; check "
                    "the loss for overflow (exp of a wide draw) in the model's log density."))
    held = np.zeros(0, int) if getattr(state, "held", None) is None else np.asarray(state.held)
    pis = np.asarray(weights(state), np.float64)
    # a held component of weight below rounding of the others (one whose fit went far off and died) does not change q
    shown = [c for c in range(held.size) if held[c] and pis[c] > np.finfo(np.asarray(state.means).dtype).eps]
    if shown:
        which = ", ".join(f"{c} ({int(held[c])} steps, weight {pis[c]:.3g})" for c in shown)
        out.append((("held", tuple(shown)),
                    f"{name} held component(s) {which} of {steps} step(s), because their own draws gave a "
                    "non-finite loss, gradient or Hessian (or their update was not finite), while the other "
                    "components stepped; each hold returned the component to its best iterate and halved its step "
                    "sizes. Start the means nearer the mode, pass a larger precision_init (narrower "
                    "initial components) or fewer components, or check the loss for overflow in the model's log "
                    "density."))
    out += loss_trace_problems(
        state.trace, steps, name,
        "Pass a smaller lr (and weight_lr) or a decaying schedule (lr=lambda t: lr0 / (1 + t / 100)), a larger "
        "precision_init, or keep backtrack=True (nb.mixture_blr's default).",
        "Continue the run from its state (more steps), or pass a larger lr if no step was skipped.")
    return out


def check(state, name="nb.mixture_blr"):
    """Warn (``RuntimeWarning``, one per problem) about what :func:`report` finds in the end state of a run and
    return its ``[(key, message), ...]``; call it after the loop (``jit``/``scan`` cannot warn)."""
    import warnings  # noqa: PLC0415

    out = report(state, name)
    for _, message in out:
        warnings.warn(message, RuntimeWarning, stacklevel=2)
    return out


def modes(state, loss_fn=None, tol=1e-2):
    """Distinct component means (host-side helper, not jit-able).

    Means closer than ``tol`` (Euclidean) are merged, keeping the first; returns a numpy array
    (n_modes, d) sorted by ``loss_fn`` value if given, else by decreasing mixture weight.
    """
    means = np.asarray(state.means)
    order = np.argsort(-np.asarray(weights(state)))
    kept = []
    for i in order:
        if np.all(np.isfinite(means[i])) and all(np.linalg.norm(means[i] - means[j]) > tol for j in kept):
            kept.append(i)
    out = means[kept]
    if loss_fn is not None and len(out):
        vals = np.asarray(jax.vmap(loss_fn)(jnp.asarray(out)))
        out = out[np.argsort(vals)]
    return out
