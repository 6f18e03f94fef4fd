r"""Drawing from a fitted guide and evaluating the densities the diagnostics compare.

The one place the other diagnostics modules (:mod:`.convert`, :mod:`.psis`) take their inputs from:
argument checks that name what was expected, the model's site structure, draws
:math:`\theta^{(s)} \sim q`, and :math:`\log p(u^{(s)}, y)`, :math:`\log q(u^{(s)})` in the
unconstrained space.
"""

from collections.abc import Mapping

import jax
import jax.numpy as jnp
from numpyro import handlers
from numpyro.distributions.transforms import biject_to
from numpyro.infer.autoguide import AutoContinuous, AutoDelta
from numpyro.infer.util import log_density

__all__ = ["DiagnosticsError", "check_arguments", "has_density", "log_densities", "model_sites", "posterior_draws"]


class DiagnosticsError(ValueError):
    """Bad input to a diagnostic (the message names the site or dimension at fault)."""


# -- argument checks ---------------------------------------------------------------------------
def _is_guide_object(x):
    from numpyro.infer.autoguide import AutoGuide

    from numpyro_blr.guides import ExpFamilyGuide

    return isinstance(x, (AutoGuide, ExpFamilyGuide))


def check_arguments(where, guide, params, model=None, args=(), kwargs=None):
    """Check ``(guide, params, model)`` up front and say what was expected (the order is the one of
    ``numpyro.infer.Predictive``: the guide, its fitted parameters, then the model and its arguments)."""
    call = f"{where}(guide, svi_result.params{', model' if model is not None else ''}, *args)"
    if not callable(guide):
        raise DiagnosticsError(
            f"{where}: the first argument must be the guide (an autoguide or a guide function), got "
            f"{type(guide).__name__}; the call is {call}."
        )
    if not isinstance(params, Mapping):
        hint = ""
        if hasattr(params, "params") and hasattr(params, "losses"):
            hint = " This is an SVIRunResult: pass svi_result.params (and losses=svi_result.losses to keep the loss trace)."
        elif callable(params):
            hint = " It is callable: is it the model or the guide, in the wrong place?"
        raise DiagnosticsError(
            f"{where}: the second argument must be the dict of fitted parameters (svi_result.params), got "
            f"{type(params).__name__}.{hint} The call is {call}."
        )
    if model is None:
        return
    if not callable(model):
        raise DiagnosticsError(
            f"{where}: the third argument must be the model (a function), got {type(model).__name__}; the call is {call}."
        )
    if _is_guide_object(model) and not _is_guide_object(guide):
        raise DiagnosticsError(
            f"{where}: the model argument is a guide ({type(model).__name__}) and the guide argument is not: model "
            f"and guide are swapped. The call is {call}."
        )
    from numpyro_blr.report import check_guide_params  # the guide of another model's parameters

    try:
        check_guide_params(guide, params, where, args, kwargs)
    except ValueError as err:
        raise DiagnosticsError(str(err)) from None
    if not _is_guide_object(guide):  # a guide function: it must not observe data
        try:
            tr = handlers.trace(handlers.substitute(handlers.seed(guide, 0), data=dict(params))).get_trace(
                *args, **(kwargs or {})
            )
        except Exception:  # noqa: BLE001 - let the conversion itself report what fails
            return
        observed = [n for n, site in tr.items() if site["type"] == "sample" and site.get("is_observed", False)]
        if observed:
            raise DiagnosticsError(
                f"{where}: the function passed as the guide has observed site(s) {observed}: it looks like the "
                f"model (model and guide swapped?). The call is {call}."
            )


# -- model structure ---------------------------------------------------------------------------
def model_sites(model, draw, *args, rng_key=None, **kwargs):
    """Trace ``model`` once with the latent values of ``draw`` substituted.

    Returns ``(trace, latent, observed, deterministic)``: the trace and the site names of each kind.
    """
    rng_key = jax.random.PRNGKey(0) if rng_key is None else rng_key
    tr = handlers.trace(handlers.substitute(handlers.seed(model, rng_key), data=draw)).get_trace(*args, **kwargs)
    latent, observed, deterministic = [], [], []
    for name, site in tr.items():
        if site["type"] == "sample":
            if site.get("is_observed", False):
                observed.append(name)
            elif not site.get("infer", {}).get("is_auxiliary", False):
                latent.append(name)
        elif site["type"] == "deterministic":
            deterministic.append(name)
    return tr, latent, observed, deterministic


def prepare_guide(guide, params, args, kwargs, rng_key):
    """An autoguide that was never run (no prototype trace) is run once, eagerly, so that it knows the model's
    sites; other guides are left as they are."""
    if hasattr(guide, "sample_posterior") and getattr(guide, "prototype_trace", None) is None:
        handlers.substitute(handlers.seed(guide, rng_key), data=params)(*args, **kwargs)


def guide_program(compute, static, guide, model, params, args, kwargs, rng_key):
    r"""``compute(args, kwargs, (params, rng_key), meta)`` (draws from the guide, the model at each draw, densities)
    as one compiled program (:func:`numpyro_blr.compile_once.one_program`), kept for the next call with the same
    ``model``, ``guide``, ``static`` values (what else ``compute`` depends on) and argument shapes; the program holds
    both objects, so their ids stay theirs while it is kept. Returns ``(outputs, meta)``.

    Run eagerly these are hundreds of one-operation programs, each compiled on first use (a first ``to_datatree``
    of a three-coefficient regression: 137 programs, 4.3 s; as one program 0.8 s). NumPyro's distribution checks
    are off inside: in a traced program they see only the literal constants of the guide and the model (the
    values are traced), each check a program compiled on first use, and the fit ran them already. An autoguide
    that was never run is set up first, eagerly (:func:`prepare_guide`)."""
    from numpyro.distributions.distribution import validation_enabled

    from numpyro_blr.compile_once import one_program

    prepare_guide(guide, params, args, kwargs, rng_key)
    key = (id(model), id(guide)) + tuple(static)
    with validation_enabled(False):
        return one_program(compute, key, args, kwargs, (dict(params), rng_key),
                           owners=(guide,) if hasattr(guide, "prototype_trace") else ())


def posterior_draws(guide, params, *args, num_samples=1000, rng_key=None, **kwargs):
    r"""``num_samples`` draws :math:`\theta^{(s)} \sim q` from ``guide`` with ``params``.

    For autoguides this is ``guide.sample_posterior(rng_key, params, *args, sample_shape=(S,))``
    (the guide's own draws for the same key, to rounding); for a guide function it is
    ``numpyro.infer.Predictive(guide, params=params, num_samples=S)``. Compiled as one program and kept for the
    next call on arguments of the same shapes (:func:`guide_program`): after ``nb.fit`` of a four-coefficient
    regression, ``AutoMultivariateNormal``'s eager ``sample_posterior`` compiles 46 one-operation programs (1.7-2.0 s)
    on its first call, this one program.
    """
    check_arguments("posterior_draws", guide, params)
    rng_key = jax.random.PRNGKey(0) if rng_key is None else rng_key

    def compute(args, kwargs, inputs, meta):
        params, rng_key = inputs
        return guide_draws(guide, params, args, kwargs, num_samples, rng_key)

    return guide_program(compute, ("posterior_draws", num_samples), guide, None, params, args, kwargs, rng_key)[0]


def guide_draws(guide, params, args, kwargs, num_samples, rng_key):
    """The draws of :func:`posterior_draws`, as operations (to be traced into a program, or run eagerly)."""
    if hasattr(guide, "sample_posterior"):
        prepare_guide(guide, params, args, kwargs, rng_key)
        return dict(guide.sample_posterior(rng_key, params, *args, sample_shape=(num_samples,), **kwargs))
    from numpyro.infer import Predictive

    return dict(Predictive(guide, params=params, num_samples=num_samples)(rng_key, *args, **kwargs))


# -- densities ---------------------------------------------------------------------------------
def has_density(guide):
    """Whether the guide has a density to evaluate (point masses such as ``AutoDelta`` do not)."""
    return not isinstance(guide, AutoDelta)


def _unconstrain(model_trace, draw):
    """Unconstrained values and the log|det J| of :math:`\\theta = T(u)` summed over all sites."""
    u, logdet = {}, 0.0
    for name, value in draw.items():
        site = model_trace[name]
        transform = biject_to(site["fn"].support)
        u[name] = transform.inv(value)
        logdet = logdet + jnp.sum(transform.log_abs_det_jacobian(u[name], value))
    return u, logdet


def log_densities(guide, params, model, draws, *args, **kwargs):
    r""":math:`\log p(u^{(s)}, y)` and :math:`\log q(u^{(s)})` for each draw, in the unconstrained space.

    ``draws`` are constrained latent draws ``{site: (S, ...)}`` (e.g. from
    ``guide.sample_posterior``). With :math:`\theta = T(u)` (``biject_to(support)`` per site):

    .. math::
        \log p(u, y) = \log p(\theta, y) + \log\lvert\det J_T(u)\rvert

    (``numpyro.infer.util.log_density`` of the model plus the Jacobian: minus the potential
    energy), and :math:`\log q(u)` is the density of the guide's unconstrained latent: for
    ``AutoContinuous`` guides (``AutoDiagonalNormal``, ``AutoMultivariateNormal``,
    ``AutoLowRankMultivariateNormal``, ``AutoLaplaceApproximation``, flows)
    ``guide.get_posterior(params).log_prob(u)``; for other guides (``AutoNormal``, guide
    functions) the guide's log density of :math:`\theta` plus the same Jacobian.

    Returns two arrays of shape ``(S,)``. The difference is the log importance ratio of Yao et al.
    (2018).
    """
    check_arguments("log_densities", guide, params, model, args, kwargs)
    if not has_density(guide):
        raise DiagnosticsError(
            f"{type(guide).__name__} is a point mass: it has no density log q, so there are no importance "
            "ratios (use a Gaussian guide such as AutoNormal or AutoMultivariateNormal)."
        )
    draws = {k: jnp.asarray(v) for k, v in draws.items()}
    pmodel = handlers.substitute(model, data=params)
    first = {k: v[0] for k, v in draws.items()}
    tr, latent, _, _ = model_sites(pmodel, first, *args, **kwargs)
    missing = [n for n in latent if n not in draws]
    if missing:
        raise DiagnosticsError(f"no draws for the latent site(s) {missing} of the model (got {sorted(draws)}).")
    draws = {k: draws[k] for k in latent}

    if isinstance(guide, AutoContinuous):
        # the guide's latent is the concatenation of the sites' unconstrained values in its own order
        posterior = guide.get_posterior(params)
        names = list(guide._unpack_latent(jnp.zeros(guide.latent_dim)).keys())
        extra = [n for n in names if n not in draws]
        if extra:
            raise DiagnosticsError(f"the guide has the latent site(s) {extra} that the model does not sample.")

        def log_q_fn(u, draw):
            # AutoDiagonalNormal's posterior is a batch of univariate normals: sum them
            return jnp.sum(posterior.log_prob(jnp.concatenate([jnp.reshape(u[n], -1) for n in names])))

    else:
        pguide = handlers.substitute(guide, data=params)
        gtr = handlers.trace(handlers.substitute(handlers.seed(pguide, 0), data=first)).get_trace(*args, **kwargs)
        unmatched = [
            n
            for n, s in gtr.items()
            if s["type"] == "sample" and not s.get("is_observed", False) and n not in draws
        ]
        if unmatched:
            raise DiagnosticsError(
                f"the guide samples the site(s) {unmatched} that are not latent sites of the model; "
                "log q of the draws cannot be evaluated."
            )

        def log_q_fn(u, draw):
            lq, _ = log_density(pguide, args, kwargs, draw)
            return lq

    def one(draw):
        t = handlers.trace(handlers.substitute(pmodel, data=draw)).get_trace(*args, **kwargs)
        u, logdet = _unconstrain(t, draw)
        lp, _ = log_density(pmodel, args, kwargs, draw)
        lq = log_q_fn(u, draw)
        if not isinstance(guide, AutoContinuous):
            lq = lq + logdet  # guide density of theta -> of u
        return lp + logdet, lq

    return jax.vmap(one)(draws)
