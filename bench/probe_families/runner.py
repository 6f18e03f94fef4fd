"""Probe runner: NUTS references, nb.fit (default nb.BLR()) in float64/float32, Adam(0.01) 10k yardsticks, evaluation.

  python runner.py ref   [names]              # float64 NUTS 2 x (1000 + 3000), sequential -> out/ref_<name>.npz/.json
  python runner.py fit64 [names] [--no-adam]  # float64 nb.fit MVN + MF (1000 steps) and Adam(0.01) 10k -> out/*.pkl
  python runner.py fit32 [names]              # float32 nb.fit MVN + MF -> out/*.pkl
  python runner.py eval  [names]              # float64: moments vs NUTS, ELBO (2000 particles, fixed key) -> table
  options: --steps N, --tag T, --optim 'nb.BLR(hessian="reparam")' (an expression; tag names the run),
           --set structures (structures.py's models, results in out_structures/)
"""
import argparse
import json
import math
import os
import pickle
import sys
import time
import traceback
import warnings

HERE = os.path.dirname(os.path.abspath(__file__))
SETS = {"families": ("models", "out"), "structures": ("structures", "out_structures")}

ap = argparse.ArgumentParser()
ap.add_argument("phase", choices=["ref", "fit64", "fit32", "eval"])
ap.add_argument("names", nargs="*")
ap.add_argument("--steps", type=int, default=1000)
ap.add_argument("--tag", default="default")
ap.add_argument("--optim", default="nb.BLR()")
ap.add_argument("--guides", default="MVN,MF")
ap.add_argument("--no-adam", action="store_true")
ap.add_argument("--adam-steps", type=int, default=10000)
ap.add_argument("--set", choices=sorted(SETS), default="families",
                help="the models: models.py (families, out/) or structures.py (structures, out_structures/)")
ARGS = ap.parse_args()
OUT = os.path.join(HERE, SETS[ARGS.set][1])
os.environ.setdefault("ROBUSTNESS_CACHE", os.path.join(HERE, "cache"))  # not the suite's cache

import jax  # noqa: E402

if ARGS.phase != "fit32":
    jax.config.update("jax_enable_x64", True)

import numpy as np  # noqa: E402
import numpyro  # noqa: E402
from numpyro.infer import MCMC, NUTS, SVI, Trace_ELBO  # noqa: E402
from numpyro.infer.autoguide import AutoMultivariateNormal, AutoNormal  # noqa: E402

import numpyro_blr as nb  # noqa: E402

sys.path.insert(0, HERE)
sys.path.insert(0, os.path.dirname(HERE))  # bench/: robustness_cases
import importlib  # noqa: E402

M = importlib.import_module(SETS[ARGS.set][0])
import robustness_cases as rc  # noqa: E402

GUIDES = {"MVN": AutoMultivariateNormal, "MF": AutoNormal}
QUIET = (DeprecationWarning, FutureWarning, PendingDeprecationWarning)
os.makedirs(OUT, exist_ok=True)


def names():
    return ARGS.names or list(M.SPECS)


# ------------------------------------------------------------------------------------------------ reference
def run_ref(name):
    spec = M.SPECS[name]
    args, kwargs = M.get_data(name)
    model = spec.get("ref_model", spec["model"])
    t0 = time.perf_counter()
    kernel = NUTS(model, **spec["nuts"])
    mcmc = MCMC(kernel, num_warmup=1000, num_samples=3000, num_chains=2, chain_method="sequential", progress_bar=False)
    mcmc.run(jax.random.PRNGKey(0), *args, extra_fields=("diverging", "num_steps"), **kwargs)
    s = {k: np.asarray(v) for k, v in mcmc.get_samples(group_by_chain=True).items()}
    extra = mcmc.get_extra_fields(group_by_chain=True)
    if "ref_map" in spec:
        s = {k: np.asarray(v) for k, v in spec["ref_map"](s).items()}
    sites = list(rc.latent_sites(spec["model"], args, kwargs))
    s = {k: s[k] for k in sites}
    diag = rc.reference_diagnostics(s)
    diag.update(divergences=int(np.sum(extra["diverging"])), mean_leapfrog=float(np.mean(extra["num_steps"])),
                seconds=time.perf_counter() - t0, nuts=dict(spec["nuts"]), method="NUTS 2x(1000+3000) float64"
                + (" on the non-centred model" if "ref_model" in spec else ""))
    np.savez(os.path.join(OUT, f"ref_{name}.npz"), **s)
    with open(os.path.join(OUT, f"ref_{name}.json"), "w") as f:
        json.dump(diag, f, indent=1)
    print(name, json.dumps(diag), flush=True)


# ------------------------------------------------------------------------------------------------ fits
def to_np(tree):
    return {k: np.asarray(v) for k, v in tree.items()}


def do_fit(name, gname, prec, optim_expr, steps, tag):
    spec = M.SPECS[name]
    args, kwargs = M.get_data(name, float32=prec == "32")
    guide = GUIDES[gname](spec["model"])
    rec = dict(name=name, guide=gname, prec=prec, optim=optim_expr, steps=steps, tag=tag)
    t0 = time.perf_counter()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            if optim_expr.startswith("adam"):
                lr = float(optim_expr.split(":")[1])
                svi = SVI(spec["model"], guide, numpyro.optim.Adam(lr), Trace_ELBO())
                res = svi.run(jax.random.PRNGKey(0), steps, *args, progress_bar=False, **kwargs)
            else:
                optim = eval(optim_expr, {"nb": nb})
                res = nb.fit(spec["model"], guide, *args, optim=optim, num_steps=steps, progress_bar=False,
                             rng_key=jax.random.PRNGKey(0), **kwargs)
            rec["params"] = to_np(res.params)
            losses = np.asarray(res.losses)
            rec["losses"] = losses
            rec["finite"] = bool(np.all(np.isfinite(losses[-100:]))) and all(
                np.all(np.isfinite(v)) for v in rec["params"].values())
            if not optim_expr.startswith("adam"):
                try:
                    rec["report"] = str(nb.fit_report(res, guide=guide))
                except Exception as e:  # noqa: BLE001
                    rec["report"] = f"fit_report failed: {type(e).__name__}: {e}"
        except Exception as e:  # noqa: BLE001
            rec["error"] = f"{type(e).__name__}: {e}"
            rec["traceback"] = traceback.format_exc()
    rec["seconds"] = time.perf_counter() - t0
    rec["warnings"] = [(w.category.__name__, str(w.message)) for w in caught if not issubclass(w.category, QUIET)]
    rec["quiet_warnings"] = [(w.category.__name__, str(w.message)[:200]) for w in caught if issubclass(w.category, QUIET)]
    fn = f"fit_{tag}_{prec}_{name}_{gname}.pkl"
    with open(os.path.join(OUT, fn), "wb") as f:
        pickle.dump(rec, f)
    w = "; ".join(f"{c}: {m[:150]}" for c, m in rec["warnings"]) or "-"
    print(f"{name:24s} {gname:3s} f{prec} {tag:10s} {rec['seconds']:6.1f}s "
          f"{'ERROR ' + rec['error'][:200] if 'error' in rec else 'finite' if rec['finite'] else 'NONFINITE'} | {w[:400]}",
          flush=True)


# ------------------------------------------------------------------------------------------------ evaluation
def load(fn):
    p = os.path.join(OUT, fn)
    if not os.path.exists(p):
        return None
    with open(p, "rb") as f:
        return pickle.load(f)


def make_case(name):
    spec = M.SPECS[name]
    args, kwargs = M.get_data(name)
    with np.load(os.path.join(OUT, f"ref_{name}.npz")) as f:
        chains = {k: f[k] for k in f.files}
    draws = {k: v.reshape((-1,) + v.shape[2:]) for k, v in chains.items()}
    return rc.Case(name, spec["model"], args, kwargs, lambda: draws, False, False, spec["note"])


def setup_guide(case, gname):
    guide = GUIDES[gname](case.model)
    svi = SVI(case.model, guide, numpyro.optim.Adam(0.01), Trace_ELBO())
    state = svi.init(jax.random.PRNGKey(0), *case.args, **case.kwargs)
    return guide, to_np(svi.get_params(state))


def as64(params):
    return {k: jax.numpy.asarray(np.asarray(v, np.float64)) for k, v in params.items()}


def evaluate(name):
    case = make_case(name)
    ref = rc.unconstrained_moments(case, case.reference())
    d = rc.n_params(case)
    ekey = jax.random.PRNGKey(1)
    out = []
    opt = {}
    for gname in GUIDES:
        guide, p0 = setup_guide(case, gname)
        diag = gname == "MF"
        # KL-optimal Gaussian (BFGS, rc.optimal_gaussian): full covariance only for small d
        e_opt, opt_cmp = float("nan"), None
        if diag or d <= 60:
            try:
                t0 = time.perf_counter()
                opt_cmp = rc.optimal_gaussian(case, diagonal=diag)[0]
                e_opt = rc.elbo(case.model, guide, as64(rc.optimal_guide_params(case, guide, p0, diagonal=diag)),
                                case.args, case.kwargs, key=ekey)
                print(f"  {name} {gname} ELBO* {e_opt:.2f} ({time.perf_counter() - t0:.0f}s) opt-vs-NUTS err "
                      f"{opt_cmp.mean_err:.3f} sd {opt_cmp.sd_ratio_min:.2f}-{opt_cmp.sd_ratio_max:.2f}", flush=True)
            except Exception as e:  # noqa: BLE001
                print(f"  optimal gaussian failed {name} {gname}: {e}")
        opt[gname] = (e_opt, opt_cmp)
        recs = []
        for fn in sorted(os.listdir(OUT)):
            if fn.startswith("fit_") and fn.endswith(f"_{name}_{gname}.pkl"):
                recs.append(load(fn))
        rows = []
        for r in recs:
            row = dict(name=name, guide=gname, prec=r["prec"], tag=r["tag"], optim=r["optim"], steps=r["steps"], d=d,
                       warnings=r["warnings"], error=r.get("error"), seconds=r["seconds"],
                       finite=r.get("finite", False), report=r.get("report", ""))
            if "params" in r:
                try:
                    c = rc.compare(ref, rc.guide_moments(guide, as64(r["params"]), case, exact=True))
                    row.update(err=c.mean_err, sd_lo=c.sd_ratio_min, sd_hi=c.sd_ratio_max,
                               sites={k: v for k, v in c.sites.items()})
                except Exception as e:  # noqa: BLE001
                    row.update(err=float("inf"), sd_lo=float("nan"), sd_hi=float("nan"), sites={}, cmp_error=str(e))
                try:
                    e = rc.elbo(case.model, guide, as64(r["params"]), case.args, case.kwargs, key=ekey)
                except Exception:  # noqa: BLE001
                    e = float("nan")
                row["elbo"] = e if math.isfinite(e) else float("nan")
            rows.append(row)
        cands = [r["elbo"] for r in rows if math.isfinite(r.get("elbo", float("nan")))] + \
                ([e_opt] if math.isfinite(e_opt) else [])
        best = max(cands) if cands else float("nan")
        adam = [r for r in rows if r["optim"].startswith("adam")]
        e_adam = adam[0]["elbo"] if adam else float("nan")
        for row in rows:
            row["best"] = best
            row["elbo_opt"] = e_opt
            row["elbo_adam"] = e_adam
            row["gap"] = best - row["elbo"] if math.isfinite(row.get("elbo", float("nan"))) else float("inf")
            row["gap_adam"] = e_adam - row["elbo"] if math.isfinite(row.get("elbo", float("nan"))) else float("inf")
        out += rows
    # near-Gaussian: the KL-optimal full Gaussian matches NUTS; where not computed (d > 60), the best-ELBO MVN fit
    ng_src = "ELBO*"
    if opt["MVN"][1] is not None:
        near = opt["MVN"][1].matched()
    else:
        mv = [r for r in out if r["guide"] == "MVN" and math.isfinite(r.get("elbo", float("nan")))]
        b = max(mv, key=lambda r: r["elbo"]) if mv else None
        near = bool(b and b["err"] <= 0.1 and 0.9 <= b["sd_lo"] and b["sd_hi"] <= 1.1)
        ng_src = f"best-ELBO MVN fit ({b['optim']} f{b['prec']})" if b else "none"
    for row in out:
        row["near_gaussian"] = near
        row["near_src"] = ng_src
        if row["optim"].startswith("adam"):
            row["verdict"] = "yardstick"
            continue
        warned = any(c == "RuntimeWarning" or c == "UserWarning" for c, _ in row["warnings"])
        if row["error"]:
            row["verdict"] = "crash"
            continue
        if not row["finite"] or not math.isfinite(row.get("elbo", float("nan"))):
            bad = True
        elif row["guide"] == "MVN":
            moments_ok = row["err"] <= 0.1 and 0.9 <= row["sd_lo"] and row["sd_hi"] <= 1.1
            bad = (near and not moments_ok) or row["gap"] > 1.0
        else:
            bad = row["gap"] > 1.0
        row["verdict"] = ("failed-but-warned" if warned else "SILENT FAILURE") if bad else ("OK (warned)" if warned else "OK")
    with open(os.path.join(OUT, f"eval_{name}.pkl"), "wb") as f:
        pickle.dump(out, f)
    for row in out:
        print_row(row)
    return out


def fmt(x, spec):
    return "nan" if x is None or (isinstance(x, float) and not math.isfinite(x)) else format(x, spec)


def print_row(r):
    w = " || ".join(f"{c}: {m}" for c, m in r["warnings"])[:150] or "-"
    print(f"{r['name']:24s} {r['guide']:3s} f{r['prec']} {r['tag']:9s} d={r['d']:3d} err={fmt(r.get('err'), '.3f'):>7s} "
          f"sd={fmt(r.get('sd_lo'), '.2f')}-{fmt(r.get('sd_hi'), '.2f')} ELBO={fmt(r.get('elbo'), '.2f')} "
          f"gap_best={fmt(r.get('gap'), '.2f')} gap_adam={fmt(r.get('gap_adam'), '.2f')} near={r['near_gaussian']} "
          f"-> {r.get('verdict')} | {r['error'] or ''} {w}", flush=True)


def main():
    t0 = time.perf_counter()
    if ARGS.phase == "ref":
        for n in names():
            run_ref(n)
    elif ARGS.phase in ("fit64", "fit32"):
        prec = ARGS.phase[3:]
        for n in names():
            for g in ARGS.guides.split(","):
                do_fit(n, g, prec, ARGS.optim, ARGS.steps, ARGS.tag)
                if prec == "64" and not ARGS.no_adam:
                    do_fit(n, g, prec, "adam:0.01", ARGS.adam_steps, "adam10k")
    else:
        for n in names():
            evaluate(n)
    print(f"total {time.perf_counter() - t0:.0f}s")


if __name__ == "__main__":
    main()
