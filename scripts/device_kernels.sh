# One device call for issue 5's numbers (bench/results/kernels.md). exllamav3's extension builds in
# the background while the fused-op GPU tests run; then exllamav3's side runs alone (--peer-child,
# each result appended to $OUT/peer.jsonl as measured, so a cut-short call keeps them), then ours
# on the same seeded tensors with that file merged. Everything is tee'd to $OUT as it happens.
# On the device: STRATA_PEER=1 source scripts/device_env.sh && bash scripts/device_kernels.sh
set -o pipefail
args="--rows ${ROWS:-1,2,6} --rep ${REP:-50} ${EXTRA:-}"
(MAX_JOBS=16 timeout 330 python -c "from exllamav3.ext import exllamav3_ext; print('ext ok')" \
    > $OUT/peer_build.log 2>&1; echo "build rc $?" >> $OUT/peer_build.log) &
build=$!
timeout 150 python -m pytest -q -m gpu tests/gpu/test_kernels_fused_ops_gpu.py 2>&1 | tee $OUT/gpu_fused.log
wait $build; tail -3 $OUT/peer_build.log
timeout ${PEER_S:-150} python -m strata.bench.kernels --peer-child $args --json $OUT/peer.jsonl
wc -l $OUT/peer.jsonl
timeout ${OURS_S:-200} strata bench kernels $args --moe --peer-results $OUT/peer.jsonl \
    --json $OUT/kernels.json 2>&1 | tee $OUT/kernels.log
