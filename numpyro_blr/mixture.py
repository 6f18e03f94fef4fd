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

from numpyro_blr.core import Algorithm, StepInfo, all_finite, select, value_at
from numpyro_blr.families.mixture import log_prob, log_weights, sample, weights
from numpyro_blr.report import LossTrace, init_loss_trace, loss_trace_problems, next_loss_trace
from numpyro_blr.rules.blr import gaussian_update

COVARIANCES = ("full", "diagonal")

__all__ = ["COVARIANCES", "MixtureRule", "MixtureState", "check", "init_mixture", "log_prob", "log_weights",
           "mixture_algorithm", "mixture_update", "modes", "report", "sample", "weights"]


class MixtureState(NamedTuple):
    r"""``means`` (K, d) :math:`m_c`; ``precision`` (K, d, d) :math:`S_c`, or (K, d) diagonals; ``logits`` (K,)
    :math:`v_c = \log(\pi_c/\pi_K)`, last entry 0; ``count`` steps taken and ``skipped`` non-finite steps, int32
    (each skipped step halves both step sizes: :math:`\rho\,2^{-\text{skipped}}`); ``trace`` the
    :class:`~numpyro_blr.report.LossTrace` of the kept steps' losses (the evidence of :func:`report`); ``best``
    ``(means, precision, logits)`` of the step whose loss set the trace's best average, the state a skipped step
    returns to."""

    means: jax.Array
    precision: jax.Array
    logits: jax.Array
    count: jax.Array
    skipped: jax.Array
    trace: LossTrace
    best: Any


class MixtureRule(NamedTuple):
    """Options of :func:`mixture_update`: ``lr`` :math:`\\rho` and ``weight_lr`` :math:`\\rho_\\pi` (numbers
    or schedules ``count -> rate``) and ``improved``, the positivity rule of :mod:`numpyro_blr.rules.blr`."""

    lr: Any
    weight_lr: Any
    improved: Any = "improved"


def init_mixture(means, precision, logits, num_components, covariance, precision_init):
    """A fresh :class:`MixtureState`; ``precision`` defaults to ``precision_init`` times the identity,
    ``logits`` to equal weights."""
    means = jnp.asarray(means)
    if not jnp.issubdtype(means.dtype, jnp.floating):
        means = means.astype(jnp.float32)
    if means.ndim != 2 or means.shape[0] != num_components:
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
    return MixtureState(means, precision, logits, zero, zero, init_loss_trace(dtype), (means, precision, logits))


def mixture_update(rule: MixtureRule, state: MixtureState, estimate):
    """One BLR step of every component and of the weights from an
    :class:`~numpyro_blr.estimators.Estimate` of :mod:`numpyro_blr.estimators.mixture`. A step that is not
    finite (its estimate or its update) is skipped, as ``nb.BLR()`` and ``nb.LieGroupBLR()`` skip one: it halves
    both step sizes for the rest of the run and returns the components and weights to ``state.best``, the
    iterate whose loss set the run's best average (a run that diverged through finite steps before the first
    non-finite one restarts from before the divergence, with a shorter step). Returns
    ``(state, StepInfo(estimate.loss, skipped))``; :func:`report` reads the skipped steps and the losses."""
    dtype = state.means.dtype
    damping = jnp.exp2(-state.skipped.astype(dtype))  # 1 until a step is skipped: healthy runs are unchanged
    lr, weight_lr = value_at(rule.lr, state.count) * damping, value_at(rule.weight_lr, state.count) * damping
    hess = state.precision + estimate.hessian  # H_c = S_c + G_c
    if hess.ndim == 3:
        hess = 0.5 * (hess + jnp.swapaxes(hess, -1, -2))
    step = lambda m, p, g, h: gaussian_update(m, p, g, h, lr, rule.improved)  # noqa: E731
    means, precision = jax.vmap(step)(state.means, state.precision, estimate.grad.means, hess)
    logits = state.logits - weight_lr * estimate.grad.logits
    ok = all_finite(precision, means, logits)
    current = (state.means, state.precision, state.logits)
    means, precision, logits = select(ok, (means, precision, logits), state.best)
    loss = jnp.mean(jnp.asarray(estimate.loss, dtype))  # multimodal optimisation: the mean of l(m_c)
    trace = next_loss_trace(state.trace, state.count, loss)
    improved = ok & jnp.isfinite(loss) & (trace.loss_best < state.trace.loss_best)
    trace = select(ok, trace, state.trace)
    best = select(improved, current, state.best)
    new = MixtureState(means, precision, logits, jnp.where(ok, state.count + 1, state.count),
                       state.skipped + jnp.where(ok, 0, 1).astype(jnp.int32), trace, best)
    return new, StepInfo(estimate.loss, ~ok)


def mixture_algorithm(estimator, rule: MixtureRule, num_components, covariance="full", precision_init=1.0):
    """A mixture row as an :class:`~numpyro_blr.core.Algorithm`: ``step`` is ``estimator`` then :func:`mixture_update`."""
    if covariance not in COVARIANCES:
        raise ValueError(f"covariance must be one of {COVARIANCES}, got {covariance!r}.")

    def init(means, precision=None, logits=None):
        return init_mixture(means, precision, logits, num_components, covariance, precision_init)

    def update(state, estimate):
        return mixture_update(rule, state, estimate)

    def step(key, state, loss_fn, *args):
        return update(state, estimator(key, state, loss_fn, *args))

    return Algorithm(init=init, step=step, sample=sample, update=update)


def report(state, name="nb.mixture_blr"):
    """``[(key, message), ...]``: the problems the end state of a run shows (host-side, outside ``jit``), each
    naming what to change: steps skipped as non-finite (each halved the step sizes and returned to the best
    iterate), a run that diverged or whose loss was still falling at the end (:func:`numpyro_blr.report.
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
                    f"sizes, now {2.0 ** -skipped:.3g} times the given ones.{unusable} Pass a smaller lr (and weight_lr), "
                    "a larger precision_init (narrower initial components), or means started nearer the mode; check "
                    "the loss for overflow (exp of a wide draw) in the model's log density."))
    out += loss_trace_problems(
        state.trace, steps, name,
        "Pass a smaller lr (and weight_lr) or a decaying schedule (lr=lambda t: lr0 / (1 + t / 100)), or a larger "
        "precision_init.",
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
