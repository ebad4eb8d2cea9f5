# One device call (one GPU) for a prefill change: (1) the GPU tests it touches (TESTS: files or
# node ids, nothing quoted; NO_TESTS=1: none); (2) the 10-layer prefill A/B of sessions 46–53
# (layers 0-4 and 20-24: five encoder and five decoder layers, 32K and 128K prompts with the
# decoder skip) with its decode (plain and p0.69@3 windows, graphed, 48 tokens, two runs: a
# prefill change can cost decode — session 56's did, 5 %, which its 4-token single runs did
# not show: session 58), each variant in its own copy of the tree: `kept` as
# the tree is, any other V with .ab/V/ copied over it (scripts/ab_overlay.sh REV V makes it
# here; carry ".ab"). The order alternates (AB: default "before kept kept before") so drift
# between runs shows; ARGS: more `bench synthetic` arguments for every run (e.g.
# --prefill-chunk 8192); (3) with PIECES=1, the whole 40 layers in pieces whose times add, on
# the kept tree (layers 0-13, 14-27, 20+28-39, minus 20 alone: performance.md, session 51), and
# their sum (`strata bench pieces`). Each run's measured lines are printed as it ends; the JSON
# and logs are in $OUT. PREFILL: the prompt lengths timed (default 32K,128K; none: a decode
# change's A/B, decode alone); LAYERS: the A/B's layers (default 0-4,20-24).
# On the device: source scripts/device_env.sh && AB="before kept kept before" bash scripts/device_prefill_ab.sh
set -o pipefail
[ -n "$NO_TESTS" ] || timeout ${T1:-300} python -m pytest -q -m gpu -rf --tb=short \
    ${TESTS:-tests/gpu/test_kernels_fused_ops_gpu.py tests/gpu/test_cuda_parity.py} \
    > $OUT/prefill_ab_tests.log 2>&1
[ -n "$NO_TESTS" ] || tail -4 $OUT/prefill_ab_tests.log
repo=$PWD
prefill=(--prefill ${PREFILL:-32K,128K} --prefill-skip on)
[ "$PREFILL" = none ] && prefill=()
synthetic() {  # tree, name, then bench synthetic arguments
  local tree=$1 name=$2; shift 2
  (cd $tree && PYTHONPATH=/tmp/site:$tree timeout ${T2:-300} python -m strata bench synthetic \
      --device cuda:0 --runs 1 --warmup 1 "${prefill[@]}" \
      --json $OUT/$name.json "$@" $ARGS > $OUT/$name.log 2>&1)
  echo "== $name rc $?"; grep -E "^measured|Error|error" $OUT/$name.log
}
i=0
for v in ${AB:-before kept kept before}; do
  i=$((i + 1))
  rm -rf /tmp/ab_$v && cp -r $repo /tmp/ab_$v
  [ $v = kept ] || cp -r $repo/.ab/$v/. /tmp/ab_$v/
  synthetic /tmp/ab_$v prefill_ab_${i}_$v --layers ${LAYERS:-0-4,20-24} --runs 2 \
      --modes plain+graphs,oracle:p0.69@3+graphs --tokens 48
done
if [ -n "$PIECES" ]; then
  for p in a:0-13 b:14-27 c:20,28-39 d:20; do
    synthetic $repo piece_${p%%:*} --layers ${p#*:} --tokens 32 \
        --modes plain+graphs,oracle+graphs,oracle:p0.69@3+graphs
  done
  python -m strata bench pieces --add $OUT/piece_{a,b,c}.json --subtract $OUT/piece_d.json
fi
