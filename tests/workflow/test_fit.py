"""nb.fit: one compiled program per (model, guide, optimizer, loss, shapes), the same result as SVI.run,
refits without compiling, programs that do not depend on the process, and errors that name the argument."""

import os
import subprocess
import sys
import textwrap
import warnings

import jax
import jax.monitoring
import jax.numpy as jnp
import numpy as np
import numpyro
import numpyro.distributions as dist
import optax
import pytest
from numpyro import handlers
from numpyro.infer import SVI, Trace_ELBO
from numpyro.infer.autoguide import AutoDelta, AutoDiagonalNormal, AutoMultivariateNormal, AutoNormal

import numpyro_blr as nb

# svi.run here starts from svi.init's default compiled program (tests/conftest.py runs NumPyro's eager start elsewhere)
pytestmark = pytest.mark.compiled_init

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def numpyro_svi():
    """conftest's ``numpyro_svi`` (NumPyro's own svi.init and svi.run in the block), imported when used: this module is
    imported by the subprocesses below, where importing conftest would turn the suite's compilation cache on."""
    from conftest import numpyro_svi as block

    return block()


def regression(x, y=None):
    a = numpyro.sample("a", dist.Normal(0.0, 5.0))
    b = numpyro.sample("b", dist.Normal(0.0, 5.0))
    s = numpyro.sample("s", dist.HalfNormal(2.0))
    with numpyro.plate("n", x.shape[0]):
        numpyro.sample("y", dist.Normal(a + b * x, s), obs=y)


def data(n=30, seed=0, slope=2.0):
    rng = np.random.default_rng(seed)
    x = np.linspace(-1.0, 1.0, n).astype(np.float32)
    return x, (0.5 + slope * x + 0.3 * rng.standard_normal(n)).astype(np.float32)


class CompileCounter:
    """Counts XLA backend compilations (jax.monitoring) while active."""

    def __init__(self):
        self.count = 0
        self.active = False
        jax.monitoring.register_event_duration_secs_listener(self._listen)

    def _listen(self, name, duration, **kwargs):
        if self.active and name == "/jax/core/compile/backend_compile_duration":
            self.count += 1

    def __enter__(self):
        self.count, self.active = 0, True
        return self

    def __exit__(self, *exc):
        self.active = False


@pytest.fixture(scope="module")
def compiles():
    return CompileCounter()


def unsorted_sites(x, y=None):
    """The regression with its sites out of alphabetical order (s before p): a guide set up in a trace must
    still lay its latent vector out in the model's order, as one set up eagerly does."""
    a = numpyro.sample("a", dist.Normal(0.0, 5.0))
    b = numpyro.sample("b", dist.Normal(0.0, 5.0))
    s = numpyro.sample("s", dist.HalfNormal(2.0))
    p = numpyro.sample("p", dist.Beta(2.0, 2.0))
    with numpyro.plate("n", x.shape[0]):
        numpyro.sample("y", dist.Normal(a + b * x, s * (0.5 + p)), obs=y)


@pytest.mark.parametrize("guide_cls", [AutoNormal, pytest.param(AutoDiagonalNormal, marks=pytest.mark.slow),
                                       pytest.param(AutoMultivariateNormal, marks=pytest.mark.slow)])
@pytest.mark.slow
def test_fit_equals_svi_run(guide_cls):
    """In float64, to rounding (in float32 the programs' different fusion shows in the early losses' last digits
    and is amplified by the iteration: 1e-4 relative)."""
    with jax.enable_x64(True):
        x, y = (v.astype(np.float64) for v in data())
        key = jax.random.PRNGKey(3)
        res = nb.fit(unsorted_sites, guide_cls(unsorted_sites), x, y=y, num_steps=40, rng_key=key, progress_bar=False)
        with numpyro_svi():  # NumPyro's own start and steps (svi.run is otherwise nb.fit's program)
            ref = SVI(unsorted_sites, guide_cls(unsorted_sites), nb.BLR(), nb.Trace_ELBO()).run(key, 40, x, y=y,
                                                                                                progress_bar=False)
        for k in ref.params:
            np.testing.assert_allclose(res.params[k], ref.params[k], rtol=1e-9, atol=1e-12)
        np.testing.assert_allclose(res.losses, ref.losses, rtol=1e-9)


@pytest.mark.slow
def test_numpyro_trace_elbo_sums_the_same_terms():
    """nb.Trace_ELBO is NumPyro's Trace_ELBO up to the order of the sum."""
    x, y = data()
    guide = AutoNormal(regression)
    svi = SVI(regression, guide, numpyro.optim.Adam(0.01), Trace_ELBO())
    state = svi.init(jax.random.PRNGKey(0), x, y=y)
    params = svi.get_params(state)
    for particles in (1, 3):
        ours = nb.Trace_ELBO(num_particles=particles).loss(jax.random.PRNGKey(1), params, regression, guide, x, y=y)
        theirs = Trace_ELBO(num_particles=particles).loss(jax.random.PRNGKey(1), params, regression, guide, x, y=y)
        np.testing.assert_allclose(ours, theirs, rtol=1e-6)


@pytest.mark.slow  # eager traces: 1-3.5 s of one-operation compiles each
@pytest.mark.parametrize("guide_cls", [AutoNormal, AutoDiagonalNormal, AutoMultivariateNormal])
def test_guide_draws_are_numpyros_bit_for_bit(guide_cls):
    """nb.Trace_ELBO draws the guide's Gaussian sites once, behind an optimisation barrier (compile_once._draw_once:
    XLA copied the draw into every consumer; IVON + AutoNormal's 15-step program on unsorted_sites compiled in 2.2 s
    at -O0, now 0.7 s): the values and the transforms' intermediates (AutoNormal's constrained sites s and p) are
    NumPyro's own; under an outer substitute the substituted value is kept, with no stale intermediates."""
    from numpyro_blr.compile_once import _draw_once

    x, y = data()
    guide = guide_cls(unsorted_sites)
    svi = SVI(unsorted_sites, guide, numpyro.optim.Adam(0.01), Trace_ELBO())
    params = {k: v + 0.1 if k.endswith("loc") else v for k, v in svi.get_params(svi.init(jax.random.PRNGKey(0), x, y=y)).items()}
    key = jax.random.PRNGKey(3)

    def trace(g):
        return handlers.trace(handlers.substitute(g, data=params)).get_trace(x, y=y)

    theirs, ours = trace(handlers.seed(guide, key)), trace(_draw_once(handlers.seed(guide, key)))
    drawn = [n for n, site in theirs.items() if site["type"] == "sample"]
    assert drawn
    for n in drawn:
        np.testing.assert_array_equal(ours[n]["value"], theirs[n]["value"])
        for (a, ia), (b, ib) in zip(ours[n]["intermediates"], theirs[n]["intermediates"]):
            np.testing.assert_array_equal(a, b)
            jax.tree.map(np.testing.assert_array_equal, ia, ib)
        assert len(ours[n]["intermediates"]) == len(theirs[n]["intermediates"])
    fixed = {n: jnp.asarray(theirs[n]["value"]) + 0.5 for n in drawn}
    with handlers.substitute(data=fixed):
        kept = trace(_draw_once(handlers.seed(guide, key)))
    for n in drawn:
        np.testing.assert_array_equal(kept[n]["value"], fixed[n])
        assert kept[n]["intermediates"] == []


@pytest.mark.slow
def test_guide_draws_are_not_copied_into_each_consumer():
    """The compiled SVI step of NumPyro's Adam with AutoNormal on unsorted_sites (float32): with NumPyro's
    Trace_ELBO 1,468 of its operations are erf_inv (the normal draws, copied by XLA's fusion into each consumer),
    with nb.Trace_ELBO 160; the same losses to rounding. Compiled for the CPU on any machine: the copies are the
    CPU compiler's (a GPU fuses differently; the test failed on an H200 before)."""
    x, y = data()
    counts, losses = [], []
    for loss in (Trace_ELBO(), nb.Trace_ELBO()):
        with jax.default_device(jax.devices("cpu")[0]):
            svi = SVI(unsorted_sites, AutoNormal(unsorted_sites), numpyro.optim.Adam(0.01), loss)
            state = svi.init(jax.random.PRNGKey(0), x, y=y)
            step = jax.jit(svi.update)
            counts.append(sum("erf_inv" in line for line in step.lower(state, x, y=y).compile().as_text().splitlines()))
            losses.append(float(step(state, x, y=y)[1]))
    assert counts[1] * 4 < counts[0], counts
    assert losses[1] == pytest.approx(losses[0], rel=1e-6)


@pytest.mark.parametrize("optim", [lambda: numpyro.optim.Adam(0.05), lambda: optax.adam(0.05)], ids=["numpyro", "optax"])
@pytest.mark.slow
def test_any_numpyro_optimizer(optim):
    x, y = data()
    key = jax.random.PRNGKey(0)
    o = optim()
    res = nb.fit(regression, AutoNormal(regression), x, y=y, optim=o, num_steps=30, rng_key=key, progress_bar=False)
    ref = SVI(regression, AutoNormal(regression), o, nb.Trace_ELBO()).run(key, 30, x, y=y, progress_bar=False)
    for k in ref.params:
        np.testing.assert_allclose(res.params[k], ref.params[k], rtol=1e-5, atol=1e-6)


@pytest.mark.slow
def test_refit_with_new_data_does_not_compile(compiles):
    x, y = data(seed=0)
    guide = AutoNormal(regression)
    nb.fit(regression, guide, x, y=y, num_steps=30, progress_bar=False)
    x2, y2 = data(seed=1, slope=-1.0)
    with compiles:
        res = nb.fit(regression, guide, x2, y=y2, num_steps=30, progress_bar=False)
    assert compiles.count == 0
    # the refit is the fit of the new data (the guide's initialisation does not depend on the data's values)
    with numpyro_svi():
        ref = SVI(regression, AutoNormal(regression), nb.BLR(), nb.Trace_ELBO()).run(jax.random.PRNGKey(0), 30, x2,
                                                                                   y=y2, progress_bar=False)
    for k in ref.params:
        np.testing.assert_allclose(res.params[k], ref.params[k], rtol=1e-5, atol=1e-6)
    # a new nb.BLR() with the same options is the same program
    with compiles:
        nb.fit(regression, guide, x2, y=y2, optim=nb.BLR(), num_steps=30, progress_bar=False)
    assert compiles.count == 0
    # so is a guide built anew with the same options (nb.fit(model, AutoNormal(model), ...) in a loop), which the
    # fit sets up as it set up the first
    fresh = AutoNormal(regression)
    with compiles:
        again = nb.fit(regression, fresh, x2, y=y2, num_steps=30, progress_bar=False)
    assert compiles.count == 0
    for k in ref.params:
        np.testing.assert_allclose(again.params[k], ref.params[k], rtol=1e-5, atol=1e-6)
    leaves = jax.tree.leaves([site.get("value") for site in fresh.prototype_trace.values()])
    assert leaves and not any(isinstance(v, jax.core.Tracer) for v in leaves)
    assert float(fresh.median(again.params)["s"]) > 0
    # other options are another program, with their own fit
    with compiles:
        other = nb.fit(regression, AutoNormal(regression, init_scale=0.5), x2, y=y2, num_steps=30, progress_bar=False)
    assert compiles.count > 0
    assert not np.allclose(other.losses[:3], again.losses[:3])


def local_level(y):
    """A random walk observed with noise, written with NumPyro's ``scan``: the observations are scan's ``xs``."""
    from numpyro.contrib.control_flow import scan

    sigma_obs = numpyro.sample("sigma_obs", dist.HalfNormal(1.0))
    sigma_level = numpyro.sample("sigma_level", dist.HalfNormal(0.5))
    x0 = numpyro.sample("x0", dist.Normal(0.0, 5.0))

    def transition(x_prev, y_t):
        x = numpyro.sample("x", dist.Normal(x_prev, sigma_level))
        numpyro.sample("y", dist.Normal(x, sigma_obs), obs=y_t)
        return x, None

    scan(transition, x0, y)


def item_response(y):
    """Persons x items in crossed plates (dims -2 and -1), a 2-D observed site."""
    sigma_b = numpyro.sample("sigma_b", dist.HalfNormal(2.0))
    with numpyro.plate("items", y.shape[1], dim=-1):
        b = numpyro.sample("b", dist.Normal(0.0, sigma_b))
    with numpyro.plate("persons", y.shape[0], dim=-2):
        theta = numpyro.sample("theta", dist.Normal(0.0, 1.0))
    with numpyro.plate("persons", y.shape[0], dim=-2), numpyro.plate("items", y.shape[1], dim=-1):
        numpyro.sample("y", dist.Bernoulli(logits=theta - b), obs=y)


def _structure_data(model, seed):
    rng = np.random.default_rng(seed)
    if model is local_level:
        return np.cumsum(0.3 * rng.standard_normal(20)) + 0.5 * rng.standard_normal(20)
    return (rng.random((12, 4)) < 0.5).astype(np.float64)


@pytest.mark.slow  # two compilations per model
@pytest.mark.parametrize("model", [local_level, item_response], ids=["scan", "crossed_plates"])
def test_structures_fit_as_svi_run_and_refit_without_compiling(model, compiles):
    """Structures of bench/probe_families/structures.py: nb.fit gives svi.run's fit to rounding (float64) and a
    second data set of the same shapes (scan's xs, a 2-D observed site) is the same program."""
    with jax.enable_x64(True):
        y = _structure_data(model, 0)
        key = jax.random.PRNGKey(1)
        res = nb.fit(model, AutoNormal(model), y, num_steps=30, rng_key=key, progress_bar=False)
        with numpyro_svi():
            ref = SVI(model, AutoNormal(model), nb.BLR(), nb.Trace_ELBO()).run(key, 30, y, progress_bar=False)
        for k in ref.params:
            np.testing.assert_allclose(res.params[k], ref.params[k], rtol=1e-9, atol=1e-12)
        y2 = _structure_data(model, 1)
        with compiles:
            res2 = nb.fit(model, AutoNormal(model), y2, num_steps=30, rng_key=key, progress_bar=False)
        assert compiles.count == 0
        assert not np.allclose(res2.losses, res.losses)


def local_means(y=None):
    """A latent site per observation: the guide's parameters take the data's shape."""
    mu = numpyro.sample("mu", dist.Normal(0.0, 5.0))
    with numpyro.plate("n", y.shape[0]):
        z = numpyro.sample("z", dist.Normal(mu, 1.0))
        numpyro.sample("y", dist.Normal(z, 0.5), obs=y)


@pytest.mark.slow
@pytest.mark.parametrize("guide_cls", [AutoNormal, AutoMultivariateNormal])
def test_latent_sites_that_follow_the_data_refit_on_new_shapes(guide_cls):
    """The same guide object on data of another length, then back: each fit sets the guide up for its shapes
    (before, the second fit read the first one's setup and failed: "Model and guide shapes disagree")."""
    ys = {n: np.random.default_rng(n).normal(1.0, 1.0, n) for n in (20, 33)}
    fresh = {n: nb.fit(local_means, guide_cls(local_means), y=ys[n], num_steps=40, progress_bar=False) for n in ys}
    guide = guide_cls(local_means)
    for n in (20, 33, 20, 33):
        res = nb.fit(local_means, guide, y=ys[n], num_steps=40, progress_bar=False)
        np.testing.assert_array_equal(res.losses, fresh[n].losses)
        assert guide.median(res.params)["z"].shape == (n,)
        draws = guide.sample_posterior(jax.random.PRNGKey(1), res.params, sample_shape=(3,))
        assert draws["z"].shape == (3, n)
    # a fit continued on the shorter data after a fit of the longer: the guide as set up for the shorter
    half = nb.fit(local_means, guide, y=ys[20], num_steps=20, progress_bar=False)
    nb.fit(local_means, guide, y=ys[33], num_steps=20, progress_bar=False)
    resumed = nb.fit(local_means, guide, y=ys[20], num_steps=20, progress_bar=False, init_state=half.state)
    np.testing.assert_allclose(jnp.concatenate([half.losses, resumed.losses]), fresh[20].losses, rtol=1e-6)
    assert guide.median(resumed.params)["z"].shape == (20,)


@pytest.mark.slow
def test_kfold_with_the_guide_of_a_fit_on_data_of_another_length():
    """The workflow's programs set the guide up for their shapes too (they read the fit's setup before and failed)."""
    from numpyro_blr import workflow as wf

    ys = {n: np.random.default_rng(n).normal(1.0, 1.0, n) for n in (8, 12)}
    guide = AutoNormal(local_means)
    nb.fit(local_means, guide, y=ys[8], num_steps=20, progress_bar=False)
    for n in (12, 8):
        cv = wf.kfold(local_means, guide, y=ys[n], k=2, num_steps=20, warm_start=False)
        assert cv.n_data_points == n and np.isfinite(cv.elpd)
        assert guide.prototype_trace["z"]["value"].shape == (n,)


@pytest.mark.slow
def test_workflow_with_a_guide_built_anew_reuses_its_programs(compiles):
    """kfold/reloo/sbc(model, AutoNormal(model), ...) called again with a new guide of the same options: the
    programs of the first are reused (they compiled everything again before), with the same results, and the
    new guide is set up afterwards as the first was."""
    from numpyro_blr import workflow as wf

    y = np.random.default_rng(3).normal(1.0, 1.0, 10)
    first = wf.kfold(local_means, AutoNormal(local_means), y=y, k=5, num_steps=30, num_draws=50)
    s_first = wf.sbc(local_means, AutoNormal(local_means), y=y, num_datasets=4, num_draws=9, num_steps=30)
    fresh, fresh_sbc = AutoNormal(local_means), AutoNormal(local_means)
    with compiles:
        again = wf.kfold(local_means, fresh, y=y, k=5, num_steps=30, num_draws=50)
        s_again = wf.sbc(local_means, fresh_sbc, y=y, num_datasets=4, num_draws=9, num_steps=30)
    assert compiles.count == 0
    np.testing.assert_array_equal(np.asarray(again.elpd_i), np.asarray(first.elpd_i))
    for site in s_first.ranks:
        np.testing.assert_array_equal(s_again.ranks[site], s_first.ranks[site])
    for g in (fresh, fresh_sbc):
        leaves = jax.tree.leaves([site.get("value") for site in g.prototype_trace.values()])
        assert leaves and not any(isinstance(v, jax.core.Tracer) for v in leaves)
        assert g.prototype_trace["z"]["value"].shape == (10,)
    # other options: other programs
    with compiles:
        wf.kfold(local_means, AutoNormal(local_means, init_scale=0.5), y=y, k=5, num_steps=30, num_draws=50)
    assert compiles.count > 0


@pytest.mark.slow
def test_new_shapes_recompile_silently():
    guide = AutoNormal(regression)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        a = nb.fit(regression, guide, *data(n=20)[:1], y=data(n=20)[1], num_steps=20, progress_bar=False)
        b = nb.fit(regression, guide, *data(n=33)[:1], y=data(n=33)[1], num_steps=20, progress_bar=False)
    assert a.losses.shape == b.losses.shape == (20,)


@pytest.mark.slow
def test_progress_bar_and_resume_give_the_same_fit():
    x, y = data()
    guide = AutoMultivariateNormal(regression)
    whole = nb.fit(regression, guide, x, y=y, num_steps=40, progress_bar=False)
    shown = nb.fit(regression, guide, x, y=y, num_steps=40, progress_bar=True)
    half = nb.fit(regression, guide, x, y=y, num_steps=20, progress_bar=False)
    resumed = nb.fit(regression, guide, x, y=y, num_steps=20, progress_bar=False, init_state=half.state)
    for k in whole.params:
        np.testing.assert_allclose(shown.params[k], whole.params[k], rtol=1e-6, atol=1e-7)
        np.testing.assert_allclose(resumed.params[k], whole.params[k], rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(jnp.concatenate([half.losses, resumed.losses]), whole.losses, rtol=1e-6)


@pytest.mark.slow
def test_a_start_traced_after_another_fit_draws_from_its_own_key():
    """A program that starts a fit, traced after another program set the guide up for the same shapes, traces the
    setup again: before, the progress bar's start (traced after a fit without the bar, key 3) held that fit's
    initial locations as constants, so a fit from key 0 started where key 3's had (loss 14,108 against 668)."""
    def model(x, y=None):  # its own programs, whatever ran before
        regression(x, y)

    x, y = data()
    nb.fit(model, AutoNormal(model), x, y=y, num_steps=20, rng_key=jax.random.PRNGKey(3), progress_bar=False)
    plain = nb.fit(model, AutoNormal(model), x, y=y, num_steps=20, progress_bar=False)
    shown = nb.fit(model, AutoNormal(model), x, y=y, num_steps=20, progress_bar=True)
    np.testing.assert_allclose(shown.losses, plain.losses, rtol=1e-6)
    for k in plain.params:
        np.testing.assert_allclose(shown.params[k], plain.params[k], rtol=1e-6, atol=1e-7)


@pytest.mark.slow  # 10-12 s: four programs (run, continuation, two capacities)
def test_another_number_of_steps_and_a_continued_fit_compile_nothing(compiles):
    """The step count is an argument of the program on every backend (a loop that stops at it, its losses in a
    buffer of the program's capacity): a fit of another num_steps runs the same program, and a continued fit of
    any length the continuation's program (compiled by the first one). Each fit is svi.run's fit of that many
    steps, its losses those steps' alone (no NaN of the buffer's tail)."""
    x, y = data(seed=3)
    guide = AutoNormal(regression)
    first = nb.fit(regression, guide, x, y=y, num_steps=50, progress_bar=False)
    nb.fit(regression, guide, x, y=y, num_steps=10, progress_bar=False, init_state=first.state)  # its own program
    with compiles:
        short = nb.fit(regression, guide, x, y=y, num_steps=17, progress_bar=False)
        more = nb.fit(regression, guide, x, y=y, num_steps=33, progress_bar=False, init_state=short.state)
    assert compiles.count == 0
    assert short.losses.shape == (17,) and more.losses.shape == (33,)
    assert short.losses.dtype == first.losses.dtype and np.all(np.isfinite(np.asarray(more.losses)))
    np.testing.assert_array_equal(short.losses, first.losses[:17])  # the same steps, in the same program
    with numpyro_svi():
        ref = SVI(regression, AutoNormal(regression), nb.BLR(), nb.Trace_ELBO()).run(jax.random.PRNGKey(0), 17, x, y=y,
                                                                                   progress_bar=False)
    np.testing.assert_allclose(short.losses, ref.losses, rtol=1e-6)
    np.testing.assert_allclose(jnp.concatenate([short.losses, more.losses]), first.losses, rtol=1e-6)
    for k in ref.params:
        np.testing.assert_allclose(short.params[k], ref.params[k], rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(more.params[k], first.params[k], rtol=1e-5, atol=1e-6)
    # continued on a program that has not started a fit of these shapes (a larger capacity): its start sets the
    # guide up first (before: "'NoneType' object is not callable" from inside NumPyro)
    on = nb.fit(regression, guide, x, y=y, num_steps=1100, progress_bar=False, init_state=more.state)
    assert on.losses.shape == (1100,) and np.all(np.isfinite(np.asarray(on.losses)))


@pytest.mark.parametrize("guide_cls", [AutoNormal, AutoMultivariateNormal, AutoDelta])
@pytest.mark.slow
def test_guide_is_usable_after_a_fit(guide_cls):
    """The guide's setup was traced into the program; what it left in the guide is concrete again."""
    x, y = data()
    guide = guide_cls(regression)
    res = nb.fit(regression, guide, x, y=y, num_steps=30, progress_bar=False)
    leaves = jax.tree.leaves([site.get("value") for site in guide.prototype_trace.values()])
    assert not any(isinstance(v, jax.core.Tracer) for v in leaves)
    median = guide.median(res.params)
    assert np.isfinite(float(median["b"])) and float(median["s"]) > 0
    draws = guide.sample_posterior(jax.random.PRNGKey(1), res.params, sample_shape=(5,))
    assert draws["b"].shape == (5,)
    report = nb.fit_report(res, guide=guide) if guide_cls is not AutoDelta else None
    assert report is None or report.steps == 30


@pytest.mark.slow
def test_hand_written_guide():
    def guide(x, y=None):
        for name in ("a", "b"):
            loc = numpyro.param(f"{name}_loc", 0.0)
            scale = numpyro.param(f"{name}_scale", 0.5, constraint=dist.constraints.positive)
            numpyro.sample(name, dist.Normal(loc, scale))
        s_loc = numpyro.param("s_loc", 0.0)
        numpyro.sample("s", dist.LogNormal(s_loc, numpyro.param("s_scale", 0.3, constraint=dist.constraints.positive)))

    x, y = data()
    opt = nb.BLR(guide=guide, guide_args=(x,), guide_kwargs={"y": y})
    res = nb.fit(regression, guide, x, y=y, optim=opt, num_steps=60, progress_bar=False)
    assert np.isfinite(res.losses[-1]) and abs(float(res.params["b_loc"]) - 2.0) < 0.3


@pytest.mark.slow
def test_program_text_does_not_depend_on_the_hash_seed():
    script = textwrap.dedent(
        f"""
        import sys, hashlib
        sys.path.insert(0, {os.path.join(REPO, 'tests', 'workflow')!r})
        import jax, jax.numpy as jnp
        from numpyro.infer.autoguide import AutoNormal
        import numpyro_blr as nb
        from numpyro_blr.compile_once import _STEPS, _Program, _capacity, _split
        from test_fit import regression, data
        x, y = data()
        arrays, rebuild, _ = _split((x,), {{"y": y}})
        p = _Program(regression, AutoNormal(regression), nb.BLR(), nb.Trace_ELBO(), num_steps=3, chunk=3,
                     stable_update=False, rebuild=rebuild, compiler_options=None, capacity=_capacity(3))
        data = ([jnp.asarray(a) for a in arrays], {{_STEPS: jnp.asarray(3, jnp.int32)}})
        text = jax.jit(p._run_fn).lower(jax.random.PRNGKey(0), data).as_text()
        print(hashlib.sha256(text.encode()).hexdigest())
        """
    )
    digests = set()
    for seed in ("1", "2", "3"):
        env = dict(os.environ, PYTHONHASHSEED=seed, JAX_PLATFORMS=os.environ.get("JAX_PLATFORMS", "cpu"))
        out = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, check=True)
        digests.add(out.stdout.strip().splitlines()[-1])
    assert len(digests) == 1


@pytest.mark.slow
def test_compilation_cache_is_opt_in_and_hits_in_a_second_process(tmp_path):
    script = textwrap.dedent(
        f"""
        import sys
        sys.path.insert(0, {os.path.join(REPO, 'tests', 'workflow')!r})
        import jax, jax.monitoring
        counts = {{"hits": 0, "compiles": 0}}
        def listen(name, *a, **k):  # a program compiled (not read back) is a cache miss
            if name == "/jax/compilation_cache/cache_hits":
                counts["hits"] += 1
            if name == "/jax/compilation_cache/cache_misses":
                counts["compiles"] += 1
        jax.monitoring.register_event_listener(listen)
        import numpyro_blr as nb
        assert jax.config.jax_compilation_cache_dir is None, "the cache was switched on at import"
        nb.enable_compilation_cache(sys.argv[1])
        from numpyro.infer.autoguide import AutoNormal
        from test_fit import regression, data
        x, y = data()
        nb.fit(regression, AutoNormal(regression), x, y=y, num_steps=10, progress_bar=False)
        print(counts["hits"], counts["compiles"])
        """
    )
    env = dict(os.environ, JAX_PLATFORMS=os.environ.get("JAX_PLATFORMS", "cpu"))
    env.pop("JAX_COMPILATION_CACHE_DIR", None)
    runs = []
    for seed in ("1", "2"):
        env["PYTHONHASHSEED"] = seed
        out = subprocess.run([sys.executable, "-c", script, str(tmp_path / "cache")], env=env, capture_output=True,
                             text=True, check=True)
        runs.append(tuple(int(v) for v in out.stdout.split()[-2:]))
    (hits1, compiles1), (hits2, compiles2) = runs
    assert compiles1 > 0 and hits2 > 0
    assert compiles2 == 0, f"second process compiled {compiles2} program(s) (first: {compiles1})"
    assert any((tmp_path / "cache").iterdir())


def model_two_inputs(X, y=None):
    w = numpyro.sample("w", dist.Normal(0.0, 1.0).expand([X.shape[1]]).to_event(1))
    with numpyro.plate("n", X.shape[0]):
        numpyro.sample("y", dist.Normal(X @ w, 1.0), obs=y)


def test_bad_input_names_the_argument():
    x, y = data()
    guide = AutoNormal(regression)
    with pytest.raises(TypeError, match="optim must be"):
        nb.fit(regression, guide, x, y=y, optim="adam")
    with pytest.raises(ValueError, match="num_steps"):
        nb.fit(regression, guide, x, y=y, num_steps=0)
    with pytest.raises(ValueError, match="another model|model 'model_two_inputs'|of the model"):
        nb.fit(regression, AutoNormal(model_two_inputs), x, y=y, num_steps=5)
    with pytest.raises(TypeError, match="loss must be"):
        nb.fit(regression, guide, x, y=y, loss="elbo")
    with pytest.raises(ValueError, match="compile_effort"):
        nb.fit(regression, guide, x, y=y, compile_effort="max")
    # a column vector against a plate of n: it would broadcast to (n, n)
    with pytest.raises(ValueError, match=r"observed site 'y'.*argument 'y'.*\(30, 1\)"):
        nb.fit(regression, AutoNormal(regression), x, y=y[:, None], num_steps=5, progress_bar=False)
    # leading sizes that disagree
    X = np.ones((30, 2), np.float32)
    with pytest.raises(ValueError, match=r"observed site 'y'.*leading sizes disagree"):
        nb.fit(model_two_inputs, AutoNormal(model_two_inputs), X, y=y[:25], num_steps=5, progress_bar=False)


def reads_its_data_in_python(x, y=None):
    """A model SVI.run fits (its data are constants of its program) but nb.fit cannot trace: it reads y's values."""
    centre = float(np.mean(np.asarray(y)))
    a = numpyro.sample("a", dist.Normal(centre, 5.0))
    with numpyro.plate("n", x.shape[0]):
        numpyro.sample("y", dist.Normal(a, 1.0), obs=y)


@pytest.mark.slow
def test_a_model_that_reads_its_data_in_python_is_told_what_to_do():
    from numpyro_blr import workflow as wf

    x, y = data(n=12)
    SVI(reads_its_data_in_python, AutoNormal(reads_its_data_in_python), nb.BLR(), nb.Trace_ELBO()).run(
        jax.random.PRNGKey(0), 10, x, y=y, progress_bar=False)  # svi.run: the data are constants, it runs
    with pytest.raises(TypeError, match=r"nb.fit: the model reads the value of argument 'y' in Python "
                                        r"\(TracerArrayConversionError.*jnp.mean.*SVI\(model, guide, optim, loss\).run"):
        nb.fit(reads_its_data_in_python, AutoNormal(reads_its_data_in_python), x, y=y, num_steps=5, progress_bar=False)
    with pytest.raises(TypeError, match=r"kfold: the model reads the value of argument 'y'"):
        wf.kfold(reads_its_data_in_python, AutoNormal(reads_its_data_in_python), x, y=y, k=2, num_steps=5)
    # the model's own values read in Python (not the data's): JAX's error, which svi.run raises too
    def reads_a_sample(x, y=None):
        a = numpyro.sample("a", dist.Normal(0.0, 1.0))
        if a > 0:
            a = a + 1.0
        with numpyro.plate("n", x.shape[0]):
            numpyro.sample("y", dist.Normal(a, 1.0), obs=y)

    with pytest.raises(jax.errors.TracerBoolConversionError):
        nb.fit(reads_a_sample, AutoNormal(reads_a_sample), x, y=y, num_steps=5, progress_bar=False)


def test_hand_written_guide_of_another_model_is_refused():
    def other_guide(x, y=None):
        numpyro.sample("w", dist.Normal(numpyro.param("w_loc", 0.0), 1.0))

    x, y = data()
    with pytest.raises(ValueError, match=r"\['w'\].*another model"):
        nb.fit(regression, other_guide, x, y=y, optim=numpyro.optim.Adam(0.01), num_steps=5, progress_bar=False)


@pytest.mark.slow
@pytest.mark.parametrize("make", [
    lambda: (nb.ExpFamilyGuide(unsorted_sites), nb.BLR()),
    lambda: (nb.LieGroupGuide(unsorted_sites), nb.LieGroupBLR(lr=0.05)),
    lambda: (AutoNormal(unsorted_sites), nb.IVON(lr=0.05, ess=30)),
], ids=["ExpFamilyGuide", "LieGroupGuide", "IVON"])
def test_our_other_guides_and_optimizers_equal_svi_run(make):
    """Guides whose setup reads concrete values are set up eagerly, as SVI.init does, with the same key."""
    with jax.enable_x64(True):
        x, y = (v.astype(np.float64) for v in data())
        key = jax.random.PRNGKey(2)
        guide, optim = make()
        res = nb.fit(unsorted_sites, guide, x, y=y, optim=optim, num_steps=15, rng_key=key, progress_bar=False)
        guide, optim = make()
        with numpyro_svi():
            ref = SVI(unsorted_sites, guide, optim, nb.Trace_ELBO()).run(key, 15, x, y=y, progress_bar=False)
        for k in ref.params:
            np.testing.assert_allclose(res.params[k], ref.params[k], rtol=1e-8, atol=1e-10)
