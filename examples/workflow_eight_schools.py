"""Bayesian workflow for a BLR fit: eight schools, centred vs non-centred.

1. Prior predictive check (what data does the model expect?).
2. Fit both parameterisations with nb.BLR() (mean-field AutoNormal and full AutoMultivariateNormal).
3. Is the fit trustworthy? Pareto k-hat of log p(theta, y) - log q(theta) (Yao et al. 2018).
4. Posterior predictive check.
5. LOO comparison of the two models (approximate-posterior correction, Magnusson et al. 2019),
   with NUTS on the non-centred model as the reference.

Figures go to figures/. Run: python examples/workflow_eight_schools.py
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
from numpyro.infer import MCMC, NUTS, SVI, Predictive, Trace_ELBO
from numpyro.infer.autoguide import AutoMultivariateNormal, AutoNormal

import numpyro_blr as nb
from numpyro_blr import diagnostics as nd
from numpyro_blr.diagnostics import plots

FIG = os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir, "figures")


def eight_schools_data():
    """The eight-schools data (Rubin 1981) from arviz_base if it can be read, else the published numbers."""
    try:
        dt = az.load_arviz_data("centered_eight")
        y = dt["observed_data"].ds["obs"].values
        sigma = dt["constant_data"].ds["sigma"].values
        schools = [str(s) for s in dt["observed_data"].ds["school"].values]
        source = "arviz_base.load_arviz_data('centered_eight')"
    except Exception as err:  # noqa: BLE001 - arviz_base ships it as HDF5 netCDF: needs h5netcdf or netCDF4
        y = np.array([28.0, 8.0, -3.0, 7.0, -1.0, 1.0, 18.0, 12.0])
        sigma = np.array([15.0, 10.0, 16.0, 11.0, 9.0, 11.0, 10.0, 18.0])
        schools = ["Choate", "Deerfield", "Phillips Andover", "Phillips Exeter", "Hotchkiss", "Lawrenceville", "St. Paul's", "Mt. Hermon"]
        source = f"Rubin (1981) table (arviz_base's copy could not be read: {type(err).__name__})"
    return y, sigma, schools, source


def centered(sigma, y=None):
    mu = numpyro.sample("mu", dist.Normal(0.0, 5.0))
    tau = numpyro.sample("tau", dist.HalfCauchy(5.0))
    with numpyro.plate("school", sigma.shape[0]):
        theta = numpyro.sample("theta", dist.Normal(mu, tau))
        numpyro.sample("obs", dist.Normal(theta, sigma), obs=y)


def non_centered(sigma, y=None):
    mu = numpyro.sample("mu", dist.Normal(0.0, 5.0))
    tau = numpyro.sample("tau", dist.HalfCauchy(5.0))
    with numpyro.plate("school", sigma.shape[0]):
        theta_t = numpyro.sample("theta_t", dist.Normal(0.0, 1.0))
        theta = numpyro.deterministic("theta", mu + tau * theta_t)
        numpyro.sample("obs", dist.Normal(theta, sigma), obs=y)


def main():
    t0 = time.perf_counter()
    y, sigma, schools, source = eight_schools_data()
    y, sigma = jnp.asarray(y, jnp.float32), jnp.asarray(sigma, jnp.float32)
    coords = {"school": schools}
    print(f"== Eight schools ({source})")

    # 1. prior predictive
    prior = Predictive(non_centered, num_samples=500)(jax.random.PRNGKey(0), sigma)
    prior_tree = az.from_dict(
        {"prior_predictive": {"obs": np.asarray(prior["obs"])[None]}, "observed_data": {"obs": np.asarray(y)}},
        dims={"obs": ["school"]},
        coords=coords,
    )
    q = np.quantile(np.asarray(prior["obs"]), [0.05, 0.5, 0.95])
    print(f"prior predictive of a school's effect: 5%/50%/95% = {q[0]:.0f} / {q[1]:.0f} / {q[2]:.0f} (observed {float(y.min()):.0f}..{float(y.max()):.0f})")
    plots.plot_ppc(prior_tree, os.path.join(FIG, "eight_schools_prior_predictive.png"), group="prior_predictive")

    # 2. fits
    fits, trees = {}, {}
    for model_name, model in [("centred", centered), ("non-centred", non_centered)]:
        for guide_cls in (AutoNormal, AutoMultivariateNormal):
            name = f"{model_name} {guide_cls.__name__}"
            guide = guide_cls(model)
            res = SVI(model, guide, nb.BLR(), Trace_ELBO()).run(jax.random.PRNGKey(1), 300, sigma, y, progress_bar=False)
            tree = nd.to_datatree(guide, res.params, model, sigma, y, num_samples=4000, rng_key=jax.random.PRNGKey(2), coords=coords, losses=res.losses)
            fits[name], trees[name] = nd.check_fit(tree), tree

    # 3. is the fit trustworthy?
    print("\nPareto k-hat of log p(theta, y) - log q(theta), 4000 draws (Yao et al. 2018):")
    for name, r in fits.items():
        e = nd.psis_expectation(trees[name], var_names=["mu", "tau"], result=r)
        post = trees[name]["posterior"].ds
        print(
            f"  {name:<36} k-hat {r.khat:5.2f} ({r.verdict:<10}) ESS {r.ess:6.0f}   "
            f"E[tau] q: {float(post['tau'].mean()):5.2f}  PSIS: {float(e['tau'].sel(stat='mean')):5.2f}"
        )
    plots.plot_khat({n.replace(" Auto", "\n"): r for n, r in fits.items()}, os.path.join(FIG, "eight_schools_khat.png"))
    plots.plot_loss({n: t for n, t in trees.items()}, os.path.join(FIG, "eight_schools_loss.png"))

    # NUTS reference on the non-centred model
    mcmc = MCMC(NUTS(non_centered), num_warmup=500, num_samples=1000, num_chains=2, chain_method="sequential", progress_bar=False)
    mcmc.run(jax.random.PRNGKey(3), sigma, y)
    nuts = az.from_numpyro(mcmc, log_likelihood=True, coords=coords, dims={"theta": ["school"], "theta_t": ["school"], "obs": ["school"]})
    print(f"  NUTS (non-centred)                   E[tau] {float(nuts['posterior'].ds['tau'].mean()):5.2f}")

    # 4. posterior predictive check
    best = "non-centred AutoMultivariateNormal"
    plots.plot_ppc(trees[best], os.path.join(FIG, "eight_schools_ppc.png"))
    pp = trees[best]["posterior_predictive"].ds["obs"].values.reshape(-1, 8)
    print(f"\nposterior predictive ({best}): P(y_rep > y_obs) per school =", np.round((pp > np.asarray(y)).mean(0), 2))

    # 5. LOO comparison
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        print("\nPSIS-LOO elpd (BLR fits with the approximate-posterior correction; NUTS plain):")
        loos = {}
        for name in [best, "centred AutoMultivariateNormal", "non-centred AutoNormal", "centred AutoNormal"]:
            loos[name] = nd.loo_vi(trees[name])
            print(f"  {name:<36} elpd {loos[name].elpd:7.2f} +- {loos[name].se:.2f}   p_loo {loos[name].p:.2f}")
        nuts_loo = az.loo(nuts, pointwise=True)
        print(f"  {'NUTS non-centred':<36} elpd {nuts_loo.elpd:7.2f} +- {nuts_loo.se:.2f}   p_loo {nuts_loo.p:.2f}")
        cmp = az.compare(
            {"non-centred (BLR)": loos[best], "centred (BLR)": loos["centred AutoMultivariateNormal"], "NUTS": nuts_loo},
            round_to="none",
        )
        # the ranking is only as good as the fits it ranks: show each fit's k-hat next to it
        fit_khat = {"non-centred (BLR)": fits[best], "centred (BLR)": fits["centred AutoMultivariateNormal"]}
        cmp["fit k-hat"] = [f"{fit_khat[n].khat:.2f} {fit_khat[n].verdict}" if n in fit_khat else "(MCMC)" for n in cmp.index]
        print("\naz.compare of the corrected LOO results (plain az.loo on q's draws would ignore q != p),")
        print("with the Pareto k-hat of each variational fit (section 3):")
        print(cmp[["rank", "elpd", "p", "elpd_diff", "weight", "se", "dse", "fit k-hat"]].to_string(float_format=lambda v: f"{v:.2f}"))
        for n, r in fit_khat.items():
            if r.verdict == "unreliable":
                print(
                    f"  WARNING: {n} is ranked {int(cmp.loc[n, 'rank'])} but its fit k-hat is {r.khat:.2f} (unreliable): "
                    "q does not match its posterior, so its elpd (and its rank) cannot be trusted; compare it only "
                    "after a fit with k-hat <= 0.7 (here: the non-centred model)."
                )
        plots.plot_khat(loos[best], os.path.join(FIG, "eight_schools_loo_khat.png"))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        plots.plot_forest(
            {"BLR non-centred": trees[best], "BLR centred (mean-field)": trees["centred AutoNormal"], "NUTS": nuts},
            os.path.join(FIG, "eight_schools_forest.png"),
            var_names=["mu", "tau", "theta"],
        )
    print(f"\nfigures written to {os.path.normpath(FIG)} (total {time.perf_counter() - t0:.0f} s)")


if __name__ == "__main__":
    main()
