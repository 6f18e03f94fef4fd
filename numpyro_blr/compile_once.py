r"""Compile once, fit many: :func:`fit`, a deterministic :class:`Trace_ELBO` and :func:`enable_compilation_cache`.

``SVI(model, guide, optim, loss).run(key, n, *data)`` pays three costs before its first step, every
time: NumPyro's autoguide setup runs the model eagerly (hundreds of one-operation programs, each
compiled on first use: 1-5 s), ``svi.init`` runs eagerly again, and ``run`` builds a new function on
each call, so the steps compile again for new data of the same shapes (with the progress bar the data
are even baked into the program as constants). :func:`fit` runs the same algorithm as one program:

.. math::
    \texttt{program}(k, x) = \operatorname{scan}^{n}\big(\texttt{svi.update}(\cdot, x),\;
    \texttt{svi.init}(k, x)\big),

jit-compiled with the data :math:`x` as arguments (never as constants) and the guide's setup traced
into it, and cached per (model, guide, optimizer configuration, loss, non-array arguments); the number of
steps :math:`n` is an argument too (one program runs any :math:`n` up to its capacity, a power of two of at
least 1,024). JAX's own cache then keys it by the arrays' shapes and dtypes, so a refit with new data of the
same shapes, or with another number of steps, runs the steps alone, and new shapes recompile silently.

The guide's setup inside a traced program leaves traced values in the guide object (its prototype
trace, initial locations, the closures over the data that ``guide.median`` and
``guide.sample_posterior`` call later). :func:`fit` returns those values from the program and puts
the concrete ones back (:func:`_replace_tracers` walks NumPyro's objects, containers, partials and
closures); if any traced value is left that it cannot account for, it sets the guide up again
eagerly, as ``SVI.run`` does, and says nothing: the result is the same. While the setup is traced,
``AutoContinuous`` guides keep their initial values in the model's site order
(:class:`_ModelSiteOrder`), so ``auto_loc`` is laid out as an eager setup lays it out; guides whose
setup reads concrete values (``nb.ExpFamilyGuide``, ``nb.LieGroupGuide``) are set up eagerly, with
the key ``svi.init`` gives them; inside the program the guide runs without NumPyro's distribution
checks (:func:`_unvalidated`), which there only see its own initial constants.

With :func:`enable_compilation_cache`, the compiled programs are also written to disk, keyed by a trace
of the fit's start alone (:meth:`_Program._key_fn`: the guide's setup and ``svi.init``, a fraction of
the whole trace), so a later process loads the program without tracing or lowering its steps. That
trace sets the guide up with traced values, as the program's own trace would; the program read from
disk returns the concrete ones in the same order (the order of the walk over the guide and SVI objects,
recorded with each value's path and shape when the program is written and compared when it is read),
and they are put back as above. On any doubt it falls back to tracing the whole program.

:class:`Trace_ELBO` is NumPyro's with the sites summed in sorted name order. NumPyro sums them in
the order of a Python ``set`` (``numpyro/infer/elbo.py``: ``set(model_log_probs).union(...)``),
which follows ``PYTHONHASHSEED``: the program text then differs between processes and JAX's
persistent compilation cache (:func:`enable_compilation_cache`) never hits; the loss also differs
in the last bit between processes for the same key. An upstream fix is one line:
``for name in sorted(union)``. :func:`fit` uses this class in place of a plain
``numpyro.infer.Trace_ELBO`` (same ``num_particles`` and options).
"""

from __future__ import annotations

import collections
import contextlib
import functools
import hashlib
import os
import pathlib
import threading
import types
import warnings
import weakref

import jax
import jax.numpy as jnp
import numpy as np
import numpyro.distributions as dist
import optax
from jax import lax
from numpyro import handlers
from numpyro.infer import SVI
from numpyro.infer import Trace_ELBO as _NumPyroTraceELBO
from numpyro.infer.svi import SVIRunResult, SVIState
from numpyro.optim import _NumPyroOptim

__all__ = ["Trace_ELBO", "fit", "enable_compilation_cache", "cache_info", "cache_clear"]


class _draw_once(handlers.Messenger):  # noqa: N801 - a NumPyro handler's name
    """Draws a guide's ``Normal`` and ``MultivariateNormal`` sites (also ``.to_event`` and transformed, as
    ``AutoNormal``'s constrained sites) as NumPyro does, the same values and intermediates bit for bit, with the
    standard normal draw behind ``lax.optimization_barrier``: without it XLA's fusion copies the draw (threefry bits
    and ``erf_inv``, about 240 operations per value in float64) into every fused consumer of it (the site's value,
    the guide's log density, the gradient in the scale). Placed outside ``handlers.seed``, whose key it reads; under
    a handler that may still set the value (``substitute``, ``condition``, ``replay``, ``do`` around the loss) it
    leaves the site to NumPyro."""

    def process_message(self, msg):
        if msg["type"] != "sample" or msg["value"] is not None or msg.get("is_observed"):
            return
        from numpyro.primitives import _PYRO_STACK

        outer = _PYRO_STACK[:next(i for i, h in enumerate(_PYRO_STACK) if h is self)]
        if any(_sets_value(h, msg) for h in outer):
            return
        key, base, transforms = msg["kwargs"].get("rng_key"), msg["fn"], []
        if type(base) is dist.TransformedDistribution:
            base, transforms = base.base_dist, base.transforms
        while type(base) is dist.Independent:
            base = base.base_dist
        if key is None or type(base) not in (dist.Normal, dist.MultivariateNormal):
            return
        shape = tuple(msg["kwargs"].get("sample_shape", ())) + base.batch_shape + base.event_shape
        eps = lax.optimization_barrier(jax.random.normal(key, shape=shape))
        if type(base) is dist.Normal:  # numpyro's Normal.sample and MultivariateNormal.sample, with the barrier
            x = base.loc + eps * base.scale
        else:
            x = base.loc + jnp.squeeze(jnp.matmul(base.scale_tril, eps[..., jnp.newaxis]), axis=-1)
        msg["value"], msg["intermediates"] = transformed_with_intermediates(x, transforms)


def transformed_with_intermediates(x, transforms):
    """``(value, intermediates)``: ``transforms`` applied to the base draw ``x``, with the intermediates as
    ``TransformedDistribution.sample_with_intermediates`` records them (read back by its ``log_prob``)."""
    intermediates = []
    for transform in transforms:
        x_before = x
        x, t_inter = transform.call_with_intermediates(x)
        intermediates.append([x_before, t_inter])
    return x, intermediates


def _sets_value(handler, msg):
    """Whether ``handler`` (a NumPyro handler around the guide) will set this sample site's value: ``substitute`` and
    ``condition`` (by data or by function), ``replay``, ``do`` (``log_density``'s substitute of the parameters does
    not)."""
    name = msg["name"]
    if isinstance(handler, (handlers.substitute, handlers.condition)):
        if handler.data is not None:
            return handler.data.get(name) is not None
        fn = handler.substitute_fn if isinstance(handler, handlers.substitute) else handler.condition_fn
        return fn(msg) is not None
    if isinstance(handler, handlers.replay):
        return name in handler.trace
    if isinstance(handler, handlers.do):
        return handler.data is not None and name in handler.data
    return False


class Trace_ELBO(_NumPyroTraceELBO):  # noqa: N801 - NumPyro's name
    """NumPyro's ``Trace_ELBO``, with the ELBO's sites taken in sorted name order.

    NumPyro's ``single_particle_elbo`` forms ``log p - log q`` per site and sums them in the order of a
    Python ``set``; this one does the same in sorted order (the rest is NumPyro's code path: the same
    traces, checks, mutable state and particles). The value equals NumPyro's up to the order of a
    floating-point sum, and the compiled program is the same in every process, which JAX's
    persistent compilation cache needs to hit. A drop-in: ``SVI(model, guide, nb.BLR(), nb.Trace_ELBO())``.
    A guide that proposes several samples (``multi_sample_guide=True``) or ``sum_sites=False`` use
    NumPyro's code unchanged.
    """

    def loss_with_mutable_state(self, rng_key, param_map, model, guide, *args, **kwargs):
        if self.multi_sample_guide or not self.sum_sites:
            return super().loss_with_mutable_state(rng_key, param_map, model, guide, *args, **kwargs)
        from numpyro.infer.elbo import compute_log_probs
        from numpyro.util import _validate_model, check_model_guide_match

        def single_particle_elbo(key):
            params = param_map.copy()
            model_seed, guide_seed = jax.random.split(key)
            guide_log_probs, guide_trace = compute_log_probs(_draw_once(handlers.seed(guide, guide_seed)), args, kwargs,
                                                             param_map)
            mutable = {n: site["value"] for n, site in guide_trace.items() if site["type"] == "mutable"}
            params.update(mutable)
            replayed = handlers.replay(handlers.seed(model, model_seed), guide_trace)
            model_log_probs, model_trace = compute_log_probs(replayed, args, kwargs, params)
            check_model_guide_match(model_trace, guide_trace)
            _validate_model(model_trace, plate_warning="loose")
            mutable.update({n: site["value"] for n, site in model_trace.items() if site["type"] == "mutable"})
            elbo = jnp.array(0.0)
            for name in sorted(set(model_log_probs) | set(guide_log_probs)):  # NumPyro: the set's order
                elbo = elbo + (model_log_probs.get(name, jnp.array(0.0)) - guide_log_probs.get(name, jnp.array(0.0)))
            if mutable:
                if self.num_particles == 1:
                    return elbo, mutable
                warnings.warn("mutable state is currently ignored when num_particles > 1.", stacklevel=2)
            return elbo, None

        if self.num_particles == 1:
            elbo, mutable = single_particle_elbo(rng_key)
            return {"loss": -elbo, "mutable_state": mutable}
        elbos, mutable = self.vectorize_particles_fn(single_particle_elbo, jax.random.split(rng_key, self.num_particles))
        return {"loss": -jnp.mean(elbos), "mutable_state": mutable}


def _ordered_loss(loss):
    """``loss`` with its sites summed in a fixed order, where that is known to be the same loss."""
    if loss is None:
        return Trace_ELBO()
    if type(loss) is _NumPyroTraceELBO:
        ordered = Trace_ELBO.__new__(Trace_ELBO)
        ordered.__dict__.update(vars(loss))
        return ordered
    if not (hasattr(loss, "loss_with_mutable_state") or hasattr(loss, "loss")):
        raise TypeError(
            f"loss must be a NumPyro ELBO (numpyro.infer.Trace_ELBO(), TraceMeanField_ELBO(), ...) or None for "
            f"nb.Trace_ELBO(), got {loss!r} of type {type(loss).__name__}."
        )
    return loss


# -- keys -----------------------------------------------------------------------------------------
def _freeze(value, depth=0):
    """A hashable stand-in for a configuration value: the value itself where it is hashable and compares
    by value, a tuple for containers, ``("id", id)`` otherwise (the cache entry holds the object, so the
    id cannot be reused while the entry lives)."""
    if value is None or isinstance(value, (bool, int, float, complex, str, bytes, np.generic)):
        return value
    if depth < 4 and isinstance(value, (tuple, list)):
        return (type(value).__name__,) + tuple(_freeze(v, depth + 1) for v in value)
    if depth < 4 and isinstance(value, dict):
        return ("dict",) + tuple(sorted(((str(k), _freeze(v, depth + 1)) for k, v in value.items()), key=repr))
    if depth < 4 and type(value).__module__.startswith("numpyro_blr") and hasattr(value, "__dict__"):
        return (type(value).__qualname__,) + _freeze(vars(value), depth + 1)
    if depth < 4 and type(value) is functools.partial:  # init_to_median(num_samples=15) is a new partial each call
        return ("partial", _freeze(value.func, depth + 1), _freeze(value.args, depth + 1),
                _freeze(value.keywords, depth + 1))
    return ("id", id(value))


def _optimizer_key(optim):
    """Our optimizers (``nb.BLR``, ``nb.IVON``, ...) by their configuration: two ``nb.BLR()`` share a program.
    Any other optimizer by the object itself."""
    from numpyro_blr.svi import GuideOptimizer

    if isinstance(optim, GuideOptimizer):
        # the arrays a hand-written guide is traced with give only its parameters' shapes, which JAX keys by
        # (packed_guide: the fit's own guide, whose key is the program's already)
        config = {k: v for k, v in vars(optim).items() if k not in ("algorithm", "_traced_layouts", "_state_shapes",
                                                                      "guide_args", "packed_guide")}
        return (type(optim).__qualname__, _freeze(config))
    return ("id", id(optim))


def _pristine_autoguide(guide):
    """One of NumPyro's autoguides that has not been set up: a program traces its setup, so its class and
    options alone decide the program."""
    return (type(guide).__module__ == "numpyro.infer.autoguide" and getattr(guide, "prototype_trace", False) is None
            and not hasattr(guide, "_guides"))  # an AutoGuideList's parts hold setups of their own


_GUIDE_KEYS = weakref.WeakKeyDictionary()  # an autoguide set up by fit -> (its key, its attributes as built)


def _guide_key(guide):
    """``(key, attributes as built)``: a NumPyro autoguide by its class and options while :func:`fit` sets it
    up (built anew for each fit, ``nb.fit(model, AutoNormal(model), ...)`` reuses the program), and after (the
    setup values a program left in it are that program's); any other guide by the object itself, with ``None``
    (a guide set up before, a function: its values are constants of the program)."""
    known = _registered(guide)
    if known is not None:
        return known
    if _pristine_autoguide(guide):
        cls = type(guide)
        return ("options", cls.__module__, cls.__qualname__, _freeze(vars(guide))), _vars_copy(guide)
    return ("id", id(guide)), None


def _registered(guide):
    try:
        return _GUIDE_KEYS.get(guide)
    except TypeError:  # not weakly referable, or unhashable
        return None


def _built(guide):
    """The attributes as built of an autoguide that :func:`fit` set up, else ``None``."""
    known = _registered(guide)
    return None if known is None else known[1]


def _copied(attributes):
    """The attributes with their top-level dicts and lists copied (an autoguide's setup fills some in place)."""
    return {k: (type(v)(v) if type(v) in (dict, list) else v) for k, v in attributes.items()}


def _vars_copy(obj):
    return _copied(vars(obj))


def _assign_vars(obj, saved):
    d = vars(obj)
    d.clear()
    d.update(_copied(saved))


def _loss_key(loss):
    return (type(loss).__qualname__, _freeze(vars(loss)) if hasattr(loss, "__dict__") else id(loss))


def _is_data(x):
    return isinstance(x, (jax.Array, np.ndarray))


def _split(args, kwargs):
    """(arrays, rebuild, signature): the array leaves of ``(args, kwargs)`` are the program's inputs; the
    rest (Python numbers, strings, functions) is part of its key and stays static."""
    leaves, treedef = jax.tree.flatten((args, kwargs))
    arrays = [x for x in leaves if _is_data(x)]
    static = tuple(None if _is_data(x) else x for x in leaves)
    is_array = tuple(_is_data(x) for x in leaves)

    def rebuild(values):
        it = iter(values)
        return jax.tree.unflatten(treedef, [next(it) if a else s for a, s in zip(is_array, static)])

    try:
        hash(static)
        static_key = static
    except TypeError:
        static_key = tuple(x if _hashable(x) else ("id", id(x)) for x in static)
    return arrays, rebuild, (treedef, is_array, static_key)


def _hashable(x):
    try:
        hash(x)
        return True
    except TypeError:
        return False


# -- traced values left in the guide --------------------------------------------------------------
_ATOMS = (str, bytes, int, float, complex, bool, type(None), type, np.ndarray, np.generic)


def _replace_tracers(root, replace, paths=None, visit=None):
    """Walk ``root`` (NumPyro objects, containers, ``functools.partial``, closures) and replace every
    ``jax.core.Tracer`` ``t`` by ``replace(t)`` in place (tuples and partials are rebuilt). With ``paths``
    (a dict), ``paths[id(t)]`` is the path at which ``t`` was first met (a string: attribute names, keys,
    indices, closure cells), in the walk's order, which follows the objects' own (insertion) order. With
    ``visit``, ``visit(x)`` is called on every other leaf met (arrays, numbers, strings), in that order."""
    memo = {}

    def walk(obj, path):
        if isinstance(obj, jax.core.Tracer):
            if paths is not None:
                paths.setdefault(id(obj), path)
            return replace(obj)
        if isinstance(obj, _ATOMS) or isinstance(obj, jax.Array):
            if visit is not None:
                visit(obj)
            return obj
        oid = id(obj)
        if oid in memo:
            return memo[oid]
        memo[oid] = obj
        if isinstance(obj, dict):
            for k, v in list(obj.items()):
                new = walk(v, f"{path}[{k!r}]" if paths is not None else None)
                if new is not v:
                    obj[k] = new
            return obj
        if isinstance(obj, list):
            for i, v in enumerate(obj):
                new = walk(v, f"{path}[{i}]" if paths is not None else None)
                if new is not v:
                    obj[i] = new
            return obj
        if isinstance(obj, tuple):
            items = [walk(v, f"{path}({i})" if paths is not None else None) for i, v in enumerate(obj)]
            if all(a is b for a, b in zip(items, obj)):
                return obj
            new = type(obj)(*items) if hasattr(obj, "_fields") else type(obj)(items)
            memo[oid] = new
            return new
        if isinstance(obj, functools.partial):
            sub = (lambda tag: f"{path}.{tag}") if paths is not None else (lambda tag: None)
            func = walk(obj.func, sub("func"))
            args = [walk(a, sub(f"args{i}")) for i, a in enumerate(obj.args)]
            kw = {k: walk(v, sub(f"kw{k}")) for k, v in obj.keywords.items()}
            if func is obj.func and all(a is b for a, b in zip(args, obj.args)) and all(kw[k] is v for k, v in obj.keywords.items()):
                return obj
            new = functools.partial(func, *args, **kw)
            memo[oid] = new
            return new
        if isinstance(obj, types.FunctionType):
            for i, cell in enumerate(obj.__closure__ or ()):
                try:
                    value = cell.cell_contents
                except ValueError:  # an empty cell
                    continue
                new = walk(value, f"{path}<{obj.__qualname__}:{i}>" if paths is not None else None)
                if new is not value:
                    cell.cell_contents = new
            return obj
        if isinstance(obj, types.MethodType):
            walk(obj.__self__, f"{path}.__self__" if paths is not None else None)
            return obj
        if type(obj).__module__.split(".")[0] in ("numpyro", "numpyro_blr") and hasattr(obj, "__dict__"):
            d = vars(obj)
            for k, v in list(d.items()):
                new = walk(v, f"{path}.{k}" if paths is not None else None)
                if new is not v:
                    d[k] = new
            return obj
        return obj

    walk(root, "" if paths is not None else None)


def _leaked_tracers(root, paths=None):
    found = {}

    def record(t):
        found.setdefault(id(t), t)
        return t

    _replace_tracers(root, record, paths)
    return list(found.values())


class _Setup:
    """What a trace of the program left in the guide and SVI objects: recorded during tracing, put back
    with concrete values after the call."""

    def __init__(self):
        self.pending = None  # refs of the last trace, until the call returns
        self.signature = None  # the last trace's outputs: ((path, shape, dtype), ...) in their order

    def collect(self, svi, inputs):
        """Inside the trace: the traced values left in ``svi`` (its guide included); those of this trace
        that are not inputs become outputs of the program, the inputs are mapped to the call's arguments."""
        leaves = jax.tree.leaves(inputs)
        outer = {id(getattr(x, "_trace", None)) for x in leaves if isinstance(x, jax.core.Tracer)}
        by_input = {id(x): i for i, x in enumerate(leaves)}
        refs, outputs, paths = {}, [], {}
        for t in _leaked_tracers(svi, paths):
            if id(t) in by_input:
                refs[id(t)] = ("input", by_input[id(t)])
            elif id(getattr(t, "_trace", None)) in outer:
                refs[id(t)] = ("output", len(outputs))
                outputs.append(t)
            else:  # a value of an inner trace (a scan's body): as SVI.run leaves it, never read again
                refs[id(t)] = ("leave", None)
        self.pending = refs
        self.signature = tuple((paths[id(t)], tuple(t.shape), str(t.dtype)) for t in outputs)
        return outputs

    def restore(self, svi, inputs, outputs, resetup):
        """After the call: concrete values in place of the traced ones; ``resetup()`` if any is left."""
        refs, self.pending = self.pending, None
        if refs is None:
            return
        leaves = jax.tree.leaves(inputs)
        unknown = []

        def replace(t):
            ref = refs.get(id(t))
            if ref is None:
                unknown.append(t)
                return t
            kind, i = ref
            if kind == "leave":
                return t
            return leaves[i] if kind == "input" else outputs[i]

        _replace_tracers(svi, replace)
        if unknown:
            resetup()


def _guide_has_setup(guide):
    return hasattr(guide, "prototype_trace")


class _ModelSiteOrder:
    """Mixed into an autoguide's class while its setup is traced: keeps ``_init_locs`` in the model's site
    order. NumPyro's ``find_valid_initial_params`` returns its dict in that order when run eagerly, and in
    sorted order when traced (its ``while_loop`` output is a pytree); ``AutoContinuous`` ravels that dict
    into its latent vector, so a traced setup would lay ``auto_loc`` out differently from ``svi.run``'s and
    from another instance of the guide set up eagerly (``Predictive(model, guide=AutoDiagonalNormal(model),
    params=...)`` would then read the parameters in the wrong order, silently)."""

    @property
    def _init_locs(self):
        return self.__dict__["_init_locs"]

    @_init_locs.setter
    def _init_locs(self, value):
        trace = self.__dict__.get("prototype_trace")
        if isinstance(value, dict) and trace is not None:
            value = {**{k: value[k] for k in trace if k in value}, **value}
        self.__dict__["_init_locs"] = value


_ORDERED_CLASSES = {}


@contextlib.contextmanager
def _model_site_order(guide):
    """While the guide's setup is traced: ``_init_locs`` in the model's order (:class:`_ModelSiteOrder`)."""
    cls = type(guide)
    if getattr(guide, "prototype_trace", False) is not None:
        yield
        return
    if cls not in _ORDERED_CLASSES:
        namespace = {"__module__": cls.__module__, "_init_locs": _ModelSiteOrder._init_locs}
        _ORDERED_CLASSES[cls] = type(cls.__name__, (cls,), namespace)  # the layout of cls: __class__ can be assigned
    guide.__class__ = _ORDERED_CLASSES[cls]
    try:
        yield
    finally:
        guide.__class__ = cls


# -- the disk cache of compiled programs ------------------------------------------------------------
_DISK_FORMAT = "numpyro_blr-program-2"
_DISK = {"dir": None, "hits": 0, "misses": 0, "writes": 0, "reasons": collections.Counter()}
_DISK_LOCK = threading.Lock()
#: JAX settings that change a program's lowering without changing its jaxpr (the key includes them)
_DISK_CONFIG = ("jax_enable_x64", "jax_default_matmul_precision", "jax_default_prng_impl", "jax_threefry_partitionable",
                "jax_enable_custom_prng", "jax_numpy_dtype_promotion", "jax_numpy_rank_promotion",
                "jax_use_shardy_partitioner", "jax_debug_nans", "jax_debug_infs", "jax_disable_jit")


class _Unstable(Exception):
    """A value with no description that is the same in every process (a function, a foreign object)."""


def _type_name(cls):
    return f"{cls.__module__}.{cls.__qualname__}"


def _array_text(a):
    """``dtype shape sha256`` of a concrete array (a PRNG key by its key data)."""
    if isinstance(a, jax.core.Tracer):
        raise _Unstable("a traced value")
    dtype = str(a.dtype)
    if jax.dtypes.issubdtype(a.dtype, jax.dtypes.prng_key):
        a = jax.random.key_data(a)
    host = np.ascontiguousarray(np.asarray(a))
    if host.dtype.hasobject:
        raise _Unstable("an object array")
    return f"{dtype}{host.shape}:{hashlib.sha256(host.tobytes()).hexdigest()}"


def _stable(value, owner=None, depth=0, active=None):
    """A text for a configuration value that is the same in every process and differs where the value
    does; raise :class:`_Unstable` where there is none (a function outside this package, a foreign object:
    their identity is all that is known; a cycle). Bound methods of ``owner`` are named by their function,
    this package's functions by their name and what they close over."""
    if value is None or isinstance(value, (bool, int, float, complex, str, bytes)):
        return f"{type(value).__name__}:{value!r}"
    if isinstance(value, (np.ndarray, np.generic, jax.Array)):
        return _array_text(np.asarray(value) if isinstance(value, np.generic) else value)
    if isinstance(value, types.ModuleType):
        return "module:" + value.__name__
    if isinstance(value, types.MethodType) and owner is not None and value.__self__ is owner:
        return "self." + value.__func__.__qualname__
    active = set() if active is None else active
    if depth > 32 or id(value) in active:
        raise _Unstable("too deep, or a cycle")
    active.add(id(value))
    try:
        return _stable_container(value, owner, depth, active)
    finally:
        active.discard(id(value))


def _stable_container(value, owner, depth, active):
    def sub(v):
        return _stable(v, owner, depth + 1, active)

    if isinstance(value, (tuple, list)):
        return _type_name(type(value)) + "(" + ",".join(sub(v) for v in value) + ")"
    if isinstance(value, dict):
        return "dict(" + ",".join(f"{k}:{v}" for k, v in sorted((sub(k), sub(v)) for k, v in value.items())) + ")"
    if isinstance(value, types.FunctionType) and value.__module__.split(".")[0] == "numpyro_blr":
        try:
            cells = [c.cell_contents for c in value.__closure__ or ()]  # a closure: by what it closes over
        except ValueError as err:  # an empty cell
            raise _Unstable("an empty cell") from err
        return f"{value.__module__}.{value.__qualname__}" + sub(cells)
    if isinstance(value, functools.partial):
        return "partial" + sub((value.func, value.args, value.keywords))
    if type(value).__module__.split(".")[0] == "numpyro_blr" and hasattr(value, "__dict__"):
        return _type_name(type(value)) + sub(vars(value))
    raise _Unstable(type(value).__qualname__)


def _optimizer_text(optim):
    """Our optimizers by their type and configuration (caches left out); others raise :class:`_Unstable`."""
    from numpyro_blr.svi import GuideOptimizer

    if not isinstance(optim, GuideOptimizer):
        raise _Unstable(type(optim).__qualname__)
    config = {k: v for k, v in vars(optim).items() if k not in ("_traced_layouts", "_state_shapes", "packed_guide")}
    return _type_name(type(optim)) + _stable(config, owner=optim)


def _loss_text(loss):
    """NumPyro's and our ELBOs by their type and options; others raise :class:`_Unstable`."""
    if type(loss).__module__.split(".")[0] not in ("numpyro", "numpyro_blr") or not hasattr(loss, "__dict__"):
        raise _Unstable(type(loss).__qualname__)
    config = dict(vars(loss))
    if isinstance(config.get("vectorize_particles"), bool):  # the function is made from the flag
        config.pop("vectorize_particles_fn", None)
    return _type_name(type(loss)) + _stable(config)


@functools.lru_cache(maxsize=1)
def _source_digest():
    """sha256 of this package's source files: a program written by other code of the same version is not read."""
    root = pathlib.Path(__file__).resolve().parent
    h = hashlib.sha256()
    for f in sorted(root.rglob("*.py")):
        h.update(str(f.relative_to(root)).encode() + b"\0" + f.read_bytes() + b"\0")
    return h.hexdigest()


def _environment_text():
    import jaxlib
    import numpyro

    import numpyro_blr

    device = jax.devices()[0]
    config = tuple((n, repr(getattr(jax.config, n, None))) for n in _DISK_CONFIG)
    return repr((_DISK_FORMAT, jax.__version__, jaxlib.__version__, numpyro.__version__, numpyro_blr.__version__,
                 _source_digest(), jax.default_backend(), device.platform, device.device_kind,
                 getattr(device.client, "platform_version", ""), jax.device_count(), config,
                 os.environ.get("XLA_FLAGS", ""), os.environ.get("LIBTPU_INIT_ARGS", "")))


def _disk_config(optim, loss, num_steps, chunk, stable_update, signature, effort, compiler_options):
    """The text of what keys a :func:`fit` program besides its traced start (``None`` where some of it has no
    text that is the same in every process: then the disk cache is not used)."""
    if _DISK["dir"] is None:
        return None
    treedef, is_array, static = signature
    try:
        return repr((_environment_text(), _optimizer_text(optim), _loss_text(loss),
                     num_steps, chunk, stable_update, str(treedef), is_array,
                     [_stable(x) for x in static], effort, sorted((compiler_options or {}).items())))
    except Exception:  # noqa: BLE001 - _Unstable, or anything unexpected: no disk cache for this program
        return None


def _guide_text(guide):
    """The guide's class and its options that are numbers, strings or tuples of them (``rank``, ``init_scale``):
    those its setup's trace may not show as values."""
    options = []
    for k, v in sorted(vars(guide).items()) if hasattr(guide, "__dict__") else ():
        try:
            if v is None or isinstance(v, (bool, int, float, str, tuple)):
                options.append((k, _stable(v)))
        except _Unstable:
            pass
    return _type_name(type(guide)) + repr(options)


def _avals_text(tree):
    """The arguments' tree, dtypes, shapes, weak types and placement (what a compiled program is specialised to)."""
    leaves, treedef = jax.tree.flatten(tree)
    return str(treedef) + repr([(str(x.dtype), tuple(x.shape), bool(getattr(x, "weak_type", False)),
                                 repr(getattr(x, "sharding", None))) for x in leaves])


def _jaxpr_text(closed):
    """The jaxpr's text and its constants' values (what the trace captured: the model, the guide, the loss)."""
    return str(closed.jaxpr) + repr([_array_text(c) if hasattr(c, "dtype") else _stable(c) for c in closed.consts])


def _arrays_text(root):
    """The values of the concrete arrays reachable from ``root`` (the set-up guide, SVI and optimizer), in the
    walk's order: what a program traced after the setup may hold as constants."""
    found = []

    def visit(value):
        if isinstance(value, (np.ndarray, np.generic, jax.Array, float, complex)) and not isinstance(value, jax.core.Tracer):
            found.append(value)

    _replace_tracers(root, lambda t: t, visit=visit)
    h = hashlib.sha256()
    for value in found:
        h.update((repr(value) if isinstance(value, (float, complex)) else _array_text(value)).encode())
    return h.hexdigest()


def _custom_calls(lowered):
    import re

    text = lowered.as_text()
    return sorted(set(re.findall(r"custom_call @([\w.$-]+)", text)) | set(re.findall(r'call_target_name = "([^"]+)"', text)))


#: custom calls that XLA itself implements (its GPU backend allocates a scan's buffers through ``AllocateBuffer``)
_XLA_CUSTOM_CALLS = frozenset({"AllocateBuffer", "Sharding", "SPMDFullToShardShape", "SPMDShardToFullShape",
                               "annotate_device_placement", "MoveToHost", "MoveToDevice", "SliceToDynamic",
                               "PadToStatic"})


def _loadable_custom_calls(names):
    """Whether every custom call of a program resolves in a fresh process that did not lower it: XLA's own,
    LAPACK's (initialised before loading) and those jaxlib registers at import; never a host callback."""
    registered = set(_XLA_CUSTOM_CALLS)
    try:
        from jax._src.lib import gpu_linalg, gpu_solver, gpu_sparse

        for module in (gpu_linalg, gpu_solver, gpu_sparse):
            for targets in (module.registrations().values() if hasattr(module, "registrations") else ()):
                registered.update(name for name, *_ in targets)
    except Exception:  # noqa: BLE001
        pass
    return all(n.startswith("lapack_") or n in registered for n in names)


def _disk_path(key):
    return pathlib.Path(_DISK["dir"]) / f"{key}.nbexe"


def _disk_read(key):
    """The entry written under ``key`` (a dict), or ``None``."""
    import pickle

    try:
        raw = _disk_path(key).read_bytes()
    except OSError:
        return None
    try:
        head, payload = pickle.loads(raw)
        if head.get("format") != _DISK_FORMAT or head.get("sha256") != hashlib.sha256(payload).hexdigest():
            return None
        entry = pickle.loads(payload)
        return entry if isinstance(entry, dict) and entry.get("key") == key else None
    except Exception:  # noqa: BLE001 - a damaged or foreign file: compile instead
        return None


def _disk_write(key, compiled, lowered, signature):
    """Write ``compiled`` under ``key`` (atomically); nothing where it cannot be written or loaded back."""
    import pickle

    from jax.experimental import serialize_executable

    try:
        calls = _custom_calls(lowered)
        if not _loadable_custom_calls(calls):
            return False
        blob, in_tree, out_tree = serialize_executable.serialize(compiled)
        payload = pickle.dumps({"key": key, "exe": blob, "in_tree": in_tree, "out_tree": out_tree,
                                "signature": signature, "custom_calls": calls, "devices": _program_devices(compiled)},
                               protocol=pickle.HIGHEST_PROTOCOL)
        pickle.loads(payload)  # the trees must load back (a pytree node registered under a local name may not)
        raw = pickle.dumps(({"format": _DISK_FORMAT, "sha256": hashlib.sha256(payload).hexdigest()}, payload),
                           protocol=pickle.HIGHEST_PROTOCOL)
        path = _disk_path(key)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f"{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
        tmp.write_bytes(raw)
        os.replace(tmp, path)
    except Exception:  # noqa: BLE001 - not serialisable (constants passed as arguments, callbacks), disk full, ...
        return False
    with _DISK_LOCK:
        _DISK["writes"] += 1
    return True


def _disk_load(entry):
    """A ``jax.stages.Compiled`` from an entry (LAPACK initialised first: a fresh process that never lowered a
    factorisation has not resolved its functions, and the executable would call a null pointer)."""
    from jax.experimental import serialize_executable

    if any(n.startswith("lapack_") for n in entry["custom_calls"]):
        from jax._src.lax.linalg import initialize_lapack

        initialize_lapack()
    by_id = {d.id: d for d in jax.devices()}
    devices = [by_id[i] for i in entry["devices"]]  # KeyError where the device is not here: compiled instead
    return serialize_executable.deserialize_and_load(entry["exe"], entry["in_tree"], entry["out_tree"],
                                                     execution_devices=devices)


def _program_devices(compiled):
    """The ids of the devices a compiled program runs on (its inputs' placement; the default device where it has
    no sharded input). A loaded program must be given them: by default it would run on every local device, and a
    one-device program then fails on a machine with several (``--xla_force_host_platform_device_count``, GPUs)."""
    ids = set()
    for sharding in jax.tree.leaves(compiled.input_shardings):
        ids.update(d.id for d in sharding.device_set)
    return sorted(ids) or [jax.devices()[0].id]


def _disk_count(what, reason=None):
    with _DISK_LOCK:
        _DISK[what] += 1
        if reason is not None:
            _DISK["reasons"][reason] += 1


def _digest(*parts):
    return hashlib.sha256(repr(parts).encode()).hexdigest()


# -- the programs ---------------------------------------------------------------------------------
COMPILE_EFFORTS = ("auto", "low", "high")


#: above this many (data elements x fits x steps) the steps outweigh what "low" saves in compiling
AUTO_HIGH_WORK = 5e7


def resolve_effort(effort, arrays, fits=1, steps=1000):
    """``"low"`` or ``"high"`` for ``compile_effort``. ``"auto"`` is ``"low"`` on CPU while the run is short
    against the compile time it saves, and ``"high"`` when the persistent cache is on (the program is compiled
    once and run in every later process) or when (data elements x fits x steps) > :data:`AUTO_HIGH_WORK`.

    Measured on this 2-core machine (``bench/bench_workflow.py``): breast cancer (18k data elements),
    ``AutoMultivariateNormal``, one fit of 1,000 steps: "low" compiles in 1.2 s instead of 1.9 s and runs in
    0.29 s instead of 0.10 s (1.8e7: low); its 10-fold CV (11 fits): 6.4 s cold with "low", 5.1 s with
    "high" (2e8: high); SBC of eight schools (16 elements, 100 fits): 4.7 s with "low", 5.2 s with "high"
    (1.6e6: low)."""
    if effort != "auto":
        return effort
    if jax.default_backend() != "cpu" or jax.config.jax_compilation_cache_dir:
        return "high"
    size = sum(int(np.size(a)) for a in jax.tree.leaves(arrays))
    return "high" if size * fits * steps > AUTO_HIGH_WORK else "low"


def _compiler_options(effort):
    """XLA options for a resolved ``compile_effort``: ``"low"`` turns LLVM's optimisation off on the CPU
    backend (``xla_backend_optimization_level=0``; :func:`resolve_effort` says when it pays)."""
    if effort == "low" and jax.default_backend() == "cpu":
        return {"xla_backend_optimization_level": 0}
    return None


def _unvalidated(guide):
    """``guide`` with NumPyro's distribution checks off while it runs. They only act on concrete values, which
    in a traced program are the guide's own initial constants: checking ``AutoMultivariateNormal``'s initial
    ``scale_tril`` compiled about 20 one-operation programs and took half the tracing time (0.5 of 1.1 s on
    breast cancer), with nothing to find. The model's distributions are still checked."""
    from numpyro.distributions.distribution import validation_enabled

    def unvalidated_guide(*args, **kwargs):
        with validation_enabled(False):
            return guide(*args, **kwargs)

    unvalidated_guide.guide = guide
    return unvalidated_guide


class _Program:
    """The compiled pieces of one cache entry (one model, guide, optimizer, loss, capacity of steps).

    ``data`` is ``(arrays, extra)``: the array leaves of the call's ``(args, kwargs)`` and a dict of
    further keyword arrays: the step counts (``_STEPS``, and the workflow's ``_WARM_STEPS``), which the model does
    not see, and the workflow's per-fit masks or simulated data.
    ``disk`` (:func:`_disk_config`'s text, :func:`fit` only) puts :meth:`run`'s programs in the disk cache
    (:meth:`_start_program`, :meth:`_later_program`); the workflow's programs (:meth:`many`, :meth:`chain`)
    are not.
    """

    def __init__(self, model, guide, optim, loss, *, num_steps, chunk, stable_update, rebuild, compiler_options,
                 owner=None, post=None, batch_size=None, disk=None, capacity=None):
        self.svi = SVI(model, _unvalidated(guide), optim, loss)
        self.svi.reads_its_guide = False  # the optimizer was bound to the user's guide (_bound) before the program
        self.owner = guide if owner is None else owner  # the object a guide's setup is stored in
        self.num_steps, self.chunk = num_steps, chunk
        self.capacity = capacity  # fit's programs: the step count is an argument (_STEPS), at most this many; the
        # workflow's (many, chain) read theirs from the data too, without a buffer of losses (None)
        self.stable_update = stable_update
        self.rebuild = rebuild
        self.post, self.batch_size = post, batch_size
        self.setup = _Setup()
        self.lock = threading.Lock()
        self.disk = disk  # what keys the program on disk besides its traced start (_disk_config); None: not on disk
        self._compiled = {}  # (name, input avals) -> (callable, key of the traced start): the disk cache's programs
        self._stale = None  # the tracers of a start traced for the key only, which the program's own trace replaces
        # A NumPyro autoguide whose setup the program traces: its attributes before any setup, and after the fit on
        # arguments of each abstract signature (a model whose latent sites' shapes follow the data's needs the setup
        # of those shapes: a new signature is traced from the guide as built, a known one gets its setup back)
        self._pristine = _vars_copy(self.owner) if _pristine_autoguide(self.owner) else _built(self.owner)
        self._setups = {}
        self._traced = set()  # (program, arguments' signature) pairs traced: _use_setup
        jit = functools.partial(jax.jit, compiler_options=compiler_options) if compiler_options else jax.jit
        self._jit = jit
        self._run = jit(self._run_fn)
        self._init = jit(self._init_fn)
        self._init_from = jit(self._init_from_fn)
        self._steps = jit(self._steps_fn)
        self._params = jit(self._params_fn)
        self._many = jit(self._many_fn)
        self._chain = jit(self._chain_fn)

    def _arguments(self, data):
        arrays, extra = data
        args, kwargs = self.rebuild(arrays)
        if _STEPS in extra or _WARM_STEPS in extra:
            extra = {k: v for k, v in extra.items() if k not in (_STEPS, _WARM_STEPS)}
        return args, {**kwargs, **extra}

    def _update(self, state, data):
        args, kwargs = self._arguments(data)
        svi = self.svi
        return (svi.stable_update if self.stable_update else svi.update)(state, *args, **kwargs)

    def _steps_upto(self, state, data):
        """``(state, losses)`` after the number of steps in the arguments (``data``'s ``_STEPS``, traced): a loop of
        that many steps, the losses written into a buffer of ``self.capacity`` (NaN past the count). The buffer is
        of the widest float JAX has here, each loss converted to it exactly, and it is converted back to the losses'
        dtype (known once the loop's step is traced) after the loop: the values are the step's own."""
        dtypes = []

        def body(carry):
            i, s, losses = carry
            s, loss = self._update(s, data)
            dtypes.append(jnp.result_type(loss))
            return i + 1, s, losses.at[i].set(loss.astype(losses.dtype))

        n = data[1][_STEPS]
        losses = jnp.full((self.capacity,), jnp.nan, jnp.result_type(float))
        _, state, losses = lax.while_loop(lambda c: c[0] < n, body, (jnp.zeros((), n.dtype), state, losses))
        return state, losses.astype(dtypes[-1])

    def _start(self, rng_key, data, checks=True, init_params=None):
        args, kwargs = self._arguments(data)
        if checks:
            check_observations(self.svi.model, args, kwargs)
        with _model_site_order(self.owner):
            if init_params is None:
                state = self.svi.init(rng_key, *args, **kwargs)
            else:  # a warm start: the guide's parameters (constrained) from an earlier fit, a fresh optimizer state
                state = self.svi.init(rng_key, *args, init_params=init_params, **kwargs)
        if checks and not hasattr(self.owner, "prototype_trace"):  # an autoguide's sites are its model's (fit
            check_guide_sites(self.svi, state, args, kwargs)          # checked guide.model): a function guide's may not be
        return state

    def _run_fn(self, rng_key, data):
        state = self._start(rng_key, data)
        state, losses = self._steps_upto(state, data)
        return state, losses, self.svi.get_params(state), self.setup.collect(self.svi, (rng_key, data))

    def _init_fn(self, rng_key, data):
        state = self._start(rng_key, data)
        return state, self.setup.collect(self.svi, (rng_key, data))

    def _init_from_fn(self, rng_key, data, init_params):
        """:meth:`_init_fn` with the guide's ``param`` sites at ``init_params`` (``svi.init(..., init_params=...)``)."""
        state = self._start(rng_key, data, init_params=init_params)
        return state, self.setup.collect(self.svi, (rng_key, data))

    def _key_fn(self, rng_key, data, with_loss=True):
        """The start of a fit (the guide's setup, ``svi.init``), and with ``with_loss`` the loss there. With the
        disk cache on, the jaxpr of this trace keys the programs on disk, and this is the program that starts a
        fit shown with a progress bar (its outputs: the state, the loss, the guide's traced setup values).
        The trace holds the model's density (an autoguide's setup evaluates it and its gradient to find valid
        initial values), the guide (``svi.init`` runs it) and, with the loss, the ELBO: the loss is left out
        only where the setup is traced and the guide's class is NumPyro's or ours (its code is then keyed by the
        versions); it costs a third more than the start alone in a fresh process (0.35 s instead of 0.1 s on
        eight schools with ``AutoMultivariateNormal``: first traces of NumPyro's and JAX's helpers)."""
        state = self._start(rng_key, data)
        out = (state,)
        if with_loss:
            args, kwargs = self._arguments(data)
            out += (self.svi.evaluate(state, *args, **kwargs),)
        return (*out, self.setup.collect(self.svi, (rng_key, data)))

    def _steps_fn(self, state, data):
        return self._steps_upto(state, data)

    def _params_fn(self, state):
        return self.svi.get_params(state)  # under jit: no warnings, and the constraints in one program

    def _many_fn(self, rng_keys, data, batch, init_params=None):
        """One fit per leading index of ``rng_keys`` and of the arrays in ``batch`` (keyword arguments
        added to each fit's), vectorised ``batch_size`` fits at a time; ``post(params, key, args, kwargs)``
        is evaluated on each fit inside the program. ``init_params`` (constrained, shared by every fit):
        each fit starts from these guide parameters (``svi.init(..., init_params=...)``: the optimizer's
        state is a fresh one, only the guide's starting point is given). Each fit runs the number of steps
        in ``data``'s ``_STEPS`` (an argument: another count runs the same program); the losses are not kept."""
        arrays, extra = data
        n = extra[_STEPS]
        leaked = []
        if self.needs_setup():  # the guide's setup, traced once outside the vectorised fits (its values are outputs)
            self._start(rng_keys[0], (arrays, {**extra, **jax.tree.map(lambda v: v[0], batch)}))
            leaked = self.setup.collect(self.svi, (rng_keys, data, batch, init_params))

        def one(xs):
            key, b = xs
            fit_key, post_key = jax.random.split(key)
            d = (arrays, {**extra, **b})
            state = self._start(fit_key, d, checks=False, init_params=init_params)
            state = lax.fori_loop(0, n, lambda _, s: self._update(s, d)[0], state)
            params = self.svi.get_params(state)
            out = self.post[0](params, post_key, *self._arguments(d), *self.post[1:]) if self.post else ()
            return state, (), params, out

        xs = (rng_keys, batch)
        m = len(rng_keys)
        size = min(self.batch_size or m, m)
        if size >= m:
            return (*jax.vmap(one)(xs), leaked)
        full = (m // size) * size  # lax.map over groups of `size` fits, vmapped within a group; then the rest
        grouped = jax.tree.map(lambda x: x[:full].reshape((m // size, size) + x.shape[1:]), xs)
        out = jax.tree.map(lambda x: x.reshape((full,) + x.shape[2:]), lax.map(jax.vmap(one), grouped))
        if full < m:
            rest = jax.vmap(one)(jax.tree.map(lambda x: x[full:], xs))
            out = jax.tree.map(lambda a, b: jnp.concatenate([a, b]), out, rest)
        return (*out, leaked)

    def _chain_fn(self, rng_keys, data, batch, init_params=None):
        """Warm-started fits one after another, in one loop: fit ``i`` with its slice of ``batch``. Without
        ``init_params``, fit 0 starts from the guide's initialisation and runs ``num_steps`` steps, and every
        later fit starts from fit 0's parameters; with them, every fit starts from ``init_params``. A warm
        start is ``svi.init(..., init_params=...)`` (constrained parameters; a fresh optimizer state) followed
        by ``warm_steps`` steps. Both counts are arguments (``data``'s ``_STEPS`` and ``_WARM_STEPS``): other
        counts run the same program. ``post`` is evaluated on each fit. One fit's code in the program whatever
        the number of fits: on CPU a vectorised fit costs about as much per step as a fit of its own, so the
        loop loses no time to :meth:`_many_fn` and compiles once for the first fit and the warm ones."""
        arrays, extra = data
        num_steps, warm_steps = extra[_STEPS], extra[_WARM_STEPS]
        leaked = []
        first = (arrays, {**extra, **jax.tree.map(lambda v: v[0], batch)})
        setup = self.needs_setup()  # the guide's setup, traced once outside the loop (its values are outputs)
        expected = self.svi.get_params(self._start(rng_keys[0], first, checks=setup))  # the parameters' structure
        if setup:
            leaked = self.setup.collect(self.svi, (rng_keys, data, batch, init_params))
        given = init_params is not None
        if not given:  # the loop's carry: fit 0's parameters once it has run
            init_params = expected
        elif set(init_params) != set(expected):
            raise ValueError(f"the full-data fit to start from has the parameters {sorted(init_params)}, but this guide's "
                             f"are {sorted(expected)}: pass the result of a fit of this guide.")
        else:
            init_params = {k: jnp.asarray(v, dtype=jnp.result_type(expected[k])).reshape(jnp.shape(expected[k]))
                           for k, v in init_params.items()}

        def body(carry, xs):
            i, key, b = xs
            fit_key, post_key = jax.random.split(key)
            d = (arrays, {**extra, **b})
            warm = self._start(fit_key, d, checks=False, init_params=carry)
            if given:
                state, steps = warm, warm_steps
            else:
                cold = self._start(fit_key, d, checks=False)
                state = jax.tree.map(lambda c, w: jnp.where(i == 0, c, w), cold, warm)
                steps = jnp.where(i == 0, num_steps, warm_steps)
            state = lax.fori_loop(0, steps, lambda _, s: self._update(s, d)[0], state)
            params = self.svi.get_params(state)
            out = self.post[0](params, post_key, *self._arguments(d), *self.post[1:]) if self.post else ()
            if not given:
                carry = jax.tree.map(lambda c, p: jnp.where(i == 0, p, c), carry, params)
            return carry, (state, params, out)

        xs = (jnp.arange(len(rng_keys)), rng_keys, batch)
        _, (states, params, out) = lax.scan(body, init_params, xs)
        return states, (), params, out, leaked

    def chain(self, rng_keys, data, batch, init_params=None):
        """``(states, (), params, post)`` of ``len(rng_keys)`` warm-started fits (:meth:`_chain_fn`)."""
        first = (data[0], {**data[1], **jax.tree.map(lambda v: v[0], batch)})
        self.setup_eagerly(lambda: jax.random.split(rng_keys[0])[0], first)
        with self.lock:
            sig = self._use_setup((rng_keys, data, batch, init_params), program="chain")
            try:
                *result, leaked = self._chain(rng_keys, data, batch, init_params)
            except Exception:
                if _guide_has_setup(self.owner) and _leaked_tracers(self.owner):  # a failed trace: set up afresh next time
                    self.owner.prototype_trace = None
                raise
            self.setup.restore(self.svi, (rng_keys, data, batch, init_params), leaked,
                               lambda: self._resetup(rng_keys[0], first))
            self._keep_setup(sig, "chain")
        return result

    def needs_setup(self):
        return getattr(self.owner, "prototype_trace", False) is None

    def setup_eagerly(self, rng_key, data):
        """Set up a guide whose setup reads concrete values eagerly, with the key ``svi.init`` gives it:
        ``nb.ExpFamilyGuide`` picks each site's initial parameters from the prior's mean where it is finite,
        ``nb.LieGroupGuide`` checks its base distributions' moments."""
        from numpyro_blr.guides import ExpFamilyGuide
        from numpyro_blr.liegroup_guide import LieGroupGuide

        owner = self.owner
        if (isinstance(owner, ExpFamilyGuide) and owner.sites is None) or (
                isinstance(owner, LieGroupGuide) and owner.prototype_trace is None):
            args, kwargs = self._arguments(data)
            rng_key = rng_key() if callable(rng_key) else rng_key  # a key made only where it is needed
            guide_key = jax.random.split(rng_key, 3)[2]  # as SVI.init splits its key
            handlers.seed(self.svi.guide, guide_key)(*args, **kwargs)

    def _resetup(self, rng_key, data):
        """Set the guide up eagerly, as ``SVI.run`` does (the fallback when traced values are left)."""
        if _guide_has_setup(self.owner):
            self.owner.prototype_trace = None
        args, kwargs = self._arguments(data)
        self.svi.init(rng_key, *args, **kwargs)

    def _call(self, fn, rng_key, data, program=None):
        """``fn(rng_key, data)`` (a program that starts a fit), then the guide's traced values put back. ``fn``
        may be a name ("run" or "init"): the program is then :meth:`_start_program`'s. ``program`` names another
        ``fn`` (:meth:`_use_setup`). Returns the results and the key of the traced start (``None`` off the disk
        cache)."""
        with self.lock:
            base, snapshot = None, None
            program = fn if isinstance(fn, str) else program
            sig = self._use_setup((rng_key, data), program=program)
            if isinstance(fn, str):
                name = fn
                fn, base, snapshot = self._start_program(name, rng_key, data)
            try:
                *result, leaked = fn(rng_key, data)
            except Exception as err:
                if snapshot is None:
                    raise
                # a program read from disk that does not run here: the guide as before the key's trace, then today's path
                with _DISK_LOCK:
                    _DISK["reasons"][f"{name}: read but failed to run ({type(err).__name__})"] += 1
                self.setup.pending, self._stale = None, None
                self._restore_snapshot(snapshot)
                jitted = self._run if name == "run" else self._init
                self._compiled.update({k: (jitted, None, None) for k, v in self._compiled.items() if v[0] is fn})
                fn, base = jitted, None
                *result, leaked = fn(rng_key, data)
            self.setup.restore(self.svi, (rng_key, data), leaked, lambda: self._resetup(rng_key, data))
            stale, self._stale = self._stale, None
            if stale:  # a value of the key's trace that the program's trace did not replace: set up afresh
                ids = {id(t) for t in stale}
                if any(id(t) in ids for t in _leaked_tracers(self.svi)):
                    self._resetup(rng_key, data)
            self._keep_setup(sig, program)
        return result, base

    def _keep_setup(self, sig, program=None):
        if sig is not None and not self.needs_setup():
            self._setups[sig] = _vars_copy(self.owner)
            if program is not None:
                self._traced.add((program, sig))

    def _use_setup(self, args, known_only=False, program=None):
        """Before a program that starts a fit (or many) on ``args``: the guide as set up for arguments of these shapes
        by an earlier call, or as built (its setup is then traced; with ``known_only``, as it is). Returns the
        arguments' abstract signature (``None`` for a guide whose setup is not the program's).

        ``program`` names the program about to run: where it has not run on arguments of these shapes (it is about
        to be traced), the guide is as built even where another program set it up for them, so that its setup is
        traced into this program too. Traced with the guide already set up, the program would hold that setup's
        values as constants: an autoguide's initial locations drawn with the earlier fit's key (a fit with a progress
        bar after one without, on the same shapes, started where the earlier key's fit had started)."""
        if self._pristine is None:
            return None
        try:
            sig = _avals_text(args)
        except Exception:  # noqa: BLE001 - keep the guide as it is
            return None
        if program is not None and (program, sig) not in self._traced:
            _assign_vars(self.owner, self._pristine)
        elif sig in self._setups or not known_only:
            _assign_vars(self.owner, self._setups.get(sig, self._pristine))
        return sig

    # -- the disk cache (enable_compilation_cache) ----------------------------------------------------------
    def _snapshot(self):
        """The attributes of the guide, the SVI object and the optimizer (a trace sets them)."""
        return [(o, dict(vars(o))) for o in (self.owner, self.svi, self.svi.optim) if hasattr(o, "__dict__")]

    @staticmethod
    def _restore_snapshot(snapshot):
        for obj, saved in snapshot:
            d = vars(obj)
            d.clear()
            d.update(saved)

    def _start_program(self, name, rng_key, data):
        """``(program, key, snapshot)`` for a fit that starts from ``rng_key`` ("run": init and every step;
        "init": the start of a fit with a progress bar). Off the disk cache: the jitted program. On it, the
        start is traced (:meth:`_key_fn`) to key the program, and a program written under that key, by this
        process or an earlier one, is loaded instead of tracing and lowering the steps; ``snapshot`` is the
        objects' state before that trace, to fall back to. Under ``self.lock`` (a trace sets the guide up)."""
        jitted = self._run if name == "run" else self._init
        if self.disk is None or _DISK["dir"] is None:
            return jitted, None, None
        args = (rng_key, data)
        try:
            sig = _avals_text(args)
        except Exception:  # noqa: BLE001
            return jitted, None, None
        if (name, sig) not in self._compiled:
            self._compiled[(name, sig)] = self._disk_start(name, jitted, args, sig)
        fn, base, snapshot = self._compiled[(name, sig)]
        self._compiled[(name, sig)] = (fn, base, None)  # the snapshot is for the first call only
        return fn, base, snapshot

    def _disk_start(self, name, jitted, args, sig):
        snapshot = self._snapshot()
        try:
            before = _arrays_text(self.svi), _guide_text(self.owner)  # a guide set up before: constants of the program
            known = type(self.owner).__module__.split(".")[0] in ("numpyro", "numpyro_blr")
            with_loss = not (known and self.needs_setup())  # else the setup's trace holds the model's density
            traced = self._jit(functools.partial(self._key_fn, with_loss=with_loss)).trace(*args)
            key_sig = self.setup.signature
            base = _digest(self.disk, with_loss, _jaxpr_text(traced.jaxpr), sig, before)
            key = _digest(base, name)
            key_out = jax.tree.structure(traced.out_info)
        except Exception:  # noqa: BLE001 - the program's own trace says what fails, if anything
            self.setup.pending = None
            self._restore_snapshot(snapshot)
            return jitted, None, None
        entry, reason = _disk_read(key), "not found"
        if entry is not None:
            reason = "another output tree or setup order"
            try:
                out = entry["out_tree"]
                if name == "init":
                    ok = out == key_out
                else:  # (state, losses, params, leaked): the state as the start's, the leaked values as many
                    parts = out.children()
                    ok = len(parts) == 4 and parts[0] == key_out.children()[0] and parts[3].num_leaves == len(key_sig)
                if ok and entry["signature"] == key_sig and entry["in_tree"] == jax.tree.structure((args, {})):
                    compiled = _disk_load(entry)
                    _disk_count("hits")
                    return compiled, base, snapshot
            except Exception as err:  # noqa: BLE001 - anything unexpected: compile instead
                reason = f"load failed ({type(err).__name__})"
        _disk_count("misses", f"{name}: {reason}")
        if name == "init":  # the key's trace is this program: lower it
            try:
                lowered = traced.lower()
                compiled = lowered.compile()
            except Exception:  # noqa: BLE001
                self.setup.pending = None
                self._restore_snapshot(snapshot)
                return jitted, None, None
            _disk_write(key, compiled, lowered, key_sig)
            return compiled, base, None
        # "run": trace the whole program, from the objects' state before the key's trace
        stale = _leaked_tracers(self.svi)
        self._restore_snapshot(snapshot)
        self.setup.pending = None
        lowered = jitted.trace(*args).lower()
        compiled = lowered.compile()
        self._stale = stale
        if self.setup.signature == key_sig:  # the same setup values in the same order as the key's trace
            _disk_write(key, compiled, lowered, key_sig)
        return compiled, base, None

    def _later_program(self, name, args, base):
        """The program ``name`` ("steps", "params") on ``args``, after a start keyed ``base``: read from or written
        to disk under ``base``, the values of the set-up guide (constants of this program) and the arguments'
        shapes; the jitted program off the disk cache or on any doubt."""
        jitted = self._steps if name == "steps" else self._params
        if base is None or _DISK["dir"] is None:
            return jitted
        try:
            sig = _avals_text(args)
            found = self._compiled.get((name, sig))
            if found is not None:
                return found[0]
            key = _digest(base, name, sig, _arrays_text(self.svi))
        except Exception:  # noqa: BLE001
            return jitted
        fn, entry, reason = None, _disk_read(key), "not found"
        if entry is not None:
            reason = "another tree"
            try:
                out = entry["out_tree"]
                ok = entry["in_tree"] == jax.tree.structure((args, {}))
                if name == "steps":
                    ok = ok and out.children()[0] == jax.tree.structure(args[0])
                if ok:
                    fn = _guarded(_disk_load(entry), jitted)
                    _disk_count("hits")
            except Exception as err:  # noqa: BLE001
                fn, reason = None, f"load failed ({type(err).__name__})"
        if fn is None:
            _disk_count("misses", f"{name}: {reason}")
            lowered = jitted.trace(*args).lower()
            fn = lowered.compile()
            _disk_write(key, fn, lowered, ())
        self._compiled[(name, sig)] = (fn, base, None)
        return fn

    def many(self, rng_keys, data, batch, init_params=None):
        """``(states, (), params, post)`` of ``len(rng_keys)`` fits, each with its slice of ``batch``
        (each started from ``init_params`` when given: :meth:`_many_fn`)."""
        first = (data[0], {**data[1], **jax.tree.map(lambda v: v[0], batch)})
        self.setup_eagerly(lambda: jax.random.split(rng_keys[0])[0], first)
        with self.lock:
            sig = self._use_setup((rng_keys, data, batch, init_params), program="many")
            *result, leaked = self._many(rng_keys, data, batch, init_params)
            self.setup.restore(self.svi, (rng_keys, data, batch, init_params), leaked,
                               lambda: self._resetup(rng_keys[0], first))
            self._keep_setup(sig, "many")
        return result

    def run(self, rng_key, data, init_state, progress_bar, num_steps=None, chunk=None):
        """``(state, losses, params)`` of a fit from ``rng_key`` (or continued from ``init_state``): ``num_steps``
        steps in calls of ``chunk`` (default: the program's own). A program with a ``capacity`` reads each call's
        count from ``data`` (``_STEPS``, which :func:`fit` sets to ``chunk``)."""
        num_steps = self.num_steps if num_steps is None else num_steps
        chunk = self.chunk if chunk is None else chunk
        if init_state is None:
            self.setup_eagerly(rng_key, data)
        if init_state is None and not progress_bar:
            state, losses, params = self._call("run", rng_key, data)[0]
            return state, self._first(losses, num_steps), params
        base = None
        if init_state is None:
            result, base = self._call("init", rng_key, data)
            init_state = result[0]  # the disk cache's start also gives the loss there
        else:  # a fit continued: the guide as set up for these shapes, where a fit of them set it up
            with self.lock:
                self._use_setup((rng_key, data), known_only=True)
            if self.needs_setup():  # this program has not started a fit of these shapes (the earlier fit ran
                self._call("init", rng_key, data)  # another: other steps or options): its start sets the guide up
        state, losses = self._continue(init_state, data, progress_bar, base, num_steps, chunk)
        with self.lock:
            params = self._later_program("params", (state,), base)(state)
        return state, losses, params

    def _first(self, losses, n):
        """The losses of a call's ``n`` steps, the first ``n`` of the program's buffer (sliced on the host and put back
        with ``jax.device_put``: a slice on the device, or ``jnp.asarray`` of the host array, would compile a small
        program for each ``n``)."""
        return jax.device_put(np.asarray(losses)[:n])

    def _continue(self, state, data, progress_bar, base=None, num_steps=None, chunk=None):
        import tqdm

        num_steps = self.num_steps if num_steps is None else num_steps
        chunk = self.chunk if chunk is None else chunk
        chunks = []
        n = num_steps // chunk
        with self.lock:
            steps = self._later_program("steps", (state, data), base)
        with tqdm.trange(n * chunk, disable=not progress_bar, leave=True) as bar:
            for _ in range(n):
                with self.lock:
                    state, losses = steps(state, data)
                chunks.append(self._first(losses, chunk))
                if progress_bar:
                    last = np.asarray(chunks[-1])
                    bar.set_postfix_str(f"init loss: {float(np.asarray(chunks[0])[0]):.4f}, avg. loss [last {len(last)}]: "
                                        f"{float(np.nanmean(last)):.4f}", refresh=False)
                bar.update(chunk)
        if len(chunks) == 1:
            return state, chunks[0]
        # host arrays already: one transfer, no concatenation program
        return state, jax.device_put(np.concatenate([np.asarray(c) for c in chunks]))


def _guarded(loaded, jitted):
    """``loaded`` (a program read from disk), or ``jitted`` from its first failure on (a program that does not run
    here raises before it runs: its arguments are checked first)."""
    current = [loaded]

    def call(*args):
        if current[0] is loaded:
            try:
                return loaded(*args)
            except Exception:  # noqa: BLE001
                current[0] = jitted
        return jitted(*args)

    return call


# The number of steps a fit's program runs at a call is one of its arguments (under this key of the arguments' keyword
# dict, which the model does not see), so that fits of any number of steps up to the program's capacity share it
_STEPS = "_nb_num_steps"
_WARM_STEPS = "_nb_warm_steps"  # the workflow's warm-started fits (_Program.chain)
_MIN_CAPACITY = 1024


def _capacity(steps):
    """The most steps a :func:`fit` program runs at one call, for calls of ``steps`` steps: a power of two, at least
    1,024 (the length of the buffer its losses are written to; the steps past the call's count are not run).

    On every backend. On a GPU a loop whose count is known only at run time reads its condition back to the host
    at each step; measured on an H200 (float32, warm refits of 200 and 1,000 steps, eight schools and breast
    cancer with ``AutoNormal`` and ``AutoMultivariateNormal``), it costs 0.86-1.31x the fixed-count loop per fit
    (median 1.07x, within the run-to-run spread), where a program per ``num_steps`` costs a compilation (4-5 s
    there) for each new count."""
    return max(_MIN_CAPACITY, 1 << (int(steps) - 1).bit_length())


def _chunk_length(num_steps, progress_bar):
    """Steps per compiled call: all of them without a progress bar, else about a twentieth (a divisor)."""
    if not progress_bar:
        return num_steps
    k = max(d for d in range(1, min(20, num_steps) + 1) if num_steps % d == 0)
    return num_steps // k


_CACHE_SIZE = 32
_CACHE: "collections.OrderedDict" = collections.OrderedDict()
_CACHE_LOCK = threading.Lock()


def cache_info():
    """How many compiled fits :func:`fit` holds (at most ``32``, least recently used dropped first), and, since
    the process started, how many of its programs were read from disk (``disk_hits``), looked up there and not
    found or not usable (``disk_misses``: compiled instead; ``disk_miss_reasons`` counts them by program and
    reason) and written there (``disk_writes``); see
    :func:`enable_compilation_cache`."""
    with _DISK_LOCK:
        disk = {k: _DISK[k] for k in ("hits", "misses", "writes")}
        reasons = dict(_DISK["reasons"])
    return {"entries": len(_CACHE), "max_entries": _CACHE_SIZE, "disk_hits": disk["hits"], "disk_misses": disk["misses"],
            "disk_writes": disk["writes"], "disk_miss_reasons": reasons}


def cache_clear():
    """Drop every compiled fit that :func:`fit` holds, and the diagnostics' programs (:func:`one_program`);
    JAX's own caches are not touched."""
    with _CACHE_LOCK:
        _CACHE.clear()
        _ONE_PROGRAMS.clear()


# -- one program for a computation after the fit ------------------------------------------------------
_ONE_PROGRAMS_SIZE = 16
_ONE_PROGRAMS: "collections.OrderedDict" = collections.OrderedDict()
DATA_IN_PYTHON = (jax.errors.ConcretizationTypeError, jax.errors.TracerArrayConversionError,
                   jax.errors.TracerBoolConversionError, jax.errors.TracerIntegerConversionError)


def one_program(fn, key, args, kwargs, inputs, owners=()):
    """``fn(args, kwargs, inputs, meta)`` compiled as one program, with the array leaves of ``args``/``kwargs`` and
    ``inputs`` as its arguments; returns ``(outputs, meta)``.

    For the computations that follow a fit (the diagnostics' draws from the guide, the model traced at each draw,
    log densities): run eagerly they are hundreds of one-operation programs, each compiled on first use (a first
    ``to_datatree`` of a three-coefficient regression: 137 programs, 4.3 s), where one program compiles in a
    fraction of that. ``fn`` records the Python values it finds while tracing (site names) in the dict ``meta``.
    The jitted function is kept per (``key``, non-array arguments), so a second call on arrays of the same shapes
    and dtypes compiles nothing; ``key`` holds whatever else ``fn`` depends on (the model and guide objects, the
    number of draws). The attributes of ``owners`` (the guide) are put back after tracing: nothing traced is left
    in them. A model that reads its data's values in Python (an ``if`` on the data, ``np.asarray(y)``) cannot be
    traced: then ``fn`` runs eagerly, as it would without this function.
    """
    arrays, rebuild, signature = _split(args, kwargs)
    full_key = (key, signature)
    with _CACHE_LOCK:
        entry = _ONE_PROGRAMS.get(full_key)
        if entry is not None:
            _ONE_PROGRAMS.move_to_end(full_key)
    if entry is None:
        metas, tracing = {}, [None]

        def program(arrays, inputs):
            saved = [_vars_copy(o) for o in owners]
            try:
                meta = {}
                a, kw = rebuild(arrays)
                out = fn(a, kw, inputs, meta)
                metas[tracing[0]] = meta
                return out
            finally:
                for o, v in zip(owners, saved):
                    _assign_vars(o, v)

        entry = (jax.jit(program), metas, tracing)
        with _CACHE_LOCK:
            _ONE_PROGRAMS[full_key] = entry
            while len(_ONE_PROGRAMS) > _ONE_PROGRAMS_SIZE:
                _ONE_PROGRAMS.popitem(last=False)
    jitted, metas, tracing = entry
    leaves, treedef = jax.tree.flatten((arrays, inputs))
    tracing[0] = (treedef, tuple((str(jnp.result_type(x)), np.shape(x), bool(getattr(x, "weak_type", False))) for x in leaves))
    try:
        out = jitted(arrays, inputs)
    except DATA_IN_PYTHON:
        with _CACHE_LOCK:
            _ONE_PROGRAMS.pop(full_key, None)
        meta = {}
        a, kw = rebuild(arrays)
        return fn(a, kw, inputs, meta), meta
    return out, metas[tracing[0]]


def _cached_program(key, guide, built, make):
    """The program under ``key`` in the cache, or ``make()``'s, stored there. ``guide`` and ``built`` are
    :func:`_guide_key`'s: an autoguide set up by a program since dropped is first put back as built."""
    with _CACHE_LOCK:
        program = _CACHE.get(key)
        if program is not None:
            _CACHE.move_to_end(key)
    if program is None:
        if built is not None and not _pristine_autoguide(guide):
            _assign_vars(guide, built)
        program = make()
        with _CACHE_LOCK:
            _CACHE[key] = program
            while len(_CACHE) > _CACHE_SIZE:
                _CACHE.popitem(last=False)
    return program


def _adopt_setup(program, guide, guide_key, built):
    """After ``program`` set its guide up: ``guide``, keyed by its class and options (:func:`_guide_key`), set up
    alike where the program's guide is another object, and registered as set up by that key's programs."""
    if built is not None:
        if program.owner is not guide:
            _assign_vars(guide, vars(program.owner))
        _GUIDE_KEYS[guide] = (guide_key, built)


#: ``svi.init``'s keys whose compiled start failed (a model that reads its data in Python): NumPyro's eager init
_EAGER_INIT = set()


def compiled_init(svi, rng_key, args, kwargs, init_params=None):
    """``svi.init(rng_key, *args, init_params=init_params, **kwargs)`` for an ``SVI`` with one of our optimizers, as
    one compiled program: the guide's setup, NumPyro's search for valid initial values, the constraints'
    inverses and the optimizer's initial state.

    NumPyro's ``SVI.init`` runs these eagerly, one small XLA program per operation and shape: 226 compilations,
    7.5 s in a fresh process on 2 cores for kidiq's four-parameter regression with ``AutoMultivariateNormal``
    (2.1-2.3 s compiled), most of a first ``svi.run`` (``docs/workflow.md``, section 1). ``NUMPYRO_BLR_EAGER_INIT=1``
    turns this off (NumPyro's eager start is cheaper where many different models of alike shapes are fitted in one
    process: its one-operation programs are shared across models).
    The program is :func:`fit`'s start (``_Program._init_fn``), cached like :func:`fit`'s programs: another
    ``svi.init`` or ``svi.run`` on arguments of the same shapes, with the same model, guide (an autoguide: the same
    class and options) and optimizer configuration, runs it without compiling. The state equals NumPyro's to
    rounding; the guide is set up with concrete values and ``svi.constrain_fn`` is set, as ``SVI.init`` does.

    Returns ``None`` where NumPyro's own init should run instead: traced arguments (``svi.init`` inside ``jit``),
    or a model or guide whose start cannot be traced (one that reads its data in Python: its first call here
    fails, and NumPyro's eager init runs from then on for that key)."""
    if os.environ.get("NUMPYRO_BLR_EAGER_INIT", "") == "1":
        return None
    leaves = jax.tree.leaves((rng_key, args, kwargs, init_params))
    if any(isinstance(x, jax.core.Tracer) for x in leaves):
        return None
    model, guide, optim, loss = svi.model, svi.guide, svi.optim, svi.loss
    if optim.algorithm.read_layout is not None:  # nb.LieGroupBLR finds its guide among the live ones: a program
        return None  # cached here would keep guides of earlier fits alive beside the one being fitted
    kwargs = {**kwargs, **svi.static_kwargs}
    data, rebuild, signature = _split(args, kwargs)
    data = [jnp.asarray(x) if isinstance(x, np.ndarray) else x for x in data]
    guide_key, built = _guide_key(guide)
    effort = resolve_effort("auto", data, 1, 1)
    key = ("init", id(model), guide_key, _optimizer_key(optim), _loss_key(loss), signature, effort,
           None if init_params is None else jax.tree.structure(init_params))
    if key in _EAGER_INIT:
        return None
    program = _cached_program(key, guide, built, lambda: _Program(
        model, guide, optim, loss, num_steps=None, chunk=None, stable_update=False, rebuild=rebuild,
        compiler_options=_compiler_options(effort)))
    snapshot = program._snapshot()
    try:
        program.setup_eagerly(rng_key, (data, {}))
        if init_params is None:
            (state,), _ = program._call("init", rng_key, (data, {}))
        else:
            (state,), _ = program._call(lambda k, d: program._init_from(k, d, init_params), rng_key, (data, {}),
                                        program=("init_from", jax.tree.structure(init_params)))
    except Exception:  # noqa: BLE001 - NumPyro's init runs instead, and raises its own error if there is one
        program._restore_snapshot(snapshot)
        program.setup.pending = None
        _EAGER_INIT.add(key)
        with _CACHE_LOCK:
            _CACHE.pop(key, None)
        return None
    _adopt_setup(program, guide, guide_key, built)
    # compiled too: svi.run ends with svi.get_params(state) outside jit, where NumPyro's transforms (the
    # scale_tril's, above all) would run eagerly, one small program per operation (1.5 s on the regression above)
    svi.constrain_fn = _jitted_constrain(program.svi.constrain_fn)
    return state


def _adopt_run_state(source, target):
    """``target`` (the optimizer a fit was given) as ``source`` (the optimizer of the cached program that ran it, built
    for an earlier fit with the same configuration) left it: the attributes its start sets and its end-of-run report
    reads (``GuideOptimizer.RUN_STATE``: the data's size; ``nb.IVON``'s default ``ess`` read from it)."""
    if source is not target and type(source) is type(target):
        for name in getattr(target, "RUN_STATE", ()):
            setattr(target, name, getattr(source, name))


#: ``svi.run``'s keys whose compiled run failed (a model that reads its data in Python): NumPyro's run
_NUMPYRO_RUN = set()


def compiled_run(svi, rng_key, num_steps, args, kwargs, progress_bar=True, stable_update=False, init_state=None):
    """``svi.run(rng_key, num_steps, *args, progress_bar=..., stable_update=..., init_state=..., **kwargs)`` for an
    ``SVI`` with one of our optimizers, as :func:`fit` runs it: the start and the steps as one compiled program with
    the data as its arguments (in about 20 calls of it with the progress bar), cached by the model, the guide (an
    autoguide: its class and options), the optimizer's configuration and the arguments' shapes.

    NumPyro's ``SVI.run`` starts eagerly (``svi.init``; :func:`compiled_init` compiles that start), then compiles
    its steps as a new program on every call, with the data as constants and at XLA's full optimisation: a cold
    ``svi.run`` of 1,000 steps waited 1.5-2x as long as :func:`fit` (``docs/workflow.md``, section 1), and a second
    ``svi.run`` on new data of the same shapes compiled its steps again. The result is :func:`fit`'s: NumPyro's to
    rounding (the ELBO's terms summed in a fixed order, :func:`_ordered_loss`), with the same end-of-run warnings;
    ``svi.constrain_fn`` is set and the guide set up as after NumPyro's run.

    Returns ``None`` where NumPyro's own ``SVI.run`` should run instead (its start through :func:`compiled_init`):
    ``NUMPYRO_BLR_EAGER_INIT=1``, traced arguments (``svi.run`` inside ``jit``), ``nb.LieGroupBLR`` (as for
    :func:`compiled_init`), or a model or guide this program cannot run (one that reads its data in Python: its
    first call here fails, and NumPyro's run is used from then on for that key)."""
    if os.environ.get("NUMPYRO_BLR_EAGER_INIT", "") == "1":
        return None
    if any(isinstance(x, jax.core.Tracer) for x in jax.tree.leaves((rng_key, args, kwargs, init_state))):
        return None
    optim = svi.optim
    if optim.algorithm.read_layout is not None or not isinstance(num_steps, (int, np.integer)) \
            or isinstance(num_steps, bool) or num_steps < 1:
        return None  # NumPyro's run: nb.LieGroupBLR (compiled_init), or its own error for the step count
    if init_state is not None and not isinstance(init_state, SVIState):
        return None
    kwargs = {**kwargs, **svi.static_kwargs}
    key = (id(svi.model), _guide_key(svi.guide)[0], _optimizer_key(optim), _loss_key(svi.loss), _split(args, kwargs)[2])
    if key in _NUMPYRO_RUN:
        return None
    try:
        result, program = _fit(svi.model, svi.guide, args, kwargs, optim, int(num_steps), rng_key, svi.loss,
                               progress_bar, stable_update, init_state, "auto", "svi.run", stacklevel=7)
    except Warning:  # an end-of-run warning the caller's filters turned into an error: the fit ran
        raise
    except Exception:  # noqa: BLE001 - NumPyro's run runs instead, and raises its own error if there is one
        _NUMPYRO_RUN.add(key)
        return None
    svi.constrain_fn = _jitted_constrain(program.svi.constrain_fn)
    return result


def _jitted_constrain(constrain_fn):
    """``constrain_fn`` (``SVI.init``'s ``partial(transform_fn, transforms)``) compiled where it is called on concrete
    parameters (``svi.get_params(state)``: one program instead of one per operation); on traced ones (the loss
    inside the step) the function itself, so that the step's program is what it was (a nested ``jit`` would also
    read every parameter, hiding from :func:`~numpyro_blr.guide_trace.unread_params` which ones the loss reads)."""
    jitted = jax.jit(constrain_fn)

    def constrain(params):
        if any(isinstance(x, jax.core.Tracer) for x in jax.tree.leaves(params)):
            return constrain_fn(params)
        return jitted(params)

    return constrain


def _check_optimizer(optim):
    if isinstance(optim, (_NumPyroOptim, optax.GradientTransformation)):
        return optim
    raise TypeError(
        f"optim must be a NumPyro optimizer (nb.BLR(), nb.IVON(...), numpyro.optim.Adam(0.01), ...) or an optax "
        f"GradientTransformation (optax.adam(1e-2)), got {optim!r} of type {type(optim).__name__}. "
        "Leave it unset for nb.BLR()."
    )


def _bound(optim, guide, args, kwargs):
    """``optim`` reading ``guide`` where it is one of ours (:meth:`~numpyro_blr.svi.GuideOptimizer.bound_to`: a
    hand-written guide traced with the fit's arguments), as ``svi.init`` binds it."""
    from numpyro_blr.svi import GuideOptimizer

    return optim.bound_to(guide, args, kwargs) if isinstance(optim, GuideOptimizer) else optim


def _check_guide(model, guide):
    if not callable(guide):
        raise TypeError(f"guide must be a NumPyro guide (an autoguide or a function), got {type(guide).__name__}.")
    owner = getattr(guide, "model", None)
    if owner is not None and callable(owner) and owner is not model:
        raise ValueError(
            f"guide is {type(guide).__name__} of the model {getattr(owner, '__name__', owner)!r}, not of the model "
            f"{getattr(model, '__name__', model)!r} passed to fit: build it on that model, e.g. "
            f"{type(guide).__name__}(model)."
        )


def fit(model, guide, *args, optim=None, num_steps=1000, rng_key=None, loss=None, progress_bar=True,
        stable_update=False, init_state=None, compile_effort="auto", **kwargs):
    r"""Fit ``guide`` to ``model``'s posterior: ``SVI(model, guide, optim, loss).run(rng_key, num_steps, *args, **kwargs)``,
    compiled once.

    :param model, guide: a NumPyro model and a guide of it (an autoguide built on ``model``, or a function).
    :param args, kwargs: the model's arguments, as for ``svi.run``. Arrays (NumPy or JAX) are the
        program's inputs; everything else (Python numbers, strings) is fixed into the program, and a
        new value compiles a new one.
    :param optim: any NumPyro optimizer or optax transformation; default ``nb.BLR()``.
    :param num_steps: how many steps (a positive int).
    :param rng_key: a ``jax.random`` key; default ``jax.random.PRNGKey(0)``.
    :param loss: default :class:`Trace_ELBO` (a plain ``numpyro.infer.Trace_ELBO`` is replaced by it,
        with the same options).
    :param progress_bar: show a progress bar (the steps then run in about 20 compiled calls of one
        program; without it init and every step are one program).
    :param stable_update: as ``svi.run``'s.
    :param init_state: continue from ``svi_result.state`` of an earlier fit (as ``svi.run``'s).
    :param compile_effort: ``"low"`` (XLA's CPU backend without LLVM optimisation: shorter compile,
        slower steps), ``"high"`` (JAX's default) or ``"auto"`` (:func:`resolve_effort`: ``"low"`` on CPU
        where a first fit of a small model is mostly compilation; see ``docs/workflow.md``).
    :returns: NumPyro's ``SVIRunResult(params, state, losses)``, with the same end-of-run warnings
        as ``svi.run`` (``nb.fit_report(result, guide=guide)`` shows the evidence).

    The program is cached per (model, guide, optimizer configuration, loss, the non-array arguments);
    JAX keys it further by the arrays' shapes and dtypes. The number of steps is one of its
    arguments: a program runs any number up to its capacity (the next power of two, at least 1,024; with the
    progress bar, per call of about a twentieth of them; :func:`_capacity`). A refit with new data of the same
    shapes, or with another ``num_steps`` (or a continued fit), therefore costs the steps alone, in this process;
    across processes, see :func:`enable_compilation_cache`. Our optimizers are keyed by their configuration (a new
    ``nb.BLR()`` with the same options reuses the program), NumPyro's autoguides by their class and options
    while this sets them up (``nb.fit(model, AutoNormal(model), ...)`` for each data set reuses the program,
    and the new guide is set up afterwards as the first one was: :func:`_guide_key`); other optimizers,
    guides and models by the object itself. New shapes set the guide up for them (a latent site per
    observation takes the data's length), and each shape's setup is kept for its refits.
    """
    from numpyro_blr.optim import BLR

    if isinstance(num_steps, bool) or not isinstance(num_steps, (int, np.integer)) or num_steps < 1:
        raise ValueError(f"num_steps must be a positive int, got {num_steps!r}.")
    num_steps = int(num_steps)
    if compile_effort not in COMPILE_EFFORTS:
        raise ValueError(f"compile_effort must be one of {COMPILE_EFFORTS}, got {compile_effort!r}.")
    if not callable(model):
        raise TypeError(f"model must be a NumPyro model (a callable), got {type(model).__name__}.")
    _check_guide(model, guide)
    optim = _bound(BLR() if optim is None else _check_optimizer(optim), guide, args, kwargs)
    if rng_key is None:
        rng_key = jax.random.PRNGKey(0)
    if init_state is not None and not isinstance(init_state, SVIState):
        raise TypeError(f"init_state must be the state of an earlier fit (svi_result.state), got {type(init_state).__name__}.")
    return _fit(model, guide, args, kwargs, optim, num_steps, rng_key, loss, progress_bar, stable_update, init_state,
                compile_effort, "nb.fit", stacklevel=6)[0]


def _fit(model, guide, args, kwargs, optim, num_steps, rng_key, loss, progress_bar, stable_update, init_state,
         compile_effort, where, stacklevel):
    """:func:`fit` once its arguments are checked (and ``optim`` bound): ``(SVIRunResult, program)``, the program of
    the last fit run (after a rerun, the rerun's: the same model, guide and constraints). ``where`` names the caller
    in errors; ``stacklevel`` is the end-of-run warnings' (the user's line: 1 is the optimizer's ``warn``, 4 this)."""
    from numpyro_blr.svi import run_with_rerun

    loss = _ordered_loss(loss)
    data, rebuild, signature = _split(args, kwargs)
    data = [jnp.asarray(x) if isinstance(x, np.ndarray) else x for x in data]
    chunk = _chunk_length(num_steps, progress_bar)
    capacity = _capacity(chunk)  # the program runs any count up to it: other num_steps reuse it
    extra = {_STEPS: jnp.asarray(chunk, jnp.int32)}
    effort = resolve_effort(compile_effort, data, 1, num_steps)
    check_data(model, args, kwargs, shapes=False)  # NaN/inf in the data: on the concrete arrays, before the program

    def once(optim):
        guide_key, built = _guide_key(guide)
        key = (id(model), guide_key, _optimizer_key(optim), _loss_key(loss), capacity, bool(stable_update),
               signature, effort, _DISK["dir"])

        def make():
            options = _compiler_options(effort)
            disk = _disk_config(optim, loss, capacity, "any", bool(stable_update),
                                signature, effort, options)
            return _Program(model, guide, optim, loss, num_steps=num_steps, chunk=chunk, stable_update=bool(stable_update),
                            rebuild=rebuild, compiler_options=options, disk=disk, capacity=capacity)

        program = _cached_program(key, guide, built, make)
        with explain_traced_data(model, args, kwargs, where):
            state, losses, params = program.run(rng_key, (data, extra), init_state, progress_bar, num_steps, chunk)
        _adopt_setup(program, guide, guide_key, built)
        _adopt_run_state(program.svi.optim, optim)
        programs.append(program)
        warn = getattr(optim, "warn", None)
        if warn is not None:  # the end-of-run warnings svi.run's get_params gives
            warn(state.optim_state, stacklevel=stacklevel)  # once, run_with_rerun, _fit, then the callers
        return SVIRunResult(params, state, losses)

    # nb.BLR()'s default may rerun the fit with averaged curvature draws, as svi.run does (run_with_rerun)
    programs = []
    result = run_with_rerun(optim, once)
    return result, programs[-1]


# -- checks made while the program is traced (shapes only: no cost at run time) ---------------------
def _positional_names(model):
    """The names of ``model``'s positional parameters (``[]`` where its signature cannot be read)."""
    import inspect

    try:
        params = list(inspect.signature(model).parameters.values())
    except (TypeError, ValueError):
        return []
    return [p.name for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]


def _arguments(model, args, kwargs):
    """``[(label, value)]`` of the call's arguments, labelled by the model's parameter names where its
    signature binds them (``argument 'X'``), else by position (``argument 0``) or keyword."""
    names = []
    positional = _positional_names(model)
    for i, a in enumerate(args):
        names.append((f"argument {positional[i]!r}" if i < len(positional) else f"argument {i}", a))
    names += [(f"argument {k!r}", v) for k, v in kwargs.items()]
    return names


def _argument_name(value, args, kwargs, model=None):
    """The name of the argument ``value`` came from (by identity with the program's inputs), or ``None``."""
    for label, a in _arguments(model, args, kwargs) if model is not None else (
            [(f"argument {i}", a) for i, a in enumerate(args)] + [(f"argument {k!r}", v) for k, v in kwargs.items()]):
        if a is value:
            return label
    return None


def _input_labels(model, args, kwargs):
    """The labels of the program's array inputs, in :func:`_split`'s order (``argument 'X'``, a pytree
    argument's leaves with their path)."""
    positional = _positional_names(model)
    out = []
    for path, leaf in jax.tree_util.tree_flatten_with_path((args, kwargs))[0]:
        if not _is_data(leaf):
            continue
        top, key, rest = path[0].idx, path[1], path[2:]
        if top == 0:
            name = positional[key.idx] if key.idx < len(positional) else key.idx
        else:
            name = key.key
        out.append(f"argument {name!r}" + jax.tree_util.keystr(tuple(rest)))
    return out


def _traced_argument(text, model, args, kwargs):
    """The label of the data array a JAX tracer error names (``... the value of the argument data[0][2]``: the
    program's third array input; ``args[0]``, ``kwargs['y']``: an abstract trace of the model's arguments), or
    ``None`` where it names none."""
    import re

    found = re.search(r"argument data\[0\]\[(\d+)\]", text)
    if found is not None:
        labels = _input_labels(model, args, kwargs)
        i = int(found.group(1))
        return labels[i] if i < len(labels) else "an array argument"
    found = re.search(r"argument args\[(\d+)\]", text)
    if found is not None:
        i = int(found.group(1))
        labels = [label for label, _ in _arguments(model, args, kwargs)]
        return labels[i] if i < len(labels) else f"argument {i}"
    found = re.search(r"argument kwargs\['([^']+)'\]", text)
    return None if found is None else f"argument {found.group(1)!r}"


_TRACED_DATA_ERRORS = (jax.errors.TracerArrayConversionError, jax.errors.ConcretizationTypeError,
                       jax.errors.TracerIntegerConversionError, jax.errors.TracerBoolConversionError)


@contextlib.contextmanager
def explain_traced_data(model, args, kwargs, where):
    """Around a program that takes the data as inputs: a model that reads a data array's values in Python
    (``np.asarray(x)``, ``float(x.mean())``, an ``if`` on it), which ``SVI.run`` allows (it bakes the data
    into its program), gets a ``TypeError`` naming the argument and what to do instead of JAX's tracer error."""
    try:
        yield
    except _TRACED_DATA_ERRORS as err:
        text = str(err)
        which = _traced_argument(text, model, args, kwargs)
        if which is None:  # not one of the data's arrays: the model's own values (svi.run fails on it too)
            raise
        raise TypeError(
            f"{where}: the model reads the value of {which} in Python ({type(err).__name__}: np.asarray, float(), "
            f"int() or an `if` on it). {where} passes the data to one compiled program as its inputs, so that a refit "
            "with new data of the same shapes compiles nothing, and their values are not known while it is traced. "
            "Compute such values with jax.numpy inside the model (jnp.mean(x), not float(np.mean(x))), or pass them "
            "as Python numbers in another argument (a number is part of the program)"
            + (", or fit with SVI(model, guide, optim, loss).run(...), which bakes the data into its program"
               if where == "nb.fit" else "") + ". JAX: " + text.splitlines()[0]) from err


def _array_arguments(model, args, kwargs):
    """``[(label, array)]``: the array leaves of the arguments (a pytree argument's leaves labelled by their path)."""
    out = []
    for label, value in _arguments(model, args, kwargs):
        leaves = jax.tree_util.tree_leaves_with_path(value)
        for path, leaf in leaves:
            if isinstance(leaf, (np.ndarray, jax.Array)) and np.ndim(leaf) > 0:
                out.append((label + jax.tree_util.keystr(path), leaf))
    return out


def _rows(mask):
    """``'rows [3, 7]'`` (leading-axis indices where ``mask`` holds anywhere in the row), at most ten listed."""
    mask = np.asarray(mask)
    rows = np.nonzero(mask.reshape(mask.shape[0], -1).any(axis=1))[0] if mask.ndim else np.zeros(0, int)
    listed = ", ".join(str(int(r)) for r in rows[:10])
    more = f", ... ({rows.size} rows in all)" if rows.size > 10 else ""
    return f"row{'s' if rows.size != 1 else ''} [{listed}{more}]"


def _nonfinite_arguments(model, args, kwargs):
    """``[(label, non-finite mask)]`` of the concrete floating-point array arguments that hold NaN or inf
    (one host-side reduction per array; tracers, integer and boolean arrays are skipped)."""
    bad = []
    for label, a in _array_arguments(model, args, kwargs):
        if isinstance(a, jax.core.Tracer) or not jnp.issubdtype(jnp.result_type(a), jnp.inexact):
            continue
        if isinstance(a, jax.Array) and bool(jnp.all(jnp.isfinite(a))):  # on the device: no transfer when finite
            continue
        mask = ~np.isfinite(np.asarray(a))
        if mask.any():
            bad.append((label, mask))
    return bad


def _leading_sizes(model, args, kwargs):
    """``{label: leading size}`` of the array arguments with at least one axis."""
    return {label: int(np.shape(a)[0]) for label, a in _array_arguments(model, args, kwargs)}


def _trace_model(model, args, kwargs, concrete=True):
    """The model's trace with its latent values drawn as NumPyro's initialisation draws them (shapes and
    the observed sites' distributions are what the checks read). With ``concrete=False`` it is traced
    abstractly (``jax.eval_shape``, NumPyro's distribution checks off): the same sites, shapes, plates and
    observed values (the data themselves), latent values and distribution parameters as tracers that only
    their shapes may be read from; run eagerly it would compile a small program per operation (14 of them,
    0.5 s, for a regression with ``AutoMultivariateNormal``)."""
    from numpyro.distributions.distribution import validation_enabled
    from numpyro.infer.initialization import init_to_uniform

    def run():
        with handlers.block(), handlers.substitute(substitute_fn=init_to_uniform), handlers.seed(rng_seed=0):
            return handlers.trace(model).get_trace(*args, **kwargs)

    if concrete:
        return run()
    out = {}

    def abstract():
        out["trace"] = run()
        return ()

    with validation_enabled(False):
        jax.eval_shape(abstract)
    return out["trace"]


def check_data(model, args, kwargs, shapes=True):
    """Check the data of a fit before it starts (host side, on concrete arrays: ``nb.fit`` calls it before
    entering its compiled program, ``nb.BLR``/``nb.IVON`` under ``SVI`` at ``svi.init``); returns the model's
    trace (or ``None`` where the arguments are tracers). Raises ``ValueError`` naming the argument and the rows:

    * an array argument holding NaN or inf where it makes an observed site's log density non-finite
      (NaN in ``y``, inf in ``X``; a non-finite value the model masks out or never reads passes);
    * array arguments whose leading sizes disagree where the model cannot be evaluated, or where an
      observed site's data do not have the distribution's shape (:func:`check_observations`).
    """
    leaves = jax.tree_util.tree_leaves((args, kwargs))
    if any(isinstance(x, jax.core.Tracer) for x in leaves):
        return None
    with jax.ensure_compile_time_eval():  # concrete data inside a jit (svi.run in a jitted function): eagerly
        return _check_data(model, args, kwargs, shapes)


def _check_data(model, args, kwargs, shapes):
    bad = _nonfinite_arguments(model, args, kwargs)
    what = "; ".join(f"{label} has NaN or inf in {_rows(mask)}" for label, mask in bad)
    if not bad and not shapes:
        return None
    fix = ("Remove those rows (or impute them), or mask them out of the likelihood (numpyro.handlers.mask, or "
           "obs_mask= for missing observations) before fitting.")
    try:
        model_trace = _trace_model(model, args, kwargs, concrete=bool(bad))
    except Exception as err:  # noqa: BLE001 - say what in the data makes the model fail, if we can
        if bad:
            raise ValueError(f"the model fails on its data ({type(err).__name__}: {err}): {what}. {fix}") from err
        _raise_leading_sizes(model, args, kwargs, err)
        return None  # not explained by the data: NumPyro's own initialisation says what fails
    if shapes:
        _check_observed_shapes(model_trace, model, args, kwargs)
    if bad:
        sites = []
        for name, site in model_trace.items():
            if site["type"] != "sample" or not site["is_observed"]:
                continue
            with warnings.catch_warnings():  # out-of-support data are what is being looked for
                warnings.simplefilter("ignore")
                log_prob = jnp.asarray(site["fn"].log_prob(site["value"]))
            if site.get("mask") is not None:
                log_prob = jnp.where(site["mask"], log_prob, 0.0)
            if not bool(jnp.all(jnp.isfinite(log_prob))):
                sites.append(name)
        if sites:
            raise ValueError(f"{what}: the log density of the observed site(s) {sites} is then not finite, and the fit "
                             f"would be meaningless. {fix}")
    return model_trace


def _raise_leading_sizes(model, args, kwargs, err=None):
    """Raise naming the array arguments and their leading sizes when these disagree (one row per observation)."""
    sizes = _leading_sizes(model, args, kwargs)
    if len(set(sizes.values())) > 1:
        listed = ", ".join(f"{label} has {n} rows" for label, n in sizes.items())
        failed = f" ({type(err).__name__}: {err})" if err is not None else ""
        raise ValueError(f"the model fails on its data{failed}, and its array arguments' leading sizes disagree: {listed}. "
                         "Where each holds one row per observation, pass the same number of rows.") from err


def check_observations(model, args, kwargs):
    """Raise, naming the site and the argument, where an observed site's data would broadcast against its
    distribution into another shape (``y`` of shape ``(N, 1)`` against a plate of ``N``), or cannot
    broadcast (arguments whose leading sizes disagree). Runs on a trace of the model: shapes only."""
    try:
        model_trace = _trace_model(model, args, kwargs)
    except Exception as err:  # noqa: BLE001 - the arguments' sizes, if they disagree, say why
        _raise_leading_sizes(model, args, kwargs, err)
        raise
    _check_observed_shapes(model_trace, model, args, kwargs)


def _check_observed_shapes(model_trace, model, args, kwargs):
    for name, site in model_trace.items():
        if site["type"] != "sample" or not site["is_observed"]:
            continue
        value_shape, dist_shape = tuple(jnp.shape(site["value"])), tuple(site["fn"].shape())
        try:
            joint = tuple(np.broadcast_shapes(value_shape, dist_shape))
        except ValueError:
            joint = None
        if joint in (dist_shape, value_shape):  # the data in the distribution's shape, or broadcasting a smaller one
            continue
        source = _argument_name(site["value"], args, kwargs, model)
        source = f" ({source})" if source else ""
        sizes = _leading_sizes(model, args, kwargs)
        listed = ", ".join(f"{label} has {n}" for label, n in sizes.items())
        raise ValueError(
            f"observed site {name!r}: the data{source} have shape {value_shape}, but the model's distribution there has "
            f"shape {dist_shape} (batch {tuple(site['fn'].batch_shape)}, event {tuple(site['fn'].event_shape)}), set by the "
            "other arguments and plates"
            + (f": the arguments' leading sizes disagree ({listed} rows); pass one row of each argument per observation."
               if joint is None else f": they would broadcast to {joint} and count each observation many times. "
               "Pass the data in the distribution's shape (e.g. y.reshape(-1) for a column vector).")
        )


def check_guide_sites(svi, state, args, kwargs):
    """Raise where the guide's latent sites are not the model's: a guide of another model (by the sites)."""
    params = svi.get_params(state)
    with handlers.block(), handlers.seed(rng_seed=0):
        guide_trace = handlers.trace(handlers.substitute(svi.guide, data=params)).get_trace(*args, **kwargs)
        model_trace = handlers.trace(handlers.replay(svi.model, guide_trace)).get_trace(*args, **kwargs)
    guide_latents = {n for n, s in guide_trace.items()
                     if s["type"] == "sample" and not s["is_observed"] and not s["infer"].get("is_auxiliary")}
    model_latents = {n for n, s in model_trace.items() if s["type"] == "sample" and not s["is_observed"]}
    observed = {n for n, s in model_trace.items() if s["type"] == "sample" and s["is_observed"]}
    extra = sorted(guide_latents - model_latents - observed)
    if extra:
        raise ValueError(
            f"the guide samples site(s) {extra} that the model does not have (the model's latent sites: "
            f"{sorted(model_latents)}): is it the guide of another model?"
        )
    clash = sorted(guide_latents & observed)
    if clash:
        raise ValueError(f"the guide samples site(s) {clash} that the model observes: is it the guide of another model?")


# -- the persistent cache -------------------------------------------------------------------------
def enable_compilation_cache(path=None):
    """Turn on JAX's persistent compilation cache and :func:`fit`'s own cache of compiled programs, so
    that a second process loads the compiled fit instead of tracing and compiling it again. Opt-in:
    never switched on at import.

    :param path: the directory (created if missing); default ``$NUMPYRO_BLR_CACHE`` or
        ``~/.cache/numpyro_blr/jax`` (``$XDG_CACHE_HOME`` respected).
    :returns: the directory, as a ``pathlib.Path``.

    JAX's cache: every program is written, however short its compile (JAX's default keeps only those
    over 1 s, which misses small models), and read back when a later process compiles the same program
    text for the same backend, JAX and XLA versions and options. JAX keys a program by its lowered text,
    so that process still traces and lowers the whole fit first (0.5-1 s on small models, more than the
    steps themselves).

    :func:`fit`'s cache (the ``numpyro_blr/`` subdirectory, ``<key>.nbexe`` files): the compiled program
    itself (``jax.experimental.serialize_executable``), keyed by a trace of the fit's start alone (the
    guide's setup and ``svi.init``: the model's density, which the setup evaluates with its gradient, and
    the guide; plus the loss at the start where the setup is not traced or the guide's class is not
    NumPyro's or ours): its jaxpr's text and constants' values, with the optimizer's configuration, the
    loss's options, the program's capacity of steps, ``stable_update``, the compile effort and
    XLA options, the non-array arguments, the arrays' shapes and dtypes, the versions of JAX, jaxlib,
    NumPyro and this package (and a hash of this package's source), the backend and device, and JAX's
    settings that change lowering (``jax_enable_x64``, the matmul precision, the PRNG, ...). That trace
    costs a fraction of the whole one (0.1 s instead of 0.6 s, plus 0.2 s of lowering, in a fresh process
    on eight schools); loading the executable costs what JAX's own cache does (0.25 s for a 1.7 MB program
    on CPU). A second process then fits eight schools or kidiq in about 0.5 s, of which 0.02 s are steps.
    The programs of a progress-bar fit (start, chunk of steps, parameters) are cached too; the later
    ones are also keyed by the values of the set-up guide (which they hold as constants).

    What the key does not cover: code that runs when the steps are traced but leaves the start's trace
    unchanged (a model or guide that traces differently on later calls, e.g. one that reads a global
    setting; a custom JVP rule the setup's gradient does not reach). Python code that changes nothing in
    the jaxpr cannot change the program. Optimizers other than ours (``numpyro.optim``, optax), losses
    other than NumPyro's or ours, function arguments and optimizers that hold functions of the user's
    (``nb.BLR(guide=...)``) have no description that is the same in every process: those fits use JAX's
    cache alone. So do programs that call back into Python or use custom calls a fresh process has not
    registered (only LAPACK's, initialised before loading, and jaxlib's own are accepted). On any doubt
    (a damaged or foreign file, another tree of outputs, the guide's traced setup values in another
    order, a failed load) :func:`fit` compiles as without the cache, and gives the same result; each
    program read, missed or written is counted in :func:`cache_info`.

    Caveats of both caches: entries are not evicted (delete the directory to reclaim the space; a few MB
    per model, twice for :func:`fit`'s programs), the directory must not be shared by machines with
    different CPUs or accelerator drivers, and it must be trusted (an entry is unpickled and loaded as
    code). Programs whose text depends on the process (NumPyro's ``Trace_ELBO`` sums sites in a
    hash-seed-dependent order: :func:`fit` uses :class:`Trace_ELBO` instead) never hit. Call it before
    the first compilation of the process to cover every program.
    """
    if path is None:
        path = os.environ.get("NUMPYRO_BLR_CACHE") or (
            pathlib.Path(os.environ.get("XDG_CACHE_HOME") or pathlib.Path.home() / ".cache") / "numpyro_blr" / "jax")
    path = pathlib.Path(path).expanduser().resolve()
    path.mkdir(parents=True, exist_ok=True)
    jax.config.update("jax_compilation_cache_dir", str(path))
    _DISK["dir"] = str(path / "numpyro_blr")  # fit's own programs (JAX's entries are the directory's *-cache files)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", -1)
    try:  # a process that compiled before the directory was set has initialised the cache without it
        from jax._src import compilation_cache as _cc

        if getattr(_cc, "_cache_initialized", False) or getattr(_cc, "_cache_checked", False):
            _cc.reset_cache()
    except Exception:  # noqa: BLE001 - private API: the settings above still apply to a fresh process
        pass
    return path
