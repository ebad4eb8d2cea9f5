# The last device call of session 5 (nvidia-h200-x2), most valuable first, each step with its
# own timeout and tee'd to $OUT: (1) the graph tests (capture/replay, graphed decode, verify
# windows, draft) and the row kernel's exactness on one GPU; (2) the synthetic V4.1, 20
# layers on one GPU, eager against graphed decode with the step breakdown; (3) the two-GPU
# tests: tensor parallel with graphs, the killed rank, tp modes; (4) `bench decode` in tensor
# parallel on the fixture, eager against graphed.
# On the device: source scripts/device_env.sh && bash scripts/device_session5_final.sh
set -o pipefail
timeout ${T1:-120} python -m pytest -q -m gpu tests/gpu/test_cuda_graph_gpu.py \
    tests/gpu/test_cuda_parity.py -k "graph or rowwise or ladder" -rf \
    --tb=short -s --durations=8 2>&1 | tee $OUT/gpu_tests.log
timeout ${T2:-100} python -m strata bench synthetic --device cuda:0 --layers 0-9,20-29 \
    --modes plain,plain+graphs,oracle+graphs,oracle:2.9+graphs --tokens 24 --runs 1 \
    --warmup 1 --breakdown 3 --json $OUT/synthetic_1gpu_graphs.json 2>&1 \
    | tee $OUT/synthetic_1gpu_graphs.log
timeout ${T3:-100} python -m pytest -q -m gpu tests/gpu/test_parallel_gpu.py -k \
    "tp_graphs or killed or vendor-tp-01" -rf --tb=short -s 2>&1 | tee $OUT/parallel_tests.log
timeout ${T4:-45} python -m strata bench decode --parallel tp --devices cuda:0,cuda:1 \
    --modes plain,plain+graphs,oracle,oracle+graphs --tokens 32 --runs 1 --warmup 1 --quiet \
    --json $OUT/decode_tp_graphs.json 2>&1 | tee $OUT/decode_tp_graphs.log
