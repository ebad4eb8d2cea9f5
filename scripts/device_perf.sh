# One device call (one GPU) for issue 8's single-GPU figures, most valuable first, each step
# with its own timeout and tee'd to $OUT: (1) the GPU tests of the EXL3 CUDA kernel and early
# launch, the fused kernels, the exactness ladders and the graphs (-v: each result streams, a
# cut run keeps them); (2) the synthetic V4.1 with LAYERS (default 0-4,20-24: five encoder and
# five decoder layers): graphed decode modes with the step breakdown, and prefills of PREFILLS
# (default 32K; each after an untimed warm-up) with and without the decoder skip (logits
# compared), the breakdowns (plain steps, DSpark windows, and a 4,096-row prefill chunk at the
# prompt's end, encoder-only and full; NOMMA=1: the Triton EXL3 kernels only, --no-mma); (3)
# with KERNELS=1, the row kernel, the indexer's scores and hc_mix against cuBLAS at the model's
# shapes; (4) a 128K prefill. TOKENS: decoded per run (default 96; 24 up to session 23).
# Defaults fit one 600 s call without (3). Figures to compare with: performance.md, the latest
# session's section. On the device: source scripts/device_env.sh && bash scripts/device_perf.sh
set -o pipefail
timeout ${T1:-240} python -m pytest -v -m gpu \
    "tests/gpu/test_kernels_exl3_gpu.py::test_the_mma_kernel_gives_the_triton_kernels_bits" \
    "tests/gpu/test_kernels_exl3_gpu.py::test_the_early_launch_gives_plain_orders_bits_eager_and_graphed" \
    "tests/gpu/test_kernels_exl3_gpu.py::test_moe_grouped_equals_single_linear" \
    tests/gpu/test_kernels_fused_ops_gpu.py \
    tests/gpu/test_cuda_parity.py \
    tests/gpu/test_cuda_graph_gpu.py \
    "tests/gpu/test_kernels_exl3_gpu.py::test_exl3_fixture_ladder_through_kernels" \
    -rf --tb=short --durations=8 2>&1 | tee $OUT/gpu_tests.log
timeout ${T2:-250} python -m strata bench synthetic --device cuda:0 --layers ${LAYERS:-0-4,20-24} \
    --modes plain+graphs,oracle+graphs,oracle:2.9+graphs --tokens ${TOKENS:-96} --runs 1 --warmup 1 \
    --breakdown 2 --prefill ${PREFILLS:-32K} --prefill-skip both --prefill-chunk 4096 \
    ${NOMMA:+--no-mma} --json $OUT/synthetic_1gpu.json 2>&1 | grep -v CUDAGraph.cpp \
    | tee $OUT/synthetic_1gpu.log
[ -z "$KERNELS" ] || timeout ${T3:-90} python -m strata bench kernels --no-peer --rowwise \
    --shapes expert_w13 \
    --ks 2.5 --rows 1 --rep 50 --json $OUT/kernels_rowwise.json 2>&1 | tail -24 \
    | tee $OUT/kernels_rowwise.log
timeout ${T4:-90} python -m strata bench synthetic --device cuda:0 --layers ${LAYERS:-0-4,20-24} \
    --modes plain --tokens 2 --runs 1 --warmup 0 --prefill 128K --prefill-skip on \
    --prefill-chunk 4096 --json $OUT/prefill_128k.json 2>&1 | tee $OUT/prefill_128k.log
