# One device call on nvidia-h200-x2 for issue 8's two-GPU figures (and issue 7's tests): the
# two-GPU tests in both GPU orders, then the full-size synthetic V4.1 over both GPUs in layer
# split and tensor parallel — graphed plain and DSpark modes, with the step by part on rank 0
# (--breakdown: its communication kernels and its waits on the other rank included). With
# DECODE=1 also `bench decode` on the real-vocab fixture (eager, with the compute/communication
# split). Every step has its own timeout and tees to $OUT as it runs.
# On the device: source scripts/device_env.sh && bash scripts/device_parallel.sh
set -o pipefail
nvidia-smi topo -m | tee $OUT/topo.txt
timeout ${TESTS_S:-240} python -m pytest -q -m gpu tests/gpu/test_parallel_gpu.py 2>&1 \
    | tee $OUT/parallel_tests.log
for p in ${DECODE:+layer tp}; do
  timeout ${DECODE_S:-90} python -m strata bench decode --parallel $p --devices cuda:0,cuda:1 \
      --modes plain,dspark,oracle --tokens 32 --runs 1 --warmup 1 --quiet \
      --json $OUT/decode_$p.json 2>&1 | tee $OUT/decode_$p.log
done
for p in ${SYN_MODES:-layer tp}; do
  timeout ${SYN_S:-170} python -m strata bench synthetic --parallel $p --devices cuda:0,cuda:1 \
      --modes plain+graphs,oracle+graphs,oracle:2.9+graphs --tokens 16 --runs 1 --warmup 1 \
      --breakdown ${BREAKDOWN:-2} --json $OUT/synthetic_$p.json 2>&1 \
      | grep -v CUDAGraph.cpp | tee $OUT/synthetic_$p.log
done
