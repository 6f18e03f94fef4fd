"""The default nb.BLR() on data nobody standardised, and what it says about its own fit.

Bayesian linear regression on scikit-learn's diabetes data as it ships *unscaled* (age in years,
blood pressure in mmHg, serum measurements in their units; target in disease-progression units),
unknown noise, weakly informative priors. The coefficients' posterior sds range over three orders
of magnitude and several are strongly correlated. Fits, on the model as written:

1. nb.BLR() (no tuning) with AutoMultivariateNormal and with AutoNormal, 500 steps;
2. NumPyro's Adam(0.01) with AutoMultivariateNormal, 10,000 steps (for contrast);
3. NUTS (2 chains x 2,000 draws) as the reference.

Prints, per fit, the largest error of the posterior means in NUTS sds, the range of sd ratios
(fit / NUTS) and the ELBO, then `nb.fit_report` of the BLR run and of a run stopped after 15 steps
(which warns that it has not converged, naming the sites).

Run: python examples/raw_data.py
"""

import time
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import numpyro
import numpyro.distributions as dist
from numpyro.infer import MCMC, NUTS, SVI, Trace_ELBO
from numpyro.infer.autoguide import AutoMultivariateNormal, AutoNormal
from sklearn.datasets import load_diabetes

import numpyro_blr as nb

numpyro.enable_x64()


def model(X, y=None):
    intercept = numpyro.sample("intercept", dist.Normal(0.0, 1000.0))
    w = numpyro.sample("w", dist.Normal(0.0, 100.0).expand([X.shape[1]]).to_event(1))
    sigma = numpyro.sample("sigma", dist.HalfNormal(100.0))
    numpyro.sample("y", dist.Normal(intercept + X @ w, sigma), obs=y)


def summary(draws):
    """Per-coordinate means and sds in the unconstrained space (log sigma)."""
    flat = np.concatenate(
        [np.asarray(draws["intercept"])[:, None], np.asarray(draws["w"]), np.log(np.asarray(draws["sigma"]))[:, None]], axis=1
    )
    return flat.mean(0), flat.std(0)


def compare(name, guide, params, ref_mean, ref_sd, X, y, seconds):
    draws = guide.sample_posterior(jax.random.PRNGKey(1), params, sample_shape=(4000,))
    mean, sd = summary(draws)
    elbo = -Trace_ELBO(num_particles=2000).loss(jax.random.PRNGKey(2), params, model, guide, X, y)
    err = np.max(np.abs(mean - ref_mean) / ref_sd)
    ratio = sd / ref_sd
    print(f"  {name:<34} mean error {err:7.3f} sd   sd ratio {ratio.min():.2f}-{ratio.max():.2f}   ELBO {float(elbo):10.2f}   {seconds:5.1f} s")


def main():
    X, y = load_diabetes(return_X_y=True, scaled=False)
    X, y = jnp.asarray(X), jnp.asarray(y)
    print(f"diabetes, unscaled: {X.shape[0]} x {X.shape[1]}, column sds {np.asarray(X).std(0).min():.2g}-{np.asarray(X).std(0).max():.2g}")

    t0 = time.perf_counter()
    mcmc = MCMC(NUTS(model), num_warmup=1000, num_samples=2000, num_chains=2, chain_method="sequential", progress_bar=False)
    mcmc.run(jax.random.PRNGKey(0), X, y)
    ref_mean, ref_sd = summary(mcmc.get_samples())
    print(f"NUTS reference: 2 x 2000 draws in {time.perf_counter() - t0:.1f} s\n")

    fits = [
        ("nb.BLR(), AutoMultivariateNormal", AutoMultivariateNormal, nb.BLR(), 500),
        ("nb.BLR(), AutoNormal", AutoNormal, nb.BLR(), 500),
        ("Adam(0.01), AutoMultivariateNormal", AutoMultivariateNormal, numpyro.optim.Adam(0.01), 10_000),
    ]
    results = {}
    for name, guide_cls, opt, steps in fits:
        guide = guide_cls(model)
        svi = SVI(model, guide, opt, Trace_ELBO())
        t0 = time.perf_counter()
        result = svi.run(jax.random.PRNGKey(0), steps, X, y, progress_bar=False)
        jax.block_until_ready(result.params)
        compare(f"{name}, {steps} steps", guide, result.params, ref_mean, ref_sd, X, y, time.perf_counter() - t0)
        results[name] = (guide, result)
    print("  (AutoNormal is mean-field: its sds are the mean-field optimum's, smaller than NUTS's on correlated coefficients)")

    guide, result = results["nb.BLR(), AutoMultivariateNormal"]
    print("\nnb.fit_report of the 500-step BLR run:")
    print(nb.fit_report(result, guide=guide))

    print("\nthe same fit stopped after 15 steps:")
    guide = AutoMultivariateNormal(model)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        short = SVI(model, guide, nb.BLR(), Trace_ELBO()).run(jax.random.PRNGKey(0), 15, X, y, progress_bar=False)
    for w in caught:
        if "nb.BLR" in str(w.message):
            print(f"  RuntimeWarning: {w.message}")
    print(nb.fit_report(short, guide=guide))


if __name__ == "__main__":
    main()
