# One device call (nvidia-h200-x2) for CUDA graphs over two GPUs (issues 7 and 8), most
# valuable first, each step with its own timeout and tee'd to $OUT: (1) the exactness ladder
# (with the indexer's bounded pieces and radix top-k), the row kernel, the one-GPU graph tests,
# the fused small ops (the one-program expert grouping) and the grouped wo_a (EXL3 ladder);
# (2) every two-GPU test — modes × numerics × orders, graphs in tensor parallel and in the layer split
# (its hand-offs captured), the killed rank; (3) `bench decode` in the layer split on the
# fixture, eager against graphed; (4) the full-size synthetic over both GPUs, layer split,
# graphed (the published anchor is Layer+DSpark), with rank 0's step breakdown.
# On the device: source scripts/device_env.sh && bash scripts/device_graphs.sh
set -o pipefail
timeout ${T1:-200} python -m pytest -q -m gpu tests/gpu/test_cuda_parity.py \
    tests/gpu/test_cuda_graph_gpu.py tests/gpu/test_kernels_fused_ops_gpu.py \
    "tests/gpu/test_kernels_exl3_gpu.py::test_wo_a_groups_as_one_launch_equal_each_groups_linear" \
    "tests/gpu/test_kernels_exl3_gpu.py::test_exl3_fixture_ladder_through_kernels" \
    -rf --tb=short -s --durations=8 2>&1 | tee $OUT/gpu_tests.log
timeout ${T2:-240} python -m pytest -q -m gpu tests/gpu/test_parallel_gpu.py -rf --tb=short \
    -s --durations=12 2>&1 | tee $OUT/parallel_tests.log
timeout ${T3:-60} python -m strata bench decode --parallel layer --devices cuda:0,cuda:1 \
    --modes plain,plain+graphs,oracle,oracle+graphs --tokens 32 --runs 1 --warmup 1 --quiet \
    --json $OUT/decode_layer_graphs.json 2>&1 | tee $OUT/decode_layer_graphs.log
timeout ${T4:-130} python -m strata bench synthetic --parallel layer --devices cuda:0,cuda:1 \
    --modes plain+graphs,oracle+graphs,oracle:2.9+graphs --tokens 16 --runs 1 --warmup 0 \
    --breakdown 2 --json $OUT/synthetic_layer_graphs.json 2>&1 \
    | tee $OUT/synthetic_layer_graphs.log
