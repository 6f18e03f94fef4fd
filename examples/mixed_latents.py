"""Positive, simplex and discrete latents in one model: ExpFamilyGuide + nb.BLR against NUTS.

Model (a two-component Poisson "burst" model on the Linnerud chin-up counts shipped with
scikit-learn): each person is a "burst" (z_i = 1) with probability w[1]; counts are
Poisson(rate * (1 + 2 z_i)).

    w    ~ Dirichlet(1, 1)        simplex   -> Dirichlet guide
    rate ~ Gamma(2, 0.2)          positive  -> Gamma guide
    z_i  ~ Bernoulli(w[1])        boolean   -> Bernoulli guide (enumerated exactly inside nb.BLR;
                                             or, with max_enumerate=0, the score-function estimator
                                             that nb.BLR uses for sites too large to enumerate)

The reference is NUTS on the model with z summed out (``config_enumerate`` marks z for NUTS; the
model itself leaves it unmarked, since ExpFamilyGuide leaves marked sites to TraceEnum_ELBO);
p(z_i = 1 | data) is then averaged over the NUTS draws exactly.
The mean-field guide cannot represent the posterior correlation between z and (rate, w), so small
differences from NUTS are expected; the marginal means are usually close.

Run: python examples/mixed_latents.py
"""

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import numpyro
import numpyro.distributions as dist
from numpyro.contrib.funsor import config_enumerate
from numpyro.infer import MCMC, NUTS, SVI, Trace_ELBO
from sklearn.datasets import load_linnerud

import numpyro_blr as nb
from numpyro_blr.guides import ExpFamilyGuide

Y = jnp.asarray(load_linnerud().data[:, 0])  # 20 chin-up counts


def model(y):
    w = numpyro.sample("w", dist.Dirichlet(jnp.ones(2)))
    rate = numpyro.sample("rate", dist.Gamma(2.0, 0.2))
    with numpyro.plate("people", y.shape[0]):
        z = numpyro.sample("z", dist.Bernoulli(w[1]))
        numpyro.sample("y", dist.Poisson(rate * (1.0 + 2.0 * z)), obs=y)


def fit(max_enumerate):
    guide = ExpFamilyGuide(model, max_enumerate=max_enumerate)
    svi = SVI(model, guide, nb.BLR(guide=guide), Trace_ELBO(num_particles=4))
    return guide, svi.run(jax.random.PRNGKey(0), 1500, Y, progress_bar=False)


def main():
    # NumPyro warns that Trace_ELBO has no estimator for discrete guide sites; nb.BLR handles them
    warnings.filterwarnings("ignore", message="Currently, SVI with Trace_ELBO")
    guide, result = fit(max_enumerate=64)  # z: 20 x 2 = 40 loss evaluations -> enumerated
    _, result_sf = fit(max_enumerate=0)  # the same site by the score-function estimator (32 draws)
    mean = guide.mean(result.params)
    mean_sf = guide.mean(result_sf.params)
    draws = guide.sample_posterior(jax.random.PRNGKey(1), result.params, sample_shape=(2000,))

    mcmc = MCMC(NUTS(config_enumerate(model)), num_warmup=500, num_samples=2000, progress_bar=False)
    mcmc.run(jax.random.PRNGKey(2), Y)
    s = mcmc.get_samples()
    # exact p(z_i = 1 | rate, w, y_i), averaged over the NUTS draws (Rao-Blackwellised)
    lp1 = jnp.log(s["w"][:, 1:2]) + dist.Poisson(3.0 * s["rate"][:, None]).log_prob(Y)
    lp0 = jnp.log(s["w"][:, 0:1]) + dist.Poisson(s["rate"][:, None]).log_prob(Y)
    pz = jnp.mean(jax.nn.sigmoid(lp1 - lp0), 0)

    print(f"ELBO loss: first {float(result.losses[0]):.2f}, last 100 mean {float(np.mean(result.losses[-100:])):.2f}")
    print(f"{'':12s} {'BLR mean':>9s} {'BLR sd':>8s} {'NUTS mean':>10s} {'NUTS sd':>8s}")
    print(f"{'rate':12s} {float(mean['rate']):9.3f} {float(np.std(draws['rate'])):8.3f} "
          f"{float(s['rate'].mean()):10.3f} {float(s['rate'].std()):8.3f}")
    print(f"{'rate (SF)':12s} {float(mean_sf['rate']):9.3f}")
    print(f"{'w[1]':12s} {float(mean['w'][1]):9.3f} {float(np.std(draws['w'][:, 1])):8.3f} "
          f"{float(s['w'][:, 1].mean()):10.3f} {float(s['w'][:, 1].std()):8.3f}")
    print(f"{'w[1] (SF)':12s} {float(mean_sf['w'][1]):9.3f}")
    print("p(z_i = 1 | y):")
    print("  y   ", " ".join(f"{int(v):5d}" for v in Y))
    print("  BLR ", " ".join(f"{float(v):5.2f}" for v in mean["z"]))
    print("  SF  ", " ".join(f"{float(v):5.2f}" for v in mean_sf["z"]), " (score function)")
    print("  NUTS", " ".join(f"{float(v):5.2f}" for v in pz))


if __name__ == "__main__":
    main()
