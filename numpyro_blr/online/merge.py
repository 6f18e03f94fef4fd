r"""Model merging by uncertainty: task vectors weighted by posterior precisions.

Networks fine-tuned from one starting point :math:`\theta_0` on different tasks :math:`t = 1..T`
(parameters :math:`\theta_t`) are merged into one. Task arithmetic (Ilharco et al. 2023) adds the
task vectors with one scale, :math:`\theta_0 + \alpha\sum_t(\theta_t - \theta_0)` (:math:`\alpha = 1/T`:
the plain average). Daheim, Möllenhoff, Ponti, Gurevych & Khan (ICLR 2024), "Model Merging by
Uncertainty-Based Gradient Matching" (Sec. 3), weight each task vector per parameter with the
precisions instead:

.. math::
    \bar H = H_0 + \sum_t \alpha_t H_t, \qquad
    \theta_{\rm merged} = \theta_0 + \sum_t \alpha_t\, \bar H^{-1} (H_0 + H_t)\,(\theta_t - \theta_0),

with :math:`H_0` the precision of the start (the prior of every fine-tuning run) and :math:`H_t` task
:math:`t`'s data precision (the Hessian, Fisher or generalised Gauss-Newton of its summed loss); all
are diagonal here, so every product is per parameter. It is their merging equation with one
:math:`\alpha_t` per task (their reference implementation, ``uncertainty_based_gradient_matching.py``,
uses one scale :math:`\alpha` for all tasks in both places: :math:`\bar H = H_0 + \alpha\sum_t H_t`).
:math:`H_0 + H_t` is task :math:`t`'s *posterior* precision :math:`P_t` when it was fine-tuned under the
prior :math:`\mathcal N(\theta_0, H_0^{-1})`; in terms of posteriors the merge is the normalised
product

.. math::
    q_{\rm merged} \propto p_0^{\,1 - \sum_t\alpha_t}\prod_t q_t^{\alpha_t}, \qquad
    q_t = \mathcal N(\theta_t, P_t^{-1}),\ p_0 = \mathcal N(\theta_0, H_0^{-1}),

whose precision is :math:`\bar H` and whose mean is :math:`\theta_{\rm merged}`. With :math:`\alpha_t = 1` it is
Bayes' rule for the union of independent datasets, :math:`p(\theta\mid D_{1:T}) \propto \prod_t p(\theta\mid D_t) / p_0^{T-1}`,
exact for conjugate Gaussian models (:func:`gaussian_product` also with full precision matrices);
for networks it is the second-order (gradient-matching) approximation of training on all tasks'
data. Special cases: equal precisions and :math:`H_0 = 0` give the plain average; :math:`H_0 = 0`,
:math:`\alpha_t = 1` gives Fisher-weighted averaging (Matena & Raffel 2022).

- :func:`merge`: the merge over pytrees or IVON :class:`~numpyro_blr.rules.diagonal.DiagonalState`\ s
  (posterior precision ``ess * state.precision``).
- :func:`task_arithmetic`: the baseline.
- :func:`gaussian_product`: the exact conjugate case for flat Gaussians (diagonal or full precision).
- :func:`posterior_precision`: a diagonal state's posterior precision as the weights' pytree.

All are pure and jit-able (the values checks below only run on concrete arrays).
"""

import numbers

import jax
import jax.numpy as jnp
import numpy as np

from numpyro_blr.rules.diagonal import DiagonalState

__all__ = ["merge", "task_arithmetic", "gaussian_product", "posterior_precision"]


def _is_state(x):
    return isinstance(x, DiagonalState)


def _concrete(x):
    return not isinstance(x, jax.core.Tracer)


def _check_nonnegative(leaves, name):
    for i, x in enumerate(leaves):
        if _concrete(x):
            v = np.asarray(x)
            if v.size and not np.all(v >= 0):  # NaN fails too
                bad = "NaN" if np.isnan(v).any() else f"{float(np.min(v)):g}"
                raise ValueError(f"{name} must be >= 0 everywhere (a precision), got {bad} in leaf {i}.")


def _check_tasks(tasks, name="tasks"):
    if isinstance(tasks, DiagonalState) or not isinstance(tasks, (list, tuple)):
        raise ValueError(f"{name} must be a list or tuple of fine-tuned models (pytrees or DiagonalStates), "
                         f"got {type(tasks).__name__}.")
    if len(tasks) == 0:
        raise ValueError(f"{name} is empty: give at least one fine-tuned model.")
    return list(tasks)


def _params(x):
    return x.params if _is_state(x) else x


def _same_structure(ref_leaves, treedef, tree, name):
    """The leaves of ``tree`` after checking it has ``treedef`` and the reference leaves' shapes."""
    leaves, td = jax.tree.flatten(tree)
    if td != treedef:
        raise ValueError(f"{name} does not have the structure of start's parameters: {td} vs {treedef}.")
    for i, (a, b) in enumerate(zip(leaves, ref_leaves)):
        if jnp.shape(a) != jnp.shape(b):
            raise ValueError(f"{name}: leaf {i} has shape {jnp.shape(a)}, start's has {jnp.shape(b)}.")
    return leaves


def _precision_leaves(p, ref_leaves, treedef, name):
    """A scalar (broadcast to every leaf) or a pytree like the parameters whose leaves broadcast to theirs."""
    if _is_state(p):
        raise ValueError(f"{name} is a DiagonalState: pass posterior_precision(state, ess) (its precision "
                         "times the effective sample size) instead.")
    if isinstance(p, (numbers.Number, np.generic)) or (isinstance(p, (jax.Array, np.ndarray)) and p.ndim == 0):
        leaves = [jnp.asarray(p)] * len(ref_leaves)
    else:
        leaves, td = jax.tree.flatten(p)
        if td != treedef:
            raise ValueError(f"{name} does not have the structure of start's parameters: {td} vs {treedef}.")
        for i, (a, b) in enumerate(zip(leaves, ref_leaves)):
            try:
                shape = jnp.broadcast_shapes(jnp.shape(a), jnp.shape(b))
            except ValueError:
                shape = None
            if shape != jnp.shape(b):
                raise ValueError(f"{name}: leaf {i} has shape {jnp.shape(a)}, which does not broadcast to the "
                                 f"parameters' {jnp.shape(b)}.")
        leaves = [jnp.asarray(a) for a in leaves]
    _check_nonnegative(leaves, name)
    return leaves


def _weights(alphas, T, name, nonnegative):
    if isinstance(alphas, (list, tuple)) or (hasattr(alphas, "shape") and jnp.ndim(alphas) == 1):
        if len(alphas) != T:
            raise ValueError(f"{name} has {len(alphas)} entries for {T} tasks.")
        out = list(alphas)
    elif isinstance(alphas, numbers.Number) or (hasattr(alphas, "shape") and jnp.ndim(alphas) == 0):
        out = [alphas] * T
    else:
        raise ValueError(f"{name} must be a number or a sequence of {T} numbers, got {type(alphas).__name__}.")
    for i, a in enumerate(out):
        if _concrete(a):
            v = float(np.asarray(a))
            if not np.isfinite(v) or (nonnegative and v < 0):
                raise ValueError(f"{name}[{i}] must be a finite number{' >= 0' if nonnegative else ''}, got {v}.")
    return out


def posterior_precision(state, ess):
    r"""The precision of a diagonal row's posterior :math:`q = \mathcal N(m, \operatorname{diag}(1/(N p)))`
    as the weights' pytree: ``ess * state.precision`` (for IVON :math:`N(h + \delta)`, which includes the
    weight-decay prior :math:`N\delta`)."""
    if not _is_state(state):
        raise ValueError(f"state must be a DiagonalState (from nb.ivon(...).init/step), got {type(state).__name__}.")
    if isinstance(ess, bool) or not isinstance(ess, numbers.Number) or not ess > 0 or not np.isfinite(ess):
        raise ValueError(f"ess must be a finite number > 0 (the effective sample size the state was trained with), got {ess!r}.")
    return state.tree(ess * state.precision)


def task_arithmetic(start, tasks, alpha=None):
    r"""Task arithmetic (Ilharco et al. 2023): :math:`\theta_0 + \sum_t \alpha_t(\theta_t - \theta_0)`.

    ``start`` and every entry of ``tasks`` are parameter pytrees of one structure (or
    :class:`~numpyro_blr.rules.diagonal.DiagonalState`\ s: their mean is used). ``alpha``: one scale for all
    task vectors or one per task (any sign: a negative one removes a task); ``None`` (default) is
    :math:`1/T`, the plain average of the fine-tuned models. Returns the merged parameters (a pytree)."""
    tasks = _check_tasks(tasks)
    T = len(tasks)
    start = _params(start)
    ref, treedef = jax.tree.flatten(start)
    alphas = _weights(1.0 / T if alpha is None else alpha, T, "alpha", nonnegative=False)
    task_leaves = [_same_structure(ref, treedef, _params(m), f"tasks[{t}]") for t, m in enumerate(tasks)]
    out = []
    for i, x0 in enumerate(ref):
        x0 = jnp.asarray(x0)
        acc = sum(a * (jnp.asarray(tl[i]) - x0) for a, tl in zip(alphas, task_leaves))
        out.append((x0 + acc).astype(x0.dtype))
    return jax.tree.unflatten(treedef, out)


def merge(start, tasks, precisions=None, *, prior_precision=0.0, alphas=1.0, ess=None, includes_prior=True,
          return_precision=False):
    r"""Merge fine-tuned models by their uncertainty (Daheim et al. 2024; module docstring):

    .. math::
        \theta = \theta_0 + \bar H^{-1}\sum_t \alpha_t (H_0 + H_t)(\theta_t - \theta_0),
        \qquad \bar H = H_0 + \sum_t\alpha_t H_t,

    per parameter (diagonal precisions).

    ``start``: :math:`\theta_0`, a pytree of parameters (or a ``DiagonalState``: its mean).
    ``tasks``: the fine-tuned models, a non-empty list of pytrees like ``start`` or of IVON
    ``DiagonalState``\ s (then their posterior precision ``ess * state.precision`` is used unless
    ``precisions`` is given).
    ``precisions``: one per task, a pytree like the parameters (or a number); required for tasks given
    as pytrees. With ``includes_prior=True`` (default) they are the tasks' posterior precisions
    :math:`P_t = H_0 + H_t` (what a Gaussian posterior or IVON's ``ess * precision`` gives when task
    :math:`t` was fine-tuned under the prior :math:`\mathcal N(\theta_0, H_0^{-1})`), and
    :math:`H_t = \max(P_t - H_0, 0)`; with ``includes_prior=False`` they are the data precisions
    :math:`H_t` themselves (Fisher or Gauss-Newton estimates of each task's summed loss, as in the
    paper's experiments).
    ``prior_precision``: :math:`H_0`, a number or a pytree like the parameters (default 0: Fisher
    averaging when ``alphas=1``).
    ``alphas``: :math:`\alpha_t \ge 0`, one number or one per task (default 1: Bayes' rule for the
    union of the tasks' data).
    ``ess``: the effective sample size of the state tasks, one number or one per task.
    ``return_precision``: also return :math:`\bar H` (the merged posterior precision, a pytree).

    Where :math:`\bar H = 0` (no task and no prior has any precision for a parameter) the start's value is
    kept. Returns the merged parameters (a pytree in the start's dtypes), or ``(params, precision)``.
    """
    tasks = _check_tasks(tasks)
    T = len(tasks)
    start = _params(start)
    ref, treedef = jax.tree.flatten(start)
    if not ref:
        raise ValueError("start has no parameters (an empty pytree).")
    task_leaves = [_same_structure(ref, treedef, _params(m), f"tasks[{t}]") for t, m in enumerate(tasks)]
    alphas = _weights(alphas, T, "alphas", nonnegative=True)

    if precisions is None:
        missing = [t for t, m in enumerate(tasks) if not _is_state(m)]
        if missing:
            raise ValueError(f"precisions is required: tasks{missing} are pytrees, not DiagonalStates "
                             "(give one precision pytree per task).")
        if ess is None:
            raise ValueError("ess is required to merge DiagonalStates: their posterior precision is ess * state.precision.")
        esses = ess if isinstance(ess, (list, tuple)) else [ess] * T
        if len(esses) != T:
            raise ValueError(f"ess has {len(esses)} entries for {T} tasks.")
        precisions = [posterior_precision(m, e) for m, e in zip(tasks, esses)]
    elif isinstance(precisions, (list, tuple)):
        if len(precisions) != T:
            raise ValueError(f"precisions has {len(precisions)} entries for {T} tasks.")
    else:
        raise ValueError(f"precisions must be a list with one precision pytree per task, got {type(precisions).__name__}.")
    prec_leaves = [_precision_leaves(p, ref, treedef, f"precisions[{t}]") for t, p in enumerate(precisions)]
    h0_leaves = _precision_leaves(prior_precision, ref, treedef, "prior_precision")

    out, out_prec = [], []
    for i, x0 in enumerate(ref):
        x0 = jnp.asarray(x0)
        h0 = h0_leaves[i]
        hbar, num = h0, 0.0
        for t in range(T):
            p = prec_leaves[t][i]
            h = jnp.maximum(p - h0, 0.0) if includes_prior else p
            hbar = hbar + alphas[t] * h
            num = num + alphas[t] * (h0 + h) * (jnp.asarray(task_leaves[t][i]) - x0)
        hbar = jnp.broadcast_to(hbar, jnp.shape(x0))
        pos = hbar > 0
        delta = jnp.where(pos, num / jnp.where(pos, hbar, 1.0), 0.0)
        out.append((x0 + delta).astype(x0.dtype))
        out_prec.append(hbar)
    merged = jax.tree.unflatten(treedef, out)
    if return_precision:
        return merged, jax.tree.unflatten(treedef, out_prec)
    return merged


def gaussian_product(means, precisions, prior_mean=None, prior_precision=None, alphas=1.0):
    r"""The exact conjugate merge: the normalised :math:`p_0^{1-\sum_t\alpha_t}\prod_t q_t^{\alpha_t}` of Gaussians.

    ``means``: the task posteriors' means :math:`m_t`, a non-empty list of vectors of one length :math:`d`;
    ``precisions``: their precisions :math:`P_t`, each a vector (diagonal) or a :math:`d\times d` matrix.
    ``prior_mean``, ``prior_precision``: the common prior :math:`\mathcal N(m_0, P_0^{-1})` each task's
    posterior was computed under (``None``: no prior, the plain product). In natural parameters,

    .. math::
        \Lambda = P_0 + \sum_t\alpha_t (P_t - P_0), \qquad
        \Lambda m = P_0 m_0 + \sum_t \alpha_t (P_t m_t - P_0 m_0),

    so with :math:`\alpha_t = 1` and posteriors of independent datasets under one prior this is the
    posterior of their union (Bayes' rule), and with diagonal precisions it equals :func:`merge`
    (``prior_precision`` :math:`= P_0`, ``includes_prior=True``). Returns ``(mean, precision)``
    (:math:`\Lambda` diagonal or full like the inputs).
    """
    means = _check_tasks(means, "means")
    T = len(means)
    if not isinstance(precisions, (list, tuple)) or len(precisions) != T:
        raise ValueError(f"precisions must be a list of {T} precisions (one per mean).")
    means = [jnp.asarray(m) for m in means]
    d = jnp.shape(means[0])
    if len(d) != 1:
        raise ValueError(f"means[0] must be a vector, got shape {d}.")
    for t, m in enumerate(means):
        if jnp.shape(m) != d:
            raise ValueError(f"means[{t}] has shape {jnp.shape(m)}, means[0] has {d}.")
    full = jnp.ndim(precisions[0]) == 2
    want = (d[0], d[0]) if full else d
    precisions = [jnp.asarray(p) for p in precisions]
    for t, p in enumerate(precisions):
        if jnp.shape(p) != want:
            raise ValueError(f"precisions[{t}] has shape {jnp.shape(p)}; expected {want} "
                             f"({'full, like precisions[0]' if full else 'diagonal, like means'}).")
        if not full:
            _check_nonnegative([p], f"precisions[{t}]")
    alphas = _weights(alphas, T, "alphas", nonnegative=True)
    if (prior_mean is None) != (prior_precision is None):
        raise ValueError("prior_mean and prior_precision go together: give both or neither.")
    if prior_precision is None:
        lam = sum(a * p for a, p in zip(alphas, precisions))
        eta = sum(a * (p @ m if full else p * m) for a, p, m in zip(alphas, precisions, means))
    else:
        m0, p0 = jnp.asarray(prior_mean), jnp.asarray(prior_precision)
        if jnp.shape(m0) != d:
            raise ValueError(f"prior_mean has shape {jnp.shape(m0)}, the means have {d}.")
        if jnp.shape(p0) != want and not (not full and jnp.ndim(p0) == 0):
            raise ValueError(f"prior_precision has shape {jnp.shape(p0)}; expected {want}.")
        if not full:
            _check_nonnegative([p0], "prior_precision")
        eta0 = p0 @ m0 if full else p0 * m0
        lam = p0 + sum(a * (p - p0) for a, p in zip(alphas, precisions))
        eta = eta0 + sum(a * ((p @ m if full else p * m) - eta0) for a, p, m in zip(alphas, precisions, means))
    mean = jnp.linalg.solve(lam, eta) if full else eta / lam
    return mean, lam
