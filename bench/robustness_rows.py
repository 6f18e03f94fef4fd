"""More entry points for ``bench/bench_robustness.py --rows``: each with its defaults, against the optimum
of its own family on the robustness cases it applies to.

Rows (each fits ``--steps`` steps with one jitted ``lax.scan``, as ``SVI.run``):

  expfam   ``nb.ExpFamilyGuide(model)`` + ``nb.BLR()``: a Gaussian per real site, a Gamma per positive
           site, a Beta per unit-interval site, ... Yardstick: the same guide after 5000 steps of
           ``optax.adam(0.01)`` (the family's optimum as far as Adam gets) and, for information, the
           mean-field Gaussian ELBO (``nb.BLR()`` + ``AutoNormal``): ``vsMF`` is ExpFamilyGuide minus
           mean-field Gaussian (positive: its families fit better).
  von      ``nb.von()`` + ``AutoMultivariateNormal``;
  newton   ``nb.newton()`` + ``AutoMultivariateNormal``;
  laplace  ``nb.laplace()`` + ``AutoMultivariateNormal`` (the Laplace approximation: not the ELBO's
           optimum, so only its finiteness and its warnings are judged, and the gap is printed).
           Yardstick of these three: ``nb.BLR()`` + ``AutoMultivariateNormal`` and ELBO* (the KL-optimal
           full Gaussian, ``robustness_cases.optimal_gaussian``) unless ``--no-opt``.

gap = yardstick ELBO - row ELBO (2000 particles, common random numbers); ok = finite and gap <= 1 nat
(laplace: finite). 'silent failures' are runs that are not ok and raised no warning.
"""

import math
import time

import jax
import optax
from numpyro.infer.autoguide import AutoMultivariateNormal, AutoNormal

import numpyro_blr as nb

ELBO_TOL = 1.0
ADAM_STEPS = 5000


def _bench():
    import bench_robustness  # noqa: PLC0415 - the runner imports this module; share its helpers

    return bench_robustness


def _fmt(x, spec="10.2f"):
    return _bench().fmt(x, spec)


def _row_table(title, name, selected, args, t_start, fit_row):
    """Run ``fit_row(case, args) -> (line_fields, ok, warned)`` over the cases and print the table."""
    print(f"\n{name}: {title}, {args.steps} steps", flush=True)
    lines, bad = [], []
    for case in selected:
        try:
            fields, ok, warned = fit_row(case, args)
        except Exception as err:  # noqa: BLE001 - the entry point does not apply to this model
            line = f"{case.name:27s} | n/a: {type(err).__name__}: {str(err)[:100]}"
            lines.append(line)
            print(line, flush=True)
            continue
        line = f"{case.name:27s} | {fields} | " + ("yes" if ok else "no") + (" [warned]" if warned else "")
        lines.append(line)
        print(line, flush=True)
        if not ok:
            bad.append((case.name, warned))
    n_ok = sum(" | yes" in line for line in lines)
    n_app = sum(" n/a: " not in line for line in lines)
    print(f"{name}: {n_ok} of {n_app} applicable cases ok (gap <= {ELBO_TOL} nat)")
    silent = [n for n, warned in bad if not warned]
    print(f"{name} silent failures: {', '.join(silent) if silent else 'none'}")
    print(f"{name} wall time {time.perf_counter() - t_start:.0f} s", flush=True)


def _warned(run):
    return bool(run.warnings)


def expfam_rows(selected, args, t_start):
    b = _bench()

    def fit_row(case, args):
        key, ekey = jax.random.PRNGKey(0), jax.random.PRNGKey(1)
        run = b.Run(case, nb.ExpFamilyGuide, nb.BLR(), args.steps, 10, key)
        adam = b.Run(case, nb.ExpFamilyGuide, optax.adam(0.01), ADAM_STEPS, ADAM_STEPS // 10, key)
        mf = b.Run(case, AutoNormal, nb.BLR(), args.steps, 10, key)
        e = b.safe_elbo(case, run.guide, run.params[-1], ekey)
        e_adam = b.safe_elbo(case, adam.guide, adam.params[-1], ekey)
        e_mf = b.safe_elbo(case, mf.guide, mf.params[-1], ekey)
        best = max([v for v in (e, e_adam) if math.isfinite(v)], default=float("nan"))
        gap = best - e if math.isfinite(e) else float("inf")
        ok = run.finite and gap <= ELBO_TOL
        fields = (f"ELBO {_fmt(e)} Adam {_fmt(e_adam)} gap {_fmt(gap, '7.2f')} vsMF {_fmt(e - e_mf, '7.2f')} "
                  f"wall {run.t_compile + run.t_run:5.1f}")
        return fields, ok, _warned(run)

    _row_table("nb.ExpFamilyGuide + nb.BLR() defaults; yardstick the same guide after "
               f"{ADAM_STEPS} steps of optax.adam(0.01)", "expfam", selected, args, t_start, fit_row)


def _preset_rows(name, make, judged):
    def runner(selected, args, t_start):
        b = _bench()

        def fit_row(case, args):
            key, ekey = jax.random.PRNGKey(0), jax.random.PRNGKey(1)
            run = b.Run(case, AutoMultivariateNormal, make(), args.steps, 10, key)
            ref = b.Run(case, AutoMultivariateNormal, nb.BLR(), args.steps, 10, key)
            e = b.safe_elbo(case, run.guide, run.params[-1], ekey)
            cands = [b.safe_elbo(case, ref.guide, ref.params[-1], ekey)]
            if not args.no_opt:
                try:
                    opt = b.rc.optimal_guide_params(case, ref.guide, ref.params[-1], diagonal=False)
                    cands.append(b.safe_elbo(case, ref.guide, opt, ekey))
                except Exception:  # noqa: BLE001 - ELBO* unavailable: BLR's ELBO alone
                    pass
            best = max([v for v in cands if math.isfinite(v)], default=float("nan"))
            gap = best - e if math.isfinite(e) else float("inf")
            ok = run.finite and (gap <= ELBO_TOL if judged else True)
            fields = f"ELBO {_fmt(e)} best {_fmt(best)} gap {_fmt(gap, '7.2f')} wall {run.t_compile + run.t_run:5.1f}"
            return fields, ok, _warned(run)

        _row_table(f"nb.{name}() + AutoMultivariateNormal defaults; yardstick nb.BLR() and ELBO*", name, selected,
                   args, t_start, fit_row)

    return runner


ROW_RUNNERS = {
    "expfam": expfam_rows,
    "von": _preset_rows("von", nb.von, True),
    "newton": _preset_rows("newton", nb.newton, True),
    "laplace": _preset_rows("laplace", nb.laplace, False),
}
