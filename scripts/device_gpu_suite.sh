# One device call (one GPU) for the GPU suite after CPU-side changes: the CUDA-graph capture
# test first (the newest mechanism), then the rest of tests/gpu but the two-GPU file, then the
# decode-step breakdown with cProfile (where the host time goes). Tee'd to $OUT as it runs.
# On the device: source scripts/device_env.sh && bash scripts/device_gpu_suite.sh
set -o pipefail
timeout ${GRAPH_S:-120} python -m pytest -q -m gpu tests/gpu/test_cuda_graph_gpu.py -rf \
    --tb=short -s 2>&1 | tee $OUT/gpu_graph.log
STRATA_GPU_RESULTS=$OUT/gpu_results.jsonl timeout ${SUITE_S:-480} python -m pytest -q -m gpu \
    tests/gpu --ignore=tests/gpu/test_parallel_gpu.py --ignore=tests/gpu/test_cuda_graph_gpu.py \
    -rf --tb=line --durations=15 2>&1 | tee $OUT/gpu_suite.log
timeout ${SYN_S:-150} python -m strata bench synthetic --device cuda:0 --layers 0-1,20-21 \
    --modes plain --tokens 8 --runs 1 --warmup 1 --breakdown 3 \
    --json $OUT/breakdown.json 2>&1 | tee $OUT/breakdown.log
