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
* refuses another optimizer's state with what to do instead, and reports at the end of a run
  (``get_params`` outside ``jit``) what the algorithm found wrong, each problem once per run.

The algorithm is a :class:`GuideAlgorithm`: ``init(params, layout) -> (params, state)``,
``step(fn, params, state, layout, step, forward_mode) -> GuideStep`` (the proposed parameters of
its blocks, its proposed state and the arrays that must be finite), ``commit(old, new, ok) ->
state`` (what to keep once the adapter knows whether the step was finite) and ``report(state,
optimizer) -> [(key, message)]``; an algorithm with a guide of its own (parameters no autoguide
has) also gives ``read_layout(params, optimizer) -> Layout``.
"""

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
from numpyro_blr.layout import GuideLayoutError, read_layout


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
        self.prefix = prefix or getattr(guide, "prefix", None) or "auto"
        self.scale_constraint = getattr(guide, "scale_constraint", None)
        self.scale_tril_constraint = getattr(guide, "scale_tril_constraint", None)
        self.update_with_value = False

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
        self.algorithm.check_layout(layout, params, self.prefix)
        if not layout.blocks and self.fallback is None:
            raise GuideLayoutError(
                f"{name} found no Gaussian in the parameters {sorted(params)}: it expects an autoguide's "
                f"'<site>_{self.prefix}_loc'/'<site>_{self.prefix}_scale', '{self.prefix}_loc'/"
                f"'{self.prefix}_scale_tril' or point-mass '{self.prefix}_loc' parameters. Use AutoNormal, "
                "AutoDiagonalNormal, AutoMultivariateNormal or AutoDelta, or pass guide=... if it uses another prefix "
                "(for positive, unit-interval, simplex or discrete latents use nb.ExpFamilyGuide). "
                f"If it is a hand-written guide, pass it: {name}(guide=guide, guide_args=(...)) with the arguments "
                f"you give svi.run, and {name} reads its Normal/MultivariateNormal sites by tracing it; "
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


def _all_finite(arrays):
    """One reduction: ``x * 0`` is 0 for finite ``x`` and NaN for inf/NaN, so the sum is finite iff all are."""
    return jnp.isfinite(sum(jnp.sum(a * 0) for a in arrays))


def commit_if_finite(old, new, ok):
    """The ``commit`` of an algorithm whose proposal is its next state: ``new`` if the step was finite, else ``old``."""
    return select(ok, new, old)


def skipped_report(name, fix):
    """A ``report`` naming the steps ``name`` skipped as non-finite and the parameters at fault, then ``fix``."""

    def report(state, optimizer):
        i, s = state
        if not int(s.skipped):
            return []
        return [(("skipped", int(i)), f"{name} skipped {int(s.skipped)} of {int(i)} steps because of a non-finite loss, "
                 f"gradient or update, for parameter(s) {nonfinite_parameters(state)}; those steps kept the last finite values. {fix}")]

    return report


def nonfinite_parameters(state):
    """Names of the parameters whose gradient or update was ever non-finite in a run.

    ``state`` is an ``SVIState`` (``svi_result.state``) or the optimizer's state.
    """
    opt_state = getattr(state, "optim_state", state)
    return sorted(k for k, v in opt_state[1].nonfinite.items() if bool(v))
