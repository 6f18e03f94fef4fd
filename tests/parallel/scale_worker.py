"""The multi-device half of tests/parallel/test_scale.py, run in a subprocess.

``python tests/parallel/scale_worker.py CHECK [CHECK ...]`` sets ``XLA_FLAGS=--xla_force_host_platform_device_count=4``
before JAX is imported (four emulated CPU devices), runs each check and prints one JSON line per check:
``{"check": name, ...measurements}`` or ``{"check": name, "error": traceback}``. The checks measure;
tests/parallel/test_scale.py holds the tolerances. With ``--processes`` it is one process of the two-process run
(tests/parallel/test_scale.py::test_two_processes_match_one).
"""

import json
import os
import sys
import time
import traceback

if __name__ == "__main__":  # run as the worker; imported by test_scale.py (for its models) it leaves the env alone:
    # the pytest process's later subprocesses would inherit four devices (tests/workflow/test_disk_cache.py did)
    if "--process" not in sys.argv:
        os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=4"
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

if "--process" in sys.argv:  # one process of a multi-process run: initialise before any other JAX call
    import numpyro_blr.parallel as _parallel

    _parallel.initialize(timeout=60)

import numpyro  # noqa: E402
import numpyro.distributions as dist  # noqa: E402
import optax  # noqa: E402
from numpyro.infer import SVI, Trace_ELBO  # noqa: E402
from numpyro.infer.autoguide import AutoMultivariateNormal, AutoNormal  # noqa: E402

import numpyro_blr as nb  # noqa: E402

cache = os.environ.get("NB_TEST_JAX_CACHE")
if cache:
    jax.config.update("jax_compilation_cache_dir", cache)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", -1)


# ----------------------------------------------------------------------------- data and models


def breast_cancer(n=568):
    """Standardised breast-cancer design with an intercept; 568 of the 569 rows (568 = 4 x 142)."""
    from sklearn.datasets import load_breast_cancer

    X, y = load_breast_cancer(return_X_y=True)
    X = (X - X.mean(0)) / X.std(0)
    X = np.hstack([np.ones((X.shape[0], 1)), X])
    return X[:n].astype(np.float32), y[:n].astype(np.float32)


def logistic_model(X, y=None):
    w = numpyro.sample("w", dist.Normal(0.0, 1.0).expand([X.shape[1]]).to_event(1))
    with numpyro.plate("data", X.shape[0]):
        numpyro.sample("y", dist.Bernoulli(logits=X @ w), obs=y)


def digits(n=256):
    from sklearn.datasets import load_digits

    X, y = load_digits(return_X_y=True)
    return (X[:n] / 16.0).astype(np.float32), y[:n].astype(np.int32)


HIDDEN = 8


def mlp_model(X, y=None):
    d, k = X.shape[1], 10
    w1 = numpyro.sample("w1", dist.Normal(0.0, 1.0).expand([d, HIDDEN]).to_event(2))
    b1 = numpyro.sample("b1", dist.Normal(0.0, 1.0).expand([HIDDEN]).to_event(1))
    w2 = numpyro.sample("w2", dist.Normal(0.0, 1.0).expand([HIDDEN, k]).to_event(2))
    b2 = numpyro.sample("b2", dist.Normal(0.0, 1.0).expand([k]).to_event(1))
    logits = jax.nn.relu(X @ w1 + b1) @ w2 + b2
    with numpyro.plate("data", X.shape[0]):
        numpyro.sample("y", dist.Categorical(logits=logits), obs=y)


def mixture_data(n=2048, seed=0):
    rng = np.random.default_rng(seed)
    z = rng.integers(0, 3, n)
    return (np.array([-4.0, 0.0, 5.0])[z] + rng.normal(size=n)).astype(np.float32)


def mixture_model_for(n_total):
    """A three-component Gaussian mixture (assignments marginalised), fitted on minibatches: the plate
    scales the batch's log-likelihood by n_total / batch (NumPyro's subsampling)."""

    def model(xb):
        locs = numpyro.sample("locs", dist.Normal(0.0, 10.0).expand([3]).to_event(1))
        mix = dist.MixtureSameFamily(dist.Categorical(probs=jnp.ones(3) / 3), dist.Normal(locs, 1.0))
        with numpyro.plate("data", n_total, subsample_size=xb.shape[0]):
            numpyro.sample("x", mix, obs=xb)

    return model


def mesh4():
    return nb.data_mesh(jax.devices()[:4])


def mesh1():
    return nb.data_mesh(jax.devices()[:1])


def fit_svi(model, guide, optim, steps, batches, mesh, key=0):
    """SVI by a loop of the jitted ``svi.update`` (what ``svi.run`` scans), one batch per step. The initial
    state is replicated on the mesh, as the steps' outputs are: else the second step compiles again."""
    svi = SVI(model, guide, optim, Trace_ELBO())
    state = nb.replicate(mesh, svi.init(jax.random.PRNGKey(key), *batches(0)))
    update = jax.jit(svi.update)
    losses = []
    for i in range(steps):
        state, loss = update(state, *batches(i))
        losses.append(float(loss))
    return svi, state, losses


def max_diff(a, b):
    return max(float(np.max(np.abs(np.asarray(a[k]) - np.asarray(b[k])))) for k in a)


def max_scale(a):
    return max(float(np.max(np.abs(np.asarray(v)))) for v in a.values())


# ----------------------------------------------------------------------------- checks


BLR_STEPS = 100  # the breast-cancer fits: one device, four, and each of the two processes


def check_blr_breast_cancer(steps=BLR_STEPS):
    """nb.BLR() + AutoMultivariateNormal, 1 device vs 4 (shared key: same keys, same steps); the one-device fit is
    also the reference of the two-process run."""
    X, y = breast_cancer()
    out = {}
    for name, mesh in (("one", mesh1()), ("four", mesh4())):
        Xs, ys = nb.shard_data(mesh, X, y, model=logistic_model)
        svi = SVI(logistic_model, AutoMultivariateNormal(logistic_model), nb.BLR(), Trace_ELBO())
        res = svi.run(jax.random.PRNGKey(0), steps, Xs, ys, progress_bar=False)
        out[name] = res.params
        out[name + "_loss"] = float(res.losses[-1])
        out[name + "_sharding"] = str(res.params["auto_loc"].sharding.spec)
    return {"max_diff": max_diff(out["one"], out["four"]), "scale": max_scale(out["one"]),
            "loss_one": out["one_loss"], "loss_four": out["four_loss"], "params_spec": out["four_sharding"],
            "params_one": {k: np.asarray(v).tolist() for k, v in out["one"].items()}, "steps": steps}


def check_estimators(steps=30):
    """The estimators of nb.BLR on both guide kinds, 4 devices vs 1 (a small logistic regression). The
    default ones are covered by the other checks (AutoMultivariateNormal + autodiff: breast cancer;
    AutoNormal + autodiff: the mixture)."""
    rng = np.random.default_rng(1)
    X = rng.normal(size=(256, 5)).astype(np.float32)
    y = (rng.uniform(size=256) < jax.nn.sigmoid(X @ np.array([1.0, -0.5, 0.3, 0.0, 2.0]))).astype(np.float32)
    X1, y1 = nb.shard_data(mesh1(), X, y)
    Xs, ys = nb.shard_data(mesh4(), X, y)
    results = {}
    for guide_cls in (AutoNormal, AutoMultivariateNormal):
        for kw in ({"hessian": "reparam"}, {"hessian": "price"}, {"delta": True}):
            label = f"{guide_cls.__name__} {kw}"
            fits = []
            for mesh, data in ((mesh1(), (X1, y1)), (mesh4(), (Xs, ys))):
                svi, state, _ = fit_svi(logistic_model, guide_cls(logistic_model), nb.BLR(**kw), steps,
                                        lambda i, data=data: data, mesh)
                fits.append(svi.get_params(state))
            results[label] = [max_diff(*fits), max_scale(fits[0])]
    return {"max_diff": results}


def _ivon_svi(mesh, X, y, steps):
    Xs, ys = nb.shard_data(mesh, X, y, model=mlp_model)
    optim = nb.IVON(lr=0.05, ess=X.shape[0], hess_init=0.1, beta2=0.99)
    svi, state, losses = fit_svi(mlp_model, AutoNormal(mlp_model), optim, steps, lambda i: (Xs, ys), mesh)
    return svi.get_params(state), losses


def check_ivon_digits(steps=50):
    """nb.IVON (SVI adapter) on a digits MLP (64-8-10, 256 images), 1 device vs 4."""
    X, y = digits()
    p1, l1 = _ivon_svi(mesh1(), X, y, steps)
    p4, l4 = _ivon_svi(mesh4(), X, y, steps)
    return {"max_diff": max_diff(p1, p4), "scale": max_scale(p1), "loss_first": l1[0], "loss_last": l1[-1],
            "loss_last_four": l4[-1]}


def _eqx_ivon(mesh, X, y, steps, per_device_sample=False):
    """nb.as_optax(nb.ivon(...)) in an Equinox training loop; shared key (jit) or one draw per device (shard_map)."""
    import equinox as eqx

    model = eqx.nn.MLP(64, 10, HIDDEN, 1, key=jax.random.PRNGKey(0))
    params, static = eqx.partition(model, eqx.is_array)
    algo = nb.ivon(0.1, ess=X.shape[0], hess_init=0.3, beta2=0.999,
                   axis_name="data" if per_device_sample else None)
    tx = nb.as_optax(algo)
    params = nb.replicate(mesh, params)
    opt_state = nb.replicate(mesh, tx.init(params))
    Xs, ys = nb.shard_data(mesh, X, y)

    def loss_fn(p, xb, yb):
        logits = jax.vmap(eqx.combine(p, static))(xb)
        return -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(logits), yb[:, None], 1))

    def train_step(p, s, xb, yb):
        theta = nb.perturbed(algo, p, s)
        loss, grads = jax.value_and_grad(loss_fn)(theta, xb, yb)
        if per_device_sample:
            loss = jax.lax.pmean(loss, "data")
        updates, s = tx.update(grads, s, p)
        return optax.apply_updates(p, updates), s, loss

    if per_device_sample:
        from jax.sharding import PartitionSpec as P

        train_step = jax.shard_map(train_step, mesh=mesh, in_specs=(P(), P(), P("data"), P("data")),
                                   out_specs=(P(), P(), P()))
    step = jax.jit(train_step)
    losses = []
    for _ in range(steps):
        params, opt_state, loss = step(params, opt_state, Xs, ys)
        losses.append(float(loss))
    return params, opt_state, losses, step, (Xs, ys)


def check_eqx_ivon(steps=100):
    X, y = digits()
    p1, _, l1, _, _ = _eqx_ivon(mesh1(), X, y, steps)
    p4, s4, l4, step, data = _eqx_ivon(mesh4(), X, y, steps)
    leaves1, leaves4 = jax.tree.leaves(p1), jax.tree.leaves(p4)
    diff = max(float(np.max(np.abs(np.asarray(a) - np.asarray(b)))) for a, b in zip(leaves1, leaves4))
    counts = nb.collective_counts(step, p4, s4, *data)
    pd, _, lpd, _, _ = _eqx_ivon(mesh4(), X, y, steps, per_device_sample=True)
    return {"max_diff": diff, "scale": max(float(np.max(np.abs(np.asarray(a)))) for a in leaves1),
            "loss_first": l1[0], "loss_last": l1[-1], "loss_last_per_device": lpd[-1],
            "all_reduce": counts["all-reduce"], "other_collectives": sum(counts[c] for c in nb.parallel.COLLECTIVES[1:])}


def check_mixture_svi(steps=150, batch=256):
    """Minibatched stochastic VI (NumPyro's plate subsampling) of a Gaussian mixture with nb.BLR, 1 device vs 4:
    the same minibatches in the same order, the same keys."""
    data = mixture_data()
    n = data.shape[0]
    rng = np.random.default_rng(0)
    order = [rng.choice(n, batch, replace=False) for _ in range(steps)]
    model = mixture_model_for(n)
    fits = {}
    for name, mesh in (("one", mesh1()), ("four", mesh4())):
        def batches(i, mesh=mesh):
            return (nb.shard_data(mesh, data[order[i]], model=model),)

        guide = AutoNormal(model, init_loc_fn=numpyro.infer.init_to_value(values={"locs": jnp.array([-1.0, 0.0, 1.0])}))
        svi, state, losses = fit_svi(model, guide, nb.BLR(), steps, batches, mesh)
        fits[name] = svi.get_params(state)
        fits[name + "_loss"] = losses[-1]
    locs = np.sort(np.asarray(fits["one"]["locs_auto_loc"]))
    return {"max_diff": max_diff(fits["one"], fits["four"]), "scale": max_scale(fits["one"]), "locs": locs.tolist()}


def vmp_mixture_model(y, size):
    """A three-component Gaussian mixture for numpyro_blr.infer.svi (conjugate: Dirichlet weights, Normal means,
    Gamma precisions, explicit assignments), streamed: ``y`` is the minibatch, ``size`` the plate's full size N."""
    w = numpyro.sample("w", dist.Dirichlet(jnp.ones(3)))
    with numpyro.plate("k", 3):
        mu = numpyro.sample("mu", dist.Normal(0.0, 10.0))
        tau = numpyro.sample("tau", dist.Gamma(1.0, 1.0))
    with numpyro.plate("n", size, subsample_size=y.shape[0]):
        z = numpyro.sample("z", dist.Categorical(w))
        numpyro.sample("y", dist.Normal(mu[z], 1.0 / jnp.sqrt(tau[z])), obs=y)


def check_mixture_message_passing_svi(steps=80, batch=256):
    """The message-passing stochastic VI (numpyro_blr.infer.svi, streamed minibatches) of a Gaussian mixture,
    1 device vs 4: the same minibatches in the same order, each placed with nb.shard_data (split along the
    plate), the state replicated. Measures the fits' difference and the all-reduces of one compiled step."""
    import re

    from numpyro_blr.infer import svi

    data = mixture_data()
    n = data.shape[0]
    rng = np.random.default_rng(0)
    order = [rng.choice(n, batch, replace=False) for _ in range(steps)]
    init = {"mu": dist.Normal(jnp.array([-3.0, 0.0, 3.0]), 1.0)}
    fits, out = {}, {}
    for name, mesh in (("one", mesh1()), ("four", mesh4())):
        algo = svi(vmp_mixture_model, data[order[0]], n, kappa=0.7, tau=1.0)
        state = nb.replicate(mesh, algo.init(init=init))
        for i in range(steps):
            state, info = algo.step(None, state, nb.shard_data(mesh, data[order[i]]), n)
        post = algo.posterior(state)
        fits[name] = {"natural": state.natural, "elbo": float(state.elbo),
                      "means": {k: np.asarray(d.mean) for k, d in post.items()}}
    eng = algo.engine
    jitted, args = eng.jitted.jitted, (eng.graph.data(), dict(eng.graph.plate_values), state)
    counts = nb.collective_counts(jitted, *args)
    text = jitted.lower(*args).compile().as_text()
    one, four = fits["one"], fits["four"]
    rel = [float(np.max(np.abs(np.asarray(a) - np.asarray(b))) / max(1.0, float(np.max(np.abs(np.asarray(a))))))
           for a, b in zip(jax.tree.leaves(one["natural"]), jax.tree.leaves(four["natural"]))]
    out.update({
        "max_diff": max_diff(one["means"], four["means"]), "scale": max_scale(one["means"]),
        "natural_rel_diff": max(rel), "elbo_one": one["elbo"], "elbo_four": four["elbo"],
        "locs": np.sort(one["means"]["mu"]).tolist(),
        "component_means": [float(data[np.random.default_rng(0).integers(0, 3, n) == k].mean()) for k in range(3)],
        "state_specs": sorted({str(x.sharding.spec) for x in jax.tree.leaves(state.natural)}),
        "all_reduce": counts["all-reduce"], "where": counts["where"],
        "all_reduce_shapes": [re.sub(r"/\*.*?\*/", "", line.split(" = ", 1)[1].split(" all-reduce", 1)[0])
                              for line in text.splitlines() if re.search(r"\sall-reduce(?:-start)?\(", line)],
        "other": sum(counts[c] for c in nb.parallel.COLLECTIVES[1:]),
    })
    return out


def check_collectives():
    """All-reduces in the optimised HLO of one data-parallel step (4 devices)."""
    X, y = breast_cancer()
    Xs, ys = nb.shard_data(mesh4(), X, y)
    out = {}
    for label, guide_cls, optim in (
        ("BLR AutoMultivariateNormal", AutoMultivariateNormal, nb.BLR()),
        ("BLR AutoMultivariateNormal backtrack=False", AutoMultivariateNormal, nb.BLR(backtrack=False)),
        ("BLR AutoNormal reparam backtrack=False", AutoNormal, nb.BLR(hessian="reparam", backtrack=False)),
        ("IVON AutoNormal", AutoNormal, nb.IVON(0.1, ess=X.shape[0])),
    ):
        svi = SVI(logistic_model, guide_cls(logistic_model), optim, Trace_ELBO())
        state = svi.init(jax.random.PRNGKey(0), Xs, ys)
        counts = nb.collective_counts(svi.update, state, Xs, ys)
        out[label] = {"all_reduce": counts["all-reduce"], "where": counts["where"],
                      "other": sum(counts[c] for c in nb.parallel.COLLECTIVES[1:])}
    return out


def _mlp_params(hidden, seed=0):
    rng = np.random.default_rng(seed)
    return {"w1": rng.normal(size=(64, hidden)).astype(np.float32) * 0.3, "b1": np.zeros(hidden, np.float32),
            "w2": rng.normal(size=(hidden, 10)).astype(np.float32) * 0.3, "b2": np.zeros(10, np.float32)}


def _mlp_loss(p, xb, yb):
    logits = jax.nn.relu(xb @ p["w1"] + p["b1"]) @ p["w2"] + p["b2"]
    return -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(logits), yb[:, None], 1))


def check_variance(reps=400):
    """The per-device-sample mode's curvature estimate vs the shared-key one: variance over keys, same
    state, same batch (IVON's Price estimator on the digits MLP, rows shuffled so the shards are alike)."""
    X, y = digits()
    perm = np.random.default_rng(0).permutation(X.shape[0])
    X, y = X[perm], y[perm]
    mesh = mesh4()
    Xs, ys = nb.shard_data(mesh, X, y)
    kw = dict(ess=X.shape[0], hess_init=0.1)
    shared_algo, pd_algo = nb.ivon(0.1, **kw), nb.ivon(0.1, axis_name="data", **kw)
    state = nb.replicate(mesh, shared_algo.init(_mlp_params(HIDDEN)))
    shared = nb.data_parallel_estimate(shared_algo, _mlp_loss, mesh)
    per_device = nb.data_parallel_estimate(pd_algo, _mlp_loss, mesh, per_device_sample=True)
    keys = jax.random.split(jax.random.PRNGKey(3), reps)
    hs = np.stack([np.asarray(shared(k, state, Xs, ys).hessian) for k in keys])
    hp = np.stack([np.asarray(per_device(k, state, Xs, ys).hessian) for k in keys])
    var_s, var_p = hs.var(0, ddof=1), hp.var(0, ddof=1)
    ratio = float(var_s.sum() / var_p.sum())
    # What independent draws per device predict, shards being what they are: (1/k^2) sum_d Var(h_d), with
    # h_d one device's estimate on its own shard (one device, shared key); equal to Var_shared / k when
    # the shards are alike. Keys independent of the ones above.
    single = jax.jit(lambda k, s, x, yy: shared_algo.parts.estimator(k, s, _mlp_loss, x, yy).hessian)
    state1 = shared_algo.init(_mlp_params(HIDDEN))
    n = X.shape[0] // 4
    var_d = []
    for d in range(4):
        xd, yd = jnp.asarray(X[d * n:(d + 1) * n]), jnp.asarray(y[d * n:(d + 1) * n])
        kd = jax.random.split(jax.random.PRNGKey(100 + d), reps)
        var_d.append(np.stack([np.asarray(single(k, state1, xd, yd)) for k in kd]).var(0, ddof=1))
    predicted = float(var_s.sum() / (np.sum(var_d, axis=0).sum() / 16.0))
    # Monte Carlo error of the measured ratio: bootstrap over the replicates (log scale)
    b = np.random.default_rng(1)
    boots = []
    for _ in range(200):
        i, j = b.integers(0, reps, reps), b.integers(0, reps, reps)
        boots.append(hs[i].var(0, ddof=1).sum() / hp[j].var(0, ddof=1).sum())
    # the means agree (both unbiased for the same expectation), in standard errors of the difference
    se = np.sqrt((var_s + var_p) / reps)
    live = se > 0  # weights of dead ReLU units have no curvature signal in either mode
    z = np.abs(hs.mean(0) - hp.mean(0))[live] / se[live]
    step = nb.data_parallel_step(pd_algo, _mlp_loss, mesh, per_device_sample=True)
    new, info = step(keys[0], state, Xs, ys)
    return {"ratio": ratio, "predicted": predicted, "log_ratio_sd": float(np.std(np.log(boots))), "devices": 4,
            "reps": reps, "mean_z_rms": float(np.sqrt(np.mean(z**2))), "step_loss": float(info.loss),
            "step_spec": str(new.precision.sharding.spec)}


def check_sharded_state(steps=5, hidden=18):
    """IVON's optimizer state split over the devices stays split through jitted steps and optax-view updates.
    hidden=18: 64*18 + 18 + 18*10 + 10 = 1360 weights, a multiple of 4 (JAX splits only evenly)."""
    X, y = digits()
    mesh = mesh4()
    Xs, ys = nb.shard_data(mesh, X, y)
    params = _mlp_params(hidden)
    algo = nb.ivon(0.1, ess=X.shape[0], hess_init=0.3)
    out = {}
    # 1. the algorithm's own state (mean, precision, momentum: flat), split; compared with one device
    state = nb.shard_state(mesh, algo.init(params))
    ref = algo.init(params)
    step = nb.data_parallel_step(algo, _mlp_loss, mesh)
    ref_step = jax.jit(lambda k, s, x, yy: algo.step(k, s, _mlp_loss, x, yy))
    for i in range(steps):
        state, _ = step(jax.random.PRNGKey(i), state, Xs, ys)
        ref, _ = ref_step(jax.random.PRNGKey(i), ref, X, y)
    out["step_specs"] = [str(x.sharding.spec) for x in (state.mean, state.precision, state.momentum)]
    out["step_shard_len"] = [int(x.addressable_shards[0].data.shape[0]) for x in (state.mean, state.precision)]
    out["size"] = int(state.mean.shape[0])
    out["step_diff"] = float(np.max(np.abs(np.asarray(state.mean) - np.asarray(ref.mean))))
    # 2. the optax view: parameters split along a layer's input axis, the view's state split
    from jax.sharding import NamedSharding, PartitionSpec as P

    tx = nb.as_optax(algo)
    specs = {"w1": P("data", None), "b1": P(), "w2": P(), "b2": P()}
    p = {k: jax.device_put(v, NamedSharding(mesh, specs[k])) for k, v in params.items()}
    s = nb.shard_state(mesh, tx.init(p))

    def train_step(p, s, xb, yb):
        theta = nb.perturbed(algo, p, s)
        grads = jax.grad(_mlp_loss)(theta, xb, yb)
        updates, s = tx.update(grads, s, p)
        return optax.apply_updates(p, updates), s

    jitted = jax.jit(train_step, out_shardings=(nb.parallel.shardings_of(p), nb.parallel.shardings_of(s)))
    p0, s0 = p, s
    for _ in range(steps):
        p, s = jitted(p, s, Xs, ys)
    out["param_specs"] = {k: str(v.sharding.spec) for k, v in p.items()}
    out["view_specs"] = [str(x.sharding.spec) for x in (s.precision, s.momentum)]
    # the same steps on one device, unsharded
    pr, sr = jax.tree.map(np.asarray, params), tx.init(params)
    for _ in range(steps):
        pr, sr = jax.jit(train_step)(pr, sr, X, y)
    out["view_diff"] = max(float(np.max(np.abs(np.asarray(p[k]) - np.asarray(pr[k])))) for k in p)
    out["view_collectives"] = {c: v for c, v in nb.collective_counts(jitted, p0, s0, Xs, ys).items() if c != "where"}
    return out


def check_bad_input():
    """Errors before any step: a batch that does not divide the devices, data split along a feature axis,
    arrays that disagree on the plate axis, a full-covariance guide too large for the device."""
    from jax.sharding import NamedSharding, PartitionSpec as P

    X, y = breast_cancer(569)
    msgs = {}
    for label, fn in (
        ("indivisible", lambda: nb.shard_data(mesh4(), X, y)),
        ("axes_disagree", lambda: nb.shard_data(mesh4(), X[:568], y[:568], axis=(1, 0))),
        ("feature_axis", lambda: nb.check_data_sharding(
            logistic_model, jax.device_put(X[:, :28], NamedSharding(mesh4(), P(None, "data"))), y)),
    ):
        try:
            fn()
            msgs[label] = None
        except nb.ScaleError as err:
            msgs[label] = str(err)
    return msgs


def process_fit():
    """One process of the two-process run: this process's half of the rows, the global array, nb.BLR."""
    X, y = breast_cancer()
    rows = nb.parallel.process_rows(X.shape[0])
    mesh = nb.data_mesh()
    Xs, ys = nb.shard_data(mesh, X[rows], y[rows], model=logistic_model)
    svi = SVI(logistic_model, AutoMultivariateNormal(logistic_model), nb.BLR(), Trace_ELBO())
    res = svi.run(jax.random.PRNGKey(0), BLR_STEPS, Xs, ys, progress_bar=False)
    return {"process": jax.process_index(), "steps": BLR_STEPS, "processes": jax.process_count(), "devices": len(jax.devices()),
            "global_rows": int(Xs.shape[0]), "params": {k: np.asarray(v).tolist() for k, v in res.params.items()},
            "loss": float(res.losses[-1])}


CHECKS = {name[len("check_"):]: fn for name, fn in globals().items() if name.startswith("check_")}


def main(argv):
    if "--process" in argv:
        print("RESULT " + json.dumps(process_fit()), flush=True)
        return
    for name in argv:
        start = time.perf_counter()
        try:
            result = CHECKS[name]()
            result["check"] = name
        except Exception:  # noqa: BLE001 - reported to the test, which fails with the traceback
            result = {"check": name, "error": traceback.format_exc()}
        print("RESULT " + json.dumps(result), flush=True)
        print(f"check {name}: {time.perf_counter() - start:.1f} s (compilation included)", file=sys.stderr, flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
