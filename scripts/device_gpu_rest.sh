# One device call (one GPU): the CUDA-graph capture test, then the GPU tests from the EXL3
# fixture ladders on (the part of the suite the first call of session 5 did not reach), with
# per-test durations. On the device: source scripts/device_env.sh && bash scripts/device_gpu_rest.sh
set -o pipefail
timeout ${GRAPH_S:-120} python -m pytest -q -m gpu tests/gpu/test_cuda_graph_gpu.py -rf \
    --tb=short -s 2>&1 | tee $OUT/gpu_graph.log
STRATA_GPU_RESULTS=$OUT/gpu_results.jsonl timeout ${SUITE_S:-420} python -m pytest -q -m gpu \
    "tests/gpu/test_kernels_exl3_gpu.py::test_exl3_fixture_ladder_through_kernels" \
    "tests/gpu/test_kernels_exl3_gpu.py::test_bench_kernels_harness" \
    tests/gpu/test_kernels_fp8fp4_gpu.py tests/gpu/test_kernels_fused_ops_gpu.py \
    tests/gpu/test_loader_gpu.py --durations=20 -rf --tb=short 2>&1 | tee $OUT/gpu_suite.log
