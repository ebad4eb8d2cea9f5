# Device calls for the CUDA EXL3 kernel (strata/kernels/exl3_mma.cu) after a change to it.
# STEP=check (default): (1) its GPU tests — bits against the Triton kernels for linears and MoE,
# the early launch — and the CUDA-graph and fused-op tests; (2) an A/B of the synthetic
# V4.1's graphed decode (LAYERS, default 0-4,20-24): as configured (cuda), without the small
# kernels' early launch (nopdl: STRATA_PDL=0, strata/kernels/pdl.py) and Triton only
# (--no-mma), each mode twice (the tokens' sha256 must match across variants); (3) the kernels
# alone: scripts/exl3_variants.py (V4.1 shapes at 1 and 6 rows, the MoE gate + up and down for 1 and
# 6 tokens; bits compared), also with fewer and more splits a weight (TARGET_PROGRAMS
# 256 / 1024 against 512: other summation orders, so other bits). With two GPUs visible the
# tests run on the second while the A/B times on the first (graph replays: the tests' host
# work does not reach the timed GPU).
# STEP=parallel (two GPUs): the two-GPU tests (NO_TESTS=1: not), then the synthetic over both
# GPUs (PAR: tp and/or layer) with a warm-up and its breakdown.
# AB: the A/B's variants (default cuda nopdl triton); NO_VARIANTS=1 skips (3), NO_TESTS=1 (1).
# Every step has its own timeout and writes to $OUT as it runs.
# On the device: source scripts/device_env.sh && STEP=... bash scripts/device_mma.sh
set -o pipefail
ngpu=$(python -c "import torch; print(torch.cuda.device_count())")
second=$([ "$ngpu" -ge 2 ] && echo 1 || echo 0)

tests() {
  CUDA_VISIBLE_DEVICES=$second timeout ${T1:-300} python -m pytest -q -m gpu -rf --tb=short \
      tests/gpu/test_kernels_exl3_gpu.py -k "mma or moe or early_launch or wgmma" \
      > $OUT/mma_tests.log 2>&1
  CUDA_VISIBLE_DEVICES=$second timeout ${T1G:-200} python -m pytest -q -m gpu -rf --tb=short \
      tests/gpu/test_cuda_graph_gpu.py tests/gpu/test_kernels_fused_ops_gpu.py \
      > $OUT/graph_tests.log 2>&1
}

ab() {  # one variant of the synthetic A/B: cuda | nopdl | triton
  env $([ $1 = nopdl ] && echo STRATA_PDL=0) timeout ${T2:-150} python -m strata bench \
      synthetic --device cuda:${2:-0} --layers ${LAYERS:-0-4,20-24} \
      --modes plain+graphs,oracle+graphs,oracle:2.9+graphs --tokens 24 --runs 2 --warmup 1 \
      $([ $1 = triton ] && echo --no-mma) --json $OUT/synthetic_$1.json 2>&1 \
      | grep -E "^measured|identical|^mode|graphs |Error|error" > $OUT/synthetic_$1.log
}

if [ "${STEP:-check}" = check ]; then
  if [ -n "$NO_TESTS" ]; then
    for v in ${AB:-cuda nopdl triton}; do ab $v; done
  elif [ "$second" = 1 ]; then
    tests &
    for v in ${AB:-cuda nopdl triton}; do ab $v; done
    wait
  else
    tests; for v in ${AB:-cuda nopdl triton}; do ab $v; done
  fi
  [ -n "$NO_TESTS" ] || tail -n 4 $OUT/mma_tests.log $OUT/graph_tests.log
  cat $OUT/synthetic_*.log
  [ -n "$NO_VARIANTS" ] && exit 0
  timeout ${T3:-200} python scripts/exl3_variants.py --linear-only \
      --variants "cuda:;t256:TARGET_PROGRAMS=256;t1024:TARGET_PROGRAMS=1024;triton:MMA=0" \
      --json $OUT/variants.json > $OUT/variants.log 2>&1
  tail -40 $OUT/variants.log
elif [ "$STEP" = parallel ]; then
  [ -z "$NO_TESTS" ] && timeout ${T4:-200} python -m pytest -q -m gpu -rf --tb=short \
      tests/gpu/test_parallel_gpu.py > $OUT/parallel_tests.log 2>&1
  [ -z "$NO_TESTS" ] && tail -8 $OUT/parallel_tests.log
  for p in ${PAR:-tp}; do
    timeout ${T5:-200} python -m strata bench synthetic --parallel $p --devices cuda:0,cuda:1 \
        --modes plain+graphs,oracle+graphs,oracle:2.9+graphs --tokens 16 --runs 2 --warmup 1 \
        --breakdown 2 --json $OUT/synthetic_$p.json 2>&1 | grep -v CUDAGraph.cpp \
        | grep -v "Warning: \[PG" > $OUT/synthetic_$p.log
    grep -E "^measured|identical|^mode|graphs " $OUT/synthetic_$p.log
  done
fi
