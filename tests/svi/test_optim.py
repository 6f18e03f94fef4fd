"""nb.BLR inside NumPyro's SVI: exactness, SVI features, guides, bad input."""

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import numpyro
import numpyro.distributions as dist
import optax
import pytest
from conftest import linear_model, logistic_model
from numpyro.infer import SVI, Predictive, Trace_ELBO
from numpyro.infer.autoguide import (
    AutoDelta,
    AutoDiagonalNormal,
    AutoLowRankMultivariateNormal,
    AutoMultivariateNormal,
    AutoNormal,
)

import numpyro_blr as nb

# ---------------------------------------------------------------- exactness (float64)


def _exact_linear_posterior(X, y, noise, prior_scale):
    prec = X.T @ X / noise**2 + np.eye(X.shape[1]) / prior_scale**2
    cov = np.linalg.inv(prec)
    return cov @ X.T @ y / noise**2, cov


@pytest.mark.slow
@pytest.mark.parametrize("guide_cls", [AutoMultivariateNormal, AutoDelta])
def test_newton_one_step_is_exact_on_linear_regression(diabetes_np, guide_cls):
    """One nb.newton(lr=1) step = the closed-form posterior (Gaussian linear model, known noise)."""
    X, y = diabetes_np
    noise, prior_scale = 0.7, 2.0
    mean, cov = _exact_linear_posterior(X, y, noise, prior_scale)
    with jax.enable_x64(True):
        guide = guide_cls(linear_model)
        svi = SVI(linear_model, guide, nb.newton(lr=1.0), Trace_ELBO())
        state = svi.init(jax.random.PRNGKey(0), jnp.asarray(X), jnp.asarray(y), noise, prior_scale)
        state, _ = jax.jit(svi.update, static_argnums=(3, 4))(state, jnp.asarray(X), jnp.asarray(y), noise, prior_scale)
        params = svi.get_params(state)
        if guide_cls is AutoMultivariateNormal:
            np.testing.assert_allclose(params["auto_loc"], mean, rtol=1e-5, atol=1e-8)
            tril = params["auto_scale_tril"]
            np.testing.assert_allclose(tril @ tril.T, cov, rtol=1e-5, atol=1e-10)
        else:  # the MAP of a Gaussian posterior is its mean; the precision lives in the optimizer state
            np.testing.assert_allclose(params["w_auto_loc"], mean, rtol=1e-5, atol=1e-8)
            blr_state = state.optim_state[1]
            np.testing.assert_allclose(np.linalg.inv(blr_state.algorithm.point_precision), cov, rtol=1e-5, atol=1e-10)


@pytest.mark.slow
def test_sampled_exact_hessian_is_exact_after_two_steps_on_quadratic_loss():
    """Exact Hessian at a sample, lr=1: step 1 sets S = H (constant for a quadratic loss); from then
    on the control variate S (z - m) cancels the sampling noise of the gradient exactly, so step 2
    lands on the posterior mean whatever the sample."""
    rng = np.random.default_rng(1)
    X = rng.normal(size=(40, 3))
    y = X @ np.array([0.5, -1.0, 2.0]) + rng.normal(size=40)
    mean, cov = _exact_linear_posterior(X, y, 1.0, 1.0)
    with jax.enable_x64(True):
        opt = nb.BLR(1.0, hessian="autodiff", improved=False)
        svi = SVI(linear_model, AutoMultivariateNormal(linear_model), opt, Trace_ELBO())
        state = svi.init(jax.random.PRNGKey(0), jnp.asarray(X), jnp.asarray(y))
        update = jax.jit(svi.update)
        for _ in range(2):
            state, _ = update(state, jnp.asarray(X), jnp.asarray(y))
        p = svi.get_params(state)
        np.testing.assert_allclose(p["auto_loc"], mean, rtol=1e-6)
        np.testing.assert_allclose(p["auto_scale_tril"] @ p["auto_scale_tril"].T, cov, rtol=1e-6)


# ---------------------------------------------------------------- SVI features


@pytest.fixture(scope="module")
def small_logistic():
    rng = np.random.default_rng(0)
    X = np.hstack([np.ones((60, 1)), rng.normal(size=(60, 2))])
    y = (rng.uniform(size=60) < 1 / (1 + np.exp(-X @ np.array([0.3, 1.0, -1.0])))).astype(np.float32)
    return jnp.asarray(X, jnp.float32), jnp.asarray(y)


@pytest.mark.slow
@pytest.mark.parametrize(
    "guide_cls, hessian",
    [(AutoNormal, None), (AutoMultivariateNormal, None), (AutoDiagonalNormal, "reparam"), (AutoMultivariateNormal, "price")],
)
def test_run_progress_bar_and_stable_update_agree(small_logistic, guide_cls, hessian):
    X, y = small_logistic
    results = []
    for progress_bar, stable in [(False, False), (True, False), (False, True)]:
        svi = SVI(logistic_model, guide_cls(logistic_model), nb.BLR(0.2, hessian=hessian), Trace_ELBO())
        results.append(svi.run(jax.random.PRNGKey(1), 30, X, y, progress_bar=progress_bar, stable_update=stable))
    for r in results[1:]:
        assert jnp.all(jnp.isfinite(r.losses))
        for k in results[0].params:
            # same key, same steps; float32 rounding differs between the scanned and the
            # step-by-step compiled programs and 30 noisy steps amplify it to ~1e-4
            np.testing.assert_allclose(r.params[k], results[0].params[k], rtol=2e-3, atol=1e-4)
    # the fit improved on the starting point
    assert results[0].losses[-5:].mean() < results[0].losses[:3].mean()


@pytest.mark.slow
def test_resume_through_init_state_equals_uninterrupted(small_logistic):
    X, y = small_logistic
    svi = SVI(logistic_model, AutoMultivariateNormal(logistic_model), nb.BLR(momentum=0.5), Trace_ELBO())
    full = svi.run(jax.random.PRNGKey(2), 40, X, y, progress_bar=False)
    first = svi.run(jax.random.PRNGKey(2), 25, X, y, progress_bar=False)
    rest = svi.run(jax.random.PRNGKey(99), 15, X, y, progress_bar=False, init_state=first.state)
    for k in full.params:
        np.testing.assert_allclose(rest.params[k], full.params[k], rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(jnp.concatenate([first.losses, rest.losses]), full.losses, rtol=1e-6)


@pytest.mark.slow
def test_predictive_and_sample_posterior(small_logistic):
    X, y = small_logistic
    guide = AutoMultivariateNormal(logistic_model)
    result = SVI(logistic_model, guide, nb.BLR(), Trace_ELBO()).run(jax.random.PRNGKey(0), 50, X, y, progress_bar=False)
    draws = guide.sample_posterior(jax.random.PRNGKey(1), result.params, sample_shape=(400,))
    assert draws["w"].shape == (400, 3)
    tril = result.params["auto_scale_tril"]
    # draws follow the guide: mean within 4 standard errors, sds within 15% (400 draws: rel. SE ~3.5%)
    sd = jnp.sqrt(jnp.sum(tril**2, axis=1))
    assert jnp.all(jnp.abs(draws["w"].mean(0) - result.params["auto_loc"]) < 4 * sd / 20)
    assert jnp.all(jnp.abs(draws["w"].std(0) / sd - 1) < 0.15)
    pred = Predictive(logistic_model, guide=guide, params=result.params, num_samples=100)(jax.random.PRNGKey(2), X)
    assert pred["y"].shape == (100, X.shape[0])
    accuracy = float(((pred["y"].mean(0) > 0.5) == (y > 0.5)).mean())
    assert accuracy > 0.7


@pytest.mark.slow
def test_autodelta_newton_reaches_map(small_logistic):
    """AutoDelta + Newton (delta method) vs numpyro's own BFGS (Minimize) on the same MAP problem."""
    X, y = small_logistic
    with jax.enable_x64(True):
        Xd, yd = X.astype(jnp.float64), y.astype(jnp.float64)
        ours = SVI(logistic_model, AutoDelta(logistic_model), nb.newton(), Trace_ELBO()).run(
            jax.random.PRNGKey(0), 15, Xd, yd, progress_bar=False
        )
        ref = SVI(logistic_model, AutoDelta(logistic_model), numpyro.optim.Minimize(), Trace_ELBO()).run(
            jax.random.PRNGKey(0), 1, Xd, yd, progress_bar=False
        )
        np.testing.assert_allclose(ours.params["w_auto_loc"], ref.params["w_auto_loc"], rtol=1e-5, atol=1e-6)


@pytest.mark.slow
def test_laplace_preset_matches_numpyro_laplace(small_logistic):
    """nb.laplace on AutoMultivariateNormal = mode by BFGS + covariance from AutoLaplaceApproximation."""
    from numpyro.infer.autoguide import AutoLaplaceApproximation

    X, y = small_logistic
    with jax.enable_x64(True):
        Xd, yd = X.astype(jnp.float64), y.astype(jnp.float64)
        ours = SVI(logistic_model, AutoMultivariateNormal(logistic_model), nb.laplace(), Trace_ELBO()).run(
            jax.random.PRNGKey(0), 15, Xd, yd, progress_bar=False
        )
        lap = AutoLaplaceApproximation(logistic_model)
        ref = SVI(logistic_model, lap, numpyro.optim.Minimize(), Trace_ELBO()).run(
            jax.random.PRNGKey(0), 1, Xd, yd, progress_bar=False
        )
        post = lap.get_posterior(ref.params)
        np.testing.assert_allclose(ours.params["auto_loc"], post.loc, rtol=1e-5, atol=1e-6)
        tril = ours.params["auto_scale_tril"]
        np.testing.assert_allclose(tril @ tril.T, post.covariance_matrix, rtol=1e-4, atol=1e-8)


@pytest.mark.slow
def test_fallback_optimizer_for_model_params(small_logistic):
    X, y = small_logistic

    def model(X, y=None):
        bias = numpyro.param("bias", 0.0)
        w = numpyro.sample("w", dist.Normal(0, 1).expand([X.shape[1]]).to_event(1))
        numpyro.sample("y", dist.Bernoulli(logits=X @ w + bias), obs=y)

    with pytest.raises(nb.GuideLayoutError, match="'bias'"):
        SVI(model, AutoNormal(model), nb.BLR(), Trace_ELBO()).init(jax.random.PRNGKey(0), X, y)
    svi = SVI(model, AutoNormal(model), nb.BLR(fallback=optax.adam(0.05)), Trace_ELBO())
    result = svi.run(jax.random.PRNGKey(0), 30, X, y, progress_bar=False)
    assert result.params["bias"] != 0.0 and jnp.isfinite(result.params["bias"])


# ---------------------------------------------------------------- bad input


@pytest.mark.parametrize("lr", [0.0, -1.0, float("nan"), float("inf"), "0.1", True, type(None), lambda t: -0.1])
def test_invalid_lr(lr):
    with pytest.raises(ValueError, match="lr"):
        nb.BLR(lr)


@pytest.mark.parametrize("kwargs, match", [
    ({"hessian": "bogus"}, "hessian"),
    ({"momentum": 1.0}, "momentum"),
    ({"momentum": -0.1}, "momentum"),
    ({"delta": True, "hessian": "reparam"}, "delta"),
    ({"fallback": "adam"}, "fallback"),
    ({"init_precision": 0.0}, "init_precision"),
])
def test_invalid_hyperparameters(kwargs, match):
    with pytest.raises(ValueError, match=match):
        nb.BLR(0.1, **kwargs)


@pytest.mark.slow
def test_unreadable_guide_names_parameters(small_logistic):
    X, y = small_logistic
    for optim in (nb.BLR(), nb.BLR(fallback=optax.adam(1e-2))):  # a fallback does not take the covariance over
        svi = SVI(logistic_model, AutoLowRankMultivariateNormal(logistic_model), optim, Trace_ELBO())
        with pytest.raises(nb.GuideLayoutError, match="auto_cov_factor.*fit this guide with an optax optimizer"):
            svi.init(jax.random.PRNGKey(0), X, y)


def test_update_without_loss_is_rejected():
    opt = nb.BLR()
    state = opt.init({"auto_loc": jnp.zeros(2), "auto_scale": jnp.ones(2)})
    with pytest.raises(TypeError, match="loss function"):
        opt.update({"auto_loc": jnp.zeros(2), "auto_scale": jnp.zeros(2)}, state)


def _nan_model(X, y=None, broken=False):
    w = numpyro.sample("w", dist.Normal(0, 1).expand([X.shape[1]]).to_event(1))
    if broken:
        numpyro.factor("broken", jnp.nan * jnp.sum(w))  # a log density that is NaN everywhere
    numpyro.sample("y", dist.Bernoulli(logits=X @ w), obs=y)


@pytest.mark.slow
def test_nonfinite_step_is_skipped_and_reported(small_logistic):
    """A NaN log density makes every loss and gradient non-finite: no step may write NaN params."""
    X, y = small_logistic
    svi = SVI(_nan_model, AutoNormal(_nan_model), nb.BLR(), Trace_ELBO())
    init_state = svi.init(jax.random.PRNGKey(0), X, y)  # a valid start, then the model breaks
    init_params = svi.get_params(init_state)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        result = svi.run(jax.random.PRNGKey(0), 5, X, y, broken=True, progress_bar=False, init_state=init_state)
        jax.effects_barrier()
    assert not jnp.any(jnp.isfinite(result.losses))
    for k, v in result.params.items():  # every step skipped: the initial (finite) values are kept
        np.testing.assert_array_equal(v, init_params[k])
    assert nb.nonfinite_parameters(result.state) == ["w_auto_loc", "w_auto_scale"]
    assert int(result.state.optim_state[1].skipped) == 5
    assert any("kept none of its 5 steps" in str(w.message) and "w_auto_loc" in str(w.message) for w in caught)
    with warnings.catch_warnings(record=True) as again:  # reading params changes nothing: Python's
        warnings.simplefilter("default")  # default filter shows the message once, however often it is read
        for _ in range(3):
            svi.get_params(result.state)
    assert sum("non-finite" in str(w.message) for w in again) == 1
    # stable_update: the steps are skipped and the whole state kept, as NumPyro does
    stable = svi.run(jax.random.PRNGKey(0), 5, X, y, broken=True, progress_bar=False, stable_update=True, init_state=init_state)
    for k, v in stable.params.items():
        np.testing.assert_array_equal(v, init_params[k])
    assert int(stable.state.optim_state[0]) == 0


@pytest.mark.slow
def test_guide_with_custom_scale_constraint(small_logistic):
    """A guide whose scales go through exp (constraints.positive): BLR reads it from guide=..."""
    from numpyro.distributions import constraints

    class ExpScaleNormal(AutoNormal):
        scale_constraint = constraints.positive

    X, y = small_logistic
    results = {}
    for cls in (AutoNormal, ExpScaleNormal):
        guide = cls(logistic_model)
        svi = SVI(logistic_model, guide, nb.BLR(0.3, guide=guide), Trace_ELBO())
        results[cls] = svi.run(jax.random.PRNGKey(0), 10, X, y, progress_bar=False).params
    # the same algorithm whatever the parameterisation of the scale
    np.testing.assert_allclose(results[ExpScaleNormal]["w_auto_loc"], results[AutoNormal]["w_auto_loc"], rtol=1e-3, atol=1e-4)
    np.testing.assert_allclose(results[ExpScaleNormal]["w_auto_scale"], results[AutoNormal]["w_auto_scale"], rtol=1e-3)
