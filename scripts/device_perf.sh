# One device call (one GPU) for issue 8's single-GPU figures and issue 5's re-measure: the
# synthetic V4.1 with half the layers (an encoder and a decoder half) — decode modes, the
# per-step breakdown, prefill with the decoder skip — then the EXL3 kernels (ours).
# On the device: source scripts/device_env.sh && bash scripts/device_perf.sh
set -o pipefail
timeout ${SYN_S:-300} python -m strata bench synthetic --device cuda:0 --layers 0-9,20-29 \
    --modes plain,oracle,oracle:2.9 --tokens 16 --runs 1 --warmup 1 --breakdown 4 \
    --prefill ${PREFILL:-8K,32K} --prefill-skip on \
    --json $OUT/synthetic_1gpu.json 2>&1 | tee $OUT/synthetic_1gpu.log
timeout ${KERNELS_S:-120} python -m strata bench kernels --no-peer --rows 1,2,6,512 --rep 50 \
    --shapes expert_w13,wq_b,head --ks 2.5 --moe --json $OUT/kernels_after.json 2>&1 \
    | tee $OUT/kernels_after.log
