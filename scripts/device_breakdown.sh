# One device call (nvidia-h200-x2) of session 5: the killed-rank test (the one two-GPU test the
# previous call did not reach), then the decode-step breakdown eager and graphed on the
# synthetic V4.1 (4 layers, one GPU), every kernel counted (Triton's and a graph's included).
# On the device: source scripts/device_env.sh && bash scripts/device_breakdown.sh
set -o pipefail
timeout ${KILL_S:-100} python -m pytest -q -m gpu \
    tests/gpu/test_parallel_gpu.py::test_killed_rank_stops_rank0 -rf --tb=short -s 2>&1 \
    | tee $OUT/killed_rank.log
timeout ${SYN_S:-200} python -m strata bench synthetic --device cuda:0 --layers 0-1,20-21 \
    --modes plain,graphs --tokens 16 --runs 1 --warmup 1 --breakdown 3 \
    --json $OUT/breakdown_graphs.json 2>&1 | tee $OUT/breakdown_graphs.log
