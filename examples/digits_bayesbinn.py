"""BayesBiNN (Meng, Bachmann & Khan 2020) on scikit-learn's digits: a binary (+-1 weight) MLP.

Every weight of the 64-512-10 network is binary; layers are scaled by 1/sqrt(fan_in) and the
hidden pre-activations are standardised per example (a parameter-free layer norm), so the only
learned quantities are the Bernoulli natural parameters lam. Prints test accuracy with the
sign(mu) network and with the average of sampled binary networks (fixed 80/20 split).

Run: python examples/digits_bayesbinn.py   (about half a minute on 2 CPU cores)
"""

import time

import jax
import jax.numpy as jnp
import numpy as np
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split

from numpyro_blr import bayesbinn
from numpyro_blr.bayesbinn import mean as sign_mean
from numpyro_blr.bayesbinn import predictive, sample_binary

HIDDEN = 512


def apply(w, x):
    """Logits of the binary MLP; scale factors are fixed, not learned."""
    h = x @ w["w1"] / np.sqrt(x.shape[-1])
    h = (h - h.mean(-1, keepdims=True)) / (h.std(-1, keepdims=True) + 1e-5)
    h = jnp.tanh(h)
    return 4.0 * (h @ w["w2"]) / np.sqrt(HIDDEN)


def loss_fn(w, x, y):
    logits = apply(w, x)
    return -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(logits), y[:, None], -1))


def main(epochs=60, batch=64, seed=0):
    X, y = load_digits(return_X_y=True)
    X_tr, X_te, y_tr, y_te = train_test_split(X, y, test_size=0.2, random_state=0, stratify=y)
    mean, sd = X_tr.mean(0), X_tr.std(0) + 1e-6
    X_tr = jnp.asarray((X_tr - mean) / sd, jnp.float32)
    X_te = jnp.asarray((X_te - mean) / sd, jnp.float32)
    y_tr, y_te = jnp.asarray(y_tr), jnp.asarray(y_te)
    n = X_tr.shape[0]
    steps_per_epoch = n // batch

    total = epochs * steps_per_epoch
    lr = lambda t: 3e-3 * 0.5 * (1.0 + jnp.cos(jnp.pi * jnp.minimum(t, total) / total))  # cosine decay
    opt = bayesbinn(lr=lr, ess=n, temperature=1.0, beta=0.99, mc_samples=1, lam_init=10.0)
    shapes = {"w1": jnp.zeros((64, HIDDEN)), "w2": jnp.zeros((HIDDEN, 10))}
    key = jax.random.PRNGKey(seed)
    key, k0 = jax.random.split(key)
    state = opt.init(k0, shapes)

    @jax.jit
    def epoch(state, key):
        kp, ks = jax.random.split(key)
        perm = jax.random.permutation(kp, n)[: steps_per_epoch * batch].reshape(steps_per_epoch, batch)

        def body(s, inp):
            idx, k = inp
            return opt.step(k, s, loss_fn, X_tr[idx], y_tr[idx])

        return jax.lax.scan(body, state, (perm, jax.random.split(ks, steps_per_epoch)))

    t0 = time.time()
    for e in range(epochs):
        key, k = jax.random.split(key)
        state, info = epoch(state, k)
        if (e + 1) % 20 == 0:
            acc = jnp.mean(jnp.argmax(apply(sign_mean(state), X_te), -1) == y_te)
            print(f"epoch {e + 1:3d}  train loss {float(info.loss.mean()):.3f}  test acc sign(mu) {float(acc):.4f}")

    acc_mean = float(jnp.mean(jnp.argmax(apply(sign_mean(state), X_te), -1) == y_te))
    probs = predictive(jax.random.PRNGKey(1), state, lambda w, x: jax.nn.softmax(apply(w, x)), X_te, 32)
    acc_bma = float(jnp.mean(jnp.argmax(probs, -1) == y_te))
    one = apply(sample_binary(jax.random.PRNGKey(2), state), X_te)
    acc_one = float(jnp.mean(jnp.argmax(one, -1) == y_te))
    print(f"test accuracy, sign(mu) network:               {acc_mean:.4f}")
    print(f"test accuracy, one sampled binary network:     {acc_one:.4f}")
    print(f"test accuracy, average of 32 sampled networks: {acc_bma:.4f}")
    print(f"time {time.time() - t0:.1f} s")


if __name__ == "__main__":
    main()
