r"""What a message-passing run says about itself: :class:`Report`, the counterpart of :func:`numpyro_blr.fit_report`.

Every :meth:`~numpyro_blr.infer.MessagePassing.run` (``vmp``, ``ncvmp``, ``em``, ``svi``) ends by building a
:class:`Report` from what the run already holds (the ELBO history, the last sweep's :class:`~.vmp.SweepInfo`
and the final state), stores it as ``result.report`` and warns once per problem, naming the sites and the one
change that fixes it:

* **not converged**: the relative ELBO change did not fall below ``tol`` within ``num_steps``; the sites listed
  are those the last sweep still moved most (a Gaussian's mean in posterior standard deviations, other
  families' expectation parameters relatively: :attr:`SweepInfo.change`);
* **damped** (``ncvmp``): sweeps whose ELBO decreased were rejected and the non-conjugate step halved
  (backtracking, as ``nb.BLR``'s); the report gives the factor it ended at, and warns only when the ELBO kept
  decreasing at the smallest one (the non-conjugate estimate is then not an ascent direction of the ELBO);
* **collapsed component**: a point estimate on a positive support (a mixture component's scale under
  :func:`~.vmp.em`) fell below :math:`\sqrt{\varepsilon}` times the spread (standard deviation) of the observed
  values of the factors that read it: the likelihood is unbounded as a component's scale goes to 0 on one data
  point (Day 1969), EM heads there and the ELBO becomes meaningless (1e12 and more, from cancellation), so the fit
  is reported as not converged. On the K = 20, N = 8 mixture of issue 25 the scale reached 6e-16 (float64) and
  7e-10 (float32); a scale 1.5e-8 (float64) or 3.4e-4 (float32) times the data's spread is not one a fit resolves;
* **stochastic VI** (:func:`~.stochastic.svi`): the minibatch ELBO's average over the last quarter of the steps
  against the quarter before, in units of its standard error (Robbins-Monro steps never make the ELBO stop
  moving, so "converged" means its trend is within noise).
"""

from typing import NamedTuple

import numpy as np

#: how many sites a "not converged" message lists
LISTED = 5
#: stochastic VI: the last quarter's minibatch-ELBO average may differ from the previous quarter's by this many
#: standard errors and still count as stationary
STATIONARY_SE = 3.0


class Report(NamedTuple):
    """The evidence of one message-passing run and the problems found in it (``problems``: messages, empty if none).

    ``change``: site -> the last sweep's change (posterior sds for a Gaussian's mean, relative otherwise);
    ``damping``: the non-conjugate step's backtracking factor at the end (1 without non-conjugate sites);
    ``rejected``: sweeps rejected because the ELBO decreased; ``collapsed``: ``"site[index]"`` -> value;
    ``relative_change``: the last sweep's relative ELBO change (svi: the minibatch ELBO's trend in standard errors)."""

    name: str
    steps: int
    converged: bool
    elbo: float
    relative_change: float
    change: dict
    damping: float
    rejected: int
    collapsed: dict
    problems: list

    def __str__(self):
        state = "converged" if self.converged else "not converged"
        if self.name == "svi":
            lines = [f"svi fit: {self.steps} steps, {state}, last minibatch ELBO {self.elbo:.8g} (trend over the last "
                     f"quarter {self.relative_change:.3g} standard errors)"]
            lines += [f"  - {p}" for p in self.problems] or ["  no problem found"]
            return "\n".join(lines)
        lines = [f"{self.name} fit: {self.steps} sweeps, {state}, ELBO {self.elbo:.8g} (last relative change "
                 f"{self.relative_change:.3g}), {self.rejected} sweep(s) rejected by backtracking, non-conjugate "
                 f"step factor {self.damping:.3g}"]
        lines += [f"  - {p}" for p in self.problems] or ["  no problem found"]
        return "\n".join(lines)


def changes(order, change):
    """``{site: float}`` from a :class:`SweepInfo`'s ``change`` (per site in update order), or {}."""
    if change is None:
        return {}
    values = np.asarray(change, dtype=float)
    return {n: float(v) for n, v in zip(order, values)}


def moving(change):
    """``'a' (0.3), 'b' (0.01)``: the sites with the largest change, largest first."""
    ranked = sorted(((v, n) for n, v in change.items() if np.isfinite(v) and v > 0), reverse=True)[:LISTED]
    return ", ".join(f"'{n}' ({v:.2g})" for v, n in ranked)


def collapsed_points(engine, state):
    r"""``{"site[i, j]": value}`` for point sites on a positive support whose value is below :math:`\sqrt\varepsilon`
    times the spread of the observed values of the factors that read them (module docstring)."""
    graph = engine.graph
    points = [n for n, s in graph.sites.items() if s.kind == "point"]
    if not points:
        return {}
    params = engine.params(state)
    out = {}
    for n in points:
        s = graph.sites[n]
        codomain = getattr(s.transform, "codomain", None)
        lower = getattr(codomain, "lower_bound", None)
        if lower is None or hasattr(codomain, "upper_bound") or not np.all(np.asarray(lower) == 0):
            continue  # only scales bounded below by 0 and not above can collapse onto a data point
        value = np.asarray(params.get(n, np.nan), dtype=float)
        data_scale = engine.data_scale(n)
        if data_scale is None:
            continue
        eps = float(np.finfo(np.asarray(params[n]).dtype).eps)
        if not data_scale > 0:
            continue
        small = np.argwhere(np.atleast_1d(value) < np.sqrt(eps) * data_scale)
        for idx in small[:LISTED]:
            key = f"{n}[{', '.join(str(int(i)) for i in idx)}]" if np.ndim(value) else n
            out[key] = float(np.atleast_1d(value)[tuple(idx)])
    return out


def eps_of(state, engine):
    return float(np.finfo(engine.float_dtype).eps)


def build(engine, name, steps, converged, history, tol, info, damping=1.0, rejected=0, floor_decreases=0,
          state=None, num_steps=None):
    """The :class:`Report` of a deterministic run (``vmp``, ``ncvmp``, ``em``)."""
    elbo = history[-1] if history else float("nan")
    rel = abs(history[-1] - history[-2]) / max(abs(history[-1]), 1e-300) if len(history) > 1 else float("nan")
    change = changes(engine.order, None if info is None else info.change)
    problems = []
    collapsed = collapsed_points(engine, state) if state is not None else {}
    if collapsed:
        listed = ", ".join(f"{k} = {v:.3g}" for k, v in collapsed.items())
        problems.append(
            f"{name}: a component collapsed: {listed} fell below {np.sqrt(eps_of(state, engine)):.2g} times the spread of "
            "the data it scales, towards where the likelihood is unbounded (a component on a single data point), so "
            "the ELBO "
            f"({elbo:.3g}) is meaningless. Use fewer components (at most a few per data point), give the scale a prior "
            "(a latent Gamma/InverseGamma site instead of numpyro.param), or bound it below (constraint=interval).")
        converged = False
    if not converged and not collapsed and (steps > 0 or rejected) and tol is not None:
        sites = moving(change)
        where = f"; the last sweep still moved {sites} (posterior sds for a Gaussian's mean, relative otherwise)" if sites else ""
        h = np.asarray(history, dtype=float)
        eps = float(np.finfo(np.asarray(info.elbo).dtype).eps) if info is not None else np.finfo(float).eps
        slack = 1e3 * eps * np.maximum(np.abs(h[:-1]), 1.0)
        decreases = int(np.sum(np.diff(h) < -slack)) if len(h) > 1 else 0
        fix = "Run more sweeps (run(result.state, num_steps=...)) or loosen tol"
        if decreases and name == "ncvmp":
            lr = getattr(engine, "nc_lr", 1.0)
            lr = f"{0.5 * lr * damping:.3g}" if not callable(lr) else "a smaller schedule"
            fix = (f"The ELBO decreased in {decreases} of {len(h) - 1} sweeps (the non-conjugate step overshoots): pass "
                   f"nonconjugate_lr={lr} (or backtrack=True), or run more sweeps")
        elif decreases:
            fix = (f"The ELBO decreased in {decreases} of {len(h) - 1} sweeps: pass lr < 1 (damped steps), or run more "
                   "sweeps")
        fix += "."
        problems.append(
            f"{name} has not converged after {steps} sweeps: the relative ELBO change is {rel:.3g}, above tol={tol}{where}. "
            + fix)
    if floor_decreases:
        problems.append(
            f"{name}: the ELBO decreased in {floor_decreases} sweep(s) even with the non-conjugate step damped to "
            f"{damping:.3g} of nonconjugate_lr: the non-conjugate estimate is not an ascent direction of the ELBO there. "
            "Use estimator='projected' (or 'cubature'), or more num_samples.")
    return Report(name, int(steps), bool(converged), float(elbo), float(rel), change, float(damping), int(rejected),
                  collapsed, problems)


def stochastic(engine, steps, history, info, rho):
    """The :class:`Report` of a stochastic-VI run: stationarity of the minibatch ELBO (module docstring)."""
    h = np.asarray(history, dtype=float)
    q = len(h) // 4
    converged, z = False, float("nan")
    if q >= 5:
        last, before = h[-q:], h[-2 * q:-q]
        se = np.sqrt(np.var(last, ddof=1) / q + np.var(before, ddof=1) / q)
        z = abs(last.mean() - before.mean()) / se if se > 0 else (0.0 if last.mean() == before.mean() else np.inf)
        converged = bool(z < STATIONARY_SE)
    change = changes(engine.globals, None if info is None else info.change)
    problems = []
    if steps > 0 and not converged:
        sites = moving(change)
        why = (f"the minibatch ELBO's average over the last {q} steps differs from the {q} before by {z:.3g} standard "
               "errors" if q >= 5 else f"{steps} steps are too few to judge (at least 20 are needed)")
        problems.append(
            f"svi has not converged after {steps} steps (step size now {rho:.3g}): {why}"
            + (f"; the last step moved {sites}" if sites else "")
            + ". Continue the run (run(result.state, key=..., num_epochs=...)) or use larger minibatches.")
    return Report("svi", int(steps), converged, float(h[-1]) if len(h) else float("nan"), z, change, 1.0, 0, {},
                  problems)
