"""IVON vs optax.adamw on a GPT-2-small-shaped transformer language model (a compute-bound network), step cost only.

    python bench/transformer_lm.py [--layers 12 --width 768 --heads 12 --vocab 50257] [--seq 512] [--batch 8]
                                   [--rounds 5] [--steps 20] [--cost-only] [--bf16-params]

A small pure-JAX decoder (pre-LayerNorm blocks, causal multi-head attention, GELU MLP, learned positions, output
head tied to the token embedding): with the defaults 124M weights, GPT-2 small's shape. The matmuls run in
bfloat16 (weights and activations cast to bfloat16, results back to float32; LayerNorm, softmax and the loss in
float32); the weights are float32 (``--bf16-params``: bfloat16 weights, IVON's state float32). The tokens are
synthetic (uniform; the step cost does not depend on them) and the loss is the mean next-token cross-entropy.
The table is bench/bench_cost.py's: XLA's bytes accessed in passes over the parameters and flops of each
compiled step next to AdamW's, and the median time over alternating rounds.
"""

import argparse
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_cost import adamw_steps, algorithm_step, report  # noqa: E402

import numpyro_blr as nb  # noqa: E402

BF16 = jnp.bfloat16


def init_lm(key, vocab, width, layers, seq, dtype=jnp.float32):
    """GPT-2's initialisation: normal(0, 0.02) weights, the residual projections scaled by 1/sqrt(2 layers)."""
    keys = iter(jax.random.split(key, 4 + 4 * layers))

    def normal(shape, sd=0.02):
        return (sd * jax.random.normal(next(keys), shape)).astype(dtype)

    zeros = lambda n: jnp.zeros((n,), dtype)  # noqa: E731
    ones = lambda n: jnp.ones((n,), dtype)  # noqa: E731
    proj_sd = 0.02 / np.sqrt(2 * layers)
    blocks = [
        {
            "ln1": (ones(width), zeros(width)),
            "qkv": (normal((width, 3 * width)), zeros(3 * width)),
            "proj": (normal((width, width), proj_sd), zeros(width)),
            "ln2": (ones(width), zeros(width)),
            "fc": (normal((width, 4 * width)), zeros(4 * width)),
            "out": (normal((4 * width, width), proj_sd), zeros(width)),
        }
        for _ in range(layers)
    ]
    return {"wte": normal((vocab, width)), "wpe": normal((seq, width), 0.01), "blocks": blocks,
            "ln_f": (ones(width), zeros(width))}


def _layer_norm(x, p):
    g, b = p
    x = x.astype(jnp.float32)
    mu = jnp.mean(x, -1, keepdims=True)
    var = jnp.mean((x - mu) ** 2, -1, keepdims=True)
    return (x - mu) * jax.lax.rsqrt(var + 1e-5) * g.astype(jnp.float32) + b.astype(jnp.float32)


def _dense(x, p):
    w, b = p
    return jnp.dot(x.astype(BF16), w.astype(BF16), preferred_element_type=jnp.float32) + b.astype(jnp.float32)


def make_loss(heads):
    def loss_fn(params, tokens):
        """Mean next-token cross-entropy of ``tokens`` (batch, seq + 1)."""
        inp, target = tokens[:, :-1], tokens[:, 1:]
        bsz, seq = inp.shape
        x = params["wte"][inp].astype(jnp.float32) + params["wpe"][:seq].astype(jnp.float32)
        width = x.shape[-1]
        mask = jnp.tril(jnp.ones((seq, seq), bool))
        for blk in params["blocks"]:
            q, k, v = jnp.split(_dense(_layer_norm(x, blk["ln1"]), blk["qkv"]), 3, axis=-1)
            q, k, v = (t.reshape(bsz, seq, heads, width // heads).astype(BF16) for t in (q, k, v))
            att = jnp.einsum("bqhd,bkhd->bhqk", q, k, preferred_element_type=jnp.float32) / np.sqrt(width // heads)
            att = jax.nn.softmax(jnp.where(mask, att, -1e9), axis=-1)
            y = jnp.einsum("bhqk,bkhd->bqhd", att.astype(BF16), v, preferred_element_type=jnp.float32)
            x = x + _dense(y.reshape(bsz, seq, width), blk["proj"])
            x = x + _dense(jax.nn.gelu(_dense(_layer_norm(x, blk["ln2"]), blk["fc"])), blk["out"])
        x = _layer_norm(x, params["ln_f"])
        logits = jnp.dot(x.astype(BF16), params["wte"].astype(BF16).T, preferred_element_type=jnp.float32)
        logp = jax.nn.log_softmax(logits, axis=-1)
        return -jnp.mean(jnp.take_along_axis(logp, target[..., None], axis=-1))

    return loss_fn


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--width", type=int, default=768)
    ap.add_argument("--heads", type=int, default=12)
    ap.add_argument("--vocab", type=int, default=50257)
    ap.add_argument("--seq", type=int, default=512)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--steps", type=int, default=20, help="steps per timed round")
    ap.add_argument("--cost-only", action="store_true")
    ap.add_argument("--with-sgd", action="store_true", help="also the gradient with plain SGD (one more compilation)")
    ap.add_argument("--bf16-params", action="store_true", help="bfloat16 weights (IVON keeps a float32 state)")
    args = ap.parse_args()
    if args.width % args.heads:
        raise SystemExit(f"--width {args.width} must be a multiple of --heads {args.heads}")
    dtype = BF16 if args.bf16_params else jnp.float32
    params = init_lm(jax.random.key(0), args.vocab, args.width, args.layers, args.seq, dtype)
    tokens = jax.random.randint(jax.random.key(1), (args.batch, args.seq + 1), 0, args.vocab)
    loss_fn = make_loss(args.heads)
    n_params = sum(x.size for x in jax.tree.leaves(params))
    fns = adamw_steps(params, loss_fn, tokens, lr=3e-4, with_sgd=args.with_sgd)
    ivon = nb.ivon(0.1, ess=1e6, hess_init=0.1, weight_decay=1e-6)  # the step cost does not depend on the values
    fns["IVON step (1 sample)"] = (algorithm_step(ivon, loss_fn, tokens), (jnp.int32(0), ivon.init(params)))
    label = (f"transformer LM {args.layers} layers x {args.width} ({args.heads} heads), vocab {args.vocab}, "
             f"{n_params / 1e6:.1f}M weights ({jnp.dtype(dtype).name}), bf16 matmuls, batch {args.batch} x seq {args.seq}")
    report(fns, params, label, args.rounds, args.steps, not args.cost_only, width=24)


if __name__ == "__main__":
    main()
