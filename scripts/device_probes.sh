# One device call (one GPU) for session 15's unmeasured choices, each step with its own
# timeout and written to $OUT as it runs: (1) the GPU tests they touch — the grouped MoE's
# split loop at expert tiles of 64 and 128 pairs against the single linear, the fused ops
# (hc_mix's tensor-core products included), the row kernel's products and the parity
# ladders; (2) scripts/probe_moe_prefill.py (the MoE tile and register cap at a 4,096-token
# chunk, bits compared); (3) scripts/probe_mhc_tiles.py (hc_mix's chunking for decode and
# prefill). Then set exl3.MOE_LOOP_BLOCK_M / mhc.MIX_CHUNK from (2)–(3) and measure the model
# (`bash scripts/device_perf.sh`).
# On the device: source scripts/device_env.sh && bash scripts/device_probes.sh
set -o pipefail
timeout ${T1:-200} python -m pytest -q -m gpu -rf --tb=short \
    "tests/gpu/test_kernels_exl3_gpu.py::test_moe_prefill_step_equals_single_linear" \
    tests/gpu/test_kernels_fused_ops_gpu.py \
    "tests/gpu/test_cuda_parity.py::test_rowwise_split_and_row_tiles_compiled" \
    "tests/gpu/test_cuda_parity.py::test_cuda_parity_ladder" > $OUT/probe_tests.log 2>&1
tail -4 $OUT/probe_tests.log
timeout ${T2:-150} python scripts/probe_moe_prefill.py 2>&1 | tee $OUT/probe_moe_prefill.log
timeout ${T3:-150} python scripts/probe_mhc_tiles.py 2>&1 | tee $OUT/probe_mhc_tiles.log
