r"""A NumPyro model read as a factor graph of exponential-family sites: what message passing sees.

Every latent sample site gets the exponential family of its prior
(:func:`numpyro_blr.families.registry.for_prior`), every ``numpyro.param`` site a point mass, and every
sample site (priors, likelihoods, :func:`numpyro.factor`) is a *factor* :math:`\phi = \log p_{\text{site}}`.
Nothing is written by hand: the graph is read off one abstract trace of the model, and which latent sites a
factor reads is read off the jaxpr of its log density.

**Elements.** A site's batch axes that belong to a ``numpyro.plate`` are its *elements*: independent under
:math:`q`, each with its own natural parameters, updated together in one vectorised step. A Gaussian
site is one dense Gaussian per element over the remaining axes (its event axes and any batch axes that are
not a plate, so ``Normal(0, 1).expand([d])`` outside plates is one ``d``-dimensional Gaussian, as in
:func:`~numpyro_blr.infer.conjugate_fit`); Gamma, Beta and Bernoulli sites are elementwise over all axes;
Dirichlet and Categorical sites have one distribution per batch index.

**Values.** :meth:`Graph.run` traces the model with chosen values of the latent sites and parameters (any
leading axes are a ``vmap``), with every subsampled plate given its indices (all of them by default, so
that a model written for minibatches is fitted to the whole data set). :meth:`Graph.log_prob` is a factor's
log density per element of its batch shape, its ``scale`` and mask applied.
"""

import dataclasses
import types
import weakref
from dataclasses import dataclass, field
from typing import Any, Dict, Tuple

import jax
import jax.numpy as jnp
import numpy as np
import numpyro.distributions as dist
from numpyro import handlers
from numpyro.distributions.transforms import biject_to

from numpyro_blr.families import Categorical, FullGaussian
from numpyro_blr.families.registry import exponential_form, for_prior, prior_names

__all__ = ["Factor", "Graph", "ModelError", "NonConjugateError", "Site", "Unfreezable", "freeze", "intern", "shared_jit"]


#: XLA options for programs run once or on little data (construction checks, small sweeps): backend optimisation
#: off, about 1.3-2x faster compiles for slower code
FAST_COMPILE = {"compiler_options": {"xla_backend_optimization_level": 0, "xla_llvm_disable_expensive_passes": True}}


class ModelError(ValueError):
    """A model message passing cannot read as asked (the message names the site and says what to do)."""


class NonConjugateError(ModelError):
    """A latent site's complete conditional is not in its prior's exponential family, or no family fits it."""


def unwrap(fn):
    """Strip ``Independent``, ``ExpandedDistribution`` and ``MaskedDistribution`` (not transforms)."""
    while isinstance(fn, (dist.Independent, dist.ExpandedDistribution, dist.MaskedDistribution)):
        fn = fn.base_dist
    return fn


def mask_of(fn):
    """The product of the masks of ``fn``'s ``MaskedDistribution`` wrappers, or None."""
    mask = None
    while isinstance(fn, (dist.Independent, dist.ExpandedDistribution, dist.MaskedDistribution)):
        if isinstance(fn, dist.MaskedDistribution) and not isinstance(fn._mask, bool):
            mask = fn._mask if mask is None else mask & fn._mask
        elif isinstance(fn, dist.MaskedDistribution) and fn._mask is False:
            mask = jnp.zeros((), bool)
        fn = fn.base_dist
    return mask


_KINDS = {"multivariate_normal": "gaussian", "gamma": "gamma", "beta": "beta", "dirichlet": "dirichlet",
          "bernoulli": "bernoulli", "categorical": "categorical"}


# ----------------------------------------------------------------------------------------------
# Sites
# ----------------------------------------------------------------------------------------------


@dataclass
class Site:
    r"""A latent site: its family, shapes and element layout (see the module docstring).

    Natural parameters are the family's NamedTuple in the *element layout*: for a Gaussian ``eta1`` of
    shape ``elem_shape + (B,)`` and ``eta2`` of ``elem_shape + (B, B)``; for the other families the
    family's own layout over the value (``value_shape``, plus the category axis for Dirichlet/Categorical).
    A point site (``kind == "point"``) holds its unconstrained value instead.
    """

    name: str
    kind: str
    family: Any
    info: Any
    value_shape: Tuple[int, ...]
    dtype: Any
    float_dtype: Any
    batch_shape: Tuple[int, ...]
    event_shape: Tuple[int, ...]
    plates: Dict[str, int]  # plate name -> axis of the value
    is_param: bool = False
    transform: Any = None  # point sites: constrained <- unconstrained
    num_categories: int = 0
    elem_axes: Tuple[int, ...] = ()
    block_axes: Tuple[int, ...] = ()
    elem_shape: Tuple[int, ...] = ()
    block_shape: Tuple[int, ...] = ()
    block_size: int = 1
    scale: float = 1.0  # the site's own factor's scale (a subsampled plate's N/B): q counts that many times

    # --- layout -------------------------------------------------------------------------------
    @property
    def discrete(self):
        return self.kind in ("bernoulli", "categorical")

    @property
    def num_elements(self):
        if self.kind == "gaussian":
            return int(np.prod(self.elem_shape))
        if self.kind in ("dirichlet", "categorical"):
            return int(np.prod(self.batch_shape))
        return int(np.prod(self.value_shape))

    def describe(self):
        if self.kind == "point":
            return f"site '{self.name}' (point estimate)"
        i = self.info
        return f"site '{self.name}' ({i.label} family, support {i.support}, statistics {i.statistics})"

    def to_value(self, block, lead=1):
        """A Gaussian's element-layout array ``(lead..., elem..., B)`` in the value's shape ``(lead..., value...)``."""
        lead_shape = block.shape[:lead]
        x = block.reshape(lead_shape + self.elem_shape + self.block_shape)
        order = self.elem_axes + self.block_axes
        inverse = tuple(int(i) for i in np.argsort(order))
        return jnp.transpose(x, tuple(range(lead)) + tuple(lead + i for i in inverse))

    def to_block(self, value, lead=0):
        """The inverse of :meth:`to_value`."""
        lead_shape = value.shape[:lead]
        x = jnp.transpose(value, tuple(range(lead)) + tuple(lead + a for a in self.elem_axes + self.block_axes))
        return x.reshape(lead_shape + self.elem_shape + (self.block_size,))

    # --- families -----------------------------------------------------------------------------
    def natural_from_dist(self, fn):
        """Natural parameters (element layout) of a NumPyro distribution over the site (its prior, or an ``init``)."""
        base = unwrap(fn)
        if self.kind == "gaussian":
            if isinstance(base, dist.Normal):
                loc = jnp.broadcast_to(base.loc, self.value_shape).astype(self.float_dtype)
                var = jnp.broadcast_to(base.scale, self.value_shape).astype(self.float_dtype) ** 2
                mean, prec = self.to_block(loc), 1.0 / self.to_block(var)
                precision = prec[..., :, None] * jnp.eye(self.block_size, dtype=self.float_dtype)
                return FullGaussian.to_natural(mean, precision)
            if isinstance(base, dist.MultivariateNormal):
                d = base.event_shape[-1]
                loc = jnp.broadcast_to(base.loc, self.batch_shape + (d,)).astype(self.float_dtype)
                prec = jnp.broadcast_to(base.precision_matrix, self.batch_shape + (d, d)).astype(self.float_dtype)
                nb = len(self.batch_shape)
                batch_block = tuple(a for a in self.block_axes if a < nb)
                order = self.elem_axes + batch_block
                loc = jnp.transpose(loc, order + (nb,))
                prec = jnp.transpose(prec, order + (nb, nb + 1))
                m = int(np.prod([self.value_shape[a] for a in batch_block]))
                loc = loc.reshape(self.elem_shape + (m * d,))
                prec = prec.reshape(self.elem_shape + (m, d, d))
                eye = jnp.eye(m, dtype=self.float_dtype)
                full = jnp.einsum("bc,...bij->...bicj", eye, prec).reshape(self.elem_shape + (m * d, m * d))
                return FullGaussian.to_natural(loc, full)
            raise ModelError(f"site '{self.name}': a Gaussian from {type(base).__name__} is not supported")
        user = self.family.from_numpyro(base)
        user = user if isinstance(user, tuple) else (user,)
        if self.kind in ("dirichlet", "categorical"):
            k = user[0].shape[-1]
            user = tuple(jnp.broadcast_to(u, self.batch_shape + (k,)) for u in user)
        else:
            user = tuple(jnp.broadcast_to(u, self.value_shape) for u in user)
        return self.family.to_natural(*[jnp.asarray(u, self.float_dtype) for u in user])

    def expectation(self, natural):
        if self.kind == "point":
            return natural
        return self.family.expectation(natural)

    def constrained(self, unconstrained):
        return self.transform(unconstrained)

    def points(self, natural, mean):
        r"""The site's quadrature rule, exact for every function affine in its statistics, as functions of the
        expectation parameters ``mean`` (so autodiff gives :math:`\nabla_\mu`): ``(values, weights)`` with values
        of shape ``(P,) + value_shape``; weights of shape ``(P,)`` (continuous rules) or ``(P,) + batch_shape``
        (discrete enumeration, the probabilities)."""
        if self.kind == "point":
            return self.constrained(mean)[None], jnp.ones((1,), self.float_dtype)
        pts, w = self.family.quadrature(mean, natural)
        if self.kind == "gaussian":
            return self.to_value(pts), w
        if self.discrete:
            pts = pts.astype(self.dtype)
        return pts, w

    def reference(self, natural):
        """A value for evaluations that do not integrate over the site: its mean (continuous), mode (discrete)."""
        if self.kind == "point":
            return self.constrained(natural)
        if self.kind == "gaussian":
            mean, _ = FullGaussian.from_natural(natural)
            return self.to_value(mean[None])[0]
        if self.kind == "categorical":
            return jnp.argmax(Categorical.from_natural(natural), -1).astype(self.dtype)
        if self.kind == "bernoulli":
            return (natural.logits > 0).astype(self.dtype)
        if self.kind == "gamma":
            a, b = self.family.from_natural(natural)
            return a / b
        if self.kind == "beta":
            a, b = self.family.from_natural(natural)
            return a / (a + b)
        alpha = self.family.from_natural(natural)
        return alpha / jnp.sum(alpha, -1, keepdims=True)

    def entropy(self, natural):
        if self.kind == "point":
            return jnp.zeros((), self.float_dtype)
        if self.kind == "gaussian":
            return jnp.sum(FullGaussian.entropy(-2.0 * natural.eta2))
        return self.family.entropy(*self.info.user(natural))

    def is_valid(self, natural):
        if self.kind == "point":
            return jnp.all(jnp.isfinite(natural))
        if self.kind == "gaussian":
            return jnp.all(FullGaussian.is_valid(natural))
        return jnp.all(self.family.is_valid(natural)) & jnp.all(jnp.asarray([jnp.all(jnp.isfinite(a)) for a in natural]))

    def distribution(self, natural):
        """The posterior as a NumPyro distribution over the site's value (batch: the elements)."""
        if self.kind == "point":
            return dist.Delta(self.constrained(natural), event_dim=len(self.value_shape))
        if self.kind == "gaussian":
            mean, precision = FullGaussian.from_natural(natural)
            if self.block_size == 1:
                sd = jax.lax.rsqrt(precision[..., 0, 0])
                d = dist.Normal(self.to_value(mean[None])[0], self.to_value(sd[..., None][None])[0])
                return d.to_event(len(self.value_shape) - len(self.elem_axes)) if len(self.value_shape) > len(self.elem_axes) else d
            d = dist.MultivariateNormal(mean, precision_matrix=precision)
            leading = self.elem_axes == tuple(range(len(self.elem_axes)))
            if leading and self.block_shape != (self.block_size,):
                from numpyro.distributions.transforms import ReshapeTransform

                d = dist.TransformedDistribution(d, ReshapeTransform(self.block_shape, (self.block_size,)))
            return d
        d = self.family.to_numpyro(*self.info.user(natural))
        extra = len(self.value_shape) - len(d.batch_shape) - len(d.event_shape)
        return d.to_event(len(d.batch_shape) - len(self.batch_shape)) if extra == 0 and len(d.batch_shape) > len(self.batch_shape) else d


def _frames(msg):
    return {f.name: (f.dim, f.size) for f in msg.get("cond_indep_stack", [])}


def _make_site(name, msg, float_dtype, point):
    """The :class:`Site` of a traced latent sample site (or param site)."""
    value = msg["value"]
    shape = tuple(jnp.shape(value))
    if msg["type"] == "param":
        constraint = msg["kwargs"].get("constraint", dist.constraints.real)
        return Site(name, "point", None, None, shape, jnp.result_type(value), float_dtype, shape, (), {},
                    is_param=True, transform=biject_to(constraint))
    fn = msg["fn"]
    batch_shape, event_shape = tuple(fn.batch_shape), tuple(fn.event_shape)
    plates = {}
    for pname, (dim, size) in _frames(msg).items():
        axis = len(batch_shape) + dim
        if 0 <= axis < len(batch_shape) and batch_shape[axis] == size and size > 1:
            plates[pname] = axis
    if name in point:
        support = fn.support
        return Site(name, "point", None, None, shape, jnp.result_type(value), float_dtype, batch_shape, event_shape,
                    plates, transform=biject_to(support))
    base = unwrap(fn)
    info = for_prior(base)
    scale = msg.get("scale")
    try:
        scale = 1.0 if scale is None else float(scale)
    except TypeError:
        raise ModelError(f"site '{name}': a scale that varies over the site (handlers.scale with an array) is not "
                         "supported by message passing; scale the whole site or none of it.") from None
    if info is None:
        raise NonConjugateError(
            f"site '{name}': prior {type(base).__name__} (support {fn.support}) has no exponential family here; "
            f"the supported priors are {prior_names()} (give the site one of them, or fit the model with nb.BLR and SVI)."
        )
    kind = _KINDS[info.name]
    dtype = jnp.result_type(value) if info.discrete else float_dtype
    site = Site(name, kind, info.family, info, shape, dtype, float_dtype, batch_shape, event_shape, plates, scale=scale)
    if kind == "gaussian":
        elem = tuple(sorted(plates.values()))
        block = tuple(a for a in range(len(shape)) if a not in elem)
        site.elem_axes, site.block_axes = elem, block
        site.elem_shape = tuple(shape[a] for a in elem)
        site.block_shape = tuple(shape[a] for a in block)
        site.block_size = int(np.prod(site.block_shape))
    elif kind == "categorical":
        site.num_categories = int(base.logits.shape[-1])
    return site


# ----------------------------------------------------------------------------------------------
# Factors
# ----------------------------------------------------------------------------------------------


@dataclass
class Factor:
    """A sample site's log density as a factor: which latent sites it reads and how its expectation is taken.

    ``path`` is ``"full"`` (the model evaluated at every combination of its parents' quadrature points, per
    element) or ``"shrunk"`` (its local discrete parents enumerated with their plates shrunk to size 1 and its
    value's statistics contracted against the expected natural parameters: O(N K) instead of O(N K x points)).
    """

    name: str
    observed: bool
    batch_shape: Tuple[int, ...]
    event_shape: Tuple[int, ...]
    plates: Dict[str, int]  # plate name -> axis of the batch
    deps: Tuple[str, ...] = ()
    path: str = "full"
    local: Tuple[str, ...] = ()  # shrunk path: local discrete sites enumerated (own value included)
    local_axes: Tuple[int, ...] = ()  # shrunk path: batch axes of those sites' plates
    info: Dict[str, Any] = field(default_factory=dict)

    @property
    def parents(self):
        return tuple(d for d in self.deps if d != self.name)


def _default_value(msg):
    fn = msg["fn"]
    shape = tuple(msg["kwargs"].get("sample_shape", ())) + tuple(fn.batch_shape) + tuple(fn.event_shape)
    if fn.is_discrete:
        return jnp.zeros(shape, jnp.result_type(int))
    try:
        return jnp.broadcast_to(fn.mean, shape)
    except Exception:  # pragma: no cover - a distribution without a mean
        return None


class Graph:
    """The factor graph of ``model(*args, **kwargs)`` (see the module docstring).

    ``point``: latent site names to be point estimates (EM); ``plates``: ``{plate name: indices}`` to
    substitute (stochastic VI's minibatch), other subsampled plates get all their indices (unless
    ``full_plates=False``: then they subsample as the model says).
    """

    def __init__(self, model, args=(), kwargs=None, point=(), plates=None, full_plates=True):
        self.model, self.args, self.kwargs = model, tuple(args), dict(kwargs or {})
        self.full_plates = full_plates
        self.point = tuple(point)
        self.plate_values = dict(plates or {})
        self.float_dtype = jnp.result_type(float)
        self.sites: Dict[str, Site] = {}
        self.factors: Dict[str, Factor] = {}

        def abstract():  # static structure only: nothing traced leaves this function
            tr = self.run({}, {})
            self.subsampled = {n: s["args"] for n, s in tr.items()
                               if s["type"] == "plate" and s["args"][1] is not None and s["args"][1] != s["args"][0]}
            latent_names = [n for n, s in tr.items() if s["type"] == "sample" and not s["is_observed"]]
            unknown = [p for p in self.point if p not in latent_names]
            if unknown:
                raise ModelError(f"point={unknown}: not latent sample sites of the model (latent sites: {latent_names}).")
            for name, msg in tr.items():
                if msg["type"] == "param":
                    self.sites[name] = _make_site(name, msg, self.float_dtype, self.point)
                elif msg["type"] == "sample":
                    if msg.get("infer") and msg["infer"].get("is_auxiliary"):
                        continue
                    if not msg["is_observed"]:
                        self.sites[name] = _make_site(name, msg, self.float_dtype, self.point)
                    fn = msg["fn"]
                    lp_shape = tuple(jnp.shape(fn.log_prob(msg["value"])))
                    batch = tuple(jnp.broadcast_shapes(lp_shape, tuple(fn.batch_shape)))
                    plates = {}
                    for pname, (dim, size) in _frames(msg).items():
                        axis = len(batch) + dim
                        if 0 <= axis < len(batch):
                            plates[pname] = axis
                    self.factors[name] = Factor(name, bool(msg["is_observed"]), batch, tuple(fn.event_shape), plates)
            return 0

        jax.eval_shape(abstract)
        if not self.sites:
            raise ModelError("the model has no latent sample sites and no parameters")
        self._dependencies()

    # --- data as jit arguments -------------------------------------------------------------------
    def _data_leaves(self):
        leaves, treedef = jax.tree_util.tree_flatten((self.args, self.kwargs))
        dynamic = [i for i, x in enumerate(leaves) if isinstance(x, (np.ndarray, jax.Array)) and np.ndim(x) >= 1]
        return leaves, treedef, dynamic

    def data(self):
        """The model's array arguments (``ndim >= 1``), the dynamic inputs of :meth:`jit`."""
        leaves, _, dynamic = self._data_leaves()
        return [jnp.asarray(leaves[i]) for i in dynamic]

    def set_data(self, args, kwargs=None):
        """Replace the model's arguments (same structure and shapes: a new minibatch)."""
        self.args, self.kwargs = tuple(args), dict(kwargs or {})

    def jit(self, fn, key=None, data=True, **jit_kwargs):
        """``jax.jit(fn)`` with the model's array arguments and the subsampled plates' indices passed as inputs, not
        folded in as constants (XLA constant-folds computations on large constants: slow compiles, and the same
        program recompiled for every data set or minibatch).

        With ``key`` (hashable, :func:`freeze`-able: everything ``fn`` reads besides its inputs and this graph, e.g.
        an engine's options), the compiled program is shared by every graph of equal :meth:`static_key` called with a
        key equal to it (:func:`shared_jit`): a second object on the same model, options and shapes does not compile
        again. ``data=False``: ``fn`` does not run the model (posterior parameters from natural parameters), and the
        data are not passed. ``key=None``: a program of this wrapper alone, as before issue 24."""

        def inner(data, plate_values, *a, **k):
            leaves, treedef, dynamic = self._data_leaves()
            saved = self.args, self.kwargs, self.plate_values
            leaves = list(leaves)
            for i, x in zip(dynamic, data):
                leaves[i] = x
            self.args, self.kwargs = jax.tree_util.tree_unflatten(treedef, leaves)
            self.plate_values = plate_values
            try:
                return fn(*a, **k)
            finally:
                self.args, self.kwargs, self.plate_values = saved

        name = _name(key, fn)
        if key is not None:
            try:
                key = intern(("graph.jit", key if isinstance(key, _Key) else freeze(key), bool(data)))
            except Unfreezable:
                key = None
        if key is None:
            if not data:
                return jax.jit(fn, **jit_kwargs)
            jitted = jax.jit(inner, **jit_kwargs)

            def call(*a, **k):
                return jitted(self.data(), dict(self.plate_values), *a, **k)

            call.jitted = jitted
            return call

        shared = _shared_jitted(jit_kwargs, name)
        local = []  # this wrapper's own program, for arguments that cannot be frozen

        def keys():
            graph_key = self.static_key()
            if not data:
                return (key, graph_key)
            args_key = self._args_key()
            return None if graph_key is None or args_key is None else (key, graph_key, args_key)

        def fallback():
            if not local:
                local.append(jax.jit(inner if data else fn, **jit_kwargs))
            return local[0]

        if not data:
            def call(*a, **k):
                parts = keys()
                if parts[1] is None:
                    return fallback()(*a, **k)
                return _call_shared(shared, parts, fn, a, k)

            return call

        def call(*a, **k):
            parts, inputs = keys(), (self.data(), dict(self.plate_values))
            if parts is None:
                return fallback()(*inputs, *a, **k)
            return _call_shared(shared, parts, inner, inputs + a, k)

        call.jitted = _Bound(shared, keys, inner, fallback)
        return call

    # --- the static structure, for sharing compiled programs ------------------------------------------
    #: attributes that are inputs of the compiled programs (or memos), not part of :meth:`static_key`
    _NOT_STATIC = frozenset({"args", "kwargs", "plate_values", "_static_memo", "_args_memo"})

    def static_key(self):
        """Everything a traced function reads from this graph besides the model's array arguments and the plates'
        indices (:func:`freeze`: the model function, sites, factors and their paths, the options), interned; None
        if some of it cannot be frozen. Recomputed when a factor's path changes (:func:`~.expectations.check`)."""
        finger = tuple((f.path, f.local, f.local_axes, f.deps) for f in self.factors.values())
        memo = getattr(self, "_static_memo", None)
        if memo is not None and memo[0] == finger:
            return memo[1]
        try:
            key = intern(("graph", type(self), tuple((k, freeze(v)) for k, v in sorted(vars(self).items())
                                                      if k not in self._NOT_STATIC)))
        except Unfreezable:
            key = None
        self._static_memo = (finger, key)
        return key

    def _args_key(self):
        """The model arguments' structure, which leaves are inputs, and the other leaves' values (folded into the
        program), interned; None if some cannot be frozen. Memoised on the identity of ``args``/``kwargs``."""
        memo = getattr(self, "_args_memo", None)
        if memo is not None and memo[0] is self.args and memo[1] is self.kwargs:
            return memo[2]
        leaves, treedef, dynamic = self._data_leaves()
        dyn = set(dynamic)
        try:
            key = intern(("args", treedef, tuple(dynamic),
                           tuple(freeze(x) for i, x in enumerate(leaves) if i not in dyn)))
        except Unfreezable:
            key = None
        self._args_memo = (self.args, self.kwargs, key)
        return key

    # --- evaluation -----------------------------------------------------------------------------
    def run(self, values, params):
        """Trace the model with latent ``values`` and constrained ``params`` substituted (missing latent sites
        take their prior mean, or 0 if discrete); subsampled plates get ``self.plate_values`` or all indices."""
        plate_values = self.plate_values

        def substitute_fn(msg):
            kind = msg["type"]
            if kind == "sample":
                if msg.get("is_observed"):
                    return None
                if msg["name"] in values:
                    return values[msg["name"]]
                return _default_value(msg)
            if kind == "param":
                return params.get(msg["name"])
            if kind == "plate":
                size, sub = msg["args"]
                if msg["name"] in plate_values:
                    return plate_values[msg["name"]]
                if sub is not None and sub != size and (self.full_plates or sub > size):
                    # more indices than the plate has cannot be drawn (without replacement: jax.random.choice
                    # raises, in some JAX versions while the model is traced); svi names the plate after the trace
                    return jnp.arange(size)
            return None

        import warnings

        with handlers.block(), warnings.catch_warnings():
            # the plate warns when given more indices than its subsample_size: the full data set, on purpose
            warnings.filterwarnings("ignore", message="subsample_size does not match")
            model = handlers.seed(handlers.substitute(self.model, substitute_fn=substitute_fn), 0)
            return handlers.trace(model).get_trace(*self.args, **self.kwargs)

    def split(self, values):
        """Latent sample values and constrained parameter values of a dict over all sites."""
        params = {n: v for n, v in values.items() if n in self.sites and self.sites[n].is_param}
        latent = {n: v for n, v in values.items() if n not in params}
        return latent, params

    def log_prob(self, name, values):
        """Factor ``name``'s log density per element of its batch shape (scale and mask applied), the latent
        sites and parameters at ``values``."""
        latent, params = self.split(values)
        site = self.run(latent, params)[name]
        lp = site["fn"].log_prob(site["value"])
        if site.get("scale") is not None:
            lp = lp * site["scale"]
        return jnp.broadcast_to(lp, self.factors[name].batch_shape)

    def site_msg(self, name, values):
        latent, params = self.split(values)
        return self.run(latent, params)[name]

    # --- structure ------------------------------------------------------------------------------
    def _dependencies(self):
        """Factor -> the sites its log density reads, from the jaxpr of the log densities (nothing runs).

        Every equation's outputs inherit the union of its inputs' sites (nested calls as a whole, which can only
        over-approximate; an over-approximation costs time, not exactness)."""
        names = list(self.sites)
        factor_names = list(self.factors)

        def evaluate(values):
            latent, params = self.split(values)
            tr = self.run(latent, params)
            out = {}
            for f in factor_names:
                s = tr[f]
                lp = s["fn"].log_prob(s["value"])
                out[f] = jnp.sum(lp * s["scale"]) if s.get("scale") is not None else jnp.sum(lp)
            return out

        example = {n: jax.ShapeDtypeStruct(self.sites[n].value_shape, self.sites[n].dtype) for n in names}
        closed = jax.make_jaxpr(evaluate)(example)
        jaxpr = closed.jaxpr
        leaves, _ = jax.tree_util.tree_flatten({n: n for n in names})
        env = {var: frozenset([n]) for var, n in zip(jaxpr.invars, leaves)}

        def read(v):
            return env.get(v, frozenset()) if type(v).__name__ != "Literal" else frozenset()

        for eqn in jaxpr.eqns:
            d = frozenset().union(*[read(v) for v in eqn.invars]) if eqn.invars else frozenset()
            for o in eqn.outvars:
                env[o] = d
        out_leaves, _ = jax.tree_util.tree_flatten({f: f for f in factor_names})
        found = {f: read(v) for f, v in zip(out_leaves, jaxpr.outvars)}
        for f in factor_names:
            self.factors[f].deps = tuple(n for n in names if n in found[f] or n == f)

    def factors_of(self, site):
        return [f for f in self.factors.values() if site in f.deps]

    def is_local(self, site, factor):
        """Whether every element axis of ``site`` is a plate of ``factor`` (then element ``n`` of the factor reads
        element ``n`` of the site only), and the site has at least one."""
        s = self.sites[site]
        if not s.plates:
            return False
        elem_axes = set(s.plates.values())
        nb = len(s.batch_shape)
        if any(a not in elem_axes and s.batch_shape[a] > 1 for a in range(nb)):
            return False
        return all(p in factor.plates for p in s.plates)

    def choose_paths(self):
        """Decide each factor's path (:class:`Factor`): shrunk when its local parents (its own value included,
        if latent) are all discrete and aligned with its plates, at least one exists, its value's statistics are
        known (observed sites: :func:`~numpyro_blr.families.registry.exponential_form`; latent: discrete), and a
        trial evaluation with those sites' plates shrunk to size 1 gives natural parameters of size 1 there."""
        for f in self.factors.values():
            f.path, f.local, f.local_axes = "full", (), ()
            local = [d for d in f.deps if d in self.sites and self.is_local(d, f)]
            if not local or any(not self.sites[d].discrete for d in local):
                continue
            if not f.observed and not (f.name in local):
                continue
            if not f.observed and f.event_shape:
                continue
            axes = sorted({f.plates[p] for d in local for p in self.sites[d].plates})
            try:
                shapes = jax.eval_shape(lambda: self._shrunk_terms(f, tuple(local), tuple(axes), self._abstract_values(f, local, axes)))
            except Exception:  # noqa: BLE001 - a model that cannot run with shrunk plates takes the full path
                continue
            if shapes is None:
                continue
            f.path, f.local, f.local_axes = "shrunk", tuple(local), tuple(axes)

    def _abstract_values(self, f, local, axes):
        values = {}
        for n, s in self.sites.items():
            if n in local:
                values[n] = jnp.zeros(self.shrunk_shape(s, f), s.dtype)
            elif s.kind == "point":
                values[n] = jnp.zeros(s.value_shape, s.float_dtype)
            else:
                values[n] = jnp.zeros(s.value_shape, s.dtype) if s.discrete else jnp.ones(s.value_shape, s.dtype) * 0.5
        return values

    def shrunk_shape(self, site, factor):
        """``site``'s value shape with the axes of ``factor``'s plates shrunk to 1."""
        shape = list(site.value_shape)
        for p, a in site.plates.items():
            if p in factor.plates:
                shape[a] = 1
        return tuple(shape)

    def _shrunk_terms(self, f, local, axes, values):
        """The factor with its local sites at shrunk values: ``(log_prob summed,)`` for a latent discrete factor,
        ``(natural, log_partition)`` for an observed one; None if its parameters vary along the shrunk axes
        (covariates) or its family is unknown."""
        latent, params = self.split(values)
        msg = self.run(latent, params)[f.name]
        fn = msg["fn"]
        target = list(f.batch_shape)
        for a in axes:
            target[a] = 1
        target = tuple(target)
        if not f.observed:
            # the plate expands the distribution to the full plate: with the value shrunk, every element along the
            # shrunk axes is the same unless the parameters vary there (the check at construction tells)
            lp = jnp.broadcast_to(fn.log_prob(msg["value"]), f.batch_shape)
            lp = lp[tuple(slice(0, 1) if a in axes else slice(None) for a in range(len(f.batch_shape)))]
            return (jnp.sum(lp),)
        base = unwrap(fn)
        form = exponential_form(base)
        if form is None:
            return None
        family, natural, _ = form
        full = len(f.batch_shape) + len(f.event_shape)
        base_full = len(base.batch_shape) + len(base.event_shape)
        out = []
        for arr in natural:
            extra = arr.ndim - base_full
            lead = full - base_full
            if lead < 0:
                return None
            shape = arr.shape
            for a in axes:
                i = a - lead
                if i >= 0 and shape[i] != 1:
                    return None
            arr = jnp.reshape(arr, (1,) * lead + shape)
            out.append(jnp.broadcast_to(arr, target + tuple(f.event_shape) + tuple(shape[base_full:]) if extra >= 0 else arr.shape))
        natural = type(natural)(*out)
        return (natural, family.log_partition(natural))


# ----------------------------------------------------------------------------------------------
# Compiled programs shared across objects (issue 24)
# ----------------------------------------------------------------------------------------------
#: arrays up to this many entries are frozen by value (their values are folded into a program); larger ones make a
#: key unfreezable (such an object gets programs of its own)
FREEZE_MAX_SIZE = 4096


_TRACER = getattr(jax.core, "Tracer", ())


class Unfreezable(TypeError):
    """A value with no hashable description by value (an unhashable object, a large array, a tracer)."""


def freeze(x):
    """A hashable description of ``x``, equal for two values only if a function reading them traces to the same
    program: primitives with their type, containers (order kept) and dataclasses recursively, arrays up to
    :data:`FREEZE_MAX_SIZE` entries by dtype, shape and bytes, pytrees (transforms, constraints) by structure and
    leaves, Python functions by identity and what they read (:func:`_function_key`), classes and other
    identity-hashed objects by identity (equal only to themselves).

    Raises:
        Unfreezable: an unhashable object that is none of these, a larger array, a tracer, a cyclic container.
    """
    return _freeze(x, _function_key, set())


#: containers nested deeper than this are not frozen (Unfreezable)
_MAX_DEPTH = 64


def _freeze(x, function, active):
    """:func:`freeze` with ``function`` for Python functions; ``active``: the ids of the containers being frozen
    (a cycle, or nesting deeper than :data:`_MAX_DEPTH`, is Unfreezable)."""
    if x is None or isinstance(x, (bool, int, str, bytes)):
        return (type(x), x)
    if isinstance(x, (float, complex)):
        return (type(x), repr(x))  # repr: -0.0 differs from 0.0, nan equals nan
    if isinstance(x, (_Key, _Ref, jax.tree_util.PyTreeDef)):  # already frozen; a pytree's structure
        return (type(x), x)
    if isinstance(x, _TRACER):
        raise Unfreezable("a traced value")
    if isinstance(x, (np.ndarray, np.generic, jax.Array)):
        if np.size(x) > FREEZE_MAX_SIZE:
            raise Unfreezable(f"an array of {np.size(x)} entries")
        a = np.asarray(x)
        return ("array", type(x), a.dtype.name, a.dtype.str, a.shape, bool(getattr(x, "weak_type", False)), a.tobytes())
    if isinstance(x, np.dtype):
        return ("dtype", x.name, x.str)
    if isinstance(x, types.FunctionType):
        return function(x)
    if isinstance(x, (type, types.BuiltinFunctionType, types.MethodType, types.ModuleType)):
        return ("id", x)  # equal only to itself (a bound method: to the same function of the same object)
    if id(x) in active or len(active) >= _MAX_DEPTH:
        raise Unfreezable("a cyclic or too deeply nested value")
    active.add(id(x))
    try:
        def sub(v):
            return _freeze(v, function, active)

        if isinstance(x, tuple):
            return (type(x), tuple(sub(e) for e in x))
        if isinstance(x, list):
            return (list, tuple(sub(e) for e in x))
        if isinstance(x, dict):
            return (type(x), tuple((sub(k), sub(v)) for k, v in x.items()))
        if isinstance(x, (set, frozenset)):
            return (type(x), frozenset(sub(e) for e in x))
        if dataclasses.is_dataclass(x):
            return (type(x), tuple((f.name, sub(getattr(x, f.name))) for f in dataclasses.fields(x)))
        leaves, treedef = jax.tree_util.tree_flatten(x)
        if not (len(leaves) == 1 and leaves[0] is x):  # a registered pytree: a transform, a constraint
            return ("tree", treedef, tuple(sub(leaf) for leaf in leaves))
    finally:
        active.discard(id(x))
    if type(x).__hash__ is not None and type(x).__eq__ is object.__eq__:
        return ("id", x)
    raise Unfreezable(f"{type(x).__name__}")


class _Ref:
    """Identity of an object that cannot be frozen by value (a large array a function reads), holding it."""

    __slots__ = ("obj",)

    def __init__(self, obj):
        self.obj = obj

    def __hash__(self):
        return id(self.obj)

    def __eq__(self, other):
        return type(other) is _Ref and self.obj is other.obj


def _identity(fn):
    return ("id", fn)


def _loose(v):
    """What a function reads from a closure cell, a default or a global: frozen with the functions in it by identity
    (not what they read in turn), or by identity when it cannot be frozen."""
    try:
        return _freeze(v, _identity, set())
    except Unfreezable:
        return ("ref", _Ref(v))


def _function_key(fn):
    """A Python function: itself (its identity), and the values it reads from its defaults, closure cells and the
    module globals its code names (not modules): rebinding a global data set (or a closed-over one) between two
    objects on the same model gives another key, as the constants folded into the program differ. An object it
    reads in place (a numpy array changed in place, an attribute of a global) is not followed, as in ``jax.jit``."""
    names, stack = set(), [fn.__code__]
    while stack:
        code = stack.pop()
        names.update(code.co_names)
        stack.extend(c for c in code.co_consts if isinstance(c, types.CodeType))
    env = fn.__globals__
    read = tuple((n, _loose(env[n])) for n in sorted(names) if n in env and not isinstance(env[n], types.ModuleType))
    cells = []
    for cell in fn.__closure__ or ():
        try:
            cells.append(_loose(cell.cell_contents))
        except ValueError:  # an empty cell
            cells.append(("empty",))
    return ("function", fn, _loose(fn.__defaults__), _loose(fn.__kwdefaults__), tuple(cells), read)


class _Key:
    """A frozen key with its hash computed once; interned (:func:`intern`) so that equal keys are one object."""

    __slots__ = ("value", "hash", "__weakref__")

    def __init__(self, value):
        self.value, self.hash = value, hash(value)

    def __hash__(self):
        return self.hash

    def __eq__(self, other):
        return self is other or (type(other) is _Key and self.hash == other.hash and self.value == other.value)


#: frozen value -> its :class:`_Key`, while a wrapper or a cached program holds it
_KEYS = weakref.WeakValueDictionary()


def intern(value):
    """The one :class:`_Key` of a frozen value (:func:`freeze`), its hash computed once."""
    key = _KEYS.get(value)
    if key is None:
        key = _KEYS[value] = _Key(value)
    return key


class _Program:
    """The static argument of a shared jitted function: the keys that say which program, and the function to trace
    (this call's; dropped after the call, so that a cached program holds no object's data or engine)."""

    __slots__ = ("keys", "hash", "fn")

    def __init__(self, keys, fn):
        self.keys, self.hash, self.fn = keys, hash(keys), fn

    def __hash__(self):
        return self.hash

    def __eq__(self, other):
        return (type(other) is _Program and self.hash == other.hash and len(self.keys) == len(other.keys)
                and all(a is b or a == b for a, b in zip(self.keys, other.keys)))


_SHARED = {}


def _shared_jitted(jit_kwargs, name="shared"):
    """The module's one jitted trampoline (calling its static :class:`_Program`'s function) per name (what profiles
    and XLA dumps call it, ``jit_<name>``) and set of jit options (XLA compiler options)."""
    if {"static_argnums", "static_argnames", "donate_argnums", "donate_argnames"} & set(jit_kwargs):
        raise ValueError("shared_jit: static or donated arguments are not supported")
    k = (name, freeze(jit_kwargs))
    jitted = _SHARED.get(k)
    if jitted is None:
        def trampoline(program, *a, **kw):
            return program.fn(*a, **kw)

        trampoline.__name__ = trampoline.__qualname__ = name
        jitted = _SHARED[k] = jax.jit(trampoline, static_argnums=0, **jit_kwargs)
    return jitted


def _name(key, fn):
    """A program's name: ``fn``'s, or for a lambda the key's label (its first string, before freezing)."""
    name = getattr(fn, "__name__", "")
    if name.isidentifier():
        return name
    for _ in range(4):
        if isinstance(key, _Key):
            key = key.value
        elif isinstance(key, tuple) and key:
            if isinstance(key[0], str):
                return key[0] if key[0].isidentifier() else "shared"
            key = key[0]
        else:
            break
    return "shared"


def _call_shared(jitted, keys, fn, a, k, method=None):
    program = _Program(keys, fn)
    try:
        return (jitted if method is None else getattr(jitted, method))(program, *a, **k)
    finally:
        program.fn = None


class _Bound:
    """A :meth:`Graph.jit` wrapper's program as a function of ``(data, plate_values, *args)``, with ``lower``
    (:func:`numpyro_blr.parallel.collective_counts`)."""

    def __init__(self, jitted, keys, fn, fallback):
        self._jitted, self._keys, self._fn, self._fallback = jitted, keys, fn, fallback

    def __call__(self, *a, **k):
        parts = self._keys()
        return self._fallback()(*a, **k) if parts is None else _call_shared(self._jitted, parts, self._fn, a, k)

    def lower(self, *a, **k):
        parts = self._keys()
        if parts is None:
            return self._fallback().lower(*a, **k)
        return _call_shared(self._jitted, parts, self._fn, a, k, method="lower")


def shared_jit(fn, key, **jit_kwargs):
    """``jax.jit(fn)`` whose compiled programs are shared by every ``shared_jit`` wrapper of an equal ``key``
    (:func:`freeze`): ``fn`` must read nothing but its inputs and what ``key`` describes (no array of one object
    folded in as a constant, or another object would get its values). A key that cannot be frozen gives a plain
    ``jax.jit(fn)``."""
    name = _name(key, fn)
    try:
        key = intern(("shared_jit", freeze(key)))
    except Unfreezable:
        return jax.jit(fn, **jit_kwargs)
    jitted = _shared_jitted(jit_kwargs, name)

    def call(*a, **k):
        return _call_shared(jitted, (key,), fn, a, k)

    return call
