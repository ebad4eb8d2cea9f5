# One device call (one GPU) for the kernel choices not yet measured, each step with its own
# timeout and written to $OUT as it runs: (1) the GPU tests they touch — the CUDA prefill
# kernel against the Triton split loop (exl3_mma_prefill, session 16), the decode kernel at
# K 5.5 / 6 (the head), the grouped decode kernel and the prefill step against single
# linears; (2) scripts/probe_moe_prefill.py (the prefill kernel against the split loop at a
# 4,096-token chunk, bits compared); (3) scripts/probe_mhc_tiles.py for hc_mix's row blocks
# of 16 and 32 at decode and prefill sizes. Then measure the model
# (`bash scripts/device_perf.sh`).
# On the device: source scripts/device_env.sh && bash scripts/device_probes.sh
set -o pipefail
timeout ${T1:-240} python -m pytest -q -m gpu -rf --tb=short tests/gpu/test_kernels_exl3_gpu.py \
    -k "prefill or moe_gives or (mma_kernel_gives and (5.5 or 6-3inst))" \
    > $OUT/probe_tests.log 2>&1
tail -6 $OUT/probe_tests.log
timeout ${T2:-120} python scripts/probe_moe_prefill.py 2>&1 | tee $OUT/probe_moe_prefill.log
TS=1,6,4096 ROWS=16,32 CHUNKS=256 timeout ${T3:-120} python scripts/probe_mhc_tiles.py 2>&1 \
    | tee $OUT/probe_mhc_tiles.log
