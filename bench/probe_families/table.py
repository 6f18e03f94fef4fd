"""Print the markdown table of all evaluated runs (out/eval_*.pkl)."""
import glob, json, math, pickle, os, sys
HERE = os.path.dirname(os.path.abspath(__file__))
OUT = "out_structures" if "structures" in sys.argv[1:] else "out"  # python table.py [structures]
def f(x, s):
    return "nan" if x is None or (isinstance(x, float) and not math.isfinite(x)) else format(x, s)
print("| model | d | NUTS ref (R-hat, min ESS, div) | guide | prec | max mean err (NUTS sd) | sd ratio | ELBO | gap vs Adam10k | gap vs best | warnings (first 150 chars) | verdict |")
print("|---|---|---|---|---|---|---|---|---|---|---|---|")
for fn in sorted(glob.glob(os.path.join(HERE, f"{OUT}/eval_*.pkl"))):
    rows = pickle.load(open(fn, "rb"))
    name = rows[0]["name"]
    dg = json.load(open(os.path.join(HERE, f"{OUT}/ref_{name}.json")))
    ref = f"{dg['max_rhat']:.4f}, {dg['min_ess']:.0f}, {dg['divergences']}"
    for r in sorted(rows, key=lambda r: (r["guide"] != "MVN", r["optim"].startswith("adam"), r["prec"])):
        if r["optim"].startswith("adam"):
            continue
        w = " / ".join(m for _, m in r["warnings"])[:150].replace("|", "/") or "-"
        big = lambda x: f(x, ".2f") if (isinstance(x, float) and abs(x) < 1e5) else f(x, ".2e")
        print(f"| {name} | {r['d']} | {ref} | {r['guide']} | f{r['prec']} | {big(r.get('err'))} | "
              f"{f(r.get('sd_lo'), '.2f')}-{f(r.get('sd_hi'), '.2f')} | {big(r.get('elbo'))} | {big(r.get('gap_adam'))} | "
              f"{big(r.get('gap'))} | {w} | {r['verdict']} |")
