# One device call (one GPU) for a change not yet measured, each step with its own timeout and
# written to $OUT as it runs: (1) the GPU tests it touches (TESTS: files or node ids, nothing
# quoted; default the EXL3 CUDA kernel's bits against Triton's, its early launch and the CUDA
# graphs; NO_TESTS=1: none); (2) an A/B of the synthetic V4.1's graphed decode (LAYERS, default
# 0-4,20-24, as scripts/device_mma.sh's), each variant in its own copy of the tree: `kept` as
# the tree is, any other V with the files under .ab/V/ (an overlay at their repo paths, made here by
# scripts/ab_overlay.sh REV V — carried as an ignored folder) copied over it. The order
# alternates (AB: default "before kept kept before") so drift between runs shows. TOKENS: per
# run (default 96 — 16 DSpark windows, so a run's one-time costs weigh less than with the 24
# of sessions ≤ 23, whose oracle figures spread ±5 % between copies of one tree); PROMPT: the
# prompt's tokens (default 512; e.g. 32768 for decode at an agent's context length).
# On the device: source scripts/device_env.sh && bash scripts/device_probes.sh
set -o pipefail
[ -n "$NO_TESTS" ] || timeout ${T1:-200} python -m pytest -q -m gpu -rf --tb=short \
    ${TESTS:-tests/gpu/test_kernels_exl3_gpu.py tests/gpu/test_cuda_graph_gpu.py \
    -k "mma or early_launch or moe_grouped or graph"} > $OUT/probe_tests.log 2>&1
[ -n "$NO_TESTS" ] || tail -4 $OUT/probe_tests.log
repo=$PWD
i=0
for v in ${AB:-before kept kept before}; do
  i=$((i + 1))
  rm -rf /tmp/ab_$v && cp -r $repo /tmp/ab_$v
  [ $v = kept ] || cp -r $repo/.ab/$v/. /tmp/ab_$v/
  (cd /tmp/ab_$v && PYTHONPATH=/tmp/site:/tmp/ab_$v timeout ${T3:-150} python -m strata bench \
      synthetic --device cuda:0 --layers ${LAYERS:-0-4,20-24} \
      --modes plain+graphs,oracle+graphs,oracle:2.9+graphs --tokens ${TOKENS:-96} --runs 2 --warmup 1 --prompt-tokens ${PROMPT:-512} \
      --json $OUT/synthetic_${i}_$v.json 2>&1 | grep -E "^measured|identical|Error|error" \
      > $OUT/synthetic_${i}_$v.log)
  echo "== $i $v"; cat $OUT/synthetic_${i}_$v.log
done
