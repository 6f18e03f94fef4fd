"""Data-parallel BLR and IVON on emulated CPU devices (docs/scaling.md).

    python examples/data_parallel.py            # 4 emulated CPU devices (on a GPU host: its GPUs)

1. Breast-cancer logistic regression, nb.BLR() + AutoMultivariateNormal, rows split over the devices
   (shared key): the same fit as one device, one all-reduce per estimate.
2. IVON on a digits MLP with one weight sample per device (shard_map, pmean): the same training loop.
"""

import os
import sys

if "--no-emulate" not in sys.argv:
    os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=4"

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import numpyro  # noqa: E402
import numpyro.distributions as dist  # noqa: E402
from numpyro.infer import SVI, Trace_ELBO  # noqa: E402
from numpyro.infer.autoguide import AutoMultivariateNormal  # noqa: E402
from sklearn.datasets import load_breast_cancer, load_digits  # noqa: E402

import numpyro_blr as nb  # noqa: E402


def logistic(X, y=None):
    w = numpyro.sample("w", dist.Normal(0.0, 1.0).expand([X.shape[1]]).to_event(1))
    with numpyro.plate("data", X.shape[0]):
        numpyro.sample("y", dist.Bernoulli(logits=X @ w), obs=y)


def main():
    devices = jax.devices()
    k = len(devices)
    print(f"{k} {devices[0].platform} device(s)")

    # 1. shared key: the single-device fit, computed on k devices
    X, y = load_breast_cancer(return_X_y=True)
    X = np.hstack([np.ones((len(X), 1)), (X - X.mean(0)) / X.std(0)]).astype(np.float32)
    n = len(X) - len(X) % k  # the plate must split evenly: drop the last len(X) % k rows
    X, y = X[:n], y[:n].astype(np.float32)
    fits = {}
    for label, mesh in (("1 device", nb.data_mesh(devices[:1])), (f"{k} devices", nb.data_mesh())):
        Xs, ys = nb.shard_data(mesh, X, y, model=logistic)
        svi = SVI(logistic, AutoMultivariateNormal(logistic), nb.BLR(), Trace_ELBO())
        res = svi.run(jax.random.PRNGKey(0), 300, Xs, ys, progress_bar=False)
        fits[label] = res.params
        print(f"  {label:10s} final loss {float(res.losses[-1]):.4f}, params placed as {res.params['auto_loc'].sharding.spec}")
        if label != "1 device":
            state = svi.init(jax.random.PRNGKey(0), Xs, ys)
            counts = nb.collective_counts(svi.update, state, Xs, ys)
            print(f"  one step's collectives: {counts['all-reduce']} all-reduce(s) "
                  f"({len(counts['where'])} reduced ops, one of them the backtracking trial loss), "
                  f"{sum(counts[c] for c in nb.parallel.COLLECTIVES[1:])} other")
    a, b = fits.values()
    print("  largest parameter difference, 1 vs", k, "devices:",
          f"{max(float(np.max(np.abs(np.asarray(a[n]) - np.asarray(b[n])))) for n in a):.1e}")

    # 2. IVON, one weight sample per device: each device perturbs its own weights, estimates are pmean-ed
    Xd, yd = load_digits(return_X_y=True)
    Xd, yd = (Xd / 16.0).astype(np.float32), yd.astype(np.int32)
    n = (len(Xd) // (64 * k)) * 64 * k
    Xd, yd = Xd[:n], yd[:n]
    mesh = nb.data_mesh()
    rng = np.random.default_rng(0)
    params = {"w1": rng.normal(size=(64, 32)).astype(np.float32) * 0.2, "b1": np.zeros(32, np.float32),
              "w2": rng.normal(size=(32, 10)).astype(np.float32) * 0.2, "b2": np.zeros(10, np.float32)}

    def loss_fn(p, xb, yb):  # the mean over this device's part of the batch
        logits = jax.nn.relu(xb @ p["w1"] + p["b1"]) @ p["w2"] + p["b2"]
        return -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(logits), yb[:, None], 1))

    algo = nb.ivon(0.5, ess=n, hess_init=0.3, beta2=0.9999, axis_name="data")
    step = nb.data_parallel_step(algo, loss_fn, mesh, per_device_sample=True)
    state = nb.replicate(mesh, algo.init(params))
    batch = 64 * k
    key = jax.random.PRNGKey(0)
    for epoch in range(20):
        perm = rng.permutation(n)
        for i in range(n // batch):
            idx = perm[i * batch:(i + 1) * batch]
            xb, yb = nb.shard_data(mesh, Xd[idx], yd[idx])
            state, info = step(jax.random.fold_in(key, epoch * 1000 + i), state, xb, yb)
    acc = float(jnp.mean(jnp.argmax(jax.nn.relu(Xd @ state.params["w1"] + state.params["b1"]) @ state.params["w2"]
                                    + state.params["b2"], -1) == yd))
    print(f"  IVON, {k} weight samples per step (one per device): training accuracy after 20 epochs {acc:.3f}, "
          f"last batch loss {float(info.loss):.3f}")


if __name__ == "__main__":
    main()
