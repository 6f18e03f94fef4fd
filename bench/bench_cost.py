"""Shared pieces of bench/bench_ivon.py and bench/bench_liegroup.py: networks of any size, XLA's cost analysis of a
compiled step (bytes accessed in passes over the parameters, flops) and the alternating-round timing.

A *pass* is one read or one write of every parameter: ``bytes accessed / parameter bytes`` of the compiled step.
AdamW's update is 7 of them (read g, m, v, w; write m, v, w) on top of the gradient's own traffic, so the passes
of a step compared with AdamW's say how much memory traffic an optimizer adds, independently of the machine (the
figure is XLA's estimate for the backend that compiled the step: CPU here, GPU there).
"""

import os
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "examples"))
from digits_ivon import BATCH, SIZES, init_mlp, load_data  # noqa: E402


def parse_sizes(text):
    sizes = tuple(int(s) for s in str(text).split(","))
    if len(sizes) < 2 or min(sizes) < 1:
        raise SystemExit(f"--sizes must be at least two positive layer widths like 784,1024,1024,10, got {text!r}")
    return sizes


def problem(sizes=None, batch=None, seed=0):
    """``(params, xb, yb, n_train, label)``: the digits MLP and a digits batch by default; for other ``sizes`` an MLP of
    those widths and a synthetic batch (standard normal inputs, uniform labels; the step cost does not depend on the
    values)."""
    sizes = SIZES if sizes is None else tuple(sizes)
    params = init_mlp(jax.random.key(seed), sizes)
    if sizes == SIZES:
        x_tr, _, y_tr, _ = load_data()
        batch = BATCH if batch is None else batch
        xb, yb, n = jnp.asarray(x_tr[:batch]), jnp.asarray(y_tr[:batch]), len(y_tr)
    else:
        batch = 256 if batch is None else batch
        rng = np.random.default_rng(seed)
        xb = jnp.asarray(rng.standard_normal((batch, sizes[0]), np.float32))
        yb = jnp.asarray(rng.integers(0, sizes[-1], batch).astype(np.int32))
        n = 50_000
    n_params = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(params))
    label = f"MLP {'-'.join(map(str, sizes))} ({n_params / 1e6:.2f}M weights), batch {batch}"
    return params, xb, yb, n, label


def param_bytes(params):
    return sum(int(np.prod(x.shape)) * jnp.dtype(x.dtype).itemsize for x in jax.tree.leaves(params))


def compiled(fn, carry):
    """``jax.jit(fn)`` lowered and compiled for ``carry`` once: its cost analysis and the executable that is timed."""
    return jax.jit(fn).lower(carry).compile()


def cost(exe, nbytes):
    """``(passes, flops)`` of a compiled step: XLA's 'bytes accessed' / ``nbytes`` and 'flops'."""
    ca = exe.cost_analysis()
    if isinstance(ca, (list, tuple)):  # older jax: one dict per computation
        ca = ca[0]
    return float(ca.get("bytes accessed", float("nan"))) / nbytes, float(ca.get("flops", float("nan")))


def adamw_steps(params, loss, *batch, lr=1e-3, with_sgd=True):
    """The baselines every step is compared with: ``optax.adamw`` and the gradient with plain SGD (same loss, batch
    and ``jax.value_and_grad``)."""
    tx = optax.adamw(lr, weight_decay=1e-4)  # the step cost does not depend on the lr value

    def adamw_step(carry):
        p, s = carry
        _, g = jax.value_and_grad(loss)(p, *batch)
        u, s = tx.update(g, s, p)
        return optax.apply_updates(p, u), s

    def grad_sgd(carry):  # the gradient plus the cheapest possible update
        _, g = jax.value_and_grad(loss)(carry, *batch)
        return jax.tree.map(lambda p, d: p - 1e-3 * d, carry, g)

    fns = {"optax.adamw step": (adamw_step, (params, tx.init(params)))}
    if with_sgd:
        fns["gradient + plain SGD"] = (grad_sgd, params)
    return fns


def algorithm_step(algo, loss, *batch, seed=1):
    """An ``nb`` row's step as ``carry -> carry`` with its key derived inside jit (``fold_in``), as a training loop."""
    key = jax.random.key(seed)

    def step(carry):
        i, state = carry
        state, _ = algo.step(jax.random.fold_in(key, i), state, loss, *batch)
        return i + 1, state

    return step


def time_steps(step, carry, n=300):
    carry = step(carry)
    jax.block_until_ready(carry)
    t0 = time.perf_counter()
    for _ in range(n):
        carry = step(carry)
    jax.block_until_ready(carry)
    return (time.perf_counter() - t0) / n, carry


def alternating_medians(fns, rounds, steps=300):
    """Median seconds per step of each ``name -> (step, carry)`` (a compiled executable or a function, jitted here),
    the steps timed in turn in each of ``rounds`` rounds of ``steps`` steps (so a change of machine load falls on all
    of them alike)."""
    fns = {k: (f if hasattr(f, "cost_analysis") else jax.jit(f), c) for k, (f, c) in fns.items()}
    times = {k: [] for k in fns}
    for _ in range(rounds):
        for k, (f, c) in list(fns.items()):
            t, c = time_steps(f, c, steps)
            fns[k] = (f, c)
            times[k].append(t)
    return {k: statistics.median(v) for k, v in times.items()}


def report(fns, params, label, rounds=9, steps=300, timing=True, width=42, note=""):
    """Print, for each step, XLA's passes over the parameters and flops next to AdamW's and (``timing``) the median
    time and its ratio to AdamW's; return ``{name: dict(passes, flops, seconds)}``."""
    nbytes = param_bytes(params)
    exes = {k: (compiled(f, c), c) for k, (f, c) in fns.items()}  # compiled once: costed, then timed
    rows = {k: dict(zip(("passes", "flops"), cost(e, nbytes))) for k, (e, c) in exes.items()}
    if timing:
        for k, t in alternating_medians(exes, rounds, steps).items():
            rows[k]["seconds"] = t
    ref = rows["optax.adamw step"]
    dev = f"{jax.device_count()} {jax.default_backend()} device(s) ({jax.devices()[0].device_kind})"
    if jax.default_backend() == "cpu":  # pinned (taskset -c 0) or not: XLA splits loops between the CPU's threads
        from numpyro_blr.tree import _cpu_threads, split_loops

        dev += f", {_cpu_threads()} CPU thread(s), loops split: {'yes' if split_loops() else 'no'}"
    print(f"{label}; {dev}{note}")
    how = f"; time: median of {rounds} alternating rounds of {steps} steps" if timing else ""
    print(f"  passes = XLA cost_analysis 'bytes accessed' / parameter bytes ({nbytes / 1e6:.1f} MB){how}")
    print(f"  {'step':<{width}} {'passes':>7} {'x adamw':>8} {'GFLOP':>8} {'x adamw':>8}"
          + (f" {'ms':>9} {'x adamw':>8}" if timing else ""))
    for k, r in rows.items():
        line = (f"  {k:<{width}} {r['passes']:7.1f} {r['passes'] / ref['passes']:8.2f} {r['flops'] / 1e9:8.3f} "
                f"{r['flops'] / ref['flops']:8.2f}")
        if timing:
            line += f" {1e3 * r['seconds']:9.3f} {r['seconds'] / ref['seconds']:8.2f}"
        print(line, flush=True)
    return rows
