r"""Plots for the workflow, saved as PNG files (matplotlib's Agg backend: no display needed).

* :func:`plot_loss`: the loss per SVI step of one or several fits (``fit_history``);
* :func:`plot_forest`: means and central intervals of several fits side by side (BLR vs Adam vs
  NUTS...), plain matplotlib;
* :func:`plot_khat`: pointwise LOO Pareto :math:`\hat k` (``arviz_plots.plot_khat``) or the fit
  :math:`\hat k` of several fits (Yao et al. 2018) against the 0.5 and 0.7 thresholds;
* :func:`plot_ppc`: posterior predictive check (``arviz_plots.plot_ppc_dist``);
* :func:`plot_sensitivity`: memory-perturbation sensitivities (Nickl et al. 2023).

Every function takes the output ``path``, creates its directory, writes the PNG and returns the path.
"""

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402

__all__ = ["plot_forest", "plot_khat", "plot_loss", "plot_ppc", "plot_sensitivity"]


def _prepare(path):
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    return path


def _save(fig, path):
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _save_pc(pc, path, dpi=110):
    try:
        pc.savefig(str(path), dpi=dpi)
    except Exception:  # noqa: BLE001 - older/newer PlotCollection APIs
        plt.gcf().savefig(path, dpi=dpi)
    plt.close("all")
    return path


def _losses(item):
    if hasattr(item, "children"):  # a DataTree from to_datatree(..., losses=...)
        if "fit_history" not in item.children:
            raise ValueError("the DataTree has no fit_history group: pass losses=svi_result.losses to to_datatree.")
        return np.asarray(item["fit_history"].ds["loss"].values)
    return np.asarray(item, dtype=float).reshape(-1)


def plot_loss(fits, path, log_scale=None, title="SVI loss (negative ELBO estimate) per step"):
    """Loss trace per step. ``fits``: ``{name: DataTree or losses array}`` (or one of them)."""
    path = _prepare(path)
    if not isinstance(fits, dict):
        fits = {"fit": fits}
    fig, ax = plt.subplots(figsize=(7, 4))
    lows = []
    for name, item in fits.items():
        loss = _losses(item)
        ax.plot(np.arange(1, loss.size + 1), loss, lw=1, label=name)
        lows.append(np.nanmin(loss))
    if log_scale is None:
        log_scale = len(fits) > 0 and all(v > 0 for v in lows)
    if log_scale:
        ax.set_xscale("log")
    ax.set_xlabel("step")
    ax.set_ylabel("loss")
    ax.set_title(title)
    ax.legend()
    return _save(fig, path)


def plot_forest(trees, path, var_names=None, prob=0.94, title=None):
    """Posterior means and central ``prob`` intervals of several fits, one row per scalar element.

    ``trees`` is ``{name: DataTree}`` (e.g. BLR, Adam, NUTS), each with a ``posterior`` group with
    ``chain``/``draw`` dims; the fits are drawn side by side (offset rows, one colour per fit).
    Element labels come from the first tree's coordinates.
    """
    import itertools

    path = _prepare(path)
    names = list(trees)
    first = trees[names[0]]["posterior"].ds
    var_names = list(first.data_vars) if var_names is None else list(var_names)
    lo_q, hi_q = (1 - prob) / 2, 1 - (1 - prob) / 2
    labels, stats = [], {n: [] for n in names}
    for v in var_names:
        ref = first[v]
        extra = [d for d in ref.dims if d not in ("chain", "draw")]
        coords = [list(np.asarray(ref[d].values)) if d in ref.coords else list(range(ref.sizes[d])) for d in extra]
        labels += [v + ("[" + ", ".join(str(c) for c in idx) + "]" if idx else "") for idx in itertools.product(*coords)]
        for n in names:
            if v not in trees[n]["posterior"].ds:
                raise ValueError(f"plot_forest: the fit {n!r} has no posterior variable {v!r}.")
            x = np.asarray(trees[n]["posterior"].ds[v].transpose("chain", "draw", *extra).values)
            x = x.reshape(-1, int(np.prod(x.shape[2:], dtype=int)))
            stats[n].append(np.stack([x.mean(0), np.quantile(x, lo_q, axis=0), np.quantile(x, hi_q, axis=0)], -1))
    rows = len(labels)
    fig, ax = plt.subplots(figsize=(7, 1.2 + 0.35 * rows * max(1, len(names)) ** 0.5))
    height = 0.7 / len(names)
    for k, n in enumerate(names):
        st = np.concatenate(stats[n], 0)
        y = np.arange(rows)[::-1] + 0.35 - (k + 0.5) * height
        ax.hlines(y, st[:, 1], st[:, 2], color=f"C{k}", lw=2, label=n)
        ax.plot(st[:, 0], y, "o", color=f"C{k}", ms=4)
    ax.set_yticks(np.arange(rows)[::-1])
    ax.set_yticklabels(labels)
    ax.set_xlabel(f"posterior mean and central {int(round(100 * prob))}% interval")
    ax.grid(axis="x", alpha=0.3)
    ax.legend(loc="best", fontsize="small")
    ax.set_title(title or "Forest plot")
    return _save(fig, path)


def plot_khat(khat, path, title=None):
    r"""Pareto :math:`\hat k` against the thresholds 0.5 (good) and 0.7 (unreliable above).

    ``khat`` is an ``ELPDData`` from ``az.loo(..., pointwise=True)`` / :func:`loo_vi` (pointwise
    LOO :math:`\hat k`, drawn by ``arviz_plots.plot_khat``), or ``{fit name: k-hat}`` for the fit
    diagnostic of Yao et al. (2018) of several fits (a bar chart).
    """
    path = _prepare(path)
    if hasattr(khat, "pareto_k"):
        if khat.pareto_k is None:
            raise ValueError("the ELPDData has no pointwise pareto_k: compute it with pointwise=True.")
        from arviz_plots import plot_khat as _plot_khat

        pc = _plot_khat(khat, backend="matplotlib")
        return _save_pc(pc, path)
    names = list(khat)
    values = np.array([float(getattr(khat[n], "khat", khat[n])) for n in names])
    colors = ["tab:green" if k < 0.5 else "tab:orange" if k <= 0.7 else "tab:red" for k in values]
    fig, ax = plt.subplots(figsize=(1.4 * len(names) + 2.5, 3.5))
    shown = np.where(np.isfinite(values), values, 0.0)
    ax.bar(names, shown, color=colors)
    for x, k in enumerate(values):
        ax.text(x, max(shown[x], 0) + 0.02, f"{k:.2f}", ha="center", va="bottom")
    ax.axhline(0.5, color="k", ls=":", lw=1)
    ax.axhline(0.7, color="k", ls="--", lw=1)
    ax.set_ylabel(r"Pareto $\hat k$")
    ax.set_title(title or r"Is the fit trustworthy? ($\hat k$ < 0.5 good, > 0.7 unreliable)", fontsize=10)
    return _save(fig, path)


def plot_ppc(tree, path, var_names=None, num_samples=100, **kwargs):
    """Posterior (or prior) predictive check with ``arviz_plots.plot_ppc_dist``."""
    from arviz_plots import plot_ppc_dist

    path = _prepare(path)
    pc = plot_ppc_dist(tree, var_names=var_names, num_samples=num_samples, backend="matplotlib", **kwargs)
    return _save_pc(pc, path)


def plot_sensitivity(mp, path, true_shift=None, title="Memory perturbation (Nickl et al. 2023)"):
    """Left: per-example sensitivity :math:`\\Lambda_i v_i|e_i|`; right: estimated vs true LOO shifts if given."""
    path = _prepare(path)
    ncols = 2 if true_shift is not None else 1
    fig, axes = plt.subplots(1, ncols, figsize=(5 * ncols, 3.8), squeeze=False)
    ax = axes[0, 0]
    ax.scatter(np.abs(mp.residual), mp.variance, c=mp.sensitivity, s=12, cmap="viridis")
    ax.set_xlabel(r"prediction error $|e_i|$")
    ax.set_ylabel(r"prediction variance $v_i$")
    ax.set_title("sensitivity (colour)")
    if true_shift is not None:
        ax = axes[0, 1]
        ax.scatter(true_shift, mp.loo_shift, s=12)
        lim = [min(np.min(true_shift), np.min(mp.loo_shift)), max(np.max(true_shift), np.max(mp.loo_shift))]
        ax.plot(lim, lim, "k:", lw=1)
        r = np.corrcoef(true_shift, mp.loo_shift)[0, 1]
        ax.set_xlabel("refit: $f_i^{\\setminus i} - f_i$")
        ax.set_ylabel("estimate: $v_i e_i$")
        ax.set_title(f"leave-one-out shifts (r = {r:.3f})")
    fig.suptitle(title, fontsize=10)
    return _save(fig, path)
