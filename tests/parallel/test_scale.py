"""Data-parallel BLR / IVON / stochastic VI (numpyro_blr.parallel, issue 15).

The multi-device checks run in a subprocess (tests/parallel/scale_worker.py) that sets
``XLA_FLAGS=--xla_force_host_platform_device_count=4`` before JAX is imported: four emulated CPU devices.
The worker measures; the tolerances are here. The two-process test starts two JAX processes on
127.0.0.1 (gloo CPU collectives) with nb.parallel.launch_local, bounded in time.
"""

import json
import math
import os
import pathlib
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import numpyro
import numpyro.distributions as dist
import pytest
from numpyro.infer import SVI, Trace_ELBO
from numpyro.infer.autoguide import AutoMultivariateNormal, AutoNormal

import numpyro_blr as nb
from numpyro_blr.layout import read_layout

ROOT = pathlib.Path(__file__).resolve().parents[2]
HERE = pathlib.Path(__file__).resolve().parent
WORKER = HERE / "scale_worker.py"

# float32 sums split over 4 devices are added in another order: the fits differ by rounding, which a few
# hundred steps of a contracting iteration keep at that size (measured: <= 1.1e-6 on O(1) parameters)
FLOAT_TOL = 2e-5


def run_worker(*checks, timeout=400):
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    cache = jax.config.jax_compilation_cache_dir
    if cache:
        env["NB_TEST_JAX_CACHE"] = str(cache)
    env.pop("XLA_FLAGS", None)  # the worker sets its own device count
    if "--xla_backend_optimization_level=0" in os.environ.get("XLA_FLAGS", ""):
        env["XLA_FLAGS"] = "--xla_backend_optimization_level=0"  # conftest's fast compile for the suite, kept
    out = subprocess.run([sys.executable, str(WORKER), *checks], capture_output=True, text=True, env=env,
                         timeout=timeout)
    results = {}
    for line in out.stdout.splitlines():
        if line.startswith("RESULT "):
            r = json.loads(line[len("RESULT "):])
            results[r.pop("check")] = r
    missing = [c for c in checks if c not in results]
    assert not missing, f"worker gave no result for {missing}: exit {out.returncode}\n{out.stderr[-3000:]}"
    for c, r in results.items():
        assert "error" not in r, f"{c}:\n{r['error']}"
    return results


# the worker's checks each test reads; one worker process runs those of every selected test of this file (a
# process start, the imports and the compilations the checks share are paid once: tests/data/file_costs.json)
CHECKS_OF = {
    "test_blr_breast_cancer_four_devices_equal_one": ("blr_breast_cancer",),
    "test_ivon_digits_four_devices_equal_one": ("ivon_digits",),
    "test_stochastic_vi_mixture_four_devices_equal_one": ("mixture_svi",),
    "test_message_passing_stochastic_vi_mixture_four_devices_equal_one": ("mixture_message_passing_svi",),
    "test_optax_view_equinox_four_devices_equal_one": ("eqx_ivon",),
    "test_every_estimator_runs_sharded": ("estimators",),
    "test_one_all_reduce_per_step": ("collectives",),
    "test_sharded_diagonal_state": ("sharded_state",),
    "test_per_device_samples_reduce_curvature_variance": ("variance",),
    "test_bad_input_messages": ("bad_input",),
    "test_two_processes_match_one": ("blr_breast_cancer",),  # its one-process reference
}


@pytest.fixture(scope="module")
def worker(request):
    """``{check: result}`` for the checks of the selected tests of this file, from one worker process."""
    here = request.node.path
    selected = {item.originalname for item in request.session.items if item.path == here and "worker" in item.fixturenames}
    assert selected <= set(CHECKS_OF), f"tests reading the worker with no entry in CHECKS_OF: {selected - set(CHECKS_OF)}"
    checks = dict.fromkeys(c for name in CHECKS_OF if name in selected for c in CHECKS_OF[name])
    return run_worker(*checks, timeout=900)


# ----------------------------------------------------------------------------- four devices, shared key


@pytest.mark.slow
def test_blr_breast_cancer_four_devices_equal_one(worker):
    r = worker["blr_breast_cancer"]
    assert r["params_spec"] == "P()"  # parameters come back replicated
    assert r["max_diff"] <= FLOAT_TOL * max(1.0, r["scale"]), r
    assert abs(r["loss_one"] - r["loss_four"]) <= 1e-5 * abs(r["loss_one"])


@pytest.mark.slow
def test_ivon_digits_four_devices_equal_one(worker):
    r = worker["ivon_digits"]
    assert r["loss_last"] < 0.5 * r["loss_first"]  # it learns
    assert r["max_diff"] <= FLOAT_TOL * max(1.0, r["scale"]), r


@pytest.mark.slow
def test_stochastic_vi_mixture_four_devices_equal_one(worker):
    """Minibatched SVI (NumPyro's plate subsampling, nb.BLR) of a three-component mixture: the same
    minibatches and keys on 1 and 4 devices. The message-passing one is the next test."""
    r = worker["mixture_svi"]
    assert r["max_diff"] <= FLOAT_TOL * max(1.0, r["scale"]), r
    assert np.allclose(r["locs"], [-4.0, 0.0, 5.0], atol=0.3)  # and it finds the components


@pytest.mark.slow
def test_message_passing_stochastic_vi_mixture_four_devices_equal_one(worker):
    """numpyro_blr.infer.svi (streamed minibatches, each split over the devices by nb.shard_data, the state
    replicated) of a three-component mixture: the same minibatches on 1 and 4 devices give the same fit
    (measured: posterior means 1e-6 apart, natural parameters 5e-6 relative), and one compiled step holds two
    all-reduces, nothing else: the global sites' messages (their minibatch sums, all sites in one combined
    tuple: the update's one reduction) and, after the update, the minibatch ELBO's two plate factors (y and z)
    at the new globals, two scalars that depend on the first reduction and so cannot be merged with it."""
    r = worker["mixture_message_passing_svi"]
    assert r["max_diff"] <= FLOAT_TOL * max(1.0, r["scale"]), r
    assert r["natural_rel_diff"] <= FLOAT_TOL, r
    assert abs(r["elbo_one"] - r["elbo_four"]) <= 1e-5 * abs(r["elbo_one"]), r
    assert r["state_specs"] == ["P()"], r  # the globals come back replicated
    np.testing.assert_allclose(r["locs"], r["component_means"], atol=0.3)  # and it finds the components
    assert r["all_reduce"] == 2 and r["other"] == 0, r
    messages, elbo = r["all_reduce_shapes"]
    assert "f32[3]" in messages and messages.count("f32") >= 3, r  # the messages of w, mu, tau in one tuple
    assert elbo.replace(" ", "") == "(f32[],f32[])", r


@pytest.mark.slow
def test_optax_view_equinox_four_devices_equal_one(worker):
    r = worker["eqx_ivon"]
    assert r["max_diff"] <= FLOAT_TOL * max(1.0, r["scale"]), r
    assert r["loss_last"] < r["loss_first"] and r["loss_last_per_device"] < r["loss_first"]
    # gradient (and loss) partial sums over the batch: one combined all-reduce, nothing else
    assert r["all_reduce"] == 1 and r["other_collectives"] == 0, r


@pytest.mark.slow
def test_every_estimator_runs_sharded(worker):
    r = worker["estimators"]["max_diff"]
    assert len(r) == 6
    for label, (diff, scale) in r.items():
        # the sampled estimators (reparam's baseline above all) amplify rounding more over 30 steps
        assert diff <= 2e-3 * max(1.0, scale), (label, diff)


@pytest.mark.slow
def test_one_all_reduce_per_step(worker):
    """XLA's all-reduce combiner merges the loss, gradient and Hessian partial sums into one all-reduce;
    backtracking adds one scalar all-reduce (the trial loss) inside its loop."""
    r = worker["collectives"]
    for label, c in r.items():
        assert c["other"] == 0, (label, c)
    assert r["BLR AutoMultivariateNormal backtrack=False"]["all_reduce"] == 1
    assert r["BLR AutoNormal reparam backtrack=False"]["all_reduce"] == 1
    assert r["IVON AutoNormal"]["all_reduce"] == 1
    full = r["BLR AutoMultivariateNormal"]
    assert full["all_reduce"] == 2 and sum("while" in w for w in full["where"]) == 1, full


@pytest.mark.slow
def test_sharded_diagonal_state(worker):
    r = worker["sharded_state"]
    assert r["step_specs"] == ["P('data',)"] * 3 and r["step_shard_len"] == [r["size"] // 4] * 2
    assert r["step_diff"] <= FLOAT_TOL
    assert r["param_specs"]["w1"] == "P('data', None)" and r["param_specs"]["w2"] == "P()"
    assert r["view_specs"] == ["P('data',)"] * 2
    assert r["view_diff"] <= FLOAT_TOL


# ----------------------------------------------------------------------------- one sample per device


@pytest.mark.slow
def test_per_device_samples_reduce_curvature_variance(worker):
    """Four devices, one weight draw each: the curvature estimate's variance falls by about 4. Exactly 4
    only for alike shards; the prediction for these shards is (1/k^2) sum_d Var(h_d), each device's
    own estimate on its shard, measured separately. Tolerance: 4 bootstrap sds of the log ratio."""
    r = worker["variance"]
    tol = 4 * r["log_ratio_sd"] * math.sqrt(2)  # the prediction has the same Monte Carlo error
    assert abs(math.log(r["ratio"] / r["predicted"])) < tol, r
    assert 0.75 * r["devices"] < r["ratio"] < 1.25 * r["devices"], r
    assert r["mean_z_rms"] < 1.5, r  # both modes estimate the same expectation
    assert r["step_spec"] == "P()" and math.isfinite(r["step_loss"])


# ----------------------------------------------------------------------------- bad input


@pytest.mark.slow  # the worker: a four-device subprocess (3-9 s)
def test_bad_input_messages(worker):
    r = worker["bad_input"]
    assert "569 examples over 4 devices" in r["indivisible"] and "568" in r["indivisible"]
    assert "differ in length along the plate axis" in r["axes_disagree"]
    assert "not a plate of the model" in r["feature_axis"] and "axis=0" in r["feature_axis"]


@pytest.mark.slow
def test_full_covariance_too_large_fails_at_init(monkeypatch):
    def model(y):
        z = numpyro.sample("z", dist.Normal(0.0, 1.0).expand([300]).to_event(1))
        numpyro.sample("y", dist.Normal(z.sum(), 1.0), obs=y)

    monkeypatch.setattr(nb.parallel, "available_memory", lambda device: (2**20, "test"))
    svi = SVI(model, AutoMultivariateNormal(model), nb.BLR(), Trace_ELBO())
    with pytest.raises(nb.ScaleError, match=r"D = 300.*6\.5 MiB.*1\.0 MiB.*AutoNormal"):
        svi.init(jax.random.PRNGKey(0), 1.0)
    # a diagonal guide of the same model keeps D numbers: no check applies
    SVI(model, AutoNormal(model), nb.BLR(), Trace_ELBO()).init(jax.random.PRNGKey(0), 1.0)
    svi = SVI(model, AutoNormal(model), nb.IVON(0.1, ess=1), Trace_ELBO())
    svi.init(jax.random.PRNGKey(0), 1.0)


def test_guide_memory_counts_the_measured_matrices():
    params = {"auto_loc": jax.ShapeDtypeStruct((1000,), jnp.float32),
              "auto_scale_tril": jax.ShapeDtypeStruct((1000 * 1001 // 2,), jnp.float32)}
    layout = read_layout({"auto_loc": jnp.zeros(3), "auto_scale_tril": jnp.zeros(6)})
    d, need = nb.parallel.guide_memory(params, layout)
    assert d == 1000 and need == nb.parallel.FULL_STEP_MATRICES * 1000**2 * 4
    free, source = nb.parallel.available_memory(jax.devices()[0])
    assert free > 0 and source


def test_shard_data_one_device_and_errors():
    X = np.ones((6, 3), np.float32)
    Xs, ys = nb.shard_data(jax.devices(), X, np.arange(6.0), names=("X", "y"))
    assert Xs.sharding.spec == jax.sharding.PartitionSpec("data") and ys.shape == (6,)
    with pytest.raises(nb.ScaleError, match="'X' shape \\(6, 3\\) -> 3"):
        nb.shard_data(jax.devices(), X, np.arange(6.0), axis=(1, 0), names=("X", "y"))
    with pytest.raises(nb.ScaleError, match="no axis 2"):
        nb.shard_data(jax.devices(), X, axis=2)
    algo = nb.ivon(0.1, ess=6, axis_name="data")
    with pytest.raises(nb.ScaleError, match="per_device_sample=True"):
        nb.data_parallel_step(algo, lambda p, x: jnp.sum(p["w"] * x), nb.data_mesh())
    with pytest.raises(nb.ScaleError, match="axis_name='data'"):
        nb.data_parallel_step(nb.ivon(0.1, ess=6), lambda p, x: 0.0, nb.data_mesh(), per_device_sample=True)


def test_initialize_checks_before_joining():
    with pytest.raises(nb.ScaleError, match="process_id=2 is not in \\[0, num_processes=2\\)"):
        nb.parallel.initialize("127.0.0.1:1", num_processes=2, process_id=2)
    with pytest.raises(nb.ScaleError, match="coordinator_address"):
        nb.parallel.initialize(None, num_processes=2, process_id=0)


# ----------------------------------------------------------------------------- two processes


@pytest.mark.slow
def test_two_processes_match_one(worker):
    """Two local JAX processes (gloo CPU collectives, 127.0.0.1, a free port), each holding half the rows,
    fit the same posterior as one process holding all of them (the worker's one-device fit of
    test_blr_breast_cancer_four_devices_equal_one: the same model, data, key and steps). Bounded: launch_local
    kills both after the timeout or when one fails."""
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    env.pop("XLA_FLAGS", None)
    results = nb.parallel.launch_local([str(WORKER), "--process"], 2, timeout=240, env=env)
    outs = [json.loads(next(line for line in r.stdout.splitlines() if line.startswith("RESULT "))[7:])
            for r in results]
    assert [o["process"] for o in outs] == [0, 1] and all(o["processes"] == 2 and o["devices"] == 2 for o in outs)
    assert all(o["global_rows"] == 568 for o in outs)
    ref = worker["blr_breast_cancer"]["params_one"]
    assert set(ref) == {"auto_loc", "auto_scale_tril"}
    for o in outs:
        assert o["steps"] == worker["blr_breast_cancer"]["steps"]
        for k, v in ref.items():
            np.testing.assert_allclose(np.asarray(o["params"][k]), np.asarray(v), atol=FLOAT_TOL * 2, rtol=0)


def test_launch_local_reports_a_failing_process_and_stops_the_other(tmp_path):
    script = tmp_path / "fail.py"
    script.write_text(
        "import os, sys, time\n"
        "if os.environ['NUMPYRO_BLR_PROCESS_ID'] == '1':\n"
        "    sys.exit('process 1 fails')\n"
        "time.sleep(60)\n"
    )
    with pytest.raises(RuntimeError, match="(?s)failed.*process 1 \\(exit 1\\).*process 1 fails"):
        nb.parallel.launch_local([str(script)], 2, timeout=30)
    script.write_text("import time\ntime.sleep(60)\n")
    with pytest.raises(RuntimeError, match="did not finish within 1 s"):
        nb.parallel.launch_local([str(script)], 2, timeout=1)
