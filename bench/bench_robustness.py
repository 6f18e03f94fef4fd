"""Robustness bench: the default ``nb.BLR()`` on ordinary NumPyro models it was not tuned on.

For every case of ``bench/robustness_cases.py`` and the guides AutoMultivariateNormal (MVN) and
AutoNormal (MF), both with their default ``init_loc_fn``:

* ``SVI(model, guide, nb.BLR(), Trace_ELBO())`` for ``--steps`` steps (default 1000) in one jitted
  ``lax.scan`` (as ``SVI.run``) that also returns the params every 10 steps;
* ``numpyro.optim.Adam(0.01)`` for ``--adam-steps`` steps (default 10,000; params every 500);
* one NUTS chain, 1000 warmup + 1000 draws, timed with compilation.

Columns (one row per case and guide):

  d        unconstrained dimension
  match@   BLR: first step from which the guide's unconstrained means stay within 0.1 reference-sd
           and its sds within 0.9-1.1x of the reference ('-' = not by the end)
  wall/run BLR wall time in seconds: the whole fit (svi.init, compilation and the steps) / the
           steps alone (compilation excluded)
  err      final max |mean - ref mean| / ref sd over all scalar coordinates (unconstrained space)
  sd       final min-max sd ratio guide / reference
  ELBO     final ELBO, 2000 particles, the same random numbers for every method of a case
  gap      best ELBO of that guide family (BLR at step 500 and at the end, Adam at the end, ELBO*)
           minus BLR's final ELBO
  ELBO*    ELBO of the KL-optimal Gaussian of that family (full covariance for MVN, diagonal for
           MF), found independently by BFGS on a sample-average ELBO whitened by the reference
           (robustness_cases.optimal_gaussian; cached on disk): a yardstick that does not depend on
           BLR or Adam having converged
  Adam ... the same for Adam(0.01) after --adam-steps steps (match@ at a 500-step resolution)
  NUTS     seconds for one NUTS chain (1000 + 1000, compile included)

Matched:
  MVN, near-Gaussian case: final means within 0.1 ref-sd and sds within 0.9-1.1x;
  MF (every case): BLR's ELBO at step 500 within 1 nat of the best mean-field ELBO (including ELBO*).
  MVN on a case that is not near-Gaussian is not in the count; it is listed as a failure only when
  BLR's final ELBO is more than 1 nat below the best full-Gaussian ELBO.
'silent failures' lists the runs that ended badly (a non-finite loss or params, or not matched)
with no Python warning raised during the run.

``--rows`` picks the entry points (comma-separated; default ``blr``, the table above):

  blr       the table above;
  liegroup  nb.LieGroupGuide(model) + nb.LieGroupBLR(), both with their defaults (affine group, Gaussian q0;
            positive sites lognormal), for --steps steps on every selected case whose guide can be built. Columns:
            gap = best mean-field Gaussian ELBO (nb.BLR() + AutoNormal after --steps, and ELBO* unless --no-opt)
            minus the Lie-group fit's ELBO (2000 particles, the same random numbers); pos/NUTS = median of each
            positive site under the fit divided by the NUTS (reference) median (min-max over its coordinates);
            ok = gap <= 1 nat and, on the regressions with an unknown noise scale, pos/NUTS within 5%.
            A case whose seed-0 gap is over 1 nat with a finite fit is run again with LIE_SEEDS seeds (both the
            Lie-group fit and the yardstick nb.BLR() + AutoNormal, keys 0..LIE_SEEDS-1): where the mean-field ELBO
            has several local optima (hierarchical_scales_logistic: nb.BLR() + AutoNormal ends between -80.4 and
            -78.4 over 12 seeds), one seed's gap says which basin each run fell into, not whether the rule reaches
            an optimum. The case is then ok when every seed's fit is finite and the median Lie-group ELBO is within
            1 nat of the yardstick's median; the line gives both medians and the yardstick's range.
            A case without a finite yardstick (float32 gp_pois_regr: its kernel's Cholesky fails at long
            length-scales, and every fit and ELBO there with it) is n/a, and the line says whether the Lie-group
            fit was finite and warned. 'silent failures' lists the runs that are not ok and raised no warning.
  expfam, von, newton, laplace, ivon, mixture: see bench/robustness_rows.py (ExpFamilyGuide + nb.BLR() against the same
            guide's Adam optimum; the Table-1 presets with AutoMultivariateNormal against nb.BLR() and ELBO*; nb.IVON
            + AutoNormal and nb.mixture_blr on the potential against the best Gaussian of the family).

Run: python bench/bench_robustness.py [--quick] [--cases a,b] [--steps N] [--float32] [--rows blr,liegroup,expfam,von,newton,laplace,ivon,mixture] [--ivon-tuned]
"""

import argparse
import math
import os
import sys
import time
import warnings

FLOAT32 = "--float32" in sys.argv
import numpyro  # noqa: E402

if not FLOAT32:
    numpyro.enable_x64()

import jax  # noqa: E402
import numpy as np  # noqa: E402
from jax import lax  # noqa: E402
from numpyro.infer import MCMC, NUTS, SVI, Trace_ELBO  # noqa: E402
from numpyro.infer.autoguide import AutoMultivariateNormal, AutoNormal  # noqa: E402

import numpyro_blr as nb  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import robustness_cases as rc  # noqa: E402

GUIDES = {"MVN": AutoMultivariateNormal, "MF": AutoNormal}
MEAN_TOL, SD_LO, SD_HI, ELBO_TOL = 0.1, 0.9, 1.1, 1.0
QUIET = (DeprecationWarning, FutureWarning, PendingDeprecationWarning)


class Run:
    """One SVI run of ``steps`` steps, as ``SVI.run`` does it (one jitted ``lax.scan``), which also
    returns the params every ``every`` steps (read inside ``jit``, so ``get_params`` has no Python
    side effects there). ``svi.get_params`` is called once outside ``jit`` at the end, as after
    ``SVI.run``: the warnings recorded are those a user of ``SVI.run`` would see."""

    def __init__(self, case, guide_cls, optim, steps, every, key):
        self.guide = guide_cls(case.model)
        svi = SVI(case.model, self.guide, optim, Trace_ELBO())
        args, kwargs = rc.device_data(case)
        n_chunks = steps // every

        def chunk(s, _):
            s, losses = lax.scan(lambda s, _: svi.update(s, *args, **kwargs), s, None, length=every)
            return s, (losses, svi.get_params(s))

        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            t0 = time.perf_counter()
            state = svi.init(key, *args, **kwargs)
            run = jax.jit(lambda s: lax.scan(chunk, s, None, length=n_chunks)).lower(state).compile()
            self.t_compile = time.perf_counter() - t0
            t1 = time.perf_counter()
            state, (losses, history) = run(state)
            jax.block_until_ready(losses)
            self.t_run = time.perf_counter() - t1
            final = jax.device_get(svi.get_params(state))
        self.state = state
        self.report = nb.fit_report(state, svi.optim) if isinstance(optim, nb.BLR) else None
        self.loss_sd = self.report.loss_sd if self.report else float("nan")
        history = jax.device_get(history)
        self.checkpoints = [(i + 1) * every for i in range(n_chunks)]
        self.params = [jax.tree_util.tree_map(lambda x: x[i], history) for i in range(n_chunks)]
        self.params[-1] = final
        self.losses = np.asarray(losses).reshape(-1)
        self.warnings = [w for w in caught if not issubclass(w.category, QUIET)]
        self.finite = bool(np.all(np.isfinite(self.losses[-every:]))) and all(
            np.all(np.isfinite(np.asarray(v))) for v in jax.tree_util.tree_leaves(final))

    @classmethod
    def as_svi_run(cls, case, guide_cls, optim, steps, every, key):
        """A run as ``SVI.run`` gives it: with ``nb.BLR()``'s default, a fit whose one-draw curvature was too noisy
        and whose report finds a problem is run again with ``curvature_draws=8`` (``nb.svi.run_with_rerun``, the
        mechanism svi.run and nb.fit use; ``rerun`` says which run was kept)."""
        def once(o):
            run = cls(case, guide_cls, o, steps, every, key)  # its warnings recorded in run.warnings
            run.rerun = o is not optim
            return run

        return nb.svi.run_with_rerun(optim, once)

    def params_at(self, step):
        i = max(j for j, s in enumerate(self.checkpoints) if s <= step)
        return self.params[i]

    def comparisons(self, case, ref):
        out = []
        for p in self.params:
            try:
                out.append(rc.compare(ref, rc.guide_moments(self.guide, p, case, exact=True)))
            except Exception:  # noqa: BLE001 - e.g. a non-finite scale_tril: counts as no match
                out.append(None)
        return out


def first_stable_match(checkpoints, comps):
    """First checkpoint from which every later one matches; None if the last does not."""
    first = None
    for s, c in zip(checkpoints, comps):
        ok = c is not None and c.matched(MEAN_TOL, SD_LO, SD_HI)
        if ok and first is None:
            first = s
        elif not ok:
            first = None
    return first


OPT_MAX_PARAMS = 5000  # ELBO* of a full Gaussian with more parameters is left out (BFGS's memory)


def safe_elbo(case, guide, params, key):
    try:
        v = rc.elbo(case.model, guide, params, *rc.device_data(case), n_particles=2000, key=key)
    except Exception:  # noqa: BLE001
        return float("nan")
    return v if math.isfinite(v) else float("nan")


def nuts_time(case):
    t0 = time.perf_counter()
    mcmc = MCMC(NUTS(case.model), num_warmup=1000, num_samples=1000, num_chains=1, progress_bar=False)
    mcmc.run(jax.random.PRNGKey(2), *case.args, **case.kwargs)
    jax.block_until_ready(mcmc.get_samples())
    return time.perf_counter() - t0


def fmt(x, spec=".3f"):
    """Format a number to the width in ``spec``; switches to e-notation when it would not fit."""
    if x is None:
        return "-"
    if isinstance(x, float) and not math.isfinite(x):
        return "nan" if math.isnan(x) else "inf"
    s = format(x, spec)
    width = int(spec.split(".")[0]) if spec[0].isdigit() else 0
    if width and len(s) > width:
        s = format(x, f"{width}.{max(0, width - 7)}e")
    return s


def sd_range(c):
    if c is None or not math.isfinite(c.sd_ratio_min):
        return "nan"
    lo, hi = c.sd_ratio_min, c.sd_ratio_max
    return f"{lo:.2f}-{hi:.2f}" if max(abs(lo), abs(hi)) < 10 else f"{lo:.0e}-{hi:.0e}"


HEADER = (f"{'case':27s} {'g':3s} {'d':>3s} | {'match@':>6s} {'wall':>5s} {'run':>5s} {'err':>7s} {'sd':>9s} "
          f"{'ELBO':>10s} {'gap':>6s} {'ELBO*':>10s} | Adam: {'match@':>6s} {'err':>7s} {'sd':>9s} {'ELBO':>10s} {'gap':>6s} {'time':>5s} "
          f"| {'NUTS':>5s} | ok")


def main():
    ap = argparse.ArgumentParser(description="nb.BLR() on the robustness cases")
    ap.add_argument("--cases", default=None, help="comma-separated case names")
    ap.add_argument("--steps", type=int, default=1000, help="BLR steps (multiple of 10)")
    ap.add_argument("--adam-steps", type=int, default=None, help="Adam(0.01) steps (default 10000; 2000 with --quick)")
    ap.add_argument("--quick", action="store_true", help="fast cases only, 2000 Adam steps")
    ap.add_argument("--float32", action="store_true", help="run in float32 (default: float64)")
    ap.add_argument("--no-nuts", action="store_true", help="skip the NUTS timing")
    ap.add_argument("--no-opt", action="store_true", help="skip the KL-optimal Gaussian (ELBO* column)")
    ap.add_argument("--rows", default="blr", help=f"comma-separated entry points among {ROWS} (default blr)")
    ap.add_argument("--ivon-tuned", action="store_true",
                    help="the ivon row with nb.IVON(lr=0.3, ess=N, hess_init=0.1, beta2=0.999) (docs/deep-learning.md's "
                         "SVI settings, the row before IVON had a default lr) instead of nb.IVON()")
    args = ap.parse_args()
    rows_selected = [r for r in args.rows.split(",") if r]
    unknown = sorted(set(rows_selected) - set(ROWS))
    if unknown or not rows_selected:
        ap.error(f"--rows: unknown entry point(s) {unknown or rows_selected}; choose among {', '.join(ROWS)}")
    adam_steps = args.adam_steps or (2000 if args.quick else 10000)

    t_start = time.perf_counter()
    selected = rc.cases()
    if args.cases:
        names = args.cases.split(",")
        selected = [rc.get(n) for n in names]
    elif args.quick:
        selected = [c for c in selected if c.fast]
    print(f"robustness bench: {len(selected)} cases, BLR {args.steps} steps, Adam(0.01) {adam_steps} steps, "
          f"{'float32' if args.float32 else 'float64'}, jax {jax.__version__}, numpyro {numpyro.__version__}, "
          f"{jax.devices()[0].platform}" + ("" if rc.posteriordb_available() else "; posteriordb missing: its cases skipped"),
          flush=True)

    if "blr" not in rows_selected:
        for row in rows_selected:
            ROW_RUNNERS[row](selected, args, t_start)
        return
    rows, results = [], []
    for i, case in enumerate(selected):
        t_case = time.perf_counter()
        t0 = time.perf_counter()
        ref = rc.unconstrained_moments(case, case.reference())
        t_ref = time.perf_counter() - t0
        diag = rc.REFERENCE_DIAGNOSTICS.get(case.name, {})
        d = rc.n_params(case)
        print(f"[{i + 1}/{len(selected)}] {case.name} (d={d}, near_gaussian={case.near_gaussian}): reference "
              f"{diag.get('method', '?')}, R-hat {diag.get('max_rhat', float('nan')):.4f}, "
              f"min ESS {diag.get('min_ess', float('nan')):.0f} ({t_ref:.1f} s)", flush=True)
        key = jax.random.PRNGKey(0)
        ekey = jax.random.PRNGKey(1)
        for gname, gcls in GUIDES.items():
            blr = Run.as_svi_run(case, gcls, nb.BLR(), args.steps, 10, key)
            adam = Run(case, gcls, numpyro.optim.Adam(0.01), adam_steps, 500 if adam_steps >= 500 else adam_steps, key)
            bc, ac = blr.comparisons(case, ref), adam.comparisons(case, ref)
            e_blr = safe_elbo(case, blr.guide, blr.params[-1], ekey)
            e_adam = safe_elbo(case, adam.guide, adam.params[-1], ekey)
            e_500 = safe_elbo(case, blr.guide, blr.params_at(500), ekey) if args.steps >= 500 else float("nan")
            e_opt = float("nan")
            # BFGS keeps a dense inverse Hessian over the full Gaussian's d(d+3)/2 parameters: 17 GB at d = 304
            if not args.no_opt and (gname == "MF" or d * (d + 3) // 2 <= OPT_MAX_PARAMS):
                try:
                    opt = rc.optimal_guide_params(case, blr.guide, adam.params[-1], diagonal=gname == "MF")
                    e_opt = safe_elbo(case, blr.guide, opt, ekey)
                except Exception as err:  # noqa: BLE001
                    print(f"    optimal Gaussian for {gname} failed: {type(err).__name__}: {err}")
            cands = [e for e in (e_blr, e_adam, e_500, e_opt) if math.isfinite(e)]
            best = max(cands) if cands else float("nan")
            gap = best - e_blr if math.isfinite(e_blr) else float("inf")
            gap_adam = best - e_adam if math.isfinite(e_adam) else float("inf")
            final = bc[-1]
            if gname == "MVN":
                counted = case.near_gaussian
                matched = counted and blr.finite and final is not None and final.matched(MEAN_TOL, SD_LO, SD_HI)
                bad = (not blr.finite) or (counted and not matched) or (not counted and not (gap <= ELBO_TOL))
            else:
                counted = True
                gap500 = best - e_500 if math.isfinite(e_500) else float("inf")
                matched = blr.finite and gap500 <= ELBO_TOL
                bad = not matched
            r = dict(case=case.name, guide=gname, d=d, counted=counted, matched=matched, bad=bad,
                     silent=bad and not blr.warnings, warnings=[str(w.message)[:120] for w in blr.warnings],
                     finite=blr.finite, match_at=first_stable_match(blr.checkpoints, bc),
                     t_compile=blr.t_compile, t_run=blr.t_run, err=final.mean_err if final else float("nan"),
                     cmp=final, elbo=e_blr, gap=gap, adam_match_at=first_stable_match(adam.checkpoints, ac),
                     adam_cmp=ac[-1], adam_elbo=e_adam, adam_gap=gap_adam, adam_time=adam.t_compile + adam.t_run,
                     elbo500=e_500, elbo_opt=e_opt, rerun=getattr(blr, "rerun", False))
            results.append(r)
        t_nuts = float("nan") if args.no_nuts else nuts_time(case)
        for r in results[-2:]:
            r["nuts"] = t_nuts
            row = (f"{r['case']:27s} {r['guide']:3s} {r['d']:3d} | {fmt(r['match_at'], 'd'):>6s} {r['t_compile'] + r['t_run']:5.1f} "
                   f"{r['t_run']:5.1f} {fmt(r['err'], '7.3f'):>7s} {sd_range(r['cmp']):>9s} {fmt(r['elbo'], '10.2f'):>10s} "
                   f"{fmt(r['gap'], '6.2f'):>6s} {fmt(r['elbo_opt'], '10.2f'):>10s} | Adam: {fmt(r['adam_match_at'], 'd'):>6s} "
                   f"{fmt(r['adam_cmp'].mean_err if r['adam_cmp'] else float('nan'), '7.3f'):>7s} {sd_range(r['adam_cmp']):>9s} "
                   f"{fmt(r['adam_elbo'], '10.2f'):>10s} {fmt(r['adam_gap'], '6.2f'):>6s} {r['adam_time']:5.1f} | "
                   f"{fmt(t_nuts, '5.1f'):>5s} | "
                   + ("yes" if r["matched"] else ("no" if r["counted"] else "n/a"))
                   + ("" if r["finite"] else " NONFINITE") + (f" [{len(r['warnings'])} warning(s)]" if r["warnings"] else "")
                   + (" (rerun: curvature_draws=8)" if r["rerun"] else ""))
            rows.append(row)
            print(row, flush=True)
        print(f"    ({time.perf_counter() - t_case:.0f} s)", flush=True)

    print()
    print(HEADER)
    for row in rows:
        print(row)
    print()
    for g in GUIDES:
        rs = [r for r in results if r["guide"] == g and r["counted"]]
        crit = "near-Gaussian cases, means within 0.1 sd, sds 0.9-1.1x" if g == "MVN" else \
            "ELBO at step 500 within 1 nat of the best mean-field ELBO"
        print(f"{GUIDES[g].__name__}: {sum(r['matched'] for r in rs)} of {len(rs)} matched ({crit})")
    rs = [r for r in results if r["counted"]]
    print(f"{sum(r['matched'] for r in rs)} of {len(rs)} matched")
    bad = [r for r in results if r["bad"]]
    silent = [f"{r['case']}/{r['guide']}" for r in bad if r["silent"]]
    warned = [f"{r['case']}/{r['guide']}" for r in bad if not r["silent"]]
    print(f"silent failures: {', '.join(silent) if silent else 'none'}")
    # wall time to NUTS-quality (the matching step's share of the run) against one NUTS chain
    timed = [r for r in results if isinstance(r["match_at"], int) and math.isfinite(r.get("nuts", float("nan")))]
    if timed:
        run = [r["nuts"] / (r["t_run"] * r["match_at"] / args.steps) for r in timed]
        whole = [r["nuts"] / (r["t_compile"] + r["t_run"] * r["match_at"] / args.steps) for r in timed]
        print(f"NUTS chain / BLR time to NUTS-quality over {len(timed)} matched run(s): compilation excluded "
              f"min {min(run):.0f}x, median {float(np.median(run)):.0f}x; compilation included "
              f"min {min(whole):.2f}x, median {float(np.median(whole)):.2f}x")
    print(f"failures with a warning: {', '.join(warned) if warned else 'none'}")
    for r in results:
        for w in r["warnings"]:
            print(f"  warning in {r['case']}/{r['guide']}: {w}")
    print(f"total wall time {time.perf_counter() - t_start:.0f} s")
    for row in rows_selected:
        if row != "blr":
            ROW_RUNNERS[row](selected, args, time.perf_counter())


# regressions with an unknown noise scale: the positive site's median must be within POS_TOL of NUTS's
NOISE_REGRESSIONS = ("kidiq_kidscore_momiq", "kidiq_momiq_x1e3", "earnings_logearn_height", "earnings_height_mm_offset",
                     "sblri_blr", "sblri_X1e3", "sblri_collinear", "diabetes_standardised", "diabetes_raw")
POS_TOL = 0.05
# seeds of the liegroup row's second look at a case whose seed-0 gap is over ELBO_TOL (a multimodal mean-field ELBO)
LIE_SEEDS = 5


def positive_medians(case, guide, params):
    """{site: (min, max) of median under the fit / NUTS median} over the positive sites of the case."""
    from numpyro_blr.families.registry import is_positive_support

    sites = [k for k, sup in rc.case_sites(case).items() if is_positive_support(sup)]
    if not sites:
        return {}
    ref = case.reference()
    med = guide.median(params)
    out = {}
    for k in sites:
        r = np.asarray(med[k], np.float64).reshape(-1) / np.median(np.asarray(ref[k], np.float64).reshape(len(ref[k]), -1), 0)
        out[k] = (float(np.min(r)), float(np.max(r)))
    return out


def liegroup_rows(selected, args, t_start):
    """The ``liegroup`` row: nb.LieGroupGuide + nb.LieGroupBLR() defaults against the mean-field optimum."""
    print(f"\nliegroup: nb.LieGroupGuide(model) + nb.LieGroupBLR() defaults, {args.steps} steps; yardstick nb.BLR() + "
          f"AutoNormal ({args.steps} steps){'' if args.no_opt else ' and ELBO*'}", flush=True)
    header = f"{'case':27s} {'d':>3s} | {'ELBO':>10s} {'gap':>8s} {'wall':>5s} | {'pos/NUTS':28s} | ok"
    lines, bad = [], []
    for case in selected:
        key, ekey = jax.random.PRNGKey(0), jax.random.PRNGKey(1)
        d = rc.n_params(case)
        try:
            lie = Run(case, nb.LieGroupGuide, nb.LieGroupBLR(), args.steps, 10, key)
        except Exception as err:  # noqa: BLE001 - the guide does not apply (a discrete site, ...)
            line = f"{case.name:27s} {d:3d} | n/a: {type(err).__name__}: {str(err)[:90]}"
            lines.append(line)
            print(line, flush=True)
            continue
        mf = Run.as_svi_run(case, AutoNormal, nb.BLR(), args.steps, 10, key)
        e_lie = safe_elbo(case, lie.guide, lie.params[-1], ekey)
        cands = [safe_elbo(case, mf.guide, mf.params[-1], ekey)]
        if not args.no_opt:
            try:
                cands.append(safe_elbo(case, mf.guide, rc.optimal_guide_params(case, mf.guide, mf.params[-1], diagonal=True),
                                       ekey))
            except Exception as err:  # noqa: BLE001
                print(f"    optimal mean-field Gaussian failed: {type(err).__name__}: {err}")
        cands = [e for e in cands if math.isfinite(e)]
        if not cands:  # no finite yardstick in this precision (the model's own arithmetic fails): nothing to judge by
            line = (f"{case.name:27s} {d:3d} | n/a: no finite yardstick (nb.BLR()+AutoNormal"
                    f"{'' if args.no_opt else ' and ELBO*'} not finite); the Lie-group fit: "
                    + ("finite" if lie.finite and math.isfinite(e_lie) else "not finite")
                    + (f", {len(lie.warnings)} warning(s)" if lie.warnings else ", no warning"))
            lines.append(line)
            print(line, flush=True)
            if not (lie.finite and math.isfinite(e_lie)) and not lie.warnings:
                bad.append((case.name, False))  # a non-finite fit without a word is silent, yardstick or not
            continue
        best = max(cands)
        gap = best - e_lie if math.isfinite(e_lie) else float("inf")
        try:
            pos = positive_medians(case, lie.guide, lie.params[-1])
        except Exception as err:  # noqa: BLE001
            pos = {}
            print(f"    positive-site medians failed: {type(err).__name__}: {err}")
        pos_ok = all(1 - POS_TOL <= lo and hi <= 1 + POS_TOL for lo, hi in pos.values()) \
            if case.name in NOISE_REGRESSIONS else True
        ok = lie.finite and gap <= ELBO_TOL and pos_ok
        seeds_note, warned = "", list(lie.warnings)
        if lie.finite and gap > ELBO_TOL and pos_ok:  # one seed's basin, or the rule? (module docstring)
            lies, mfs = [e_lie], [cands[0] if cands else float("nan")]
            for seed in range(1, LIE_SEEDS):
                run = Run(case, nb.LieGroupGuide, nb.LieGroupBLR(), args.steps, 10, jax.random.PRNGKey(seed))
                warned += run.warnings
                lies.append(safe_elbo(case, run.guide, run.params[-1], ekey) if run.finite else float("nan"))
                mf_s = Run.as_svi_run(case, AutoNormal, nb.BLR(), args.steps, 10, jax.random.PRNGKey(seed))
                mfs.append(safe_elbo(case, mf_s.guide, mf_s.params[-1], ekey))
            finite = int(np.sum(np.isfinite(lies)))
            med_lie, med_mf = float(np.nanmedian(lies)), float(np.nanmedian(mfs))
            ok = finite == LIE_SEEDS and med_mf - med_lie <= ELBO_TOL
            seeds_note = (f" ({LIE_SEEDS} seeds, {finite} finite: median {med_lie:.2f} against nb.BLR()+AutoNormal's "
                          f"{med_mf:.2f}, which ends in {np.nanmin(mfs):.2f}..{np.nanmax(mfs):.2f})")
        pos_s = " ".join(f"{k} {lo:.3f}" + (f"-{hi:.3f}" if hi - lo > 5e-4 else "") for k, (lo, hi) in pos.items()) or "-"
        line = (f"{case.name:27s} {d:3d} | {fmt(e_lie, '10.2f'):>10s} {fmt(gap, '8.2f'):>8s} "
                f"{lie.t_compile + lie.t_run:5.1f} | {pos_s[:28]:28s} | " + ("yes" if ok else "no")
                + ("" if lie.finite else " NONFINITE") + (f" [{len(warned)} warning(s)]" if warned else "")
                + seeds_note)
        lines.append(line)
        print(line, flush=True)
        if not ok:
            bad.append((case.name, bool(warned)))
        for w in warned:
            print(f"    warning: {str(w.message)[:160]}")
    print()
    print(header)
    for line in lines:
        print(line)
    n_ok = sum(line.rstrip().split(" | ")[-1].startswith("yes") for line in lines)
    n_app = sum(" n/a: " not in line for line in lines)
    print(f"liegroup: {n_ok} of {n_app} applicable cases ok (gap <= {ELBO_TOL} nat; positive-site medians within "
          f"{100 * POS_TOL:.0f}% of NUTS on the noise regressions)")
    silent = [n for n, warned in bad if not warned]
    print(f"liegroup silent failures: {', '.join(silent) if silent else 'none'}")
    print(f"liegroup wall time {time.perf_counter() - t_start:.0f} s")


ROW_RUNNERS = {"liegroup": liegroup_rows}
import robustness_rows  # noqa: E402 - the other entry points (expfam, von, newton, laplace)

ROW_RUNNERS.update(robustness_rows.ROW_RUNNERS)
ROWS = ("blr",) + tuple(ROW_RUNNERS)


if __name__ == "__main__":
    main()
