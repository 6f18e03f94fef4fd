r"""The one adapter from a BLR algorithm over a guide's parameters to NumPyro's optimizer protocol.

``SVI(model, guide, optimizer, Trace_ELBO())`` hands its optimizer the guide's *unconstrained*
parameters and, at each step, the ELBO loss ``fn(params) -> (loss, aux)`` with the step's random
key fixed. :class:`GuideOptimizer` is a ``numpyro.optim._NumPyroOptim`` that does, for every
algorithm (``nb.BLR``, ``nb.IVON`` and what follows), what does not depend on the algorithm:

* reads the guide's blocks (:mod:`numpyro_blr.layout` for autoguides and ``nb.ExpFamilyGuide``,
  :mod:`numpyro_blr.guide_trace` for hand-written guides, traced once per parameter structure);
* updates every parameter outside the algorithm's blocks with a ``fallback`` optax optimizer (or
  passes ``numpyro.contrib.module``'s unread ``"{name}$params"`` placeholders through, or raises
  naming the parameters);
* skips a step whose loss, gradients or update are not finite (a select, not a branch: a
  conditional inside ``SVI.run``'s scan costs as much as a small model's whole step on CPU),
  records which parameters were at fault, and follows NumPyro's ``stable_update`` convention;
* refuses another optimizer's state with what to do instead (another algorithm's, or one made by
  the same algorithm with options that keep other arrays), and reports at the end of a run
  (``get_params`` outside ``jit``) what the algorithm found wrong, each problem once per run;
* checks the data before the first step (:func:`install_svi_checks`: ``svi.init`` with one of these
  optimizers runs :func:`numpyro_blr.compile_once.check_data` on the concrete arguments, host side,
  once per ``svi.init``; nothing is added to the step).

The algorithm is a :class:`GuideAlgorithm`: ``init(params, layout) -> (params, state)``,
``step(fn, params, state, layout, step, forward_mode) -> GuideStep`` (the proposed parameters of
its blocks, its proposed state and the arrays that must be finite), ``commit(old, new, ok) ->
state`` (what to keep once the adapter knows whether the step was finite) and ``report(state,
optimizer) -> [(key, message)]``; an algorithm with a guide of its own (parameters no autoguide
has) also gives ``read_layout(params, optimizer) -> Layout``.
"""

import copy
import functools
import os
import warnings
from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from numpyro.optim import _NumPyroOptim

from numpyro_blr.core import select
from numpyro_blr.guide_trace import (
    PLACEHOLDER_SUFFIX,
    fallback_transformation,
    check_foreign_state,
    check_loss,
    guide_call_args,
    is_autoguide,
    passthrough_params,
    trace_layout,
)
from numpyro_blr.parallel import check_guide_memory
from numpyro_blr.layout import GuideLayoutError, read_layout, site_segments


class GuideState(NamedTuple):
    """The adapter's state: fixed-shape arrays only, so ``SVI.run`` can ``lax.scan`` and resume exactly.

    ``params``     the guide's unconstrained parameters (what ``get_params`` returns);
    ``algorithm``  the algorithm's own state over the guide's blocks;
    ``fallback``   the fallback optax optimizer's state (``()`` without one);
    ``nonfinite``  per parameter, whether a non-finite gradient or update was ever met;
    ``skipped``    how many steps were skipped for that reason (int32).
    """

    params: dict
    algorithm: Any
    fallback: Any
    nonfinite: dict
    skipped: jax.Array


class GuideStep(NamedTuple):
    """What an algorithm's ``step`` proposes: ``loss``, ``aux`` (SVI's mutable state), ``grads`` (the
    loss's gradients w.r.t. every parameter, for the fallback), ``params`` (all parameters, its blocks
    updated), ``state`` (its proposal, read only by its own ``commit`` within the same trace: the
    proposed state, or a function of whether the step is kept when part of its bookkeeping records
    skipped steps too, as ``nb.BLR``'s fit trace does) and ``checked`` (parameter name -> arrays that
    must be finite for that parameter's update to be kept)."""

    loss: Any
    aux: Any
    grads: dict
    params: dict
    state: Any
    checked: dict


class GuideAlgorithm(NamedTuple):
    """An algorithm over a guide's blocks, as the adapter drives it (module docstring)."""

    name: str
    init: Callable
    step: Callable
    commit: Callable
    report: Callable = lambda state, optimizer: []
    check_layout: Callable = lambda layout, params, prefix: None
    read_layout: Any = None  # read_layout(params, optimizer) -> Layout, for guides of the algorithm's own
    result: Any = None  # result(state, params) -> the parameters get_params returns (e.g. an average of iterates)


class GuideOptimizer(_NumPyroOptim):
    """The one SVI adapter; ``nb.BLR`` and ``nb.IVON`` are this class with their algorithm.

    :param algorithm: a :class:`GuideAlgorithm`.
    :param fallback: an ``optax.GradientTransformation`` (or a NumPyro optimizer) for parameters
        outside the algorithm's blocks (pytree-valued ones included).
    :param guide, guide_args, guide_kwargs: the guide, to read an autoguide's prefix and scale
        constraints, or a hand-written guide to trace (with the arguments given to ``svi.run``).
    :param prefix: the autoguide prefix (default ``"auto"``, or the guide's).
    """

    #: what a fit sets on the optimizer while it starts (``check_data`` at ``svi.init``), which the end-of-run report
    #: reads: :func:`nb.fit <numpyro_blr.compile_once.fit>` copies it from the optimizer of the compiled program it
    #: reused (another object of the same configuration) to the one it was given
    RUN_STATE = ("data_size",)

    # whether the algorithm reads the sites packed into one vector (site_segments: nb.BLR's probes); the others are
    # not rebound to an AutoDiagonalNormal they are used with (what they record at init stays on the user's object)
    reads_packed_sites = False

    def __init__(self, algorithm, *, fallback=None, guide=None, guide_args=None, guide_kwargs=None, prefix=None):
        self.algorithm = algorithm
        self.fallback = fallback_transformation(fallback)
        self.guide = guide
        # a hand-written guide is read by tracing it (numpyro_blr.guide_trace), with these arguments
        self.traced = guide is not None and not is_autoguide(guide)
        if self.traced and not callable(guide):
            raise ValueError(f"guide must be a NumPyro guide (a callable), got {type(guide).__name__}.")
        self.guide_args = guide_call_args(guide, guide_args, guide_kwargs) if self.traced else None
        self._traced_layouts = {}
        # an autoguide whose one vector packs several sites (AutoDiagonalNormal), to read their sizes (site_segments)
        self.packed_guide = guide if self.reads_packed_sites and _packs_sites(guide) else None
        self.prefix = prefix or getattr(guide, "prefix", None) or "auto"
        self.scale_constraint = getattr(guide, "scale_constraint", None)
        self.scale_tril_constraint = getattr(guide, "scale_tril_constraint", None)
        self.update_with_value = False
        self._state_shapes = {}  # parameter structure -> the algorithm state's structure and shapes
        self.data_size = None  # observations the likelihood sums over, read by check_data at svi.init

    # -- the guide of the fit it runs in ----------------------------------------------------
    def bound_to(self, guide, args=(), kwargs=None):
        """This optimizer reading ``guide``, the guide of the fit it runs in (``svi.init``, :func:`nb.fit
        <numpyro_blr.compile_once.fit>` and the workflow pass theirs), so that ``SVI(model, guide, nb.BLR(), ...)``
        needs no ``guide=`` where the parameter names alone do not say what the guide is:

        * a hand-written guide: a copy that traces it with the fit's arguments, as
          ``nb.BLR(guide=guide, guide_args=args, guide_kwargs=kwargs)`` would;
        * an autoguide with another prefix than this optimizer's (``AutoNormal(model, prefix="q")``): a copy that
          reads that prefix and the guide's scale constraints, as ``nb.BLR(guide=guide)`` would.

        ``self`` otherwise: an optimizer given a guide keeps it, an algorithm that reads its own guides
        (``nb.LieGroupBLR``) needs none, and an autoguide with the default prefix is read by its parameter names.
        The copy's algorithm functions are bound to the copy (:meth:`_rebound`); the user's object is unchanged."""
        if guide is None or self.guide is not None or self.algorithm.read_layout is not None:
            return self
        if is_autoguide(guide):
            if getattr(guide, "prefix", self.prefix) == self.prefix:
                if not (self.reads_packed_sites and _packs_sites(guide)) or self.packed_guide is guide:
                    return self
                new = self._rebound()  # AutoDiagonalNormal: its sites' sizes in its one vector (site_segments)
                new.packed_guide = guide
                return new
            new = self._rebound()
            new.guide, new.prefix = guide, guide.prefix
            new.packed_guide = guide if self.reads_packed_sites and _packs_sites(guide) else None
            new.scale_constraint = getattr(guide, "scale_constraint", None)
            new.scale_tril_constraint = getattr(guide, "scale_tril_constraint", None)
            return new
        if not callable(guide):
            return self  # SVI raises on its own terms
        new = self._rebound()
        new.guide, new.traced = guide, True
        new.guide_args = (tuple(args), dict(kwargs or {}))
        return new

    def _rebound(self):
        """A shallow copy whose algorithm functions that were methods of ``self`` are the copy's (they read its
        options and guide), with its own copies of the caches of traced layouts and state shapes."""
        new = copy.copy(self)
        methods = {f: getattr(new, fn.__name__) for f, fn in self.algorithm._asdict().items()
                   if getattr(fn, "__self__", None) is self}
        new.algorithm = self.algorithm._replace(**methods)
        new._traced_layouts = dict(self._traced_layouts)
        new._state_shapes = dict(self._state_shapes)
        return new

    # -- the data, at svi.init -------------------------------------------------------------
    def check_data(self, model, args, kwargs):
        """Check the fit's data before it starts (:func:`numpyro_blr.compile_once.check_data`: NaN or inf that
        reaches the likelihood, arguments whose numbers of rows disagree, data that broadcast against an
        observed site into another shape), naming the argument and the rows; record :attr:`data_size`.
        Called by ``svi.init`` (:func:`install_svi_checks`), on concrete arrays only."""
        from numpyro_blr.compile_once import check_data

        model_trace = check_data(model, args, kwargs)
        if model_trace is not None:
            self.data_size = observation_count(model_trace)

    # -- structure -------------------------------------------------------------------------
    def layout(self, params):
        """The guide's blocks read from ``params`` (raises if they cannot be read)."""
        name = self.algorithm.name
        if self.algorithm.read_layout is not None:
            layout = self.algorithm.read_layout(params, self)
        elif self.traced:
            key = tuple(sorted((k, str(jax.tree.map(jnp.shape, v))) for k, v in params.items()))  # names, shapes
            if key not in self._traced_layouts:
                args, kwargs = self.guide_args
                # read off concrete stand-ins, also when the step is being traced (nb.fit traces init and steps
                # as one program): the guide's own constants must not become tracers
                with jax.ensure_compile_time_eval():
                    self._traced_layouts[key] = trace_layout(self.guide, params, args, kwargs, self.fallback)
            layout = self._traced_layouts[key]
        else:
            layout = read_layout(params, self.prefix, self.scale_constraint, self.scale_tril_constraint)
            if self.packed_guide is not None:
                layout = site_segments(layout, params, self.packed_guide, self.prefix)
        self.algorithm.check_layout(layout, params, self.prefix)
        if not layout.blocks and self.fallback is None:
            raise GuideLayoutError(
                f"{name} found no Gaussian in the parameters {sorted(params)}: it expects an autoguide's "
                f"'<site>_{self.prefix}_loc'/'<site>_{self.prefix}_scale', '{self.prefix}_loc'/"
                f"'{self.prefix}_scale_tril' or point-mass '{self.prefix}_loc' parameters. Use AutoNormal, "
                "AutoDiagonalNormal, AutoMultivariateNormal or AutoDelta, or pass guide=... if it uses another prefix "
                "(for positive, unit-interval, simplex or discrete latents use nb.ExpFamilyGuide). "
                f"If it is a hand-written guide used outside SVI and nb.fit (which hand theirs over), pass it: "
                f"{name}(guide=guide, guide_args=(...)) with the arguments you give svi.run, and {name} reads its "
                "Normal/MultivariateNormal sites by tracing it; "
                "pass fallback=optax.adam(1e-3) to fit a guide with no Gaussian."
            )
        unhandled = [k for k in layout.other if not k.endswith(PLACEHOLDER_SUFFIX)]
        if unhandled and self.fallback is None:
            raise GuideLayoutError(
                f"{name} cannot treat the parameter(s) {unhandled} as part of a Gaussian guide. "
                "Pass fallback=optax.adam(1e-3) (or another optax optimizer) to update them, or remove them"
                + (f"; if they belong to a hand-written guide, pass it: {name}(guide=guide, guide_args=(...))."
                   if self.guide is None else ".")
            )
        return layout

    def check_state(self, s, layout):
        """Raise, saying what the state is from and what to do, when ``s.algorithm`` is not a state this
        optimizer makes for these parameters: another algorithm's (``nb.IVON``'s state given to ``nb.BLR``),
        or one made by the same algorithm with options that keep other arrays (``nb.BLR()``'s state given
        to ``nb.BLR(hessian="reparam")``). The expected structure is traced once per parameter structure."""
        key = tuple(sorted((k, tuple(jnp.shape(v))) for k, v in s.params.items() if hasattr(v, "shape")))
        if key not in self._state_shapes:
            try:
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")
                    made = jax.eval_shape(lambda p: self.algorithm.init(dict(p), layout)[1], s.params)
            except Exception:  # noqa: BLE001 - an init that needs concrete values: the state is not compared
                made = None
            self._state_shapes[key] = made
        expected = self._state_shapes[key]
        if expected is None:
            return
        got_def, want_def = jax.tree.structure(s.algorithm), jax.tree.structure(expected)
        name = self.algorithm.name
        if type(s.algorithm) is not type(expected):
            what = f"{state_origin(s)}, where {name} keeps {_article(type(expected).__name__)}"
        else:
            differs = _state_difference(s.algorithm, expected)
            if differs is None and got_def == want_def:
                return
            what = f"{_ORIGINS.get(type(expected).__name__, name)} with other options: {differs}"
        raise TypeError(
            f"{name} was given the optimizer state of {what}. svi.run(..., init_state=...) "
            "continues a run only with the optimizer that made the state, configured the same way. Continue with that "
            f"optimizer, or start {name} from that run's parameters: svi.run(key, num_steps, *args, "
            "init_params=previous_result.params)."
        )

    # -- the _NumPyroOptim protocol --------------------------------------------------------
    def init(self, params):
        layout = self.layout(params)
        check_guide_memory(params, layout)  # numpyro_blr.parallel: D x D blocks that cannot fit raise here
        params, state = self.algorithm.init(dict(params), layout)
        other = {k: params[k] for k in layout.other}
        # constants from NumPy, placed once: jnp constructors compile a small program per new shape
        return jax.device_put(np.array(0, np.int32)), GuideState(
            params=params,
            algorithm=state,
            fallback=self.fallback.init(other) if self.fallback is not None else (),
            nonfinite={k: jax.device_put(np.array(False)) for k in params},
            skipped=jax.device_put(np.array(0, np.int32)),
        )

    def get_params(self, state):
        """The guide's unconstrained parameters. Outside ``jit`` (``SVI.run`` calls this once at the
        end of a run) it also warns about what the algorithm's report finds wrong, naming the
        parameters concerned and the change that fixes it. The messages carry the step count, so
        Python's warning registry shows each problem once per run however often this is called;
        nothing is stored here."""
        i, s = state
        check_foreign_state(s, GuideState, self.algorithm.name)
        self.warn(state, stacklevel=4)  # <- warn <- get_params <- SVI.get_params
        if self.algorithm.result is not None:
            return self.algorithm.result(s.algorithm, s.params)
        return s.params

    def warn(self, state, stacklevel=2):
        """Warn about what the algorithm's end-of-run report finds wrong (nothing under ``jit``)."""
        i, s = state
        check_foreign_state(s, GuideState, self.algorithm.name)
        if not isinstance(s.skipped, jax.core.Tracer) and int(i):
            for _, message in self.algorithm.report((i, s), self):
                warnings.warn(message, RuntimeWarning, stacklevel=stacklevel)

    def update(self, g, state, value=None):
        raise TypeError(
            f"{self.algorithm.name} needs the loss function, not only its gradient: use it through "
            "numpyro.infer.SVI (which calls eval_and_update), or call eval_and_update(loss_fn, state) yourself."
        )

    def eval_and_update(self, fn, state, forward_mode_differentiation=False):
        return self._step(fn, state, forward_mode_differentiation, stable=False)

    def eval_and_stable_update(self, fn, state, forward_mode_differentiation=False):
        return self._step(fn, state, forward_mode_differentiation, stable=True)

    def _step(self, fn, state, forward_mode, stable):
        i, s = state
        check_foreign_state(s, GuideState, self.algorithm.name)
        params = s.params
        layout = self.layout(params)
        self.check_state(s, layout)  # trace time (a structure comparison)
        check_loss(fn, params, layout, read_by_names=not self.traced)  # trace time only
        passthrough = passthrough_params(fn, params, layout.other, self.fallback, self.algorithm.name)
        out = self.algorithm.step(fn, params, s.algorithm, layout, i, forward_mode)
        new_params, checked = dict(out.params), dict(out.checked)

        new_fallback = s.fallback
        if layout.other and not passthrough:  # passthrough placeholders stay as they are
            other_g = {k: out.grads[k] for k in layout.other}
            updates, new_fallback = self.fallback.update(other_g, s.fallback, {k: params[k] for k in layout.other})
            for k in layout.other:  # a parameter may be a pytree (an Equinox module's weights)
                new_params[k] = optax.apply_updates(params[k], updates[k])
                checked[k] = tuple(jax.tree.leaves((out.grads[k], new_params[k])))

        loss_ok = jnp.isfinite(out.loss)
        finite = {k: _all_finite(arrays) for k, arrays in checked.items()}
        ok = loss_ok
        for f in finite.values():
            ok = ok & f
        kept = self.algorithm.commit(s.algorithm, out.state, ok)
        flags = {k: s.nonfinite[k] | ((~finite.get(k, loss_ok) | ~loss_ok) & ~ok) for k in params}
        new_state = GuideState(
            params=select(ok, new_params, params),
            algorithm=kept,
            fallback=select(ok, new_fallback, s.fallback),
            nonfinite=flags,
            skipped=s.skipped + jnp.where(ok, 0, 1).astype(jnp.int32),
        )
        if stable:  # as NumPyro's stable update: a bad step keeps the iteration count and returns NaN
            return (jnp.where(ok, out.loss, jnp.nan), out.aux), (jnp.where(ok, i + 1, i), new_state)
        return (out.loss, out.aux), (i + 1, new_state)


def _packs_sites(guide):
    """Whether ``guide`` is one of NumPyro's ``AutoContinuous`` guides with a diagonal covariance over its one vector
    (``AutoDiagonalNormal``), whose sites :func:`~numpyro_blr.layout.site_segments` reads."""
    from numpyro.infer.autoguide import AutoDiagonalNormal

    return isinstance(guide, AutoDiagonalNormal)


def _all_finite(arrays):
    """One reduction: ``x * 0`` is 0 for finite ``x`` and NaN for inf/NaN, so the sum is finite iff all are."""
    return jnp.isfinite(sum(jnp.sum(a * 0) for a in arrays))


def _state_difference(got, want):
    """The fields of two algorithm states of one type whose structure or shapes differ, in words (``None`` if none)."""
    fields = getattr(type(want), "_fields", None)
    pairs = [(f, getattr(got, f), getattr(want, f)) for f in fields] if fields else [("state", got, want)]
    out = []
    for field, a, b in pairs:
        if jax.tree.structure(a) != jax.tree.structure(b):
            out.append(f"{field} holds {sorted(a) if isinstance(a, dict) else jax.tree.structure(a)} where this "
                       f"configuration keeps {sorted(b) if isinstance(b, dict) else jax.tree.structure(b)}")
            continue
        shapes_a = [tuple(np.shape(x)) for x in jax.tree.leaves(a)]
        shapes_b = [tuple(x.shape) for x in jax.tree.leaves(b)]
        if shapes_a != shapes_b:
            diff = next((x, y) for x, y in zip(shapes_a, shapes_b) if x != y)
            out.append(f"{field} has shape {diff[0]} where this configuration keeps {diff[1]}")
    return "; ".join(out) if out else None


_ORIGINS = {"BLRState": "nb.BLR", "IVONSVIState": "nb.IVON"}


def _article(word):
    return ("an " if word[:1].upper() in "AEIOU" else "a ") + word


def state_origin(s):
    """Which optimizer made a :class:`GuideState` (by its algorithm state's type), in words."""
    kind = type(getattr(s, "algorithm", s)).__name__
    origin = _ORIGINS.get(kind)
    return f"{origin} ({_article(kind)})" if origin else f"another algorithm ({_article(kind)})"


def observation_count(model_trace):
    """How many observations the model's likelihood sums over: the largest, over its observed sites, of the
    product of the site's plate sizes (the full sizes of subsampled plates), or of its batch shape without
    plates, of its leading batch size. ``None`` without observed sites."""
    counts = []
    for site in model_trace.values():
        if site["type"] != "sample" or not site["is_observed"]:
            continue
        frames = [f for f in site.get("cond_indep_stack", ()) if f.size is not None]
        batch = tuple(site["fn"].batch_shape)
        counts.append(int(np.prod([f.size for f in frames])) if frames else (int(batch[0]) if batch else 1))
    return max(counts) if counts else None


def commit_if_finite(old, new, ok):
    """The ``commit`` of an algorithm whose proposal is its next state: ``new`` if the step was finite, else ``old``."""
    return select(ok, new, old)


def skipped_report(name, fix):
    """A ``report`` naming the steps ``name`` skipped as non-finite and the parameters at fault, then ``fix``."""

    def report(state, optimizer):
        i, s = state
        cause = _small_ess(optimizer)
        if not int(s.skipped):
            return [(("ess", int(i)), f"{name}: {cause} The fit may be far off without any step being skipped.")] if cause else []
        return [(("skipped", int(i)), f"{name} skipped {int(s.skipped)} of {int(i)} steps because of a non-finite loss, "
                 f"gradient or update, for parameter(s) {nonfinite_parameters(state)}; those steps kept the last finite values. "
                 f"{'The likely cause: ' + cause if cause else fix}")]

    return report


ESS_FRACTION = 0.1  # an ess below this fraction of the observations is reported as the likely cause


def _ess_of(optimizer):
    """The ``ess`` (sample size) an optimizer was built with (``nb.IVON``'s ``ess`` attribute), or ``None``."""
    ess = getattr(optimizer, "ess", None)
    try:
        return float(ess)
    except (TypeError, ValueError):
        return None


def _small_ess(optimizer):
    """The sentence naming ``ess`` as the cause of skipped steps, where it is implausibly small for the data
    (below ``ESS_FRACTION`` of the observations ``svi.init`` counted: :attr:`GuideOptimizer.data_size`)."""
    ess, n = _ess_of(optimizer), getattr(optimizer, "data_size", None)
    if ess is None or not n or ess >= ESS_FRACTION * n:
        return None
    return (f"ess={ess:g} is implausibly small: ess is the number of training examples, and the model's likelihood "
            f"sums over {n} observations. With a sample size that small IVON's per-example units are off by the "
            f"ratio (its initial scales 1/sqrt(ess*(hess_init+weight_decay)) far wider than the posterior). Pass ess={n}.")


def as_optax(algorithm, seed=0):
    """A row as an ``optax.GradientTransformationExtraArgs``: :func:`numpyro_blr.rules.diagonal.as_optax`
    (``tx = nb.as_optax(nb.ivon(lr, ess=n_train))``, with ``nb.perturbed`` for the weight draw). An SVI optimizer (``nb.BLR()``, ``nb.IVON(...)``) is
    refused with what to use instead: it updates a guide's parameters from the loss function itself, which
    an optax ``update(grads, state, params)`` does not receive."""
    from numpyro_blr.rules.diagonal import as_optax as row_as_optax

    if isinstance(algorithm, GuideOptimizer):
        name = algorithm.algorithm.name
        raise TypeError(
            f"as_optax takes one of the package's rows (nb.ivon(lr, ess=n_train), nb.vogn, nb.ogn, nb.adam_blr, "
            f"nb.rmsprop_blr, nb.sgd_blr, nb.lie_additive, ...), not {name}(): {name} is a NumPyro optimizer "
            "over a guide's parameters that needs the loss function, not only its gradient. Use it as "
            f"numpyro.infer.SVI(model, guide, {name}(...), Trace_ELBO()) or nb.fit(model, guide, ..., optim={name}(...)); "
            "for a Flax/Equinox training loop, use nb.as_optax(nb.ivon(lr, ess=n_train))."
        )
    return row_as_optax(algorithm, seed)




# -- the checks svi.init and svi.run make for these optimizers ------------------------------------
_RUN_OPTIONS = ("progress_bar", "stable_update", "forward_mode_differentiation", "init_params")


def install_svi_checks():
    """Wrap ``numpyro.infer.SVI.init`` and ``SVI.run`` (once; called on import) with checks that apply
    only where they concern this package's optimizers, host side and before the first step:

    * ``svi.init`` with a :class:`GuideOptimizer` checks the data (:meth:`GuideOptimizer.check_data`: NaN or
      inf in ``y`` or ``X``, numbers of rows that disagree, ``y`` of shape ``(N, 1)`` against a plate of ``N``),
      where NumPyro would stop with "Cannot find valid initial parameters", "invalid loc parameter" or
      "Incompatible shapes", or fit meaningless data with a plate warning;
    * ``svi.run(..., init_state=state)`` with the state of one of these optimizers and another optimizer
      (``numpyro.optim.Adam``) raises saying what the state is from and what to do (NumPyro's own
      optimizers fail inside with "too many values to unpack");
    * ``svi.run(..., init_state=state)`` on a new ``SVI`` object with one of these optimizers first learns
      the parameters' constraints with ``svi.init`` (NumPyro's ``SVI`` learns them only there, and its
      loss fails with "'NoneType' object is not callable" without them); the state given is the one continued.
      On the ``SVI`` object that made the state, the continued run's data are checked as ``svi.init`` checks them.

    Arguments that are tracers (``svi.run`` inside ``jit``, ``nb.fit``'s program) are not checked here:
    ``nb.fit`` checks its concrete data before entering its program.
    """
    from numpyro.infer import svi as numpyro_svi

    cls = numpyro_svi.SVI
    if getattr(cls.init, "_numpyro_blr_checks", False):
        return
    init, run = cls.init, cls.run

    @functools.wraps(init)
    def checked_init(self, rng_key, *args, init_params=None, **kwargs):
        if isinstance(self.optim, GuideOptimizer):
            if getattr(self, "reads_its_guide", True):  # nb.fit's programs bind their optimizer beforehand
                # a hand-written guide (or another prefix) read from this SVI's guide: no nb.BLR(guide=...) needed
                self.optim = self.optim.bound_to(self.guide, args, {**kwargs, **self.static_kwargs})
            self.optim.check_data(self.model, args, {**kwargs, **self.static_kwargs})
            if getattr(self, "reads_its_guide", True):  # not one of nb.fit's programs' (they trace this init)
                from numpyro_blr.compile_once import compiled_init

                state = compiled_init(self, rng_key, args, kwargs, init_params)
                if state is not None:
                    return state
        return init(self, rng_key, *args, init_params=init_params, **kwargs)

    @functools.wraps(run)
    def checked_run(self, rng_key, num_steps, *args, **kwargs):
        state = kwargs.get("init_state")
        if isinstance(self.optim, GuideOptimizer) and getattr(self, "reads_its_guide", True):
            # bound before the run, so that the rerun's decision (run_with_rerun) reads the guide too
            model_kwargs = {k: v for k, v in kwargs.items() if k not in _RUN_OPTIONS + ("init_state",)}
            self.optim = self.optim.bound_to(self.guide, args, {**model_kwargs, **self.static_kwargs})
        if state is not None:
            opt_state = getattr(state, "optim_state", None)
            inner = opt_state[1] if isinstance(opt_state, tuple) and len(opt_state) == 2 else None
            ours = isinstance(self.optim, GuideOptimizer)
            if isinstance(inner, GuideState) and not ours:
                raise TypeError(
                    f"svi.run(..., init_state=...) was given the optimizer state of {state_origin(inner)}, but this SVI's "
                    f"optimizer is {type(self.optim).__name__}: a run continues only with the optimizer that made its "
                    f"state. Continue with {_ORIGINS.get(type(inner.algorithm).__name__, 'that optimizer')}, or start "
                    "this one from that run's parameters: svi.run(key, num_steps, *args, init_params=previous_result.params)."
                )
            model_kwargs = {k: v for k, v in kwargs.items() if k not in _RUN_OPTIONS + ("init_state",)}
            if ours and self.constrain_fn is None and not _compiled_run_applies(self, kwargs):
                # a new SVI object: learn the constraints (its state is discarded; the compiled run sets them)
                self.init(rng_key, *args, **model_kwargs)  # the data are checked there
            elif ours:  # a continued run: its data, which may be new, are checked as svi.init checks them
                self.optim.check_data(self.model, args, {**model_kwargs, **self.static_kwargs})
        if _compiled_run_applies(self, kwargs):  # nb.fit's program: the start and the steps compiled once
            from numpyro_blr.compile_once import compiled_run

            model_kwargs = {k: v for k, v in kwargs.items() if k not in _RUN_OPTIONS + ("init_state",)}
            result = compiled_run(self, rng_key, num_steps, args, model_kwargs, kwargs.get("progress_bar", True),
                                  kwargs.get("stable_update", False), state)
            if result is not None:
                return result
            if state is not None and self.constrain_fn is None:  # NumPyro's run of a new SVI object: the constraints
                self.init(rng_key, *args, **model_kwargs)
        # nb.BLR()'s default may rerun the fit with averaged curvature draws (run_with_rerun)
        return run_with_rerun(self.optim, lambda optim: run(self if optim is self.optim else _rerun_svi(self, optim),
                                                             rng_key, num_steps, *args, **kwargs))

    def _compiled_run_applies(svi, kwargs):
        """Whether ``svi.run`` goes to :func:`~numpyro_blr.compile_once.compiled_run` (which may still decline):
        one of our optimizers, and none of ``svi.run``'s options that :func:`numpyro_blr.fit` does not take."""
        return (isinstance(svi.optim, GuideOptimizer) and getattr(svi, "reads_its_guide", True)
                and kwargs.get("init_params") is None and not kwargs.get("forward_mode_differentiation", False)
                and os.environ.get("NUMPYRO_BLR_EAGER_INIT", "") != "1")

    def _rerun_svi(svi, optim):
        """``svi`` with another optimizer (same model, guide, loss and static arguments; its constraints)."""
        other = copy.copy(svi)
        other.optim = optim
        return other

    checked_init._numpyro_blr_checks = True
    checked_run._numpyro_blr_checks = True
    cls.init, cls.run = checked_init, checked_run


install_svi_checks()


def run_with_rerun(optim, run):
    """``run(optim)`` (a fit that returns an ``SVIRunResult`` and gives its end-of-run warnings), run again with the
    optimizer ``optim.rerun_optimizer(state)`` proposes, if any (``nb.BLR()``'s default: a fit whose one-draw
    curvature was too noisy and whose report finds a problem, rerun from the same key and ``init_state`` with
    ``curvature_draws=8``); the rerun is kept where ``optim.keep_rerun`` says so, and only the kept fit's warnings
    are given (recorded, then re-emitted: the caller's filters apply). ``svi.run`` and ``nb.fit`` both use it."""
    rerun_with = getattr(optim, "rerun_optimizer", None)
    if rerun_with is None:
        return run(optim)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        result = run(optim)
    other = rerun_with(result.state.optim_state)
    if other is not None:
        with warnings.catch_warnings(record=True) as caught_again:
            warnings.simplefilter("always")
            again = run(other)
        if optim.keep_rerun((result.state.optim_state, result.losses), (again.state.optim_state, again.losses)):
            result, caught = again, caught_again
    for w in caught:
        warnings.warn_explicit(w.message, w.category, w.filename, w.lineno, source=w.source)
    return result


def nonfinite_parameters(state):
    """Names of the parameters whose gradient or update was ever non-finite in a run.

    ``state`` is an ``SVIState`` (``svi_result.state``) or the optimizer's state.
    """
    opt_state = getattr(state, "optim_state", state)
    return sorted(k for k, v in opt_state[1].nonfinite.items() if bool(v))
