"""``nb.IVON()`` without an ``lr`` (issue 25: every entry point as trustworthy as ``nb.BLR()``): its default step
size fits without tuning, its ``ess`` is read from the model, its end-of-run report says when it has not converged,
and an explicit ``lr`` computes exactly what it did before."""

import math
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import numpyro
import numpyro.distributions as dist
import pytest
from numpyro.infer import SVI, Trace_ELBO
from numpyro.infer.autoguide import AutoDiagonalNormal, AutoNormal

import numpyro_blr as nb
from numpyro_blr.deep.svi import DEFAULT_STEP_SIZE, IVONSVIState, ivon_guide_algorithm

N = 30
_rng = np.random.default_rng(0)
X = jnp.asarray(_rng.standard_normal((N, 3)), jnp.float32)
Y = jnp.asarray(X @ np.array([1.0, -0.5, 0.3]) + 0.5 + 0.5 * _rng.standard_normal(N), jnp.float32)


def regression(x, y=None):
    w = numpyro.sample("w", dist.Normal(0.0, 1.0).expand([3]).to_event(1))
    b = numpyro.sample("b", dist.Normal(0.0, 1.0))
    with numpyro.plate("data", x.shape[0]):
        numpyro.sample("y", dist.Normal(x @ w + b, 0.5), obs=y)


def closed_form():
    """The posterior's precision and mean (conjugate: known noise sd 0.5, N(0, 1) priors), in float64."""
    A = np.hstack([np.asarray(X, np.float64), np.ones((N, 1))])
    precision = np.eye(4) + A.T @ A / 0.25
    return precision, np.linalg.solve(precision, A.T @ np.asarray(Y, np.float64) / 0.25)


def _run(model, guide, optim, steps, *args):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        result = SVI(model, guide, optim, Trace_ELBO()).run(jax.random.key(1), steps, *args, progress_bar=False)
    return result, [str(w.message) for w in caught if str(w.message).startswith("IVON")]


@pytest.mark.slow
def test_default_fits_the_conjugate_regression_within_its_monte_carlo_error():
    """Before: ``nb.IVON()`` raised (``lr`` and ``ess`` were required), and the settings docs/deep-learning.md gave
    for SVI ended 2 of 21 robustness cases within 1 nat. The default reads ``ess`` off the plate and fits the
    KL-optimal mean-field Gaussian: the exact posterior means and the conditional sds ``1/sqrt(diag(precision))``.

    Tolerance from the Monte Carlo error of the averaged iterate (``adaptive_decay``'s docstring): after the clock
    has counted ``c`` noise-dominated steps, the average's variance is ``a^2/(2a - 1) / c`` (``a = rho_0 tau = 5``)
    times the variance of one step's estimate. In the posterior's conditional sds (the whitened coordinates, where
    ``C = diag(sd) precision diag(sd)`` has a unit diagonal) one step's mean estimate ``m - grad U(z)/p`` has
    variance ``v = max_i sum_j C_ij^2`` (the noise ``C eps``), and its curvature estimate ``eps_i (C eps)_i``
    a relative variance ``1 + v``; the sd is the precision's ``-1/2`` power. Five standard errors each."""
    optim = nb.IVON()
    result, messages = _run(regression, AutoNormal(regression), optim, 400, X, Y)
    assert optim.ess == N and not messages, messages  # ess: the plate's size; the report finds nothing wrong
    state = result.state.optim_state[1]
    assert isinstance(state.algorithm, IVONSVIState) and int(state.skipped) == 0
    precision, mean = closed_form()
    cond_sd = 1.0 / np.sqrt(np.diag(precision))
    C = cond_sd[:, None] * precision * cond_sd[None, :]
    v = float(np.max(np.sum(C**2, axis=1)))
    clock = float(state.algorithm.trace.clock)
    assert clock > 200  # the clock counts the noise-dominated steps (most of the 400 here)
    a = DEFAULT_STEP_SIZE.init_value * DEFAULT_STEP_SIZE.halving_steps
    var_factor = a * a / (2 * a - 1) / clock
    p = result.params  # constrained: the averaged means and sds
    m = np.concatenate([np.asarray(p["w_auto_loc"]), [float(p["b_auto_loc"])]])
    sd = np.concatenate([np.asarray(p["w_auto_scale"]), [float(p["b_auto_scale"])]])
    mean_err = np.abs(m - mean) / cond_sd
    log_sd_err = np.abs(np.log(sd / cond_sd))
    assert np.max(mean_err) < 5 * math.sqrt(var_factor * v), (mean_err, 5 * math.sqrt(var_factor * v))
    assert np.max(log_sd_err) < 5 * 0.5 * math.sqrt(var_factor * (1 + v)), (log_sd_err, sd / cond_sd)


@pytest.mark.slow
def test_too_short_a_run_is_reported():
    _, messages = _run(regression, AutoNormal(regression), nb.IVON(), 5, X, Y)
    assert any("IVON ran only 5 step(s): too short to judge" in m for m in messages), messages


def _uncentred():
    """A regression on a predictor around 20 with sd 1: intercept and slope correlate at -0.999 (the earnings case
    of bench/robustness_cases.py in miniature), where IVON's diagonal steps crawl."""
    rng = np.random.default_rng(2)
    x = 20.0 + rng.standard_normal(50)
    y = 3.0 + 0.5 * (x - 20.0) + 0.3 * rng.standard_normal(50)

    def model(x, y=None):
        a = numpyro.sample("a", dist.Normal(0.0, 100.0))
        b = numpyro.sample("b", dist.Normal(0.0, 10.0))
        with numpyro.plate("data", x.shape[0]):
            numpyro.sample("y", dist.Normal(a + b * x, 0.3), obs=y)

    return model, jnp.asarray(x, jnp.float32), jnp.asarray(y, jnp.float32)


@pytest.mark.slow
def test_unconverged_default_run_is_reported():
    """A run that ends short of the optimum is not silent: here the means' estimated shortfall (from the gradients'
    mean and covariance over the last steps) or the loss still falling names it."""
    model, x, y = _uncentred()
    _, messages = _run(model, AutoNormal(model), nb.IVON(), 200, x, y)
    assert any("IVON has likely not converged" in m and "nb.BLR()" in m for m in messages), messages
    # the means' shortfall names the two correlated sites (the loss itself hardly moves)
    assert any("short of the optimum" in m and "a_auto_loc" in m and "b_auto_loc" in m for m in messages), messages


@pytest.mark.slow
def test_explicit_lr_computes_what_it_did():
    """With an lr, nb.IVON is IVON's own step with its published defaults (beta1=0.9, beta2=0.99999): the
    same arrays as the algorithm built with them spelled out, and no default-only state."""
    params = {"w_auto_loc": jnp.asarray([0.5, -1.0, 0.2]), "w_auto_scale": jnp.zeros(3),
              "b_auto_loc": jnp.asarray(0.3), "b_auto_scale": jnp.asarray(0.0)}

    def loss(p, t):
        sd = {k: jax.nn.softplus(p[f"{k}_auto_scale"]) for k in ("w", "b")}
        z = {k: p[f"{k}_auto_loc"] + sd[k] * (0.3 + 0.1 * t) for k in ("w", "b")}
        value = jnp.sum((z["w"] - 1.0) ** 2) * 10.0 + (z["b"] + 0.5) ** 2 * 4.0
        return value - sum(jnp.sum(jnp.log(v)) for v in sd.values()), None

    spelled = ivon_guide_algorithm(0.2, 30.0, 1.0, 0.9, 0.99999, 0.0, float("inf"), True)
    for optim in (nb.IVON(0.2, 30.0), nb.IVON(lr=0.2, ess=30)):
        ref = nb.IVON(0.2, 30.0)
        ref.algorithm = spelled
        states = [o.init(dict(params)) for o in (optim, ref)]
        for t in range(3):
            states = [o.eval_and_update(lambda p: loss(p, t), s)[1] for o, s in zip((optim, ref), states)]
        for a, b in zip(jax.tree.leaves(states[0]), jax.tree.leaves(states[1])):
            np.testing.assert_array_equal(a, b)
        algo = states[0][1].algorithm
        assert algo.average is None and algo.grams is None and algo.snapshot is None
    with pytest.raises(ValueError, match="ess"):  # as before: an explicit lr needs the sample size
        nb.IVON(lr=0.1)


def test_default_ess_rule_and_explicit_ess():
    """ess=None reads the largest observed site's plate size at svi.init (and sets the initial scales
    1/sqrt(ess * hess_init)); an explicit ess is kept."""
    for ess, want in ((None, N), (10, 10)):
        optim = nb.IVON(ess=ess)
        state = SVI(regression, AutoDiagonalNormal(regression), optim, Trace_ELBO()).init(jax.random.key(0), X, Y)
        assert optim.ess == want
        sd = jax.nn.softplus(state.optim_state[1].params["auto_scale"])
        np.testing.assert_allclose(sd, 1.0 / math.sqrt(want), rtol=1e-5)

    def no_data():
        numpyro.sample("z", dist.Normal(0.0, 1.0))

    optim = nb.IVON()
    SVI(no_data, AutoNormal(no_data), optim, Trace_ELBO()).init(jax.random.key(0))
    assert optim.ess == 1.0  # no observed site: the initial scale 1


@pytest.mark.slow  # two nb.fit compiles
def test_nb_fit_reads_ess_and_keys_programs_by_the_options():
    """Under nb.fit the data are tracers when the optimizer is initialised: ess is read from their shapes. Two IVONs
    with different options do not share a compiled program (before, nb.fit keyed IVON by its ess alone, and
    IVON(lr=0.5) reran IVON(lr=0.01)'s program)."""
    optim = nb.IVON()
    nb.fit(regression, AutoNormal(regression), X, Y, optim=optim, num_steps=20, progress_bar=False)
    assert optim.ess == N
    guide = AutoNormal(regression)
    slow = nb.fit(regression, guide, X, Y, optim=nb.IVON(lr=1e-4, ess=N), num_steps=20, progress_bar=False)
    fast = nb.fit(regression, guide, X, Y, optim=nb.IVON(lr=0.5, ess=N), num_steps=20, progress_bar=False)
    assert not np.allclose(slow.params["w_auto_loc"], fast.params["w_auto_loc"])
