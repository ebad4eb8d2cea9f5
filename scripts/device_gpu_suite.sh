# One device call (one GPU) for the GPU suite after CPU-side changes: the CUDA-graph tests
# first (the newest mechanism), then the rest of tests/gpu but the two-GPU file (~8 minutes in
# all on an H200). Tee'd to $OUT as it runs.
# On the device: source scripts/device_env.sh && bash scripts/device_gpu_suite.sh
set -o pipefail
timeout ${GRAPH_S:-120} python -m pytest -q -m gpu tests/gpu/test_cuda_graph_gpu.py -rf \
    --tb=short -s 2>&1 | tee $OUT/gpu_graph.log
STRATA_GPU_RESULTS=$OUT/gpu_results.jsonl timeout ${SUITE_S:-480} python -m pytest -q -m gpu \
    tests/gpu --ignore=tests/gpu/test_parallel_gpu.py --ignore=tests/gpu/test_cuda_graph_gpu.py \
    -rf --tb=line --durations=15 2>&1 | tee $OUT/gpu_suite.log
