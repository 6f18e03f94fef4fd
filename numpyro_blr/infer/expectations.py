r"""Exact :math:`\mathbb E_q[\log p]` of a factor from the model's log density, and the checks that make it exact.

Mean-field :math:`q = \prod_i q_i`. Each site's family has a *quadrature rule* (``family.quadrature``): points
:math:`x_{ij}` and weights :math:`w_{ij}` with :math:`\sum_j w_{ij} T_i(x_{ij}) = \mu_i`, exact for every function
affine in :math:`T_i` (Gaussian: :math:`2D` cubature points; Gamma, Beta, Dirichlet: two points; Bernoulli,
Categorical: enumeration). A factor :math:`\phi` whose log density is multi-affine in its sites' statistics
(conditional conjugacy, Winn & Bishop 2005) then has

.. math::
    \mathbb E_q[\phi] = \sum_{j_1,\dots,j_m} \Big(\prod_i w_{i j_i}\Big)\, \phi(x_{1 j_1}, \dots, x_{m j_m})

exactly, and :math:`\hat\eta_i = \nabla_{\mu_i}\mathbb E_q[\log p]`, the message of VMP and the BLR's
natural gradient at :math:`\rho = 1` (Khan & Rue 2023, Sec. 5), is autodiff through the rules (points are
functions of :math:`\mu` for continuous sites, weights for discrete ones). Every element of a site is at its
own :math:`j`-th point at once: exact when the factor, per element, has no product of two elements of one
site (it reads one component of a mixture's means, one coefficient vector): :func:`check` tests it.

Two ways to evaluate the sum (:class:`~numpyro_blr.infer.graph.Factor`'s ``path``):

* **full**: the model is run at every combination of points (vmapped; chunked with rematerialisation
  when large); a factor of ``N`` elements costs ``N`` times the number of combinations.
* **shrunk**: when a factor's local parents are discrete (mixture assignments, its own value if it is
  one) they are enumerated with their plates shrunk to size 1, so the model is run on the *global*
  points only, and the factor's value enters through its statistics:
  :math:`\mathbb E[\phi_n] = \sum_k r_{nk}\,(\langle T(y_n), \bar\eta_k\rangle - \bar A_k)`,
  :math:`\bar\eta_k = \sum_c W_c\,\eta(k, c)` (:func:`numpyro_blr.families.registry.exponential_form`). A sweep
  then costs :math:`O(NK\dim T)`, one matrix product, as a hand-written mixture VMP (BayesPy's Mixture node).

:func:`check` (run on the first sweep) tests what exactness needs, per factor and continuous site: a
Gaussian site's factor is quadratic along random lines (third differences vanish), another family's is
affine in its statistics (least squares on :math:`(1, T)` at test values), a multi-element site's
elements do not interact (mixed differences over a random split vanish), and a shrunk factor agrees with
its full evaluation. Failures name the site and the factor.
"""

import math

import jax
import jax.numpy as jnp
import numpy as np

from numpyro_blr.families.registry import exponential_form
from numpyro_blr.infer.graph import FAST_COMPILE, ModelError, mask_of, unwrap

__all__ = ["check", "expected_factor", "reference_values", "site_rules"]

#: above this many floats in one table of factor values, the first site's points are looped over
#: (``lax.map`` with rematerialisation) instead of vmapped
MAX_TABLE = 2**24


def site_rules(graph, natural, mean, names=None):
    """Each site's quadrature rule ``(values, weights)`` (:meth:`Site.points`), from its natural and expectation
    parameters."""
    names = graph.sites if names is None else names
    return {n: graph.sites[n].points(natural[n], mean[n]) for n in names}


def reference_values(graph, natural):
    return {n: s.reference(natural[n]) for n, s in graph.sites.items()}


def _weight_for(w, batch_shape):
    """A weight (scalar or a discrete site's per-element array, right-aligned) broadcast to a factor's batch shape."""
    return jnp.broadcast_to(w, batch_shape)


def expected_factor(graph, f, rules, refs):
    r""":math:`\mathbb E_q[\phi_f]` (a scalar), the sites at ``rules`` (:func:`site_rules`) and the others at ``refs``."""
    if f.path == "shrunk":
        return _shrunk(graph, f, rules, refs)
    return _full(graph, f, rules, refs)


def _full(graph, f, rules, refs):
    deps = list(f.deps)
    if not deps:
        return jnp.sum(graph.log_prob(f.name, refs))
    sizes = [rules[d][0].shape[0] for d in deps]
    batch = int(np.prod(f.batch_shape))

    def table(level, fixed):
        """Factor values over the points of deps[level:], contracted with their weights: shape = batch."""
        if level == len(deps):
            return graph.log_prob(f.name, {**refs, **fixed})
        name = deps[level]
        pts, w = rules[name]
        vals = jax.vmap(lambda v: table(level + 1, {**fixed, name: v}))(pts)
        return jnp.sum(jax.vmap(lambda wj: _weight_for(wj, f.batch_shape))(w) * vals, 0)

    if int(np.prod(sizes)) * batch <= MAX_TABLE or len(deps) == 0:
        return jnp.sum(table(0, {}))
    name = deps[0]
    pts, w = rules[name]

    @jax.checkpoint
    def one(args):
        v, wj = args
        return jnp.sum(_weight_for(wj, f.batch_shape) * table(1, {name: v}))

    return jnp.sum(jax.lax.map(one, (pts, w)))


def _local_layout(graph, f):
    """Per local site: its values (enumerated, shrunk) and a function of its weights to ``(|L|, K)``."""
    out = []
    for n in f.local:
        s = graph.sites[n]
        k = s.num_categories if s.kind == "categorical" else 2
        shape = graph.shrunk_shape(s, f)
        vals = jnp.stack([jnp.full(shape, j, s.dtype) for j in range(k)])
        out.append((n, vals, k))
    return out


def _to_local(arr, f, lead=0):
    """An array over a factor's batch shape (right-aligned, broadcast; ``lead`` leading axes kept) ->
    ``(lead..., |L|)`` over its local axes."""
    nb = len(f.batch_shape)
    arr = jnp.asarray(arr)
    lead_shape = arr.shape[:lead]
    body = arr.shape[lead:]
    arr = jnp.reshape(arr, lead_shape + (1,) * (nb - len(body)) + body)
    index = tuple(slice(None) if a in f.local_axes else slice(0, 1) for a in range(nb))
    arr = arr[(slice(None),) * lead + index]
    shape = lead_shape + tuple(f.batch_shape[a] if a in f.local_axes else 1 for a in range(nb))
    arr = jnp.broadcast_to(arr, shape)
    order = tuple(range(lead)) + tuple(lead + a for a in f.local_axes) + tuple(lead + a for a in range(nb) if a not in f.local_axes)
    return jnp.transpose(arr, order).reshape(lead_shape + (-1,))


def _flatten_local(arr, f):
    """``arr`` of shape ``batch + rest`` -> ``(prod of local axes, rest)`` with the local axes first."""
    order = tuple(f.local_axes) + tuple(a for a in range(arr.ndim) if a not in f.local_axes)
    arr = jnp.transpose(arr, order)
    n_local = int(np.prod([arr.shape[i] for i in range(len(f.local_axes))]))
    return arr.reshape(n_local, -1)


def _shrunk_table(graph, f, rules, refs):
    """Over every local configuration (the product of the local sites' values): the global-weighted natural
    parameters flattened with the local axes first, ``(C, Q)``, and log partitions ``(C,)`` (observed factor),
    or the global-weighted values ``(C,)`` (latent discrete factor)."""
    local = _local_layout(graph, f)
    globals_ = [d for d in f.deps if d not in f.local]

    def terms(values):
        out = graph._shrunk_terms(f, f.local, f.local_axes, {**refs, **values})
        if out is None:  # pragma: no cover - excluded when the path was chosen
            raise ModelError(f"factor '{f.name}': the shrunk evaluation failed")
        if not f.observed:
            return out[0]
        natural, a = out
        flat = jnp.concatenate([_flatten_local(x, f)[0] for x in natural])
        return flat, a

    def over_globals(level, fixed):
        if level == len(globals_):
            return terms(fixed)
        name = globals_[level]
        pts, w = rules[name]
        vals = jax.vmap(lambda v: over_globals(level + 1, {**fixed, name: v}))(pts)
        w = jnp.reshape(w, (w.shape[0],))  # globals' weights are scalars per point
        return jax.tree.map(lambda x: jnp.tensordot(w, x, axes=(0, 0)), vals)

    def over_locals(level, fixed):
        if level == len(local):
            return over_globals(0, fixed)
        name, vals, _ = local[level]
        return jax.vmap(lambda v: over_locals(level + 1, {**fixed, name: v}))(vals)

    out = over_locals(0, {})
    num = int(np.prod([k for _, _, k in local]))
    return jax.tree.map(lambda x: x.reshape((num,) + x.shape[len(local):]), out)


def _local_weights(f, rules):
    """``(|L|, C)``: each local configuration's probability per local element (product over local sites)."""
    r = None
    for n in f.local:
        _, w = rules[n]  # (K,) + site batch
        wl = _to_local(w, f, lead=1).T  # (|L|, K)
        r = wl if r is None else (r[:, :, None] * wl[:, None, :]).reshape(wl.shape[0], -1)
    return r


def _factor_weight(graph, f, refs):
    """The factor's scale times mask over its local elements ``(|L|,)``, and its observed value."""
    latent, params = graph.split(refs)
    msg = graph.run(latent, params)[f.name]
    w = jnp.ones(f.batch_shape, graph.float_dtype)
    mask = mask_of(msg["fn"])
    if mask is not None:
        w = w * jnp.broadcast_to(mask, f.batch_shape)
    if msg.get("scale") is not None:
        w = w * msg["scale"]
    return _to_local(w, f), msg


def _shrunk(graph, f, rules, refs):
    weight, msg = _factor_weight(graph, f, refs)
    r = _local_weights(f, rules)
    table = _shrunk_table(graph, f, rules, refs)
    if not f.observed:
        return jnp.sum(weight * (r @ table))
    eta, a = table  # (C, Q), (C,)
    _, _, statistics = exponential_form(unwrap(msg["fn"]))
    stats = statistics(msg["value"])
    t = jnp.concatenate([_flatten_local(x, f) for x in stats], -1)  # (|L|, Q)
    s = t @ eta.T - a  # (|L|, C)
    return jnp.sum(weight * jnp.sum(r * s, -1))


# ----------------------------------------------------------------------------------------------
# Checks
# ----------------------------------------------------------------------------------------------


def _summaries(graph, natural):
    """Per site, in one compiled call: its reference value and, for a Gaussian, its block mean and covariance
    Cholesky factor (numpy arrays), from which the checks draw their test values."""
    from numpyro_blr.families import FullGaussian

    def fn(natural):
        out = {}
        for n, s in graph.sites.items():
            ref = s.reference(natural[n])
            if s.kind == "gaussian":
                mean, precision = FullGaussian.from_natural(natural[n])
                out[n] = (ref, mean, jnp.linalg.cholesky(jnp.linalg.inv(precision)))
            else:
                out[n] = (ref,)
        return out

    return jax.tree.map(np.asarray, graph.jit(fn, key=("summaries",), data=False)(natural))


def _np_to_value(site, block):
    """:meth:`Site.to_value` in numpy (no compilation) for one value."""
    x = np.asarray(block).reshape(site.elem_shape + site.block_shape)
    return np.transpose(x, np.argsort(site.elem_axes + site.block_axes))


def _test_value(site, summary, rng):
    """A random value near ``q`` (value shape), for the checks."""
    ref = summary[0]
    if site.kind == "point":
        return np.asarray(ref)
    if site.kind == "gaussian":
        _, mean, chol = summary
        eps = rng.standard_normal(np.shape(mean)) * 0.7
        return _np_to_value(site, mean + np.einsum("...ij,...j->...i", chol, eps)).astype(site.dtype)
    if site.kind == "gamma":
        return (ref * np.exp(0.3 * rng.standard_normal(ref.shape))).astype(site.dtype)
    if site.kind == "beta":
        logit = np.log(ref) - np.log1p(-ref)
        return (1.0 / (1.0 + np.exp(-(logit + 0.5 * rng.standard_normal(ref.shape))))).astype(site.dtype)
    if site.kind == "dirichlet":
        z = np.log(ref) + 0.5 * rng.standard_normal(ref.shape)
        z = np.exp(z - z.max(-1, keepdims=True))
        return (z / z.sum(-1, keepdims=True)).astype(site.dtype)
    k = site.num_categories if site.kind == "categorical" else 2
    return rng.integers(0, k, site.value_shape).astype(site.dtype)


def _gaussian_direction(site, summary, rng):
    chol = summary[2]
    eps = rng.standard_normal(chol.shape[:-1])
    return _np_to_value(site, np.einsum("...ij,...j->...i", chol, eps))


def _element_split(site, rng):
    """A random half of a site's elements as a boolean mask over its value (broadcast inside elements)."""
    if site.kind == "gaussian":
        pick = rng.random(site.elem_shape) < 0.5
        block = np.broadcast_to(pick[..., None], site.elem_shape + (site.block_size,))
        return _np_to_value(site, block)
    if site.kind == "dirichlet":
        pick = rng.random(site.batch_shape) < 0.5
        return np.broadcast_to(pick[..., None], site.value_shape)
    return rng.random(site.value_shape) < 0.5


def _design(site, test, base):
    """Test values (list) and the regression design (one row per value) of a non-Gaussian continuous site."""
    if site.kind == "gamma":
        ratios = np.array([0.5, 0.8, 1.25, 2.0, 3.0])
        values = [(np.asarray(base) * r).astype(site.dtype) for r in ratios]
        return values, np.stack([np.ones(5), np.log(ratios), ratios], 1), "per-element ratios"
    if site.kind == "beta":
        xs = np.array([0.15, 0.3, 0.5, 0.7, 0.85])
        values = [np.full(site.value_shape, x, site.dtype) for x in xs]
        return values, np.stack([np.ones(5), np.log(xs), np.log1p(-xs)], 1), "common values"
    k = site.value_shape[-1]
    xs = test.dirichlet(np.ones(k), size=k + 3)
    values = [np.broadcast_to(x.astype(site.dtype), site.value_shape) for x in xs]
    return values, np.concatenate([np.ones((k + 3, 1)), np.log(xs)], 1), "common values"


def check(graph, natural, rtol, sites=None, seed=0):
    r"""Test every factor's exactness conditions (module docstring) at random values near ``q`` (``natural``).

    Returns a list of failures ``(kind, factor, site, error)``: ``kind`` is ``"conjugacy"`` (the factor is not
    affine in the site's statistics: the site's complete conditional is not in its family), ``"nonfinite"`` (the
    factor is not finite at values of the site near ``q``) or ``"elements"`` (elements of the site interact in
    the factor). A shrunk factor whose shrunk evaluation disagrees with its full one is switched to the full path
    rather than reported. ``sites`` limits the conjugacy tests to those sites. Every test of every factor runs in
    one compiled function, each reduced to its largest relative error there.
    """
    rng = np.random.default_rng(seed)
    failures = []
    summary = _summaries(graph, natural)
    refs = {n: jnp.asarray(v[0]) for n, v in summary.items()}
    plans = {}  # factor -> (base values, {site: stacked values of the site}, jobs)
    shrunk = {}  # factor -> [(local test values, global point indices)] x 2
    for f in graph.factors.values():
        deps = [d for d in f.deps if graph.sites[d].kind != "point"]
        if not deps:
            continue
        base = {d: _test_value(graph.sites[d], summary[d], rng) for d in deps}
        varied, jobs = {}, []

        def add(d, value):
            """One configuration: ``d`` at ``value``, the others at ``base`` (``value`` None: the base itself)."""
            if value is None:
                return ("base", 0)
            varied.setdefault(d, []).append(np.asarray(value))
            return (d, len(varied[d]) - 1)

        i0 = add(None, None)
        for d in deps:
            s = graph.sites[d]
            if s.discrete or (sites is not None and d not in sites):
                pass
            elif s.kind == "gaussian":
                for _ in range(2):
                    u = _gaussian_direction(s, summary[d], rng)
                    x = np.asarray(base[d])
                    idx = [add(d, (x + h * u).astype(s.dtype)) for h in (2.0, 1.0, -1.0)]
                    jobs.append(("third", d, idx + [i0], None))
            else:
                values, design, _ = _design(s, rng, base[d])
                jobs.append(("affine", d, [add(d, v) for v in values], design))
            if s.num_elements > 1 and not graph.is_local(d, f):
                if s.discrete:
                    failures.append(("elements", f.name, d, math.inf))
                    continue
                other = _test_value(s, summary[d], rng)
                split = _element_split(s, rng)
                x0, x1 = np.asarray(base[d]), np.asarray(other)
                both = add(d, x1.astype(s.dtype))
                a = add(d, np.where(split, x1, x0).astype(s.dtype))
                b = add(d, np.where(split, x0, x1).astype(s.dtype))
                jobs.append(("mixed", d, [both, a, b, i0], None))
        if jobs:
            plans[f.name] = (base, {d: np.stack(v) for d, v in varied.items()}, jobs)
        if f.path == "shrunk":
            shrunk[f.name] = [({n: _test_value(graph.sites[n], summary[n], rng) for n in f.local},
                               {d: int(rng.integers(0, 1 << 30)) for d in f.deps if d not in f.local}) for _ in range(2)]

    def job_error(phi, kind, idx, design):
        """``phi``: {group: factor values per configuration of the group}; ``idx``: (group, index) pairs."""
        if kind == "affine":
            idx = [phi[g][i] for g, i in idx]
            y = jnp.stack(idx)
            hat = jnp.asarray(design @ np.linalg.pinv(design), y.dtype)  # the least-squares projection
            num = jnp.max(jnp.abs(jnp.tensordot(hat, y, 1) - y), 0)
            den = 1.0 + jnp.max(jnp.abs(y), 0)
            err = num / den
            return jnp.where(jnp.all(jnp.isfinite(err)), jnp.max(err, initial=0.0), jnp.inf)
        phi = [phi[g][i] for g, i in idx]
        idx = range(4)
        if kind == "third":
            p2, p1, pm, p0 = (phi[i] for i in idx)
            num = jnp.abs(p2 - 3 * p1 + 3 * p0 - pm)
            den = 1.0 + jnp.abs(p2) + 3 * jnp.abs(p1) + 3 * jnp.abs(p0) + jnp.abs(pm)
        else:
            pb, pa_, pb_, p0 = (phi[i] for i in idx)
            num = jnp.abs(pb - pa_ - pb_ + p0)
            den = 1.0 + jnp.abs(pb) + jnp.abs(pa_) + jnp.abs(pb_) + jnp.abs(p0)
        err = num / den
        return jnp.where(jnp.all(jnp.isfinite(err)), jnp.max(err, initial=0.0), jnp.inf)

    def evaluate(values, refs, natural, locals_):
        out = {}
        for name, (_, _, jobs) in plans.items():
            base, varied = values[name]
            at = {**refs, **base}
            phi = {"base": graph.log_prob(name, at)[None]}
            for d, stacked in varied.items():
                phi[d] = jax.vmap(lambda x, d=d: graph.log_prob(name, {**at, d: x}))(stacked)
            out[name] = jnp.stack([job_error(phi, kind, idx, design) for kind, _, idx, design in jobs])
        for name, trials in shrunk.items():
            f = graph.factors[name]
            out["shrunk:" + name] = jnp.stack([_shrunk_error(graph, f, natural, refs, loc, picks)
                                               for loc, (_, picks) in zip(locals_[name], trials)])
        return out

    values = {name: (plan[0], plan[1]) for name, plan in plans.items()}
    locals_ = {name: [t[0] for t in trials] for name, trials in shrunk.items()}
    # the program depends on the jobs (design matrices included) and the global points picked, not on the values
    key = ("check", tuple((name, tuple((kind, d, tuple(idx), design) for kind, d, idx, design in jobs))
                          for name, (_, _, jobs) in plans.items()),
           tuple((name, tuple(picks for _, picks in trials)) for name, trials in shrunk.items()))
    errors = jax.tree.map(np.asarray, graph.jit(evaluate, key=key, **FAST_COMPILE)(values, refs, natural, locals_))
    for name, (_, _, jobs) in plans.items():
        for (kind, d, _, _), worst in zip(jobs, errors[name]):
            worst = float(worst)
            if not np.isfinite(worst):
                failures.append(("nonfinite", name, d, math.inf))
            elif worst > rtol:
                failures.append(("conjugacy" if kind != "mixed" else "elements", name, d, worst))
    for name in shrunk:
        if not float(np.max(errors["shrunk:" + name])) <= rtol:
            graph.factors[name].path = "full"
    return failures


def _shrunk_error(graph, f, natural, refs, local_vals, picks):
    """Largest relative difference between a shrunk factor and its full evaluation, per local element, at one
    configuration: the local sites at random values, each global site at one of its quadrature points."""
    mean = {n: graph.sites[n].expectation(natural[n]) for n in f.deps}
    rules = site_rules(graph, natural, mean, f.deps)
    glob = {d: rules[d][0][picks[d] % rules[d][0].shape[0]] for d in picks}
    full = graph.log_prob(f.name, {**refs, **glob, **local_vals})
    full = _flatten_local(full, f).sum(-1)
    # the shrunk formula with the global sites at one point (weight 1) and one-hot local probabilities
    one = {d: (glob[d][None], jnp.ones((1,), graph.float_dtype)) for d in glob}
    for n in f.local:
        s = graph.sites[n]
        k = s.num_categories if s.kind == "categorical" else 2
        onehot = jax.nn.one_hot(jnp.asarray(local_vals[n]).astype(jnp.int32), k, dtype=graph.float_dtype)
        one[n] = (None, jnp.moveaxis(onehot, -1, 0))
    weight, msg = _factor_weight(graph, f, refs)
    r = _local_weights(f, one)
    table = _shrunk_table(graph, f, one, refs)
    if f.observed:
        eta, a = table
        _, _, statistics = exponential_form(unwrap(msg["fn"]))
        t = jnp.concatenate([_flatten_local(x, f) for x in statistics(msg["value"])], -1)
        per = weight * jnp.sum(r * (t @ eta.T - a), -1)
    else:
        per = weight * (r @ table)
    err = jnp.abs(per - full) / (1.0 + jnp.abs(full))
    return jnp.where(jnp.all(jnp.isfinite(err)), jnp.max(err, initial=0.0), jnp.inf)


# ----------------------------------------------------------------------------------------------
# Non-conjugate Gaussian sites: expectations along the factor's linear predictor
# ----------------------------------------------------------------------------------------------
#: Gauss-Hermite nodes per factor element for projected expectations
GAUSS_HERMITE = 32

_LINKS = {
    "identity": (lambda t: t, lambda a: a),
    "log": (jnp.log, jnp.exp),
    "logit": (lambda t: jnp.log(t) - jnp.log1p(-t), jax.nn.sigmoid),
}


def _leaves(graph, f, values):
    msg = graph.site_msg(f.name, values)
    leaves, tree = jax.tree_util.tree_flatten(msg["fn"])
    return leaves, tree, msg


def find_projection(graph, f, gauss, natural, rtol, seed=0):
    r"""Whether factor ``f`` reads its non-conjugate Gaussian sites ``gauss`` only through one parameter of its
    distribution that is affine in them after a link (identity, log or logit): a generalised linear model's
    linear predictor, a Student-t location. Then under :math:`q` that parameter is Gaussian per element, and
    :math:`\mathbb E_q[\phi]` is a one-dimensional integral per element (:func:`projected_factor`). The
    distribution must be elementwise (univariate, so that its log density is a sum of per-entry terms).
    Returns ``(leaf index, link name)`` or None."""
    rng = np.random.default_rng(seed)
    summary = _summaries(graph, natural)
    refs = {n: jnp.asarray(v[0]) for n, v in summary.items()}
    draws = [{s: jnp.asarray(_test_value(graph.sites[s], summary[s], rng)) for s in gauss} for _ in range(2)]
    mid = {s: 0.5 * (draws[0][s] + draws[1][s]) for s in gauss}

    def leaves_at(refs, values):
        leaves, _, msg = _leaves(graph, f, {**refs, **values})
        return leaves

    try:
        base = unwrap(graph.site_msg(f.name, refs)["fn"])
        if base.event_shape != ():
            return None
        jitted = graph.jit(leaves_at, key=("projection", f.name))
        l0, l1, lm = (jitted(refs, v) for v in (draws[0], draws[1], mid))
    except Exception:  # noqa: BLE001 - a factor that cannot be read this way takes the cubature rule
        return None
    changed = [i for i, (a, b) in enumerate(zip(l0, l1))
               if jnp.issubdtype(jnp.result_type(a), jnp.floating) and not np.allclose(np.asarray(a), np.asarray(b), rtol=0, atol=0)]
    if len(changed) != 1:
        return None
    i = changed[0]
    full = tuple(base.batch_shape)
    if np.ndim(l0[i]) > len(full) or not _broadcastable(np.shape(l0[i]), full):
        return None
    for name, (forward, _) in _LINKS.items():
        with np.errstate(all="ignore"):
            t0, t1, tm = (np.asarray(forward(jnp.asarray(x[i])), np.float64) for x in (l0, l1, lm))
        if not (np.all(np.isfinite(t0)) and np.all(np.isfinite(t1))):
            continue
        err = np.abs(t0 + t1 - 2 * tm) / (1.0 + np.abs(t0) + np.abs(t1))
        if float(np.max(err)) <= rtol:
            return i, name
    return None


def _broadcastable(shape, target):
    try:
        np.broadcast_shapes(shape, target)
        return len(shape) <= len(target)
    except ValueError:
        return False


def projected_factor(graph, f, spec, gauss, rules, refs):
    r""":math:`\mathbb E_q[\phi_f]` when the factor's parameter ``spec = (leaf, link)`` is affine (after the link) in the
    non-conjugate Gaussian sites ``gauss`` (site -> ``(mean, scale_tril)`` in the element layout): per element
    :math:`a_n = a_n(m) + \sum_k V_{nk}\epsilon_k`, with :math:`V_{\cdot k}` the derivative of :math:`a` along the
    :math:`k`-th column of every element's Cholesky factor at once (so no element needs to know which element of a
    site it reads), integrated by Gauss-Hermite; the other sites by their quadrature rules. Differentiable in the
    means and Cholesky factors (the estimators' :math:`\nabla_m`, :math:`\nabla_\Sigma`)."""
    leaf, link = spec
    forward, inverse = _LINKS[link]
    nodes, weights = np.polynomial.hermite_e.hermegauss(GAUSS_HERMITE)
    dtype = graph.float_dtype
    nodes, weights = jnp.asarray(nodes, dtype), jnp.asarray(weights / np.sqrt(2 * np.pi), dtype)
    others = [d for d in f.deps if d not in gauss]
    sites = list(gauss)

    def at(values):
        def predictor(blocks):
            vals = {s: graph.sites[s].to_value(b[None])[0] for s, b in zip(sites, blocks)}
            leaves, _, _ = _leaves(graph, f, {**refs, **values, **vals})
            return forward(leaves[leaf])

        means = tuple(gauss[s][0] for s in sites)
        a0 = predictor(means)
        var = jnp.zeros_like(a0)
        for j, s in enumerate(sites):
            chol = gauss[s][1]
            b = chol.shape[-1]

            def along(k, j=j, chol=chol):
                tangent = tuple(jnp.zeros_like(m) if jj != j else chol[..., :, k] for jj, m in enumerate(means))
                return jax.jvp(predictor, (means,), (tangent,))[1]

            v = jax.vmap(along)(jnp.arange(b))
            var = var + jnp.sum(v * v, 0)
        positive = var > 0
        sd = jnp.where(positive, jnp.sqrt(jnp.where(positive, var, 1.0)), 0.0)
        mvals = {s: graph.sites[s].to_value(gauss[s][0][None])[0] for s in sites}
        leaves, tree, msg = _leaves(graph, f, {**refs, **values, **mvals})

        def log_prob(x):
            new = list(leaves)
            new[leaf] = inverse(a0 + sd * x)
            fn = jax.tree_util.tree_unflatten(tree, new)
            lp = fn.log_prob(msg["value"])
            if msg.get("scale") is not None:
                lp = lp * msg["scale"]
            return jnp.broadcast_to(lp, f.batch_shape)

        return jnp.tensordot(weights, jax.vmap(log_prob)(nodes), 1)

    def over(level, fixed):
        if level == len(others):
            return at(fixed)
        name = others[level]
        pts, w = rules[name]
        vals = jax.vmap(lambda v: over(level + 1, {**fixed, name: v}))(pts)
        return jnp.sum(jax.vmap(lambda wj: _weight_for(wj, f.batch_shape))(w) * vals, 0)

    return jnp.sum(over(0, {}))
