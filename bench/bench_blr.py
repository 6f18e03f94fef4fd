"""Benchmark: nb.BLR vs NumPyro's Adam on the same model and guide, measured in the same run.

For breast-cancer logistic regression and diabetes linear regression (known noise), with
AutoNormal and AutoMultivariateNormal, and for a larger model where the sampled estimators are
the default (multinomial logistic regression on the digits, 650 weights, AutoNormal), prints for
each optimizer:
  - steps to come within 1 nat of the reference ELBO (Adam(0.01)'s ELBO after ADAM_STEPS steps),
  - its final ELBO (1000-particle estimate, common random numbers),
  - time per step (inside one lax.scan, compile excluded; all optimizers timed in alternating
    rounds, best of 7) and the ratio to an Adam(0.01) step.

Run: python bench/bench_blr.py [--quick]
"""

import argparse
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np
import numpyro
import numpyro.distributions as dist
from numpyro.infer import SVI, Trace_ELBO
from numpyro.infer.autoguide import AutoMultivariateNormal, AutoNormal
from sklearn.datasets import load_breast_cancer, load_diabetes, load_digits

import numpyro_blr as nb
from numpyro_blr.monitor import elbo_curve, steps_to_reach, time_per_step_alternating

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "examples"))
from logistic_regression import linear_model as linear_model_with_noise  # noqa: E402
from logistic_regression import logistic_model, standardise_with_intercept  # noqa: E402


def linear_model(X, y=None):
    """The diabetes model of the demo, with the noise s.d. fixed at 0.7."""
    return linear_model_with_noise(X, y, noise=0.7)


def softmax_model(X, y=None):
    w = numpyro.sample("w", dist.Normal(0.0, 1.0).expand([X.shape[1], 10]).to_event(2))
    numpyro.sample("y", dist.Categorical(logits=X @ w), obs=y)


def datasets():
    X, y = load_breast_cancer(return_X_y=True)
    guides = (AutoNormal, AutoMultivariateNormal)
    small = dict(adam_every=25, blr_every=1, num_particles=1000)
    yield "logistic/breast-cancer", logistic_model, jnp.asarray(standardise_with_intercept(X), jnp.float32), jnp.asarray(y, jnp.float32), guides, small
    X, y = load_diabetes(return_X_y=True)
    yield "linear/diabetes", linear_model, jnp.asarray(standardise_with_intercept(X), jnp.float32), jnp.asarray((y - y.mean()) / y.std(), jnp.float32), guides, small
    X, y = load_digits(return_X_y=True)
    X = X[:, X.std(0) > 0]  # drop the always-blank pixels
    yield "softmax/digits (650 weights)", softmax_model, jnp.asarray(standardise_with_intercept(X), jnp.float32), jnp.asarray(y), (AutoNormal,), \
        dict(adam_every=100, blr_every=10, num_particles=200)  # ELBO checkpoints cost 0.2 GFLOP each here


def main(adam_steps, blr_steps):
    key = jax.random.PRNGKey(0)
    optimizers = [  # name, constructor, steps, is Adam (checkpoint spacing)
        ("Adam(0.01)", lambda: numpyro.optim.Adam(0.01), adam_steps, True),
        ("Adam(0.05)", lambda: numpyro.optim.Adam(0.05), adam_steps, True),
        ("BLR()", lambda: nb.BLR(), blr_steps, False),
        ("BLR(reparam)", lambda: nb.BLR(hessian="reparam"), blr_steps, False),
        ("BLR(price)", lambda: nb.BLR(hessian="price"), blr_steps, False),
    ]
    for data_name, model, X, y, guides, opts in datasets():
        for guide_cls in guides:
            rows = []
            for name, make, steps, is_adam in optimizers:
                svi = SVI(model, guide_cls(model), make(), Trace_ELBO())
                every = opts["adam_every"] if is_adam else opts["blr_every"]
                curve = elbo_curve(
                    svi, key, steps, X, y, checkpoints=range(0, steps + 1, every), num_particles=opts["num_particles"]
                )
                rows.append((name, curve))
            # fresh SVI objects (a guide is set up once per trace), timed in alternating rounds
            svis = [SVI(model, guide_cls(model), make(), Trace_ELBO()) for _, make, _, _ in optimizers]
            secs = time_per_step_alternating(svis, key, X, y, num_steps=300)
            rows = [(name, curve, sec) for (name, curve), sec in zip(rows, secs)]
            reference = rows[0][1].elbo[-1]
            adam_sec = rows[0][2]
            print(f"\n{data_name}, {guide_cls.__name__}: reference ELBO {reference:.2f} (Adam(0.01) after {adam_steps} steps)")
            print(f"  {'optimizer':<14}{'steps to 1 nat':>15}{'final ELBO':>12}{'us/step':>10}{'x Adam(0.01) step':>19}")
            for name, curve, sec in rows:
                reach = steps_to_reach(curve, reference)
                reach = f"{reach}" if reach is not None else f">{curve.steps[-1]}"
                print(f"  {name:<14}{reach:>15}{curve.elbo[-1]:>12.2f}{1e6 * sec:>10.1f}{sec / adam_sec:>19.2f}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    main(adam_steps=1000 if args.quick else 4000, blr_steps=400)
