# One device call (nvidia-h200-x2) for issue 8's long-context prefills: the synthetic V4.1 with
# all 40 layers over both GPUs (layer split: each rank holds its layers and their caches, as
# the memory plan assumes), chunked prefill with the exact decoder skip at 128K and 524,288
# tokens, reporting tok/s and peak device (rank 0) and host memory, with a progress line per
# 32,768 tokens fed (a run cut short keeps its rate). bench/results/memory_plan.md
# has the plan these are checked against.
# On the device: source scripts/device_env.sh && bash scripts/device_longctx.sh
set -o pipefail
timeout ${T1:-560} python -m strata bench synthetic --parallel layer --devices cuda:0,cuda:1 \
    --modes plain --tokens 4 --runs 1 --warmup 0 --prefill ${PREFILL:-128K,512K} \
    --prefill-skip on --prefill-chunk 4096 --json $OUT/synthetic_prefill_long.json 2>&1 \
    | tee $OUT/synthetic_prefill_long.log
