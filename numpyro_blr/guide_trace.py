r"""Reading a hand-written guide's Gaussians by tracing it, and checking a read by names against the loss.

A guide written with ``numpyro.param`` and ``numpyro.sample`` names its parameters as its author
likes, so :func:`numpyro_blr.layout.read_layout` (which reads autoguide names) cannot find its
Gaussians. :func:`trace_layout` runs the guide instead (``nb.BLR(guide=guide, guide_args=...)``)
and reads, for every sample site whose distribution is (possibly through ``to_event``, a
``TransformedDistribution`` such as ``LogNormal``, or an ``expand`` that adds no dimensions)

* ``dist.Normal(loc, scale)``: a diagonal block, or
* ``dist.MultivariateNormal(loc, scale_tril=L)``: a full-covariance block,

which parameter *is* the ``loc`` and which parameter, through its ``constraint``, *is* the
``scale`` (or ``scale_tril``). "Is" is checked exactly: the guide is run with every parameter
replaced by a random value, the site's ``loc`` must equal one parameter's value and its derivative
with respect to all parameters (one ``jax.jvp`` with a random tangent) must be that parameter's
tangent; the ``scale`` must be ``biject_to(constraint)`` of one parameter, with the same test.
A ``scale`` computed in the guide (``jnp.exp(log_scale)``) or a ``loc`` shared between sites is
therefore not read: its parameters go to the ``fallback`` optimizer, or the error names them and
says why. The unconstrained value is what SVI hands the optimizer, so a scale declared with
``constraints.positive`` becomes a block whose scale transform is ``exp``.

:func:`check_loss` guards the read by names (no ``guide=``): a hand-written guide
whose parameters happen to be called ``w_auto_loc``/``w_auto_scale`` but whose scale has another
constraint than the autoguide's would otherwise be stepped with the wrong transform.
"""

import inspect

import jax
import jax.numpy as jnp
import numpy as np
import numpyro.distributions as dist
from numpyro import handlers
from numpyro.distributions import constraints
from numpyro.distributions.transforms import IdentityTransform, IndependentTransform, biject_to
from numpyro.primitives import Messenger

from numpyro_blr.layout import DIAGONAL, FULL, GaussianBlock, GuideLayoutError, Layout

FULL_SCALE_CONSTRAINTS = (
    constraints.lower_cholesky,
    constraints.scaled_unit_lower_cholesky,
    constraints.softplus_lower_cholesky,
)


def is_autoguide(guide):
    """Whether ``guide`` names its parameters as :func:`~numpyro_blr.layout.read_layout` reads them."""
    from numpyro.infer.autoguide import AutoGuide

    from numpyro_blr.guides import ExpFamilyGuide

    return isinstance(guide, (AutoGuide, ExpFamilyGuide))


def _gaussian(fn):
    """``(kind, loc, scale_or_tril)`` of the Gaussian a site's distribution reparameterises, or a reason."""
    while True:
        if isinstance(fn, dist.Independent):
            fn = fn.base_dist
        elif isinstance(fn, dist.TransformedDistribution):  # z ~ N, x = T(z): T belongs to the loss
            fn = fn.base_dist
        elif isinstance(fn, dist.ExpandedDistribution):
            if tuple(fn.batch_shape) != tuple(fn.base_dist.batch_shape):
                return f"its {type(fn.base_dist).__name__} is expanded from {fn.base_dist.batch_shape} to {fn.batch_shape}"
            fn = fn.base_dist
        else:
            break
    if type(fn) is dist.Normal:
        return DIAGONAL, fn.loc, fn.scale
    if type(fn) is dist.MultivariateNormal:
        if fn.batch_shape:
            return f"its MultivariateNormal has batch shape {fn.batch_shape} (BLR reads one vector)"
        return FULL, fn.loc, fn.scale_tril
    return None


def _is_identity(constraint):
    t = biject_to(constraint)
    while isinstance(t, IndependentTransform):
        t = t.base_transform
    return isinstance(t, IdentityTransform)


def _is_float_array(x):
    return isinstance(x, (jax.Array, np.ndarray, float)) and jnp.issubdtype(jnp.result_type(x), jnp.floating)


def guide_call_args(guide, guide_args, guide_kwargs):
    """The arguments to trace ``guide`` with, or raise saying to pass ``guide_args``."""
    if guide_args is not None or guide_kwargs is not None:
        return tuple(guide_args or ()), dict(guide_kwargs or {})
    try:
        inspect.signature(guide).bind()
    except TypeError as err:
        raise GuideLayoutError(
            f"nb.BLR(guide=...) traces a hand-written guide to find its Gaussians, and this guide needs "
            f"arguments ({err}): pass them as nb.BLR(guide=guide, guide_args=(X, ...), guide_kwargs={{...}}), "
            "the same arguments you give svi.run / svi.init."
        ) from None
    except ValueError:  # no signature (a builtin): try without arguments
        pass
    return (), {}


def _param_sites(guide, args, kwargs):
    with handlers.block(), handlers.trace() as tr, handlers.seed(rng_seed=0):
        guide(*args, **kwargs)
    return {n: s for n, s in tr.items() if s["type"] == "param"}


def trace_layout(guide, params, args=(), kwargs=None, fallback=None):
    """The :class:`~numpyro_blr.layout.Layout` of a hand-written ``guide`` over ``params``.

    ``params`` is the dict SVI hands the optimizer (only names and shapes are used, so this can run
    while ``jit`` traces). Parameters the guide does not declare (a model's ``numpyro.param``) and
    guide parameters that feed no readable Gaussian are ``other``. Without ``fallback`` a guide
    parameter that feeds a Gaussian site which could not be read raises, with the reason.
    """
    kwargs = dict(kwargs or {})
    try:
        sites = _param_sites(guide, args, kwargs)
    except Exception as err:  # noqa: BLE001 - say which call failed and how to give the arguments
        raise GuideLayoutError(
            f"nb.BLR traces the hand-written guide to find its Gaussians, and calling it with guide_args={args!r} "
            f"and guide_kwargs={kwargs!r} failed ({type(err).__name__}: {err}). Pass the arguments you give "
            "svi.run: nb.BLR(guide=guide, guide_args=(X, ...), guide_kwargs={...})."
        ) from err
    constraint = {n: s["kwargs"].get("constraint", constraints.real) for n, s in sites.items() if n in params}

    # random stand-ins in unconstrained space: no two parameters share a value by accident
    key = jax.random.PRNGKey(20231)
    u, fixed = {}, {}
    for i, n in enumerate(sorted(constraint)):
        v = params[n]
        if _is_float_array(v) and hasattr(v, "shape"):
            u[n] = 0.5 + jax.random.uniform(jax.random.fold_in(key, i), jnp.shape(v), jnp.result_type(v))
        else:  # a pytree-valued parameter (a module): kept as it is, never read as a Gaussian
            fixed[n] = v

    def run(values):
        data = {n: biject_to(constraint[n])(x) for n, x in values.items()}
        data.update(fixed)
        with handlers.block(), handlers.trace() as tr, handlers.seed(rng_seed=0), handlers.substitute(data=data):
            guide(*args, **kwargs)
        return tr

    tr = run(u)
    gaussians, reasons = {}, {}
    for name, site in tr.items():
        if site["type"] != "sample" or site.get("is_observed", False):
            continue
        got = _gaussian(site["fn"])
        if isinstance(got, str):
            reasons[name] = got
        elif got is not None:
            gaussians[name] = got[0]

    def quantities(values):
        out = {}
        t = run(values)
        for name in gaussians:
            got = _gaussian(t[name]["fn"])
            out[name] = (got[1], got[2])
        return out

    tangent = {n: jax.random.normal(jax.random.fold_in(key, 1000 + i), x.shape, x.dtype) for i, (n, x) in enumerate(sorted(u.items()))}
    primal, tangents = jax.jvp(quantities, (u,), (tangent,))

    def same(a, b):
        a, b = np.asarray(a), np.asarray(b)
        return a.shape == b.shape and np.allclose(a, b, rtol=1e-5, atol=1e-6 * max(1.0, float(np.max(np.abs(b), initial=0.0))))

    def find(value, dvalue, names, scale_kind=None):
        """The one parameter whose constrained value (and its derivative) is ``value``."""
        found = []
        for n in names:
            if scale_kind == FULL and not any(constraint[n] is c for c in FULL_SCALE_CONSTRAINTS):
                continue
            if scale_kind == DIAGONAL and getattr(constraint[n], "event_dim", 0) != 0:
                continue
            y, dy = jax.jvp(biject_to(constraint[n]), (u[n],), (tangent[n],))
            if same(value, y) and same(dvalue, dy):
                found.append(n)
        return found[0] if len(found) == 1 else None

    blocks, used = [], set()
    for name, kind in gaussians.items():
        (loc, scale), (dloc, dscale) = primal[name], tangents[name]
        loc_name = find(loc, dloc, [n for n in u if _is_identity(constraint[n])])
        scale_name = find(scale, dscale, [n for n in u if n != loc_name], scale_kind=kind)
        if loc_name is None or scale_name is None:
            what = "loc" if loc_name is None else ("scale_tril" if kind == FULL else "scale")
            reasons[name] = (
                f"its {what} is not a numpyro.param used as it is"
                + (" (declared with a constraint, e.g. constraints.positive, for a scale)" if what != "loc" else " (with no constraint)")
            )
            continue
        if loc_name in used or scale_name in used:
            reasons[name] = f"its parameters {loc_name!r}/{scale_name!r} also feed another Gaussian site"
            continue
        if kind == DIAGONAL and np.shape(loc) != np.shape(scale):
            reasons[name] = f"its loc has shape {np.shape(loc)} and its scale {np.shape(scale)}"
            continue
        blocks.append(GaussianBlock(kind, loc_name, scale_name, constraint[scale_name]))
        used.update((loc_name, scale_name))

    other = tuple(sorted(set(params) - used))
    unread_sites = {s: r for s, r in reasons.items()}
    if fallback is None and other:
        hint = "".join(f"\n  site {s!r}: {r};" for s, r in unread_sites.items())
        raise GuideLayoutError(
            f"nb.BLR read the hand-written guide's Gaussians {[b.loc for b in blocks] or 'none'} but cannot treat "
            f"the parameter(s) {list(other)} as part of one.{hint}\nA Gaussian site is read when it is "
            "numpyro.sample(name, dist.Normal(loc, scale)) (or .to_event, LogNormal, or "
            "MultivariateNormal(loc, scale_tril=L)) with loc a numpyro.param and scale (L) a numpyro.param "
            "with a positive (lower_cholesky) constraint, each used as it is. Pass fallback=optax.adam(1e-3) "
            "(or another optimizer) to update the other parameters."
        )
    return Layout(tuple(sorted(blocks, key=lambda b: b.loc)), other)


class _LossRecorder(Messenger):
    """Records what the loss's model and guide declare: param constraints, and enumerated sites that
    the loss does not enumerate."""

    def __init__(self):
        super().__init__()
        self.constraints = {}
        self.marked, self.summed, self.sampled = [], set(), set()

    def postprocess_message(self, msg):
        if msg["type"] == "param" and msg["name"] not in self.constraints:
            self.constraints[msg["name"]] = msg["kwargs"].get("constraint", constraints.real)
        if msg["type"] != "sample":
            return
        infer = msg.get("infer") or {}
        name = msg["name"]
        if not msg.get("is_observed", False) and infer.get("enumerate") == "parallel":
            if msg.get("done", False):  # TraceEnum_ELBO's enum handler marks what it enumerates done
                self.summed.add(name)
            elif name not in self.sampled and name not in self.marked:  # the guide runs first: not guided
                self.marked.append(name)
        self.sampled.add(name)

    @property
    def unsummed(self):
        """Sites marked for enumeration, with no guide site, that no pass of the loss enumerated (TraceEnum_ELBO
        also runs the model once without enumeration, to read its dependencies)."""
        return [n for n in self.marked if n not in self.summed]


def loss_sites(fn, params):
    """``({name: constraint}, [enumerated sites not enumerated])`` from running the loss
    ``fn(params)`` abstractly (``jax.eval_shape``: no computation is done)."""
    from numpyro.distributions.distribution import validation_enabled

    recorder = _LossRecorder()

    def run(p):
        with recorder:
            return fn(p)

    # NumPyro's distribution checks evaluate their constant parts eagerly even here (jax.ensure_compile_time_eval):
    # about 20 one-operation programs for AutoMultivariateNormal, where the checks have nothing to find
    with validation_enabled(False):
        jax.eval_shape(run, params)
    return recorder.constraints, recorder.unsummed


def check_loss(fn, params, layout, read_by_names=True):
    """Checks of the loss that nb.BLR runs once per compilation (abstractly):

    * a site the model marks ``infer={"enumerate": "parallel"}`` must be enumerated by the loss
      (``TraceEnum_ELBO``): under ``Trace_ELBO`` it is drawn from the model and the gradient misses
      its score-function term, a biased fit with only NumPyro's warning;
    * with ``read_by_names``, a block read by its autoguide names must have the constraints the
      block's transform assumes: otherwise the guide is not the autoguide its names suggest.
    """
    try:
        declared, unsummed = loss_sites(fn, params)
    except Exception:  # noqa: BLE001 - a loss that cannot be evaluated abstractly: nothing to check
        return
    if unsummed:
        raise ValueError(
            f"the model marks the site(s) {unsummed} infer={{'enumerate': 'parallel'}}, but the loss does not "
            "enumerate them: under Trace_ELBO they are drawn from the model and the ELBO gradient misses their "
            "score-function term. Use numpyro.infer.TraceEnum_ELBO() (nb.ExpFamilyGuide and the autoguides leave "
            "enumerated sites to it), or remove the mark and give the site a guide family."
        )
    if not read_by_names:
        return
    wrong = []
    for b in layout.blocks:
        if b.kind not in (DIAGONAL, FULL):
            continue
        want = {b.loc: constraints.real, b.scale: b.scale_constraint}
        for n, c in want.items():
            got = declared.get(n)
            if got is not None and type(got) is not type(c):
                wrong.append(f"{n!r} is declared with {got} but read as {c}")
    if wrong:
        raise GuideLayoutError(
            "nb.BLR read the guide by its parameter names as an autoguide's, but " + "; ".join(wrong) + ". "
            "If this is a hand-written guide, pass it: nb.BLR(guide=guide, guide_args=(...)) (the arguments "
            "you give svi.run), and BLR reads its Gaussians by tracing it."
        )


# -- what BLR and IVON share with numpyro.contrib.module and NumPyro's optimizers ----------------
PLACEHOLDER_SUFFIX = "$params"  # numpyro.contrib.module's parameter holding a module's weights


def unread_params(fn, params, names):
    """The subset of ``names`` (keys of ``params``) whose leaves no operation of ``fn``'s traced
    jaxpr reads (nor returns): ``fn(params)`` does not depend on them. ``random_eqx_module`` /
    ``random_flax_module`` register such a ``"{name}$params"`` placeholder when every module weight
    has a prior (the weights are then latent sites), and the optimizers pass it through."""
    jaxpr = jax.make_jaxpr(fn)(params).jaxpr
    read = {id(v) for eqn in jaxpr.eqns for v in eqn.invars}
    read |= {id(v) for v in jaxpr.outvars}
    owner = [path[0].key for path, _ in jax.tree_util.tree_flatten_with_path(params)[0]]
    used = {k for k, v in zip(owner, jaxpr.invars) if id(v) in read}
    return [k for k in names if k not in used]


def passthrough_params(fn, params, other, fallback, who):
    """The parameters an optimizer leaves as they are: without a fallback, ``other`` (the layout has
    already checked that they are all ``"$params"`` placeholders), provided the loss reads none of
    them; with a fallback, none. Raises naming the parameters the loss does read."""
    if fallback is not None or not other:
        return ()
    read = sorted(set(other) - set(unread_params(fn, params, other)))
    if read:
        from numpyro_blr.layout import GuideLayoutError

        raise GuideLayoutError(
            f"{who}: the loss reads the parameter(s) {read}, which are not part of a Gaussian guide "
            "(a module weight without a prior?); pass fallback=optax.adam(1e-3) (or another optimizer) "
            "to update them."
        )
    return tuple(other)


def fallback_transformation(fallback):
    """``fallback`` as an ``optax.GradientTransformation``: an optax one as it is, a NumPyro optimizer
    (``numpyro.optim.Adam(1e-3)``, ``optax_to_numpyro(...)``) through its ``init_fn``/``update_fn``/
    ``get_params_fn`` (the update is the change of the parameters it holds). None stays None."""
    import optax
    from numpyro.optim import _NumPyroOptim

    if fallback is None:
        return None
    if isinstance(fallback, _NumPyroOptim):
        name = type(fallback).__name__
        special = type(fallback).eval_and_update is not _NumPyroOptim.eval_and_update
        if special or getattr(fallback, "update_with_value", False):
            raise ValueError(
                f"fallback={name}(...) is an optimizer that needs the loss itself, so it cannot update only "
                "the parameters outside the Gaussians; pass a gradient optimizer, e.g. fallback=optax.adam(1e-3) "
                "or numpyro.optim.Adam(1e-3)."
            )

        def init(params):
            return (jnp.zeros((), jnp.int32), fallback.init_fn(params))

        def update(grads, state, params=None):
            i, inner = state
            new_inner = fallback.update_fn(i, grads, inner)
            old, new = fallback.get_params_fn(inner), fallback.get_params_fn(new_inner)
            return jax.tree.map(jnp.subtract, new, old), (i + 1, new_inner)

        return optax.GradientTransformation(init, update)
    if isinstance(fallback, optax.GradientTransformation) or (
        callable(getattr(fallback, "init", None)) and callable(getattr(fallback, "update", None))
    ):
        return fallback
    raise ValueError(
        f"fallback must be an optax GradientTransformation (e.g. optax.adam(1e-3)) or a NumPyro optimizer "
        f"(e.g. numpyro.optim.Adam(1e-3)), got {type(fallback).__name__}."
    )


def check_foreign_state(s, state_type, who="nb.BLR"):
    """Raise with what to do when ``svi.run(..., init_state=...)`` hands over another optimizer's state."""
    if isinstance(s, state_type):
        return
    raise TypeError(
        f"{who} was given an optimizer state of type {type(s).__name__}, not its own {state_type.__name__}: "
        "svi.run(..., init_state=...) continues a run with the optimizer that made the state, and this one "
        "comes from another optimizer (an Adam run?). To start BLR from that run's parameters, pass them "
        "instead: svi.run(key, num_steps, *args, init_params=previous_result.params) (the constrained "
        "parameters of the other run, e.g. svi_adam.get_params(state))."
    )
