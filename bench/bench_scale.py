"""Data-parallel steps (numpyro_blr.parallel): time per step and examples/s on 1 and all devices.

    python bench/bench_scale.py                       # any host: CPU, one GPU, several GPUs (unchanged)
    taskset -c 0 python bench/bench_scale.py          # CPU: pinned to one core (the overhead figure)
    python bench/bench_scale.py --emulate 4           # CPU: 4 emulated devices, weak scaling (correctness only)

Prints, for nb.BLR (AutoMultivariateNormal), nb.IVON (AutoNormal) and numpyro's Adam (optax.adam) on the
same SVI step of a logistic regression (N examples, D features):

1. ``overhead``: the step with the data placed by ``nb.shard_data`` on a one-device mesh vs the same step
   on plain arrays, alternated in one process (median of rounds): the sharding machinery when unused.
2. ``throughput``: per-step time and examples/s on one device and on all devices of the host, and each
   step's time as a multiple of Adam's on the same devices. Meaningful with real accelerators.
3. ``weak scaling`` (``--emulate K`` on CPU, or several devices): N per device fixed, 1..K devices; on
   emulated CPU devices the time is not a speed measure, so only the agreement with the one-device fit
   of the same data is printed.
"""

import argparse
import os
import sys
import time

parser = argparse.ArgumentParser()
parser.add_argument("--emulate", type=int, default=0, help="CPU only: emulate this many devices (XLA flag)")
parser.add_argument("--n", type=int, default=16384, help="examples per device")
parser.add_argument("--d", type=int, default=32, help="features")
parser.add_argument("--steps", type=int, default=200, help="steps per timed round")
parser.add_argument("--rounds", type=int, default=7)
args = parser.parse_args()
if args.emulate:
    os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + f" --xla_force_host_platform_device_count={args.emulate}"
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import numpyro  # noqa: E402
import numpyro.distributions as dist  # noqa: E402
import optax  # noqa: E402
from numpyro.infer import SVI, Trace_ELBO  # noqa: E402
from numpyro.infer.autoguide import AutoMultivariateNormal, AutoNormal  # noqa: E402
from numpyro.optim import optax_to_numpyro  # noqa: E402

import numpyro_blr as nb  # noqa: E402


def model(X, y=None):
    w = numpyro.sample("w", dist.Normal(0.0, 1.0).expand([X.shape[1]]).to_event(1))
    with numpyro.plate("data", X.shape[0]):
        numpyro.sample("y", dist.Bernoulli(logits=X @ w), obs=y)


def data(n, d, seed=0):
    rng = np.random.default_rng(seed)
    X = rng.normal(size=(n, d)).astype(np.float32) / np.sqrt(d)
    w = rng.normal(size=d).astype(np.float32)
    y = (rng.uniform(size=n) < 1 / (1 + np.exp(-X @ w))).astype(np.float32)
    return X, y


OPTIMS = {
    "nb.BLR (AutoMultivariateNormal)": (AutoMultivariateNormal, lambda n: nb.BLR()),
    "nb.IVON (AutoNormal)": (AutoNormal, lambda n: nb.IVON(0.1, ess=n, beta2=0.999)),
    "Adam (AutoMultivariateNormal)": (AutoMultivariateNormal, lambda n: optax_to_numpyro(optax.adam(1e-2))),
    "Adam (AutoNormal)": (AutoNormal, lambda n: optax_to_numpyro(optax.adam(1e-2))),
}
ADAM_OF = {"nb.BLR (AutoMultivariateNormal)": "Adam (AutoMultivariateNormal)", "nb.IVON (AutoNormal)": "Adam (AutoNormal)"}


class Step:
    """A jitted svi.update on given data, its state replicated on the mesh."""

    def __init__(self, name, mesh, X, y):
        guide_cls, make = OPTIMS[name]
        self.svi = SVI(model, guide_cls(model), make(X.shape[0]), Trace_ELBO())
        state = self.svi.init(jax.random.PRNGKey(0), X, y)
        self.state = nb.replicate(mesh, state) if mesh is not None else state
        self.update, self.data = jax.jit(self.svi.update), (X, y)
        for _ in range(3):  # compile (the first output's placement may differ from the input's)
            self.state, loss = self.update(self.state, *self.data)
        loss.block_until_ready()

    def run(self, steps):
        t = time.perf_counter()
        for _ in range(steps):
            self.state, loss = self.update(self.state, *self.data)
        loss.block_until_ready()
        return (time.perf_counter() - t) / steps


def alternate(steps, rounds, nsteps):
    """Median time per step of each Step, measured in alternation (round-robin) in this process."""
    times = {k: [] for k in steps}
    for _ in range(rounds):
        for k, s in steps.items():
            times[k].append(s.run(nsteps))
    return {k: float(np.median(v)) for k, v in times.items()}


def main():
    devs = jax.devices()
    k = len(devs)
    print(f"jax {jax.__version__}, {k} {devs[0].platform} device(s): {devs[0].device_kind}; "
          f"{args.n} examples per device, D={args.d}; median of {args.rounds} alternated rounds of {args.steps} steps")
    one = nb.data_mesh(devs[:1])

    # 1. overhead of the sharding machinery on one device
    X, y = data(args.n, args.d)
    Xs, ys = nb.shard_data(one, X, y, model=model)
    print("\n1. one device: data placed with nb.shard_data vs plain arrays (target <= 1.05x)")
    for name in ("nb.BLR (AutoMultivariateNormal)", "nb.IVON (AutoNormal)"):
        steps = {"plain": Step(name, None, jnp.asarray(X), jnp.asarray(y)), "sharded": Step(name, one, Xs, ys)}
        t = alternate(steps, args.rounds, args.steps)
        print(f"   {name:34s} plain {t['plain'] * 1e3:7.3f} ms   sharded {t['sharded'] * 1e3:7.3f} ms   "
              f"ratio {t['sharded'] / t['plain']:.3f}")

    # 2. throughput on one and on all devices (strong scaling: the same N*k examples)
    n_total = args.n * k
    X, y = data(n_total, args.d)
    emulated = devs[0].platform == "cpu" and k > 1
    print(f"\n2. throughput, {n_total} examples per step" + (" (emulated CPU devices: not a speed measure)" if emulated else ""))
    for label, mesh in (("1 device", one), (f"{k} devices", nb.data_mesh(devs))):
        if label != "1 device" and k == 1:
            break
        Xs, ys = nb.shard_data(mesh, X, y)
        steps = {name: Step(name, mesh, Xs, ys) for name in OPTIMS}
        t = alternate(steps, args.rounds, args.steps)
        for name, s in t.items():
            ratio = f"{s / t[ADAM_OF[name]]:5.2f}x Adam, same guide" if name in ADAM_OF else ""
            print(f"   {label:10s} {name:34s} {s * 1e3:8.3f} ms/step  {n_total / s:12.0f} examples/s  {ratio}")

    # 3. weak scaling: N per device fixed; the fit on j devices vs one device on the same data
    if k > 1:
        print("\n3. weak scaling (N per device fixed): |params(j devices) - params(1 device)|, same data and keys"
              + ("; times on emulated CPU devices are not a speed measure" if emulated else ""))
        j = 1
        while j <= k:
            X, y = data(args.n * j, args.d, seed=j)
            fits = {}
            for label, mesh in (("one", one), ("many", nb.data_mesh(devs[:j]))):
                Xs, ys = nb.shard_data(mesh, X, y)
                s = Step("nb.BLR (AutoMultivariateNormal)", mesh, Xs, ys)
                dt = s.run(50)
                fits[label] = (s.svi.get_params(s.state), dt)
            diff = max(float(np.max(np.abs(np.asarray(fits["one"][0][n]) - np.asarray(fits["many"][0][n])))) for n in fits["one"][0])
            print(f"   {j} device(s), {args.n * j:7d} examples: max |diff| {diff:.2e}   "
                  f"({fits['many'][1] * 1e3:.2f} ms/step)")
            j *= 2


if __name__ == "__main__":
    main()
