"""IVON vs AdamW vs SGD on scikit-learn's digits with a small pure-JAX MLP.

    python examples/digits_ivon.py [--epochs 60]

Prints test accuracy, NLL and expected calibration error (15 bins) at the mean and, for IVON,
with 32-sample predictive averaging, plus the time per training step. Runs in about a minute
on two CPU cores.
"""

import argparse
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split

from numpyro_blr.deep import ivon

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


# Hyper-parameters chosen by validation NLL (load_data(validation=True), 60 epochs, small grids:
# IVON lr {0.2,0.5,1,2} x hess_init {0.1,0.3,1} x beta2 {0.999,0.9999}; AdamW lr {3e-4..1e-2};
# SGD lr {0.03,0.1,0.3}); the test set is used once, for the printed numbers.
IVON_LR, IVON_H0, IVON_BETA2 = 1.0, 0.3, 0.9999
ADAMW_LR, SGD_LR = 1e-2, 0.3


def make_ivon(n_train, epochs=60):
    # ess = training-set size; hess_init sets the initial posterior s.d. 1/sqrt(ess*(h0+delta)).
    return ivon(lr=cosine(IVON_LR, epochs, n_train), ess=n_train, hess_init=IVON_H0, beta1=0.9,
                beta2=IVON_BETA2, weight_decay=1e-4, mc_samples=1)


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


def compare(epochs=60, seed=0, num_samples=32):
    data = load_data()
    x_te, y_te = data[1], data[3]
    rows = []
    n = len(data[2])
    opt, state, t_ivon = train_ivon(data, epochs, seed)
    rows.append(("IVON @ mean", metrics(probs_fn(state.params, x_te), y_te), t_ivon))
    pred = opt.predictive(jax.random.key(seed + 3), state, probs_fn, x_te, num_samples)
    rows.append((f"IVON {num_samples}-sample", metrics(pred, y_te), t_ivon))
    for name, tx in [
        ("AdamW", optax.adamw(cosine(ADAMW_LR, epochs, n), weight_decay=1e-4)),
        ("SGD+momentum", optax.chain(optax.add_decayed_weights(1e-4), optax.sgd(cosine(SGD_LR, epochs, n), momentum=0.9))),
    ]:
        params, t = train_optax(tx, data, epochs, seed)
        rows.append((name, metrics(probs_fn(params, x_te), y_te), t))
    return rows, state


def print_rows(rows):
    print(f"{'method':<18} {'acc':>7} {'NLL':>8} {'ECE':>8} {'ms/step':>8}")
    for name, m, t in rows:
        print(f"{name:<18} {m['acc']:7.4f} {m['nll']:8.4f} {m['ece']:8.4f} {1e3 * t:8.3f}")


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--epochs", type=int, default=60)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    t0 = time.perf_counter()
    rows, state = compare(args.epochs, args.seed)
    print(f"digits: {len(load_data()[2])} train / {len(load_data()[3])} test, MLP {SIZES}, batch {BATCH}, {args.epochs} epochs")
    print_rows(rows)
    print(f"IVON skipped steps: {int(state.skipped)}; total time {time.perf_counter() - t0:.1f}s")
