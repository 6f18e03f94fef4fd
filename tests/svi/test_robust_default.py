"""The default ``nb.BLR()`` on models nobody tuned it on, and what it says when a fit goes wrong.

Oracles are closed forms: the Student-t posterior of a linear regression with flat priors, the
mean-field optimum of a Gaussian posterior (mean = posterior mean, precision = diag of the
posterior precision). Each failure mode of the end-of-run report has a model built to trigger it.
"""

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import numpyro
import numpyro.distributions as dist
import optax
import pytest
from numpyro.distributions import constraints
from numpyro.infer import SVI, Trace_ELBO, init_to_value
from numpyro.infer.autoguide import AutoMultivariateNormal, AutoNormal

import numpyro_blr as nb


def flat_regression(x, y):
    """posteriordb's earnings model: flat priors on the coefficients and on sigma > 0."""
    beta = numpyro.sample("beta", dist.ImproperUniform(constraints.real, (), event_shape=(2,)))
    sigma = numpyro.sample("sigma", dist.ImproperUniform(constraints.positive, (), event_shape=()))
    numpyro.sample("y", dist.Normal(beta[0] + beta[1] * x, sigma), obs=y)


@pytest.fixture(scope="module")
def uncentred_data():
    """A predictor like a height in mm shifted by 1e4 (coefficient correlation ~ -0.99999)."""
    rng = np.random.default_rng(0)
    x = rng.normal(66.0, 4.0, size=200) * 25.4 + 1e4
    y = 9.0 + 0.0023 * (x - 1e4) / 25.4 + 0.9 * rng.normal(size=200)
    return x, y


def t_posterior(x, y):
    """Exact marginal posterior of beta: multivariate t, nu = N - 3, scale RSS/nu (X'X)^-1."""
    X = np.stack([np.ones_like(x), x], 1)
    xtx = X.T @ X
    bhat = np.linalg.solve(xtx, X.T @ y)
    nu = len(y) - 3
    s2 = np.sum((y - X @ bhat) ** 2) / nu
    return bhat, np.sqrt(nu / (nu - 2) * s2 * np.diag(np.linalg.inv(xtx)))


def _run(model, guide, opt, steps, *args):
    svi = SVI(model, guide, opt, Trace_ELBO())
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        result = svi.run(jax.random.PRNGKey(0), steps, *args, progress_bar=False)
    return result, [str(w.message) for w in caught if "nb.BLR" in str(w.message)]


@pytest.mark.slow
@pytest.mark.parametrize("x64", [True, False], ids=["float64", "float32"])
def test_default_on_uncentred_predictor_matches_exact_posterior(uncentred_data, x64):
    """From NumPyro's random initialisation the first curvature estimates are ~1e10 times the
    posterior's; the default must still reach the exact mean (within 0.1 sd) and sd (0.9-1.1x)."""
    x, y = uncentred_data
    mean, sd = t_posterior(x, y)
    with jax.enable_x64(x64):
        guide = AutoMultivariateNormal(flat_regression)
        result, messages = _run(flat_regression, guide, nb.BLR(), 500, jnp.asarray(x), jnp.asarray(y))
        post = guide.get_posterior(result.params)
        fit_mean = np.asarray(post.loc[:2], np.float64)
        fit_sd = np.sqrt(np.sum(np.asarray(post.scale_tril, np.float64) ** 2, -1))[:2]
    # The Gaussian VI optimum differs from the t marginal by O(1/N) = 0.5% in the sds.
    assert np.all(np.abs(fit_mean - mean) / sd < 0.1), (fit_mean - mean) / sd
    assert np.all((fit_sd / sd > 0.9) & (fit_sd / sd < 1.1)), fit_sd / sd
    assert messages == []


@pytest.mark.slow
def test_unfinished_run_says_so_and_names_the_site(uncentred_data):
    x, y = uncentred_data
    with jax.enable_x64(True):
        result, messages = _run(flat_regression, AutoNormal(flat_regression), nb.BLR(), 12, jnp.asarray(x), jnp.asarray(y))
    assert any("has not converged after 12 steps" in m and "beta_auto_loc" in m and "init_state" in m for m in messages), messages
    report = nb.fit_report(result)
    assert "beta_auto_loc" in report.unconverged and not report.diverged


@pytest.mark.slow
def test_report_names_sites_inside_a_multivariate_guide(uncentred_data):
    x, y = uncentred_data
    with jax.enable_x64(True):
        guide = AutoMultivariateNormal(flat_regression)
        result, _ = _run(flat_regression, guide, nb.BLR(), 12, jnp.asarray(x), jnp.asarray(y))
        unconverged = nb.fit_report(result, guide=guide).unconverged
    assert unconverged and set(unconverged) <= {"beta", "sigma"}


def _linear_known_noise(X, y=None):
    w = numpyro.sample("w", dist.Normal(0.0, 10.0).expand([X.shape[1]]).to_event(1))
    numpyro.sample("y", dist.Normal(X @ w, 1.0), obs=y)


@pytest.mark.slow
def test_mean_field_guide_reaches_its_optimum_on_a_correlated_posterior():
    """Gaussian posterior with correlations 0.999: the mean-field optimum has the exact posterior
    mean and precision diag(P). A damped Jacobi mean step needs thousands of steps here; the
    default's mean step, preconditioned by the exact Hessian across the blocks, needs tens."""
    rng = np.random.default_rng(1)
    z = rng.normal(size=(100, 1))
    X = np.hstack([z + 0.03 * rng.normal(size=(100, 1)) for _ in range(4)] + [np.ones((100, 1))])
    y = X @ np.array([1.0, -2.0, 0.5, 1.5, 3.0]) + rng.normal(size=100)
    prec = X.T @ X + np.eye(5) / 100.0
    mean = np.linalg.solve(prec, X.T @ y)
    with jax.enable_x64(True):
        result, messages = _run(_linear_known_noise, AutoNormal(_linear_known_noise), nb.BLR(), 100, jnp.asarray(X), jnp.asarray(y))
    loc = np.asarray(result.params["w_auto_loc"])
    scale = np.asarray(result.params["w_auto_scale"])
    mf_sd = 1.0 / np.sqrt(np.diag(prec))
    np.testing.assert_allclose(loc, mean, atol=1e-3 * np.min(np.sqrt(np.diag(np.linalg.inv(prec)))))
    np.testing.assert_allclose(scale, mf_sd, rtol=1e-3)
    assert messages == []


def test_divergence_is_reported_with_the_fix():
    """Gradient descent with lr = 1 on a curvature of 11 multiplies the error by -10 per step."""

    def steep(y=None):
        numpyro.sample("x", dist.Normal(0.0, 0.3))

    guide = AutoNormal(steep, init_loc_fn=init_to_value(values={"x": 0.5}))
    result, messages = _run(steep, guide, nb.gradient_descent(lr=1.0), 8)
    assert nb.fit_report(result).diverged
    assert any("diverged" in m and "smaller lr" in m for m in messages), messages


def test_collapsed_variance_is_reported():
    """A log density with curvature 1e16 at x = 1 in float32: the posterior sd, 7e-9, is below the
    rounding level of the mean (1.2e-7), so the guide cannot represent it."""

    def needle():
        x = numpyro.sample("x", dist.Normal(0.0, 10.0))
        numpyro.factor("needle", -0.5e16 * (x - 1.0) ** 2)

    guide = AutoNormal(needle, init_loc_fn=init_to_value(values={"x": 1.0}))
    result, messages = _run(needle, guide, nb.BLR(), 30)
    report = nb.fit_report(result)
    assert report.collapsed == ["x_auto_scale"]
    assert any("collapsed" in m and "x_auto_scale" in m for m in messages), messages


def _needle_at(mean, sd):
    def needle():
        x = numpyro.sample("x", dist.Normal(0.0, 1.0))
        numpyro.factor("needle", -0.5 * ((x - mean) / sd) ** 2)

    return needle


@pytest.mark.slow  # two 30-step fits per guide: ~2-3 s
@pytest.mark.parametrize("guide_cls, optim, name", [(AutoNormal, nb.BLR, "nb.BLR"),
                                                    (nb.LieGroupGuide, nb.LieGroupBLR, "nb.LieGroupBLR")],
                         ids=["BLR", "LieGroupBLR"])
def test_a_small_sd_about_a_small_mean_is_not_a_collapse(guide_cls, optim, name):
    """The collapse check measures an sd against its mean's rounding level, not against 1: an sd of 5e-7 about a
    mean of 1e-3 (float32: the mean's rounding level is 1.2e-10; a coefficient of a predictor in the thousands, the
    robustness suite's sblri_X1e3) is a resolved posterior, and was reported as collapsed (the threshold was
    10 eps max(1, |m|) = 1.2e-6). An sd of 1e-11 about the same mean is below that level, and is reported."""
    for sd, collapsed in ((5e-7, False), (1e-11, True)):
        model = _needle_at(1e-3, sd)
        guide = guide_cls(model, init_loc_fn=init_to_value(values={"x": 1e-3}))
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            result = SVI(model, guide, optim(), Trace_ELBO()).run(jax.random.PRNGKey(0), 30, progress_bar=False)
        messages = [str(w.message) for w in caught if name in str(w.message)]
        scale = float(np.asarray(result.params[[k for k in result.params if k.endswith("_scale")][0]]))
        if collapsed:
            assert scale < 1e-8 and any("collapsed" in m for m in messages), (sd, scale, messages)
        else:  # the fit reached the posterior's sd, and nothing is reported
            assert abs(scale / sd - 1) < 0.05 and messages == [], (sd, scale, messages)


@pytest.mark.slow
@pytest.mark.parametrize("guide_cls, scale", [(AutoMultivariateNormal, "auto_scale_tril"), (AutoNormal, "w_auto_scale")])
def test_correlations_beyond_the_dtype_are_reported(guide_cls, scale):
    """Two predictors equal up to noise of sd 2e-5 (flat prior): the posterior's correlation matrix has condition
    number 7e9, 850 times float32's 1/eps = 8.4e6. In float32 the fit's sds along the pair come out
    wrong and nothing else in the run looks wrong: the report says so and what to change; in float64
    the same fit is within 5% of the exact posterior and says nothing.

    The condition number the report reads is the *fitted* guide's, and a float32 fit cannot carry
    correlations far beyond what its arithmetic resolves: it saturates at a value set by the backend's
    float32 arithmetic (its dot products' precision and summation order), not by the design. With the
    earlier design (noise 2e-4, condition number 9e7, ten times 1/eps) the fitted one was 2e8 on CPU but
    1.6e7 on an H200 with JAX's default precision, and below 8.4e6 (not reported) with
    ``jax_default_matmul_precision="highest"``; with this design it is 2.4e8-4e8 on CPU, 1e8-2.5e8 on the
    H200 and 2.4e7-3.8e7 there with "highest". So the design is far beyond float32 and the test asserts what the report checks,
    kappa * eps > ``ILL_CONDITIONED``, not a fixed kappa (a fixed 1e8 failed on the GPU)."""
    rng = np.random.default_rng(0)
    z = rng.normal(size=(200, 1))
    X = np.hstack([z, z + 2e-5 * rng.normal(size=(200, 1)), np.ones((200, 1))])
    y = X @ np.array([1.0, 1.0, 0.5]) + rng.normal(size=200)

    def model(X, y=None):
        w = numpyro.sample("w", dist.Normal(0.0, 1e4).expand([3]).to_event(1))
        numpyro.sample("y", dist.Normal(X @ w, 1.0), obs=y)

    exact_sd = np.sqrt(np.diag(np.linalg.inv(X.T @ X + np.eye(3) / 1e8)))
    result, messages = _run(model, guide_cls(model), nb.BLR(), 200, jnp.asarray(X, jnp.float32), jnp.asarray(y, jnp.float32))
    report = nb.fit_report(result)
    threshold = nb.report.ILL_CONDITIONED / np.finfo(np.float32).eps  # the report's own criterion, 8.4e6
    assert list(report.ill_conditioned) == [scale] and report.ill_conditioned[scale] > threshold
    assert any("ill-conditioned for float32" in m and scale in m and "enable_x64" in m for m in messages), messages
    # Whether the float32 run shows anything else depends on the host's float32 arithmetic: on the CPUs of earlier
    # CI machines this warning was the only sign of the failure; on a Xeon with AVX-512 FP16 and AMX (2026-11-28)
    # the same run's loss also jumps (AutoMultivariateNormal: 310 -> 4,198 at step 140, reported as a divergence;
    # AutoNormal: still falling at step 200). Those two are true of the run, so they are allowed, not required.
    assert all(any(k in m for k in ("ill-conditioned", "diverged", "not converged")) for m in messages), messages
    with jax.enable_x64(True):
        result, messages = _run(model, guide_cls(model), nb.BLR(), 200, jnp.asarray(X), jnp.asarray(y))
    assert nb.fit_report(result).ill_conditioned == {}
    assert not any("ill-conditioned" in m for m in messages), messages
    if guide_cls is AutoMultivariateNormal:  # the full Gaussian is the exact posterior here
        tril = np.asarray(result.params[scale])
        np.testing.assert_allclose(np.sqrt(np.diag(tril @ tril.T)), exact_sd, rtol=0.05)


def weibull_survival(X, t, event):
    """Weibull survival with right-censoring (times in days, about 400): (t / scale)^k overflows float32 from
    NumPyro's random initialisation."""
    b0 = numpyro.sample("b0", dist.Normal(0.0, 10.0))
    b = numpyro.sample("b", dist.Normal(0.0, 2.5).expand([X.shape[1]]).to_event(1))
    k = numpyro.sample("k", dist.Gamma(2.0, 1.0))
    scale = jnp.exp(b0 + X @ b)
    with numpyro.plate("n", X.shape[0]), numpyro.handlers.mask(mask=event > 0):
        numpyro.sample("t", dist.Weibull(scale, k), obs=t)
    numpyro.factor("censored", jnp.sum(jnp.where(event > 0, 0.0, -((t / scale) ** k))))


@pytest.mark.slow
def test_a_float32_overflow_is_reported_as_one_not_as_collinearity():
    """Found by bench/probe_families: the skipped steps' report names float32's range and a unit scale for the data,
    and the conditioning check, which then reads the precision of a fit that overflowed, does not send the user
    looking for collinear predictors. In float64 the same fit is clean."""
    rng = np.random.default_rng(505)
    X = rng.standard_normal((200, 3))
    t_event = np.exp(6.0 + X @ np.array([0.5, -0.3, 0.0])) * rng.weibull(1.5, size=200)
    t_censor = rng.uniform(50, 1200, size=200)
    t, event = np.minimum(t_event, t_censor), (t_event <= t_censor).astype(float)
    args = [jnp.asarray(v, jnp.float32) for v in (X, t, event)]
    result, messages = _run(weibull_survival, AutoMultivariateNormal(weibull_survival), nb.BLR(), 200, *args)
    assert int(result.state.optim_state[1].skipped) > 0
    skipped = [m for m in messages if "skipped" in m and "step count" in m]
    assert skipped and "In float32" in skipped[0] and "enable_x64" in skipped[0] and "unit scale" in skipped[0]
    assert not any("near-collinear" in m for m in messages), messages
    with jax.enable_x64(True):
        result, messages = _run(weibull_survival, AutoMultivariateNormal(weibull_survival), nb.BLR(), 200,
                                *[jnp.asarray(v) for v in (X, t, event)])
    assert int(result.state.optim_state[1].skipped) == 0 and not messages, messages


def test_skipped_steps_halve_the_step_size():
    def model(broken=False):
        x = numpyro.sample("x", dist.Normal(0.0, 1.0))
        if broken:
            numpyro.factor("nan", jnp.nan * x)

    svi = SVI(model, AutoNormal(model), nb.BLR(), Trace_ELBO())
    init_state = svi.init(jax.random.PRNGKey(0))  # a valid start, then the model breaks
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        result = svi.run(jax.random.PRNGKey(0), 4, broken=True, progress_bar=False, init_state=init_state)
    messages = [str(w.message) for w in caught]
    report = nb.fit_report(result)
    assert report.skipped_steps == 4 and report.halvings == 4
    # each skip halves the Gaussian blocks' rho (the clock jumps to 4c + 3 tau): 0.5, 0.25, 0.125, 0.0625
    assert report.step_size == pytest.approx(0.0625, rel=1e-6)
    assert any("halved 4 time(s)" in m for m in messages)


@pytest.mark.parametrize("lr, match", [
    (1.5, "outside"),
    (optax.linear_schedule(0.5, -0.1, 5000), "at step 4167"),
    (lambda t: jnp.where(t < 20_000, 0.5, jnp.inf), "at step 20000"),
    (optax.constant_schedule(2.0), "at step 0"),
])
def test_step_sizes_are_checked_before_the_run(lr, match):
    with pytest.raises(ValueError, match=match):
        nb.BLR(lr)


@pytest.mark.slow
def test_report_of_a_healthy_run_is_clean(uncentred_data):
    x, y = uncentred_data
    with jax.enable_x64(True):
        result, messages = _run(flat_regression, AutoNormal(flat_regression), nb.BLR(), 300, jnp.asarray(x), jnp.asarray(y))
    report = nb.fit_report(result)
    assert report.problems == [] and messages == []
    assert "no problem found" in str(report)
    with pytest.raises(TypeError, match="fit_report expects"):
        nb.fit_report({"auto_loc": 1})


def imputation_model(x, y=None):
    """NumPyro's missing-data idiom: obs_mask makes a latent 'x_unobserved' with one entry per row, whose entries
    at the observed rows have no density."""
    mu_x = numpyro.sample("mu_x", dist.Normal(0.0, 5.0))
    b = numpyro.sample("b", dist.Normal(0.0, 5.0))
    with numpyro.plate("n", x.shape[0]):
        xi = numpyro.sample("x", dist.Normal(mu_x, 1.0), obs=jnp.nan_to_num(x), obs_mask=~jnp.isnan(x))
        numpyro.sample("y", dist.Normal(b * xi, 0.5), obs=y)


@pytest.mark.slow
def test_coordinates_no_density_holds_are_reported_as_such():
    """Found trying NumPyro's imputation idiom: the guide's sds at the observed rows grew to 1e39 and the report said
    the loss was still falling and to average the curvature. It now names the site, how many coordinates, the
    cause and the fix, and leaves the still-falling message out; the rows with a density are fitted."""
    rng = np.random.default_rng(0)
    x = rng.normal(size=30)
    y = 2.0 * x + 0.5 * rng.normal(size=30)
    x[:6] = np.nan
    guide = AutoNormal(imputation_model)
    result, messages = _run(imputation_model, guide, nb.BLR(), 200, jnp.asarray(x), jnp.asarray(y))
    (message,) = messages
    assert "grows without bound in x_unobserved_auto_scale (24 of 30 coordinate(s)" in message, message
    assert "obs_mask" in message and "x.at[missing_rows].set(x_missing)" in message
    assert nb.fit_report(result).problem_keys == [("diffuse", "x_unobserved_auto_scale")]
    sd = np.asarray(result.params["x_unobserved_auto_scale"])
    assert np.all(sd[:6] < 1.0) and np.all(sd[6:] > 1e6)
