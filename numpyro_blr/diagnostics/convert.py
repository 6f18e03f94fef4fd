r"""From a fitted guide to an ArviZ ``xarray.DataTree``.

:func:`to_datatree` draws :math:`\theta^{(s)} \sim q_\phi(\theta)`, :math:`s = 1..S`, from any NumPyro
autoguide (or a guide function) and stores, with the ArviZ 1.x conventions (dims ``chain`` = 1,
``draw`` = S, so that ``az.loo``, ``az.summary``, ``az.compare`` and the plots accept it):

============================  ==================================================================
group                         content
============================  ==================================================================
``posterior``                 latent and deterministic sites at the draws
``posterior_predictive``      :math:`\tilde y^{(s)} \sim p(y \mid \theta^{(s)})` per observed site
``log_likelihood``            :math:`\log p(y_i \mid \theta^{(s)})` per observation (pointwise)
``observed_data``             the observed values
``sample_stats``              :math:`\log p(\theta^{(s)}, y)`, :math:`\log q(\theta^{(s)})` and
                              their difference, the log importance ratio (unconstrained space)
``fit_history``               the loss per SVI step (``svi_result.losses``) and the ELBO
============================  ==================================================================

Dims and coords follow ``az.from_numpyro``: plate names give the batch dims of each site; ``dims``
and ``coords`` add or override them.
"""

from collections.abc import Mapping

import jax
import jax.numpy as jnp
import numpy as np
import xarray as xr
from arviz_base import dict_to_dataset
from arviz_base.io_numpyro import infer_dims
from numpyro import handlers
from numpyro.infer.util import log_likelihood as _numpyro_log_likelihood

from numpyro_blr.diagnostics.draws import (  # noqa: F401 - re-exported
    DiagnosticsError,
    check_arguments,
    guide_draws,
    guide_program,
    has_density,
    log_densities,
    model_sites,
    posterior_draws,
)
from numpyro_blr.compile_once import DATA_IN_PYTHON

__all__ = ["DiagnosticsError", "check_arguments", "posterior_draws", "to_datatree", "model_sites"]

FIT_HISTORY = "fit_history"


# -- dims and coords ---------------------------------------------------------------------------
def _merge_dims(model, args, kwargs, dims):
    try:
        inferred = infer_dims(model, args, kwargs)
    except Exception:  # noqa: BLE001 - dims are a convenience; a model that eval_shape cannot trace has none
        inferred = {}
    out = {k: list(v) for k, v in inferred.items()}
    if dims is not None:
        if not isinstance(dims, Mapping):
            raise DiagnosticsError(f"dims must be a mapping site -> list of dim names, got {type(dims).__name__}.")
        for k, v in dims.items():
            if isinstance(v, str):
                raise DiagnosticsError(f"dims[{k!r}] must be a list of dim names, got the string {v!r}.")
            out[k] = list(v)
    return out


def _check_dims(groups, dims, coords, sample_ndim):
    """Every named site exists, has at least as many axes as dims, and coords fit the axis sizes."""
    known = set()
    for group, (data, nsd) in groups.items():
        known |= set(data)
    for name in dims:
        if name not in known:
            raise DiagnosticsError(
                f"dims names the site {name!r}, which is not in the model or the guide's draws "
                f"(sites: {sorted(known)})."
            )
    coords = dict(coords or {})
    for group, (data, nsd) in groups.items():
        for name, value in data.items():
            if name not in dims:
                continue
            shape = np.shape(value)[nsd:]
            names = dims[name]
            if len(names) > len(shape):
                raise DiagnosticsError(
                    f"site {name!r} in {group}: dims {names} has {len(names)} names but the site has "
                    f"shape {tuple(shape)} ({len(shape)} axes besides the sample dims)."
                )
            for dim, size in zip(names, shape):
                if dim in coords and len(np.asarray(coords[dim])) != size:
                    raise DiagnosticsError(
                        f"site {name!r} in {group}: coords[{dim!r}] has {len(np.asarray(coords[dim]))} values "
                        f"but the site's axis {dim!r} has length {size}."
                    )


# -- conversion --------------------------------------------------------------------------------
def _as_numpy(tree):
    return {k: np.asarray(v) for k, v in tree.items()}


def _posterior_predictive(model, draws, observed, args, kwargs, rng_key):
    r""":math:`\tilde y^{(s)} \sim p(y \mid \theta^{(s)})` and the deterministic sites, per draw."""

    def one(key, draw):
        k1, k2 = jax.random.split(key)
        tr = handlers.trace(handlers.substitute(handlers.seed(model, k1), data=draw)).get_trace(*args, **kwargs)
        keys = jax.random.split(k2, max(len(observed), 1))
        pp = {name: tr[name]["fn"].sample(kk) for name, kk in zip(observed, keys)}
        det = {name: site["value"] for name, site in tr.items() if site["type"] == "deterministic"}
        return pp, det

    num = next(iter(draws.values())).shape[0]
    keys = jax.random.split(rng_key, num)
    return jax.vmap(one)(keys, draws)


def to_datatree(
    guide,
    params,
    model,
    *args,
    num_samples=1000,
    rng_key=None,
    dims=None,
    coords=None,
    losses=None,
    observed=None,
    posterior_predictive=True,
    log_likelihood=True,
    importance=None,
    **kwargs,
):
    r"""Convert a fitted guide (any NumPyro autoguide or guide function) to an ArviZ ``DataTree``.

    :param guide: the guide (``AutoNormal``, ``AutoMultivariateNormal``, ... or a function).
    :param params: its fitted parameters (``svi_result.params``).
    :param model: the model; ``*args, **kwargs`` are its arguments (with the observed data).
    :param num_samples: number of draws :math:`S`; the tree has dims ``chain`` = 1, ``draw`` = S.
    :param rng_key: key for the draws; the posterior equals
        ``guide.sample_posterior(rng_key, params, *args, sample_shape=(S,))`` to rounding (the draws, the model
        at each draw and the densities are one compiled program, kept for the next call on data of the same
        shapes: :func:`~numpyro_blr.diagnostics.draws.guide_program`).
    :param dims: ``{site: [dim names]}``, merged over the dims inferred from the model's plates.
    :param coords: ``{dim: values}``.
    :param losses: the loss per step (``svi_result.losses``), stored in the ``fit_history`` group
        with the ELBO :math:`= -` loss.
    :param observed: ``{site: data}`` to store as ``observed_data`` (default: the values of the
        model's observed sites). Each name must be an observed site of the model.
    :param posterior_predictive: draw :math:`\tilde y^{(s)} \sim p(y\mid\theta^{(s)})`.
    :param log_likelihood: store :math:`\log p(y_i\mid\theta^{(s)})` per observation, from
        ``numpyro.infer.util.log_likelihood`` (needed by ``az.loo``/``az.compare``). Raises if the
        model has no observed site.
    :param importance: store :math:`\log p(\theta^{(s)}, y)` and :math:`\log q(\theta^{(s)})` (in the
        unconstrained space, see :func:`numpyro_blr.diagnostics.log_densities`) in ``sample_stats``;
        needed by :func:`~numpyro_blr.diagnostics.check_fit` and
        :func:`~numpyro_blr.diagnostics.loo_vi`. ``None``: when the guide has a density (not for
        point masses such as ``AutoDelta``) and every latent site is continuous.
    :raises DiagnosticsError: naming the site: a latent site of the model without draws from the
        guide, no observed site for the log likelihood, dims or coords that do not fit a site.

    References: Yao, Vehtari, Simpson & Gelman (2018), *Yes, but did it work?: Evaluating
    variational inference*, ICML (for the importance ratios); ArviZ's ``from_numpyro`` for the
    dims and coords conventions.
    """
    check_arguments("to_datatree", guide, params, model, args, kwargs)
    rng_key = jax.random.PRNGKey(0) if rng_key is None else rng_key
    if not isinstance(num_samples, (int, np.integer)) or num_samples < 2:
        raise DiagnosticsError(f"num_samples must be an int >= 2, got {num_samples!r}.")
    pmodel = handlers.substitute(model, data=dict(params))
    want_ll = bool(log_likelihood)

    def compute(args, kwargs, inputs, meta):
        params, rng_key = inputs
        draws = guide_draws(guide, params, args, kwargs, num_samples, rng_key)
        first = {k: v[0] for k, v in draws.items()}
        pmodel = handlers.substitute(model, data=dict(params))
        try:
            tr, latent, observed_sites, deterministic = model_sites(pmodel, first, *args, **kwargs)
        except DATA_IN_PYTHON:
            raise
        except Exception as err:  # noqa: BLE001
            raise DiagnosticsError(f"tracing the model with the guide's first draw failed: {err}") from err
        missing = [n for n in latent if n not in draws]
        if missing:
            raise DiagnosticsError(
                f"the guide gave no draws for the latent site(s) {missing} of the model (it drew {sorted(draws)}); "
                "every latent sample site must be in the guide."
            )
        latent_draws = {k: draws[k] for k in latent}
        pp_key, _ = jax.random.split(jax.random.fold_in(rng_key, 1))
        pp, det = _posterior_predictive(pmodel, latent_draws, observed_sites, args, kwargs, pp_key)
        posterior = {**latent_draws, **{k: v for k, v in det.items() if k not in latent_draws}}
        out = {"posterior": {k: v for k, v in posterior.items() if k in latent or k in deterministic}, "pp": pp,
               "obs": {n: tr[n]["value"] for n in observed_sites}}
        if want_ll:
            if not observed_sites:
                raise DiagnosticsError(
                    f"the model has no observed sample site for the log likelihood (its sample sites are {latent}); "
                    "pass the data (obs=...) in the model's arguments, or log_likelihood=False (the call is "
                    "to_datatree(guide, params, model, *args): are model and guide swapped?)."
                )
            out["ll"] = _numpyro_log_likelihood(pmodel, latent_draws, *args, batch_ndims=1, **kwargs)
        # None: when the guide has a density and every latent is continuous (a discrete latent, e.g. a mixture's
        # assignments from message passing, has no unconstrained space for the ratio)
        continuous = all(jnp.issubdtype(jnp.result_type(v), jnp.floating) for v in latent_draws.values())
        use_importance = (has_density(guide) and continuous) if importance is None else bool(importance)
        if use_importance:
            out["log_p"], out["log_q"] = log_densities(guide, params, model, latent_draws, *args, **kwargs)
        meta["observed"] = observed_sites
        return out

    # the draws, the model at each draw and the densities as one compiled program
    out, meta = guide_program(compute, ("to_datatree", num_samples, want_ll, importance), guide, model, params, args,
                              kwargs, rng_key)
    observed_sites = meta["observed"]
    obs_data = out["obs"]
    if observed is not None:
        bad = [n for n in observed if n not in observed_sites]
        if bad:
            raise DiagnosticsError(
                f"observed names the site(s) {bad}, which are not observed sites of the model "
                f"(observed sites: {observed_sites})."
            )
        obs_data = dict(observed)

    S = num_samples
    add_chain = lambda d: {k: np.asarray(v)[None] for k, v in d.items()}  # noqa: E731
    groups = {"posterior": (add_chain(_as_numpy(out["posterior"])), 2)}
    if posterior_predictive and observed_sites:
        groups["posterior_predictive"] = (add_chain(_as_numpy(out["pp"])), 2)
    if want_ll:
        ll = out["ll"]
        for name, v in ll.items():
            if not np.all(np.isfinite(np.asarray(v))):
                raise DiagnosticsError(f"the log likelihood of the observed site {name!r} is not finite at some draws.")
        groups["log_likelihood"] = (add_chain(_as_numpy(ll)), 2)
    if obs_data:
        groups["observed_data"] = (_as_numpy(obs_data), 0)

    all_dims = _merge_dims(pmodel, args, kwargs, dims)
    _check_dims(groups, {k: v for k, v in all_dims.items() if dims and k in dims}, coords, 2)
    all_dims = {k: v for k, v in all_dims.items() if any(k in d for d, _ in groups.values())}
    _check_dims(groups, all_dims, coords, 2)

    tree = {}
    for group, (data, nsd) in groups.items():
        tree[group] = dict_to_dataset(
            data,
            inference_library=None,
            coords=coords,
            dims=all_dims,
            sample_dims=["chain", "draw"] if nsd else [],
            skip_event_dims=group == "log_likelihood",
            attrs={"creation_library": "numpyro_blr", "guide": type(guide).__name__},
        )

    if "log_p" in out:
        log_p, log_q = np.asarray(out["log_p"]), np.asarray(out["log_q"])
        tree["sample_stats"] = xr.Dataset(
            {
                "log_p": (("chain", "draw"), log_p[None]),
                "log_q": (("chain", "draw"), log_q[None]),
                "log_importance_ratio": (("chain", "draw"), (log_p - log_q)[None]),
            },
            coords={"chain": [0], "draw": np.arange(S)},
            attrs={"space": "unconstrained", "note": "log p(theta, y) and log q(theta) of the posterior draws"},
        )

    if losses is not None:
        losses = np.asarray(losses, dtype=float).reshape(-1)
        tree[FIT_HISTORY] = xr.Dataset(
            {"loss": (("step",), losses), "elbo": (("step",), -losses)},
            coords={"step": np.arange(losses.size)},
            attrs={"note": "svi_result.losses: the one-sample (or num_particles) loss per SVI step"},
        )
    return xr.DataTree.from_dict(tree)
