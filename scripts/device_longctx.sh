# One device call for issue 8's long-context prefill: chunked prefill (chunks of 4,096, the
# exact decoder skip) of PREFILL tokens (default 128K then 512K), reporting tok/s and peak
# device (rank 0) and host memory, with a progress line per 32,768 tokens fed (a run cut short
# keeps its rate). Default: the synthetic V4.1 with all 40 layers over both GPUs of
# nvidia-h200-x2 (layer split: each rank holds its layers and their caches, as the memory plan
# assumes). LAYERS=0-3,20-23: one GPU holding those layers instead. Session 9: 524K at full
# size in 177.5 s (PREFILL=512K T1=440); at its ~10.5 s per 32K piece, PREFILL=1M T1=560
# needs ~370 s plus the 67 s build.
# bench/results/memory_plan.md has the plan these are checked against.
# On the device: source scripts/device_env.sh && bash scripts/device_longctx.sh
set -o pipefail
if [ -n "$LAYERS" ]; then
    where="--device cuda:0 --layers $LAYERS"
else
    where="--parallel layer --devices cuda:0,cuda:1"
fi
timeout ${T1:-560} python -m strata bench synthetic $where \
    --modes plain --tokens 4 --runs 1 --warmup 0 --prefill ${PREFILL:-128K,512K} \
    --prefill-skip on --prefill-chunk 4096 --json $OUT/synthetic_prefill_long.json 2>&1 \
    | tee $OUT/synthetic_prefill_long.log
