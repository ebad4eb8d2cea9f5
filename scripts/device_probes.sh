# One device call (one GPU) for the kernel choices not yet measured, each step with its own
# timeout and written to $OUT as it runs (session 17: the routed experts' split schedule,
# strata.kernels.exl3.EXPERT_TARGET_PROGRAMS): (1) the GPU tests it touches — the grouped
# kernels on the experts' schedule against lone linears, the grouped decode and prefill
# kernels against the Triton ones; (2) scripts/exl3_variants.py's MoE gate + up and down at 1
# and 6 tokens for each target in TARGETS; (3) the synthetic V4.1's graphed decode (half the
# layers, as scripts/device_mma.sh's A/B) with each target in AB_TARGETS, each from its own copy
# of the tree with the constant changed (the tokens differ between targets: other sums).
# On the device: source scripts/device_env.sh && bash scripts/device_probes.sh
set -o pipefail
timeout ${T1:-150} python -m pytest -q -m gpu -rf --tb=short tests/gpu/test_kernels_exl3_gpu.py \
    -k "experts_split_schedule or mma_kernels_moe or moe_grouped or prefill_kernel" \
    > $OUT/probe_tests.log 2>&1
tail -4 $OUT/probe_tests.log
variants=$(for t in ${TARGETS:-512 256 128 64 32}; do printf "e$t:EXPERT_TARGET_PROGRAMS=$t;"; done)
timeout ${T2:-120} python scripts/exl3_variants.py --linear-only --shapes expert_w13 \
    --variants "${variants%;}" --json $OUT/variants.json > $OUT/variants.log 2>&1
grep "moe" $OUT/variants.log
repo=$PWD
for t in ${AB_TARGETS:-512 128 64}; do
  rm -rf /tmp/ab_$t && cp -r $repo /tmp/ab_$t
  sed -i "s/^EXPERT_TARGET_PROGRAMS = .*/EXPERT_TARGET_PROGRAMS = $t/" \
      /tmp/ab_$t/strata/kernels/exl3.py
  (cd /tmp/ab_$t && PYTHONPATH=/tmp/site:/tmp/ab_$t timeout ${T3:-150} python -m strata bench \
      synthetic --device cuda:0 --layers 0-9,20-29 \
      --modes plain+graphs,oracle+graphs,oracle:2.9+graphs --tokens 24 --runs 2 --warmup 1 \
      --json $OUT/synthetic_e$t.json 2>&1 | grep -E "^measured|identical|Error|error" \
      > $OUT/synthetic_e$t.log)
  echo "EXPERT_TARGET_PROGRAMS $t"; cat $OUT/synthetic_e$t.log
done
