"""Lie-group BLR step cost vs optax.adamw on the same MLP and batch, and the digits targets.

    python bench/bench_liegroup.py [--no-digits] [--rounds 9]            # every CPU thread, as a user runs it
    taskset -c 0 python bench/bench_liegroup.py [--no-digits] [--rounds 9]   # one core: XLA splits no loop

The header says how many CPU threads the steps were compiled for and whether XLA splits their loops between them
(``numpyro_blr.tree.split_loops``; docs/deep-learning.md, "Steps on a multi-core CPU"): report which.

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

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "examples"))
from bench_cost import SIZES, adamw_steps, algorithm_step, parse_sizes, problem, report  # noqa: E402
from digits_ivon import loss_fn  # noqa: E402

import numpyro_blr as nb  # noqa: E402


def step_functions(sizes=None, batch=None, student_t=True, dtype=None):
    """``(fns, params, label)``: AdamW, gradient + SGD, IVON and the Lie-group rows, one sample per step."""
    params, xb, yb, n, label = problem(sizes, batch)
    if dtype is not None:
        params = jax.tree.map(lambda x: x.astype(dtype), params)
        xb = xb.astype(dtype)
        label += f", params {jnp.dtype(dtype).name}"
    fns = adamw_steps(params, loss_fn, xb, yb)
    rows = {
        "IVON (reference: a diagonal row)": nb.ivon(0.1, ess=n),
        "additive, Normal q0": nb.lie_additive(0.1, momentum=0.9, base=dist.Normal(0.0, 1e-3), weight_decay=1e-4),
        "multiplicative (signed), Rayleigh q0": nb.lie_multiplicative(1.0, ess=n, temperature=1e-3),
        "affine, Normal q0": nb.lie_affine(0.3, ess=n, scale_lr=0.01, weight_decay=1e-4),
    }
    if student_t:
        rows["affine, StudentT(3) q0 (threefry gamma)"] = nb.lie_affine(0.3, ess=n, scale_lr=0.01, base=dist.StudentT(3.0))
    for name, algo in rows.items():
        fns[name] = (algorithm_step(algo, loss_fn, xb, yb), (jnp.int32(0), algo.init(params)))
    return fns, params, label


def bench_steps(rounds=9, sizes=None, batch=None, steps=300, timing=True, student_t=True, dtype=None):
    fns, params, label = step_functions(sizes, batch, student_t, dtype)
    return report(fns, params, label, rounds, steps, timing, width=42, note=" (one sample per Lie-group step)")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--sizes", type=parse_sizes, default=None, help="MLP widths, e.g. 784,1024,1024,10 (default: digits)")
    ap.add_argument("--batch", type=int, default=None, help="batch size (default: 64 for digits, 256 otherwise)")
    ap.add_argument("--rounds", type=int, default=9)
    ap.add_argument("--steps", type=int, default=300, help="steps per timed round")
    ap.add_argument("--cost-only", action="store_true", help="only XLA's cost analysis, no timing")
    ap.add_argument("--no-student-t", action="store_true", help="leave out the Student-t q0 row")
    ap.add_argument("--bf16", action="store_true", help="bfloat16 parameters and inputs (state in float32)")
    ap.add_argument("--no-digits", action="store_true", help="only the step costs")
    args = ap.parse_args()
    bench_steps(args.rounds, args.sizes, args.batch, args.steps, not args.cost_only, not args.no_student_t,
                jnp.bfloat16 if args.bf16 else None)
    if not args.no_digits and args.sizes in (None, SIZES) and not args.cost_only:
        print()
        from digits_liegroup import cross_validated

        cross_validated()


if __name__ == "__main__":
    main()
