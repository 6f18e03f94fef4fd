"""Measuring a fit: the ELBO along the run (with many particles) and the time per step.

SVI's own loss trace is a one-sample estimate; to compare optimizers fairly these helpers
re-evaluate the ELBO at checkpoints with many particles and common random numbers (the same
evaluation key at every checkpoint and for every optimizer).
"""

import time
import warnings
from typing import NamedTuple

import jax
import numpy as np
from numpyro.infer import Trace_ELBO


class ELBOCurve(NamedTuple):
    steps: np.ndarray  # checkpoints (number of steps taken)
    elbo: np.ndarray  # ELBO (not the loss: higher is better) at each checkpoint
    params: dict  # parameters at the last step
    state: object  # SVIState at the last step


def elbo_curve(svi, rng_key, num_steps, *args, checkpoints=None, num_particles=1000, eval_key=None, **kwargs):
    """Run ``svi`` for ``num_steps`` and return the ELBO at ``checkpoints`` (default: every step).

    The ELBO is ``-Trace_ELBO(num_particles).loss`` evaluated with ``eval_key`` (fixed), so
    curves of different optimizers on the same model and guide are directly comparable.
    """
    checkpoints = np.arange(0, num_steps + 1) if checkpoints is None else np.asarray(sorted(set(checkpoints)))
    eval_key = jax.random.PRNGKey(12345) if eval_key is None else eval_key
    estimator = Trace_ELBO(num_particles=num_particles)

    @jax.jit
    def evaluate(params):
        return -estimator.loss(eval_key, params, svi.model, svi.guide, *args, **kwargs)

    update = jax.jit(lambda s: svi.update(s, *args, **kwargs))
    state = svi.init(rng_key, *args, **kwargs)
    out = []
    for t in range(num_steps + 1):
        if t in checkpoints:
            with warnings.catch_warnings():  # a checkpoint is not the end of the run: report once, below
                warnings.simplefilter("ignore", RuntimeWarning)
                params = svi.get_params(state)
            out.append(float(evaluate(params)))
        if t < num_steps:
            state, _ = update(state)
    return ELBOCurve(checkpoints, np.asarray(out), svi.get_params(state), state)


def steps_to_reach(curve, target, tol=1.0):
    """First checkpoint at which the ELBO is within ``tol`` nats of ``target`` (None if never)."""
    hit = np.nonzero(curve.elbo >= target - tol)[0]
    return int(curve.steps[hit[0]]) if hit.size else None


def time_per_step(svi, rng_key, *args, num_steps=500, repeats=3, **kwargs):
    """Seconds per SVI step inside ``svi.run(progress_bar=False)`` (one ``lax.scan``), compile excluded.

    Takes the best of ``repeats`` timed runs after one warm-up run of the same length.
    """
    run = jax.jit(lambda key: svi.run(key, num_steps, *args, progress_bar=False, **kwargs).losses)
    jax.block_until_ready(run(rng_key))
    best = float("inf")
    for i in range(repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(run(jax.random.fold_in(rng_key, i)))
        best = min(best, time.perf_counter() - t0)
    return best / num_steps


def time_per_step_alternating(svis, rng_key, *args, num_steps=300, rounds=7, **kwargs):
    """Seconds per step of several SVI objects, timed in alternating rounds (best of ``rounds``).

    Each ``svi.run(progress_bar=False)`` is compiled and warmed up first; then every round times
    each of them once, in turn. On a machine whose speed drifts (shared or throttled CPUs) the
    *ratios* between the results are then much more stable than with :func:`time_per_step`
    called one after the other. Returns a list in the order of ``svis``.
    """
    runs = [jax.jit(lambda key, svi=svi: svi.run(key, num_steps, *args, progress_bar=False, **kwargs).losses) for svi in svis]
    for run in runs:
        jax.block_until_ready(run(rng_key))
    best = [float("inf")] * len(runs)
    for i in range(rounds):
        for j, run in enumerate(runs):
            t0 = time.perf_counter()
            jax.block_until_ready(run(jax.random.fold_in(rng_key, i)))
            best[j] = min(best[j], time.perf_counter() - t0)
    return [b / num_steps for b in best]
