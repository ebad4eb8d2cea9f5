# One device call for the CUDA EXL3 kernel (strata/kernels/exl3_mma.cu) after a change to it:
# (1) its GPU tests — bits against the Triton kernels for linears and MoE, the early launch,
# the graphs — then (2) an A/B of the synthetic V4.1's graphed decode (half the layers, on
# cuda:0) with the CUDA kernel and without it (--no-mma), each mode twice. On a two-GPU
# machine, with PARALLEL=1, also (3) the two-GPU tests and (4) the tensor-parallel synthetic.
# Every step has its own timeout and tees to $OUT as it runs.
# On the device: source scripts/device_env.sh && bash scripts/device_mma.sh
set -o pipefail
timeout ${T1:-200} python -m pytest -q -m gpu -rf --tb=short \
    tests/gpu/test_kernels_exl3_gpu.py -k "mma or moe or early_launch or wgmma" \
    tests/gpu/test_cuda_graph_gpu.py 2>&1 | tail -30 | tee $OUT/mma_tests.log
for m in "" --no-mma; do
  timeout ${T2:-150} python -m strata bench synthetic --device cuda:0 --layers 0-9,20-29 \
      --modes plain+graphs,oracle+graphs,oracle:2.9+graphs --tokens 24 --runs 2 --warmup 1 \
      $m --json $OUT/synthetic${m:-_mma}.json 2>&1 | grep -E "^measured|identical|^mode|graphs " \
      | tee $OUT/synthetic${m:-_mma}.log
done
[ -z "$PARALLEL" ] && exit 0
timeout ${T3:-200} python -m pytest -q -m gpu -rf --tb=short tests/gpu/test_parallel_gpu.py \
    2>&1 | tail -15 | tee $OUT/parallel_tests.log
timeout ${T4:-170} python -m strata bench synthetic --parallel tp --devices cuda:0,cuda:1 \
    --modes plain+graphs,oracle+graphs,oracle:2.9+graphs --tokens 16 --runs 1 --warmup 1 \
    --breakdown 2 --json $OUT/synthetic_tp.json 2>&1 | grep -v CUDAGraph.cpp \
    | grep -v "Warning: \[PG" > $OUT/synthetic_tp.log
