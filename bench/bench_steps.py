"""How many steps the default ``nb.BLR()`` needs for NUTS-quality means on breast cancer.

The case is ``breast_cancer_standardised`` of ``bench/robustness_cases.py`` (logistic regression,
569 x 30 standardised predictors and an intercept: 31 coefficients; reference: float64 NUTS,
2 x 5000 draws). For each guide (AutoMultivariateNormal, AutoNormal) and seeds 0-4,
``SVI(model, guide, nb.BLR(), Trace_ELBO())`` runs from ``PRNGKey(seed)`` for the largest
checkpoint's number of steps in one jitted ``lax.scan`` (as ``SVI.run``), reading ``get_params``
(what ``SVI.run`` returns) at each checkpoint. Per checkpoint it prints, per seed and their max:

  err   max over the 31 coefficients of |guide mean - NUTS mean| / NUTS sd (unconstrained space)
  err*  the same against the KL-optimal Gaussian of the guide's family (full covariance for
        AutoMultivariateNormal, diagonal for AutoNormal; ``robustness_cases.optimal_gaussian``
        with 32,000 draws, whose own error is about 0.006 sd), still in NUTS sds: how far the fit
        is from where it converges to. For AutoNormal this is the number to read: the mean-field
        optimum itself is 0.185 NUTS-sd from NUTS's means (and its sds 0.44-0.72x).
  sd    the range of guide sd / NUTS sd over the coefficients and seeds

The target of issue 24 is err <= 0.05 after 100 steps on every seed (AutoMultivariateNormal).
``--floor`` adds what an ideal run could reach with one sample per step (``Trace_ELBO()``'s
default): start at the full-covariance optimum and average n independent one-sample mean steps
exactly (the Polyak-Ruppert limit, no approach, no correlation between steps); prints, over 2,000
replicates, the median and 90% point of err and the chance that err <= 0.05.

Run: python bench/bench_steps.py [--float32] [--steps 50,100,200,400] [--seeds 0,1,2,3,4]
     [--guides MVN,MF] [--case NAME] [--particles K] [--floor]
"""

import argparse
import os
import sys
import time

FLOAT32 = "--float32" in sys.argv
import numpyro  # noqa: E402

if not FLOAT32:
    numpyro.enable_x64()

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax import lax  # noqa: E402
from numpyro.infer import SVI, Trace_ELBO  # noqa: E402
from numpyro.infer.autoguide import AutoMultivariateNormal, AutoNormal  # noqa: E402

import numpyro_blr as nb  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import robustness_cases as rc  # noqa: E402

GUIDES = {"MVN": AutoMultivariateNormal, "MF": AutoNormal}
OPTIMUM_DRAWS = 32000
TARGET = 0.05


def fit_checkpoints(case, guide_cls, seeds, checkpoints, particles=1):
    """``{seed: [params at each checkpoint]}`` and the guide (one compiled scan for all seeds)."""
    guide = guide_cls(case.model)
    svi = SVI(case.model, guide, nb.BLR(), Trace_ELBO(num_particles=particles))
    args, kwargs = case.args, case.kwargs
    lengths = np.diff([0] + list(checkpoints))

    def run(state):
        out = []
        for n in lengths:  # checkpoints are few: one scan per segment
            state, _ = lax.scan(lambda s, _: svi.update(s, *args, **kwargs), state, None, length=int(n))
            out.append(svi.get_params(state))
        return out

    run = jax.jit(run)
    results = {}
    for seed in seeds:
        state = svi.init(jax.random.PRNGKey(seed), *args, **kwargs)
        results[seed] = jax.device_get(run(state))
    return guide, results


def optimum(case, diagonal):
    """``{site: (mean, sd)}`` of the KL-optimal Gaussian of the family, and its flat moments."""
    _, fit, m, cov, index = rc.optimal_gaussian(case, n=OPTIMUM_DRAWS, diagonal=diagonal)
    return fit, m, cov, index


def mean_error(ref, fit, against):
    """max |fit mean - against mean| / ref sd over all coordinates."""
    return max(float(np.max(np.abs(np.asarray(fit[k][0]) - np.asarray(against[k][0])) / np.asarray(ref[k][1])))
               for k in ref)


def floor(case, ref, checkpoints, replicates=2000, draws=20000):
    """err of the Polyak-Ruppert limit (module docstring): the optimum plus the mean of n independent
    one-sample mean steps Sigma (grad - S (z - m)), for n in ``checkpoints``."""
    from jax.flatten_util import ravel_pytree
    from numpyro.infer.util import initialize_model

    _, m, cov, index = optimum(case, diagonal=False)
    with jax.enable_x64(True):
        info = initialize_model(jax.random.PRNGKey(0), case.model, model_args=case.args, model_kwargs=case.kwargs)
        _, unravel = ravel_pytree(info.param_info.z)  # sorted sites, as optimal_gaussian's index
        grad = jax.jit(jax.vmap(jax.grad(lambda v: info.potential_fn(unravel(v)))))
        chol = np.linalg.cholesky(cov)
        eps = np.asarray(jax.random.normal(jax.random.PRNGKey(3), (draws, m.size)), np.float64)
        z = m + eps @ chol.T
        g = np.asarray(grad(jnp.asarray(z)), np.float64)
    step = g @ cov - (z - m)  # Sigma g - (z - m): the mean step's noise (Sigma symmetric)
    step -= step.mean(0)  # at the exact optimum its mean is zero
    keys = sorted(index)
    ref_m = np.concatenate([np.asarray(ref[k][0]).reshape(-1) for k in keys])
    ref_sd = np.concatenate([np.asarray(ref[k][1]).reshape(-1) for k in keys])
    offset = (m - ref_m) / ref_sd
    rng = np.random.default_rng(0)
    out = {}
    for n in checkpoints:
        errs = np.array([np.max(np.abs(offset + step[rng.integers(0, draws, n)].mean(0) / ref_sd))
                         for _ in range(replicates)])
        out[n] = (float(np.median(errs)), float(np.quantile(errs, 0.9)), float(np.mean(errs <= TARGET)))
    per_step = np.std(step, axis=0) / ref_sd
    return float(np.max(np.abs(offset))), float(np.median(per_step)), float(np.max(per_step)), out


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--case", default="breast_cancer_standardised")
    ap.add_argument("--steps", default="50,100,200,400", help="comma-separated checkpoints")
    ap.add_argument("--seeds", default="0,1,2,3,4")
    ap.add_argument("--guides", default="MVN,MF")
    ap.add_argument("--float32", action="store_true", help="run in float32 (default: float64)")
    ap.add_argument("--particles", type=int, default=1, help="Trace_ELBO(num_particles=...) (default 1)")
    ap.add_argument("--floor", action="store_true", help="also print the one-sample-per-step floor")
    args = ap.parse_args()
    checkpoints = [int(s) for s in args.steps.split(",")]
    seeds = [int(s) for s in args.seeds.split(",")]
    case = rc.get(args.case)
    ref = rc.unconstrained_moments(case, case.reference())
    print(f"{case.name} (d={rc.n_params(case)}), nb.BLR() default, Trace_ELBO(num_particles={args.particles}), "
          f"{'float32' if args.float32 else 'float64'}, jax {jax.__version__}, numpyro {numpyro.__version__}")
    print("err: max |mean - NUTS mean| / NUTS sd; err*: the same against the family's KL-optimal Gaussian; "
          "sd: guide sd / NUTS sd")
    worst = {}
    for gname in args.guides.split(","):
        opt = optimum(case, diagonal=gname == "MF")[0]
        t0 = time.perf_counter()
        guide, results = fit_checkpoints(case, GUIDES[gname], seeds, checkpoints, args.particles)
        secs = time.perf_counter() - t0
        c = rc.compare(ref, opt)
        print(f"\n{GUIDES[gname].__name__} ({secs:.1f} s for {len(seeds)} fits, compilation included); "
              f"its KL-optimal Gaussian: err {c.mean_err:.3f}, sd {c.sd_ratio_min:.2f}-{c.sd_ratio_max:.2f}")
        seed_cols = " ".join(f"{'s' + str(s):>5s}" for s in seeds)
        print(f"  {'steps':>5s} | err   {seed_cols}   max | err*  {seed_cols}   max | sd")
        for j, n in enumerate(checkpoints):
            errs, stars, lo, hi = [], [], np.inf, -np.inf
            for s in seeds:
                fit = rc.guide_moments(guide, results[s][j], case, exact=True)
                cmp = rc.compare(ref, fit)
                errs.append(cmp.mean_err)
                stars.append(mean_error(ref, fit, opt))
                lo, hi = min(lo, cmp.sd_ratio_min), max(hi, cmp.sd_ratio_max)
            worst[(gname, n)] = (max(errs), max(stars))
            print(f"  {n:5d} |       " + " ".join(f"{e:5.3f}" for e in errs) + f" {max(errs):5.3f} |       "
                  + " ".join(f"{e:5.3f}" for e in stars) + f" {max(stars):5.3f} | {lo:.2f}-{hi:.2f}")
    print()
    for (gname, n), (e, e_star) in worst.items():
        if n == 100:
            print(f"{gname}: after 100 steps, max over seeds {seeds}: err {e:.3f}, err* {e_star:.3f} "
                  f"(target err <= {TARGET}: {'met' if e <= TARGET else 'missed'})")
    if args.floor:
        offset, med, top, out = floor(case, ref, checkpoints)
        print(f"\none-sample-per-step floor (full-covariance optimum, which is {offset:.3f} NUTS-sd from NUTS's means; "
              f"one step's mean noise: median {med:.3f}, largest {top:.3f} NUTS-sd per coefficient):")
        for n, (median, q90, p) in out.items():
            print(f"  {n:5d} steps averaged: err median {median:.3f}, 90% {q90:.3f}; P(err <= {TARGET}) {p:.2f}, "
                  f"on {len(seeds)} of {len(seeds)} seeds {p ** len(seeds):.2f}")


if __name__ == "__main__":
    main()
