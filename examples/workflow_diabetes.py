"""Bayesian workflow for a BLR fit on scikit-learn's diabetes data (442 x 10, standardised).

Two linear regressions with unknown noise, y ~ Normal(X w, sigma): all ten covariates vs three
(bmi, bp, s5). Each is fitted with nb.BLR() and a full-Gaussian guide; then
k-hat (Yao et al. 2018), PSIS-corrected means, LOO with the approximate-posterior correction vs NUTS,
az.compare of the two models, a posterior predictive check and memory-perturbation sensitivities
(Nickl et al. 2023: which patients move the fit most). Figures go to figures/.

Run: python examples/workflow_diabetes.py
"""

import os
import time
import warnings

import arviz as az
import jax
import jax.numpy as jnp
import numpy as np
import numpyro
import numpyro.distributions as dist
from numpyro.infer import MCMC, NUTS, SVI, Trace_ELBO
from numpyro.infer.autoguide import AutoMultivariateNormal
from sklearn.datasets import load_diabetes

import numpyro_blr as nb
from numpyro_blr import diagnostics as nd
from numpyro_blr.diagnostics import plots

FIG = os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir, "figures")


def regression(X, y=None):
    w = numpyro.sample("w", dist.Normal(0.0, 1.0).expand([X.shape[1]]).to_event(1))
    sigma = numpyro.sample("sigma", dist.HalfNormal(1.0))
    with numpyro.plate("patient", X.shape[0]):
        numpyro.sample("y", dist.Normal(X @ w, sigma), obs=y)


def main():
    t0 = time.perf_counter()
    data = load_diabetes()
    X = (data.data - data.data.mean(0)) / data.data.std(0)
    X = np.hstack([np.ones((X.shape[0], 1)), X]).astype(np.float32)
    y = ((data.target - data.target.mean()) / data.target.std()).astype(np.float32)
    names = ["intercept"] + list(data.feature_names)
    subsets = {"all ten": list(range(11)), "bmi+bp+s5": [0, 3, 4, 9]}
    print(f"== Diabetes ({X.shape[0]} x {X.shape[1] - 1}), linear regression with unknown noise, nb.BLR + AutoMultivariateNormal")

    trees, fits, loos, nuts_loos = {}, {}, {}, {}
    for label, cols in subsets.items():
        Xs = jnp.asarray(X[:, cols])
        coords = {"coef": [names[c] for c in cols]}
        guide = AutoMultivariateNormal(regression)
        res = SVI(regression, guide, nb.BLR(), Trace_ELBO()).run(jax.random.PRNGKey(0), 200, Xs, jnp.asarray(y), progress_bar=False)
        tree = nd.to_datatree(guide, res.params, regression, Xs, jnp.asarray(y), num_samples=4000, rng_key=jax.random.PRNGKey(1),
                              dims={"w": ["coef"]}, coords=coords, losses=res.losses)
        trees[label], fits[label] = tree, nd.check_fit(tree)
        mcmc = MCMC(NUTS(regression), num_warmup=500, num_samples=1000, num_chains=2, chain_method="sequential", progress_bar=False)
        mcmc.run(jax.random.PRNGKey(2), Xs, jnp.asarray(y))
        nuts = az.from_numpyro(mcmc, log_likelihood=True, dims={"w": ["coef"], "y": ["patient"]}, coords=coords)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            loos[label] = nd.loo_vi(tree)
            nuts_loos[label] = az.loo(nuts, pointwise=True)
        if label == "all ten":
            nuts_all, guide_all, params_all = nuts, guide, res.params
            # the same guide fitted by NumPyro's Adam for the same number of steps, for the forest plot
            adam_guide = AutoMultivariateNormal(regression)
            adam = SVI(regression, adam_guide, numpyro.optim.Adam(0.01), Trace_ELBO()).run(
                jax.random.PRNGKey(0), 200, Xs, jnp.asarray(y), progress_bar=False
            )
            adam_tree = nd.to_datatree(adam_guide, adam.params, regression, Xs, jnp.asarray(y), num_samples=4000,
                                       rng_key=jax.random.PRNGKey(1), dims={"w": ["coef"]}, coords=coords, losses=adam.losses)

    print("\nIs the fit trustworthy? (Pareto k-hat of log p - log q, 4000 draws)")
    for label, r in fits.items():
        e = nd.psis_expectation(trees[label], var_names=["sigma"], result=r)
        print(f"  {label:<10} k-hat {r.khat:.2f} ({r.verdict}), ESS {r.ess:.0f};  E[sigma]: q {float(trees[label]['posterior'].ds['sigma'].mean()):.4f}, PSIS {float(e['sigma'].sel(stat='mean')):.4f}")
    print("\nLOO elpd: BLR (approximate-posterior correction) vs NUTS")
    for label in subsets:
        print(f"  {label:<10} BLR {loos[label].elpd:8.2f} +- {loos[label].se:.2f}    NUTS {nuts_loos[label].elpd:8.2f} +- {nuts_loos[label].se:.2f}    difference {loos[label].elpd - nuts_loos[label].elpd:+.2f}")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        cmp = az.compare(loos, round_to="none")
    print("\naz.compare (BLR fits, corrected LOO):")
    print(cmp[["rank", "elpd", "p", "elpd_diff", "weight", "se", "dse"]].to_string(float_format=lambda v: f"{v:.2f}"))

    # memory perturbation: w given sigma (fixed at its posterior mean) is Gaussian-linear; mean and covariance
    # of w from the BLR draws (the guide's latent also holds log sigma)
    post = trees["all ten"]["posterior"].ds
    w_draws = post["w"].values.reshape(-1, 11)
    w_mean, w_cov = w_draws.mean(0), np.cov(w_draws.T)
    sigma = float(post["sigma"].mean())
    mp = nd.memory_perturbation(w_mean, w_cov, y, X=X, likelihood="gaussian", noise=sigma)
    top = np.argsort(-mp.sensitivity)[:5]
    print("\nmost sensitive patients (Nickl et al. 2023: Lambda_i v_i |e_i|):")
    for i in top:
        print(f"  patient {i:3d}: residual {y[i] - mp.f[i]:+.2f} sd, prediction sd {np.sqrt(mp.variance[i]):.3f}, "
              f"sensitivity {mp.sensitivity[i]:.4f}, LOO shift of its prediction {mp.loo_shift[i]:+.3f}")
    # check against the exact LOO of the Gaussian-linear model (hat-matrix identity)
    prec = X.T @ X / sigma**2 + np.eye(11)
    h = np.einsum("nd,de,ne->n", X, np.linalg.inv(prec), X) / sigma**2
    exact = (X @ np.linalg.solve(prec, X.T @ y / sigma**2) - y) * h / (1 - h)
    r = np.corrcoef(mp.loo_shift, exact)[0, 1]
    print(f"  correlation of the estimated LOO shifts with the exact ones (sigma fixed): {r:.3f}")

    plots.plot_loss(trees, os.path.join(FIG, "diabetes_loss.png"))
    plots.plot_khat({k: v for k, v in fits.items()}, os.path.join(FIG, "diabetes_khat.png"))
    plots.plot_khat(loos["all ten"], os.path.join(FIG, "diabetes_loo_khat.png"))
    plots.plot_ppc(trees["all ten"], os.path.join(FIG, "diabetes_ppc.png"))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        plots.plot_forest({"BLR (200 steps)": trees["all ten"], "Adam(0.01) (200 steps)": adam_tree, "NUTS": nuts_all},
                          os.path.join(FIG, "diabetes_forest.png"), var_names=["w", "sigma"])
    plots.plot_sensitivity(mp, os.path.join(FIG, "diabetes_sensitivity.png"), true_shift=exact)
    print(f"\nfigures written to {os.path.normpath(FIG)} (total {time.perf_counter() - t0:.0f} s)")


if __name__ == "__main__":
    main()
