"""IVON step cost vs optax.adamw on the same MLP and batch (time and XLA's bytes accessed), and the digits comparison.

    python bench/bench_ivon.py [--sizes 784,1024,1024,10] [--batch 256] [--rounds 9] [--steps 300]
                               [--cost-only] [--no-digits]

Default: the 26k-weight digits MLP on a digits batch of 64, then the digits comparison of
``examples/digits_ivon.py`` (seeds 0-4). ``--sizes``/``--batch`` give an MLP of any widths on a synthetic batch
(the digits comparison is then skipped). For every step the table gives XLA's cost analysis of the compiled step
(``jax.jit(step).lower(...).compile().cost_analysis()``): bytes accessed in passes over the parameters and flops,
next to AdamW's (device-independent: it can be judged on a machine without a GPU), and, unless ``--cost-only``,
the median time over alternating rounds (every step jitted, warmed up and timed in turn in the same process, so
the ratios are insensitive to the machine's load). AdamW and IVON use the same batch, loss, parameters and
``jax.value_and_grad``; IVON derives its key inside jit (``fold_in``), as a training loop does. On a CPU the
header says how many threads the steps were compiled for and whether XLA splits their loops between them
(``taskset -c 0`` pins one core; docs/deep-learning.md, "Steps on a multi-core CPU").
"""

import argparse
import os
import sys

import jax
import jax.numpy as jnp

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "examples"))
from bench_cost import SIZES, adamw_steps, algorithm_step, parse_sizes, problem, report  # noqa: E402
from digits_ivon import compare, loss_fn, make_ivon, print_summary  # noqa: E402

from numpyro_blr.tree import standard_normal  # noqa: E402


def baseline_steps(params, xb, yb):
    """``optax.adamw`` and the gradient with plain SGD (see bench/bench_cost.py), as jitted steps."""
    return {k: (jax.jit(f), c) for k, (f, c) in adamw_steps(params, loss_fn, xb, yb).items()}


def step_functions(sizes=None, batch=None, pieces=True, dtype=None):
    """``(fns, params, label)``: AdamW, gradient + SGD, IVON (noise_rng 'hash' and 'jax') and, with ``pieces``, the
    draw of one normal per weight alone."""
    params, xb, yb, n, label = problem(sizes, batch)
    if dtype is not None:
        params = jax.tree.map(lambda x: x.astype(dtype), params)
        xb = xb.astype(dtype)
        label += f", params {jnp.dtype(dtype).name}"
    n_params = sum(x.size for x in jax.tree.leaves(params))
    fns = adamw_steps(params, loss_fn, xb, yb)
    key = jax.random.key(1)
    for rng in ("hash", "jax"):
        opt = make_ivon(n, noise_rng=rng)
        fns[f"IVON step, noise_rng={rng!r}"] = (algorithm_step(opt, loss_fn, xb, yb), (jnp.int32(0), opt.init(params)))
        if pieces:
            def draw(carry, rng=rng):  # the noise alone: n_params normals from a fresh key
                i, acc = carry
                return i + 1, acc + standard_normal(jax.random.fold_in(key, i), n_params, jnp.float32, rng)

            fns[f"{n_params} normals, {rng!r}"] = (draw, (jnp.int32(0), jnp.zeros(n_params)))
    return fns, params, label


def bench_steps(rounds=9, sizes=None, batch=None, steps=300, timing=True, dtype=None):
    fns, params, label = step_functions(sizes, batch, dtype=dtype)
    return report(fns, params, label, rounds, steps, timing, width=32)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--sizes", type=parse_sizes, default=None, help="MLP widths, e.g. 784,1024,1024,10 (default: digits)")
    ap.add_argument("--batch", type=int, default=None, help="batch size (default: 64 for digits, 256 otherwise)")
    ap.add_argument("--rounds", type=int, default=9)
    ap.add_argument("--steps", type=int, default=300, help="steps per timed round")
    ap.add_argument("--cost-only", action="store_true", help="only XLA's cost analysis, no timing")
    ap.add_argument("--bf16", action="store_true", help="bfloat16 parameters and inputs (IVON keeps its state in float32)")
    ap.add_argument("--no-digits", action="store_true", help="only the step costs")
    args = ap.parse_args()
    bench_steps(args.rounds, args.sizes, args.batch, args.steps, not args.cost_only,
                jnp.bfloat16 if args.bf16 else None)
    if not args.no_digits and args.sizes in (None, SIZES) and not args.cost_only:
        print()
        seeds = (0, 1, 2, 3, 4)
        per_seed, _ = compare(seeds=seeds)
        print_summary(per_seed, seeds)


if __name__ == "__main__":
    main()
