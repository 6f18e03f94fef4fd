"""The default ``nb.BLR()`` on ordinary NumPyro models nobody tuned it on (``bench/robustness_cases.py``).

For each ``fast`` case: ``SVI(model, AutoMultivariateNormal(model), nb.BLR(), Trace_ELBO())`` for 500
steps must reach the reference posterior (means within 0.1 reference-sd, sds within 0.9-1.1x, in
NumPyro's unconstrained space), and AutoNormal must end with a finite loss. The reference moments
are read from ``tests/data/robustness_refs.json`` (written by ``bench/make_robustness_refs.py`` from
posteriordb draws or long NUTS runs); nothing here runs NUTS. Cases built on
``../shared/posteriordb`` are skipped when that folder is missing.

Full bench (timings, Adam, all cases): ``python bench/bench_robustness.py``.
"""

import json
import os
import sys

import jax
import numpy as np
import pytest
from numpyro.infer import SVI, Trace_ELBO
from numpyro.infer.autoguide import AutoMultivariateNormal, AutoNormal

import numpyro_blr as nb

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "bench"))
import robustness_cases as rc  # noqa: E402

with open(os.path.join(ROOT, "tests", "data", "robustness_refs.json")) as f:
    REFS = json.load(f)["cases"]

STEPS = 500
MEAN_TOL, SD_LO, SD_HI = 0.1, 0.9, 1.1
# Tolerance. The reference moments carry Monte Carlo error: per coordinate, mcse_mean (in reference
# sds, 1/sqrt(ESS): <= 0.013 here) and mcse_sd (relative, ~1/sqrt(2 ESS): <= 0.01). A fit whose
# distance to the TRUE posterior is within the criterion can differ from the reference by up to
# Z * mcse more, with Z = 3 (a coordinate-wise 3-sigma bound on the reference's error), so the
# checks are |mean - ref| / ref_sd <= 0.1 + 3 mcse_mean and
# 0.9 (1 - 3 mcse_sd) <= sd / ref_sd <= 1.1 (1 + 3 mcse_sd). The guide's moments are exact (closed
# form from its loc and scale params, rc.guide_moments(exact=True)), so there is no guide-draw MC
# error; from n = 4000 guide draws it would add ~1/sqrt(n) = 0.016 sd to the mean error and
# ~1/sqrt(2n) = 1.1% to the sd ratio.
Z = 3.0

pytestmark = pytest.mark.slow


@pytest.fixture(autouse=True)
def x64():
    with jax.enable_x64(True):
        yield


def _case(name):
    try:
        return rc.get(name)
    except KeyError:
        pytest.skip(f"{name} needs ../shared/posteriordb, which is missing")


def _ref(name):
    return {k: (np.asarray(s["mean"]), np.asarray(s["sd"]), np.asarray(s["mcse_mean"]), np.asarray(s["mcse_sd"]))
            for k, s in REFS[name]["sites"].items()}


def _fit(case, guide_cls):
    guide = guide_cls(case.model)
    svi = SVI(case.model, guide, nb.BLR(), Trace_ELBO())
    result = svi.run(jax.random.PRNGKey(0), STEPS, *case.args, progress_bar=False, **case.kwargs)
    return guide, result


def test_reference_file_matches_the_case_library():
    fast = {c.name for c in rc.cases() if c.fast}
    missing = fast - set(REFS)
    assert not missing, f"fast cases without reference moments: {missing}; run bench/make_robustness_refs.py"
    for name in fast:
        assert REFS[name]["n_params"] == rc.n_params(rc.get(name))
        assert REFS[name]["max_rhat"] < 1.01


@pytest.mark.parametrize("name", sorted(n for n, r in REFS.items() if r["near_gaussian"] and r.get("fast", True)))
def test_default_blr_full_gaussian_reaches_reference(name):
    case = _case(name)
    guide, result = _fit(case, AutoMultivariateNormal)
    assert np.all(np.isfinite(np.asarray(result.losses[-50:]))), "non-finite loss at the end of the run"
    fit = rc.guide_moments(guide, result.params, case, exact=True)
    problems = []
    for site, (m0, s0, mc_m, mc_s) in _ref(name).items():
        m1, s1 = fit[site]
        err = np.abs(m1 - m0) / s0
        ratio = s1 / s0
        for i in range(m0.size):
            if not err[i] <= MEAN_TOL + Z * mc_m[i]:
                problems.append(f"{site}[{i}] mean off by {err[i]:.3g} sd (allowed {MEAN_TOL + Z * mc_m[i]:.3f})")
            lo, hi = SD_LO * (1 - Z * mc_s[i]), SD_HI * (1 + Z * mc_s[i])
            if not lo <= ratio[i] <= hi:
                problems.append(f"{site}[{i}] sd ratio {ratio[i]:.3g} (allowed {lo:.3f}-{hi:.3f})")
    assert not problems, f"{name}, AutoMultivariateNormal, {STEPS} steps of nb.BLR(): " + "; ".join(problems)


@pytest.mark.parametrize("name", sorted(n for n, r in REFS.items() if r.get("fast", True)))
def test_default_blr_mean_field_finite_loss(name):
    case = _case(name)
    _, result = _fit(case, AutoNormal)
    losses = np.asarray(result.losses)
    assert np.all(np.isfinite(losses[-50:])), f"{name}, AutoNormal: non-finite loss at the end: {losses[-5:]}"
    assert all(np.all(np.isfinite(np.asarray(v))) for v in result.params.values())
