# One device call (one GPU) for the kernel choices not yet measured, each step with its own
# timeout and written to $OUT as it runs: (1) the GPU tests they touch — the grouped kernels on
# the grouped weights' split schedule (strata.kernels.exl3.GROUPED_TARGET_PROGRAMS: the routed
# experts, wo_a's groups) against lone linears, the grouped decode and prefill kernels against
# the Triton ones; (2) scripts/exl3_variants.py's MoE gate + up and down at 1 and 6 tokens for
# each target in TARGETS; (3) the synthetic V4.1's graphed decode (half the layers, as
# scripts/device_mma.sh's A/B) as the tree is (`kept`) and with wo_a's groups back on a lone
# linear's schedule (`woa512`: quant/groups.py's target set to 512 in a copy of the tree; the
# tokens differ: other sums).
# On the device: source scripts/device_env.sh && bash scripts/device_probes.sh
set -o pipefail
timeout ${T1:-150} python -m pytest -q -m gpu -rf --tb=short tests/gpu/test_kernels_exl3_gpu.py \
    -k "experts_split_schedule or wo_a_groups or mma_kernels_moe or moe_grouped or prefill_kernel" \
    > $OUT/probe_tests.log 2>&1
tail -4 $OUT/probe_tests.log
variants=$(for t in ${TARGETS:-512 128 64}; do printf "e$t:GROUPED_TARGET_PROGRAMS=$t;"; done)
timeout ${T2:-120} python scripts/exl3_variants.py --linear-only --shapes expert_w13 \
    --variants "${variants%;}" --json $OUT/variants.json > $OUT/variants.log 2>&1
grep "moe" $OUT/variants.log
repo=$PWD
for v in ${AB:-woa512 kept}; do
  rm -rf /tmp/ab_$v && cp -r $repo /tmp/ab_$v
  [ $v = woa512 ] && sed -i "s/self._target = GROUPED_TARGET_PROGRAMS/self._target = 512/" \
      /tmp/ab_$v/strata/quant/groups.py
  (cd /tmp/ab_$v && PYTHONPATH=/tmp/site:/tmp/ab_$v timeout ${T3:-150} python -m strata bench \
      synthetic --device cuda:0 --layers 0-9,20-29 \
      --modes plain+graphs,oracle+graphs,oracle:2.9+graphs --tokens 24 --runs 2 --warmup 1 \
      --json $OUT/synthetic_$v.json 2>&1 | grep -E "^measured|identical|Error|error" \
      > $OUT/synthetic_$v.log)
  echo "== $v"; cat $OUT/synthetic_$v.log
done
