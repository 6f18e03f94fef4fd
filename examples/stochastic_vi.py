"""Stochastic VI on a million points: a 20-component Gaussian mixture in 5 dimensions, minibatches of 1,000.

The model declares its minibatches the NumPyro way, ``numpyro.plate("n", N, subsample_size=B)``, and indexes the
data with the plate's indices; ``numpyro_blr.infer.svi`` updates the minibatch's assignments exactly (rho = 1) and
the global weights, means and precisions by the BLR with rho_t = (t + 1)^-0.7 on the minibatch's natural
parameters scaled by N/B (Hoffman et al. 2013). The same model, given all its indices, is fitted by full-batch
VMP (``numpyro_blr.infer.vmp``) from the same initialisation, the reference. Prints both ELBOs on the whole data
after each epoch; writes figures/stochastic_vi.png (the minibatch ELBO estimates, the whole-data ELBO every
quarter epoch, and full-batch VMP's).

Run: python examples/stochastic_vi.py [--n 1000000]
"""

import argparse
import pathlib
import time
import warnings

import jax

jax.config.update("jax_enable_x64", True)

import jax.numpy as jnp  # noqa: E402
import matplotlib  # noqa: E402

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import numpyro  # noqa: E402
import numpyro.distributions as dist  # noqa: E402

from numpyro_blr.infer import svi, vmp  # noqa: E402

K, D, B = 20, 5, 1000
FIGURE = pathlib.Path(__file__).resolve().parents[1] / "figures" / "stochastic_vi.png"


def model(y, batch=None):
    w = numpyro.sample("w", dist.Dirichlet(jnp.ones(K)))
    with numpyro.plate("k", K):
        mu = numpyro.sample("mu", dist.Normal(0.0, 10.0).expand([D]).to_event(1))
        tau = numpyro.sample("tau", dist.Gamma(1.0, 1.0).expand([D]).to_event(1))
    with numpyro.plate("n", y.shape[0], subsample_size=batch) as idx:
        z = numpyro.sample("z", dist.Categorical(w))
        numpyro.sample("y", dist.Normal(mu[z], 1.0 / jnp.sqrt(tau[z])).to_event(1), obs=y[idx])


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--n", type=int, default=10**6)
    n = parser.parse_args().n
    rng = np.random.default_rng(0)
    centers = rng.normal(0, 5, (K, D))
    y = centers[rng.integers(0, K, n)] + rng.normal(0, 1, (n, D))
    # means seeded from the data (farthest points of a subsample), the same for both fits
    sub = y[rng.choice(n, min(n, 20000), replace=False)]
    m0 = [sub[0]]
    for _ in range(K - 1):
        m0.append(sub[np.argmax(np.min(((sub[:, None] - np.array(m0)[None]) ** 2).sum(-1), 1))])
    init = {"mu": dist.Normal(jnp.asarray(np.array(m0)), 1.0).to_event(1)}
    yj = jnp.asarray(y)

    algo = svi(model, yj, B, kappa=0.7, tau=1.0)
    state = algo.init(init=init)
    steps_per_epoch = n // B
    quarter = steps_per_epoch // 4
    estimates, checkpoints = [], []
    t0 = time.perf_counter()
    for q in range(12):  # 3 epochs in quarters: a progress bar per quarter (each quarter's report is printed at the end)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)  # a quarter is not the whole run: judged below
            res = algo.run(state, key=jax.random.PRNGKey(q), num_steps=quarter, progress_bar=True)
        state = res.state
        estimates.extend(res.elbo_history)
        elbo, _ = algo.elbo(state)
        checkpoints.append(((q + 1) * quarter, elbo))
        if (q + 1) % 4 == 0:
            print(f"epoch {(q + 1) // 4}: whole-data ELBO {elbo:.1f} ({time.perf_counter() - t0:.1f} s)")
    t_svi = time.perf_counter() - t0

    t0 = time.perf_counter()
    full = vmp(model, yj, order=("z", "w", "mu", "tau"))
    ref = full.run(full.init(init=init), tol=1e-6, progress_bar=True)
    t_vmp = time.perf_counter() - t0
    gap = abs(checkpoints[-1][1] - ref.elbo) / abs(ref.elbo)
    print(f"stochastic VI, 3 epochs ({3 * steps_per_epoch} steps of {B}): ELBO {checkpoints[-1][1]:.1f} in {t_svi:.1f} s")
    print(f"full-batch VMP, {ref.num_steps} sweeps of {n:,}: ELBO {ref.elbo:.1f} in {t_vmp:.1f} s")
    print(f"relative gap: {100 * gap:.4f}%")
    print(f"last quarter's report: {res.report}")

    fig, ax = plt.subplots(figsize=(7, 4))
    steps = np.arange(1, len(estimates) + 1)
    ax.plot(steps, estimates, lw=0.4, alpha=0.5, label="minibatch ELBO estimate (x N/B)")
    ax.plot(*zip(*checkpoints), "o-", c="k", ms=4, label="whole-data ELBO (assignments at their optimum)")
    ax.axhline(ref.elbo, c="r", ls="--", lw=1, label=f"full-batch VMP ({ref.num_steps} sweeps)")
    lo = min(c[1] for c in checkpoints)
    ax.set_ylim(lo - 0.02 * abs(lo), ref.elbo + 0.01 * abs(ref.elbo))
    ax.set_xlabel(f"step (minibatches of {B}; {steps_per_epoch} steps per epoch)")
    ax.set_ylabel("ELBO")
    ax.set_title(f"Stochastic VI, Gaussian mixture, N = {n:,}, K = {K}, D = {D}")
    ax.legend(fontsize=8, loc="lower right")
    FIGURE.parent.mkdir(exist_ok=True)
    fig.tight_layout()
    fig.savefig(FIGURE, dpi=120)
    print(f"figure: {FIGURE}")


if __name__ == "__main__":
    main()
