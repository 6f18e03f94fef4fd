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

import jax
import jax.numpy as jnp
import numpy as np

from numpyro_blr.core import check_positive, select
from numpyro_blr.infer.graph import ModelError
from numpyro_blr.infer.vmp import FitResult, MessagePassing, SweepInfo, VMPState, _Engine, _progress

__all__ = ["svi"]


class _Stochastic(_Engine):
    def __init__(self, model, args, kwargs, *, kappa, tau, local_steps, order, check_model, rtol):
        from numpyro_blr.infer.graph import Graph

        graph = Graph(model, args, kwargs, full_plates=False)
        if not graph.subsampled:
            raise ModelError(
                "svi: no numpyro.plate of the model declares subsample_size, so a minibatch would count as the whole "
                "data set (an over-confident posterior by N/B). Declare the data plate as "
                "numpyro.plate('n', N, subsample_size=B) and index the data with its indices (or pass minibatches "
                "with the plate's full size N).")
        if len(graph.subsampled) > 1:
            raise ModelError(f"svi: one subsampled plate is supported, the model has {sorted(graph.subsampled)}.")
        (self.plate, (self.size, self.batch_size)), = graph.subsampled.items()
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
        new = VMPState({n: natural[n] for n in self.globals}, elbo, state.count + 1)
        new = select(good, new, state)
        factors = jnp.stack(list(per_factor.values()))
        return new, SweepInfo(-elbo, ~good, elbo, site_ok, jnp.isfinite(factors), factors,
                              jnp.stack(list(entropies.values())))

    # --- the algorithm -------------------------------------------------------------------------------
    def init(self, init=None, key=None):
        state = super().init(init=init, key=None)
        return VMPState({n: state.natural[n] for n in self.globals}, state.elbo, state.count)

    def step(self, key, state, *batch, indices=None):
        """One minibatch step: ``batch`` (the model's arguments for a streamed minibatch), or ``indices`` into the data
        given at construction, or indices drawn with ``key``."""
        graph = self.graph
        if batch:
            graph.set_data(batch, self._kwargs)
            indices = jnp.arange(self.batch_size)
        else:
            graph.set_data(self._args, self._kwargs)
            if indices is None:
                if key is None:
                    raise ValueError("svi: step needs a key to draw the minibatch (or indices=, or the batch's arguments).")
                indices = jax.random.randint(key, (self.batch_size,), 0, self.size)
        graph.plate_values = {self.plate: jnp.asarray(indices)}
        return self.jitted(state)

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
        history, diverged, taken = [], None, 0
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
            state, taken = new, taken + 1
            history.append(float(info.elbo))
            if t % 50 == 0:
                bar.set_postfix(minibatch_elbo=f"{history[-1]:.6g}")
        bar.close()
        return FitResult(state=state, posterior=self.posterior(state), params=self.params(state),
                         elbo=history[-1] if history else float("nan"), elbo_history=history, converged=False,
                         num_steps=taken, diverged=diverged, guide=self.guide(state))

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
