"""Model merging by uncertainty vs task arithmetic on digits (``examples/merge_models.py``), several seeds.

    python bench/bench_merge.py [--seeds 0 1 ... 9] [--no-short] [--no-joint] [--no-brief]

Setting (``examples/merge_models.py``): an MLP (64-64-10) trained with IVON on a pretraining split
(269 images, all classes) is the start :math:`\\theta_0` with posterior precision :math:`P_0`; five
tasks (classes {0,1}, ..., {8,9}, about 160 images each) are fine-tuned from it with IVON under the
prior :math:`\\mathcal N(\\theta_0, P_0^{-1})` (shared 10-way head). Accuracy on the union of the
tasks' test sets (450 images) of:

- ``start``, ``task models (mean)`` (each fine-tuned model alone, averaged over the five);
- ``plain average``: task arithmetic with :math:`\\alpha = 1/T`;
- ``task arithmetic, best alpha``: :math:`\\alpha` from {0.1, ..., 1.0} by accuracy on the validation split
  (270 images, all classes; the paper's baseline);
- ``merge (H0 = P0)``: :func:`numpyro_blr.online.merge.merge` with :math:`\\alpha_t = 1` (no tuning) and the
  start's posterior precision as :math:`H_0`;
- ``merge, best alpha``: the same with :math:`\\alpha_t = \\alpha` tuned like task arithmetic's;
- ``merge (H0 = 0)``: the precisions alone, Fisher-weighted averaging (what :math:`H_0` adds);
- ``joint (all data)``: IVON on the pretraining and all task images together, from scratch (what the
  merge approximates; not a merge);
- with ``--short`` off (default on): the plain average and the merge again after 30 instead of 100
  fine-tuning epochs, where IVON's precision is still mostly its initial value.

Prints every seed and mean ± sd over seeds. About 45 s on one core.
"""

import argparse
import os
import sys
import time

import jax
import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "examples"))
from merge_models import FT, PRE, PRE_BRIEF, accuracy, fit, init_mlp, load_data, start_and_tasks  # noqa: E402

from numpyro_blr.online.merge import merge, task_arithmetic  # noqa: E402

ALPHAS = np.round(np.linspace(0.1, 1.0, 10), 2)


def best_alpha(fn, data):
    """The alpha of ALPHAS with the highest validation accuracy of ``fn(alpha)`` (first on ties)."""
    val = [accuracy(fn(a), data["val"]) for a in ALPHAS]
    return float(ALPHAS[int(np.argmax(val))])


def run_seed(data, seed, short=True, joint=True, pre=PRE):
    theta0, p0, states = start_and_tasks(data, seed, FT, pre)
    sizes = [float(len(y)) for _, y in data["tasks"]]
    test = data["test"]
    row = {"start": accuracy(theta0, test),
           "task models (mean)": float(np.mean([accuracy(s.params, test) for s in states])),
           "plain average": accuracy(task_arithmetic(theta0, states), test)}
    a_ta = best_alpha(lambda a: task_arithmetic(theta0, states, a), data)
    row["task arithmetic, best alpha"] = accuracy(task_arithmetic(theta0, states, a_ta), test)
    merged = lambda a: merge(theta0, states, ess=sizes, prior_precision=p0, alphas=a)  # noqa: E731
    row["merge (H0 = P0)"] = accuracy(merged(1.0), test)
    a_m = best_alpha(merged, data)
    row["merge, best alpha"] = accuracy(merged(a_m), test)
    row["merge (H0 = 0)"] = accuracy(merge(theta0, states, ess=sizes, prior_precision=0.0), test)
    if joint:
        rng, key = np.random.default_rng(seed), jax.random.key(seed)
        row["joint (all data)"] = accuracy(fit(init_mlp(key), data["all"], dict(PRE, epochs=40), rng, jax.random.fold_in(key, 2)).params, test)
    if short:
        theta0, p0, states = start_and_tasks(data, seed, dict(FT, epochs=30), pre)
        row["30 epochs: plain average"] = accuracy(task_arithmetic(theta0, states), test)
        row["30 epochs: merge (H0 = P0)"] = accuracy(merge(theta0, states, ess=sizes, prior_precision=p0), test)
    return row, a_ta, a_m


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--seeds", type=int, nargs="+", default=list(range(10)))
    ap.add_argument("--no-short", action="store_true", help="skip the 30-epoch fine-tuning rows")
    ap.add_argument("--no-joint", action="store_true", help="skip the model trained on all data")
    ap.add_argument("--no-brief", action="store_true", help="skip the briefly trained start")
    args = ap.parse_args()
    t0 = time.perf_counter()
    data = load_data()
    print(f"digits: pretrain {len(data['pretrain'][1])}, tasks {[len(y) for _, y in data['tasks']]} "
          f"(classes {{0,1}},...,{{8,9}}), validation {len(data['val'][1])}, test {len(data['test'][1])}; "
          f"accuracy on the union of the tasks' test sets")
    joint = {}
    for label, pre in (("start: 100 epochs at lr 0.1", PRE), ("brief start: 40 epochs at lr 0.5", PRE_BRIEF)):
        if label.startswith("brief") and args.no_brief:
            continue
        rows, alphas = [], []
        for s in args.seeds:
            row, a_ta, a_m = run_seed(data, s, not args.no_short, not args.no_joint and s not in joint, pre)
            if "joint (all data)" in row:
                joint[s] = row.pop("joint (all data)")
            rows.append(row)
            alphas.append((a_ta, a_m))
        print(f"\n{label}")
        print(f"{'model':<30}" + "".join(f"{'seed ' + str(s):>7}" for s in args.seeds) + f"{'mean ± sd':>16}")
        for k in rows[0]:
            v = np.array([r[k] for r in rows])
            print(f"{k:<30}" + "".join(f"{x:7.3f}" for x in v) + f"{v.mean():10.3f} ± {v.std(ddof=1):.3f}")
        print("alpha chosen on validation (task arithmetic, merge): "
              + ", ".join(f"({a:.1f}, {b:.1f})" for a, b in alphas))
        d = np.array([r["merge (H0 = P0)"] - r["plain average"] for r in rows])
        print(f"merge - plain average: {d.mean():+.3f} ± {d.std(ddof=1):.3f} (sd over seeds; s.e. "
              f"{d.std(ddof=1) / np.sqrt(len(d)):.3f}), higher in {int((d > 0).sum())}, lower in {int((d < 0).sum())} "
              f"of {len(d)} seeds")
        d = np.array([r["merge (H0 = P0)"] - r["task arithmetic, best alpha"] for r in rows])
        print(f"merge (alpha 1, untuned) - task arithmetic (best alpha): {d.mean():+.3f} ± {d.std(ddof=1):.3f}")
    if joint:
        v = np.array(list(joint.values()))
        print(f"\njoint (IVON on all {len(data['all'][1])} pretraining and task images, 40 epochs at lr 0.1, "
              f"what the merge approximates): " + " ".join(f"{x:.3f}" for x in v) + f"  {v.mean():.3f} ± {v.std(ddof=1):.3f}")
    print(f"total time {time.perf_counter() - t0:.1f}s")
