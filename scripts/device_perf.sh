# One device call (one GPU) for issue 8's single-GPU figures, most valuable first, each step
# with its own timeout and tee'd to $OUT: (1) the GPU tests that check the row kernel's tile
# path compiled (ref-closeness and bit invariance), the exactness ladder, the graphs, the fused
# small ops and the grouped wo_a; (2) the synthetic V4.1 with half the layers (an encoder and a
# decoder half), graphed decode modes against session 7's 53.0 / 127.2 / 64.8 tok/s, with the
# step breakdown; (3) a 64K prefill's chunk times and one late chunk's kernel profile against
# session 7's 59.4 s (row kernel 2.05 of 2.55 s per chunk); (4) the row kernel against cuBLAS at
# the model's shapes (TFLOP/s).
# On the device: source scripts/device_env.sh && bash scripts/device_perf.sh
set -o pipefail
timeout ${T1:-240} python -m pytest -q -m gpu tests/gpu/test_cuda_parity.py \
    tests/gpu/test_cuda_graph_gpu.py tests/gpu/test_kernels_fused_ops_gpu.py \
    "tests/gpu/test_kernels_exl3_gpu.py::test_wo_a_groups_as_one_launch_equal_each_groups_linear" \
    "tests/gpu/test_kernels_exl3_gpu.py::test_exl3_fixture_ladder_through_kernels" \
    -rf --tb=short --durations=8 2>&1 | tee $OUT/gpu_tests.log
timeout ${T2:-150} python -m strata bench synthetic --device cuda:0 --layers 0-9,20-29 \
    --modes plain+graphs,oracle+graphs,oracle:2.9+graphs --tokens 24 --runs 1 --warmup 1 \
    --breakdown 2 --json $OUT/synthetic_1gpu.json 2>&1 | grep -v CUDAGraph.cpp \
    | tee $OUT/synthetic_1gpu.log
timeout ${T3:-150} python scripts/device_diag.py prefill 0-9,20-29 65536 4096 2>&1 \
    | tail -60 | tee $OUT/prefill_64k.log
timeout ${T4:-90} python -m strata bench kernels --no-peer --rowwise --shapes expert_w13 \
    --ks 2.5 --rows 1,6 --rep 50 --json $OUT/kernels_rowwise.json 2>&1 | tail -20 \
    | tee $OUT/kernels_rowwise.log
