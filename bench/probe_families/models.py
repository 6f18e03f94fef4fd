"""Eight NumPyro models of families the robustness suite (bench/robustness_cases.py) lacks.

Each entry of SPECS: name -> dict(model, data() -> (args, kwargs), nuts=dict(...), ref_model/ref_map (optional:
NUTS on an equivalent reparameterised model, mapped to the model's sites), note).
Data: scikit-learn datasets or seeded synthetic data; nothing downloaded.
This module does not import numpyro_blr and does not set the precision (the runner does).
"""
import numpy as np
import jax.numpy as jnp
import numpyro
import numpyro.distributions as dist
from numpyro import handlers
from numpyro.distributions import constraints


def _std(X):
    return (X - X.mean(0)) / X.std(0)


# ---------------------------------------------------------------------------------------------------------------
# 1. regularised horseshoe linear regression (Piironen & Vehtari 2017), non-centred, as NumPyro's / Stan's examples
# ---------------------------------------------------------------------------------------------------------------
def reg_horseshoe(X, y=None, tau0=0.01, slab_scale=2.0, slab_df=4.0):
    n, D = X.shape
    alpha = numpyro.sample("alpha", dist.Normal(0.0, 1.0))
    sigma = numpyro.sample("sigma", dist.HalfNormal(1.0))
    tau = numpyro.sample("tau", dist.HalfCauchy(1.0))
    c2 = numpyro.sample("c2", dist.InverseGamma(0.5 * slab_df, 0.5 * slab_df))
    with numpyro.plate("D", D):
        lam = numpyro.sample("lambda", dist.HalfCauchy(1.0))
        z = numpyro.sample("z", dist.Normal(0.0, 1.0))
    tau_s = tau0 * sigma * tau
    c2_s = slab_scale ** 2 * c2
    lam_t = jnp.sqrt(c2_s * lam ** 2 / (c2_s + tau_s ** 2 * lam ** 2))
    beta = z * lam_t * tau_s
    with numpyro.plate("N", n):
        numpyro.sample("y", dist.Normal(alpha + X @ beta, sigma), obs=y)


def _horseshoe_data():
    from sklearn.datasets import load_diabetes

    X, y = load_diabetes(return_X_y=True)
    rng = np.random.default_rng(101)
    X = np.concatenate([_std(X), rng.standard_normal((X.shape[0], 10))], axis=1)  # 10 real + 10 noise columns
    y = (y - y.mean()) / y.std()
    n, D = X.shape
    p0 = 3.0
    tau0 = p0 / (D - p0) / np.sqrt(n)
    return (X,), {"y": y, "tau0": float(tau0)}


# ---------------------------------------------------------------------------------------------------------------
# 2. one-way random-effects ANOVA, centred, 5 groups x 3 observations, both variances unknown (a funnel)
# ---------------------------------------------------------------------------------------------------------------
def random_effects_centered(group, n_groups, y=None):
    mu = numpyro.sample("mu", dist.Normal(0.0, 5.0))
    tau = numpyro.sample("tau", dist.HalfCauchy(2.5))
    sigma = numpyro.sample("sigma", dist.HalfNormal(2.5))
    with numpyro.plate("groups", n_groups):
        theta = numpyro.sample("theta", dist.Normal(mu, tau))
    with numpyro.plate("obs", group.shape[0]):
        numpyro.sample("y", dist.Normal(theta[group], sigma), obs=y)


def _random_effects_noncentered(group, n_groups, y=None):
    mu = numpyro.sample("mu", dist.Normal(0.0, 5.0))
    tau = numpyro.sample("tau", dist.HalfCauchy(2.5))
    sigma = numpyro.sample("sigma", dist.HalfNormal(2.5))
    with numpyro.plate("groups", n_groups):
        z = numpyro.sample("z", dist.Normal(0.0, 1.0))
    theta = mu + tau * z
    with numpyro.plate("obs", group.shape[0]):
        numpyro.sample("y", dist.Normal(theta[group], sigma), obs=y)


def _random_effects_data():
    rng = np.random.default_rng(202)
    n_groups, per = 5, 3
    theta = 1.0 + 0.4 * rng.standard_normal(n_groups)
    group = np.repeat(np.arange(n_groups), per).astype(np.int32)
    y = theta[group] + 1.0 * rng.standard_normal(group.size)
    return (group, n_groups), {"y": y}


def _random_effects_map(d):
    return {"mu": d["mu"], "tau": d["tau"], "sigma": d["sigma"], "theta": d["mu"][..., None] + d["tau"][..., None] * d["z"]}


# ---------------------------------------------------------------------------------------------------------------
# 3. logistic regression with quasi-complete separation (a rare indicator whose cases are all 1), weak priors
# ---------------------------------------------------------------------------------------------------------------
def separation_logistic(X, y=None):
    D = X.shape[1]
    b0 = numpyro.sample("b0", dist.Normal(0.0, 10.0))
    with numpyro.plate("D", D):
        w = numpyro.sample("w", dist.Normal(0.0, 10.0))
    with numpyro.plate("N", X.shape[0]):
        numpyro.sample("y", dist.Bernoulli(logits=b0 + X @ w), obs=y)


def _separation_data():
    rng = np.random.default_rng(303)
    n = 200
    x = rng.standard_normal((n, 2))
    flag = (rng.uniform(size=n) < 0.08).astype(np.float64)  # 8% carry the indicator
    p = 1 / (1 + np.exp(-(-0.5 + 0.8 * x[:, 0] - 1.0 * x[:, 1])))
    y = (rng.uniform(size=n) < p).astype(np.float64)
    y[flag == 1] = 1.0  # quasi-complete separation on the indicator
    X = np.column_stack([x, flag])
    return (X,), {"y": y}


# ---------------------------------------------------------------------------------------------------------------
# 4. Gaussian mixture, 3 components: ordered means (Stan's `ordered[K] mu`), Dirichlet weights, HalfNormal sds.
#    (Iris petal length/width were tried first: their tied values (0.1 cm rounding) make a component collapse onto
#    a tie, sigma -> 0, an improper posterior under HalfNormal; NUTS R-hat 32. Synthetic untied data instead.)
# ---------------------------------------------------------------------------------------------------------------
def ordered_mixture(x, K=3, loc0=0.0, sc0=5.0):
    w = numpyro.sample("w", dist.Dirichlet(jnp.ones(K)))
    mu = numpyro.sample("mu", dist.ImproperUniform(constraints.ordered_vector, (), event_shape=(K,)))
    numpyro.factor("mu_prior", dist.Normal(loc0, sc0).log_prob(mu).sum())
    with numpyro.plate("K", K):
        sigma = numpyro.sample("sigma", dist.HalfNormal(2.0))
    with numpyro.plate("N", x.shape[0]):
        numpyro.sample("x", dist.MixtureSameFamily(dist.Categorical(probs=w), dist.Normal(mu, sigma)), obs=x)


def _mixture_data():
    rng = np.random.default_rng(404)
    n = 200
    comp = rng.choice(3, size=n, p=[0.3, 0.45, 0.25])
    x = np.array([-2.0, 1.0, 4.0])[comp] + np.array([0.8, 1.0, 0.7])[comp] * rng.standard_normal(n)
    return (x,), {}


# ---------------------------------------------------------------------------------------------------------------
# 5. Weibull survival regression with right censoring: events via .mask, censored via factor(log survival)
# ---------------------------------------------------------------------------------------------------------------
def weibull_censored(X, t, event):
    D = X.shape[1]
    b0 = numpyro.sample("b0", dist.Normal(0.0, 10.0))
    with numpyro.plate("D", D):
        b = numpyro.sample("b", dist.Normal(0.0, 2.5))
    k = numpyro.sample("k", dist.Gamma(2.0, 1.0))
    scale = jnp.exp(b0 + X @ b)
    with numpyro.plate("N", X.shape[0]):
        with handlers.mask(mask=event > 0):
            numpyro.sample("t", dist.Weibull(scale, k), obs=t)
    log_surv = -((t / scale) ** k)
    numpyro.factor("censored", jnp.sum(jnp.where(event > 0, 0.0, log_surv)))


def _weibull_data():
    rng = np.random.default_rng(505)
    n = 200
    X = rng.standard_normal((n, 3))
    scale = np.exp(6.0 + X @ np.array([0.5, -0.3, 0.0]))  # times in days, ~400
    k = 1.5
    t_ev = scale * rng.weibull(k, size=n)
    t_c = rng.uniform(50, 1200, size=n)
    t = np.minimum(t_ev, t_c)
    event = (t_ev <= t_c).astype(np.float64)
    return (_std(X), t, event), {}


# ---------------------------------------------------------------------------------------------------------------
# 6. errors-in-variables regression: diabetes bmi observed with known noise sd 0.5, 120 patients
# ---------------------------------------------------------------------------------------------------------------
def errors_in_variables(x_obs, me_sd, y=None):
    n = x_obs.shape[0]
    mu_x = numpyro.sample("mu_x", dist.Normal(0.0, 1.0))
    sd_x = numpyro.sample("sd_x", dist.HalfNormal(1.0))
    a = numpyro.sample("a", dist.Normal(0.0, 1.0))
    b = numpyro.sample("b", dist.Normal(0.0, 1.0))
    sigma = numpyro.sample("sigma", dist.HalfNormal(1.0))
    with numpyro.plate("N", n):
        x = numpyro.sample("x_true", dist.Normal(mu_x, sd_x))
        numpyro.sample("x_obs", dist.Normal(x, me_sd), obs=x_obs)
        numpyro.sample("y", dist.Normal(a + b * x, sigma), obs=y)


def _eiv_data():
    from sklearn.datasets import load_diabetes

    X, y = load_diabetes(return_X_y=True)
    rng = np.random.default_rng(606)
    idx = rng.choice(X.shape[0], 120, replace=False)
    bmi = _std(X[:, 2:3])[:, 0][idx]
    yy = ((y - y.mean()) / y.std())[idx]
    x_obs = bmi + 0.5 * rng.standard_normal(bmi.size)
    return (x_obs, 0.5), {"y": yy}


# ---------------------------------------------------------------------------------------------------------------
# 7. Poisson GLMM: 40 groups x 4 observations, group and observation-level random effects (non-centred)
# ---------------------------------------------------------------------------------------------------------------
def poisson_olre(x, group, n_groups, y=None):
    n = x.shape[0]
    b0 = numpyro.sample("b0", dist.Normal(0.0, 2.0))
    b1 = numpyro.sample("b1", dist.Normal(0.0, 1.0))
    sigma_g = numpyro.sample("sigma_g", dist.HalfNormal(1.0))
    sigma_e = numpyro.sample("sigma_e", dist.HalfNormal(1.0))
    with numpyro.plate("groups", n_groups):
        z_g = numpyro.sample("z_g", dist.Normal(0.0, 1.0))
    with numpyro.plate("N", n):
        z_e = numpyro.sample("z_e", dist.Normal(0.0, 1.0))
        eta = b0 + b1 * x + sigma_g * z_g[group] + sigma_e * z_e
        numpyro.sample("y", dist.Poisson(jnp.exp(eta)), obs=y)


def _olre_data():
    rng = np.random.default_rng(707)
    n_groups, per = 40, 4
    group = np.repeat(np.arange(n_groups), per).astype(np.int32)
    x = rng.standard_normal(group.size)
    eta = 1.2 + 0.4 * x + 0.5 * rng.standard_normal(n_groups)[group] + 0.4 * rng.standard_normal(group.size)
    y = rng.poisson(np.exp(eta)).astype(np.float64)
    return (x, group, n_groups), {"y": y}


# ---------------------------------------------------------------------------------------------------------------
# 8. Poisson changepoint with a sigmoid (continuous) switch, switch time ~ Uniform(0, T)
# ---------------------------------------------------------------------------------------------------------------
def changepoint_relaxed(t, y=None, width=1.0):
    T = float(t.shape[0])
    ybar = 3.0
    r1 = numpyro.sample("r1", dist.Exponential(1.0 / ybar))
    r2 = numpyro.sample("r2", dist.Exponential(1.0 / ybar))
    s = numpyro.sample("s", dist.Uniform(0.0, T))
    wgt = jax_sigmoid((t - s) / width)
    rate = r1 * (1 - wgt) + r2 * wgt
    with numpyro.plate("T", t.shape[0]):
        numpyro.sample("y", dist.Poisson(rate), obs=y)


def jax_sigmoid(x):
    import jax

    return jax.nn.sigmoid(x)


def _changepoint_data():
    rng = np.random.default_rng(808)
    T = 100
    t = np.arange(T, dtype=np.float64)
    rate = np.where(t < 45, 4.0, 1.5)
    y = rng.poisson(rate).astype(np.float64)
    return (t,), {"y": y}


SPECS = {
    "reg_horseshoe_diabetes": dict(model=reg_horseshoe, data=_horseshoe_data, nuts=dict(target_accept_prob=0.99),
                                   note="sklearn diabetes standardised + 10 N(0,1) noise columns (D=20, n=442), "
                                        "regularised horseshoe, tau0 = 3/17/sqrt(n), non-centred"),
    "random_effects_centered": dict(model=random_effects_centered, data=_random_effects_data,
                                    nuts=dict(target_accept_prob=0.99), ref_model=_random_effects_noncentered,
                                    ref_map=_random_effects_map,
                                    note="synthetic 5 groups x 3, true tau 0.4 sigma 1; centred; NUTS on non-centred"),
    "separation_logistic": dict(model=separation_logistic, data=_separation_data, nuts=dict(target_accept_prob=0.95),
                                note="synthetic n=200, 2 N(0,1) predictors + an 8% indicator whose cases are all y=1; "
                                     "N(0,10) priors"),
    "ordered_mixture": dict(model=ordered_mixture, data=_mixture_data, nuts=dict(target_accept_prob=0.95),
                                 note="synthetic n=200 from 3 normals (-2, 1, 4; sd 0.8, 1, 0.7), 3 normals, ordered means (ImproperUniform + factor prior), "
                                      "Dirichlet(1) weights"),
    "weibull_censored": dict(model=weibull_censored, data=_weibull_data, nuts=dict(),
                             note="synthetic n=200, 3 covariates, times in days (~400), ~35% right-censored"),
    "errors_in_variables": dict(model=errors_in_variables, data=_eiv_data, nuts=dict(),
                                note="sklearn diabetes bmi (standardised) + N(0, 0.5^2) noise, 120 patients, "
                                     "latent true x per patient"),
    "poisson_olre": dict(model=poisson_olre, data=_olre_data, nuts=dict(target_accept_prob=0.95),
                         note="synthetic 40 groups x 4, group + observation-level random effects, non-centred"),
    "changepoint_relaxed": dict(model=changepoint_relaxed, data=_changepoint_data, nuts=dict(target_accept_prob=0.95),
                                note="synthetic T=100 Poisson counts, rate 4 -> 1.5 at t=45, sigmoid switch width 1"),
}


def get_data(name, float32=False, specs=None):
    """The data of ``name`` in ``specs`` (default: this module's SPECS), its float64 arrays cast to float32 on request."""
    args, kwargs = (specs or SPECS)[name]["data"]()
    if float32:
        cast = lambda a: a.astype(np.float32) if isinstance(a, np.ndarray) and a.dtype == np.float64 else a  # noqa: E731
        args = tuple(cast(a) for a in args)
        kwargs = {k: cast(v) for k, v in kwargs.items()}
    return args, kwargs
