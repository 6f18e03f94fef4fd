r"""Kalman filtering and smoothing as Bayesian-learning-rule steps on NumPyro state-space models.

A state-space model written with :func:`numpyro.contrib.control_flow.scan` is read as

.. math::

    x_0 \sim p(x_0), \qquad x_t \mid x_{t-1} \sim \mathcal N(A_t x_{t-1} + b_t,\; Q_t), \qquad
    y_t \mid x_t \sim p(y_t \mid x_t), \qquad t = 1..T,

and filtered by alternating a **predict** step (the linear-Gaussian transition pushes the Gaussian
:math:`q_{t-1} = \mathcal N(m_{t-1}, P_{t-1})` forward: :math:`\bar m_t = A_t m_{t-1} + b_t`,
:math:`\bar P_t = A_t P_{t-1} A_t^\top + Q_t`) with an **update** step that is the Bayesian learning rule
(Khan & Rue 2023, "The Bayesian learning rule", JMLR 24(281); Sec. 5 and the online/Kalman discussion):
the predicted Gaussian is the prior of time :math:`t` and the BLR with natural parameters
:math:`\lambda = \bar\lambda_t + \tilde\lambda` (prior plus a likelihood "site") moves the site by

.. math::

    \tilde\lambda \leftarrow (1-\rho)\,\tilde\lambda + \rho\,\nabla_\mu \mathbb E_q[\log p(y_t\mid x_t)],
    \qquad\text{i.e.}\qquad
    \tilde N \leftarrow (1-\rho)\tilde N + \rho\,(-\hat H), \quad
    \tilde\nu \leftarrow (1-\rho)\tilde\nu + \rho\,(\hat g - \hat H m),

with :math:`\hat g = \mathbb E_q[\nabla \log p(y_t\mid x_t)]` and
:math:`\hat H = \mathbb E_q[\nabla^2\log p(y_t\mid x_t)]`
(Bonnet's and Price's theorems), so that :math:`q = \mathcal N(m, \Sigma)` with
:math:`\Sigma^{-1} = \bar P_t^{-1} + \tilde N` and :math:`\Sigma^{-1} m = \bar P_t^{-1}\bar m_t + \tilde\nu`.
Special cases, by the options of :func:`kalman_filter`:

- ``expectation="delta"`` (:math:`\hat g, \hat H` at the mean), ``num_iter=1``, ``step_size=1``: from
  :math:`q = \mathcal N(\bar m_t, \bar P_t)` one step gives
  :math:`m = \bar m_t + \Sigma\,\nabla\log p(y_t\mid\bar m_t)`.
  For a linear-Gaussian observation :math:`\log p` is quadratic and this **is the Kalman update** (exact
  Bayes: the conjugate BLR step with :math:`\rho = 1`).
- ``hessian="gauss_newton"`` replaces :math:`\nabla^2\log p` by minus the Fisher information of the
  observation, :math:`-J^\top R^{-1} J` for a Gaussian observation with mean :math:`h(x)`: one step is the
  **extended Kalman filter**; ``num_iter > 1`` re-linearises at the new mean: the **iterated EKF**
  (Gauss-Newton on the MAP of :math:`p(x_t\mid y_{1:t})`, Bell & Cathey 1993). With the exact Hessian the
  iterations are Newton's method: the **iterated Laplace** update.
- ``expectation="cubature"`` / ``"gauss_hermite"``: :math:`\hat g, \hat H` are expectations under the
  current :math:`q`, by the third-degree spherical-radial cubature rule (:math:`2d` points) or a
  Gauss-Hermite product rule (``order**d`` points): the BLR's own (variational) estimator, a posterior
  linearisation.

The **smoother** is the Rauch-Tung-Striebel backward pass on the filtered Gaussians with the
transition's :math:`A_t, Q_t` (the exact :math:`\rho = 1` backward message of a linear-Gaussian chain):
:math:`G_t = P_t A_{t+1}^\top \bar P_{t+1}^{-1}`, :math:`m^s_t = m_t + G_t(m^s_{t+1} - \bar m_{t+1})`,
:math:`P^s_t = P_t + G_t(P^s_{t+1} - \bar P_{t+1})G_t^\top`.

**Marginal likelihood.** Each step reports :math:`\log Z_t`, the log evidence of the local model of
:math:`\log p(y_t\mid x_t)` that the last BLR step used, under the predicted Gaussian: with
``expectation="delta"`` the quadratic model
:math:`\ell(m_k) + g_k^\top(x-m_k) + \tfrac12 (x-m_k)^\top H_k (x-m_k)` at the last linearisation point
:math:`m_k`, whose evidence :math:`\int \mathcal N(x;\bar m,\bar P)\,e^{\tilde\ell(x)}dx` is in closed form
and equals the ELBO :math:`\mathbb E_q[\tilde\ell] - \mathrm{KL}(q\,\|\,\mathcal N(\bar m,\bar P))` at the
:math:`\rho=1` update. For a linear-Gaussian observation it is exact: :math:`\log p(y_t\mid y_{1:t-1}) =
\log\mathcal N(y_t; H\bar m_t + d, H\bar P_t H^\top + R)`, and :math:`\sum_t\log Z_t = \log p(y_{1:T})`. For a
nonlinear/non-Gaussian observation it is an approximation: the EKF's linearised-model evidence (one
Gauss-Newton step; what ``dynamax``'s EKF reports), a Laplace approximation at the iterate (exact Hessian,
converged). With ``expectation="cubature"``/``"gauss_hermite"`` it is the ELBO
:math:`\mathbb E_q[\log p(y_t\mid x_t)] - \mathrm{KL}(q\,\|\,\mathcal N(\bar m_t,\bar P_t))` by the same rule: a
lower bound on :math:`\log p(y_t\mid y_{1:t-1})` under the filter's Gaussian prediction (up to quadrature error).

Supported models
----------------
The model calls ``scan(step, init, xs)`` once (``reverse=False``, ``history=1``), with

- exactly **one latent sample site inside** ``step`` (the state; ``site=`` names it; any other latent
  site inside ``step`` is an error naming it), with a ``Normal`` (scalar, or batched / ``.to_event`` for a
  vector state: a diagonal covariance), ``MultivariateNormal`` or ``LowRankMultivariateNormal``
  distribution whose **mean is affine in the previous state** and whose covariance does not depend on it
  (both checked on the concrete data at probe states; errors name the site). ``dynamics="linearize"``
  instead linearises a nonlinear mean at the filtered mean (the EKF's predict step; the smoother then
  is the extended RTS smoother). :math:`A_t, b_t, Q_t` may depend on ``t`` through ``xs`` (inputs).
- the **carry is the state**: ``step`` returns the latent site's value as its new carry (checked), and
  ``init`` is either the value of a Gaussian sample site outside ``scan`` (the initial state, e.g. ``x0``)
  or a constant (a known initial state: covariance zero).
- **observed sites inside** ``step`` (``obs=`` from ``xs``), any distribution with a differentiable
  log-density in the state; their log-densities are summed into :math:`\log p(y_t\mid x_t)`, which must
  not depend on the previous state. ``hessian="gauss_newton"`` needs observation sites whose log-density
  is affine in the observation apart from terms free of the state (``Normal``/``MultivariateNormal`` with
  a state-free scale, ``Poisson``, ``Bernoulli``, ``Binomial``, ``Exponential``, ``Gamma`` with a
  state-free concentration): the Fisher information is then the Hessian of :math:`\log p(\hat y\mid x)` at
  :math:`\hat y = \mathbb E[y\mid x]`, which is how it is computed.
- no other latent site: condition hyperparameters on values (``numpyro.handlers.condition``) or pass
  them as arguments. Observed sites outside ``scan`` are read as such conditioned values: they must not
  be observations of the state (their log-density is not part of ``marginal_loglik``).

States are flattened: means have shape ``(T, d)`` and covariances ``(T, d, d)`` with ``d`` the state's
size (``d = 1`` for a scalar state). The observations must be complete: a NaN in an observation raises a
``ValueError`` that names the time index and the site.

References: Khan & Rue (2023), The Bayesian learning rule, JMLR 24(281). Kalman (1960). Rauch, Tung &
Striebel (1965). Bell & Cathey (1993), The iterated Kalman filter update as a Gauss-Newton method.
Särkkä (2013), Bayesian Filtering and Smoothing (Ch. 5-6 for the EKF/IEKF, Ch. 6 for cubature filters).
"""

from __future__ import annotations

from functools import partial
from typing import NamedTuple, Optional

import jax
import jax.numpy as jnp
import numpy as np
import numpyro.distributions as dist
from numpyro import handlers
from numpyro.primitives import Messenger

__all__ = ["KalmanResult", "kalman_filter", "kalman_smoother", "StateSpaceModelError"]


class StateSpaceModelError(ValueError):
    """The model is not a state-space model that :func:`kalman_filter` can read (the message names the site)."""


class KalmanResult(NamedTuple):
    """The filter's (and smoother's) Gaussians, flattened states: means ``(T, d)``, covariances ``(T, d, d)``.

    ``predicted_*[t]`` is :math:`p(x_t\\mid y_{1:t-1})` (the prior of the BLR update at time ``t``; note that
    ``dynamax`` indexes its predictions one step ahead), ``filtered_*[t]`` is :math:`q(x_t) \\approx
    p(x_t\\mid y_{1:t})`, ``smoothed_*[t]`` is :math:`p(x_t\\mid y_{1:T})` (``None`` from :func:`kalman_filter`).
    ``loglik_increments[t]`` is :math:`\\log Z_t \\approx \\log p(y_t\\mid y_{1:t-1})` and
    ``marginal_loglik`` their sum (exact for a linear-Gaussian model; see the module docstring otherwise).
    ``initial_*`` is the initial state's prior (covariance zero for a known initial state) and
    ``smoothed_initial_*`` its posterior given all the data. ``transition_matrices[t]`` is :math:`A_t` (at
    the filtered mean of ``t-1`` under ``dynamics="linearize"``)."""

    filtered_means: jnp.ndarray
    filtered_covariances: jnp.ndarray
    predicted_means: jnp.ndarray
    predicted_covariances: jnp.ndarray
    marginal_loglik: jnp.ndarray
    loglik_increments: jnp.ndarray
    initial_mean: jnp.ndarray
    initial_covariance: jnp.ndarray
    transition_matrices: jnp.ndarray
    smoothed_means: Optional[jnp.ndarray] = None
    smoothed_covariances: Optional[jnp.ndarray] = None
    smoothed_initial_mean: Optional[jnp.ndarray] = None
    smoothed_initial_covariance: Optional[jnp.ndarray] = None
    site: str = ""


# --------------------------------------------------------------------------------------------------
# Reading the model
# --------------------------------------------------------------------------------------------------


class _ScanFound(Exception):
    pass


class _CaptureScan(Messenger):
    """Stops the model at its ``scan`` call and keeps the call's body, carry, data and substitutions."""

    def __init__(self, fn=None):
        self.msg = None
        super().__init__(fn)

    def process_message(self, msg):
        if msg["type"] == "control_flow":
            self.msg = {"args": msg["args"], "kwargs": dict(msg["kwargs"]),
                        "substitute_stack": list(msg["kwargs"].get("substitute_stack", []))}
            raise _ScanFound()


_GN_TYPES = (dist.Normal, dist.MultivariateNormal, dist.LowRankMultivariateNormal, dist.Poisson,
             dist.BernoulliLogits, dist.BernoulliProbs, dist.BinomialLogits, dist.BinomialProbs,
             dist.Exponential, dist.Gamma)


def _base(fn):
    while isinstance(fn, (dist.Independent, dist.ExpandedDistribution)):
        fn = fn.base_dist
    return fn


def _gaussian_moments(fn, name, d):
    """Mean (d,) and covariance (d, d) of a Gaussian site's distribution, else StateSpaceModelError."""
    base = _base(fn)
    if isinstance(base, (dist.MultivariateNormal, dist.LowRankMultivariateNormal)):
        if fn.batch_shape != ():
            raise StateSpaceModelError(
                f"site {name!r}: a batched {type(base).__name__} (batch shape {fn.batch_shape}) is not supported; "
                "use one MultivariateNormal over the whole state")
        return jnp.reshape(fn.mean, (d,)), fn.covariance_matrix
    if isinstance(base, dist.Normal):
        mean = jnp.broadcast_to(fn.mean, fn.shape()).reshape((d,))
        var = jnp.broadcast_to(fn.variance, fn.shape()).reshape((d,))
        return mean, jnp.diag(var)
    raise StateSpaceModelError(
        f"site {name!r} has a {type(base).__name__} distribution: the state of kalman_filter must be Gaussian "
        "(Normal, MultivariateNormal or LowRankMultivariateNormal)")


class _Reading(NamedTuple):
    body: object
    init: object
    xs: object
    length: int
    subs: list
    site: str
    state_shape: tuple
    d: int
    obs_sites: tuple
    m_init: jnp.ndarray
    P_init: jnp.ndarray
    init_site: Optional[str]
    dtype: object


def _run_body(reading, carry_vec, z_vec, t, obs_override=None):
    """Run the scan body at time ``t`` with carry ``carry_vec`` and the state conditioned on ``z_vec``.
    Returns (trace, new_carry). ``obs_override``: a function site -> value replacing observed values."""
    r = reading
    x_t = jax.tree.map(lambda a: a[t], r.xs)
    fn = handlers.seed(r.body, rng_seed=0)
    for subs_type, subs_map in r.subs:
        from numpyro.contrib.control_flow.scan import _subs_wrapper

        subs_fn = partial(_subs_wrapper, subs_map, t, r.length)
        fn = (handlers.condition(fn, condition_fn=subs_fn) if subs_type == "condition"
              else handlers.substitute(fn, substitute_fn=subs_fn))
    fn = handlers.condition(fn, data={r.site: jnp.reshape(z_vec, r.state_shape)})
    carry = jnp.reshape(carry_vec, r.state_shape)
    with handlers.trace() as tr:
        new_carry, _ = fn(carry, x_t)
    return tr, new_carry


def _obs_loglik(reading, z_vec, t, carry_vec, fisher=False):
    tr, _ = _run_body(reading, carry_vec, z_vec, t)
    total = 0.0
    for name in reading.obs_sites:
        s = tr[name]
        value = s["value"]
        if fisher:  # log p(E[y|x] | x) with E[y|x] held fixed: its Hessian is minus the Fisher information
            mean = jnp.broadcast_to(s["fn"].mean, jnp.shape(value)).astype(jnp.result_type(float))
            value = jax.lax.stop_gradient(mean)
        lp = jnp.sum(s["fn"].log_prob(value))
        if s.get("scale") is not None:
            lp = s["scale"] * lp
        total = total + lp
    return total


def _transition(reading, prev_vec, t):
    tr, _ = _run_body(reading, prev_vec, prev_vec, t)
    return _gaussian_moments(tr[reading.site]["fn"], reading.site, reading.d)


def _read_model(model, args, kwargs, site, rng_seed):
    capture = _CaptureScan()
    with handlers.trace() as outer, capture:
        try:
            handlers.seed(model, rng_seed=rng_seed)(*args, **kwargs)
        except _ScanFound:
            pass
    if capture.msg is None:
        raise StateSpaceModelError("the model calls no numpyro.contrib.control_flow.scan: kalman_filter needs a "
                                   "state-space model written with scan")
    f, init, xs, length, reverse = capture.msg["args"]
    kw = capture.msg["kwargs"]
    if reverse:
        raise StateSpaceModelError("scan(..., reverse=True) is not supported by kalman_filter")
    if kw.get("history", 1) != 1:
        raise StateSpaceModelError(f"scan(..., history={kw.get('history')}) is not supported: a first-order "
                                   "Markov chain (history=1) is")
    subs = capture.msg["substitute_stack"]
    for subs_type, _ in subs:
        if subs_type not in ("condition", "substitute"):
            raise StateSpaceModelError(f"a {subs_type!r} handler around scan is not supported by kalman_filter")
    if xs is None:
        raise StateSpaceModelError("scan(f, init, xs=None): the observations must be scanned over as xs "
                                   "(obs=y_t inside the step)")
    if length is None:
        length = int(jnp.shape(jax.tree.leaves(xs)[0])[0])
    if isinstance(init, (tuple, list, dict)):
        raise StateSpaceModelError("the scan carry must be the latent state (one array), got a "
                                   f"{type(init).__name__}")
    init = jnp.asarray(init)
    dtype = jnp.result_type(init.dtype, float)
    state_shape = tuple(init.shape)
    d = int(np.prod(state_shape)) if state_shape else 1

    # the initial state: a Gaussian site outside scan whose value is the carry, or a constant
    init_site, m_init, P_init = None, jnp.reshape(init, (d,)).astype(dtype), jnp.zeros((d, d), dtype)
    for name, s in outer.items():
        if s["type"] != "sample":
            continue
        if s.get("is_observed", False):  # a conditioned hyperparameter: a constant factor of the joint
            continue
        if s["value"] is init or (jnp.shape(s["value"]) == state_shape
                                   and bool(jnp.all(jnp.asarray(s["value"]) == init))):
            init_site = name
            m_init, P_init = _gaussian_moments(s["fn"], name, d)
            m_init, P_init = m_init.astype(dtype), P_init.astype(dtype)
        else:
            raise StateSpaceModelError(
                f"latent site {name!r} outside scan is not the initial state (the scan's carry): kalman_filter "
                "needs every other latent fixed; condition it on a value (numpyro.handlers.condition) or "
                "pass it as an argument")

    # the body's sites, at t = 0 with the carry at the initial mean
    x_0 = jax.tree.map(lambda a: a[0], xs)
    with handlers.trace() as body_tr:
        handlers.seed(f, rng_seed=rng_seed)(jnp.reshape(m_init, state_shape), x_0)
    latent = [n for n, s in body_tr.items() if s["type"] == "sample" and not s.get("is_observed", False)]
    observed = [n for n, s in body_tr.items() if s["type"] == "sample" and s.get("is_observed", False)]
    if site is None:
        if len(latent) != 1:
            raise StateSpaceModelError(
                f"the scanned step has latent sites {latent}: kalman_filter needs exactly one (the state); "
                "name it with site=... and condition the others")
        site = latent[0]
    elif site not in latent:
        raise StateSpaceModelError(f"site {site!r} is not a latent sample site of the scanned step "
                                   f"(latent sites: {latent})")
    others = [n for n in latent if n != site]
    if others:
        raise StateSpaceModelError(f"latent site {others[0]!r} inside the scanned step: kalman_filter handles "
                                   f"one latent state ({site!r}); condition {others[0]!r} on a value")
    if not observed:
        raise StateSpaceModelError("the scanned step has no observed site (obs=...): nothing to filter on")
    if tuple(jnp.shape(body_tr[site]["value"])) != state_shape:
        raise StateSpaceModelError(f"site {site!r} has shape {jnp.shape(body_tr[site]['value'])} but the scan carry "
                                   f"has shape {state_shape}: the carry must be the state")
    return _Reading(f, init, xs, length, subs, site, state_shape, d, tuple(observed), m_init, P_init,
                    init_site, dtype)


def _check(reading, hessian, dynamics, rng_seed):
    """Concrete checks before the filter: complete data, carry = state, linear dynamics, state-free
    covariances. The probes are computed in one compiled program; the comparisons run on the host."""
    r = reading
    T = r.length
    probe = r.m_init
    rng = np.random.default_rng(rng_seed)
    scale = jnp.sqrt(jnp.maximum(jnp.diag(r.P_init), 0.0)) + 1.0
    probes = [probe + jnp.asarray(rng.standard_normal(r.d), r.dtype) * scale for _ in range(2)]
    tol = 1e-6 if r.dtype == jnp.float64 else 1e-3
    times = sorted({0, T - 1})
    gn_params = {}

    def probe_all(probes):
        out = {}

        def obs_values(t):
            tr, _ = _run_body(r, probe, probe, t)
            return {n: tr[n]["value"] for n in r.obs_sites}

        out["obs"] = jax.vmap(obs_values)(jnp.arange(T))
        for t in times:
            _, new_carry = _run_body(r, probes[0], probes[1], t)
            out[f"carry{t}"] = jnp.reshape(new_carry, (-1,))
            mean_fn = lambda z: _transition(r, z, t)[0]  # noqa: E731
            out[f"A{t}"] = [jax.jacfwd(mean_fn)(z) for z in probes]
            out[f"Q{t}"] = [_transition(r, z, t)[1] for z in probes]
            out[f"gprev{t}"] = jax.grad(lambda c: _obs_loglik(r, probes[1], t, c))(probes[0])
            if hessian == "gauss_newton":
                tr, _ = _run_body(r, probes[0], probes[1], t)
                for n in r.obs_sites:
                    base = _base(tr[n]["fn"])
                    gn_params[n] = type(base).__name__ if not isinstance(base, _GN_TYPES) else None
                    if isinstance(base, dist.Exponential):
                        continue
                    for attr in ("scale", "scale_tril", "cov_factor", "cov_diag", "concentration"):
                        if hasattr(base, attr):
                            def par(z, attr=attr, n=n):
                                tr_z, _ = _run_body(r, probes[0], z, t)
                                return jnp.ravel(getattr(_base(tr_z[n]["fn"]), attr))
                            out[f"gn:{n}:{attr}:{t}"] = jax.jacfwd(par)(probes[1])
        return out

    out = jax.device_get(jax.jit(probe_all)(probes))

    # missing data: NaN in an observed site's value (names the site and the time index), then in xs
    for n in r.obs_sites:
        v = np.asarray(out["obs"][n]).reshape(T, -1)
        bad = np.nonzero(np.isnan(v).any(axis=1))[0]
        if bad.size:
            raise ValueError(f"observed site {n!r} is NaN (missing) at time index {int(bad[0])}"
                             + (f" (and {bad.size - 1} more: {bad[:10].tolist()})" if bad.size > 1 else "")
                             + ": kalman_filter needs complete observations")
    for leaf in jax.tree.leaves(r.xs):
        a = np.asarray(leaf)
        if np.issubdtype(a.dtype, np.floating):
            bad = np.nonzero(np.isnan(a.reshape(a.shape[0], -1)).any(axis=1))[0]
            if bad.size:
                raise ValueError(f"the scanned data (xs) is NaN (missing) at time index {int(bad[0])}: "
                                 "kalman_filter needs complete data")
    close = lambda a, b: bool(np.allclose(a, b, rtol=tol, atol=tol))  # noqa: E731
    for t in times:
        if out[f"carry{t}"].shape != (r.d,) or not close(out[f"carry{t}"], probes[1]):
            raise StateSpaceModelError(f"the scanned step must return the value of site {r.site!r} as its carry "
                                       "(the carry is the state)")
        if dynamics == "linear" and not close(*out[f"A{t}"]):
            raise StateSpaceModelError(
                f"the mean of site {r.site!r} is not linear in the previous state (its Jacobian changes with the "
                f"state, at time index {t}): kalman_filter needs linear-Gaussian dynamics; "
                "dynamics='linearize' linearises them at the filtered mean (extended Kalman filter)")
        if not close(*out[f"Q{t}"]):
            raise StateSpaceModelError(f"the covariance of site {r.site!r} depends on the previous state "
                                       f"(time index {t}): kalman_filter needs a state-free transition covariance")
        if not close(out[f"gprev{t}"], 0.0):
            raise StateSpaceModelError(f"the observed sites {list(r.obs_sites)} depend on the previous state "
                                       "(the carry) given the current state: not a state-space model")
    for n, bad_type in gn_params.items():
        if bad_type is not None:
            raise StateSpaceModelError(
                f"hessian='gauss_newton' does not support observed site {n!r} ({bad_type}): supported are "
                "Normal, MultivariateNormal, Poisson, Bernoulli, Binomial, Exponential, Gamma")
    for key, jac in out.items():
        if key.startswith("gn:") and not close(jac, 0.0):
            _, n, attr, _ = key.split(":")
            raise StateSpaceModelError(f"hessian='gauss_newton': the {attr} of observed site {n!r} depends on the "
                                       "state; use hessian='exact'")


# --------------------------------------------------------------------------------------------------
# The filter
# --------------------------------------------------------------------------------------------------


def _quadrature(kind, d, order, dtype):
    """Unit points (n, d) and weights (n,) for E over N(0, I)."""
    if kind == "cubature":
        eye = np.eye(d)
        pts = np.sqrt(d) * np.concatenate([eye, -eye])
        w = np.full(2 * d, 1.0 / (2 * d))
    else:
        x, w1 = np.polynomial.hermite_e.hermegauss(order)
        w1 = w1 / w1.sum()
        grids = np.meshgrid(*([x] * d), indexing="ij")
        pts = np.stack([g.ravel() for g in grids], axis=1)
        wg = np.meshgrid(*([w1] * d), indexing="ij")
        w = np.prod(np.stack([g.ravel() for g in wg], axis=1), axis=1)
    return jnp.asarray(pts, dtype), jnp.asarray(w, dtype)


def _site_posterior(m0, P, nu, N):
    """q = prior N(m0, P) times the site exp(nu'x - x'Nx/2), in covariance form (P is never inverted)."""
    d = m0.shape[0]
    M = jnp.eye(d, dtype=P.dtype) + N @ P
    S = P - P @ jnp.linalg.solve(M, N @ P)
    S = 0.5 * (S + S.T)
    m = m0 - P @ jnp.linalg.solve(M, N @ m0) + S @ nu
    return m, S


def _filter_core(reading, hessian, expectation, num_iter, step_size, order, dynamics):
    r = reading
    d, dtype, T = r.d, r.dtype, r.length
    fisher = hessian == "gauss_newton"
    if expectation != "delta":
        unit_pts, weights = _quadrature(expectation, d, order, dtype)

    def update(m0, P, t):
        ll = lambda z: _obs_loglik(r, z, t, m0)  # noqa: E731
        ll_h = (lambda z: _obs_loglik(r, z, t, m0, fisher=True)) if fisher else ll  # noqa: E731
        grad, hess = jax.grad(ll), jax.hessian(ll_h)

        def expect(m, S):
            if expectation == "delta":
                return grad(m), hess(m)
            L = jnp.linalg.cholesky(S + 1e-300 * jnp.eye(d, dtype=dtype))
            pts = m + unit_pts @ L.T
            gs, hs = jax.vmap(grad)(pts), jax.vmap(hess)(pts)
            return jnp.tensordot(weights, gs, 1), jnp.tensordot(weights, hs, 1)

        def it(carry, _):
            m, S, nu, Nt, _lin = carry
            g, H = expect(m, S)
            N = -0.5 * (H + H.T)
            Nt = (1.0 - step_size) * Nt + step_size * N
            nu = (1.0 - step_size) * nu + step_size * (g + N @ m)
            m_new, S_new = _site_posterior(m0, P, nu, Nt)
            return (m_new, S_new, nu, Nt, (m, g, N)), None

        zero = jnp.zeros((d, d), dtype)
        lin0 = (m0, jnp.zeros(d, dtype), zero)
        (m, S, _, _, (mk, gk, Nk)), _ = jax.lax.scan(it, (m0, P, jnp.zeros(d, dtype), zero, lin0), None,
                                                     length=num_iter)
        if expectation == "delta":
            # log evidence of the quadratic model at the last linearisation point m_k, under N(m0, P)
            c_k = ll(mk)
            delta = m0 - mk
            c0 = c_k + gk @ delta - 0.5 * delta @ Nk @ delta
            g0 = gk - Nk @ delta
            _, S_q = _site_posterior(m0, P, jnp.zeros(d, dtype), Nk)
            _, logdet = jnp.linalg.slogdet(jnp.eye(d, dtype=dtype) + P @ Nk)
            logz = c0 + 0.5 * g0 @ S_q @ g0 - 0.5 * logdet
        else:
            # ELBO: E_q[log p(y|x)] by the same rule, minus KL(q || N(m0, P))
            L = jnp.linalg.cholesky(S + 1e-300 * jnp.eye(d, dtype=dtype))
            e_ll = jnp.dot(weights, jax.vmap(ll)(m + unit_pts @ L.T))
            Lp = jnp.linalg.cholesky(P)
            A = jax.scipy.linalg.solve_triangular(Lp, L, lower=True)
            u = jax.scipy.linalg.solve_triangular(Lp, m - m0, lower=True)
            logdet_ratio = jnp.sum(jnp.log(jnp.diag(Lp))) - jnp.sum(jnp.log(jnp.abs(jnp.diag(L))))
            kl = 0.5 * (jnp.sum(A * A) + u @ u - d) + logdet_ratio
            logz = e_ll - kl
        return m, S, logz

    def step(carry, t):
        m_prev, P_prev = carry
        mean_fn = lambda z: _transition(r, z, t)[0]  # noqa: E731
        A = jax.jacfwd(mean_fn)(m_prev)
        m_pred, Q = _transition(r, m_prev, t)
        P_pred = A @ P_prev @ A.T + Q
        P_pred = 0.5 * (P_pred + P_pred.T)
        m_f, P_f, logz = update(m_pred, P_pred, t)
        return (m_f, P_f), (m_f, P_f, m_pred, P_pred, logz, A)

    def run(m_init, P_init):
        _, (mf, Pf, mp, Pp, logz, As) = jax.lax.scan(step, (m_init, P_init), jnp.arange(T))
        return mf, Pf, mp, Pp, logz, As

    return run


def _rts(mf, Pf, mp, Pp, As, m_init, P_init):
    """Rauch-Tung-Striebel backward pass; also returns the smoothed initial state."""

    def gain(P_f, A_next, P_pred_next):
        return jnp.linalg.solve(P_pred_next, A_next @ P_f).T

    def back(carry, inp):
        ms_next, Ps_next = carry
        m_f, P_f, mp_next, Pp_next, A_next = inp
        G = gain(P_f, A_next, Pp_next)
        ms = m_f + G @ (ms_next - mp_next)
        Ps = P_f + G @ (Ps_next - Pp_next) @ G.T
        Ps = 0.5 * (Ps + Ps.T)
        return (ms, Ps), (ms, Ps)

    inputs = (mf[:-1], Pf[:-1], mp[1:], Pp[1:], As[1:])
    _, (ms, Ps) = jax.lax.scan(back, (mf[-1], Pf[-1]), inputs, reverse=True)
    ms = jnp.concatenate([ms, mf[-1:]])
    Ps = jnp.concatenate([Ps, Pf[-1:]])
    (m0s, P0s), _ = back((ms[0], Ps[0]), (m_init, P_init, mp[0], Pp[0], As[0]))
    return ms, Ps, m0s, P0s


def _run(model, args, kwargs, site, hessian, expectation, num_iter, step_size, order, dynamics, smooth, rng_seed):
    if hessian not in ("exact", "gauss_newton"):
        raise ValueError(f"hessian must be 'exact' or 'gauss_newton', got {hessian!r}")
    if expectation not in ("delta", "cubature", "gauss_hermite"):
        raise ValueError(f"expectation must be 'delta', 'cubature' or 'gauss_hermite', got {expectation!r}")
    if dynamics not in ("linear", "linearize"):
        raise ValueError(f"dynamics must be 'linear' or 'linearize', got {dynamics!r}")
    if int(num_iter) < 1:
        raise ValueError(f"num_iter must be >= 1, got {num_iter}")
    if not 0.0 < float(step_size) <= 1.0:
        raise ValueError(f"step_size must be in (0, 1], got {step_size}")
    reading = _read_model(model, args, kwargs, site, rng_seed)
    _check(reading, hessian, dynamics, rng_seed)
    run = _filter_core(reading, hessian, expectation, int(num_iter), float(step_size), int(order), dynamics)

    def full(m_init, P_init):
        mf, Pf, mp, Pp, logz, As = run(m_init, P_init)
        out = dict(filtered_means=mf, filtered_covariances=Pf, predicted_means=mp, predicted_covariances=Pp,
                   marginal_loglik=jnp.sum(logz), loglik_increments=logz, initial_mean=m_init,
                   initial_covariance=P_init, transition_matrices=As)
        if smooth:
            ms, Ps, m0s, P0s = _rts(mf, Pf, mp, Pp, As, m_init, P_init)
            out.update(smoothed_means=ms, smoothed_covariances=Ps, smoothed_initial_mean=m0s,
                       smoothed_initial_covariance=P0s)
        return out

    out = jax.jit(full)(reading.m_init, reading.P_init)
    return KalmanResult(site=reading.site, **out)


def kalman_filter(model, *args, site=None, hessian="exact", expectation="delta", num_iter=1, step_size=1.0,
                  order=5, dynamics="linear", rng_seed=0, **kwargs):
    r"""Filter a NumPyro state-space model (written with ``scan``) by BLR updates; see the module docstring.

    :param model: a NumPyro model calling ``numpyro.contrib.control_flow.scan`` (supported shapes: module docstring).
    :param args, kwargs: the model's arguments (the observations among them: concrete, complete arrays).
    :param site: the latent state's site inside the scanned step (default: the only latent site there).
    :param hessian: ``"exact"`` (:math:`\nabla^2\log p(y_t\mid x)`: Kalman for linear-Gaussian, Laplace/Newton
        otherwise) or ``"gauss_newton"`` (minus the observation's Fisher information, :math:`J^\top R^{-1}J` for a
        Gaussian observation: the EKF).
    :param expectation: ``"delta"`` (gradient and Hessian at the mean), ``"cubature"`` (their expectation under
        the current :math:`q`, spherical-radial rule, 2d points) or ``"gauss_hermite"`` (``order**d`` points).
    :param num_iter: BLR steps per time step (re-linearising at the new mean: the iterated EKF / iterated Laplace).
    :param step_size: the BLR's :math:`\rho` for those steps (1: the exact Bayes update for a conjugate observation).
    :param order: Gauss-Hermite points per dimension for ``expectation="gauss_hermite"``.
    :param dynamics: ``"linear"`` (checked; an error names the site otherwise) or ``"linearize"`` (the EKF's
        predict step for a nonlinear mean).
    :param rng_seed: seed for running the model once to read it, and for the probe states of the checks.
    :returns: :class:`KalmanResult` (``smoothed_*`` are ``None``).
    :raises ValueError: a NaN observation (names the time index and the site); :class:`StateSpaceModelError` (a
        ``ValueError``) for a model this cannot read (names the site).
    """
    return _run(model, args, kwargs, site, hessian, expectation, num_iter, step_size, order, dynamics, False, rng_seed)


def kalman_smoother(model, *args, site=None, hessian="exact", expectation="delta", num_iter=1, step_size=1.0,
                    order=5, dynamics="linear", rng_seed=0, **kwargs):
    r""":func:`kalman_filter` followed by the Rauch-Tung-Striebel backward pass (the exact :math:`\rho=1` backward
    message of the linear-Gaussian chain): ``smoothed_means[t]``, ``smoothed_covariances[t]`` are
    :math:`p(x_t\mid y_{1:T})` (exact for a linear-Gaussian model; a Gaussian approximation otherwise) and
    ``smoothed_initial_*`` the initial state's. Same options as :func:`kalman_filter`."""
    return _run(model, args, kwargs, site, hessian, expectation, num_iter, step_size, order, dynamics, True, rng_seed)
