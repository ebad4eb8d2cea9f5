# One device call (nvidia-h200-x2) of session 5: the CUDA-graph tests (capture/replay, graphed
# decode across a bucket edge) and the fixed RoPE test on one GPU, the two-GPU tests in both
# orders (killed rank included), then graphed against eager plain decode on the synthetic
# V4.1 (20 layers, one GPU). On the device: source scripts/device_env.sh && bash scripts/device_graphs.sh
set -o pipefail
timeout ${GRAPH_S:-150} python -m pytest -q -m gpu tests/gpu/test_cuda_graph_gpu.py \
    "tests/gpu/test_kernels_fused_ops_gpu.py::test_rope_equals_the_torch_code" -rf \
    --tb=short -s 2>&1 | tee $OUT/gpu_graph.log
timeout ${TESTS_S:-200} python -m pytest -q -m gpu tests/gpu/test_parallel_gpu.py -rf \
    --tb=short --durations=10 2>&1 | tee $OUT/parallel_tests.log
timeout ${SYN_S:-150} python -m strata bench synthetic --device cuda:0 --layers 0-9,20-29 \
    --modes plain,graphs --tokens 32 --runs 2 --warmup 1 \
    --json $OUT/synthetic_graphs.json 2>&1 | tee $OUT/synthetic_graphs.log
