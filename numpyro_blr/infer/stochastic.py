r"""Stochastic variational inference with minibatches (Hoffman, Blei, Wang & Paisley 2013) as the BLR.

The model declares its minibatches the NumPyro way, ``with numpyro.plate("n", N, subsample_size=B) as idx``: every
site in the plate has scale :math:`N/B`. Latent sites inside the subsampled plate are *local* (one per data point:
a mixture's assignments); the others are *global*. One step, on a minibatch:

1. the local sites start at their prior and take ``local_steps`` exact VMP sweeps, :math:`\rho = 1`, given the
   current globals (one sweep is exact when their messages read only the globals);
2. each global site's message :math:`\hat\eta_i = \nabla_{\mu_i}\mathbb E_q[\log p]` is computed from the scaled
   minibatch, all from the same :math:`q` (the globals are updated together, as in Hoffman et al. and BayesPy) (the natural parameter its complete conditional would have if the whole data set looked like the
   minibatch), and the BLR takes a step of size :math:`\rho_t = (t + \tau)^{-\kappa}`:
   :math:`\lambda_i \leftarrow (1 - \rho_t)\lambda_i + \rho_t\hat\eta_i` (Robbins-Monro for
   :math:`\kappa \in (0.5, 1]`, :math:`\tau \ge 0`).

The minibatch comes from the data given at construction (``step(key, state)`` draws its indices; :meth:`run`
goes through a random permutation per epoch) or is streamed (``step(key, state, *batch_args)``: the model's
arguments for this minibatch, the same shapes every step, e.g. from the user's iterator over data that does not fit in
memory; the model then ignores the plate's indices). Only the globals are kept in the state. A model that
declares no subsampled plate, or observes minibatch-sized data outside it, is rejected: its minibatch would count
as the whole data set and the posterior would be over-confident by :math:`N/B`.
"""

import math
import warnings
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from numpyro_blr.core import check_positive, select
from numpyro_blr.infer.graph import ModelError
from numpyro_blr.infer.vmp import FitResult, MessagePassing, SweepInfo, VMPState, _Engine, _progress

__all__ = ["svi"]

#: ops that only normalise an index array (negative indices, dtype, shape): a gather whose indices come from the
#: plate's indices through these reads the rows the plate selects
_INDEX_OPS = frozenset({"lt", "le", "gt", "ge", "eq", "ne", "add", "sub", "select_n", "convert_element_type",
                        "broadcast_in_dim", "reshape", "squeeze", "expand_dims", "concatenate", "clamp", "min", "max",
                        "copy", "copy_p", "and", "or", "pjit", "jit"})
_REDUCE_OPS = frozenset({"reduce_sum", "reduce_max", "reduce_min", "reduce_prod", "argmax", "argmin", "reduce_and",
                         "reduce_or"})


class _Flow(NamedTuple):
    """What a jaxpr value carries: ``raw``, the data arguments it reads whole (not through the plate's indices);
    ``indexed``, whether it depends on the plate's indices; ``direct``, whether it is those indices (normalised);
    ``gathers``, the (array size along the gathered axes, argument positions) of the gathers by the plate's indices
    it depends on."""

    raw: frozenset = frozenset()
    indexed: bool = False
    direct: bool = False
    gathers: frozenset = frozenset()


def _join(flows):
    return _Flow(frozenset().union(*[f.raw for f in flows]) if flows else frozenset(),
                 any(f.indexed for f in flows), False,
                 frozenset().union(*[f.gathers for f in flows]) if flows else frozenset())


def _propagate(jaxpr, inputs):
    """Forward data flow (:class:`_Flow`) through ``jaxpr`` given its inputs' flows; nested calls are entered."""
    env = dict(zip(jaxpr.invars, inputs))

    def read(v):
        return _Flow() if type(v).__name__ == "Literal" else env.get(v, _Flow())

    for eqn in jaxpr.eqns:
        ins = [read(v) for v in eqn.invars]
        name = eqn.primitive.name
        sub = eqn.params.get("jaxpr", eqn.params.get("call_jaxpr"))
        sub = getattr(sub, "jaxpr", sub)
        if sub is not None and hasattr(sub, "eqns") and len(sub.invars) == len(ins):
            outs = _propagate(sub, ins)
        elif name == "gather" and ins[1].direct:
            operand = eqn.invars[0].aval.shape
            axes = tuple(operand[a] for a in eqn.params["dimension_numbers"].start_index_map)
            gathered = frozenset({(axes, ins[0].raw)})
            flow = _Flow(frozenset(), True, False, ins[0].gathers | ins[1].gathers | gathered)
            outs = [flow] * len(eqn.outvars)
        else:
            flow = _join(ins)
            if name in _INDEX_OPS and any(f.direct for f in ins):
                flow = flow._replace(direct=True)
            if name in _REDUCE_OPS:
                flow = flow._replace(raw=frozenset())
            outs = [flow] * len(eqn.outvars)
        for o, f in zip(eqn.outvars, outs):
            env[o] = f
    return [read(v) for v in jaxpr.outvars]


class _Stochastic(_Engine):
    def __init__(self, model, args, kwargs, *, kappa, tau, local_steps, order, check_model, rtol):
        from numpyro_blr.infer.graph import Graph

        try:
            graph = Graph(model, args, kwargs, full_plates=False)
        except (ValueError, TypeError) as err:
            if isinstance(err, ModelError):
                raise
            _explain_shapes(model, args, kwargs, err)
            raise
        if not graph.subsampled:
            raise ModelError(
                "svi: no numpyro.plate of the model declares subsample_size, so a minibatch would count as the whole "
                "data set (an over-confident posterior by N/B). Declare the data plate as "
                "numpyro.plate('n', N, subsample_size=B) and index the data with its indices (or pass minibatches "
                "with the plate's full size N).")
        if len(graph.subsampled) > 1:
            raise ModelError(f"svi: one subsampled plate is supported, the model has {sorted(graph.subsampled)}.")
        (self.plate, (self.size, self.batch_size)), = graph.subsampled.items()
        if self.batch_size > self.size:
            raise ModelError(
                f"svi: plate '{self.plate}' declares subsample_size={self.batch_size}, more than its size {self.size}: "
                f"a minibatch cannot be larger than the data set. Pass subsample_size <= {self.size} (or fit the "
                "whole data set with numpyro_blr.infer.vmp).")
        plates = {self.plate: jnp.arange(self.batch_size)}
        super().__init__(model, args, kwargs, order=order, check_model=check_model, rtol=rtol, plates=plates, name="svi")
        g = self.graph
        self.local = [n for n, s in g.sites.items() if self.plate in s.plates]
        self.globals = [n for n in self.order if n not in self.local]
        self.local_order = [n for n in self.order if n in self.local]
        for f in g.factors.values():
            if f.observed and self.plate not in f.plates and self.batch_size in f.batch_shape + f.event_shape:
                raise ModelError(
                    f"svi: observed site '{f.name}' has an axis of the minibatch size {self.batch_size} but is not inside "
                    f"the subsampled plate '{self.plate}', so its log density is not scaled by N/B = "
                    f"{self.size}/{self.batch_size}: put it inside the plate.")
        bad = [n for n, k in self.kind.items() if k != "conjugate"]
        if bad:
            raise ModelError(f"svi: sites {bad} are not conjugate exponential-family sites; stochastic VI here takes exact "
                             "steps only (use ncvmp on the full data, or nb.BLR with SVI).")
        self.kappa = check_positive(kappa, "kappa")
        if not 0.5 < self.kappa <= 1.0:
            raise ValueError(f"svi: kappa must be in (0.5, 1] (Robbins-Monro), got {kappa}.")
        self.tau = check_positive(tau, "tau", allow_zero=True)
        self.local_steps = int(local_steps)
        self.check_data()

    # --- the data against the plate, at construction (concrete, outside the compiled step) ---------------------
    def _arg_names(self):
        """A name per dynamic data leaf (:meth:`Graph.data`): 'argument 0', "keyword argument 'y'", with its shape."""
        graph = self.graph
        with_path, _ = jax.tree_util.tree_flatten_with_path((graph.args, graph.kwargs))
        _, _, dynamic = graph._data_leaves()
        names = []
        for i in dynamic:
            path, x = with_path[i]
            first = path[1] if len(path) > 1 else None
            key = getattr(first, "idx", getattr(first, "key", "?"))
            base = f"argument {key}" if path[0].idx == 0 else f"keyword argument '{key}'"
            rest = jax.tree_util.keystr(tuple(path[2:]))
            names.append(f"{base}{rest} (shape {tuple(np.shape(x))})")
        return names

    def check_data(self):
        r"""Check how the observed sites in the subsampled plate read the data, from the jaxpr of their log densities
        as a function of the model's array arguments and the plate's indices (:class:`_Flow`), and that the rows they
        read are finite. Raises :class:`ModelError` naming the site, the argument and what to write when

        * the plate's indices gather an array whose length along the gathered axis is not the declared size (a
          smaller size uses only the first rows; a larger one has indices past the data, clamped by JAX);
        * a site reads an argument with the plate's size along an axis without the indices (``obs=y[:B]``: the
          same rows every step);
        * an argument the plate's sites read has non-finite values (rows named).
        """
        graph = self.graph
        names = [f for f, fac in graph.factors.items() if fac.observed and self.plate in fac.plates]
        if not names:
            return
        leaves, treedef, dynamic = graph._data_leaves()
        data = [jnp.asarray(leaves[i]) for i in dynamic]

        def fn(data, idx):
            values = list(leaves)
            for i, x in zip(dynamic, data):
                values[i] = x
            saved = graph.args, graph.kwargs, graph.plate_values
            graph.args, graph.kwargs = jax.tree_util.tree_unflatten(treedef, values)
            graph.plate_values = {self.plate: idx}
            try:
                tr = graph.run({}, {})
                return [tr[f]["fn"].log_prob(tr[f]["value"]) for f in names]
            finally:
                graph.args, graph.kwargs, graph.plate_values = saved

        closed = jax.make_jaxpr(fn)(data, jnp.arange(self.batch_size))
        inputs = [_Flow(raw=frozenset({k})) for k in range(len(data))] + [_Flow(indexed=True, direct=True)]
        flows = _propagate(closed.jaxpr, inputs)
        arg_names = self._arg_names()
        plate, size, b = self.plate, self.size, self.batch_size
        declared = f"numpyro.plate('{plate}', {size}, subsample_size={b})"
        used = set()
        for f, flow in zip(names, flows):
            for sizes, args in sorted(flow.gathers, key=str):
                used |= set(args)
                if size in sizes or not sizes:
                    continue
                length = sizes[0]
                what = " and ".join(arg_names[k] for k in sorted(args)) or "an array"
                effect = (f"only its first {size} rows are ever used" if length > size else
                          f"indices past its {length} rows are clamped to its last row")
                raise ModelError(
                    f"svi: observed site '{f}' reads {what} at the indices of the subsampled plate '{plate}' declared as "
                    f"{declared}, but that array has {length} entries along the indexed axis, not {size}: {effect}. "
                    f"Declare numpyro.plate('{plate}', {length}, subsample_size={b}) (the plate's size is the number of "
                    "rows of the data).")
            for k in sorted(flow.raw):
                used.add(k)
                shape = tuple(data[k].shape)
                if size != b and size in shape:
                    raise ModelError(
                        f"svi: observed site '{f}' in the subsampled plate '{plate}' reads {arg_names[k]}, which has the "
                        f"plate's {size} rows, without the plate's indices: every step sees the same rows instead of the "
                        f"minibatch. Index it with them: `with {declared} as idx:` and read the rows as `...[idx]` "
                        "(e.g. obs=y[idx]), or stream minibatches (pass each one's arguments to step).")
        for k in sorted(used):
            x = np.asarray(data[k])
            if not np.issubdtype(x.dtype, np.inexact) or np.all(np.isfinite(x)):
                continue
            axis = next((a for a, n in enumerate(x.shape) if n == size), 0)
            bad = np.nonzero(~np.all(np.isfinite(np.moveaxis(x, axis, 0).reshape(x.shape[axis], -1)), axis=1))[0]
            shown = ", ".join(str(int(r)) for r in bad[:10]) + (", ..." if len(bad) > 10 else "")
            raise ModelError(
                f"svi: {arg_names[k]} has non-finite values (NaN or inf) in {len(bad)} row(s) along axis {axis}: "
                f"[{shown}]. The subsampled plate '{plate}' reads it; remove or impute those rows (or mask them with "
                "numpyro.handlers.mask / obs_mask) before fitting.")

    def rho(self, count):
        return (count + 1.0 + self.tau) ** (-self.kappa)

    def local_prior(self, natural):
        """The local sites' prior natural parameters given the globals' reference values."""
        refs = {n: self.graph.sites[n].reference(natural[n]) for n in self.globals}
        latent, params = self.graph.split(refs)
        tr = self.graph.run(latent, params)
        return {n: self.graph.sites[n].natural_from_dist(tr[n]["fn"]) for n in self.local}

    def stochastic_step(self, state):
        natural = dict(state.natural)
        natural.update(self.local_prior(natural))
        mean = self.means(natural)
        self.exact_sweeps(self.local_order, self.local_steps, natural, mean)
        rho = self.rho(state.count.astype(self.float_dtype))
        # every global's message from the same local q and globals (Hoffman et al. 2013; BayesPy's gradient_step)
        new = {n: self.update_conjugate(n, natural, mean, rho) for n in self.globals}
        natural.update(new)
        ok = [self.graph.sites[n].is_valid(natural[n]) for n in self.globals]
        elbo, per_factor, entropies = self.elbo_terms(natural)
        site_ok = jnp.stack(ok) if ok else jnp.ones((0,), bool)
        good = jnp.all(site_ok) & jnp.isfinite(elbo)
        change = (self.change({n: self.graph.sites[n].expectation(state.natural[n]) for n in self.globals},
                              {n: self.graph.sites[n].expectation(natural[n]) for n in self.globals}, self.globals)
                  if self.globals else jnp.zeros((0,), self.float_dtype))
        new = VMPState({n: natural[n] for n in self.globals}, elbo, state.count + 1)
        new = select(good, new, state)
        factors = jnp.stack(list(per_factor.values()))
        return new, SweepInfo(-elbo, ~good, elbo, site_ok, jnp.isfinite(factors), factors,
                              jnp.stack(list(entropies.values())), change, jnp.zeros((), bool))

    # --- the algorithm -------------------------------------------------------------------------------
    def init(self, init=None, key=None):
        state = super().init(init=init, key=None)
        return VMPState({n: state.natural[n] for n in self.globals}, state.elbo, state.count)

    def step(self, key, state, *batch, indices=None):
        """One minibatch step: ``batch`` (the model's arguments for a streamed minibatch), or ``indices`` into the data
        given at construction, or indices drawn with ``key``."""
        graph = self.graph
        if batch:
            self._check_batch(batch)
            graph.set_data(batch, self._kwargs)
            indices = jnp.arange(self.batch_size)
        else:
            graph.set_data(self._args, self._kwargs)
            if indices is None:
                if key is None:
                    raise ValueError("svi: step needs a key to draw the minibatch (or indices=, or the batch's arguments).")
                indices = jax.random.randint(key, (self.batch_size,), 0, self.size)
            elif tuple(np.shape(indices)) != (self.batch_size,):
                raise ValueError(f"svi: step's indices must have shape ({self.batch_size},) (the subsample_size of plate "
                                 f"'{self.plate}'), got {tuple(np.shape(indices))}.")
        graph.plate_values = {self.plate: jnp.asarray(indices)}
        return self.jitted(state)

    def _check_batch(self, batch):
        """A streamed minibatch must have the structure and shapes of the arguments given at construction (the compiled
        step's): otherwise name the argument."""
        ref, ref_def = jax.tree_util.tree_flatten(self._args)
        got, got_def = jax.tree_util.tree_flatten_with_path(tuple(batch))
        if ref_def != got_def:
            raise ValueError(f"svi: step got {len(batch)} minibatch argument(s) of another structure than the "
                             f"{len(self._args)} given at construction; pass the model's arguments for this minibatch, "
                             "in the same order.")
        for a, (path, b) in zip(ref, got):
            if np.shape(a) != np.shape(b):
                where = f"argument {path[0].idx}{jax.tree_util.keystr(tuple(path[1:]))}"
                raise ValueError(
                    f"svi: step's minibatch {where} has shape {np.shape(b)}, but the model was built for {np.shape(a)} "
                    f"(plate '{self.plate}' declares subsample_size={self.batch_size}): pass minibatches of "
                    f"{self.batch_size} rows (drop or pad the last, short one), or build svi with a minibatch of the "
                    "new size.")

    def full_elbo(self, state, *args, **kwargs):
        """The ELBO on the whole data set (``args``: the model's full arguments, default those given at construction)
        with the local sites at their optimum given the globals: a VMP engine on the full data, built once."""
        if self._full is None:
            from numpyro_blr.infer.vmp import vmp

            self._full = vmp(self.model, *(args or self._args), order=self.order, check=False, **(kwargs or self._kwargs))
            full = self._full
            eng = full.engine

            def fn(prior, glob):  # the prior an input: another object's would otherwise be folded in
                natural = dict(prior)
                natural.update(glob)
                eng.exact_sweeps(self.local_order, self.local_steps, natural, eng.means(natural))
                return eng.elbo_terms(natural)[0], natural

            mine, theirs = self.static_key("full_elbo"), eng.static_key("full_elbo")
            self._full_fn = eng.graph.jit(fn, key=None if mine is None or theirs is None else (mine, theirs))
        if args:
            self._full.graph.set_data(args, kwargs or self._kwargs)
        elbo, natural = self._full_fn(self._full.engine._prior_natural, state.natural)
        return float(elbo), natural

    def run_stochastic(self, state, key=None, num_steps=None, num_epochs=None, batches=None, progress_bar=True):
        steps_per_epoch = math.ceil(self.size / self.batch_size)
        if num_steps is None:
            num_steps = int(round((num_epochs if num_epochs is not None else 1) * steps_per_epoch))
        if batches is None and key is None:
            key = jax.random.PRNGKey(0)
        perm_rng = np.random.default_rng(None if key is None else np.asarray(jax.random.key_data(key)).ravel()[-1])
        history, diverged, taken, last = [], None, 0, None
        bar = _progress(num_steps, "svi", progress_bar)
        batch_iter = iter(batches) if batches is not None else None
        perm, pos = None, self.size
        for t in bar:
            if batch_iter is not None:
                try:
                    batch = next(batch_iter)
                except StopIteration:
                    break
                batch = batch if isinstance(batch, tuple) else (batch,)
                new, info = self.step(None, state, *batch)
            else:
                if pos + self.batch_size > self.size:
                    perm, pos = perm_rng.permutation(self.size), 0
                idx = perm[pos:pos + self.batch_size]
                pos += self.batch_size
                new, info = self.step(None, state, indices=idx)
            if bool(info.skipped):
                diverged = self._nonfinite_name(info, self.globals)
                warnings.warn(f"svi: step {t + 1} is not finite ({diverged} went non-finite); stopped and kept the last "
                              "finite state.", RuntimeWarning, stacklevel=3)
                break
            state, taken, last = new, taken + 1, info
            history.append(float(info.elbo))
            if t % 50 == 0:
                bar.set_postfix(minibatch_elbo=f"{history[-1]:.6g}")
        bar.close()
        from numpyro_blr.infer import report

        rep = report.stochastic(self, taken, history, last, float(self.rho(float(state.count))))
        if diverged is None:
            for problem in rep.problems:
                warnings.warn(problem, RuntimeWarning, stacklevel=3)
        return FitResult(state=state, posterior=self.posterior(state), params=self.params(state),
                         elbo=history[-1] if history else float("nan"), elbo_history=history, converged=rep.converged,
                         num_steps=taken, diverged=diverged, guide=self.guide(state), report=rep)

    def posterior(self, state):
        return {n: self.graph.sites[n].distribution(state.natural[n]) for n in self.globals}

    def params(self, state):
        return {}

    def algorithm(self, parts):
        self._args, self._kwargs = self.graph.args, self.graph.kwargs
        self._full = None
        self.model = self.graph.model
        self.jitted = self.graph.jit(self.stochastic_step, key=self.static_key("stochastic_step"))
        self.jitted_step = self.step
        return MessagePassing(
            init=self.init, step=self.step, sample=self.sample,
            update=self.graph.jit(self.apply, key=self.static_key("apply"), data=False),
            run=self.run_stochastic, posterior=self.posterior, elbo=self.full_elbo, graph=self.graph, parts=parts,
            engine=self)


def svi(model, *args, kappa=0.7, tau=1.0, local_steps=1, order=None, check=True, rtol=None, **kwargs):
    r"""Stochastic VI (module docstring): ``model(*args, **kwargs)`` with one ``numpyro.plate(name, N,
    subsample_size=B)``; ``args`` is the whole data set (minibatches drawn by index) or one representative minibatch
    (then pass each minibatch's arguments to ``step``, or an iterator of them as ``run(..., batches=...)``).

    Returns :class:`~numpyro_blr.infer.vmp.MessagePassing`: ``init()``; ``step(key, state)`` /
    ``step(None, state, *batch_args)`` / ``step(None, state, indices=idx)``; ``run(state, key=..., num_epochs=...,
    batches=None, progress_bar=True)`` (a random permutation per epoch; ``elbo_history`` holds the minibatch ELBO
    estimates); ``elbo(state, *full_args)`` the whole-data ELBO with the local sites at their optimum.
    :math:`\rho_t = (t + \tau)^{-\kappa}` with ``kappa`` in (0.5, 1], ``tau >= 0``; ``local_steps`` sweeps over the
    local sites per minibatch.

    Raises:
        ModelError: no subsampled plate, more than one, minibatch-sized observations outside the plate, or a
            non-conjugate site.
    """
    engine = _Stochastic(model, args, kwargs, kappa=kappa, tau=tau, local_steps=local_steps, order=order,
                         check_model=check, rtol=rtol)
    return engine.algorithm({"rule": "blr", "rho": f"(t + {tau})^-{kappa}", "local": engine.local,
                             "global": engine.globals})


def _explain_shapes(model, args, kwargs, err):
    """Raise :class:`ModelError` naming the observed site whose value does not fit its subsampled plate, when that is
    why building the graph failed with ``err`` (a broadcast error from inside NumPyro); return otherwise."""
    from numpyro import handlers

    found = []

    def trace():
        with handlers.block():
            tr = handlers.trace(handlers.seed(model, 0)).get_trace(*args, **(kwargs or {}))
        for name, msg in tr.items():
            if msg["type"] != "sample" or not msg["is_observed"]:
                continue
            shape = tuple(np.shape(msg["value"]))[:len(np.shape(msg["value"])) - len(msg["fn"].event_shape) or None]
            for frame in msg.get("cond_indep_stack", []):
                sub = tr.get(frame.name, {}).get("args", (None, None))
                if sub[1] is None or sub[1] == sub[0]:
                    continue
                axis = len(shape) + frame.dim
                if 0 <= axis < len(shape) and shape[axis] not in (1, frame.size):
                    found.append((name, frame.name, sub[0], sub[1], shape[axis]))
        return 0

    try:
        jax.eval_shape(trace)
    except Exception:  # noqa: BLE001 - the model fails before its sites: leave the original error
        return
    if found:
        name, plate, size, b, rows = found[0]
        raise ModelError(
            f"svi: observed site '{name}' has {rows} rows along subsampled plate '{plate}', which declares "
            f"subsample_size={b} (numpyro.plate('{plate}', {size}, subsample_size={b})): the minibatch given has another "
            f"size than the plate's. Pass minibatches of {b} rows, or declare subsample_size={rows}.") from err
