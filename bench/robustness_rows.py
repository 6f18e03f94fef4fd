r"""More entry points for ``bench/bench_robustness.py --rows``: each with its defaults, against the optimum
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

  ivon     ``nb.IVON()`` + ``AutoNormal`` under ``SVI``: IVON's defaults (no ``lr``: ``nb.BLR()``'s adaptive step
           size on IVON's step, and ``ess`` read from the model, printed as ``N``; numpyro_blr/deep/svi.py). Until
           IVON had a default ``lr`` this row ran ``nb.IVON(lr=0.3, ess=N, hess_init=0.1, beta2=0.999)``, the
           settings docs/deep-learning.md gives for SVI (``--ivon-tuned`` runs them again). Yardstick: the best
           mean-field Gaussian (``nb.BLR()`` + ``AutoNormal`` and ELBO* unless ``--no-opt``).
  mixture  ``nb.mixture_blr()`` (its defaults: the adaptive step size, backtracking; two components, read off the
           means given to ``init``; until it had a default ``lr`` this row ran ``nb.mixture_blr(0.3, 2)``, the
           settings of docs/mixtures.md) on the model's potential (``numpyro.infer.util.initialize_model``: minus
           the log joint in the unconstrained space, as ``SVI``'s autoguides see it), the components started at
           NumPyro's initial point and one unit either side along the first coordinate; its ELBO
           :math:`\mathbb E_q[-U - \log q]` from 2000 draws of the mixture. Yardstick: the best full Gaussian
           (``nb.BLR()`` + ``AutoMultivariateNormal`` and ELBO*): a mixture contains every Gaussian, so it should
           end no lower. Its end-of-run report is ``nb.mixture.check(state)`` (skipped steps, divergence,
           a loss still falling), called after the run.

gap = yardstick ELBO - row ELBO (2000 particles, common random numbers); ok = finite and gap <= 1 nat
(laplace: finite; its Laplace gap, ``E_q[l] - l(mode) - D/2`` from the run's report, is printed as ``lgap``).
'silent failures' are runs that are not ok and raised no warning.
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
        for message in (warned if isinstance(warned, list) else []):
            print(f"    warning: {message[:200]}", flush=True)
        if not ok:
            bad.append((case.name, bool(warned)))
    n_ok = sum(" | yes" in line for line in lines)
    n_app = sum(" n/a: " not in line for line in lines)
    print(f"{name}: {n_ok} of {n_app} applicable cases ok (gap <= {ELBO_TOL} nat)")
    silent = [n for n, warned in bad if not warned]
    print(f"{name} silent failures: {', '.join(silent) if silent else 'none'}")
    print(f"{name} wall time {time.perf_counter() - t_start:.0f} s", flush=True)


def _warned(run):
    """The run's warnings (messages; empty: none)."""
    return [str(w.message) for w in run.warnings]


def expfam_rows(selected, args, t_start):
    b = _bench()

    def fit_row(case, args):
        key, ekey = jax.random.PRNGKey(0), jax.random.PRNGKey(1)
        run = b.Run.as_svi_run(case, nb.ExpFamilyGuide, nb.BLR(), args.steps, 10, key)
        adam = b.Run(case, nb.ExpFamilyGuide, optax.adam(0.01), ADAM_STEPS, ADAM_STEPS // 10, key)
        mf = b.Run.as_svi_run(case, AutoNormal, nb.BLR(), args.steps, 10, key)
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
            e = b.safe_elbo(case, run.guide, run.params[-1], ekey)
            best = _best_gaussian(case, AutoMultivariateNormal, args, diagonal=False)
            gap = best - e if math.isfinite(e) else float("inf")
            ok = run.finite and (gap <= ELBO_TOL if judged else True)
            lgap = run.report.laplace_gap if run.report is not None else None
            lg = f" lgap {_fmt(lgap[0], '7.2f')} +- {_fmt(lgap[1], '5.2f')}" if lgap else ""
            fields = (f"ELBO {_fmt(e)} best {_fmt(best)} gap {_fmt(gap, '7.2f')}{lg} "
                      f"wall {run.t_compile + run.t_run:5.1f}")
            return fields, ok, _warned(run)

        _row_table(f"nb.{name}() + AutoMultivariateNormal defaults; yardstick nb.BLR() and ELBO*", name, selected,
                   args, t_start, fit_row)

    return runner


def n_observations(case):
    """The number of observations the case's likelihood sums over (IVON's ``ess``): the largest batch size of
    its observed sites."""
    tr = _bench().rc.model_trace(case.model, case.args, case.kwargs)
    sizes = [int(math.prod(site["fn"].batch_shape)) or 1 for site in tr.values()
             if site["type"] == "sample" and site.get("is_observed")]
    return max(sizes, default=1)


def _best_gaussian(case, guide_cls, args, diagonal):
    """(guide, params, best ELBO) of the Gaussian family: nb.BLR() after --steps and ELBO* unless --no-opt."""
    b = _bench()
    key, ekey = jax.random.PRNGKey(0), jax.random.PRNGKey(1)
    ref = b.Run.as_svi_run(case, guide_cls, nb.BLR(), args.steps, 10, key)
    cands = [b.safe_elbo(case, ref.guide, ref.params[-1], ekey)]
    d = b.rc.n_params(case)
    if not args.no_opt and (diagonal or d * (d + 3) // 2 <= b.OPT_MAX_PARAMS):
        try:
            opt = b.rc.optimal_guide_params(case, ref.guide, ref.params[-1], diagonal=diagonal)
            cands.append(b.safe_elbo(case, ref.guide, opt, ekey))
        except Exception:  # noqa: BLE001 - ELBO* unavailable: BLR's ELBO alone
            pass
    return max([v for v in cands if math.isfinite(v)], default=float("nan"))


def ivon_rows(selected, args, t_start):
    from numpyro_blr.deep import IVON

    b = _bench()
    tuned = getattr(args, "ivon_tuned", False)
    title = ("nb.IVON(lr=0.3, ess=N, hess_init=0.1, beta2=0.999)" if tuned else "nb.IVON() (its defaults; N: the ess it "
             "read)")

    def fit_row(case, args):
        key, ekey = jax.random.PRNGKey(0), jax.random.PRNGKey(1)
        n = n_observations(case)
        optim = IVON(lr=0.3, ess=n, hess_init=0.1, beta2=0.999) if tuned else IVON()
        run = b.Run(case, AutoNormal, optim, args.steps, 10, key)
        e = b.safe_elbo(case, run.guide, run.params[-1], ekey)
        best = _best_gaussian(case, AutoNormal, args, diagonal=True)
        gap = best - e if math.isfinite(e) else float("inf")
        ok = run.finite and gap <= ELBO_TOL
        fields = (f"N {int(optim.ess):5d} ELBO {_fmt(e)} best {_fmt(best)} gap {_fmt(gap, '9.2f')} "
                  f"wall {run.t_compile + run.t_run:5.1f}")
        return fields, ok, _warned(run)

    _row_table(f"{title} + AutoNormal under SVI; yardstick the best mean-field Gaussian (nb.BLR() + AutoNormal, "
               "ELBO*)", "ivon", selected, args, t_start, fit_row)


def mixture_rows(selected, args, t_start):
    import warnings

    import jax.numpy as jnp
    import numpy as np
    from jax.flatten_util import ravel_pytree
    from numpyro.infer.util import initialize_model

    from numpyro_blr.mixture import log_prob

    b = _bench()
    K = 2

    def fit_row(case, args):
        key, ekey = jax.random.PRNGKey(0), jax.random.PRNGKey(1)
        info = initialize_model(key, case.model, model_args=case.args, model_kwargs=case.kwargs)
        flat, unravel = ravel_pytree(info.param_info.z)
        loss = lambda x: info.potential_fn(unravel(x))  # noqa: E731 - minus the log joint, unconstrained
        opt = nb.mixture_blr()  # its defaults; K components from the means given to init
        shift = jnp.zeros_like(flat).at[0].set(1.0)
        state = opt.init(jnp.stack([flat - shift, flat + shift]))
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            t0 = time.perf_counter()
            run = jax.jit(lambda s, k: jax.lax.scan(lambda s, kk: opt.step(kk, s, loss), s, jax.random.split(k, args.steps)))
            state, _ = run(state, key)
            jax.block_until_ready(state)
            wall = time.perf_counter() - t0
            nb.mixture.check(state)  # the end-of-run report: skipped steps, divergence, a loss still falling
        draws = opt.sample(ekey, state, 2000)
        vals = -jax.vmap(loss)(draws) - log_prob(state, draws)
        e = float(jnp.mean(vals)) if bool(jnp.all(jnp.isfinite(vals))) else float("nan")
        skipped = int(state.skipped)
        finite = all(bool(jnp.all(jnp.isfinite(v))) for v in (state.means, state.precision, state.logits))
        best = _best_gaussian(case, AutoMultivariateNormal, args, diagonal=False)
        gap = best - e if math.isfinite(e) else float("inf")
        ok = finite and gap <= ELBO_TOL
        w = np.exp(np.asarray(state.logits, np.float64) - np.max(np.asarray(state.logits, np.float64)))
        fields = (f"ELBO {_fmt(e)} best {_fmt(best)} gap {_fmt(gap, '9.2f')} skipped {skipped:4d} "
                  f"weights {'/'.join(f'{x:.2f}' for x in w / w.sum())} wall {wall:5.1f}")
        return fields, ok, [str(c.message) for c in caught if not issubclass(c.category, b.QUIET)]

    _row_table(f"nb.mixture_blr() (its defaults), {K} components, on the model's potential; yardstick the best full "
               "Gaussian (nb.BLR() + AutoMultivariateNormal, ELBO*)", "mixture", selected, args, t_start, fit_row)


ROW_RUNNERS = {
    "expfam": expfam_rows,
    "von": _preset_rows("von", nb.von, True),
    "newton": _preset_rows("newton", nb.newton, True),
    "laplace": _preset_rows("laplace", nb.laplace, False),
    "ivon": ivon_rows,
    "mixture": mixture_rows,
}
