"""IVON vs AdamW vs SGD on scikit-learn's digits with a small pure-JAX MLP.

    python examples/digits_ivon.py [--epochs 60] [--seeds 0 1 2 3 4] [--tune [1|2]] [--paired] [--cv]

Prints test accuracy, NLL and expected calibration error (15 bins) at the mean and, for IVON,
with 32-sample predictive averaging, plus the time per training step, for seeds 0-4 and their
mean +- standard error (ECE on 450 test points is noisy: one seed is not a comparison). Runs in
about 25 s on one CPU core; ``--tune`` reruns the stage-2 validation grid (IVON ess, weight decay,
MC samples and lr; AdamW weight decay and lr; about 9 min), ``--tune 1`` the first one (IVON lr,
hess_init, beta2; AdamW and SGD lr). See the comment above ``IVON_LR`` for the selection.
``--paired`` prints how small an IVON - AdamW difference in NLL and ECE the fixed test split can
resolve (per-image differences and a bootstrap over the test images); ``--cv`` evaluates on all
1797 images by 5-fold cross-validation (about 2 min).
"""

import argparse
import itertools
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split

from numpyro_blr.deep import ivon, predictive

SIZES = (64, 128, 128, 10)
BATCH = 64


def load_data(validation=False):
    """(x_train, x_test, y_train, y_test). With ``validation=True`` the *test* part is a validation
    set split off the training data (20%), which is what hyper-parameters are tuned on."""
    x, y = load_digits(return_X_y=True)
    x = (x / 16.0).astype(np.float32)
    x_tr, x_te, y_tr, y_te = train_test_split(x, y, test_size=0.25, random_state=0)
    if validation:
        x_tr, x_te, y_tr, y_te = train_test_split(x_tr, y_tr, test_size=0.2, random_state=1)
    return x_tr, x_te, y_tr.astype(np.int32), y_te.astype(np.int32)


def init_mlp(key, sizes=SIZES):
    params = []
    for k, (n_in, n_out) in zip(jax.random.split(key, len(sizes) - 1), zip(sizes[:-1], sizes[1:])):
        params.append((jax.random.normal(k, (n_in, n_out)) * np.sqrt(2.0 / n_in), jnp.zeros(n_out)))
    return params


def logits_fn(params, x):
    for w, b in params[:-1]:
        x = jax.nn.relu(x @ w + b)
    w, b = params[-1]
    return x @ w + b


def probs_fn(params, x):
    return jax.nn.softmax(logits_fn(params, x))


def loss_fn(params, x, y):
    """Mean cross-entropy of a mini-batch (no L2 term: weight decay lives in the optimizers)."""
    logp = jax.nn.log_softmax(logits_fn(params, x))
    return -jnp.mean(jnp.take_along_axis(logp, y[:, None], axis=1))


def metrics(probs, y, bins=15):
    probs = np.asarray(probs, np.float64)
    pred, conf = probs.argmax(1), probs.max(1)
    correct = pred == y
    nll = -np.mean(np.log(np.clip(probs[np.arange(len(y)), y], 1e-12, None)))
    edges = np.linspace(0, 1, bins + 1)
    ece = 0.0
    for lo, hi in zip(edges[:-1], edges[1:]):
        m = (conf > lo) & (conf <= hi)
        if m.any():
            ece += m.mean() * abs(correct[m].mean() - conf[m].mean())
    return dict(acc=correct.mean(), nll=nll, ece=ece)


def batches(key, n, epochs):
    """Index array (steps, BATCH): a fresh permutation per epoch, last partial batch dropped."""
    per = n // BATCH
    idx = [np.asarray(jax.random.permutation(k, n))[: per * BATCH].reshape(per, BATCH) for k in jax.random.split(key, epochs)]
    return np.concatenate(idx)


def cosine(lr, epochs, n_train):
    """The same schedule for every method: cosine decay to 0 over the run (as in the IVON paper)."""
    return optax.cosine_decay_schedule(lr, epochs * (n_train // BATCH))


# Hyper-parameters chosen by validation NLL on load_data(validation=True) (the test set is used only
# for the printed numbers). Rule, fixed before the stage-2 grid was run: mean validation NLL over
# seeds 0-4 (IVON: 32-sample predictive); every config within one standard error of the best counts
# as tied, and among those the one with the fewest departures from the simpler/default setting wins.
# Stage 1 (`--tune 1`, 60 epochs, weight decay 1e-4, seeds 0-2, then 0-4 for the top IVON configs):
# IVON lr x hess_init x beta2 and AdamW/SGD lr. The 3-seed grid ranked IVON lr=2.0 first, but it
# sits next to diverging settings and with seeds 0-4 it is unstable (NLL 0.11 +- 0.05); lr=1.0:
# 0.0529, lr=0.5: 0.0530 (hess_init 0.3, beta2 0.9999). Stage 2 (`--tune`, seeds 0-4, 60 epochs):
# IVON ess/n_train {0.5,1,2} x weight_decay {1e-4,1e-3,1e-2} x mc_samples {1,2} x lr {0.5,1}
# (hess_init 0.3, beta2 0.9999) and AdamW weight_decay {1e-4,1e-3,1e-2,1e-1} x lr {3e-3,1e-2}
# (1e-1 added after the grid to 1e-2 showed AdamW's NLL still falling at its edge).
# IVON's best is ess = n_train, weight_decay 1e-4, mc_samples 1, lr 1 (0.0529 +- 0.0022; next
# lr 0.5: 0.0530, mc_samples 2: 0.0543, ess 0.5 n: 0.0541; weight_decay 1e-3: >= 0.060, 1e-2:
# >= 0.15). AdamW's best is weight_decay 0.1 (0.0582 +- 0.0039; 1e-2: 0.0591), but weight_decay 1e-4
# (0.0613 +- 0.0042) is within one s.e., so the rule keeps 1e-4 (lr 1e-2). 100 instead of 60 epochs
# (selected configs, seeds 0-4) is worse for all three: IVON 0.0551, AdamW 0.0617, SGD 0.0619.
# These grids were run with the previous counter hash (two rounds of lowbias32 per word); they were not re-run
# after tree.hash_normal became one round per word, and the selected settings were kept.
IVON_LR, IVON_H0, IVON_BETA2 = 1.0, 0.3, 0.9999
IVON_ESS_MULT, IVON_WD, IVON_MC = 1.0, 1e-4, 1
ADAMW_WD = 1e-4
ADAMW_LR, SGD_LR = 1e-2, 0.1
IVON_GRID = dict(ess_mult=(0.5, 1.0, 2.0), weight_decay=(1e-4, 1e-3, 1e-2), mc_samples=(1, 2), lr=(0.5, 1.0))
ADAMW_GRID = dict(weight_decay=(1e-4, 1e-3, 1e-2, 1e-1), lr=(3e-3, 1e-2))
SGD_GRID = (0.03, 0.1, 0.3)


def make_ivon(n_train, epochs=60, lr=None, hess_init=None, beta2=None, ess_mult=None, weight_decay=None,
              mc_samples=None, **kwargs):
    # ess = ess_mult * training-set size; hess_init sets the initial posterior s.d.
    # 1/sqrt(ess*(h0+delta)); weight_decay delta is the prior precision per example.
    return ivon(lr=cosine(IVON_LR if lr is None else lr, epochs, n_train),
                ess=(IVON_ESS_MULT if ess_mult is None else ess_mult) * n_train,
                hess_init=IVON_H0 if hess_init is None else hess_init, beta1=0.9,
                beta2=IVON_BETA2 if beta2 is None else beta2,
                weight_decay=IVON_WD if weight_decay is None else weight_decay,
                mc_samples=IVON_MC if mc_samples is None else mc_samples, **kwargs)


def train_ivon(data, epochs, seed=0, opt=None):
    x_tr, _, y_tr, _ = data
    x_tr, y_tr = jnp.asarray(x_tr), jnp.asarray(y_tr)
    opt = opt or make_ivon(len(y_tr), epochs)
    state = opt.init(init_mlp(jax.random.key(seed)))
    base_key = jax.random.key(seed + 2)

    @jax.jit
    def step(i, state, b):  # the key is derived inside jit: no host randomness, no per-step key slicing
        return opt.step(jax.random.fold_in(base_key, i), state, loss_fn, x_tr[b], y_tr[b])

    idx = batches(jax.random.key(seed + 1), len(y_tr), epochs)
    state, _ = step(0, state, idx[0])  # compile
    jax.block_until_ready(state)
    t0 = time.perf_counter()
    for i, b in enumerate(idx[1:], 1):
        state, _ = step(i, state, b)
    jax.block_until_ready(state)
    return opt, state, (time.perf_counter() - t0) / (len(idx) - 1)


def train_optax(tx, data, epochs, seed=0):
    x_tr, _, y_tr, _ = data
    x_tr, y_tr = jnp.asarray(x_tr), jnp.asarray(y_tr)
    params = init_mlp(jax.random.key(seed))
    opt_state = tx.init(params)

    @jax.jit
    def step(params, opt_state, b):
        loss, g = jax.value_and_grad(loss_fn)(params, x_tr[b], y_tr[b])
        updates, opt_state = tx.update(g, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    idx = batches(jax.random.key(seed + 1), len(y_tr), epochs)
    params, opt_state, _ = step(params, opt_state, idx[0])
    jax.block_until_ready(params)
    t0 = time.perf_counter()
    for b in idx[1:]:
        params, opt_state, _ = step(params, opt_state, b)
    jax.block_until_ready(params)
    return params, (time.perf_counter() - t0) / (len(idx) - 1)


def adamw(lr, epochs, n, weight_decay=None):
    return optax.adamw(cosine(lr, epochs, n), weight_decay=ADAMW_WD if weight_decay is None else weight_decay)


def sgd(lr, epochs, n):
    return optax.chain(optax.add_decayed_weights(1e-4), optax.sgd(cosine(lr, epochs, n), momentum=0.9))


def run_seed(data, epochs=60, seed=0, num_samples=32, ivon_kwargs=None, adamw_lr=None, sgd_lr=None):
    """One seed of every method on ``data``: a list of (name, metrics, seconds per step)."""
    x_te, y_te = data[1], data[3]
    n = len(data[2])
    rows = []
    opt, state, t_ivon = train_ivon(data, epochs, seed, make_ivon(n, epochs, **(ivon_kwargs or {})))
    rows.append(("IVON @ mean", metrics(probs_fn(state.params, x_te), y_te), t_ivon))
    pred = predictive(jax.random.key(seed + 3), state, probs_fn, x_te, num_samples, sample=opt.sample)
    rows.append((f"IVON {num_samples}-sample", metrics(pred, y_te), t_ivon))
    for name, tx in [("AdamW", adamw(adamw_lr or ADAMW_LR, epochs, n)), ("SGD+momentum", sgd(sgd_lr or SGD_LR, epochs, n))]:
        params, t = train_optax(tx, data, epochs, seed)
        rows.append((name, metrics(probs_fn(params, x_te), y_te), t))
    return rows, state


def compare(epochs=60, seeds=(0, 1, 2, 3, 4), num_samples=32):
    """All methods on the test split for each seed (seed = init, batch order and IVON noise)."""
    data = load_data()
    per_seed, states = [], []
    for seed in seeds:
        rows, state = run_seed(data, epochs, seed, num_samples)
        per_seed.append(rows)
        states.append(state)
    return per_seed, states


def summarize(per_seed):
    """(name, {metric: (mean, standard error over seeds)}, mean seconds per step) per method."""
    out = []
    for i, (name, _, _) in enumerate(per_seed[0]):
        ms = [rows[i][1] for rows in per_seed]
        stat = {}
        for k in ms[0]:
            v = np.array([m[k] for m in ms])
            stat[k] = (v.mean(), v.std(ddof=1) / np.sqrt(len(v)) if len(v) > 1 else float("nan"))
        out.append((name, stat, float(np.mean([rows[i][2] for rows in per_seed]))))
    return out


def print_rows(rows):
    print(f"{'method':<18} {'acc':>7} {'NLL':>8} {'ECE':>8} {'ms/step':>8}")
    for name, m, t in rows:
        print(f"{name:<18} {m['acc']:7.4f} {m['nll']:8.4f} {m['ece']:8.4f} {1e3 * t:8.3f}")


def print_summary(per_seed, seeds):
    for seed, rows in zip(seeds, per_seed):
        print(f"seed {seed}")
        print_rows(rows)
    print(f"mean ± s.e. over seeds {list(seeds)}")
    print(f"{'method':<18} {'acc':>16} {'NLL':>16} {'ECE':>16}")
    for name, st, _ in summarize(per_seed):
        print(f"{name:<18} " + " ".join(f"{st[k][0]:8.4f}±{st[k][1]:.4f}" for k in ("acc", "nll", "ece")))


def _mean_se(ms):
    """{metric: (mean, standard error)} over a list of metric dicts (one per seed)."""
    out = {}
    for k in ms[0]:
        v = np.array([m[k] for m in ms], np.float64)
        out[k] = (float(v.mean()), float(v.std(ddof=1) / np.sqrt(len(v))) if len(v) > 1 else float("nan"))
    return out


def select(res, default):
    """The selection rule: lowest mean validation NLL; every config within one standard error of
    it (the best one's) counts as tied, and among those the one with the fewest departures from
    ``default`` (a dict of the simpler/default values) wins, then the lower NLL."""
    best = min(res, key=lambda k: res[k]["nll"][0])
    se = np.nan_to_num(res[best]["nll"][1])  # nan with a single seed: then only exact ties
    tied = [k for k in res if res[k]["nll"][0] <= res[best]["nll"][0] + se]
    departures = lambda k: sum(v != default[name] for name, v in k)
    return min(tied, key=lambda k: (departures(k), res[k]["nll"][0]))


def tune(epochs=60, seeds=(0, 1, 2, 3, 4), num_samples=32, stage=2):
    """The validation grids (validation split of the training data; the test set is not touched).
    Every config is scored by mean +- s.e. over ``seeds``; the criterion is NLL (IVON: the
    ``num_samples``-sample predictive one), ties broken by :func:`select`.

    ``stage=1``: the first grid (IVON lr x hess_init x beta2; AdamW and SGD lr; weight decay
    1e-4 everywhere). ``stage=2``: with hess_init and beta2 fixed at the stage-1 choice, IVON
    ess/n_train x weight_decay x mc_samples x lr and AdamW weight_decay x lr (SGD lr again)."""
    data = load_data(validation=True)
    x_va, y_va = data[1], data[3]
    n = len(data[2])

    def show(tag, m):
        print(f"{tag:<58} " + "  ".join(f"{k} {m[k][0]:.4f}±{m[k][1]:.4f}" for k in ("acc", "nll", "ece")), flush=True)

    def ivon_val(**kw):
        def one(seed):
            opt, state, _ = train_ivon(data, epochs, seed, make_ivon(n, epochs, **kw))
            return metrics(predictive(jax.random.key(seed + 3), state, probs_fn, x_va, num_samples, sample=opt.sample), y_va)
        return _mean_se([one(s) for s in seeds])

    def optax_val(make):
        return _mean_se([metrics(probs_fn(train_optax(make(), data, epochs, s)[0], x_va), y_va) for s in seeds])

    grids = {
        1: dict(ivon=dict(lr=(0.2, 0.5, 1.0, 2.0), hess_init=(0.1, 0.3, 1.0), beta2=(0.999, 0.9999)),
                adamw=dict(lr=(3e-4, 1e-3, 3e-3, 1e-2)), sgd=dict(lr=SGD_GRID)),
        2: dict(ivon=IVON_GRID, adamw=ADAMW_GRID, sgd=dict(lr=SGD_GRID)),
    }[stage]
    defaults = dict(ivon=dict(lr=1.0, hess_init=0.3, beta2=0.9999, ess_mult=1.0, weight_decay=1e-4, mc_samples=1),
                    adamw=dict(lr=1e-2, weight_decay=1e-4), sgd=dict(lr=0.1))
    res = dict(ivon={}, adamw={}, sgd={})
    for method, grid in grids.items():
        for values in itertools.product(*grid.values()):
            kw = dict(zip(grid, values))
            if method == "ivon":
                m = ivon_val(**kw)
            elif method == "adamw":
                m = optax_val(lambda: adamw(kw["lr"], epochs, n, kw.get("weight_decay")))
            else:
                m = optax_val(lambda: sgd(kw["lr"], epochs, n))
            res[method][tuple(kw.items())] = m
            show(f"{method} " + " ".join(f"{k}={v}" for k, v in kw.items()), m)
    for method in res:
        best = select(res[method], defaults[method])
        show(f"selected {method}: " + " ".join(f"{k}={v}" for k, v in best), res[method][best])
    return res


def bootstrap_draws(n, boot=1000, seed=0):
    """``boot`` resamples (with replacement) of ``n`` evaluation images."""
    rng = np.random.default_rng(seed)
    return [rng.integers(0, n, n) for _ in range(boot)]


def nll_difference(p_ivon, p_adamw, y, draws):
    """Per-image NLL difference IVON - AdamW (predictions ``seeds x images x classes``,
    log-likelihoods averaged over seeds): a line with its mean, standard error over images and
    bootstrap 95% interval over ``draws``."""
    idx = np.arange(len(y))
    nll = lambda ps: -np.mean(np.log(np.clip(np.asarray(ps, np.float64)[:, idx, y], 1e-12, None)), axis=0)  # noqa: E731
    diff = nll(p_ivon) - nll(p_adamw)
    ci = np.percentile([diff[b].mean() for b in draws], [2.5, 97.5])
    return (f"NLL difference {diff.mean():+.4f}, s.e. over images {diff.std(ddof=1) / np.sqrt(len(diff)):.4f}, "
            f"bootstrap 95% interval [{ci[0]:+.4f}, {ci[1]:+.4f}]")


def paired_resolution(epochs=60, seeds=(0, 1, 2, 3, 4), num_samples=32, boot=1000):
    """How small an IVON - AdamW difference the fixed test split can resolve.

    The per-seed standard errors printed by :func:`compare` measure seed-to-seed variation only;
    every seed is scored on the same 450 test images. Here the NLL difference is taken per test
    image (log-likelihoods averaged over seeds), so its standard error over images and a
    bootstrap over images (also for the ECE difference) show the test set's own resolution."""
    data = load_data()
    x_te, y_te = data[1], data[3]
    n = len(data[2])
    idx = np.arange(len(y_te))
    p_ivon, p_adamw = [], []
    for seed in seeds:
        opt, state, _ = train_ivon(data, epochs, seed, make_ivon(n, epochs))
        p_ivon.append(np.asarray(predictive(jax.random.key(seed + 3), state, probs_fn, x_te, num_samples, sample=opt.sample), np.float64))
        params, _ = train_optax(adamw(ADAMW_LR, epochs, n), data, epochs, seed)
        p_adamw.append(np.asarray(probs_fn(params, x_te), np.float64))
    draws = bootstrap_draws(len(y_te), boot)
    ece_diff = lambda b: np.mean([metrics(pi[b], y_te[b])["ece"] - metrics(pa[b], y_te[b])["ece"]  # noqa: E731
                                  for pi, pa in zip(p_ivon, p_adamw)])
    ece_ci = np.percentile([ece_diff(b) for b in draws], [2.5, 97.5])
    print(f"IVON {num_samples}-sample - AdamW on the {len(y_te)} test images, seeds {list(seeds)}:")
    print("  " + nll_difference(p_ivon, p_adamw, y_te, draws))
    print(f"  ECE difference {ece_diff(idx):+.4f}, bootstrap 95% interval [{ece_ci[0]:+.4f}, {ece_ci[1]:+.4f}]")


def cross_validated(epochs=60, seeds=(0, 1, 2, 3, 4), folds=5, num_samples=32, boot=1000):
    """IVON vs AdamW and SGD with every one of the 1797 images held out once (``folds``-fold
    cross-validation, stratified, the selected hyper-parameters unchanged), which gives four
    times the fixed split's evaluation set. Prints each method's accuracy, NLL and ECE over all
    held-out images (mean +- s.e. over seeds), and the per-image IVON - AdamW NLL difference with
    its standard error and a bootstrap interval over images."""
    from sklearn.model_selection import StratifiedKFold

    x, y = load_digits(return_X_y=True)
    x, y = (x / 16.0).astype(np.float32), y.astype(np.int32)
    p_ivon = np.zeros((len(seeds), len(y), 10))
    p_adamw = np.zeros((len(seeds), len(y), 10))
    p_sgd = np.zeros((len(seeds), len(y), 10))
    for tr, te in StratifiedKFold(folds, shuffle=True, random_state=0).split(x, y):
        data = (x[tr], x[te], y[tr], y[te])
        for k, seed in enumerate(seeds):
            opt, state, _ = train_ivon(data, epochs, seed, make_ivon(len(tr), epochs))
            p_ivon[k, te] = np.asarray(predictive(jax.random.key(seed + 3), state, probs_fn, x[te], num_samples, sample=opt.sample))
            params, _ = train_optax(adamw(ADAMW_LR, epochs, len(tr)), data, epochs, seed)
            p_adamw[k, te] = np.asarray(probs_fn(params, x[te]))
            params, _ = train_optax(sgd(SGD_LR, epochs, len(tr)), data, epochs, seed)
            p_sgd[k, te] = np.asarray(probs_fn(params, x[te]))
    for name, ps in (("IVON %d-sample" % num_samples, p_ivon), ("AdamW", p_adamw), ("SGD+momentum", p_sgd)):
        m = _mean_se([metrics(p, y) for p in ps])
        print(f"{name:<18} " + "  ".join(f"{k} {m[k][0]:.4f}±{m[k][1]:.4f}" for k in ("acc", "nll", "ece")))
    print(f"IVON - AdamW over the {len(y)} held-out images: " + nll_difference(p_ivon, p_adamw, y, bootstrap_draws(len(y), boot)))

if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--epochs", type=int, default=60)
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2, 3, 4])
    ap.add_argument("--tune", type=int, nargs="?", const=2, choices=(1, 2),
                    help="run the validation grids instead (stage 2, the default, or the first grid 1)")
    ap.add_argument("--paired", action="store_true",
                    help="the test set's own resolution of the IVON - AdamW NLL and ECE differences")
    ap.add_argument("--cv", action="store_true",
                    help="IVON vs AdamW and SGD with 5-fold cross-validation over all 1797 images")
    args = ap.parse_args()
    t0 = time.perf_counter()
    if args.tune:
        tune(args.epochs, args.seeds, stage=args.tune)
    elif args.paired:
        paired_resolution(args.epochs, args.seeds)
    elif args.cv:
        cross_validated(args.epochs, args.seeds)
    else:
        per_seed, states = compare(args.epochs, args.seeds)
        x_tr, x_te = load_data()[:2]
        print(f"digits: {len(x_tr)} train / {len(x_te)} test, MLP {SIZES}, batch {BATCH}, {args.epochs} epochs")
        print_summary(per_seed, args.seeds)
        print(f"IVON skipped steps: {[int(s.skipped) for s in states]}")
    print(f"total time {time.perf_counter() - t0:.1f}s")
