# One device call (one GPU) for issue 8's single-GPU figures: the synthetic V4.1 with half the
# layers (an encoder and a decoder half) — graphed decode modes against session 6's 48.4 /
# 119.1 / 61.1 tok/s (after the grouped wo_a, the one-program expert grouping and the radix
# top-k), the per-step breakdown, and prefill with the decoder skip (queries in pieces) —
# then the EXL3 kernels (ours).
# On the device: source scripts/device_env.sh && bash scripts/device_perf.sh
set -o pipefail
timeout ${SYN_S:-300} python -m strata bench synthetic --device cuda:0 --layers 0-9,20-29 \
    --modes plain+graphs,oracle+graphs,oracle:2.9+graphs --tokens 24 --runs 1 --warmup 1 \
    --breakdown 3 --prefill ${PREFILL:-8K,32K} --prefill-skip on \
    --json $OUT/synthetic_1gpu.json 2>&1 | tee $OUT/synthetic_1gpu.log
timeout ${KERNELS_S:-120} python -m strata bench kernels --no-peer --rows 1,2,6,512 --rep 50 \
    --shapes expert_w13,wq_b,head --ks 2.5 --moe --json $OUT/kernels_after.json 2>&1 \
    | tee $OUT/kernels_after.log
