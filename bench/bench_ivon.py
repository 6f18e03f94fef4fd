"""IVON step cost vs optax.adamw on the same MLP and batch, and the digits comparison.

    python bench/bench_ivon.py

Both steps are jitted, warmed up, and timed alternately in the same process (median of
several rounds of 200 steps), so the printed ratio is insensitive to the machine's load.
"""

import os
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import optax

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "examples"))
from digits_ivon import BATCH, SIZES, compare, init_mlp, load_data, loss_fn, make_ivon, print_rows  # noqa: E402


def time_steps(step, carry, n=200):
    carry = step(carry)
    jax.block_until_ready(carry)
    t0 = time.perf_counter()
    for _ in range(n):
        carry = step(carry)
    jax.block_until_ready(carry)
    return (time.perf_counter() - t0) / n, carry


def main(rounds=7):
    x_tr, _, y_tr, _ = load_data()
    xb, yb = jnp.asarray(x_tr[:BATCH]), jnp.asarray(y_tr[:BATCH])
    params = init_mlp(jax.random.key(0))

    opt = make_ivon(len(y_tr))
    key = jax.random.key(1)

    @jax.jit
    def ivon_step(carry):
        i, state = carry
        state, _ = opt.step(jax.random.fold_in(key, i), state, loss_fn, xb, yb)
        return i + 1, state

    tx = optax.adamw(1e-3, weight_decay=1e-4)  # step cost does not depend on the lr value

    @jax.jit
    def adamw_step(carry):
        p, s = carry
        g = jax.grad(loss_fn)(p, xb, yb)
        u, s = tx.update(g, s, p)
        return optax.apply_updates(p, u), s

    ci, ca = (jnp.int32(0), opt.init(params)), (params, tx.init(params))
    t_ivon, t_adam = [], []
    for _ in range(rounds):
        t, ci = time_steps(ivon_step, ci)
        t_ivon.append(t)
        t, ca = time_steps(adamw_step, ca)
        t_adam.append(t)
    ti, ta = statistics.median(t_ivon), statistics.median(t_adam)
    print(f"MLP {SIZES}, batch {BATCH}, {jax.device_count()} {jax.default_backend()} device(s)")
    print(f"IVON step (1 MC sample): {1e3 * ti:.3f} ms   optax.adamw step: {1e3 * ta:.3f} ms   ratio {ti / ta:.2f}x")
    print()
    rows, _ = compare()
    print_rows(rows)


if __name__ == "__main__":
    main()
