"""Shared fixtures. The tests are laid out like the package: ``families/``, ``rules/``, ``rows/`` (one
Table-1 row or optax view per file), ``svi/`` (the SVI adapter and nb.BLR's behaviour), ``guides/``,
``infer/``, ``diagnostics/``, ``accuracy/`` (against NUTS and gold-standard references) and
``package/`` (import cost, packaging, the demo). Expensive references are session fixtures here
(the NUTS run on breast cancer is computed once per worker); ``-m "not slow"`` is ``make test-fast``.
"""

import contextlib
import importlib.metadata
import os
import pathlib


def _cpu_only():
    """True where JAX can only use the CPU (CI, this machine): no CUDA/ROCm plugin is installed."""
    if os.environ.get("JAX_PLATFORMS", "").strip().lower() == "cpu":
        return True
    names = (d.metadata.get("Name", "").lower().replace("_", "-") for d in importlib.metadata.distributions())
    return not any(n.startswith(("jax-cuda", "jax-rocm", "jaxlib-cuda")) for n in names)


# On the CPU the suite is compile-bound (about 80% of its time in XLA, most of that in LLVM's
# optimisation of programs that then run a few hundred steps on tiny models): LLVM at -O0 takes
# about a quarter off the suite's CPU time (tests/svi/test_averaging.py + tests/rules: 61 -> 47 CPU-s)
# with the same HLO and the same results; steps run about 1.5x slower, which tests do not time.
# XLA_FLAGS is read when the backend starts (the first array), so setting it here is in time; a user's
# own XLA_FLAGS are kept, and NUMPYRO_BLR_TEST_FULL_OPT=1 turns this off. Not on a GPU machine.
if _cpu_only() and os.environ.get("NUMPYRO_BLR_TEST_FULL_OPT", "") != "1" \
        and "xla_backend_optimization_level" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_backend_optimization_level=0").strip()

# svi.init and svi.run with our optimizers run nb.fit's compiled programs (compile_once.compiled_init, compiled_run),
# the suite included: with both, tests/svi, test_any_guide, diagnostics and accuracy took 416 s on 2 workers against
# 466 s with NumPyro's eager start and run (NUMPYRO_BLR_EAGER_INIT=1, which the suite used while only svi.init was
# compiled: that alone had cost 10% more). NUMPYRO_BLR_EAGER_INIT=1 make test runs NumPyro's code outside the tests
# marked compiled_init (which compare the compiled start and run with NumPyro's: numpyro_svi below).

# Nothing heavy is imported here at module level: pytest-xdist's controller loads this file too (for the
# options and the scheduling below) and runs no test, and JAX, NumPyro and scikit-learn cost it about 3.5 s on
# 2 cores before the workers start. The workers set JAX up in pytest_configure, before they collect.
import numpy as np  # noqa: E402
import pytest  # noqa: E402

# JAX's persistent compilation cache. The suite spends most of its time in XLA compilation (about
# 80%: measured with jax.monitoring's backend_compile_duration), so a second run on the same
# checkout reuses the executables of the first (tests/guides/test_any_guide.py: 55 s -> 23 s); a cold run
# (CI's fresh clone) costs the same as without the cache (writing the entries is cheap, and the
# programs several tests compile alike are read back). Every entry is kept (no minimum compile time
# or size).
# The directory is git-ignored; JAX_COMPILATION_CACHE_DIR (JAX's own variable) moves it, and
# JAX_COMPILATION_CACHE_DIR= (empty) turns the cache off. pytest-xdist's workers (make test) share
# it: JAX writes entries without a lock, so a worker reading an entry the other is writing gets a
# warning and compiles the program itself (entries are zlib-compressed: a torn read fails its
# checksum, it never loads a wrong executable). A size limit (jax_compilation_cache_max_size) is
# not set: it makes every write re-scan the directory (thousands of entries). Delete .cache/ to
# reclaim the space (~60 MB per version of the code).
_CACHE_DIR = os.environ.get("JAX_COMPILATION_CACHE_DIR", str(pathlib.Path(__file__).resolve().parents[1] / ".cache" / "jax"))


def _xdist_controller(config):
    """pytest-xdist's controlling process, which hands the files to the workers and runs none itself."""
    return not hasattr(config, "workerinput") and getattr(config.option, "numprocesses", None) not in (None, 0)


def pytest_configure(config):
    if _xdist_controller(config):
        return
    import jax

    if _CACHE_DIR:
        jax.config.update("jax_compilation_cache_dir", _CACHE_DIR)
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
        jax.config.update("jax_persistent_cache_min_entry_size_bytes", -1)


@pytest.fixture(autouse=True, scope="module")
def _release_compiled_programs():
    """Free the compiled programs after each test file. Every live XLA CPU executable holds memory
    mappings; a pytest worker that keeps all of a file after another (JAX's jit caches, nb.fit's cache,
    the message-passing programs shared across objects) reached 57,000 of Linux's 65,530
    (``vm.max_map_count``) by the end of ``tests/svi``, and two full runs died of a SIGABRT or a
    segfault inside XLA (mapping the next program failed). Programs a later file needs again are read
    back from the persistent cache above."""
    yield
    import jax

    from numpyro_blr import compile_once

    compile_once.cache_clear()
    jax.clear_caches()


@pytest.fixture(autouse=True)
def _compiled_init_where_marked(request, monkeypatch):
    """The default compiled svi.init and svi.run (see NUMPYRO_BLR_EAGER_INIT above) in the tests marked
    ``compiled_init``, whatever the environment says."""
    if request.node.get_closest_marker("compiled_init") is not None:
        monkeypatch.delenv("NUMPYRO_BLR_EAGER_INIT", raising=False)


@contextlib.contextmanager
def numpyro_svi():
    """In the block, ``svi.init`` and ``svi.run`` run NumPyro's own code (its eager start, its steps' program) with this
    package's checks around them, as with ``NUMPYRO_BLR_EAGER_INIT=1``: the reference that ``nb.fit`` and the
    compiled ``svi.run`` (``compile_once.compiled_run``) are compared with."""
    before = os.environ.get("NUMPYRO_BLR_EAGER_INIT")
    os.environ["NUMPYRO_BLR_EAGER_INIT"] = "1"
    try:
        yield
    finally:
        if before is None:
            del os.environ["NUMPYRO_BLR_EAGER_INIT"]
        else:
            os.environ["NUMPYRO_BLR_EAGER_INIT"] = before


class LazyModule:
    """A module imported on its first attribute access, for a test file's heavy oracle or subject (ArviZ with
    xarray and matplotlib: 2.4 s; dynamax with TensorFlow Probability: 1.1 s on 2 cores). pytest-xdist's workers each
    collect every file, so a module-level import costs every worker, also the one that never runs the file's
    tests; behind this, only the worker that runs them pays. ``module`` is the module itself (for
    ``monkeypatch.setattr``)."""

    def __init__(self, name):
        self._name = name

    @property
    def module(self):
        import importlib

        return importlib.import_module(self._name)

    def __getattr__(self, attr):
        if attr.startswith("_"):  # what pytest's collection probes module-level objects for (fixture markers, ...)
            raise AttributeError(attr)
        return getattr(self.module, attr)


@contextlib.contextmanager
def count_compiles():
    """``{"compile": n}``: the XLA backend compilations in the block (``jax.monitoring``)."""
    import jax

    counts = {"compile": 0}

    def listener(event, duration, **kwargs):
        if event == "/jax/core/compile/backend_compile_duration":
            counts["compile"] += 1

    jax.monitoring.register_event_duration_secs_listener(listener)
    try:
        yield counts
    finally:
        jax.monitoring.unregister_event_duration_listener(listener)


@pytest.fixture(scope="module")
def float32_matmuls():
    """Float32 matrix products at full float32 precision for a test file whose oracle compares two computations of
    the same products to float32 rounding. On NVIDIA GPUs JAX's default precision multiplies float32 matrices in
    TF32 (operands rounded to 10 bits: about 1e-3 relative), and two programs of different shapes round differently
    (a GPU run of the suite found 3 diagnostics tests 0.3-1.0e-3 apart and a quadratic loss 1.6e-4 from its exact
    value). That is the user's precision, not this package's error; on the CPU this changes nothing. Use it as
    ``pytestmark = pytest.mark.usefixtures("float32_matmuls")`` (module-scoped: it covers the module's fixtures)."""
    import jax

    previous = jax.config.jax_default_matmul_precision
    jax.config.update("jax_default_matmul_precision", "highest")
    yield
    jax.config.update("jax_default_matmul_precision", previous)


def standardise_with_intercept(X):
    X = (X - X.mean(0)) / X.std(0)
    return np.hstack([np.ones((X.shape[0], 1)), X])


def logistic_model(X, y=None):
    import numpyro
    import numpyro.distributions as dist

    w = numpyro.sample("w", dist.Normal(0.0, 1.0).expand([X.shape[1]]).to_event(1))
    numpyro.sample("y", dist.Bernoulli(logits=X @ w), obs=y)


def linear_model(X, y=None, noise=1.0, prior_scale=1.0):
    import numpyro
    import numpyro.distributions as dist

    w = numpyro.sample("w", dist.Normal(0.0, prior_scale).expand([X.shape[1]]).to_event(1))
    numpyro.sample("y", dist.Normal(X @ w, noise), obs=y)


@pytest.fixture(scope="session")
def breast_cancer():
    import jax.numpy as jnp
    from sklearn.datasets import load_breast_cancer

    X, y = load_breast_cancer(return_X_y=True)
    return jnp.asarray(standardise_with_intercept(X), jnp.float32), jnp.asarray(y, jnp.float32)


@pytest.fixture(scope="session")
def diabetes_np():
    """Diabetes regression with standardised target: float64 numpy arrays."""
    from sklearn.datasets import load_diabetes

    X, y = load_diabetes(return_X_y=True)
    return standardise_with_intercept(X), (y - y.mean()) / y.std()


@pytest.fixture(scope="session")
def breast_cancer_nuts(breast_cancer):
    """The NUTS reference posterior of ``logistic_model`` on breast cancer, run once per session (once
    per pytest-xdist worker that needs it) for the tests that compare against it (test_accuracy.py,
    test_diagnostics.py): 2 chains of 500 warmup and 1500 draws. Returns the MCMC object
    (``get_samples``, ``az.from_numpyro``).

    Each file used to run its own: test_accuracy 2 x 1500 draws with key 0, test_diagnostics
    2 x 1000 with key 2. This keeps the larger draw count (test_accuracy's tolerances are derived
    from the ESS) and test_diagnostics' key: its PSIS-LOO comparison (elpd within 0.5 nats) is
    sensitive to the NUTS run itself (30-57 of 569 observations with Pareto k > 0.7): NUTS's LOO
    elpd is -41.88 with key 2 (BLR fit: -41.81), -41.77 and -41.80 with keys 3 and 1, but -42.78
    with key 0. test_accuracy passes with either key (largest mean error 0.47 of its allowance with
    key 2, 0.43 with key 0; sd ratios 0.95-1.03 and 0.92-1.02 in a 0.86-1.13 band)."""
    import jax
    from numpyro.infer import MCMC, NUTS

    X, y = breast_cancer
    mcmc = MCMC(NUTS(logistic_model), num_warmup=500, num_samples=1500, num_chains=2, chain_method="sequential", progress_bar=False)
    mcmc.run(jax.random.PRNGKey(2), X, y)
    return mcmc


# ----------------------------------------------------------------------------- scheduling the files
# `make test` runs two pytest-xdist workers with `--dist loadfile --no-loadscope-reorder`: each test file runs
# on one worker, and the files are handed out in the order collected. The suite's cost is concentrated in a few
# files (four-device subprocesses, fresh-process caches, references), and xdist's own order (most tests first)
# put those last, where one of them could run alone on one core while the other core had finished. Ordering
# the files by their recorded cost, longest first (tests/data/file_costs.json: wall seconds per file, setup and teardown included,
# from `pytest --record-file-costs=tests/data/file_costs.json`), is the longest-processing-time-first rule;
# unknown files count as the median. Only the order changes, never which tests run.
_COSTS_FILE = pathlib.Path(__file__).resolve().parent / "data" / "file_costs.json"


def pytest_addoption(parser):
    parser.addoption("--record-file-costs", default=None, metavar="PATH",
                     help="write each test file's summed setup+call+teardown seconds to PATH (JSON)")


def pytest_collection_modifyitems(config, items):
    try:
        import json

        costs = json.loads(_COSTS_FILE.read_text())
    except (OSError, ValueError):
        return
    if not costs:
        return
    median = float(np.median(list(costs.values())))
    first_seen = {}
    for i, item in enumerate(items):
        first_seen.setdefault(item.nodeid.split("::")[0], i)
    items.sort(key=lambda it: (-float(costs.get(it.nodeid.split("::")[0], median)), first_seen[it.nodeid.split("::")[0]]))


_FILE_SECONDS = {}


def pytest_runtest_logreport(report):
    path = report.nodeid.split("::")[0]
    _FILE_SECONDS[path] = _FILE_SECONDS.get(path, 0.0) + float(getattr(report, "duration", 0.0) or 0.0)


def pytest_sessionfinish(session):
    path = session.config.getoption("--record-file-costs", default=None)
    if not path or hasattr(session.config, "workerinput"):  # the controller writes (xdist forwards the reports)
        return
    import json

    pathlib.Path(path).write_text(json.dumps({k: round(v, 2) for k, v in sorted(_FILE_SECONDS.items())}, indent=0) + "\n")
