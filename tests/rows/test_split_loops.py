"""The forms the network rows' steps take where XLA's CPU backend splits loops between threads (tree.split_loops).

On a CPU with more than one thread XLA cuts a large elementwise loop into one part per thread; a part of a length that
is not a whole number of vectors, or a fused concatenation, then compiles to masked vector loads and stores, 5-15x
slower on AMD EPYC (docs/deep-learning.md, "Steps on a multi-core CPU"). The steps avoid both there: the hash noise's
pairs are computed for a padded length from counters laid out as one row per thread, concatenations copy their parts,
the signed multiplicative rule broadcasts the gradient over two rows. These tests switch the forms on and off by hand
and check that the values are the same (the times are bench/bench_ivon.py's and bench/bench_liegroup.py's).
"""

import jax
import jax.numpy as jnp
import numpy as np
import numpyro.distributions as dist
import optax
import pytest

import numpyro_blr as nb
import numpyro_blr.tree as tree
from numpyro_blr.tree import concatenate_flat, even_split_length, hash_normal

# a small network with leaves of odd sizes (a split loop's part is then never a whole number of vectors)
PARAMS = {"w1": np.random.default_rng(0).standard_normal((5, 9)).astype(np.float32) * 0.3,
          "b1": np.zeros(9, np.float32), "w2": np.random.default_rng(1).standard_normal((9, 3)).astype(np.float32) * 0.3}
X = jnp.asarray(np.random.default_rng(2).standard_normal((16, 5)), jnp.float32)
Y = jnp.asarray(np.random.default_rng(3).integers(0, 3, 16), jnp.int32)


def loss_fn(params, x, y):
    h = jnp.tanh(x @ params["w1"] + params["b1"])
    return optax.softmax_cross_entropy_with_integer_labels(h @ params["w2"], y).mean()


@pytest.fixture(params=[False, True], ids=["one_thread", "split"])
def split(request, monkeypatch):
    monkeypatch.setattr(tree, "split_loops", lambda: request.param)
    monkeypatch.setattr(tree, "_cpu_threads", lambda: 6 if request.param else 1)
    return request.param


def _hash_normal_before(key, n):
    """hash_normal as written before the split-loop forms: one concatenation of the two halves, then ``[:n]``."""
    k = jax.random.bits(key, (4,), jnp.uint32)
    r, b = tree._box_muller_pairs(k, jax.lax.iota(jnp.uint32, (n + 1) // 2))
    r, b = jax.lax.optimization_barrier((r, b))
    z = jnp.concatenate([r * tree._cos_of_bits(b), r * tree._cos_of_bits(b - jnp.uint32(1 << 30))])
    return z[:n]


@pytest.mark.parametrize("n", [1, 2, 7, 10, 1001, 4096])
def test_hash_normal_draws_what_it_drew_before(n, split):
    key = jax.random.key(n)
    now = jax.jit(lambda k: hash_normal(k, n))(key)
    before = jax.jit(lambda k: _hash_normal_before(k, n))(key)
    assert now.shape == (n,)
    np.testing.assert_array_equal(np.asarray(now), np.asarray(before))


@pytest.mark.parametrize("n", [1, 7, 48, 4096, 4098])
def test_hash_counters_and_uniforms_are_the_same(n, split):
    """Where loops are split, the hash's counters are built as rows of a 2-D iota (tree._counters; 48 and 4,098 are
    whole rows for the fixture's 6 threads, the others not): the same counters, so the same uniforms as element-by-
    element hash_uniform_at."""
    np.testing.assert_array_equal(np.asarray(jax.jit(lambda: tree._counters(n))()), np.arange(n, dtype=np.uint32))
    key = jax.random.key(n)
    now = jax.jit(lambda k: tree.hash_uniform(k, n))(key)
    at = jax.jit(lambda k: tree.hash_uniform_at(jax.random.bits(k, (2,), jnp.uint32), 0, n))(key)
    np.testing.assert_array_equal(np.asarray(now), np.asarray(at))


def test_even_split_length(split):
    for n in (1, 7, 48, 49, 931845):
        m = even_split_length(n)
        assert m >= n
        assert m == n if not split else (m % 48 == 0 and m - n < 48)  # 8 x the 6 threads the fixture sets


@pytest.mark.parametrize("sizes", [(5,), (3, 1, 4), (7, 0, 2)])
def test_concatenate_flat_is_concatenate(sizes, split):
    parts = [jnp.arange(s, dtype=jnp.float32) + 10.0 * i for i, s in enumerate(sizes)]
    got = jax.jit(concatenate_flat)(parts)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(jnp.concatenate(parts)))


def test_ravel_is_the_same(split):
    layout = tree.FlatLayout.of(PARAMS)
    flat = jax.jit(layout.ravel)(PARAMS)
    np.testing.assert_array_equal(np.asarray(flat), np.concatenate([np.ravel(PARAMS[k]) for k in sorted(PARAMS)]))
    back = layout.unravel(flat)
    for k in PARAMS:
        np.testing.assert_array_equal(np.asarray(back[k]), PARAMS[k])


ROWS = {
    "ivon": lambda: nb.ivon(lr=0.05, ess=200.0, hess_init=0.5),
    "lie_additive": lambda: nb.lie_additive(0.05, momentum=0.9, base=dist.Normal(0.0, 0.05)),
    "lie_affine": lambda: nb.lie_affine(0.05, ess=200.0),
    "lie_multiplicative": lambda: nb.lie_multiplicative(0.05, ess=200.0),
}


def _states(row, steps=3):
    algo = ROWS[row]()
    state = algo.init(PARAMS)
    step = jax.jit(lambda k, s: algo.step(k, s, loss_fn, X, Y))
    for i in range(steps):
        state, info = step(jax.random.key(i), state)
        assert not bool(info.skipped)
    return [np.asarray(x) for x in jax.tree.leaves(state)]


@pytest.mark.parametrize("row", sorted(ROWS))
def test_steps_are_the_same_with_and_without_the_split_forms(row, monkeypatch):
    monkeypatch.setattr(tree, "split_loops", lambda: False)
    one = _states(row)
    monkeypatch.setattr(tree, "split_loops", lambda: True)
    monkeypatch.setattr(tree, "_cpu_threads", lambda: 6)
    split = _states(row)
    assert len(one) == len(split)
    for a, b in zip(one, split):
        # the same operations on the same values; XLA may fuse them differently (at most a rounding apart)
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)
