#!/usr/bin/env bash
# Issue 26 on a GPU: IVON and the Lie-group rules against optax.adamw, per step (median of alternating rounds) and
# in XLA's bytes accessed (passes over the parameters), on
#   * MLP 784-1024-1024-10 (1.9M weights), batch 256
#   * MLP 3072-4096-4096-4096-1000 (50.2M weights), batch 512
#   * a GPT-2-small-shaped transformer LM (124M weights, bf16 matmuls, synthetic tokens), batch 8 x seq 512:
#     IVON vs AdamW only
# Assumes python3 imports jax (CUDA) and numpyro_blr (run from the repository root; PYTHONPATH is extended with it).
# Every command runs under `timeout`; the whole script stays under 7 minutes (the limits below add up to 420 s).
# Logs go to "$OUT/<name>.log", one line per command to "$OUT/summary.txt", and all logs are printed at the end.
#
#   OUT=/tmp/out bash bench/gpu_issue26.sh             # the GPU run
#   QUICK=1 OUT=/tmp/out bash bench/gpu_issue26.sh     # tiny sizes: a check of the script itself (CPU, ~1-2 min)
set -u
cd "$(dirname "$0")/.."
OUT="${OUT:-/tmp/gpu_issue26}"
mkdir -p "$OUT"
export PYTHONPATH="$(pwd)${PYTHONPATH:+:$PYTHONPATH}"
PY="${PYTHON:-python3}"
: > "$OUT/summary.txt"

if [ "${QUICK:-0}" = "1" ]; then
  MLP1="32,64,64,10"; B1=16; MLP2="48,96,96,96,20"; B2=32
  TF="--layers 2 --width 64 --heads 4 --vocab 256 --seq 32 --batch 2"
  R1="--rounds 2 --steps 5"; R2="--rounds 2 --steps 5"; RT="--rounds 2 --steps 3"
else
  MLP1="784,1024,1024,10"; B1=256; MLP2="3072,4096,4096,4096,1000"; B2=512
  TF="--layers 12 --width 768 --heads 12 --vocab 50257 --seq 512 --batch 8"
  # rounds x steps: ~1-2 s of stepping per candidate on an H100 (AdamW: ~0.15 ms at 1.9M, ~1 ms at 50M, ~60 ms at 124M)
  R1="--rounds 7 --steps 300"; R2="--rounds 7 --steps 100"; RT="--rounds 5 --steps 10"
fi

run() {  # run NAME LIMIT_S CMD...: the command's output in $OUT/NAME.log, its exit status in the summary
  local name="$1" limit="$2"; shift 2
  local t0=$SECONDS
  timeout "$limit" "$@" > "$OUT/$name.log" 2>&1
  local rc=$?
  echo "$name: rc=$rc ($((SECONDS - t0)) s, limit $limit s)$([ $rc = 124 ] && echo ' TIMED OUT')" | tee -a "$OUT/summary.txt"
}

run env 20 "$PY" -c "import jax, jaxlib, numpyro, optax, numpyro_blr; print(jax.__version__, jaxlib.__version__, numpyro.__version__, optax.__version__); print(jax.devices())"
run ivon_mlp_1.9M 45 "$PY" bench/bench_ivon.py --sizes "$MLP1" --batch "$B1" $R1 --no-digits
run liegroup_mlp_1.9M 60 "$PY" bench/bench_liegroup.py --sizes "$MLP1" --batch "$B1" $R1 --no-student-t --no-digits
run ivon_mlp_50M 50 "$PY" bench/bench_ivon.py --sizes "$MLP2" --batch "$B2" $R2 --no-digits
run liegroup_mlp_50M 65 "$PY" bench/bench_liegroup.py --sizes "$MLP2" --batch "$B2" $R2 --no-student-t --no-digits
run transformer_124M 90 "$PY" bench/transformer_lm.py $TF $RT
# the network rows' quick tests on the accelerator (float32 there); last, so that the figures come first. In one
# process they took over 90 s on an H200 (compilation); in 6, with each process allocating GPU memory as it needs it,
# tests/rows, tests/rules and tests/svi took 50 s (stop 44)
[ "${QUICK:-0}" = "1" ] || XLA_PYTHON_CLIENT_PREALLOCATE=false run tests_rows 90 "$PY" -m pytest -q -n 6 \
  --dist loadfile -m "not slow" tests/rows -p no:cacheprovider

for f in "$OUT"/summary.txt "$OUT"/env.log "$OUT"/ivon_*.log "$OUT"/liegroup_*.log "$OUT"/transformer_*.log "$OUT"/tests_*.log; do
  echo "===== $f"; tail -n 25 "$f"
done
