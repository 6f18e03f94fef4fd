"""nb.fit's programs on disk (nb.enable_compilation_cache): a second process loads the compiled fit instead
of tracing its steps, with bitwise the same result and a guide that works as after any fit; a changed model,
other data shapes or a damaged entry compile afresh, with the right result.

Each process fits twice: ``AutoMultivariateNormal`` without a progress bar (one program: init and the steps;
its Cholesky factor calls LAPACK, which a fresh process must initialise before running a loaded program) and
``AutoNormal`` with one (three programs: the start, the chunk of steps, the parameters)."""

import json
import os
import shutil
import subprocess
import sys
import textwrap

import pytest

pytestmark = pytest.mark.slow  # five fresh processes: ~4-8 s each on 2 cores

SCRIPT = textwrap.dedent(
    """
    import hashlib, json, sys
    import jax, numpy as np, numpyro
    import numpyro.distributions as dist
    from numpyro.infer import Predictive
    from numpyro.infer.autoguide import AutoMultivariateNormal, AutoNormal
    import numpyro_blr as nb
    from numpyro_blr import compile_once

    cache, plan = sys.argv[1], json.loads(sys.argv[2])
    nb.enable_compilation_cache(cache)
    SOURCE = '''
    def model(x, y=None):
        a = numpyro.sample("a", dist.Normal(0.0, {scale}))
        b = numpyro.sample("b", dist.Normal(0.0, {scale}))
        s = numpyro.sample("s", dist.HalfNormal(1.0))
        with numpyro.plate("n", x.shape[0]):
            numpyro.sample("y", dist.Normal(a + b * x, s), obs=y)
    '''

    def make_model(scale):  # as if the model's source had been edited: the constant is in its code
        space = {"numpyro": numpyro, "dist": dist}
        exec(SOURCE.format(scale=repr(float(scale))), space)
        return space["model"]

    def digest(tree):
        return hashlib.sha256(b"".join(np.asarray(v).tobytes() for v in jax.tree.leaves(tree))).hexdigest()

    def one(model, guide, x, y, bar):
        before = compile_once.cache_info()
        res = nb.fit(model, guide, x, y=y, num_steps=30, progress_bar=bar)
        after = compile_once.cache_info()
        out = {k: after["disk_" + k] - before["disk_" + k] for k in ("hits", "misses", "writes")}
        out["reasons"] = {k: v - before["disk_miss_reasons"].get(k, 0) for k, v in after["disk_miss_reasons"].items()
                          if v > before["disk_miss_reasons"].get(k, 0)}
        out.update(losses=digest(res.losses), params=digest(res.params), loss=float(res.losses[-1]),
                   median=digest(guide.median(res.params)),
                   samples=digest(guide.sample_posterior(jax.random.PRNGKey(1), res.params, sample_shape=(4,))),
                   predictive=digest(Predictive(model, guide=guide, params=res.params, num_samples=4)(
                       jax.random.PRNGKey(2), x)["y"]),
                   tracers=len(compile_once._leaked_tracers(guide)))
        return out

    results = []
    for scale, n, fresh, *where in plan:  # where: another cache directory for nb.fit's programs (JAX's stays)
        rng = np.random.default_rng(0)
        x = np.linspace(-1.0, 1.0, n)
        y = 0.5 + 2.0 * x + 0.3 * rng.standard_normal(n)
        compile_once._DISK["dir"] = str(__import__("pathlib").Path(where[0] if where else cache).resolve() / "numpyro_blr")
        if fresh:  # today's path (no disk cache) on the same model, for comparison
            compile_once._DISK["dir"] = None
            compile_once.cache_clear()
        model = make_model(scale)
        results.append([one(model, AutoMultivariateNormal(model), x, y, False),
                        one(model, AutoNormal(model), x, y, True)])
    print(json.dumps(results))
    """
)


def run(cache, plan, seed, devices=None):
    env = dict(os.environ, PYTHONHASHSEED=str(seed), JAX_PLATFORMS=os.environ.get("JAX_PLATFORMS", "cpu"))
    env.pop("JAX_COMPILATION_CACHE_DIR", None)
    if devices is not None:
        env["XLA_FLAGS"] = (env.get("XLA_FLAGS", "") + f" --xla_force_host_platform_device_count={devices}").strip()
    out = subprocess.run([sys.executable, "-c", SCRIPT, str(cache), json.dumps(plan)], env=env, capture_output=True,
                         text=True)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


RESULT_KEYS = ("losses", "params", "median", "samples", "predictive")


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("disk")
    cache = root / "cache"
    first = run(cache, [(5.0, 20, False)], seed=1)[0]
    second = run(cache, [(5.0, 20, False)], seed=2)[0]  # another hash seed: the key must not depend on it
    damaged = root / "damaged"  # the first process's programs, each cut short
    shutil.copytree(cache / "numpyro_blr", damaged / "numpyro_blr")
    for f in (damaged / "numpyro_blr").iterdir():
        f.write_bytes(f.read_bytes()[:-100])
    # the prior scale edited (same sites and shapes), then other data shapes, then the edited model on today's path,
    # then the first fit read from the damaged programs (a fit of that model and shapes is in no in-memory cache yet)
    changed, shapes, reference, broken = run(cache, [(50.0, 20, False), (5.0, 27, False), (50.0, 20, True),
                                                     (5.0, 20, False, str(damaged))], seed=3)
    # four host devices: a loaded one-device program runs on the device it was compiled for (by default JAX
    # loads it for every local device, and the call failed: "Expected args ... to have 4 shards")
    four_first = run(root / "four", [(5.0, 20, False)], seed=5, devices=4)[0]
    four_second = run(root / "four", [(5.0, 20, False)], seed=6, devices=4)[0]
    return {"first": first, "second": second, "changed": changed, "shapes": shapes, "reference": reference,
            "broken": broken, "four_first": four_first, "four_second": four_second}


def test_a_second_process_reads_the_programs_and_gives_bitwise_the_same_fit(runs):
    for a, b in zip(runs["first"], runs["second"]):
        assert a["hits"] == 0 and a["misses"] >= 1 and a["writes"] == a["misses"]
        assert b["hits"] == a["writes"] and b["misses"] == 0 and b["writes"] == 0, (a["reasons"], b["reasons"])
        for k in RESULT_KEYS:
            assert a[k] == b[k], k


def test_several_devices_read_the_programs_too(runs):
    for a, b, one in zip(runs["four_first"], runs["four_second"], runs["first"]):
        assert a["writes"] == a["misses"] >= 1
        assert b["hits"] == a["writes"] and b["misses"] == 0 and not b["reasons"], b["reasons"]
        for k in RESULT_KEYS:
            assert a[k] == b[k] == one[k], k


def test_guide_is_set_up_after_a_disk_hit(runs):
    """guide.median, sample_posterior and Predictive ran in the process that loaded the programs (the
    digests above compare them), and no traced value is left in the guide."""
    for fit in runs["second"] + runs["first"]:
        assert fit["tracers"] == 0


def test_a_changed_model_compiles_afresh_and_gives_its_own_result(runs):
    for changed, first, reference in zip(runs["changed"], runs["first"], runs["reference"]):
        assert changed["hits"] == 0 and changed["misses"] >= 1
        assert all("not found" in r for r in changed["reasons"]), changed["reasons"]  # another key, not a bad entry
        assert changed["losses"] != first["losses"] and changed["params"] != first["params"]
        for k in RESULT_KEYS:  # the same as without the disk cache
            assert changed[k] == reference[k], k


def test_other_data_shapes_compile_afresh(runs):
    for fit in runs["shapes"]:
        assert fit["hits"] == 0 and fit["misses"] >= 1


def test_a_damaged_entry_is_compiled_again_silently(runs):
    for broken, first in zip(runs["broken"], runs["first"]):
        assert broken["hits"] == 0 and broken["misses"] >= 1 and broken["reasons"], broken["reasons"]
        for k in RESULT_KEYS:
            assert broken[k] == first[k], k
