import jax.numpy as jnp
import numpy as np
import numpyro
import numpyro.distributions as dist
import pytest
from sklearn.datasets import load_breast_cancer, load_diabetes


def standardise_with_intercept(X):
    X = (X - X.mean(0)) / X.std(0)
    return np.hstack([np.ones((X.shape[0], 1)), X])


def logistic_model(X, y=None):
    w = numpyro.sample("w", dist.Normal(0.0, 1.0).expand([X.shape[1]]).to_event(1))
    numpyro.sample("y", dist.Bernoulli(logits=X @ w), obs=y)


def linear_model(X, y=None, noise=1.0, prior_scale=1.0):
    w = numpyro.sample("w", dist.Normal(0.0, prior_scale).expand([X.shape[1]]).to_event(1))
    numpyro.sample("y", dist.Normal(X @ w, noise), obs=y)


@pytest.fixture(scope="session")
def breast_cancer():
    X, y = load_breast_cancer(return_X_y=True)
    return jnp.asarray(standardise_with_intercept(X), jnp.float32), jnp.asarray(y, jnp.float32)


@pytest.fixture(scope="session")
def diabetes_np():
    """Diabetes regression with standardised target: float64 numpy arrays."""
    X, y = load_diabetes(return_X_y=True)
    return standardise_with_intercept(X), (y - y.mean()) / y.std()
