"""Continual learning on split digits: IVON's posterior of one task as the prior of the next, in an optax loop.

    python examples/continual_digits.py [--seed 0] [--epochs 20] [--scenario class|domain|task] [--memory 20]

Five tasks of two digits each ({0,1}, {2,3}, ..., {8,9}; 250 training images per task, the rest for testing) are
trained in sequence on a 64-100-100-10 MLP. After each task the script prints the test accuracy on every task
seen so far, for plain AdamW fine-tuning and for IVON whose prior for task t+1 is its posterior after task t:

    algo = nb.ivon(0.1, ess=250, hess_init=1.0, beta2=0.999, prior=True)    # the prior is carried by the state
    tx = nb.as_optax(algo)
    opt_state = tx.init(params)                                             # task 1: the weight-decay prior
    ... train task 1 with nb.perturbed / tx.update ...
    opt_state = tx.init(params, prior=opt_state.as_prior(params))           # task 2: prior = posterior of task 1

The same jitted training step serves every task (the prior is state, not a constant). With ``--memory K`` (default
20; 0: off) two more runs keep a random coreset of K training images per task (VCL, Nguyen et al. 2018) and replay
it: while task t is trained, each batch of the new task is paired with a batch drawn from the memory of tasks
1..t-1 (the loss is the mean of the two). The default setting is class-incremental (one 10-way head, no task
identity at test time), where fine-tuning forgets every earlier task (about 20% average accuracy after the last
task), the posterior prior keeps part of them (about 40-45%), the prior with the memory about 85% and IVON with the
memory but no posterior prior about 92%; joint training on all tasks reaches about 98%
(``bench/bench_continual.py`` runs the three settings over seeds, with the replay baselines). About 20-30 s.
"""

import argparse

import jax
import jax.numpy as jnp
import numpy as np
import optax
from sklearn.datasets import load_digits

import numpyro_blr as nb

N_TRAIN, BATCH = 250, 25
TASKS = [(0, 1), (2, 3), (4, 5), (6, 7), (8, 9)]


def split_digits(seed):
    x, y = load_digits(return_X_y=True)
    rng = np.random.default_rng(seed)
    parts = []
    for a, b in TASKS:
        idx = np.flatnonzero((y == a) | (y == b))
        rng.shuffle(idx)
        parts.append((idx[:N_TRAIN], idx[N_TRAIN:]))
    train = np.concatenate([tr for tr, _ in parts])
    mu, sd = x[train].mean(0), x[train].std(0) + 1.0
    xs = ((x - mu) / sd).astype(np.float32)
    return [(xs[tr], y[tr].astype(np.int32), xs[te], y[te].astype(np.int32)) for tr, te in parts]


def init_mlp(key, sizes):
    keys = jax.random.split(key, len(sizes) - 1)
    return [(jax.random.normal(k, (i, o)) * np.sqrt(2.0 / i), jnp.zeros(o)) for k, i, o in zip(keys, sizes[:-1], sizes[1:])]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--epochs", type=int, default=20)
    ap.add_argument("--scenario", default="class", choices=["class", "domain", "task"])
    ap.add_argument("--memory", type=int, default=20, help="coreset images per task for replay (0: no replay runs)")
    args = ap.parse_args()
    tasks = split_digits(args.seed)
    n_out = 2 if args.scenario == "domain" else 10

    def logits(params, x, task):
        for w, b in params[:-1]:
            x = jax.nn.relu(x @ w + b)
        z = x @ params[-1][0] + params[-1][1]
        if args.scenario == "task":  # the task's two classes only (task identity given)
            task = jnp.asarray(task)  # a scalar, or one per example (the memory's)
            z = jnp.where((jnp.arange(10) // 2) == (task[:, None] if task.ndim else task), z, -1e9)
        return z

    def target(y):
        return y % 2 if args.scenario == "domain" else y

    def loss(params, x, y, task):
        logp = jax.nn.log_softmax(logits(params, x, task))
        return -jnp.mean(jnp.take_along_axis(logp, target(y)[:, None], axis=1))

    @jax.jit
    def accuracy(params, x, y, task):
        return jnp.mean(jnp.argmax(logits(params, x, task), -1) == target(y))

    def batches(key, n):
        per = n // BATCH
        return jnp.concatenate([jax.random.permutation(k, n)[: per * BATCH].reshape(per, BATCH)
                                for k in jax.random.split(key, args.epochs)])

    algo = nb.ivon(0.1, ess=N_TRAIN, hess_init=1.0, beta2=0.999, weight_decay=1e-4, prior=True)
    # (name, optax transformation, posterior as the next prior, replay of the memory)
    runs = [("AdamW fine-tuning", optax.adamw(1e-3, weight_decay=1e-4), False, False),
            ("IVON, posterior as prior", nb.as_optax(algo), True, False)]
    if args.memory:
        runs += [("IVON, posterior as prior + replay", nb.as_optax(algo), True, True),
                 ("IVON + replay (no posterior prior)", nb.as_optax(algo), False, True)]
    k = args.memory
    # the memory: the first k training images of each task (they are shuffled: a random coreset), task-major
    mx = jnp.concatenate([xs[:k] for xs, _, _, _ in tasks])
    my = jnp.concatenate([ys[:k] for _, ys, _, _ in tasks])
    for name, tx, use_prior, replay in runs:
        bayes = name.startswith("IVON")

        @jax.jit
        def fit(params, opt_state, key, x, y, task, mx, my, n_mem, tx=tx, bayes=bayes, replay=replay):
            ix = batches(key, x.shape[0])
            jm = jax.random.randint(jax.random.fold_in(key, 1), ix.shape, 0, jnp.maximum(n_mem, 1))  # memory batches
            w = jnp.where(n_mem > 0, 1.0, 0.0)

            def body(carry, a):
                p, s = carry
                theta = nb.perturbed(algo, p, s) if bayes else p  # IVON: the gradient at a weight draw
                g = jax.grad(loss)(theta, x[a[0]], y[a[0]], task)
                if replay:  # the mean of the new batch's and a memory batch's loss (w = 0 for task 1: no memory)
                    g_mem = jax.grad(loss)(theta, mx[a[1]], my[a[1]], my[a[1]] // 2)
                    g = jax.tree.map(lambda u, v: (u + w * v) / (1 + w), g, g_mem)
                updates, s = tx.update(g, s, p)
                return (optax.apply_updates(p, updates), s), None

            return jax.lax.scan(body, (params, opt_state), (ix, jm))[0]

        params = init_mlp(jax.random.key(args.seed), (64, 100, 100, n_out))
        opt_state = tx.init(params)
        print(f"\n{name} ({args.scenario}-incremental): test accuracy (%) on each task after training task t")
        print("after " + "".join(f"  {a}/{b}" for a, b in TASKS) + "   average so far")
        for t, (x, y, _, _) in enumerate(tasks):
            if t and use_prior:  # IVON: the posterior of task t-1 (mean params, precision in opt_state) is the prior
                opt_state = tx.init(params, prior=opt_state.as_prior(params))
            elif t and not bayes:  # AdamW starts each task from the previous weights with fresh moments
                opt_state = tx.init(params)
            # (IVON without the prior carries its state over as it is)
            params, opt_state = fit(params, opt_state, jax.random.key(100 * args.seed + t), x, y, jnp.int32(t),
                                    mx, my, jnp.int32(k * t))  # the memory of tasks 1..t-1: its first k*t entries
            accs = [100 * float(accuracy(params, xt, yt, jnp.int32(s))) for s, (_, _, xt, yt) in enumerate(tasks[: t + 1])]
            print(f"{t + 1:>5}" + "".join(f"{a:6.1f}" for a in accs) + " " * 6 * (4 - t) + f"{np.mean(accs):14.1f}")


if __name__ == "__main__":
    main()
