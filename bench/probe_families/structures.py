"""A third set of probe models: structures NumPyro users write that neither bench/robustness_cases.py nor
models.py has (an LKJ correlation, crossed two-dimensional plates, ``scan``, a Gaussian-process marginal likelihood,
Beta and Gamma likelihoods, predictors in raw units).

Same layout as models.py: SPECS name -> dict(model, data, nuts, note[, ref_model, ref_map]); ``python runner.py --set
structures ref|fit64|fit32|eval``. Data: scikit-learn's diabetes (raw units) or seeded synthetic data.
"""
import numpy as np
import jax
import jax.numpy as jnp
import numpyro
import numpyro.distributions as dist
from numpyro.contrib.control_flow import scan

import models  # bench/probe_families/models.py (the runner puts this folder on the path)


def _std(X):
    return (X - X.mean(0)) / X.std(0)


# ---------------------------------------------------------------------------------------------------------------
# 1. correlated varying intercepts and slopes with an LKJ prior (sleepstudy-like, reaction times in ms, raw units)
# ---------------------------------------------------------------------------------------------------------------
def lkj_varying_slopes(days, subject, n_subjects, y=None):
    mu = numpyro.sample("mu", dist.Normal(jnp.array([250.0, 10.0]), jnp.array([50.0, 10.0])).to_event(1))
    tau = numpyro.sample("tau", dist.HalfNormal(jnp.array([50.0, 10.0])).to_event(1))
    L = numpyro.sample("L_omega", dist.LKJCholesky(2, 2.0))
    numpyro.deterministic("omega", L @ L.T)
    sigma = numpyro.sample("sigma", dist.HalfNormal(50.0))
    with numpyro.plate("subjects", n_subjects):
        z = numpyro.sample("z", dist.Normal(0.0, 1.0).expand([2]).to_event(1))
    b = mu + tau * (z @ L.T)
    eta = b[subject, 0] + b[subject, 1] * days
    with numpyro.plate("N", days.shape[0]):
        numpyro.sample("y", dist.Normal(eta, sigma), obs=y)


def _sleep_data():
    rng = np.random.default_rng(2024)
    n_subjects, n_days = 18, 10
    subject = np.repeat(np.arange(n_subjects), n_days).astype(np.int32)
    days = np.tile(np.arange(n_days, dtype=np.float64), n_subjects)
    cov = np.array([[25.0**2, 0.1 * 25 * 6], [0.1 * 25 * 6, 6.0**2]])
    b = np.array([251.0, 10.5]) + rng.multivariate_normal(np.zeros(2), cov, n_subjects)
    y = b[subject, 0] + b[subject, 1] * days + 25.0 * rng.standard_normal(subject.size)
    return (days, subject, n_subjects), {"y": y}


# ---------------------------------------------------------------------------------------------------------------
# 2. two-parameter item response model: persons x items in crossed plates (dim -2 and -1), centred item effects
# ---------------------------------------------------------------------------------------------------------------
def irt_2pl(n_persons, n_items, y=None):
    mu_b = numpyro.sample("mu_b", dist.Normal(0.0, 2.0))
    sigma_b = numpyro.sample("sigma_b", dist.HalfNormal(2.0))
    sigma_a = numpyro.sample("sigma_a", dist.HalfNormal(1.0))
    persons = numpyro.plate("persons", n_persons, dim=-2)
    items = numpyro.plate("items", n_items, dim=-1)
    with items:
        b = numpyro.sample("b", dist.Normal(mu_b, sigma_b))
        log_a = numpyro.sample("log_a", dist.Normal(0.0, sigma_a))
    with persons:
        theta = numpyro.sample("theta", dist.Normal(0.0, 1.0))
    with persons, items:
        numpyro.sample("y", dist.Bernoulli(logits=jnp.exp(log_a) * (theta - b)), obs=y)


def _irt_noncentered(n_persons, n_items, y=None):
    mu_b = numpyro.sample("mu_b", dist.Normal(0.0, 2.0))
    sigma_b = numpyro.sample("sigma_b", dist.HalfNormal(2.0))
    sigma_a = numpyro.sample("sigma_a", dist.HalfNormal(1.0))
    with numpyro.plate("items", n_items, dim=-1):
        b_raw = numpyro.sample("b_raw", dist.Normal(0.0, 1.0))
        a_raw = numpyro.sample("a_raw", dist.Normal(0.0, 1.0))
    with numpyro.plate("persons", n_persons, dim=-2):
        theta = numpyro.sample("theta", dist.Normal(0.0, 1.0))
    b, log_a = mu_b + sigma_b * b_raw, sigma_a * a_raw
    with numpyro.plate("persons", n_persons, dim=-2), numpyro.plate("items", n_items, dim=-1):
        numpyro.sample("y", dist.Bernoulli(logits=jnp.exp(log_a) * (theta - b)), obs=y)


def _irt_map(s):
    return dict(s, b=s["mu_b"][..., None] + s["sigma_b"][..., None] * s["b_raw"], log_a=s["sigma_a"][..., None] * s["a_raw"])


def _irt_data():
    rng = np.random.default_rng(31)
    P, I = 100, 10
    theta = rng.standard_normal((P, 1))
    b = rng.normal(0.3, 1.0, I)
    a = np.exp(rng.normal(0.0, 0.3, I))
    y = (rng.random((P, I)) < 1 / (1 + np.exp(-a * (theta - b)))).astype(np.float64)
    return (P, I), {"y": y}


# ---------------------------------------------------------------------------------------------------------------
# 3. local-level state-space model written with numpyro.contrib.control_flow.scan (a centred random walk)
# ---------------------------------------------------------------------------------------------------------------
def local_level(y):
    sigma_obs = numpyro.sample("sigma_obs", dist.HalfNormal(1.0))
    sigma_level = numpyro.sample("sigma_level", dist.HalfNormal(0.5))
    x0 = numpyro.sample("x0", dist.Normal(0.0, 5.0))

    def transition(x_prev, y_t):
        x = numpyro.sample("x", dist.Normal(x_prev, sigma_level))
        numpyro.sample("y", dist.Normal(x, sigma_obs), obs=y_t)
        return x, None

    scan(transition, x0, y)


def _local_level_noncentered(y):
    sigma_obs = numpyro.sample("sigma_obs", dist.HalfNormal(1.0))
    sigma_level = numpyro.sample("sigma_level", dist.HalfNormal(0.5))
    x0 = numpyro.sample("x0", dist.Normal(0.0, 5.0))
    with numpyro.plate("T", y.shape[0]):
        e = numpyro.sample("e", dist.Normal(0.0, 1.0))
    x = x0 + jnp.cumsum(sigma_level * e)
    with numpyro.plate("T", y.shape[0]):
        numpyro.sample("y", dist.Normal(x, sigma_obs), obs=y)


def _local_level_map(s):
    return dict(s, x=s["x0"][..., None] + np.cumsum(s["sigma_level"][..., None] * s["e"], axis=-1))


def _local_level_data():
    rng = np.random.default_rng(41)
    T = 100
    level = 1.0 + np.cumsum(0.2 * rng.standard_normal(T))
    y = level + 0.5 * rng.standard_normal(T)
    return (y,), {}


# ---------------------------------------------------------------------------------------------------------------
# 4. Gaussian-process regression through its marginal likelihood (three positive hyperparameters)
# ---------------------------------------------------------------------------------------------------------------
def gp_marginal(x, y=None):
    lengthscale = numpyro.sample("lengthscale", dist.InverseGamma(5.0, 5.0))
    amplitude = numpyro.sample("amplitude", dist.HalfNormal(1.0))
    noise = numpyro.sample("noise", dist.HalfNormal(1.0))
    d2 = (x[:, None] - x[None, :]) ** 2
    k = amplitude**2 * jnp.exp(-0.5 * d2 / lengthscale**2) + (noise**2 + 1e-6) * jnp.eye(x.shape[0])
    numpyro.sample("y", dist.MultivariateNormal(jnp.zeros(x.shape[0]), covariance_matrix=k), obs=y)


def _gp_marginal_data():
    rng = np.random.default_rng(51)
    x = np.sort(rng.uniform(0.0, 10.0, 50))
    y = np.sin(x) + 0.3 * rng.standard_normal(50)
    return (x,), {"y": y}


# ---------------------------------------------------------------------------------------------------------------
# 5. Beta regression of proportions (mean-precision parametrisation, logit link)
# ---------------------------------------------------------------------------------------------------------------
def beta_regression(X, y=None):
    alpha = numpyro.sample("alpha", dist.Normal(0.0, 2.0))
    beta = numpyro.sample("beta", dist.Normal(0.0, 1.0).expand([X.shape[1]]).to_event(1))
    phi = numpyro.sample("phi", dist.Gamma(2.0, 0.1))
    mu = jax.nn.sigmoid(alpha + X @ beta)
    with numpyro.plate("N", X.shape[0]):
        numpyro.sample("y", dist.Beta(mu * phi, (1.0 - mu) * phi), obs=y)


def _beta_data():
    rng = np.random.default_rng(61)
    n = 150
    X = rng.standard_normal((n, 3))
    mu = 1 / (1 + np.exp(-(-0.5 + X @ np.array([0.8, -0.4, 0.0]))))
    y = rng.beta(mu * 30.0, (1 - mu) * 30.0)
    return (X,), {"y": np.clip(y, 1e-4, 1 - 1e-4)}


# ---------------------------------------------------------------------------------------------------------------
# 6. Gamma GLM with a log link on scikit-learn's diabetes data in raw units (age in years, BMI, blood pressure in
#    mm Hg, total cholesterol in mg/dl): uncentred predictors of very different scales, an unknown shape
# ---------------------------------------------------------------------------------------------------------------
def gamma_glm_raw(X, y=None):
    alpha = numpyro.sample("alpha", dist.Normal(0.0, 5.0))
    beta = numpyro.sample("beta", dist.Normal(0.0, 1.0).expand([X.shape[1]]).to_event(1))
    shape = numpyro.sample("shape", dist.Gamma(2.0, 0.5))
    mean = numpyro.deterministic("mean", jnp.exp(alpha + X @ beta))
    with numpyro.plate("N", X.shape[0]):
        numpyro.sample("y", dist.Gamma(shape, shape / mean), obs=y)


def _gamma_data():
    from sklearn.datasets import load_diabetes

    X, y = load_diabetes(return_X_y=True, scaled=False)
    return (np.asarray(X[:, [0, 2, 3, 4]], np.float64),), {"y": np.asarray(y, np.float64)}


SPECS = {
    "lkj_varying_slopes": dict(model=lkj_varying_slopes, data=_sleep_data, nuts=dict(target_accept_prob=0.95),
                               note="synthetic sleepstudy-like, 18 subjects x 10 days, reaction times in ms (raw), "
                                    "LKJCholesky(2, 2) correlation, non-centred subject effects"),
    "irt_2pl": dict(model=irt_2pl, data=_irt_data, nuts=dict(target_accept_prob=0.95), ref_model=_irt_noncentered,
                    ref_map=_irt_map,
                    note="synthetic 100 persons x 10 items in crossed plates (dims -2, -1), centred item effects; "
                         "NUTS on the non-centred model"),
    "local_level_scan": dict(model=local_level, data=_local_level_data, nuts=dict(target_accept_prob=0.95),
                             ref_model=_local_level_noncentered, ref_map=_local_level_map,
                             note="synthetic T=100 local level, written with numpyro.contrib.control_flow.scan, "
                                  "centred random walk; NUTS on the non-centred one (a cumulative sum)"),
    "gp_marginal": dict(model=gp_marginal, data=_gp_marginal_data, nuts=dict(),
                        note="synthetic n=50 sin(x) + N(0, 0.3^2), squared-exponential kernel, marginal likelihood"),
    "beta_regression": dict(model=beta_regression, data=_beta_data, nuts=dict(),
                            note="synthetic n=150 proportions, 3 predictors, precision 30"),
    "gamma_glm_raw": dict(model=gamma_glm_raw, data=_gamma_data, nuts=dict(target_accept_prob=0.9),
                          note="sklearn diabetes in raw units (age, BMI, blood pressure, cholesterol; n=442), Gamma "
                               "GLM with log link and unknown shape"),
}


def get_data(name, float32=False):
    return models.get_data(name, float32, specs=SPECS)
