r"""How the BLR gets :math:`\hat g \approx \mathbb{E}_q[\nabla\ell]` and :math:`\hat H \approx \mathbb{E}_q[\nabla^2\ell]`.

NumPyro's SVI hands the optimizer a loss function ``fn(params) -> (loss, aux)`` whose random key
is fixed for the step. For a reparameterised guide :math:`z = m + L\epsilon` the ELBO loss is
:math:`\ell(z) + \log q(z) = \ell(m + L\epsilon) - \sum_i \log L_{ii} + \text{const}`, so its
gradients carry all the BLR needs (Khan & Rue 2023, Sec. 4.2; Lin et al. 2019, Bonnet/Price):

* ``hessian="reparam"`` (Price/Stein): :math:`\partial/\partial m = \nabla\ell(z) = \hat g` and
  :math:`\partial/\partial L = \operatorname{tril}(\nabla\ell(z)\,\epsilon^\top) - \operatorname{diag}(1/L_{ii})`.
  Since :math:`\mathbb{E}[\nabla\ell(z)\epsilon^\top] = \mathbb{E}[\nabla^2\ell]\,L`, the symmetric
  :math:`\hat H` with :math:`\operatorname{tril}(\hat H L) = \operatorname{tril}(\nabla\ell\,\epsilon^\top)` is an unbiased
  one-sample estimate. It is unique: writing :math:`\hat H L = A + B` with :math:`A` known (lower)
  and :math:`B` strictly upper, symmetry of :math:`\hat H` gives :math:`B = L^{-\top}\operatorname{triu}_1(A^\top L - L^\top A)`.
  Diagonal guides reduce to :math:`\hat h = \epsilon\,\nabla\ell(z)/s`. Parameters live in
  unconstrained space (softplus scales, scaled-unit-lower Cholesky), so gradients are mapped
  back to :math:`(m, s)` or :math:`(m, L)` exactly by the vector-Jacobian product of the inverse
  bijection.
* ``hessian="autodiff"``: :math:`\partial^2/\partial m^2` of the same loss is exactly
  :math:`\nabla^2\ell(z)` (the entropy term does not depend on :math:`m`); one Hessian by
  forward-over-reverse autodiff. For small models.
* ``hessian="none"``: no curvature; the covariance stays where it is (gradient descent).
* ``delta=True`` (delta method): :math:`\mathbb{E}_q[\ell] \approx \ell(m)`. The loss is evaluated
  with the guide's scale set to :math:`\varepsilon^2` of the dtype, which places the sample at the
  mean to rounding error; gradient and Hessian are then those of :math:`\ell` at :math:`m`.
  The reported loss is still the ELBO loss at the guide's actual parameters.

``Trace_ELBO(num_particles=K)`` averages the gradients of K samples, and every estimate above is
linear in those gradients, so several Monte Carlo samples need nothing more, except the exact
Hessian's control variate: it needs the sample's offset :math:`z - m`, solved from the Hessian and
its product with the offset, which over K particles are averages whose solution weighs each
particle's offset by its curvature (on a Poisson model, a mean 0.19 sd off the optimum with K = 4).
:func:`estimate` leaves it out where the loss averages particles (:func:`loss_particles`).
"""

import contextlib
import functools
from typing import NamedTuple, Optional

import jax
import numpy as np
import jax.numpy as jnp
from jax.flatten_util import ravel_pytree

try:
    from jax.extend.core import Literal
except ImportError:  # pragma: no cover - older jax
    from jax.core import Literal
try:
    from jax._src import source_info_util as _source_info
except ImportError:  # pragma: no cover - only the HLO metadata loses its source lines
    _source_info = None

from numpyro_blr.layout import DIAGONAL, FULL, POINT
from numpyro_blr.rules.blr import inverse_scale_tril

HESSIANS = ("reparam", "price", "hutchinson", "autodiff", "none")
BASELINE_SHRINK = 0.01


class BlockStats(NamedTuple):
    """Estimates for one Gaussian block: mean gradient ``g`` and curvature ``h`` (or None)."""

    g: jax.Array
    h: Optional[jax.Array]
    offset: Optional[jax.Array] = None  # z - m of the sample, when known (autodiff): a control variate
    whitened: Optional[jax.Array] = None  # L^T H L of a full block, when the estimator gives it directly
    control: Optional[jax.Array] = None  # a zero-mean control variate for g, when the estimator gives it (sample_control)


def _value_and_grad(fn, params, forward_mode):
    if forward_mode:

        def wrapper(p):
            out, aux = fn(p)
            return out, (out, aux)

        grads, (out, aux) = jax.jacfwd(wrapper, has_aux=True)(params)
        return (out, aux), grads
    return jax.value_and_grad(fn, has_aux=True)(params)


def _bind_equation(eqn, env):
    """Evaluate one jaxpr equation on the values in ``env`` (as ``jax.core.eval_jaxpr`` does), in the
    current trace, keeping the equation's source location for the HLO metadata and error messages."""
    params = eqn.primitive.get_bind_params(eqn.params)
    subfuns, params = params if isinstance(params, tuple) else ((), params)  # jax < 0.5: (subfuns, params)
    args = [v.val if isinstance(v, Literal) else env[v] for v in eqn.invars]
    ctx = getattr(getattr(eqn, "ctx", None), "manager", None) or contextlib.nullcontext()
    where = contextlib.nullcontext()
    if _source_info is not None:
        where = _source_info.user_context(eqn.source_info.traceback, name_stack=_source_info.current_name_stack() + eqn.source_info.name_stack)
    with where, ctx:
        out = eqn.primitive.bind(*subfuns, *args, **params)
    for v, x in zip(eqn.outvars, out if eqn.primitive.multiple_results else (out,)):
        env[v] = x


def hoist_constant_work(fn, params):
    r"""``fn`` with the work that does not depend on ``params`` done once, now, in the calling trace.

    A BLR step evaluates the loss several times at the same random key: under ``jacfwd`` for the
    exact Hessian, at the shortened means of backtracking, at the mean for the delta method. Each
    evaluation traces the whole loss again, including what does not depend on the parameters at all:
    NumPyro's draws of :math:`\varepsilon` (the threefry hash and the inverse error function, a few
    hundred HLO operations per site), the model's data-only arithmetic, constants. XLA merges none of
    it across the copies (the copies inside ``lax.while_loop`` or batched by ``vmap`` differ), so a
    small model's step compiled mostly random-number code: on ``ucbadmit_glmm`` with ``AutoNormal``,
    39,000 of the step's optimised HLO operations, 20,000 after this (measured with
    ``bench/bench_compile.py``'s cases; the compile time follows the operation count). The values
    the kept equations read are passed through ``lax.optimization_barrier``: materialised once, XLA
    cannot fuse (copy) the random-number code into each consumer's kernel (16,000 operations).

    ``fn`` is traced once into a jaxpr; every equation none of whose inputs depends on ``params`` (and
    that has no effect) is evaluated here, the others are kept, and the returned function evaluates
    only those, on its argument, with the values computed here. It is ``fn`` on every argument of the
    same structure, shapes and dtypes (same operations on the same values: the results are equal);
    anything else, and anything this cannot trace, is passed to ``fn`` itself. NumPyro effect handlers
    around a call of the returned function see nothing (it runs no NumPyro code): a caller that
    changes the loss by a handler (``expfam_blocks``' enumeration) must call ``fn``.
    """
    try:
        closed, out_shape = jax.make_jaxpr(fn, return_shape=True)(params)
        jaxpr = closed.jaxpr
        leaves, treedef = jax.tree_util.tree_flatten(params)
        avals = [(tuple(v.aval.shape), v.aval.dtype) for v in jaxpr.invars]
        known = dict(zip(jaxpr.constvars, closed.consts))
        varying = set(jaxpr.invars)
        staged, computed = [], []
        for eqn in jaxpr.eqns:
            if eqn.effects or any(not isinstance(v, Literal) and v in varying for v in eqn.invars):
                staged.append(eqn)
                varying.update(eqn.outvars)
            else:
                _bind_equation(eqn, known)
                computed.extend(eqn.outvars)
    except Exception:  # noqa: BLE001 - a loss this cannot split is evaluated as it is
        return fn
    out_tree = jax.tree_util.tree_structure(out_shape)
    # what the kept equations read of the computed values, materialised once: without the barrier
    # XLA fuses (copies) the random-number code into each of its consumers' kernels
    read = {v for eqn in staged for v in eqn.invars if not isinstance(v, Literal)}
    read.update(v for v in jaxpr.outvars if not isinstance(v, Literal))
    residuals = [v for v in computed if v in read]  # in the order of the equations: a deterministic program
    try:
        known.update(zip(residuals, jax.lax.optimization_barrier([known[v] for v in residuals])))
    except Exception:  # noqa: BLE001 - a value the barrier does not take (a typed key): left as it is
        pass

    def hoisted(p):
        p_leaves, p_tree = jax.tree_util.tree_flatten(p)
        if p_tree != treedef or [(tuple(jnp.shape(x)), jnp.result_type(x)) for x in p_leaves] != avals:
            return fn(p)
        env = dict(known)
        env.update(zip(jaxpr.invars, p_leaves))
        try:
            for eqn in staged:
                _bind_equation(eqn, env)
        except Exception:  # noqa: BLE001 - an equation this cannot replay (a jax version's quirk): the loss itself
            return fn(p)
        return jax.tree_util.tree_unflatten(out_tree, [v.val if isinstance(v, Literal) else env[v] for v in jaxpr.outvars])

    return hoisted


def _tiny(dtype):
    return jnp.finfo(dtype).eps ** 2


ZERO_MEAN_NUDGE = 64  # at_mean: means within this many eps of 0 are evaluated at that distance from it


def at_mean(params, layout):
    r"""``params`` with every Gaussian block's scale shrunk to ``eps**2`` so that samples sit at the mean.

    A draw :math:`z = m + s\epsilon` equals :math:`m` in floating point where :math:`s|\epsilon|` is below half
    an ulp of :math:`m`; then the guide's :math:`\log q(z)`, a function of :math:`(z - m)/s`, contributes nothing
    to the gradient. Where :math:`m = 0` (a guide initialised with ``jnp.zeros``) the draw is :math:`s\epsilon`
    itself, the two terms of :math:`\partial\log q/\partial m` (through :math:`z` and through :math:`m`, each
    :math:`\epsilon/s \approx 10^{31}`) cancel only after the model's gradient was added to one of them, and
    the model's gradient is lost: the mean never moved (``nb.newton()`` with a hand-written guide stayed at its
    zero initialisation). Such means (:math:`|m| <` ``ZERO_MEAN_NUDGE`` eps) are evaluated at that distance
    from 0 instead, where the draw rounds to the mean again: a shift far below any posterior sd the dtype
    resolves, and only where a mean is 0 (the next step moves it away)."""
    out = dict(params)
    for b in layout.blocks:
        if b.kind in (DIAGONAL, FULL):
            m = params[b.loc]
            floor = ZERO_MEAN_NUDGE * jnp.finfo(m.dtype).eps
            out[b.loc] = jnp.where(jnp.abs(m) < floor, jnp.where(m < 0, -floor, floor).astype(m.dtype), m)
        if b.kind == DIAGONAL:
            s = jnp.full(params[b.loc].shape, _tiny(params[b.loc].dtype), params[b.loc].dtype)
            out[b.scale] = b.transform.inv(s)
        elif b.kind == FULL:
            d = params[b.loc].shape[-1]
            out[b.scale] = b.transform.inv(_tiny(params[b.loc].dtype) * jnp.eye(d, dtype=params[b.loc].dtype))
    return out


def _scale_grad(block, scale, grad_raw, transpose=False):
    r"""The reparameterisation term :math:`\nabla\ell(z)\,\epsilon^\top` (lower part; elementwise when diagonal).

    ``grad_raw`` is the ELBO gradient w.r.t. the raw scale parameter; the vector-Jacobian product
    of the inverse bijection maps it to :math:`\partial\mathcal{L}/\partial s` (or :math:`/\partial L`),
    and adding back the entropy's :math:`1/s` (or :math:`\operatorname{diag}(1/L_{ii})`) leaves the
    term that carries the curvature. ``transpose=True`` (full blocks) returns its transpose.
    """
    transform = block.transform
    if block.kind == DIAGONAL:
        _, vjp = jax.vjp(transform.inv, scale)
        return vjp(grad_raw)[0] + 1.0 / scale
    if hasattr(transform, "cotangent_to_tril"):  # the same product, without XLA's scatter (see layout.py)
        g = transform.cotangent_to_tril(scale, grad_raw, transpose=transpose)
    else:
        _, vjp = jax.vjp(transform.inv, scale)
        g = jnp.tril(vjp(grad_raw)[0])
        g = g.T if transpose else g
    return g + jnp.diag(1.0 / jnp.diagonal(scale))


def sample_offset(block, params, grads):
    r"""The sample's offset :math:`z - m = s\varepsilon` of a diagonal block, read off its two gradients.

    The loss's gradients are :math:`\partial/\partial m = \nabla\ell(z)` and, without the entropy's
    :math:`-1/s`, :math:`\partial/\partial s = \varepsilon\,\nabla\ell(z)` (elementwise), so
    :math:`\varepsilon = a / \nabla\ell(z)`. Where :math:`|s\,\nabla\ell(z)|` is below
    :math:`\sqrt{\text{eps}}` of the dtype the quotient is rounding error, and the offset is taken as 0 there."""
    scale = block.transform(params[block.scale])
    g = grads[block.loc]
    a = _scale_grad(block, scale, grads[block.scale])
    tol = jnp.sqrt(jnp.finfo(jnp.result_type(g)).eps)
    ok = jnp.abs(scale * g) > tol
    return jnp.where(ok, scale * a / jnp.where(ok, g, 1.0), 0.0)


MAX_PROBES = 16


def probe_directions(blocks, scales, signs, max_probes=MAX_PROBES):
    r"""The directions of :func:`hutchinson_diagonal`'s probes: one per site (up to ``max_probes``; beyond, site
    :math:`k` shares probe :math:`k \bmod` ``max_probes``), each site's whitened signs :math:`s\odot v` in its own
    direction and zeros in the others. A block is one site unless it packs several (``GaussianBlock.segments``:
    ``AutoDiagonalNormal``'s one vector). Returns ``({loc: (P, ...)}, {loc: its probe's index, or for a block of
    several sites an int array of each coordinate's probe})``.

    A probe of its own leaves a site's estimate free of its coupling to the other sites: the few global
    scalars of a hierarchical model (a population mean, a scale) are coupled to every group's coordinate, and
    one probe over all blocks gave the population mean of a 300-group Gaussian model a curvature with a
    relative noise of 0.9 (sd 0.94x its mean-field optimum after 500 steps); with its own probe, a scalar
    site's curvature is the exact :math:`\nabla^2_{ii}\ell(z)`."""
    units = []  # (loc, first, last + 1) of each site, in the raveled loc
    for b in blocks:
        size = int(np.size(signs[b.loc]))
        sizes = b.segments if len(b.segments) > 1 and sum(b.segments) == size else (size,)
        start = 0
        for n in sizes:
            units.append((b.loc, start, start + n))
            start += n
    count = min(len(units), max_probes)
    row = {}
    for k, (loc, lo, hi) in enumerate(units):
        if lo == 0 and hi == int(np.size(signs[loc])):
            row[loc] = k % count
        else:
            row.setdefault(loc, np.zeros(int(np.size(signs[loc])), np.int32))[lo:hi] = k % count
    tangents = {}
    for b in blocks:
        t = scales[b.loc] * signs[b.loc]
        r = row[b.loc]
        if isinstance(r, int):
            tangents[b.loc] = jnp.stack([t if r == j else jnp.zeros_like(t) for j in range(count)])
        else:
            r = r.reshape(np.shape(t))
            tangents[b.loc] = jnp.stack([jnp.where(r == j, t, jnp.zeros_like(t)) for j in range(count)])
    return tangents, row


def probe_product(products, row):
    """Each coordinate's entry of its own probe's product (``products``: ``(P, ...)``; ``row``: from
    :func:`probe_directions`)."""
    if isinstance(row, int):
        return products[row]
    idx = jnp.asarray(row.reshape((1,) + products.shape[1:]))
    return jnp.take_along_axis(products, idx, axis=0)[0]


def hutchinson_diagonal(scale, signs, product):
    r"""Hutchinson's estimate of :math:`\operatorname{diag}\nabla^2\ell(z)` from one whitened Rademacher probe.

    With :math:`v_i = \pm 1` independent and equally likely and ``product`` :math:`= \nabla^2\ell(z)\,(s\odot v)`,
    :math:`\hat h_i = v_i\,[\nabla^2\ell(z)(s\odot v)]_i / s_i = H_{ii} + \sum_{j\ne i} H_{ij}\,v_iv_j\,s_j/s_i`,
    whose mean over :math:`v` is :math:`H_{ii}` (Hutchinson 1990; Bekas, Kokiopoulou & Saad 2007; AdaHessian and
    Sophia use the unwhitened probe). Its noise is the whitened coupling of coordinate :math:`i` to the others
    only: unlike Price's :math:`\varepsilon_i\,\nabla_i\ell(z)/s_i`, whose diagonal term is
    :math:`H_{ii}\varepsilon_i^2` (a relative noise of :math:`\sqrt2` on every coordinate, however weakly coupled),
    :math:`v_i^2 = 1` leaves the diagonal term exact: a coordinate coupled to none other gets the exact
    :math:`\nabla^2_{ii}\ell(z)`. Whitening by :math:`s` makes the noise scale-free (:math:`s_j/s_i` as in
    Price's estimate). Averaged over :math:`z\sim q` it is :math:`\mathbb E_q[\nabla^2\ell]_{ii}`."""
    return signs * product / scale


def reparam_hessian_diagonal(scale, a):
    r"""Price/Stein estimate :math:`\hat h = a / s` from :math:`a = \epsilon\,\nabla\ell(m + s\epsilon)`."""
    return a / scale


def reparam_whitened_hessian(scale_tril, a):
    r"""The whitened Price/Stein Hessian :math:`M = L^\top \hat H L` for the symmetric :math:`\hat H` with
    :math:`\operatorname{tril}(\hat H L) = a`, with no solve at all.

    From :math:`\hat H L = a + L^{-\top}\operatorname{triu}_1(Y - Y^\top)`, :math:`Y = a^\top L`
    (module docstring, :math:`L^\top a = Y^\top`):
    :math:`M = Y^\top + \operatorname{triu}_1(Y - Y^\top) = \operatorname{tril}(Y^\top) + \operatorname{triu}_1(Y)`,
    symmetric by construction. Its expectation is :math:`L^\top\mathbb E_q[\nabla^2\ell]L`."""
    return _whitened_hessian_from_transpose(scale_tril, jnp.tril(a).T)


def _whitened_hessian_from_transpose(scale_tril, a_t):
    """:func:`reparam_whitened_hessian` from :math:`a^\top` (upper triangular): ``a_t @ L`` is a plain
    matrix product, which XLA runs about twice as fast as one with a transposed operand."""
    y = a_t @ scale_tril
    return jnp.tril(y.T) + jnp.triu(y, k=1)


def reparam_hessian_full(scale_tril, a):
    r"""Symmetric :math:`\hat H` with :math:`\operatorname{tril}(\hat H L) = a`, :math:`a = \operatorname{tril}(\nabla\ell(z)\,\epsilon^\top)`:
    :math:`\hat H = L^{-\top} M L^{-1}` with :math:`M` from :func:`reparam_whitened_hessian`."""
    l_inv = inverse_scale_tril(scale_tril)
    h = l_inv.T @ reparam_whitened_hessian(scale_tril, a) @ l_inv
    return 0.5 * (h + h.T)


def sample_control(fn, params, layout, offsets, forward_mode=False):
    r"""The control variate :math:`c = \nabla^2\ell(m)\,(z - m)` for the mean gradient of the blocks of ``offsets``
    (``{loc: z - m}``, :func:`sample_offset`): one Hessian-vector product at the guide's mean.

    :math:`\nabla\ell(z) = \nabla\ell(m) + \nabla^2\ell(m)(z - m) + O(\lVert z - m\rVert^2)`, so
    :math:`\hat g - c` keeps the mean of :math:`\hat g` (:math:`\nabla^2\ell(m)` does not depend on the draw,
    and :math:`\mathbb E[z - m] = 0`) and loses its first-order noise, across blocks too: with a mean-field guide,
    the noise that every group's draw puts into the gradient of a population mean, which the precision-scaled
    offset of the block itself, :math:`S(z - m)`, cannot cancel (a 300-group Gaussian model: with :math:`S(z - m)`
    the population mean was 0.08-0.37 mean-field sd off its optimum between 100 and 1,000 steps; with this, 0.03 at
    step 100 and 0 to rounding from step 300). Returns ``{loc: c}``."""
    at = at_mean(params, layout)

    def grads(locs):
        return {n: g for n, g in _value_and_grad(fn, {**at, **locs}, forward_mode)[1].items() if n in offsets}

    _, products = jax.jvp(grads, ({n: at[n] for n in offsets},), (offsets,))
    return {n: finite_or_zero(c) for n, c in products.items()}


def finite_or_zero(x):
    """A control variate is optional: drop it (not the step) if it could not be computed."""
    return jnp.where(jnp.all(jnp.isfinite(x)), x, jnp.zeros_like(x))


def loss_gradients_and_products(fn, params, tangents, forward_mode):
    """``((loss, aux), grads, hv)``: the loss, its gradients, and the products of their Jacobian w.r.t. the locs of
    ``tangents`` (``{loc: (P, ...)}``, P probe directions) with each direction, ``hv`` ``{loc: (P, ...)}``: one
    forward-over-reverse pass, batched over the directions (the loss and its gradients do not depend on them, so
    they are computed once)."""
    primal = {n: params[n] for n in tangents}

    def loss_and_grads(locs):
        return _value_and_grad(fn, {**params, **locs}, forward_mode)

    def along(t):
        out, (_, dgrads) = jax.jvp(loss_and_grads, (primal,), (t,))
        return out, {n: dgrads[n] for n in tangents}

    # the primal outputs come back stacked (vmap broadcasts what does not depend on the direction; out_axes=None
    # would refuse a model whose primal JAX batches anyway): the first copy is the loss and its gradients
    (out, grads), hv = jax.vmap(along)(tangents)
    return jax.tree.map(lambda x: x[0], out), jax.tree.map(lambda x: x[0], grads), hv


def _grad_and_loc_hessian(fn, params, names, forward_mode, scaled_blocks=()):
    r"""Loss, gradients and the exact Hessian w.r.t. the concatenated (raveled) ``params[names]``.

    One forward-mode Jacobian of the reverse-mode gradient gives all three. With
    ``scaled_blocks``, one more variable :math:`c` multiplies those blocks' scales
    (:math:`z = m + cL\epsilon`); the gradient's derivative along it at :math:`c = 1` is
    :math:`\nabla^2\ell(z)\,L\epsilon`, from which the sample's offset :math:`L\epsilon` is solved.
    That derivative is a JVP along the raw scale parameters, in the direction
    :math:`\partial x/\partial c` of :math:`x(c) = T^{-1}(cL)` (:math:`T` the guide's scale transform;
    :meth:`~numpyro_blr.layout.GaussianBlock.scaling_tangent`), computed outside it: differentiating
    :math:`T^{-1}(c\,T(x))` inside the JVP compiled the inverse transform's tangent with the loss
    (breast cancer, 100-step scan, XLA's CPU object code: ``AutoMultivariateNormal`` 373 -> 355 KB,
    ``AutoNormal`` 341 -> 318 KB; ``bench/compile_profile.py``).
    It is a separate one-tangent JVP, not one more column of the Jacobian, so that the loc
    directions carry no tangent through the guide's scale transform and log-density. Measured
    both ways (the column as the raw scale's tangent in one batched JVP of D+1 directions): one
    column more saves a trace of the loss and its gradient (ucbadmit_glmm ``AutoNormal``: 15%
    less compile CPU time; kidiq ``AutoMultivariateNormal``: none), but it costs run time: the
    loc directions are then no longer ``jacfwd``'s constant unit basis, which XLA folds into the
    model's products (``X @ I``), so each step multiplies the data by a D+1 column tangent
    (breast cancer 148 -> 224 us per step with ``AutoNormal``, 238 -> 307 with
    ``AutoMultivariateNormal``; kidiq 18 -> 33 us).
    Returns ``((loss, aux), grads, H, column)`` (``column`` None without ``scaled_blocks``).
    """
    flat, unravel = ravel_pytree({n: params[n] for n in names})

    def grad_of_locs(v, raw_scales=None):
        p = {**params, **unravel(v), **(raw_scales or {})}
        out, grads = _value_and_grad(fn, p, forward_mode)
        return ravel_pytree({k: grads[k] for k in names})[0], (out, grads)

    jac, (out, grads) = jax.jacfwd(grad_of_locs, has_aux=True)(flat)
    if not scaled_blocks:
        return out, grads, jac, None
    # the c-direction: a separate one-tangent JVP along the raw scales, d x / dc of x(c) = T^-1(c L)
    raw = {b.scale: params[b.scale] for b in scaled_blocks}
    direction = {b.scale: b.scaling_tangent(params[b.scale]) for b in scaled_blocks}
    _, column = jax.jvp(lambda r: grad_of_locs(flat, r)[0], (raw,), (direction,))
    return out, grads, jac, column


def shifted_draw_params(params, layout, shifts, shrink=BASELINE_SHRINK):
    r"""``params`` at which the loss, at its own fixed :math:`\varepsilon`, evaluates the model at another draw of
    :math:`q`: each Gaussian block's mean moved by ``shifts[loc]`` :math:`= \sqrt{1 - c^2}\,L\varepsilon'` and its
    scale shrunk to :math:`cL` (:math:`c` = ``shrink``), so that the loss's sample is
    :math:`z' = m + \sqrt{1-c^2}\,L\varepsilon' + cL\varepsilon = m + L\eta`, :math:`\eta = \sqrt{1-c^2}\,\varepsilon'
    + c\,\varepsilon \sim \mathcal N(0, I)`: an exact draw of :math:`q` for :math:`\varepsilon'` drawn independently
    of :math:`\varepsilon` (their correlation is :math:`c`), with :math:`z' - m = L\eta`. The shrunk scale is that of
    ``hessian="reparam"``'s baseline; the loss's :math:`\log q` term then reads the shrunk density, which does
    not depend on the means (gradients and Hessians w.r.t. the means are those of :math:`\ell` at :math:`z'`)."""
    out = dict(params)
    for b in layout.blocks:
        if b.kind in (DIAGONAL, FULL):
            out[b.scale] = b.transform.inv(shrink * b.transform(params[b.scale]))
            out[b.loc] = params[b.loc] + shifts[b.loc]
    return out


def extra_draws(fn, params, layout, key, num, forward_mode=False, shrink=BASELINE_SHRINK):
    r"""``num`` more draws of the Gaussian blocks' exact loss statistics, for a curvature averaged over draws.

    Draw :math:`k` evaluates the loss at :func:`shifted_draw_params` with :math:`\varepsilon'_k` from ``key``
    (independent of the loss's own :math:`\varepsilon`), so its sample is an exact draw
    :math:`z_k = m + L\eta_k` of :math:`q`: the gradient w.r.t. the means is :math:`\nabla\ell(z_k)` and their
    Hessian :math:`\nabla^2\ell(z_k)` (the guide's :math:`\log q` does not depend on its means). Returns
    ``(losses, grads, hess, offsets)``: ``losses`` the loss at each draw (``(num,)``; its :math:`\log q` is that of
    the shrunk scale, a constant in the means), ``grads`` ``{loc: (num, ...)}``, ``hess`` ``(num, n, n)`` over the
    locs of the Gaussian blocks raveled in sorted order (as :func:`estimate`'s), ``offsets``
    ``{loc: (num, ...)}`` the known :math:`z_k - m` (for the control variate :math:`S(z_k - m)`)."""
    gauss = [b for b in layout.blocks if b.kind in (DIAGONAL, FULL)]
    names = [b.loc for b in gauss]
    scales = {b.loc: b.transform(params[b.scale]) for b in gauss}
    root = jnp.sqrt(1.0 - shrink**2)

    sizes = [int(np.prod(jnp.shape(params[n]))) for n in names]
    dtype = jnp.result_type(*[params[n] for n in names])

    def one(k):
        offsets, flat, start = {}, jax.random.normal(k, (sum(sizes),), dtype), 0  # one draw for all blocks
        for b, size in zip(gauss, sizes):
            m = params[b.loc]
            e = flat[start : start + size].reshape(jnp.shape(m)).astype(jnp.result_type(m))
            start += size
            offsets[b.loc] = scales[b.loc] * e if b.kind == DIAGONAL else scales[b.loc] @ e
        shifted = shifted_draw_params(params, layout, {n: (root * d).astype(d.dtype) for n, d in offsets.items()}, shrink)
        (loss, _), grads, hess, _ = _grad_and_loc_hessian(fn, shifted, names, forward_mode)
        # z_k - m = L(sqrt(1-c^2) eps'_k + c eps): its c eps part is this step's own offset, shrunk (estimate's)
        return loss, {n: grads[n] for n in names}, hess, {n: (root * d).astype(d.dtype) for n, d in offsets.items()}

    return jax.vmap(one)(jax.random.split(key, num))


def _loss_elbo(fn):
    """The NumPyro ELBO that the loss ``fn`` closes over (``numpyro.infer.svi._make_loss_fn``: an object with a
    ``num_particles`` and a ``loss``), looked up in its closure cells and ``functools.partial`` arguments; None where
    none is found (a loss written by hand)."""
    seen, todo = set(), [fn]
    while todo:
        f = todo.pop()
        if id(f) in seen or len(seen) > 64:
            continue
        seen.add(id(f))
        n = getattr(f, "num_particles", None)
        if isinstance(n, (int, np.integer)) and not isinstance(n, bool) and callable(getattr(f, "loss", None)):
            return f
        if isinstance(f, functools.partial):
            todo += [f.func, *f.args]
        for cell in getattr(f, "__closure__", None) or ():
            try:
                todo.append(cell.cell_contents)
            except ValueError:  # an empty cell
                pass
        todo.append(getattr(f, "__wrapped__", None))
    return None


def loss_particles(fn):
    """How many particles the loss ``fn`` averages: the ``num_particles`` of the ELBO that NumPyro's
    ``SVI.update`` closes ``fn`` over (:func:`_loss_elbo`); 1 where none is found (a loss written by hand is taken
    as one sample)."""
    elbo = _loss_elbo(fn)
    return 1 if elbo is None else int(elbo.num_particles)


def reads_sample_offsets(fn):
    r"""Whether :func:`sample_offset` can read the sample's offset off the gradients of the loss ``fn``: one particle,
    and every Gaussian site's :math:`\log q` evaluated at its sample (``TraceMeanField_ELBO`` takes the KL of
    sites whose prior has one in closed form, so their gradients are not :math:`\nabla\ell(z)` and
    :math:`\varepsilon\nabla\ell(z)`)."""
    from numpyro.infer import TraceMeanField_ELBO

    return loss_particles(fn) == 1 and not isinstance(_loss_elbo(fn), TraceMeanField_ELBO)


def estimate(fn, params, layout, hessian="reparam", delta=False, forward_mode=False, point_hessian="autodiff", with_mean_loss=False,
             control_variate=True, key=None, sample_offsets=False):
    """Evaluate the loss and the BLR's gradient statistics for every block of ``layout``.

    Returns ``((loss, aux), grads, stats, points, joint)`` where ``grads`` are the raw gradients of
    the evaluated loss w.r.t. all parameters, ``stats`` maps each diagonal/full block's loc name to
    :class:`BlockStats`, ``points`` is a :class:`BlockStats` for all point-mass locs jointly
    (``g`` raveled, ``h`` a dense matrix), or None when there are none, and ``joint`` is the dense
    Hessian over all diagonal blocks' locs (raveled in layout order) when ``hessian="autodiff"``,
    else None. ``point_hessian``
    ('autodiff' or 'none') is the curvature used for point masses, which have no sample. With
    ``with_mean_loss`` and ``delta``, a sixth value: the loss at the mean, where gradient and Hessian
    were evaluated (backtracking compares with it: one loss evaluation less to compile and to run).
    ``control_variate=False`` leaves out the sample's offset :math:`z - m` (``BlockStats.offset``): it is
    solved from the Hessian and its product with the offset, which for a loss averaged over several
    particles are averages over the particles, and the solution is then not the average offset (a biased
    control variate; :func:`loss_particles`). ``sample_offsets=True`` gives ``"hutchinson"``'s blocks their offset
    too, read off the gradients (:func:`sample_offset`; only for a loss of which :func:`reads_sample_offsets`), and
    the control variate :func:`sample_control` (``BlockStats.control``). ``key``: the probes of ``hessian="hutchinson"``
    (:func:`hutchinson_diagonal`; full blocks then take ``"reparam"``'s estimate, as a probe gives no
    off-diagonal).
    """
    if hessian not in HESSIANS:
        raise ValueError(f"hessian must be one of {HESSIANS}, got {hessian!r}")
    if hessian == "hutchinson" and (delta or key is None):
        raise ValueError("hessian='hutchinson' probes the Hessian at a sample of the guide, with probes drawn from `key`: "
                         "pass a key, and no delta=True (use 'autodiff' or 'none' with the delta method).")
    gauss = [b for b in layout.blocks if b.kind in (DIAGONAL, FULL)]
    # a probe gives the diagonal of the Hessian only: full blocks take Price's estimate with its baseline
    methods = {b.loc: "reparam" if (hessian == "hutchinson" and b.kind == FULL) else hessian for b in gauss}
    if point_hessian not in ("autodiff", "none"):
        raise ValueError(f"point_hessian must be 'autodiff' or 'none', got {point_hessian!r}")
    eval_params = at_mean(params, layout) if delta else params
    exact = [b for b in gauss if methods[b.loc] == "autodiff"]
    sampled = [b for b in gauss if methods[b.loc] in ("reparam", "price")]
    probed = [b for b in gauss if methods[b.loc] == "hutchinson"]
    point_names = [b.loc for b in layout.blocks if b.kind == POINT]
    hess, offsets = None, {}
    names = [b.loc for b in exact]
    names += point_names if point_hessian == "autodiff" else []
    offset_of = {}
    probes = {}
    if probed:  # the whitened Rademacher probe s * v of each block (hutchinson_diagonal)
        signs = {b.loc: jax.random.rademacher(k, params[b.loc].shape, params[b.loc].dtype)
                 for b, k in zip(probed, jax.random.split(key, len(probed)))}
        scales = {b.loc: b.transform(params[b.scale]) for b in probed}
        tangents, row = probe_directions(probed, scales, signs)
    if names:
        scaled = tuple(exact) if (not delta and control_variate) else ()
        (loss, aux), grads, hess, column = _grad_and_loc_hessian(fn, eval_params, names, forward_mode, scaled)
        if probed:  # the probes' products are a pass of their own
            hv = loss_gradients_and_products(fn, eval_params, tangents, forward_mode)[2]
    elif probed:  # one forward-over-reverse pass gives the loss, its gradients and the probes' products
        (loss, aux), grads, hv = loss_gradients_and_products(fn, eval_params, tangents, forward_mode)
    else:
        (loss, aux), grads = _value_and_grad(fn, eval_params, forward_mode)
    if probed:
        probes = {n: hutchinson_diagonal(scales[n], signs[n], probe_product(hv[n], row[n])) for n in signs}
    mean_loss = loss
    if delta:
        loss, aux = fn(params)
    if names:
        # ravel_pytree orders dict entries by sorted key
        start = 0
        for n in sorted(names):
            size = params[n].size
            offsets[n] = (start, start + size)
            start += size
        if scaled:
            # z - m for every sampled block, exactly: solve H(z) (z - m) = column on the sampled locs
            idx = np.concatenate([np.arange(*offsets[b.loc]) for b in exact])
            shift = jnp.linalg.solve(hess[np.ix_(idx, idx)], column[idx])
            start = 0
            for b in exact:
                size = params[b.loc].size
                offset_of[b.loc] = shift[start : start + size].reshape(params[b.loc].shape)
                start += size

    shrunk_scale, base_grads = {}, None
    baselined = [b for b in sampled if methods[b.loc] == "reparam"]
    if baselined:
        base_params = dict(params)
        for b in baselined:
            shrunk_scale[b.loc] = BASELINE_SHRINK * b.transform(params[b.scale])
            base_params[b.scale] = b.transform.inv(shrunk_scale[b.loc])
        _, base_grads = _value_and_grad(fn, base_params, forward_mode)

    stats = {}
    for b in gauss:
        g = grads[b.loc]
        h = whitened = None
        method = methods[b.loc]
        if method == "autodiff":
            lo, hi = offsets[b.loc]
            sub = hess[lo:hi, lo:hi]
            h = jnp.diagonal(sub).reshape(g.shape) if b.kind == DIAGONAL else sub
        elif method == "hutchinson":
            h = probes[b.loc]
        elif method in ("reparam", "price"):
            if delta:
                raise ValueError(f"hessian={hessian!r} needs a sample from the guide; with delta=True use 'autodiff' or 'none'.")
            scale = b.transform(params[b.scale])
            full = b.kind == FULL
            a = _scale_grad(b, scale, grads[b.scale], transpose=full)  # a^T for a full block
            if method == "reparam":
                # the same epsilon at scale c*s: subtracting its Price term removes the
                # zero-mean noise grad(l)(m) eps^T that dominates far from the optimum
                base = _scale_grad(b, shrunk_scale[b.loc], base_grads[b.scale], transpose=full)
                a = (a - base) / (1.0 - BASELINE_SHRINK)
            if not full:
                h = reparam_hessian_diagonal(scale, a)
            else:
                whitened = _whitened_hessian_from_transpose(scale, a)
                h = reparam_hessian_full(scale, a.T)  # XLA drops it when only `whitened` is used
        if method == "hutchinson" and sample_offsets and control_variate:
            offset_of[b.loc] = sample_offset(b, params, grads)
        stats[b.loc] = BlockStats(g, h, offset_of.get(b.loc), whitened)

    # Price's estimators ("reparam", "price": nb.von(), the deep-learning rows) keep their published form: one
    # pass over the data per step (one all-reduce when it is sharded), where this control variate is a second
    read = {b.loc: offset_of[b.loc] for b in probed if b.loc in offset_of}
    if read:
        for n, c in sample_control(fn, params, layout, read, forward_mode).items():
            stats[n] = stats[n]._replace(control=c)

    joint = None
    diag_names = [b.loc for b in exact if b.kind == DIAGONAL]
    if diag_names:
        # the Hessian across all diagonal blocks (the guide's family keeps only its diagonal): the
        # mean step of a mean-field guide is preconditioned by it (numpyro_blr.optim)
        idx = np.concatenate([np.arange(*offsets[n]) for n in diag_names])
        joint = hess[np.ix_(idx, idx)]

    points = None
    if point_names:
        g = jnp.concatenate([grads[n].reshape(-1) for n in sorted(point_names)])
        h = None
        if point_hessian == "autodiff":
            idx = np.concatenate([np.arange(*offsets[n]) for n in sorted(point_names)])
            h = hess[np.ix_(idx, idx)]
        points = BlockStats(g, h)
    if with_mean_loss and delta:
        return (loss, aux), grads, stats, points, joint, mean_loss
    return (loss, aux), grads, stats, points, joint
