r"""The Bayesian workflow that cheap refits make possible: :func:`kfold`, :func:`reloo`, :func:`sbc`.

A NUTS chain per refit makes K-fold cross-validation, exact leave-one-out refits and
simulation-based calibration cost minutes to hours; a BLR fit of a small model is milliseconds once
compiled (:func:`numpyro_blr.fit`). Here every set of fits is one compiled program: the model and
guide are the user's, the fits differ only in arrays passed to the program (which observations are
held out, or which simulated data are observed), and ``jax.lax.map`` runs them ``batch_size`` at a
time, vectorised (``vmap``) within a batch, with the draws and the predictive densities each fit
needs computed inside the program. Warm-started fits (:func:`kfold`, :func:`reloo`: each from the
full-data fit's :math:`q`) run one after another in one compiled loop instead.

* :func:`kfold`: :math:`\widehat{\mathrm{elpd}} = \sum_i \log \frac1S\sum_s p(y_i\mid\theta^{(s)}_{-k(i)})`,
  :math:`\theta_{-k} \sim q_{-k}`, the fit without fold :math:`k`; standard error
  :math:`\sqrt{n\,\mathrm{Var}_i(\widehat{\mathrm{elpd}}_i)}` (Vehtari, Gelman & Gabry 2017), as
  ArviZ's ``loo_kfold`` (an ``ELPDDataLOOKFold``, so ``az.compare`` takes it).
* :func:`reloo`: PSIS-LOO of the fitted :math:`q` with the approximate-posterior correction
  (:func:`numpyro_blr.diagnostics.loo_vi`, Magnusson et al. 2019) where its Pareto :math:`\hat k`
  is at most ``k_threshold``, and an exact refit without observation :math:`i` where it is above
  (the job of ArviZ's ``reloo``, which needs a sampling wrapper).
* :func:`sbc`: simulation-based calibration (Talts et al. 2018): for
  :math:`\theta^\star \sim p(\theta)`, :math:`y \sim p(y\mid\theta^\star)`, the rank of
  :math:`\theta^\star` among :math:`L` draws of the fitted :math:`q(\theta\mid y)` is uniform on
  :math:`\{0,\dots,L\}` when the inference is calibrated; the ECDF of the scaled ranks is tested
  against the uniform with a simultaneous 95% band (:class:`SBCResult`).

Observations are split along the leading dimension of an observed site's batch shape (its plate):
``obs`` names the site when the model has more than one. Held-out observations are masked out of
the training likelihood (``Distribution.mask``), so every fold has the shapes of the full data and
one program serves them all.
"""

from __future__ import annotations

import math
import warnings
import weakref
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.scipy.special import logsumexp
from numpyro import handlers
from numpyro.distributions.distribution import validation_enabled
from numpyro.infer import Predictive
from numpyro.infer.initialization import init_to_uniform
from numpyro.infer.util import log_likelihood
from numpyro.primitives import Messenger
from numpyro.util import soft_vmap

from numpyro_blr import compile_once as _fit

__all__ = ["kfold", "reloo", "sbc", "SBCResult", "WorkflowError"]


class WorkflowError(ValueError):
    """Bad input to a workflow function: the message names the argument and what is allowed."""


# -- handlers -------------------------------------------------------------------------------------
class _MaskObservations(Messenger):
    """Mask the observed site ``site`` elementwise along its first batch dimension: ``mask`` is ``(n,)``."""

    def __init__(self, fn, site, mask):
        self.site, self.mask = site, mask
        super().__init__(fn)

    def process_message(self, msg):
        if msg["type"] == "sample" and msg["name"] == self.site:
            batch_ndim = len(msg["fn"].batch_shape)
            msg["fn"] = msg["fn"].mask(self.mask.reshape(self.mask.shape + (1,) * max(batch_ndim - 1, 0)))


class _ReplaceObservations(Messenger):
    """Observe ``values[name]`` at the observed sites named in ``values`` instead of the model's data."""

    def __init__(self, fn, values):
        self.values = values
        super().__init__(fn)

    def process_message(self, msg):
        if msg["type"] == "sample" and msg["name"] in self.values and msg["is_observed"]:
            msg["value"] = self.values[msg["name"]]


class _Unobserve(Messenger):
    """Sample the sites named in ``names`` from the model instead of observing them (prior predictive)."""

    def __init__(self, fn, names):
        self.names = frozenset(names)
        super().__init__(fn)

    def process_message(self, msg):
        if msg["type"] == "sample" and msg["name"] in self.names:
            msg["value"] = None
            msg["is_observed"] = False


# wrapped models and guides are made once per user model (and site), so that the compiled fits are
# found again by fit's cache (keyed by the model and guide objects)
_WRAPPERS: dict = {}

# NumPyro's autoguides by class and options -> the guide object the programs are built with (weakly: the
# programs and wrappers that use it hold it)
_CANONICAL = weakref.WeakValueDictionary()


def _canonical(guide):
    """``(program guide, setup)``: the guide the programs are built and keyed with. One of NumPyro's
    autoguides, not set up or set up by :func:`numpyro_blr.fit`, is keyed by its class and options
    (:func:`numpyro_blr.compile_once._guide_key`): ``kfold(model, AutoNormal(model), ...)`` with a guide
    built anew reuses the programs of the first such guide, whose setup :func:`_adopt` then copies into
    it, as ``nb.fit`` does. Any other guide is its own program guide (``setup`` ``None``)."""
    guide_key, built = _fit._guide_key(guide)
    if built is None:
        return guide, None
    canon = _CANONICAL.get(guide_key)
    if canon is None:
        _CANONICAL[guide_key] = canon = guide
    if _fit._registered(canon) is None:  # its pristine attributes: each program's starting point (_Program._pristine)
        _fit._GUIDE_KEYS[canon] = (guide_key, built)
    return canon, (guide_key, built)


def _adopt(guide, canon, setup):
    """Set ``guide`` up as the programs set up ``canon`` (nothing to do when they are one object)."""
    if setup is None or canon is guide:
        return
    _fit._assign_vars(guide, vars(canon))
    _fit._GUIDE_KEYS[guide] = setup


def _wrapper(kind, model, guide, site=None):
    key = (kind, id(model), id(guide), site)
    if key in _WRAPPERS:
        return _WRAPPERS[key][2:]
    if kind == "mask":
        def wrapped_model(*args, _nb_train_mask, **kwargs):
            return _MaskObservations(model, site, _nb_train_mask)(*args, **kwargs)

        def wrapped_guide(*args, _nb_train_mask, **kwargs):
            return guide(*args, **kwargs)
    else:
        def wrapped_model(*args, _nb_observations, **kwargs):
            return _ReplaceObservations(model, _nb_observations)(*args, **kwargs)

        def wrapped_guide(*args, _nb_observations, **kwargs):
            return guide(*args, **kwargs)
    wrapped_model.__name__ = getattr(model, "__name__", "model")
    _WRAPPERS[key] = (model, guide, wrapped_model, wrapped_guide)
    return wrapped_model, wrapped_guide


# -- the model's structure --------------------------------------------------------------------------
class _Site(NamedTuple):
    name: str
    n: int  # observations along the first batch dimension
    shape: tuple


def _trace_shapes(model, args, kwargs, where):
    """``{name: (type, is_observed, value shape, batch shape)}`` of the model's sample sites, traced
    abstractly (shapes only, no computation)."""
    out = {}

    def run(args, kwargs):
        # latent values as NumPyro's initialisation draws them: an improper prior (ImproperUniform) cannot be sampled
        with handlers.block(), handlers.substitute(substitute_fn=init_to_uniform), handlers.seed(rng_seed=0):
            tr = handlers.trace(model).get_trace(*args, **kwargs)
        for name, site in tr.items():
            if site["type"] == "sample":
                out[name] = (site["is_observed"], tuple(jnp.shape(site["value"])), tuple(site["fn"].batch_shape),
                             bool(site["fn"].support.is_discrete))
        return 0

    with _fit.explain_traced_data(model, args, kwargs, where):
        jax.eval_shape(run, args, kwargs)
    return out


def _observed_site(model, args, kwargs, obs, where):
    sites = _trace_shapes(model, args, kwargs, where)
    observed = [n for n, s in sites.items() if s[0]]
    if not observed:
        raise WorkflowError(f"{where}: the model has no observed site (numpyro.sample(..., obs=data)) with these arguments.")
    if obs is None:
        if len(observed) > 1:
            raise WorkflowError(f"{where}: the model observes several sites {observed}; pass obs=<name> to say which one's "
                                "observations are held out.")
        obs = observed[0]
    elif obs not in observed:
        raise WorkflowError(f"{where}: obs={obs!r} is not an observed site of the model; its observed sites are {observed}.")
    _, shape, batch, _ = sites[obs]
    if not batch:
        raise WorkflowError(
            f"{where}: the observed site {obs!r} has no batch dimension to split (shape {shape}, batch ()): declare its "
            "observations in a plate (with numpyro.plate('data', n): numpyro.sample(...)) rather than as one event.")
    return _Site(obs, int(batch[0]), shape)


def _check_int(value, name, low, high=None):
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise WorkflowError(f"{name} must be an int, got {value!r}.")
    if value < low or (high is not None and value > high):
        bound = f"between {low} and {high}" if high is not None else f"at least {low}"
        raise WorkflowError(f"{name} must be {bound}, got {value}.")
    return int(value)


def _program(model, guide, args, kwargs, batch, *, optim, num_steps, loss, post, batch_size, owner, compile_effort,
             warm_steps=None, work_steps=None):
    """The compiled many-fit program for these arguments (from fit's cache), and its ``data``. ``warm_steps``: the
    steps of a warm-started fit (:meth:`numpyro_blr.compile_once._Program.chain`); ``work_steps``: the steps of all
    the fits together where they run one after another (for ``compile_effort="auto"``). Both step counts are
    arguments of the program (in ``data``), not part of its key: another ``num_steps`` or ``warm_steps`` runs the
    same program (unless ``compile_effort="auto"`` resolves differently for it)."""
    from numpyro_blr.optim import BLR

    optim = _fit._bound(BLR() if optim is None else _fit._check_optimizer(optim), owner, args, kwargs)
    loss = _fit._ordered_loss(loss)
    arrays, rebuild, signature = _fit._split(args, kwargs)
    arrays = [jnp.asarray(x) if isinstance(x, np.ndarray) else x for x in arrays]
    fits = len(jax.tree.leaves(batch)[0])
    if work_steps is None:
        compile_effort = _effort(compile_effort, arrays, fits, num_steps)
    else:  # the loop's program holds two starts and the predictive densities besides the step: "low" saves about
        # twice what it saves on one fit (breast cancer, 10 folds, 3,000 steps in all: 5.9-6.1 s CPU cold with "low",
        # 7.5-8.1 s with "high")
        compile_effort = _effort(compile_effort, arrays, 1, work_steps / 2)
    batch_sig = tuple(sorted((k, jax.tree.structure(v)) for k, v in batch.items()))
    key = ("many", id(model), id(guide), _fit._optimizer_key(optim), _fit._loss_key(loss), signature, batch_sig,
           post[0], _fit._freeze(post[1:]), batch_size, compile_effort)
    program = _fit._CACHE.get(key)
    if program is None:  # its step counts come with the data (_STEPS, _WARM_STEPS), not from these
        program = _fit._Program(model, guide, optim, loss, num_steps=None, chunk=None, stable_update=False,
                                rebuild=rebuild, compiler_options=_fit._compiler_options(compile_effort),
                                owner=owner, post=post, batch_size=batch_size)
        with _fit._CACHE_LOCK:
            _fit._CACHE[key] = program
            while len(_fit._CACHE) > _fit._CACHE_SIZE:
                _fit._CACHE.popitem(last=False)
    counts = {_fit._STEPS: jnp.asarray(num_steps, jnp.int32),
              _fit._WARM_STEPS: jnp.asarray(num_steps if warm_steps is None else warm_steps, jnp.int32)}
    return program, (arrays, counts)


def _effort(compile_effort, arrays, fits, steps):
    if compile_effort not in _fit.COMPILE_EFFORTS:
        raise WorkflowError(f"compile_effort must be one of {_fit.COMPILE_EFFORTS}, got {compile_effort!r}.")
    return _fit.resolve_effort(compile_effort, arrays, fits, steps)


def _warn_fits(program, states, what, labels):
    """One warning listing the fits whose end-of-run report found a problem (each fit's report, as nb.fit gives)."""
    algorithm = getattr(program.svi.optim, "algorithm", None)
    if algorithm is None:
        return []
    bad = []
    host = jax.device_get(states.optim_state)  # sliced on the host: a slice of a device array compiles per shape
    for i, label in enumerate(labels):
        opt_state = jax.tree.map(lambda x: x[i], host)
        messages = [m for _, m in algorithm.report(opt_state, program.svi.optim)]
        if messages:
            bad.append((label, messages[0]))
    if bad:
        shown = "; ".join(f"{label}: {m}" for label, m in bad[:3])
        warnings.warn(f"{len(bad)} of {len(labels)} {what} fits reported a problem (first {min(3, len(bad))}: {shown})",
                      RuntimeWarning, stacklevel=3)
    return [label for label, _ in bad]


#: the most numbers one array of vectorised draws holds (draws x numbers per draw): 2^22, 32 MB in float64. More
#: draws than that are taken in chunks of that many, one chunk after another (``numpyro.util.soft_vmap``).
DRAW_BATCH_ELEMENTS = 2**22


def _map_draws(fn, key, num_draws, per_draw):
    """``fn(k)`` for each of the ``num_draws`` keys ``numpyro.infer.Predictive`` draws with (``random.split(key,
    num_draws)``), stacked along a new first axis. ``Predictive`` maps its draws one at a time (a loop of
    ``num_draws`` iterations in the program); here they are vectorised (``vmap``), as many at once as keep an array
    of ``per_draw`` numbers per draw within :data:`DRAW_BATCH_ELEMENTS`: the same values (to rounding). On breast
    cancer (1,000 draws x 569 observations, ``compile_effort="low"``) one fit's densities took 17.5 ms instead of
    33 ms."""
    keys = jax.random.split(key, num_draws) if num_draws > 1 else jnp.reshape(key, (1,) + jnp.shape(key))
    keys = jax.random.key_data(keys) if jnp.issubdtype(keys.dtype, jax.dtypes.prng_key) else keys
    chunk = max(1, min(num_draws, DRAW_BATCH_ELEMENTS // max(1, int(per_draw))))
    return soft_vmap(fn, keys, 1, chunk)


def _guide_draw(guide, params, key, args, kwargs):
    """One draw of the fitted guide: its sample and deterministic sites, as ``Predictive(guide, params=params)`` draws
    them with ``key``."""
    tr = handlers.trace(handlers.seed(handlers.substitute(guide, data=params), key)).get_trace(*args, **kwargs)
    return {name: s["value"] for name, s in tr.items() if s["type"] in ("sample", "deterministic")}


def _pointwise_lpd(params, key, args, kwargs, model, guide, site, num_draws, drop, site_size):
    r""":math:`\log \frac1S \sum_s p(y_i \mid \theta^{(s)})`, :math:`\theta^{(s)} \sim q`, per observation of ``site``
    (summed over its other dimensions), computed inside the program (the draws vectorised, :func:`_map_draws`;
    ``site_size``: the numbers the site observes)."""
    kwargs = {k: v for k, v in kwargs.items() if k != drop}
    substituted = handlers.substitute(model, data=params)

    def one(k):
        latent = _guide_draw(guide, params, k, args, kwargs)
        return log_likelihood(substituted, latent, *args, batch_ndims=0, **kwargs)[site]

    with validation_enabled(False):  # checked by the fit already; on the constants here they would run op by op
        ll = _map_draws(one, key, num_draws, site_size)
    ll = ll.reshape(ll.shape[:2] + (-1,)).sum(-1) if ll.ndim > 2 else ll
    return logsumexp(ll, axis=0) - jnp.log(num_draws)


# -- K-fold -----------------------------------------------------------------------------------------
def _import_in_background(*modules):
    """Import ``modules`` in a thread (XLA compiles with the GIL released); ``.join()`` before using them.
    An import that fails here is left to the caller's own import, which raises it."""
    import importlib
    import sys
    import threading

    def run():
        for m in modules:
            if m not in sys.modules:
                try:
                    importlib.import_module(m)
                except Exception:  # noqa: BLE001 - raised again by the caller's import
                    return

    thread = threading.Thread(target=run, name="numpyro_blr-import", daemon=True)
    thread.start()
    return thread


#: a warm-started fit's steps (:func:`kfold`, :func:`reloo`), as a fraction of ``num_steps``, at least WARM_MIN_STEPS.
#: 100 steps of 1,000 were as close to the folds fitted from scratch as 200 (docs/workflow.md, section 5)
WARM_FRACTION = 0.1
WARM_MIN_STEPS = 100
WARM_STARTS = ("auto", True, False)


def _warm_steps(warm_steps, num_steps):
    if warm_steps is None:
        return min(num_steps, max(WARM_MIN_STEPS, int(math.ceil(WARM_FRACTION * num_steps))))
    return _check_int(warm_steps, "warm_steps", 1)


def _check_warm_start(warm_start):
    if not any(warm_start is w or (isinstance(warm_start, str) and warm_start == w) for w in WARM_STARTS):
        raise WorkflowError(f"warm_start must be one of {WARM_STARTS}, got {warm_start!r}.")
    return warm_start


def _resolve_warm_start(warm_start, result):
    """``warm_start="auto"``: warm on CPU or when the full-data fit is given; elsewhere the fits from scratch,
    side by side in one vectorised program (on an accelerator the fits of a small model run in parallel, where
    the warm ones run one after another)."""
    if warm_start != "auto":
        return warm_start
    return result is not None or jax.default_backend() == "cpu"


def _result_params(result, where):
    """The guide's (constrained) parameters of a full-data fit: an ``SVIRunResult`` or its ``params`` dict."""
    params = getattr(result, "params", result)
    if not isinstance(params, dict) or not params:
        raise WorkflowError(f"{where}: result must be the full-data fit (nb.fit's or svi.run's result, or its params "
                            f"dict), got {type(result).__name__}.")
    return {name: jnp.asarray(v) for name, v in params.items()}


def kfold(model, guide, *args, k=10, obs=None, folds=None, optim=None, num_steps=1000, num_draws=1000, rng_key=None,
          loss=None, batch_size=None, compile_effort="auto", warm_start="auto", warm_steps=None, result=None, **kwargs):
    r"""K-fold cross-validation of ``model`` fitted with ``guide``, all folds in one compiled program.

    :param model, guide, args, kwargs: as for :func:`numpyro_blr.fit` (the full data).
    :param k: number of folds, ``2 <= k <= n`` (``n = `` the observations of ``obs``).
    :param obs: the observed site whose observations are split (needed when the model has several).
    :param folds: optional ``(n,)`` integer fold of each observation, ``0 .. k-1`` (stratified or grouped
        folds); default: a random permutation of the observations cut into ``k`` near-equal folds.
    :param optim, num_steps, loss: as for :func:`numpyro_blr.fit` (default ``nb.BLR()``, 1,000 steps).
    :param num_draws: draws :math:`S` of each fold's :math:`q` for the predictive densities.
    :param batch_size: fits vectorised at once without a warm start (default: all ``k + 1``; lower it to
        bound memory).
    :param compile_effort: as for :func:`numpyro_blr.fit`.
    :param warm_start: ``True``: the fits run one after another in one compiled loop, the full data first
        (from the guide's initialisation for ``num_steps`` steps; given ``result``, refitted from it for
        ``warm_steps``), then every fold from that fit's :math:`q` with a fresh optimizer state for
        ``warm_steps`` steps (a fold's posterior is close to the full one: far fewer steps reach it);
        ``False``: every fit from the guide's initialisation for ``num_steps``, ``batch_size`` of them
        vectorised; ``"auto"`` (default): ``True`` on CPU or when ``result`` is given, else ``False``
        (see ``docs/workflow.md``).
    :param warm_steps: steps of each warm-started fit; default ``max(100, num_steps / 10)`` (at most ``num_steps``).
    :param result: a full-data fit to start from (``nb.fit``'s or ``svi.run``'s result, or its constrained
        ``params``), of the same guide.
    :returns: ArviZ's ``ELPDDataLOOKFold`` (``elpd``, ``se``, ``p`` with ``p_kfold_i``, pointwise
        ``elpd_i``): ``p`` is the full-data fit's log predictive density minus ``elpd``, as ArviZ's
        ``loo_kfold`` computes it. ``az.compare`` accepts it.

    Fits whose end-of-run report finds a problem are named in one warning (a warm-started fit's report
    is its own: a fold that has not converged from the full fit's :math:`q` in ``warm_steps`` is named).
    """
    importer = _import_in_background("xarray", "arviz_stats.utils")  # 0.6 s, while the program compiles
    site = _observed_site(model, args, kwargs, obs, "kfold")
    n = site.n
    if isinstance(k, bool) or not isinstance(k, (int, np.integer)):
        raise WorkflowError(f"k must be an int, got {k!r}.")
    if not 2 <= k <= n:
        raise WorkflowError(f"k must be between 2 and the number of observations of {site.name!r} ({n}), got {k}.")
    num_steps = _check_int(num_steps, "num_steps", 1)
    num_draws = _check_int(num_draws, "num_draws", 2)
    _fit._check_guide(model, guide)
    rng_key = jax.random.PRNGKey(0) if rng_key is None else rng_key
    split_key, *fit_keys = np.asarray(jax.random.split(rng_key, k + 2))  # on the host: an index on the device compiles
    if folds is None:
        order = np.random.default_rng(np.asarray(jax.random.key_data(split_key)).tolist()).permutation(n)
        folds = np.empty(n, dtype=np.int32)
        for j, part in enumerate(np.array_split(order, k)):
            folds[part] = j
    else:
        folds = np.asarray(folds)
        if folds.shape != (n,) or not np.issubdtype(folds.dtype, np.integer) or folds.min() < 0 or folds.max() >= k:
            raise WorkflowError(f"folds must be an int array of shape ({n},) with values in 0..{k - 1} (k={k}); got shape "
                                f"{folds.shape}, dtype {folds.dtype}.")
        if len(np.unique(folds)) != k:
            raise WorkflowError(f"folds must use every fold 0..{k - 1} at least once; missing {sorted(set(range(k)) - set(folds.tolist()))}.")
    _check_warm_start(warm_start)
    if result is not None and warm_start is False:
        raise WorkflowError("result= is the full-data fit the folds start from: it needs warm_start=True or 'auto'.")
    masks = np.ones((k + 1, n), dtype=bool)  # row j: fold j held out; the last row: the full data (for p)
    for j in range(k):
        masks[j, folds == j] = False
    pguide, setup = _canonical(guide)
    wmodel, wguide = _wrapper("mask", model, pguide, site.name)
    post = (_pointwise_lpd, model, pguide, site.name, num_draws, "_nb_train_mask", math.prod(site.shape))
    keys = np.stack(fit_keys)
    if _resolve_warm_start(warm_start, result):
        # one loop: the full data first (from the guide's initialisation, or from result), then each fold from it
        steps = _warm_steps(warm_steps, num_steps)
        init_params = None if result is None else _result_params(result, "kfold")
        work = (steps if init_params is not None else num_steps) + k * steps
        order = np.r_[k, :k]  # the full data first; the arrays stay on the host (an index on the device compiles)
        program, data = _program(wmodel, wguide, args, kwargs, {"_nb_train_mask": masks}, optim=optim,
                                 num_steps=num_steps, loss=loss, post=post, batch_size=1, owner=pguide,
                                 compile_effort=compile_effort, warm_steps=steps, work_steps=work)
        with _fit.explain_traced_data(model, args, kwargs, "kfold"):
            states, _, _, lpd = program.chain(keys, data, {"_nb_train_mask": masks[order]}, init_params)
        back = np.r_[1:k + 1, 0]
        states, lpd = jax.tree.map(lambda x: np.asarray(x)[back], jax.device_get((states, lpd)))
    else:
        program, data = _program(wmodel, wguide, args, kwargs, {"_nb_train_mask": masks}, optim=optim,
                                 num_steps=num_steps, loss=loss, post=post, batch_size=batch_size or k + 1,
                                 owner=pguide, compile_effort=compile_effort)
        with _fit.explain_traced_data(model, args, kwargs, "kfold"):
            states, _, _, lpd = program.many(keys, data, {"_nb_train_mask": jnp.asarray(masks)})
    _adopt(guide, pguide, setup)
    importer.join()
    from arviz_stats.utils import ELPDDataLOOKFold
    import xarray as xr

    lpd = np.asarray(lpd, dtype=np.float64)  # (k + 1, n)
    elpd_i = lpd[folds, np.arange(n)]  # each observation from the fit that did not see it
    lpd_full = lpd[k]
    _warn_fits(program, states, "K-fold", [f"fold {j}" for j in range(k)] + ["full data"])
    dim = f"{site.name}_dim_0"
    elpd_da = xr.DataArray(elpd_i, dims=[dim])
    return ELPDDataLOOKFold(
        elpd=float(np.sum(elpd_i)),
        se=float(np.sqrt(n * np.var(elpd_i))),
        p=float(np.sum(lpd_full - elpd_i)),
        n_samples=num_draws,
        n_data_points=n,
        scale="log",
        warning=False,
        good_k=None,
        elpd_i=elpd_da,
        n_folds=k,
        p_kfold_i=xr.DataArray(lpd_full - elpd_i, dims=[dim]),
    )


# -- exact refits where PSIS-LOO fails --------------------------------------------------------------
def reloo(model, guide, *args, result=None, k_threshold=0.7, obs=None, optim=None, num_steps=1000, num_draws=4000,
          rng_key=None, loss=None, batch_size=None, compile_effort="auto", warm_start=True, warm_steps=None, **kwargs):
    r"""PSIS-LOO of a VI fit, with exact refits for the observations where Pareto :math:`\hat k` says PSIS fails.

    :param result: the full-data fit (``nb.fit``'s or ``svi.run``'s result); fitted here when ``None``.
    :param k_threshold: observations with :math:`\hat k` above it are refitted without themselves
        (ArviZ's default 0.7).
    :param num_draws: draws of :math:`q` for PSIS (and of each refit's :math:`q`).
    :param warm_start, warm_steps: ``True`` (default): each refit starts from the full-data fit's :math:`q`
        (with a fresh optimizer state) and runs ``warm_steps`` steps (default ``max(100, num_steps / 10)``);
        ``False``: from the guide's initialisation for ``num_steps`` (``"auto"`` is ``True`` here: the
        full-data fit is at hand). A refit whose report finds a problem is named in a warning.
    :returns: ArviZ's ``ELPDDataLOO``: ``loo_vi``'s (PSIS with the approximate-posterior correction of
        Magnusson et al. 2019) with ``elpd_i`` replaced by the exact leave-one-out value, ``pareto_k`` set
        to 0 and ``p_loo_i`` recomputed at the refitted observations, and ``elpd``, ``se``, ``p``
        recomputed (ArviZ's ``reloo`` convention); the refitted observations' indices in
        ``.refitted``.
    """
    from numpyro_blr import diagnostics as nd

    site = _observed_site(model, args, kwargs, obs, "reloo")
    n = site.n
    if isinstance(k_threshold, bool) or not isinstance(k_threshold, (int, float, np.floating)) or math.isnan(k_threshold):
        raise WorkflowError(f"k_threshold must be a float, got {k_threshold!r}.")
    num_draws = _check_int(num_draws, "num_draws", 2)
    num_steps = _check_int(num_steps, "num_steps", 1)
    warm = _resolve_warm_start(_check_warm_start(warm_start), True)
    steps = _warm_steps(warm_steps, num_steps) if warm else num_steps
    _fit._check_guide(model, guide)
    rng_key = jax.random.PRNGKey(0) if rng_key is None else rng_key
    fit_key, draw_key, refit_key = jax.random.split(rng_key, 3)
    if result is None:
        result = _fit.fit(model, guide, *args, optim=optim, num_steps=num_steps, rng_key=fit_key, loss=loss,
                          progress_bar=False, compile_effort=compile_effort, **kwargs)
    params = _result_params(result, "reloo")
    tree = nd.to_datatree(guide, params, model, *args, num_samples=num_draws, rng_key=draw_key,
                          posterior_predictive=False, **kwargs)
    loo = nd.loo_vi(tree, var_name=site.name)
    khat = np.asarray(loo.pareto_k).reshape(-1)
    if khat.size != n:
        raise WorkflowError(f"reloo: the observed site {site.name!r} has {khat.size} pointwise values, not {n} observations "
                            "along its first dimension: reloo refits whole observations of a one-dimensional plate.")
    bad = np.flatnonzero(khat > k_threshold)
    loo.refitted = bad
    if bad.size == 0:
        return loo
    masks = np.ones((bad.size, n), dtype=bool)
    masks[np.arange(bad.size), bad] = False
    pguide, setup = _canonical(guide)
    wmodel, wguide = _wrapper("mask", model, pguide, site.name)
    post = (_pointwise_lpd, model, pguide, site.name, num_draws, "_nb_train_mask", math.prod(site.shape))
    refit_keys, batch = jax.random.split(refit_key, bad.size), {"_nb_train_mask": jnp.asarray(masks)}
    if warm:  # one loop, every refit from the full-data fit's q
        program, data = _program(wmodel, wguide, args, kwargs, {"_nb_train_mask": masks}, optim=optim,
                                 num_steps=num_steps, loss=loss, post=post, batch_size=1, owner=pguide,
                                 compile_effort=compile_effort, warm_steps=steps, work_steps=int(bad.size) * steps)
        with _fit.explain_traced_data(model, args, kwargs, "reloo"):
            states, _, _, lpd = program.chain(refit_keys, data, batch, params)
    else:
        program, data = _program(wmodel, wguide, args, kwargs, {"_nb_train_mask": masks}, optim=optim,
                                 num_steps=num_steps, loss=loss, post=post, batch_size=batch_size or int(bad.size),
                                 owner=pguide, compile_effort=compile_effort)
        with _fit.explain_traced_data(model, args, kwargs, "reloo"):
            states, _, _, lpd = program.many(refit_keys, data, batch)
    _adopt(guide, pguide, setup)
    _warn_fits(program, states, "leave-one-out", [f"without observation {i}" for i in bad])
    exact = np.asarray(lpd, dtype=np.float64)[np.arange(bad.size), bad]
    ll = np.asarray(tree["log_likelihood"][site.name]).reshape(num_draws, -1)  # chain 1 x draws
    lpd_full = logsumexp(jnp.asarray(ll), axis=0) - np.log(num_draws)
    elpd_i = np.asarray(loo.elpd_i).reshape(-1).copy()
    p_i = (np.asarray(loo.p_loo_i).reshape(-1).copy() if getattr(loo, "p_loo_i", None) is not None
           else np.asarray(lpd_full) - elpd_i)
    elpd_i[bad] = exact
    p_i[bad] = np.asarray(lpd_full)[bad] - exact
    k_new = khat.copy()
    k_new[bad] = 0.0
    loo.elpd_i.values[...] = elpd_i.reshape(loo.elpd_i.shape)
    loo.pareto_k.values[...] = k_new.reshape(loo.pareto_k.shape)
    if getattr(loo, "p_loo_i", None) is not None:
        loo.p_loo_i.values[...] = p_i.reshape(loo.p_loo_i.shape)
    loo.elpd = float(np.sum(elpd_i))
    loo.se = float(np.sqrt(n * np.var(elpd_i, ddof=1)))
    loo.p = float(np.sum(p_i))
    loo.warning = bool(np.any(k_new > loo.good_k)) if loo.good_k is not None else False
    return loo


# -- simulation-based calibration -----------------------------------------------------------------
class SBCResult(NamedTuple):
    r"""Simulation-based calibration (Talts et al. 2018).

    ``ranks``: ``{site: (num_datasets, *site_shape)}`` ranks of the true value among ``num_draws``
    draws of each fit's :math:`q` (``0 .. num_draws``); ``truth``: the simulated true values;
    ``num_draws``; ``band``: half-width of the simultaneous 95% band of the ECDF of the scaled ranks
    under uniformity (the 95% quantile of :math:`\sup_u |F_n(u) - u|` for uniform ranks, simulated);
    ``flagged``: the datasets whose fit reported a problem.
    """

    ranks: dict
    truth: dict
    num_draws: int
    band: float
    flagged: list

    def ecdf_difference(self, site):
        """``(u, F(u) - u)``: the ECDF of the scaled ranks minus the uniform, per element of ``site`` (columns)."""
        r = np.asarray(self.ranks[site]).reshape(self.ranks[site].shape[0], -1)
        u = np.linspace(0.0, 1.0, 101)
        scaled = (r + 0.5) / (self.num_draws + 1)
        ecdf = (scaled[None, :, :] <= u[:, None, None]).mean(axis=1)
        return u, ecdf - u[:, None]

    def max_deviation(self):
        """``{site: max over elements and u of |F(u) - u|}``; calibrated within the band when below ``band``."""
        return {s: float(np.max(np.abs(self.ecdf_difference(s)[1]))) for s in self.ranks}

    def calibrated(self):
        """``{site: bool}``: every element's ECDF difference stays inside the simultaneous band."""
        return {s: d <= self.band for s, d in self.max_deviation().items()}

    def summary(self):
        lines = [f"SBC: {len(next(iter(self.ranks.values())))} datasets, {self.num_draws} draws per fit, "
                 f"simultaneous 95% band +-{self.band:.3f}"]
        for s, d in self.max_deviation().items():
            lines.append(f"  {s:24s} max |ECDF - u| = {d:.3f}  {'calibrated' if d <= self.band else 'OUTSIDE the band'}")
        if self.flagged:
            lines.append(f"  {len(self.flagged)} fit(s) reported a problem: datasets {self.flagged[:10]}")
        return "\n".join(lines)

    def plot(self, path=None, sites=None):
        """Rank histograms and ECDF differences with the band, one column per site; saved to ``path`` if given."""
        import matplotlib

        if path is not None:
            matplotlib.use("Agg", force=False)
        import matplotlib.pyplot as plt

        sites = list(sites or self.ranks)
        fig, axes = plt.subplots(2, len(sites), figsize=(3.2 * len(sites), 5.5), squeeze=False)
        bins = min(20, self.num_draws + 1)
        for j, s in enumerate(sites):
            r = np.asarray(self.ranks[s]).reshape(len(self.ranks[s]), -1)
            axes[0, j].hist(r.ravel(), bins=bins, range=(0, self.num_draws + 1), color="0.6", edgecolor="white")
            expected = r.size / bins
            axes[0, j].axhline(expected, color="k", lw=1)
            axes[0, j].set_title(s)
            axes[0, j].set_xlabel("rank")
            u, diff = self.ecdf_difference(s)
            axes[1, j].plot(u, diff, color="C0", lw=0.8, alpha=0.7)
            axes[1, j].fill_between(u, -self.band, self.band, color="C1", alpha=0.2, label="95% band")
            axes[1, j].set_xlabel("scaled rank")
        axes[1, 0].set_ylabel("ECDF - uniform")
        axes[0, 0].set_ylabel("count")
        fig.tight_layout()
        if path is not None:
            fig.savefig(path, dpi=110)
            plt.close(fig)
        return fig


def _ranks(params, key, args, kwargs, guide, latent, num_draws, drop, latent_size):
    """``num_draws`` draws of the fitted ``q`` at the ``latent`` sites, inside the program (ranked in :func:`sbc`;
    vectorised, :func:`_map_draws`; ``latent_size``: the numbers of one draw)."""
    kwargs = {k: v for k, v in kwargs.items() if k != drop}

    def one(k):
        draw = _guide_draw(guide, params, k, args, kwargs)  # the guide traced once per draw, not once per site
        return {s: draw[s] for s in latent}

    with validation_enabled(False):  # as in _pointwise_lpd
        return _map_draws(one, key, num_draws, latent_size)


def _ecdf_band(num_datasets, num_draws, level=0.95, sims=2000, seed=0):
    """The ``level`` quantile of :math:`\\sup_u |F_n(u) - u|` for ``num_datasets`` uniform ranks on ``0..num_draws``."""
    rng = np.random.default_rng(seed)
    u = np.linspace(0.0, 1.0, 101)
    r = rng.integers(0, num_draws + 1, size=(sims, num_datasets))
    scaled = (r + 0.5) / (num_draws + 1)
    ecdf = (scaled[:, :, None] <= u[None, None, :]).mean(axis=1)
    return float(np.quantile(np.max(np.abs(ecdf - u), axis=1), level))


_SIMULATORS: dict = {}


def _simulator(model, names, latent, num_datasets, args, kwargs):
    """``key -> {site: (num_datasets, ...)}``: the prior predictive at the ``latent`` sites and the sites
    ``names``, one compiled program per model, sites and argument shapes (the arguments are its inputs, so
    a second :func:`sbc` of the model compiles nothing)."""
    arrays, rebuild, signature = _fit._split(args, kwargs)
    key = (id(model), tuple(names), tuple(latent), num_datasets, signature)
    entry = _SIMULATORS.get(key)
    if entry is None:
        predictive = Predictive(_Unobserve(model, names), num_samples=num_datasets, return_sites=list(latent) + list(names))

        def simulate(rng_key, arrays):
            a, kw = rebuild(arrays)
            return predictive(rng_key, *a, **kw)

        entry = _SIMULATORS[key] = (model, jax.jit(simulate))  # the model held: its id stays its own
    arrays = [jnp.asarray(x) if isinstance(x, np.ndarray) else x for x in arrays]

    def run(rng_key):
        with _fit.explain_traced_data(model, args, kwargs, "sbc"):
            return entry[1](rng_key, arrays)

    return run


def sbc(model, guide, *args, num_datasets=100, num_draws=99, obs=None, optim=None, num_steps=1000, rng_key=None,
        loss=None, batch_size=None, compile_effort="auto", **kwargs):
    r"""Simulation-based calibration of ``guide`` fitted with ``optim`` on ``model``, all fits in one program.

    :param args, kwargs: the model's arguments, observed data included (their shapes are those of the
        simulated data; their values are not used for the fits).
    :param num_datasets: datasets simulated from the prior predictive.
    :param num_draws: draws :math:`L` of each fit's :math:`q` (ranks ``0 .. L``).
    :param obs: the observed site(s) to simulate (a name or a list; default: every observed site).
    :param optim, num_steps, loss: as for :func:`numpyro_blr.fit`.
    :param batch_size: fits vectorised at once (default: all).
    :returns: :class:`SBCResult` (``.summary()``, ``.calibrated()``, ``.plot(path)``).
    """
    sites = _trace_shapes(model, args, kwargs, "sbc")
    observed = [n for n, s in sites.items() if s[0]]
    latent = [n for n, s in sites.items() if not s[0]]
    if not observed:
        raise WorkflowError("sbc: the model has no observed site (numpyro.sample(..., obs=data)) with these arguments.")
    names = observed if obs is None else ([obs] if isinstance(obs, str) else list(obs))
    unknown = [s for s in names if s not in observed]
    if unknown:
        raise WorkflowError(f"sbc: obs names {unknown}, which are not observed sites of the model; its observed sites are {observed}.")
    discrete = [s for s in latent if sites[s][3]]
    if discrete:
        raise WorkflowError(f"sbc: latent site(s) {discrete} are discrete; ranks of discrete parameters need randomised ties "
                            "and a guide that samples them: not supported.")
    num_datasets = _check_int(num_datasets, "num_datasets", 2)
    num_draws = _check_int(num_draws, "num_draws", 1)
    num_steps = _check_int(num_steps, "num_steps", 1)
    _fit._check_guide(model, guide)
    rng_key = jax.random.PRNGKey(0) if rng_key is None else rng_key
    sim_key, fit_key = jax.random.split(rng_key)
    sims = _simulator(model, names, latent, num_datasets, args, kwargs)(sim_key)
    truth = {s: sims[s] for s in latent}
    simulated = {s: sims[s] for s in names}
    pguide, setup = _canonical(guide)
    wmodel, wguide = _wrapper("replace", model, pguide)
    post = (_ranks, pguide, tuple(latent), num_draws, "_nb_observations",
            sum(math.prod(sites[s][1]) for s in latent))
    program, data = _program(wmodel, wguide, args, kwargs, {"_nb_observations": simulated}, optim=optim,
                             num_steps=num_steps, loss=loss, post=post, batch_size=batch_size or num_datasets,
                             owner=pguide, compile_effort=compile_effort)
    with _fit.explain_traced_data(model, args, kwargs, "sbc"):
        states, _, _, draws = program.many(jax.random.split(fit_key, num_datasets), data, {"_nb_observations": simulated})
    _adopt(guide, pguide, setup)
    ranks = {s: np.asarray(jnp.sum(draws[s] < truth[s][:, None], axis=1)) for s in latent}
    flagged = _warn_fits(program, states, "SBC", list(range(num_datasets)))
    return SBCResult(ranks=ranks, truth={s: np.asarray(v) for s, v in truth.items()}, num_draws=num_draws,
                     band=_ecdf_band(num_datasets, num_draws), flagged=flagged)
