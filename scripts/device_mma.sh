# One device call for the CUDA EXL3 kernel (strata/kernels/exl3_mma.cu) after a change to it:
# (1) its GPU tests — bits against the Triton kernels for linears and MoE, the XS switch, the
# early launch — and the CUDA-graph tests; (2) an A/B of the synthetic V4.1's graphed decode
# (half the layers, on cuda:0): the CUDA kernel, the same with XS=1 (STRATA_EXL3_MMA_XS), and
# Triton only (--no-mma), each mode twice; (3) the kernels alone: scripts/exl3_variants.py
# (V4.1 shapes at 1 and 6 rows, the MoE gate + up for 1 and 6 tokens; bits compared). On a
# two-GPU machine, with PARALLEL=1, also (4) the two-GPU tests and (5) the tensor-parallel
# synthetic. Every step has its own timeout and tees to $OUT as it runs.
# On the device: source scripts/device_env.sh && bash scripts/device_mma.sh
set -o pipefail
timeout ${T1:-240} python -m pytest -q -m gpu -rf --tb=short \
    "tests/gpu/test_kernels_exl3_gpu.py" -k "mma or moe or early_launch or wgmma" \
    2>&1 | tail -20 | tee $OUT/mma_tests.log
timeout ${T1G:-200} python -m pytest -q -m gpu -rf --tb=short tests/gpu/test_cuda_graph_gpu.py \
    2>&1 | tail -12 | tee $OUT/graph_tests.log
for v in cuda xs triton; do
  env $([ $v = xs ] && echo STRATA_EXL3_MMA_XS=1) timeout ${T2:-150} python -m strata bench \
      synthetic --device cuda:0 --layers 0-9,20-29 \
      --modes plain+graphs,oracle+graphs,oracle:2.9+graphs --tokens 24 --runs 2 --warmup 1 \
      $([ $v = triton ] && echo --no-mma) --json $OUT/synthetic_$v.json 2>&1 \
      | grep -E "^measured|identical|^mode|graphs |Error|error" | tee $OUT/synthetic_$v.log
done
timeout ${T3:-150} python scripts/exl3_variants.py --linear-only \
    --variants "cuda:;xs:MMA_XS=1;triton:MMA=0" --json $OUT/variants.json 2>&1 | tail -40 \
    | tee $OUT/variants.log
[ -z "$PARALLEL" ] && exit 0
timeout ${T4:-200} python -m pytest -q -m gpu -rf --tb=short tests/gpu/test_parallel_gpu.py \
    2>&1 | tail -15 | tee $OUT/parallel_tests.log
timeout ${T5:-170} python -m strata bench synthetic --parallel tp --devices cuda:0,cuda:1 \
    --modes plain+graphs,oracle+graphs,oracle:2.9+graphs --tokens 16 --runs 1 --warmup 1 \
    --breakdown 2 --json $OUT/synthetic_tp.json 2>&1 | grep -v CUDAGraph.cpp \
    | grep -v "Warning: \[PG" > $OUT/synthetic_tp.log
