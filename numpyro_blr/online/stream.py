r"""A stream of batches, each fitted from the last one's posterior: :class:`Stream`.

Batch :math:`t` is fitted with the posterior of batch :math:`t-1` as its prior (:mod:`~numpyro_blr.online.prior`):
with ``nb.BLR`` (or any NumPyro optimizer) on a Gaussian guide, with :func:`numpyro_blr.infer.vmp` (exact
conjugate updates, :math:`\rho = 1`) for a conjugate model. The model and the guide are built once and the prior
is an argument of the compiled fit, so a second batch of the same size runs the compiled program again (one
program per batch size; the first batch, with the model's own prior, is one more).

Each batch's **projection error** is measured: :math:`q_t` is a Gaussian (or exponential-family) fit of
:math:`p_t(\theta) \propto p(y_t\mid\theta)\,q_{t-1}(\theta)`, and with draws :math:`\theta_s \sim q_t` and log
ratios :math:`r_s = \log p(y_t, \theta_s) + \log q_{t-1}(\theta_s) - \log q_t(\theta_s)`,

.. math::
    \widehat{\mathrm{KL}}(q_t \,\|\, p_t) = \log \tfrac1S \textstyle\sum_s e^{r_s} - \tfrac1S \sum_s r_s

(nats; 0 when :math:`q_t` is exact) and the Pareto :math:`\hat k` of the ratios (Yao et al. 2018) say how much
each step loses; the errors add up over the stream. :attr:`Stream.reports` keeps them, and a batch whose
:math:`\hat k` is above 0.7 warns.
"""

import copy
import warnings
from typing import NamedTuple

import jax
import numpy as np

from numpyro_blr.online.prior import PriorError, as_prior, run_with_prior

__all__ = ["BatchReport", "Stream"]

#: the keyword argument that carries the prior into the stream's model (reserved)
PRIOR_KWARG = "_blr_online_prior"
UNRELIABLE_K = 0.7


class BatchReport(NamedTuple):
    r"""What one :meth:`Stream.update` did.

    ``batch``            its index (0, 1, ...);
    ``method``           ``"svi"`` (a guide fitted by SVI) or ``"conjugate"`` (:func:`numpyro_blr.infer.vmp`);
    ``elbo``             the ELBO of the batch's fit (SVI: minus the mean loss of the last 10% of steps; conjugate:
                         exact), i.e. :math:`\log p(y_t \mid y_{1:t-1})` up to the projection error;
    ``projection_gap``   :math:`\widehat{\mathrm{KL}}(q_t\,\|\,p_t)` in nats (module docstring); ``nan`` where not
                         measured (``check=False``, the conjugate method);
    ``khat``             the Pareto :math:`\hat k` of the same ratios (``nan`` where not measured);
    ``converged``        the conjugate method's convergence flag; ``None`` for SVI (see ``nb.fit_report``).
    """

    batch: int
    method: str
    elbo: float
    projection_gap: float
    khat: float
    converged: object = None

    def __str__(self):
        gap = "not measured" if np.isnan(self.projection_gap) else f"{self.projection_gap:.3g} nats"
        k = "" if np.isnan(self.khat) else f", k-hat {self.khat:.2f}"
        return f"batch {self.batch} ({self.method}): ELBO {self.elbo:.4g}, projection error {gap}{k}"


class Stream:
    r"""Bayes on a stream: each :meth:`update` fits one batch with the previous posterior as the prior.

    :param model: a NumPyro model; :meth:`update` gets its arguments for one batch.
    :param guide: how each batch's posterior is fitted:

        * an autoguide class or a factory ``model -> guide`` (default
          ``numpyro.infer.autoguide.AutoMultivariateNormal``; ``AutoNormal``, ``AutoDiagonalNormal``,
          ``AutoLowRankMultivariateNormal``, ``nb.ExpFamilyGuide``, ``functools.partial(AutoNormal, init_scale=0.05)``),
          built once on the stream's model;
        * a guide built on ``model`` (it is copied onto the stream's model);
        * ``"conjugate"``: exact conjugate updates / VMP sweeps (:func:`numpyro_blr.infer.vmp`; :math:`\rho = 1`:
          exact Bayes when the model has one conjugate block).
    :param optim: the SVI optimizer (default ``nb.BLR()``); not used by ``"conjugate"``.
    :param num_steps: SVI steps per batch (default 500), or the most VMP sweeps per batch (default 100).
    :param prior: the prior of the first batch (anything :func:`~numpyro_blr.online.as_prior` reads); default the
        model's own.
    :param check: measure each batch's projection error (importance sampling, ``num_check_samples`` draws; an SVI
        guide only). Default True.
    :param rng_key: a ``jax.random`` key; batch ``t`` uses ``fold_in(rng_key, t)``.
    :param fit_kwargs: passed to :func:`numpyro_blr.fit` (``loss``, ``compile_effort``, ``stable_update``) or to
        ``vmp(...).run`` (``tol``).

    After :meth:`update`, :attr:`prior` is the posterior of all batches so far (the next batch's prior),
    :attr:`result` the last fit's result, :attr:`reports` one :class:`BatchReport` per batch.
    """

    def __init__(self, model, guide=None, *, optim=None, num_steps=None, prior=None, check=True,
                 num_check_samples=2000, rng_key=None, **fit_kwargs):
        if not callable(model):
            raise TypeError(f"model must be a NumPyro model (a callable), got {type(model).__name__}.")
        self.model = model
        self.check = bool(check)
        if isinstance(num_check_samples, bool) or not isinstance(num_check_samples, int) or num_check_samples < 10:
            raise ValueError(f"num_check_samples must be an int >= 10, got {num_check_samples!r}.")
        self.num_check_samples = num_check_samples
        self.rng_key = jax.random.PRNGKey(0) if rng_key is None else rng_key
        self.fit_kwargs = fit_kwargs
        self.prior = None if prior is None else as_prior(prior)
        self.reports = []
        self.result = None
        self._ratio_programs = {}

        def stream_model(*args, **kwargs):
            prior_now = kwargs.pop(PRIOR_KWARG, None)
            return run_with_prior(model, prior_now, args, kwargs)

        stream_model.__name__ = f"{getattr(model, '__name__', 'model')}_stream"
        self._model = stream_model
        if isinstance(guide, str):
            if guide != "conjugate":
                raise ValueError(f"guide must be a guide, a guide class or factory, or 'conjugate'; got {guide!r}.")
            if optim is not None:
                raise ValueError("optim is not used with guide='conjugate' (exact conjugate updates / VMP sweeps).")
            self.method = "conjugate"
            self.guide = None
            self.num_steps = 100 if num_steps is None else num_steps
        else:
            from numpyro_blr.optim import BLR

            self.method = "svi"
            self.guide = self._build_guide(guide)
            self.optim = BLR() if optim is None else optim
            self.num_steps = 500 if num_steps is None else num_steps
        if isinstance(self.num_steps, bool) or not isinstance(self.num_steps, int) or self.num_steps < 1:
            raise ValueError(f"num_steps must be a positive int, got {self.num_steps!r}.")

    def _build_guide(self, guide):
        from numpyro.infer.autoguide import AutoGuide, AutoMultivariateNormal

        from numpyro_blr.guides import ExpFamilyGuide

        if guide is None:
            return AutoMultivariateNormal(self._model)
        if isinstance(guide, (AutoGuide, ExpFamilyGuide)):
            if guide.model is not self.model:
                raise PriorError(f"the guide was built on {getattr(guide.model, '__name__', guide.model)!r}, not on "
                                 f"this stream's model {getattr(self.model, '__name__', self.model)!r}: build it on the "
                                 "same model, or pass its class (Stream(model, AutoNormal)).")
            clone = copy.copy(guide)  # the same options, set up again on the stream's model
            clone.model = self._model
            if isinstance(clone, ExpFamilyGuide):
                clone.sites = None
            else:
                clone.prototype_trace = None
            return clone
        if isinstance(guide, type) or callable(guide):
            built = guide(self._model)
            if not callable(built):
                raise TypeError(f"guide({getattr(self.model, '__name__', 'model')}) returned a "
                                f"{type(built).__name__}, not a guide.")
            return built
        raise TypeError(f"guide must be a guide class or factory (model -> guide), a guide built on the model, or "
                        f"'conjugate'; got {type(guide).__name__}.")

    @property
    def num_batches(self):
        """How many batches have been fitted."""
        return len(self.reports)

    def update(self, *args, **kwargs):
        """Fit one batch (the model's ``*args, **kwargs``) from :attr:`prior`; returns the fit's result and sets
        :attr:`prior` to its posterior. NaN or inf in the batch is an error naming the argument."""
        if PRIOR_KWARG in kwargs:
            raise ValueError(f"{PRIOR_KWARG!r} is reserved for the stream's prior.")
        batch = len(self.reports)
        key = jax.random.fold_in(self.rng_key, batch)
        kw = dict(kwargs)
        if self.prior is not None:
            kw[PRIOR_KWARG] = self.prior
        if self.method == "conjugate":
            result, report = self._update_conjugate(batch, args, kw)
        else:
            result, report = self._update_svi(batch, key, args, kw)
        self.result = result
        self.reports.append(report)
        if not np.isnan(report.khat) and report.khat > UNRELIABLE_K:
            warnings.warn(
                f"Stream batch {batch}: the fitted posterior is far from this batch's posterior (k-hat "
                f"{report.khat:.2f} > {UNRELIABLE_K}, projection error {report.projection_gap:.3g} nats); the error "
                "carries into every later batch. A richer guide (AutoMultivariateNormal for a mean-field one) or "
                "larger batches (fewer projections, each of a posterior closer to a Gaussian) reduce it.",
                UserWarning, stacklevel=2)
        return result

    def _update_svi(self, batch, key, args, kw):
        from numpyro_blr.compile_once import fit

        fit_kwargs = dict(self.fit_kwargs)
        fit_kwargs.setdefault("progress_bar", False)
        result = fit(self._model, self.guide, *args, optim=self.optim, num_steps=self.num_steps, rng_key=key,
                     **fit_kwargs, **kw)
        self.prior = as_prior(self.guide, result.params)
        losses = np.asarray(result.losses)
        tail = losses[-max(1, len(losses) // 10):]
        elbo = -float(np.mean(tail[np.isfinite(tail)])) if np.any(np.isfinite(tail)) else float("nan")
        gap = khat = float("nan")
        if self.check:
            gap, khat = self._projection_error(jax.random.fold_in(key, 1), result.params, args, kw)
        return result, BatchReport(batch, "svi", elbo, gap, khat)

    def _projection_error(self, key, params, args, kw):
        """``(KL estimate, k-hat)`` of the batch's fit (module docstring), from ``num_check_samples`` draws of the
        guide; one compiled program per stream and batch shapes."""
        from numpyro_blr.compile_once import _split
        from numpyro_blr.diagnostics.psis import psis

        data, rebuild, signature = _split((params, args), kw)
        fn = self._ratio_programs.get(signature)
        if fn is None:
            fn = self._ratio_programs[signature] = jax.jit(_log_ratios(self._model, self.guide, rebuild))
        keys = jax.random.split(key, self.num_check_samples)
        r = np.asarray(fn(keys, data), dtype=np.float64)
        if not np.all(np.isfinite(r)):
            return float("inf"), float("inf")
        m = np.max(r)
        gap = float(m + np.log(np.mean(np.exp(r - m))) - np.mean(r))
        return max(gap, 0.0), float(psis(r, np.zeros_like(r)).khat)

    def _update_conjugate(self, batch, args, kw):
        from numpyro_blr.infer import vmp

        run_kwargs = {"tol": self.fit_kwargs.get("tol", None)}
        unknown = set(self.fit_kwargs) - {"tol"}
        if unknown:
            raise TypeError(f"Stream(guide='conjugate') takes fit option 'tol' only, got {sorted(unknown)}.")
        algo = vmp(self._model, *args, **kw)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)
            res = algo.run(algo.init(), num_steps=self.num_steps, progress_bar=False, **run_kwargs)
        if res.diverged:
            raise PriorError(f"Stream batch {batch}: the conjugate update diverged ({res.diverged}).")
        self.prior = as_prior(dict(res.posterior))
        return res, BatchReport(batch, "conjugate", float(res.elbo), float("nan"), float("nan"), bool(res.converged))

    def __repr__(self):
        return (f"Stream({getattr(self.model, '__name__', 'model')}, {self.method}, {self.num_batches} batches, "
                f"prior={self.prior!r})")


def _log_ratios(model, guide, rebuild):
    r"""``(keys, data) -> log r_s``: :math:`\log p(y, \theta_s) - \log q(\theta_s)` with :math:`\theta_s` drawn by
    the guide under ``keys[s]`` (both densities of the constrained values, as in the ELBO)."""
    from numpyro import handlers
    from numpyro.infer.util import log_density

    def ratios(keys, data):
        (params, args), kwargs = rebuild(data)

        def one(key):
            log_q, guide_trace = log_density(handlers.seed(guide, key), args, kwargs, params)
            log_p, _ = log_density(handlers.replay(model, guide_trace), args, kwargs, params)
            return log_p - log_q

        return jax.vmap(one)(keys)

    return ratios
