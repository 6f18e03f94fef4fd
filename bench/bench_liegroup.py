"""Lie-group BLR step cost vs optax.adamw on the same MLP and batch, and the digits targets.

    taskset -c 0 python bench/bench_liegroup.py [--no-digits] [--rounds 9]

Every step is jitted, warmed up, and the candidates are timed alternately in the same process (median over
rounds of 300 steps, as bench/bench_ivon.py), so the printed ratios are insensitive to the machine's load. Each
Lie-group rule takes one sample per step and derives its key inside jit (``fold_in``), as a training loop does;
AdamW and the rules use the same batch, loss, parameters and ``jax.value_and_grad``. Target (issue 14): every
group's step <= 1.2x an AdamW step with its default q0 (Gaussian for additive and affine, Rayleigh for the
signed multiplicative rule). A Student-t q0 is timed too: JAX draws it through its gamma sampler (threefry,
rejection), which is the cost of a q0 without a closed-form inverse CDF.

The digits part runs ``examples/digits_liegroup.py --cv`` (5 seeds x 5 folds; about 15 min on one core) and
prints its table and the targets: the multiplicative rule's near-zero first-layer fraction at least twice the
additive rule's with accuracy within 1 point, and the affine rule's model-average NLL at most AdamW's.
"""

import argparse
import os
import sys

import jax
import jax.numpy as jnp
import numpyro.distributions as dist

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "examples"))
from digits_ivon import BATCH, init_mlp, load_data, loss_fn  # noqa: E402

import numpyro_blr as nb  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_ivon import alternating_medians, baseline_steps, print_ratios  # noqa: E402


def step_functions():
    x_tr, _, y_tr, _ = load_data()
    xb, yb = jnp.asarray(x_tr[:BATCH]), jnp.asarray(y_tr[:BATCH])
    params = init_mlp(jax.random.key(0))
    n = len(y_tr)
    key = jax.random.key(1)
    fns = baseline_steps(params, xb, yb)
    rows = {
        "IVON (reference: a diagonal row)": nb.ivon(0.1, ess=n),
        "additive, Normal q0": nb.lie_additive(0.1, momentum=0.9, base=dist.Normal(0.0, 1e-3), weight_decay=1e-4),
        "multiplicative (signed), Rayleigh q0": nb.lie_multiplicative(1.0, ess=n, temperature=1e-3),
        "affine, Normal q0": nb.lie_affine(0.3, ess=n, scale_lr=0.01, weight_decay=1e-4),
        "affine, StudentT(3) q0 (threefry gamma)": nb.lie_affine(0.3, ess=n, scale_lr=0.01, base=dist.StudentT(3.0)),
    }
    for name, algo in rows.items():

        @jax.jit
        def lie_step(carry, algo=algo):
            i, state = carry
            state, _ = algo.step(jax.random.fold_in(key, i), state, loss_fn, xb, yb)
            return i + 1, state

        fns[name] = (lie_step, (jnp.int32(0), algo.init(params)))
    return fns


def bench_steps(rounds=9):
    med = alternating_medians(step_functions(), rounds)
    print_ratios(med, rounds, " (one sample per Lie-group step)", width=42)
    return med


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--no-digits", action="store_true", help="only the step timings")
    ap.add_argument("--rounds", type=int, default=9)
    args = ap.parse_args()
    bench_steps(args.rounds)
    if not args.no_digits:
        print()
        from digits_liegroup import cross_validated

        cross_validated()


if __name__ == "__main__":
    main()
