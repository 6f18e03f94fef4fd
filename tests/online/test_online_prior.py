"""The posterior as the next prior (issue 27, item 1): ``nb.online.as_prior``, ``with_prior`` and ``Stream``.

References: the closed-form batch posterior of Bayesian linear regression (exact to rounding after 10 batches,
by conjugate updates and by Newton's method, ``rho = 1``), the Gamma-Poisson closed form, and the one-batch fit
of a logistic regression (the sequential fit differs from it by the Gaussian projection error of each batch,
which the stream measures and reports).
"""

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import numpyro
import numpyro.distributions as dist
import pytest
from numpyro import handlers
from numpyro.infer.autoguide import AutoDelta, AutoMultivariateNormal, AutoNormal
from numpyro.infer.util import log_density

import numpyro_blr as nb
from numpyro_blr import online
from conftest import count_compiles


@pytest.fixture(autouse=True)
def x64():
    with jax.enable_x64(True):
        yield


# -- Bayesian linear regression: one Gaussian block, known noise ------------------------------------------
D, SIGMA, PRIOR_SD = 4, 0.5, 2.0


def linreg(X, y=None):
    w = numpyro.sample("w", dist.Normal(0.0, PRIOR_SD).expand([D]).to_event(1))
    numpyro.sample("y", dist.Normal(X @ w, SIGMA), obs=y)


def linreg_data(n=200, seed=0):
    rng = np.random.default_rng(seed)
    X = np.c_[rng.normal(size=(n, D - 1)), np.ones(n)]
    y = X @ np.array([1.0, -2.0, 0.5, 0.3]) + SIGMA * rng.normal(size=n)
    return X, y


def linreg_posterior(X, y):
    precision = np.eye(D) / PRIOR_SD**2 + X.T @ X / SIGMA**2
    cov = np.linalg.inv(precision)
    return cov @ (X.T @ y / SIGMA**2), cov


def batches(X, y, k):
    return [(jnp.asarray(a), jnp.asarray(b)) for a, b in zip(np.array_split(X, k), np.array_split(y, k))]


@pytest.mark.slow
def test_conjugate_stream_equals_batch_posterior():
    X, y = linreg_data()
    mean, cov = linreg_posterior(X, y)
    stream = online.Stream(linreg, "conjugate", num_steps=1)
    for xb, yb in batches(X, y, 10):
        stream.update(xb, yb)
    post = stream.prior.distributions["w"]
    np.testing.assert_allclose(post.loc, mean, rtol=0, atol=1e-10)
    np.testing.assert_allclose(post.covariance_matrix, cov, rtol=0, atol=1e-10)
    assert stream.num_batches == 10 and all(r.method == "conjugate" for r in stream.reports)


@pytest.mark.slow
def test_newton_stream_equals_batch_posterior_and_reports_no_projection_error():
    """Full-Gaussian guide, delta method with the exact Hessian, lr = 1: each batch's log joint is quadratic, so
    one step is exact Bayes and the stream ends at the batch posterior."""
    X, y = linreg_data()
    mean, cov = linreg_posterior(X, y)
    stream = online.Stream(linreg, AutoMultivariateNormal, optim=nb.newton(), num_steps=10, num_check_samples=200)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # 10 steps: "too short to judge" (it converged in 1)
        for xb, yb in batches(X, y, 10):
            stream.update(xb, yb)
    prior = stream.prior
    assert prior.full and [s.name for s in prior.gaussian_sites] == ["w"]
    np.testing.assert_allclose(prior.loc, mean, rtol=0, atol=1e-10)
    np.testing.assert_allclose(prior.scale_tril @ prior.scale_tril.T, cov, rtol=0, atol=1e-10)
    # the importance ratios of an exact fit are constant: no projection error
    assert all(abs(r.projection_gap) < 1e-8 for r in stream.reports)


@pytest.mark.slow
def test_stream_compiles_once_per_batch_size():
    X, y = linreg_data(n=230)
    parts = [(X[:50], y[:50]), (X[50:100], y[50:100]), (X[100:150], y[100:150]), (X[150:180], y[150:180]),
             (X[180:210], y[180:210]), (X[210:230], y[210:230])]
    stream = online.Stream(linreg, AutoNormal, optim=nb.newton(), num_steps=10, num_check_samples=100)
    counts = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        warnings.simplefilter("ignore", UserWarning)  # AutoNormal on a correlated posterior, k-hat from 100 draws
        for xb, yb in parts[:3] + parts[3:5] + [parts[1]]:
            with count_compiles() as c:
                stream.update(jnp.asarray(xb), jnp.asarray(yb))
            counts.append(c["compile"])
    # batch 0: the model's own prior; batch 1: the first with a prior (size 50); batch 2: size 50 again: nothing;
    # batch 3: size 30, compiled once; batch 4: size 30 again, and batch 5: size 50 again: nothing
    assert counts[0] > 0 and counts[1] > 0 and counts[3] > 0
    assert counts[2] == 0 and counts[4] == 0 and counts[5] == 0, counts


# -- the prior's density: what replaces the model's prior is the guide's q -------------------------------------
def scales_model(y=None):
    mu = numpyro.sample("mu", dist.Normal(0.0, 10.0))
    sigma = numpyro.sample("sigma", dist.HalfNormal(5.0))
    with numpyro.plate("groups", 3):
        theta = numpyro.sample("theta", dist.Normal(mu, sigma))
    with numpyro.plate("obs", 6):
        numpyro.sample("y", dist.Normal(jnp.repeat(theta, 2), 1.0), obs=y)


Y6 = np.array([0.3, 1.1, 2.5, 2.0, -0.4, 0.1])


@pytest.mark.parametrize("guide_class", [AutoNormal, AutoMultivariateNormal])
@pytest.mark.slow
def test_prior_density_is_the_guides_density(guide_class):
    """With the likelihood blocked, the model with the prior has log density log q(theta) at any theta: the
    guide's density of the constrained values (a positive site through its Jacobian, plates included)."""
    guide = guide_class(scales_model)
    result = nb.fit(scales_model, guide, Y6, num_steps=300, progress_bar=False)
    prior = online.as_prior(guide, result.params)
    assert set(prior.sites) == {"mu", "sigma", "theta"}
    prior_only = handlers.block(online.with_prior(scales_model, prior), hide=["y"])
    for seed in range(3):
        log_q, tr = log_density(handlers.seed(guide, seed), (Y6,), {}, result.params)
        values = {n: s["value"] for n, s in tr.items() if n in ("mu", "sigma", "theta")}
        log_p, _ = log_density(handlers.condition(prior_only, values), (Y6,), {}, {})
        np.testing.assert_allclose(log_p, log_q, rtol=1e-10, atol=1e-10)


@pytest.mark.slow
def test_expfam_guide_prior_and_gamma_poisson_stream():
    """A Gamma site's fitted distribution becomes its prior; the conjugate stream of a Gamma-Poisson model equals
    the closed-form posterior Gamma(a + sum y, b + n)."""

    def poisson(y=None):
        rate = numpyro.sample("rate", dist.Gamma(2.0, 1.0))
        with numpyro.plate("n", y.shape[0]):
            numpyro.sample("y", dist.Poisson(rate), obs=y)

    y = np.random.default_rng(3).poisson(4.0, size=60).astype(float)
    stream = online.Stream(poisson, "conjugate", num_steps=1)
    for part in np.array_split(y, 6):
        stream.update(jnp.asarray(part))
    post = stream.prior.distributions["rate"]
    assert isinstance(post, dist.Gamma)
    np.testing.assert_allclose([post.concentration, post.rate], [2.0 + y.sum(), 1.0 + y.size], rtol=1e-10)

    guide = nb.ExpFamilyGuide(poisson)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        result = nb.fit(poisson, guide, jnp.asarray(y[:10]), num_steps=200, progress_bar=False)
    prior = online.as_prior(guide, result.params)
    assert isinstance(prior.distributions["rate"], dist.Gamma) and prior.gaussian_sites == ()
    replaced = handlers.trace(handlers.seed(online.with_prior(poisson, prior), 0)).get_trace(jnp.asarray(y[10:20]))
    assert replaced["rate"]["fn"] is prior.distributions["rate"]


# -- logistic regression: the Gaussian projection error -----------------------------------------------------
def logistic(X, y=None):
    w = numpyro.sample("w", dist.Normal(0.0, 2.0).expand([X.shape[1]]).to_event(1))
    b = numpyro.sample("b", dist.Normal(0.0, 2.0))
    numpyro.sample("y", dist.Bernoulli(logits=X @ w + b), obs=y)


@pytest.mark.slow
def test_logistic_stream_ends_near_the_one_batch_fit():
    """10 batches of 200: the stream's Gaussian ends within 0.1 posterior sd (and 5% in sd) of the one-batch fit
    (nb.BLR() default, AutoMultivariateNormal). The one-batch fits of different seeds agree to about 0.01 sd
    (Monte Carlo error), so the rest is the projection error of the batches, which each report measures."""
    rng = np.random.default_rng(1)
    X = rng.normal(size=(2000, 4))
    y = (rng.uniform(size=2000) < 1 / (1 + np.exp(-(X @ np.array([1.5, -1.0, 0.5, 0.0]) + 0.3)))).astype(float)
    guide = AutoMultivariateNormal(logistic)
    one = online.as_prior(guide, nb.fit(logistic, guide, jnp.asarray(X), jnp.asarray(y), num_steps=500,
                                        progress_bar=False).params)
    stream = online.Stream(logistic, AutoMultivariateNormal, num_steps=500, num_check_samples=1000)
    for xb, yb in batches(X, y, 10):
        stream.update(xb, yb)
    sd = np.sqrt(np.diag(one.scale_tril @ one.scale_tril.T))
    sd_stream = np.sqrt(np.diag(stream.prior.scale_tril @ stream.prior.scale_tril.T))
    assert np.max(np.abs(stream.prior.loc - one.loc) / sd) < 0.1
    np.testing.assert_allclose(sd_stream / sd, 1.0, atol=0.05)
    gaps = np.array([r.projection_gap for r in stream.reports])
    assert np.all(np.isfinite(gaps)) and np.all(gaps >= 0) and gaps[0] > 0  # measured, not assumed zero
    assert "projection error" in str(stream.reports[0])


# -- bad input -----------------------------------------------------------------------------------------
def other_model(X, y=None):
    beta = numpyro.sample("beta", dist.Normal(0.0, 1.0).expand([D]).to_event(1))
    numpyro.sample("y", dist.Normal(X @ beta, SIGMA), obs=y)


@pytest.mark.slow
def test_errors_name_the_site():
    X, y = linreg_data(n=20)
    guide = AutoNormal(linreg)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        result = nb.fit(linreg, guide, X, y, num_steps=5, optim=nb.newton(), progress_bar=False)
    prior = online.as_prior(guide, result.params)
    # a guide of another model: the prior names a site the model does not sample
    with pytest.raises(online.PriorError, match="'w'.*does not sample"):
        handlers.seed(online.with_prior(other_model, prior), 0)(X, y)
    # a prior whose support does not fit the site
    bad = online.as_prior({"w": dist.Gamma(jnp.ones(D), 1.0).to_event(1)})
    with pytest.raises(online.PriorError, match="site 'w' has support"):
        handlers.seed(online.with_prior(linreg, bad), 0)(X, y)
    # a prior of another shape
    short = online.as_prior({"w": dist.Normal(jnp.zeros(D - 1), 1.0).to_event(1)})
    with pytest.raises(online.PriorError, match="site 'w' has shape"):
        handlers.seed(online.with_prior(linreg, short), 0)(X, y)
    # a prior for an observed site
    with pytest.raises(online.PriorError, match="'y', which is observed"):
        handlers.seed(online.with_prior(linreg, {"y": dist.Normal(jnp.zeros(20), 1.0).to_event(1)}), 0)(X, y)
    # a guide built on another model, given to a stream
    with pytest.raises(online.PriorError, match="built on"):
        online.Stream(linreg, AutoNormal(other_model))
    # point estimates have no spread
    with pytest.raises(online.PriorError, match="point estimate"):
        online.as_prior(AutoDelta(linreg), {})
    with pytest.raises(TypeError, match="params"):
        online.as_prior(guide)
    # NaN in a batch: the argument is named (nb.fit's data check)
    stream = online.Stream(linreg, AutoNormal, optim=nb.newton(), num_steps=5)
    y_bad = np.array(y)
    y_bad[3] = np.nan
    with pytest.raises(ValueError, match="'y'"):
        stream.update(jnp.asarray(X), jnp.asarray(y_bad))


@pytest.mark.slow
def test_stream_from_a_guide_instance_keeps_its_options():
    X, y = linreg_data(n=40)
    guide = AutoNormal(linreg, init_scale=0.05)
    stream = online.Stream(linreg, guide, optim=nb.newton(), num_steps=5, check=False)
    assert stream.guide is not guide and stream.guide._init_scale == 0.05
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        for xb, yb in batches(X, y, 2):
            stream.update(xb, yb)
    assert not stream.prior.full and stream.num_batches == 2
    assert np.all(np.isfinite(stream.prior.loc)) and np.all(stream.prior.scale > 0)
