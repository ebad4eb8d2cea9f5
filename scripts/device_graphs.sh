# One device call (nvidia-h200-x2) for the CUDA graphs (issues 7 and 8), most valuable first,
# each step with its own timeout and tee'd to $OUT: (1) the row kernel's exactness, the graph
# tests and the exactness ladder on one GPU; (2) the two-GPU tests of tensor parallel with
# graphs and the killed rank under NCCL; (3) the synthetic V4.1, 20 layers on one GPU, eager
# against graphed with the step breakdown; (4) `bench decode` in tensor parallel on the
# fixture, eager against graphed; (5) the full-size synthetic over both GPUs, tp, graphed.
# On the device: source scripts/device_env.sh && bash scripts/device_graphs.sh
set -o pipefail
timeout ${T1:-150} python -m pytest -q -m gpu tests/gpu/test_cuda_parity.py \
    tests/gpu/test_cuda_graph_gpu.py -k "rowwise or graph or ladder" -rf --tb=short -s \
    --durations=8 2>&1 | tee $OUT/gpu_tests.log
timeout ${T2:-150} python -m pytest -q -m gpu tests/gpu/test_parallel_gpu.py -k \
    "tp_graphs or killed" -rf --tb=short -s 2>&1 | tee $OUT/parallel_tests.log
timeout ${T3:-120} python -m strata bench synthetic --device cuda:0 --layers 0-9,20-29 \
    --modes plain,plain+graphs,oracle+graphs,oracle:2.9+graphs --tokens 24 --runs 1 \
    --warmup 1 --breakdown 3 --json $OUT/synthetic_1gpu_graphs.json 2>&1 \
    | tee $OUT/synthetic_1gpu_graphs.log
timeout ${T4:-60} python -m strata bench decode --parallel tp --devices cuda:0,cuda:1 \
    --modes plain,plain+graphs,oracle,oracle+graphs --tokens 32 --runs 1 --warmup 1 --quiet \
    --json $OUT/decode_tp_graphs.json 2>&1 | tee $OUT/decode_tp_graphs.log
timeout ${T5:-150} python -m strata bench synthetic --parallel tp --devices cuda:0,cuda:1 \
    --modes plain,plain+graphs,oracle+graphs,oracle:2.9+graphs --tokens 16 --runs 1 \
    --warmup 0 --json $OUT/synthetic_tp_graphs.json 2>&1 | tee $OUT/synthetic_tp_graphs.log
