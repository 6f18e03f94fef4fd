r"""The one algorithm shape every Table-1 row returns, and the mechanics they share.

Every algorithm in the package (Khan & Rue 2023, Table 1: a posterior *family* x a
natural-gradient *estimator* x the BLR *rule*) is an :class:`Algorithm`, as in blackjax::

    algo = nb.ivon(lr=0.1, ess=50_000)
    state = algo.init(params)                              # -> a State NamedTuple of arrays
    state, info = algo.step(key, state, loss_fn, *batch)   # -> (State, Info), jit/vmap/scan-able
    draws = algo.sample(key, state, n)                     # n draws from q, leading axis n
    state, info = algo.update(state, estimate)             # the rule alone, on an Estimate

``init`` takes the user's parameters (or natural parameters) and options; ``step`` takes a PRNG
key first, the state, then what the row needs to read :math:`\nabla_\mu \mathbb E_q[\ell]`
(a loss function and its batch, a per-example loss); it is the row's estimator
(:mod:`numpyro_blr.estimators`) followed by ``update``, the row's rule (:mod:`numpyro_blr.rules`)
applied to the :class:`~numpyro_blr.estimators.Estimate`, which is also exposed for estimates
computed elsewhere (a custom loop, other devices). ``Info`` is a NamedTuple whose first two
fields are ``loss`` (the value the step read, NaN when it has none) and ``skipped`` (True when
the step was not finite and the state was kept). Functions beyond these (:func:`predictive`,
mixture weights, ...) are module-level functions of the state.

Names used across the package (one concept, one name):

==================  ==========================================================================
``precision``       the precision of the Gaussian :math:`q` (diagonal vector or full matrix)
``scale_tril``      the Cholesky factor of the covariance, :math:`\Sigma = LL^\top`
``hessian``         an estimate of :math:`\mathbb E_q[\nabla^2\ell]` fed to the precision step
``lr``              the BLR step size :math:`\rho` (never anything else)
``weight_decay``    the precision :math:`\delta` of a zero-mean Gaussian prior (deep rows)
``ess``             effective sample size: the data-size scaling of the loss (deep rows)
``estimator``       how :math:`\nabla_\mu \mathbb E_q[\ell]` is read: ``"delta"`` (at the mean),
                    ``"reparam"`` (Bonnet/Price with samples), ``"autodiff"`` (exact Hessian)
==================  ==========================================================================
"""

from __future__ import annotations

import math
import os
from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np


class Algorithm(NamedTuple):
    """``init(params, ...) -> State``; ``step(key, State, loss_fn, *batch) -> (State, Info)``;
    ``sample(key, State, n) -> draws`` (leading axis ``n``); ``update(State, Estimate) -> (State, Info)``
    (pure functions); ``parts``: the composition the row is made of (family, estimator, rule and their
    options), for views of it such as :func:`numpyro_blr.as_optax`."""

    init: Callable
    step: Callable
    sample: Callable
    update: Callable
    parts: Any = None


class StepInfo(NamedTuple):
    """What one step reports when a row has nothing more: the ``loss`` it read and whether the
    step was ``skipped`` for being non-finite."""

    loss: Any
    skipped: Any


# ----------------------------------------------------------------------------- step mechanics


def all_finite(*trees):
    """One boolean: every leaf of every tree is finite."""
    flags = [jnp.all(jnp.isfinite(x)) for t in trees for x in jax.tree.leaves(t)]
    return jnp.all(jnp.stack(flags)) if flags else jnp.asarray(True)


def select(ok, new, old):
    """``new`` where ``ok`` else ``old``, leaf by leaf (the skip-a-non-finite-step select)."""
    return jax.tree.map(lambda a, b: jnp.where(ok, a, b), new, old)


def skip_decision(check, estimate, new):
    r"""``(ok, step_entry)`` for a rule that skips non-finite steps: ``ok`` (scalar) whether the step counts, and
    ``step_entry`` where the new state is taken (``jnp.where(step_entry, new, old)``, vector by vector).

    ``new`` is one vector of the new state that is non-finite wherever any of the new state's vectors is (the rules
    add ``x - x``, 0 or NaN, of the others to it). On an accelerator (:func:`numpyro_blr.tree.fused_passes`) the
    decision is read from the estimate, before the update: ``check`` (:attr:`~numpyro_blr.estimators.Estimate.check`)
    or, when None, :func:`~numpyro_blr.tree.finite_check` of ``estimate`` (the arrays the update reads); the select
    is then fused into the update's one pass, and an entry whose new value overflows from a finite estimate keeps its
    old value. On CPU it is read from ``new`` after the update (one reduction over one vector; the whole step is
    skipped on an overflow too). Either way a non-finite estimate skips the whole step and is counted."""
    from numpyro_blr.tree import finite_check, fused_passes

    if fused_passes():
        ok = jnp.isfinite(finite_check(estimate) if check is None else check)
        return ok, ok & jnp.isfinite(new)
    ok = jnp.isfinite(jnp.sum(new - new))
    return ok, ok


def value_at(schedule, count):
    """A constant or a schedule ``count -> value`` read at ``count``."""
    return schedule(count) if callable(schedule) else schedule


def predictive(key, state, apply_fn, x, num_samples, *, sample):
    """Average ``apply_fn(params, x)`` over ``num_samples`` draws ``params ~ q`` from ``sample``.

    ``sample(key, state, n)`` is an algorithm's ``sample`` (``nb.ivon(...).sample``). ``apply_fn``
    should return probabilities (apply the softmax inside it): averaging probabilities, not logits,
    is the Bayesian model average. Draws are ``vmap``-ed; call it on chunks of ``x`` if memory is short.
    """
    draws = sample(key, state, num_samples)
    return jnp.mean(jax.vmap(lambda p: apply_fn(p, x))(draws), axis=0)


# ----------------------------------------------------------------------------- validators


def is_number(x):
    return not isinstance(x, bool) and isinstance(x, (int, float, np.integer, np.floating))


def check_positive(x, name, allow_zero=False, allow_inf=False):
    """``float(x)`` after checking it is a finite number > 0 (>= 0 with ``allow_zero``)."""
    if not is_number(x):
        raise ValueError(f"{name} must be a number, got {x!r} of type {type(x).__name__}.")
    x = float(x)
    if math.isnan(x) or (math.isinf(x) and not allow_inf):
        raise ValueError(f"{name} must be finite, got {x}.")
    if x < 0 or (x == 0 and not allow_zero):
        raise ValueError(f"{name} must be {'>= 0' if allow_zero else '> 0'}, got {x}.")
    return x


def check_fraction(x, name, closed_low=True, closed_high=False):
    """``float(x)`` after checking it lies in [0, 1) (ends per ``closed_low``/``closed_high``)."""
    lo, hi = ("[" if closed_low else "("), ("]" if closed_high else ")")
    ok = is_number(x) and (0.0 <= float(x) if closed_low else 0.0 < float(x)) and (
        float(x) <= 1.0 if closed_high else float(x) < 1.0)
    if not ok:
        raise ValueError(f"{name} must be a number in {lo}0, 1{hi}, got {x!r}.")
    return float(x)


def check_params(params, what="params"):
    """Raise ``ValueError`` unless ``params`` is a non-empty pytree of floating arrays of one dtype;
    return that dtype."""
    leaves = jax.tree.leaves(params)
    if not leaves:
        raise ValueError(f"{what} has no array leaves.")
    dtypes = {}
    for path, leaf in jax.tree_util.tree_leaves_with_path(params):
        dt = jnp.result_type(leaf)
        if not jnp.issubdtype(dt, jnp.floating):
            raise ValueError(
                f"{what} leaf {jax.tree_util.keystr(path)} has non-floating dtype {dt}; "
                "only floating-point parameters can be learned."
            )
        dtypes.setdefault(str(dt), jax.tree_util.keystr(path))
    if len(dtypes) > 1:
        raise ValueError(
            f"{what} mixes dtypes {sorted(dtypes)} (e.g. leaves {sorted(dtypes.values())}); "
            "cast all parameters to one floating dtype."
        )
    return leaves[0].dtype



def backtracking_factor(value, loss0, shrink=0.25, tries=8):
    r"""The damping :math:`\alpha` of a step: the first of :math:`1, s, s^2, \dots, s^{k-1}` (``shrink`` :math:`s`,
    ``tries`` :math:`k`) at which ``value(alpha)`` is finite and does not rise above ``loss0`` (up to 4 ulps of it),
    and 0 when none does (backtracking line search; Nocedal & Wright 2006, Sec. 3.1). One ``value`` call per try,
    inside a ``lax.while_loop`` that stops at the first accepted factor. Shared by ``nb.BLR``'s mean step and
    ``nb.LieGroupBLR``'s shift."""
    loss0 = jnp.asarray(loss0)
    tol = 4.0 * jnp.finfo(loss0.dtype).eps * jnp.abs(loss0)

    def cond(c):
        k, _, accepted = c
        return (~accepted) & (k < tries)

    def body(c):
        k, _, _ = c
        alpha = jnp.asarray(shrink, loss0.dtype) ** k
        val = value(alpha)
        return k + 1, alpha, jnp.isfinite(val) & (val <= loss0 + tol)

    start = (jnp.zeros((), jnp.int32), jnp.ones((), loss0.dtype), jnp.zeros((), bool))
    _, alpha, accepted = jax.lax.while_loop(cond, body, start)
    return jnp.where(accepted, alpha, 0.0)

# ----------------------------------------------------------------------------- LAPACK threads

LAPACK_THREADS_ENV = "NUMPYRO_BLR_LAPACK_THREADS"


def limit_lapack_threads(threads=None):
    r"""Run the LAPACK that jaxlib's CPU kernels call on ``threads`` threads (default 1); returns the
    ``{library path: previous thread count}`` changed (empty when nothing was found or changed).

    On CPU, every ``jnp.linalg.cholesky``, ``solve_triangular``, ``eigh``, ... inside a jitted
    program is a call into scipy's bundled OpenBLAS (jaxlib reads its LAPACK from
    ``scipy.linalg.cython_lapack``), which by default wakes a pool of one thread per core for each
    call. The matrices of a BLR step are small (a guide's :math:`D \times D` blocks, a model's GP
    kernel), so the call is all hand-off: on ``gp_pois_regr`` (an 11 x 11 Cholesky in the model,
    13 x 13 triangular solves in the update, float64, ``AutoNormal``) a step took 2.0 ms with the
    pool and 0.13 ms without, on the 2-core development machine under load (min over 15 rounds
    of 50 steps); every backtracking try (one loss evaluation, hence one Cholesky) added about
    10 ms in the issue's measurement. The 16-core host of the GPU machine, idle, took 1.7-5.2 ms
    with the pool. One thread is the right setting for the small matrices a jitted step sends
    there; a program that does large dense linear algebra with scipy on the same process can set
    ``NUMPYRO_BLR_LAPACK_THREADS`` (an int; ``0`` leaves the pool alone) before importing
    ``numpyro_blr``, or call this function again with the count it wants. NumPy's own BLAS
    (matrix products) is a separate library in the wheels and is not touched; jax's CPU matrix
    products do not use either. Does nothing (returns ``{}``) without ``threadpoolctl``.
    """
    if threads is None:
        raw = os.environ.get(LAPACK_THREADS_ENV, "1").strip()
        try:
            threads = int(raw)
        except ValueError:
            raise ValueError(f"{LAPACK_THREADS_ENV} must be an integer >= 0 (0: leave LAPACK's threads alone), "
                             f"got {raw!r}.") from None
    if isinstance(threads, bool) or not isinstance(threads, (int, np.integer)) or threads < 0:
        raise ValueError(f"threads must be an integer >= 0 (0: leave LAPACK's threads alone), got {threads!r}.")
    if threads == 0:
        return {}
    try:
        import scipy.linalg.cython_lapack  # noqa: F401 - the LAPACK jaxlib calls: load it so it can be found
        from threadpoolctl import ThreadpoolController
        controllers = [c for c in ThreadpoolController().lib_controllers if c.user_api == "blas"]
    except Exception:  # noqa: BLE001 - no scipy/threadpoolctl, or a library threadpoolctl cannot read
        return {}
    # scipy's bundled OpenBLAS (wheels: site-packages/scipy.libs); a shared system library otherwise
    ours = [c for c in controllers if "scipy" in os.path.basename(os.path.dirname(c.filepath))] or (
        controllers if len(controllers) == 1 else [])
    changed = {}
    for c in ours:
        if c.num_threads != threads:
            changed[c.filepath] = c.num_threads
            c.set_num_threads(int(threads))
    return changed


try:  # at import: the first jitted step must not pay the thread hand-off (limit_lapack_threads)
    limit_lapack_threads()
except ValueError as err:  # a malformed environment variable is reported, not fatal to the import
    import warnings

    warnings.warn(str(err), stacklevel=2)
