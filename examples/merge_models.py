"""Model merging by uncertainty on scikit-learn's digits: five networks fine-tuned from one start, merged.

    python examples/merge_models.py [--seeds 0 1 2] [--short] [--brief]

The story (Daheim et al. 2024; ``numpyro_blr.online.merge``):

1. **Start.** An MLP (64-64-10) is trained with IVON on a *pretraining split* (25% of the training
   pool, all ten classes): its posterior :math:`q_0 = \\mathcal N(\\theta_0, P_0^{-1})` with
   :math:`P_0` = ``ess * state.precision``.
2. **Tasks.** The rest of the pool is split by class into five tasks ({0,1}, {2,3}, ..., {8,9}, about
   160 images each). Each is fine-tuned from :math:`\\theta_0` with IVON (same 10-way head) under the
   prior :math:`q_0` (the term :math:`\\tfrac12(\\theta-\\theta_0)^\\top P_0(\\theta-\\theta_0)/N_t` in the loss,
   weight decay 0), so its posterior precision ``N_t * state.precision`` estimates :math:`P_0 + H_t`.
3. **Merge.** Plain average of the five fine-tuned models (task arithmetic, :math:`\\alpha = 1/T`) vs
   ``merge(theta0, states, ess=sizes, prior_precision=P0)`` (:math:`\\alpha_t = 1`: the product of the
   task posteriors divided by :math:`q_0^{T-1}`, i.e. the approximate posterior of all the data).

Accuracy is on the union of the tasks' test sets (the 450 test images, all ten classes). A task
model alone knows its two classes well and forgets others; the merge keeps each task's change
where that task is certain. What it shows (``bench/bench_merge.py``, seeds 0-9, mean ± sd): with this
start (0.825 ± 0.076) the untuned merge (0.876 ± 0.037) is 2.4 ± 6.6 points above the plain average (0.852),
higher in 6 and lower in 4 seeds, and within about a point of task arithmetic whose alpha is tuned on a
validation split (0.888); with a briefly trained start (``--brief``, 0.599 ± 0.164) it is 8.1 ± 9.0 points
above the plain average, in 8 of 10 seeds (how large that mean gain is depends on the weight noise: see
docs/online.md). The prior precision matters: with :math:`H_0 = 0` (Fisher averaging) the merge gains less.
``--short`` fine-tunes for 30 instead of 100 epochs: IVON's precision (``beta2 = 0.99``) then still
holds much of its initial value ``hess_init``, and the merge gains less. About 10 s for one seed (3 s
per further seed) on one CPU core.
"""

import argparse
import time

import jax
import jax.numpy as jnp
import numpy as np
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split

import numpyro_blr as nb
from numpyro_blr.online.merge import merge, posterior_precision, task_arithmetic

SIZES = (64, 64, 10)
BATCH = 32
TASKS = ((0, 1), (2, 3), (4, 5), (6, 7), (8, 9))
PRETRAIN_FRACTION = 0.25
# Start: IVON lr 0.1, hess_init 0.3, weight decay 1e-3, 100 epochs (--brief: lr 0.5, 40 epochs). Fine-tuning: lr 0.05, hess_init 0.3,
# weight decay 0 (the prior is q_0, in the loss), 100 epochs; beta2 0.99 for both (IVON's precision must
# forget hess_init within the run: after k steps hess_init's weight is beta2**k, 0.99**500 < 0.01).
PRE = dict(lr=0.1, hess_init=0.3, weight_decay=1e-3, epochs=100)
PRE_BRIEF = dict(lr=0.5, hess_init=0.3, weight_decay=1e-3, epochs=40)  # --brief: a weaker, noisier start
FT = dict(lr=0.05, hess_init=0.3, weight_decay=0.0, epochs=100)
BETA2 = 0.99


def load_data():
    """Splits of digits (x / 16): ``dict`` of (x, y) for pretrain, each task, validation and test.

    Test: 25% of the images (stratified, seed 0); validation: 20% of the rest (for tuning task
    arithmetic's alpha); pretrain: 25% of the remaining pool; tasks: the pool's other images by class."""
    x, y = load_digits(return_X_y=True)
    x, y = (x / 16.0).astype(np.float32), y.astype(np.int32)
    x_tr, x_te, y_tr, y_te = train_test_split(x, y, test_size=0.25, random_state=0, stratify=y)
    x_pool, x_va, y_pool, y_va = train_test_split(x_tr, y_tr, test_size=0.2, random_state=1, stratify=y_tr)
    x_pre, x_ft, y_pre, y_ft = train_test_split(x_pool, y_pool, train_size=PRETRAIN_FRACTION, random_state=2,
                                                stratify=y_pool)
    tasks = [(x_ft[np.isin(y_ft, c)], y_ft[np.isin(y_ft, c)]) for c in TASKS]
    return dict(pretrain=(x_pre, y_pre), tasks=tasks, val=(x_va, y_va), test=(x_te, y_te),
                all=(np.concatenate([x_pre, x_ft]), np.concatenate([y_pre, y_ft])))


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


def cross_entropy(params, x, y):
    logp = jax.nn.log_softmax(logits_fn(params, x))
    return -jnp.mean(jnp.take_along_axis(logp, y[:, None], axis=1))


def accuracy(params, data):
    x, y = data
    return float(np.mean(np.asarray(logits_fn(params, x)).argmax(1) == y))


def batches(rng, n, epochs):
    """(steps, BATCH) indices: a fresh permutation per epoch, last partial batch dropped."""
    per = max(n // BATCH, 1)
    return np.concatenate([rng.permutation(n)[: per * BATCH].reshape(per, BATCH) for _ in range(epochs)])


_TRAINERS = {}


def trainer(n, steps, lr, hess_init, weight_decay):
    """A jitted IVON run of ``steps`` steps on ``n`` examples (cached: one compilation per task size)."""
    key = (n, steps, lr, hess_init, weight_decay)
    if key not in _TRAINERS:
        opt = nb.ivon(lr=lr, ess=float(n), hess_init=hess_init, beta2=BETA2, weight_decay=weight_decay)

        @jax.jit
        def run(params, theta0, prior_precision, x, y, idx, rng_key):
            def loss(p, xb, yb):  # mean loss + the prior N(theta0, prior_precision^-1), per example
                quad = sum(jnp.sum(h * (a - b) ** 2) for h, a, b in
                           zip(jax.tree.leaves(prior_precision), jax.tree.leaves(p), jax.tree.leaves(theta0)))
                return cross_entropy(p, xb, yb) + 0.5 * quad / n

            def body(state, inp):
                i, b = inp
                state, _ = opt.step(jax.random.fold_in(rng_key, i), state, loss, x[b], y[b])
                return state, None

            state, _ = jax.lax.scan(body, opt.init(params), (jnp.arange(idx.shape[0]), idx))
            return state

        _TRAINERS[key] = run
    return _TRAINERS[key]


def fit(params, data, cfg, rng, key, theta0=None, prior_precision=None):
    """IVON from ``params`` on ``data`` (prior N(theta0, prior_precision^-1) if given): the final DiagonalState."""
    x, y = data
    idx = batches(rng, len(y), cfg["epochs"])
    run = trainer(len(y), len(idx), cfg["lr"], cfg["hess_init"], cfg["weight_decay"])
    if prior_precision is None:
        theta0, prior_precision = params, jax.tree.map(jnp.zeros_like, params)
    return run(params, theta0, prior_precision, jnp.asarray(x), jnp.asarray(y), jnp.asarray(idx), key)


def start_and_tasks(data, seed, ft=FT, pre=PRE):
    """The start (theta0, P0) and the fine-tuned task states."""
    rng, key = np.random.default_rng(seed), jax.random.key(seed)
    start = fit(init_mlp(key), data["pretrain"], pre, rng, jax.random.fold_in(key, 1))
    theta0 = start.params
    p0 = posterior_precision(start, float(len(data["pretrain"][1])))
    states = [fit(theta0, task, ft, rng, jax.random.fold_in(key, 10 + t), theta0, p0)
              for t, task in enumerate(data["tasks"])]
    return theta0, p0, states


def run_seed(data, seed, ft=FT, pre=PRE):
    """Test accuracies (dict) of the start, each task model, the plain average and the merge."""
    theta0, p0, states = start_and_tasks(data, seed, ft, pre)
    sizes = [float(len(y)) for _, y in data["tasks"]]
    acc = {"start": accuracy(theta0, data["test"])}
    for c, s in zip(TASKS, states):
        acc[f"task {c}"] = accuracy(s.params, data["test"])
    acc["plain average"] = accuracy(task_arithmetic(theta0, states), data["test"])
    acc["merge"] = accuracy(merge(theta0, states, ess=sizes, prior_precision=p0), data["test"])
    return acc


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--short", action="store_true", help="fine-tune for 30 epochs (precisions not converged)")
    ap.add_argument("--brief", action="store_true", help="a briefly trained start (lr 0.5, 40 epochs)")
    args = ap.parse_args()
    t0 = time.perf_counter()
    data = load_data()
    ft = dict(FT, epochs=30) if args.short else FT
    pre = PRE_BRIEF if args.brief else PRE
    print(f"digits: pretrain {len(data['pretrain'][1])} images (all classes), tasks "
          f"{[len(y) for _, y in data['tasks']]} images (classes {list(TASKS)}), test {len(data['test'][1])} "
          f"(union of the tasks' test sets); MLP {SIZES}, IVON, start {pre['epochs']} epochs at lr {pre['lr']}, "
          f"fine-tuning {ft['epochs']} epochs")
    rows = [run_seed(data, s, ft, pre) for s in args.seeds]
    print(f"{'model':<16}" + "".join(f"{'seed ' + str(s):>9}" for s in args.seeds))
    for k in rows[0]:
        print(f"{k:<16}" + "".join(f"{r[k]:9.3f}" for r in rows))
    print(f"total time {time.perf_counter() - t0:.1f}s")
