"""IVON step cost vs optax.adamw on the same MLP and batch, and the digits comparison.

    python bench/bench_ivon.py [--no-digits]

Every step is jitted, warmed up, and the candidates are timed alternately in the same process
(median over rounds of 300 steps), so the printed ratios are insensitive to the machine's load.
AdamW and IVON use the same batch, loss, parameters and ``jax.value_and_grad``; IVON additionally
derives its key inside jit (``fold_in``), as a training loop does. The pieces (gradient alone,
the 26k-normal draw alone) are timed the same way, to show where IVON's extra time goes.
"""

import argparse
import os
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import optax
from jax.flatten_util import ravel_pytree

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "examples"))
from digits_ivon import BATCH, SIZES, compare, init_mlp, load_data, loss_fn, make_ivon, print_summary  # noqa: E402

from numpyro_blr.tree import standard_normal  # noqa: E402


def time_steps(step, carry, n=300):
    carry = step(carry)
    jax.block_until_ready(carry)
    t0 = time.perf_counter()
    for _ in range(n):
        carry = step(carry)
    jax.block_until_ready(carry)
    return (time.perf_counter() - t0) / n, carry


def baseline_steps(params, xb, yb):
    """The baselines every step is timed against: ``optax.adamw`` and the gradient with plain SGD."""
    fns = {}
    tx = optax.adamw(1e-3, weight_decay=1e-4)  # step cost does not depend on the lr value

    @jax.jit
    def adamw_step(carry):
        p, s = carry
        _, g = jax.value_and_grad(loss_fn)(p, xb, yb)
        u, s = tx.update(g, s, p)
        return optax.apply_updates(p, u), s

    fns["optax.adamw step"] = (adamw_step, (params, tx.init(params)))

    @jax.jit
    def grad_sgd(carry):  # the gradient plus the cheapest possible update
        _, g = jax.value_and_grad(loss_fn)(carry, xb, yb)
        return jax.tree.map(lambda p, d: p - 1e-3 * d, carry, g)

    fns["gradient + plain SGD"] = (grad_sgd, params)
    return fns


def step_functions():
    x_tr, _, y_tr, _ = load_data()
    xb, yb = jnp.asarray(x_tr[:BATCH]), jnp.asarray(y_tr[:BATCH])
    params = init_mlp(jax.random.key(0))
    n_params = ravel_pytree(params)[0].shape[0]
    key = jax.random.key(1)
    fns = baseline_steps(params, xb, yb)
    for rng in ("hash", "jax"):
        opt = make_ivon(len(y_tr), noise_rng=rng)

        @jax.jit
        def ivon_step(carry, opt=opt):
            i, state = carry
            state, _ = opt.step(jax.random.fold_in(key, i), state, loss_fn, xb, yb)
            return i + 1, state

        fns[f"IVON step, noise_rng={rng!r}"] = (ivon_step, (jnp.int32(0), opt.init(params)))

        @jax.jit
        def draw(carry, rng=rng):  # the noise alone: n_params normals from a fresh key
            i, acc = carry
            return i + 1, acc + standard_normal(jax.random.fold_in(key, i), n_params, jnp.float32, rng)

        fns[f"{n_params} normals, {rng!r}"] = (draw, (jnp.int32(0), jnp.zeros(n_params)))
    return fns


def alternating_medians(fns, rounds):
    """Median seconds per step of each ``name -> (jitted step, carry)``, the steps timed in turn in each
    of ``rounds`` rounds (so a change of machine load falls on all of them alike)."""
    times = {k: [] for k in fns}
    for _ in range(rounds):
        for k, (f, c) in list(fns.items()):
            t, c = time_steps(f, c)
            fns[k] = (f, c)
            times[k].append(t)
    return {k: statistics.median(v) for k, v in times.items()}


def print_ratios(med, rounds, note="", width=32):
    ta = med["optax.adamw step"]
    print(f"MLP {SIZES}, batch {BATCH}, {jax.device_count()} {jax.default_backend()} device(s); "
          f"median of {rounds} alternating rounds of 300 steps{note}")
    for k, t in med.items():
        print(f"  {k:<{width}} {1e3 * t:7.3f} ms   {t / ta:5.2f} x adamw")


def bench_steps(rounds=9):
    med = alternating_medians(step_functions(), rounds)
    print_ratios(med, rounds)
    return med


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--no-digits", action="store_true", help="only the step timings")
    args = ap.parse_args()
    bench_steps()
    if not args.no_digits:
        print()
        seeds = (0, 1, 2, 3, 4)
        per_seed, _ = compare(seeds=seeds)
        print_summary(per_seed, seeds)


if __name__ == "__main__":
    main()
