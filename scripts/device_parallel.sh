# One device call on nvidia-h200-x2 for issue 7 (and issue 8's two-GPU figures): the two-GPU
# tests in both GPU orders, `bench decode` in layer and tp (each with plain, dspark, oracle and
# the compute/communication split), then the full-size synthetic V4.1 over both GPUs.
# Every step has its own timeout and tees to $OUT as it runs.
# On the device: source scripts/device_env.sh && bash scripts/device_parallel.sh
set -o pipefail
nvidia-smi topo -m | tee $OUT/topo.txt
timeout ${TESTS_S:-200} python -m pytest -q -m gpu tests/gpu/test_parallel_gpu.py 2>&1 \
    | tee $OUT/parallel_tests.log
for p in layer tp; do
  timeout ${DECODE_S:-90} python -m strata bench decode --parallel $p --devices cuda:0,cuda:1 \
      --modes plain,dspark,oracle --tokens 32 --runs 1 --warmup 1 --quiet \
      --json $OUT/decode_$p.json 2>&1 | tee $OUT/decode_$p.log
done
for p in ${SYN_MODES:-layer tp}; do
  timeout ${SYN_S:-110} python -m strata bench synthetic --parallel $p --devices cuda:0,cuda:1 \
      --modes plain,oracle,oracle:2.9 --tokens 16 --runs 1 --warmup 1 \
      --json $OUT/synthetic_$p.json 2>&1 | tee $OUT/synthetic_$p.log
done
