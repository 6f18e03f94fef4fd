"""Diagnose one (model, guide) run: nb.fit with several settings, ELBO against the KL-optimal Gaussian of the guide's
family (ELBO*, over 5 keys of 2000 particles, common random numbers per key), per-site errors against NUTS.

  python diag.py NAME GUIDE [--float32] [--configs 'nb.BLR()@1000' 'nb.BLR()@3000' 'nb.BLR(hessian="reparam")@1000']
"""
import argparse
import os
import sys
import warnings

ap = argparse.ArgumentParser()
ap.add_argument("name")
ap.add_argument("guide", choices=["MVN", "MF"])
ap.add_argument("--float32", action="store_true")
ap.add_argument("--configs", nargs="+", default=["nb.BLR()@1000", "nb.BLR()@3000", 'nb.BLR(hessian="reparam")@1000'])
A = ap.parse_args()
HERE = os.path.dirname(os.path.abspath(__file__))
os.environ.setdefault("ROBUSTNESS_CACHE", os.path.join(HERE, "cache"))

import jax  # noqa: E402

if not A.float32:
    jax.config.update("jax_enable_x64", True)
import numpy as np  # noqa: E402
import numpyro  # noqa: E402

import numpyro_blr as nb  # noqa: E402

sys.path.insert(0, HERE)
sys.path.insert(0, os.path.dirname(HERE))  # bench/: robustness_cases
import models as M  # noqa: E402
import robustness_cases as rc  # noqa: E402
from numpyro.infer import SVI, Trace_ELBO  # noqa: E402
from numpyro.infer.autoguide import AutoMultivariateNormal, AutoNormal  # noqa: E402

G = {"MVN": AutoMultivariateNormal, "MF": AutoNormal}[A.guide]
spec = M.SPECS[A.name]
args, kwargs = M.get_data(A.name, float32=A.float32)
results = []
for cfg in A.configs:
    expr, steps = cfg.rsplit("@", 1)
    guide = G(spec["model"])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            if expr.startswith("adam"):
                svi = SVI(spec["model"], guide, numpyro.optim.Adam(float(expr.split(":")[1])), Trace_ELBO())
                res = svi.run(jax.random.PRNGKey(0), int(steps), *args, progress_bar=False, **kwargs)
            else:
                res = nb.fit(spec["model"], guide, *args, optim=eval(expr, {"nb": nb}), num_steps=int(steps),
                             progress_bar=False, rng_key=jax.random.PRNGKey(0), **kwargs)
            params = {k: np.asarray(v, np.float64) for k, v in res.params.items()}
            err = None
        except Exception as e:  # noqa: BLE001
            params, err = None, f"{type(e).__name__}: {str(e)[:300]}"
    ws = [f"{w.category.__name__}: {str(w.message)[:300]}" for w in caught
          if not issubclass(w.category, (DeprecationWarning, FutureWarning))]
    results.append((cfg, params, ws, err))
    print(f"[{cfg}] {'ERROR ' + err if err else ''} warnings: {len(ws)}", flush=True)
    for w in ws:
        print("   ", w)

# evaluation in float64
jax.config.update("jax_enable_x64", True)
args, kwargs = M.get_data(A.name)
with np.load(os.path.join(HERE, "out", f"ref_{A.name}.npz")) as f:
    draws = {k: f[k].reshape((-1,) + f[k].shape[2:]) for k in f.files}
case = rc.Case(A.name, spec["model"], args, kwargs, lambda: draws, False, False, "")
ref = rc.unconstrained_moments(case, draws)
guide = G(spec["model"])
svi = SVI(spec["model"], guide, numpyro.optim.Adam(0.01), Trace_ELBO())
p0 = svi.get_params(svi.init(jax.random.PRNGKey(0), *args, **kwargs))
popt = rc.optimal_guide_params(case, guide, p0, diagonal=A.guide == "MF")
keys = [jax.random.PRNGKey(k) for k in range(1, 6)]


def elbos(p):
    p = {k: jax.numpy.asarray(np.asarray(v, np.float64)) for k, v in p.items()}
    return np.array([rc.elbo(spec["model"], guide, p, args, kwargs, key=k) for k in keys])


e_opt = elbos(popt)
opt_m = rc.guide_moments(guide, popt, case, exact=True)
print(f"ELBO* (KL-optimal {A.guide}): {e_opt.mean():.2f} (keys: {np.round(e_opt, 2).tolist()})")
for cfg, params, ws, err in results:
    if params is None:
        continue
    e = elbos(params)
    d = e_opt - e
    fit = rc.guide_moments(guide, {k: jax.numpy.asarray(v) for k, v in params.items()}, case, exact=True)
    c = rc.compare(ref, fit)
    print(f"[{cfg}] ELBO {e.mean():.2f}; gap to ELBO* {d.mean():.2f} +- {d.std(ddof=1) / np.sqrt(len(d)):.2f} "
          f"(per key {np.round(d, 2).tolist()}); vs NUTS err {c.mean_err:.3f} sd {c.sd_ratio_min:.2f}-{c.sd_ratio_max:.2f}; "
          f"warned: {bool(ws)}")
    rows = []
    for k in ref:
        m0, s0 = ref[k]
        m1, s1 = fit[k]
        mo, so = opt_m[k]
        for i in range(len(np.ravel(m0))):
            rows.append((abs(np.ravel(m1)[i] - np.ravel(mo)[i]) / np.ravel(s0)[i], k, i,
                         (np.ravel(m1)[i] - np.ravel(m0)[i]) / np.ravel(s0)[i], np.ravel(s1)[i] / np.ravel(s0)[i],
                         (np.ravel(mo)[i] - np.ravel(m0)[i]) / np.ravel(s0)[i], np.ravel(so)[i] / np.ravel(s0)[i]))
    rows.sort(reverse=True)
    print("   coords farthest from the KL-optimal guide (in NUTS sd): site[i]: fit mean err, fit sd ratio | "
          "optimum mean err, optimum sd ratio")
    for r in rows[:6]:
        print(f"     {r[1]}[{r[2]}]: |fit-opt| {r[0]:.2f}; fit {r[3]:+.2f} {r[4]:.2f} | opt {r[5]:+.2f} {r[6]:.2f}")
