r"""The one table: family name <-> family class <-> NumPyro priors <-> support <-> guide parameters.

:data:`FAMILIES` has one row (:class:`FamilyInfo`) per family. Readers:
:class:`numpyro_blr.guides.ExpFamilyGuide` (which family a site's support gets, the guide's
parameters, their constraints and its distribution), :func:`numpyro_blr.layout.read_layout` (which
parameters form a block), :mod:`numpyro_blr.expfam_blocks` (raw <-> user parameters of a block) and
:func:`numpyro_blr.infer.conjugate_fit` (which family a prior belongs to: every Gaussian prior,
``Normal`` of any shape or ``MultivariateNormal``, is fitted with a dense precision over the flattened
site). Each family's own conversions (natural, expectation and user parameters, statistics, the
NumPyro distribution) live in its class.
"""

from dataclasses import dataclass
from typing import Callable, Optional

import jax.numpy as jnp
import numpy as np
import numpyro.distributions as dist
from numpyro.distributions import constraints
from numpyro.distributions.transforms import biject_to

from numpyro_blr.families.bernoulli import Bernoulli
from numpyro_blr.families.beta import Beta
from numpyro_blr.families.categorical import Categorical
from numpyro_blr.families.dirichlet import Dirichlet
from numpyro_blr.families.gamma import Gamma
from numpyro_blr.families.gaussian import DiagonalGaussian, FullGaussian


def base_support(support):
    """``support`` without its ``independent`` wrappers."""
    while isinstance(support, constraints.independent):
        support = support.base_constraint
    return support


def _is_zero(x):
    try:
        return float(np.max(np.abs(np.asarray(x)))) == 0.0
    except Exception:  # noqa: BLE001 - a traced bound cannot be checked
        return False


def num_categories(support):
    """``K`` for ``integer_interval(0, K-1)`` with a concrete upper bound, 2 for ``boolean``, else None."""
    base = base_support(support)
    if base is constraints.boolean:
        return 2
    if isinstance(base, constraints._IntegerInterval) and _is_zero(base.lower_bound):
        ub = np.asarray(base.upper_bound)
        if ub.size and np.all(ub == ub.flat[0]):
            return int(ub.flat[0]) + 1
    return None


def _positive(base):
    return isinstance(base, constraints._GreaterThan) and not isinstance(base, constraints._GreaterThanEq) and _is_zero(base.lower_bound)


def is_positive_support(support):
    """Whether ``support`` is :math:`(0, \\infty)` (``constraints.positive`` and its subclasses)."""
    return _positive(base_support(support))


def _unit_interval(base):
    return isinstance(base, constraints._Interval) and _is_zero(base.lower_bound) and _is_zero(np.asarray(base.upper_bound) - 1)


@dataclass(frozen=True)
class FamilyInfo:
    """One row of the table.

    ``serves(base_support)``: whether the family fits a site of that support (``ExpFamilyGuide``);
    ``params``/``constraints``: the guide's parameters in the order of the family's user parameters,
    and what SVI's ``constrain_fn`` applies to their raw values; ``event_dim``: event dimensions of
    one draw; ``build``: the guide's distribution from its parameter values (default
    ``family.to_numpyro``); ``label``/``support``/``statistics``: for messages.
    """

    name: str
    family: type
    label: str
    support: str
    statistics: str
    priors: tuple = ()
    params: tuple = ()
    constraints: tuple = ()
    serves: Callable = lambda base: False  # noqa: E731
    discrete: bool = False
    event_dim: int = 0
    build: Optional[Callable] = None

    def distribution(self, *values):
        """The NumPyro distribution of guide parameter values (in the order of ``params``)."""
        return (self.build or self.family.to_numpyro)(*values)

    def user(self, natural):
        """The family's user parameters of ``natural``, always as a tuple."""
        out = self.family.from_natural(natural)
        return out if isinstance(out, tuple) else (out,)

    def constrain(self, raw):
        """User parameters (tuple) from the guide's raw (unconstrained) values."""
        return tuple(biject_to(c)(r) for c, r in zip(self.constraints, raw))

    def unconstrain(self, user):
        return tuple(biject_to(c).inv(u) for c, u in zip(self.constraints, user))


_POSITIVE = constraints.positive
FAMILIES = {
    info.name: info
    for info in (
        FamilyInfo("normal", DiagonalGaussian, "Gaussian", "real", "(z, z^2)", params=("loc", "scale"),
                   constraints=(constraints.real, constraints.softplus_positive),
                   serves=lambda base: base is constraints.real, build=dist.Normal),
        FamilyInfo("multivariate_normal", FullGaussian, "Gaussian", "real", "(z, z z^T)",
                   priors=(dist.Normal, dist.MultivariateNormal)),
        FamilyInfo("gamma", Gamma, "Gamma", "positive", "(log z, z)", priors=(dist.Gamma, dist.Exponential),
                   params=("concentration", "rate"), constraints=(_POSITIVE, _POSITIVE), serves=_positive),
        FamilyInfo("beta", Beta, "Beta", "unit_interval", "(log z, log(1 - z))", priors=(dist.Beta,),
                   params=("concentration1", "concentration0"), constraints=(_POSITIVE, _POSITIVE), serves=_unit_interval),
        FamilyInfo("dirichlet", Dirichlet, "Dirichlet", "simplex", "log z", priors=(dist.Dirichlet,),
                   params=("concentration",), constraints=(_POSITIVE,),
                   serves=lambda base: isinstance(base, constraints._Simplex), event_dim=1),
        FamilyInfo("bernoulli", Bernoulli, "Bernoulli", "boolean", "z", priors=(dist.BernoulliProbs, dist.BernoulliLogits),
                   params=("logits",), constraints=(constraints.real,),
                   serves=lambda base: base is constraints.boolean, discrete=True),
        FamilyInfo("categorical", Categorical, "Categorical", "integer_interval", "one-hot(z)[:K-1]",
                   priors=(dist.CategoricalProbs, dist.CategoricalLogits), params=("logits",), constraints=(constraints.real,),
                   serves=lambda base: num_categories(base) is not None, discrete=True),
    )
}
# the families an ExpFamilyGuide site can have, in order of preference (Bernoulli before Categorical)
GUIDE_FAMILIES = tuple(name for name, info in FAMILIES.items() if info.params)


def default_family(support):
    """The guide family for a site's support, or None if there is none."""
    base = base_support(support)
    return next((name for name in GUIDE_FAMILIES if FAMILIES[name].serves(base)), None)


def allowed_families(support):
    """The guide families that fit the support: the default first, then ``"normal"`` for any continuous
    support (a Gaussian on the unconstrained value), ``"categorical"`` also for a boolean one."""
    base = base_support(support)
    names = [name for name in GUIDE_FAMILIES if FAMILIES[name].serves(base)]
    return tuple(dict.fromkeys(names + ([] if support.is_discrete else ["normal"])))


def for_prior(d):
    """The row whose ``priors`` include the NumPyro distribution ``d`` (unwrapped), or None."""
    return next((info for info in FAMILIES.values() if isinstance(d, info.priors)), None)


def prior_names():
    """The supported priors, for error messages (``Bernoulli`` for ``BernoulliProbs``/``BernoulliLogits``)."""
    names = [cls.__name__.replace("Probs", "").replace("Logits", "") for info in FAMILIES.values() for cls in info.priors]
    return ", ".join(dict.fromkeys(names))


# ----------------------------------------------------------------------------------------------
# Likelihoods: a NumPyro distribution as an exponential family in its *value*
# ----------------------------------------------------------------------------------------------
#: NumPyro distribution classes whose log density is <eta, T(x)> - A(eta) with base measure 1 in the
#: family's statistics: class -> (family, whether the family is elementwise over batch and event axes)
LIKELIHOODS = (
    (dist.Normal, DiagonalGaussian, True),
    (dist.MultivariateNormal, FullGaussian, False),
    ((dist.Gamma, dist.Exponential), Gamma, True),
    (dist.Beta, Beta, True),
    (dist.Dirichlet, Dirichlet, False),
    ((dist.BernoulliProbs, dist.BernoulliLogits), Bernoulli, True),
    ((dist.CategoricalProbs, dist.CategoricalLogits), Categorical, False),
)


def exponential_form(d):
    r"""``(family, natural, statistics)`` of the NumPyro distribution ``d`` (without wrappers) read as an
    exponential family in its value, :math:`\log p(x) = \langle\eta, T(x)\rangle - A(\eta)` with base measure 1,
    or None if ``d``'s class is not in :data:`LIKELIHOODS`.

    ``natural`` is the family's natural NamedTuple with every array of shape
    ``d.batch_shape + d.event_shape + extra`` (``extra`` the statistic's own axes: ``(D,)`` for a dense
    Gaussian's second one, ``(K-1,)`` for a Categorical); ``statistics(x)`` is :math:`T(x)` in the same layout
    and ``family.log_partition(natural)`` is :math:`\sum A` over all of ``d``'s elements. Used by message
    passing (:mod:`numpyro_blr.infer`) to factorise a likelihood's expectation through :math:`T(x)`.
    """
    for classes, family, elementwise in LIKELIHOODS:
        if isinstance(d, classes):
            break
    else:
        return None
    user = family.from_numpyro(d)
    user = user if isinstance(user, tuple) else (user,)
    natural = family.to_natural(*user)
    full = tuple(d.batch_shape) + tuple(d.event_shape)
    if elementwise:
        natural = type(natural)(*[jnp.broadcast_to(a, full) for a in natural])
    if family is Categorical:
        k = natural.eta.shape[-1] + 1
        return family, natural, lambda x: family.sufficient_statistics(x, k)
    return family, natural, family.sufficient_statistics
