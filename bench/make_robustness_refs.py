"""Write tests/data/robustness_refs.json: reference moments of the ``fast`` robustness cases.

For every latent site, in NumPyro's UNCONSTRAINED space (``biject_to(site support).inv`` of the
reference draws), per scalar coordinate: the mean, the sd, the effective sample size of the draws
(``numpyro.diagnostics.effective_sample_size`` over the reference's chains) and the Monte Carlo
standard errors

    mcse_mean = 1 / sqrt(ESS)                      (of the mean, in reference sds)
    mcse_sd   = sqrt((kurtosis - 1) / (4 ESS_sq))  (of the sd, relative; ESS_sq: ESS of the squared
                                                    centred draws; = 1/sqrt(2 ESS) for a Gaussian)

The tests read this file instead of rerunning NUTS. Run: python bench/make_robustness_refs.py [--all];
``--cases a,b`` computes the named cases (fast or not) and merges them into the existing file, keeping
the other entries (NUTS draws are cached on disk: see robustness_cases).
"""

import argparse
import datetime
import json
import os
import sys

import numpyro

numpyro.enable_x64()

import jax  # noqa: E402
import numpy as np  # noqa: E402
from numpyro.diagnostics import effective_sample_size  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import robustness_cases as rc  # noqa: E402

OUT = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests", "data", "robustness_refs.json")


def sig(x, digits):
    return [float(f"{v:.{digits}g}") for v in np.asarray(x, np.float64).reshape(-1)]


def case_entry(case):
    chains = case.reference_chains()
    n_chains, n_draws = next(iter(chains.values())).shape[:2]
    flat = {k: v.reshape((-1,) + v.shape[2:]) for k, v in chains.items()}
    u = rc.to_unconstrained(case, flat)  # (n_chains * n_draws, d_site)
    sites = {}
    for k, v in u.items():
        v = v.reshape(n_chains, n_draws, -1)
        mean, sd = v.mean((0, 1)), v.reshape(-1, v.shape[-1]).std(0, ddof=1)
        c = (v - mean) / sd
        ess = np.asarray(effective_sample_size(v))
        ess_sq = np.asarray(effective_sample_size(c ** 2))
        kurt = (c ** 4).mean((0, 1))
        sites[k] = {
            "mean": sig(mean, 12),
            "sd": sig(sd, 8),
            "ess": sig(ess, 4),
            "mcse_mean": sig(1 / np.sqrt(ess), 3),
            "mcse_sd": sig(np.sqrt(np.maximum(kurt - 1, 0) / (4 * ess_sq)), 3),
        }
    diag = rc.REFERENCE_DIAGNOSTICS.get(case.name, {})
    return {
        "source": case.source,
        "method": diag.get("method", ""),
        "near_gaussian": case.near_gaussian,
        "fast": case.fast,
        "n_chains": int(n_chains),
        "n_draws": int(n_chains * n_draws),
        "max_rhat": round(diag.get("max_rhat", float("nan")), 5),
        "n_params": rc.n_params(case),
        "sites": sites,
    }


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--all", action="store_true", help="all cases, not only the fast ones")
    ap.add_argument("--cases", default=None, help="comma-separated case names, merged into the existing file")
    ap.add_argument("--out", default=OUT)
    args = ap.parse_args()
    if args.cases:
        selected = [rc.get(n) for n in args.cases.split(",")]
    else:
        selected = [c for c in rc.cases() if args.all or c.fast]
    if not rc.posteriordb_available():
        print("warning: ../shared/posteriordb is missing: its cases are left out of the file", file=sys.stderr)
    data = {
        "meta": {
            "description": "Reference posterior moments in NumPyro's unconstrained space, per scalar coordinate "
                           "(flattened site), for the fast robustness cases (bench/robustness_cases.py).",
            "mcse": "mcse_mean in reference sds (1/sqrt(ESS)); mcse_sd relative to the sd",
            "generated": datetime.date.today().isoformat(),
            "numpyro": numpyro.__version__,
            "jax": jax.__version__,
        },
        "cases": {},
    }
    if args.cases and os.path.exists(args.out):  # merge: keep the other cases' entries
        with open(args.out) as f:
            old = json.load(f)
        data["cases"] = old.get("cases", {})
        data["meta"]["description"] = old.get("meta", {}).get("description", data["meta"]["description"])
    for c in selected:
        data["cases"][c.name] = e = case_entry(c)
        worst = max(max(s["mcse_mean"]) for s in e["sites"].values())
        print(f"{c.name:28s} {e['n_params']:3d} params  {e['n_draws']:6d} draws  max R-hat {e['max_rhat']:.4f}  "
              f"max mcse(mean) {worst:.4f} sd  [{e['method']}]")
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(data, f, indent=1)
        f.write("\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
