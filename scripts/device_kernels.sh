# One device call for issue 5's numbers (bench/results/kernels.md). Ours is timed while
# exllamav3's extension builds in the background (nvcc loads the CPUs; graph-replayed kernels are
# timed on the GPU), then exllamav3's side runs alone (--peer-child appends each result to
# $OUT/peer.jsonl as measured, so a cut-short call keeps them), then the two are merged.
# On the device: STRATA_PEER=1 source scripts/device_env.sh && bash scripts/device_kernels.sh
set -o pipefail
args="--rows ${ROWS:-1,2,6} --rep ${REP:-50} ${EXTRA:-}"
(MAX_JOBS=12 timeout 400 python -c "from exllamav3.ext import exllamav3_ext; print('ext ok')" \
    > $OUT/peer_build.log 2>&1; echo "build rc $?" >> $OUT/peer_build.log) &
build=$!
timeout ${OURS_S:-250} python -m strata bench kernels $args --moe --no-peer \
    --json $OUT/kernels_ours.json 2>&1 | tee $OUT/kernels_ours.log
wait $build; tail -2 $OUT/peer_build.log
timeout ${PEER_S:-200} python -m strata.bench.kernels --peer-child $args --json $OUT/peer.jsonl
wc -l $OUT/peer.jsonl
python -m strata bench kernels --results $OUT/kernels_ours.json --peer-results $OUT/peer.jsonl \
    --json $OUT/kernels.json
