# One device call (one GPU) for issue 5: the EXL3 fused kernel's split-K schedule swept —
# TARGET_PROGRAMS (programs a one-row launch aims for; it sets each output's summation order,
# so the engine keeps one value) over TPS, at decode's rows (1 and 6) on the V4.1 shapes and
# the grouped MoE case, each a separate `strata bench kernels` run tee'd to $OUT. Compare
# with kernels.md (TARGET_PROGRAMS 512). Defaults fit one 600 s call.
# On the device: source scripts/device_env.sh && bash scripts/device_exl3_sweep.sh
set -o pipefail
for tp in ${TPS:-256 512 1024 2048}; do
    timeout ${T:-120} python -m strata bench kernels --no-peer --rows ${ROWS:-1,6} \
        --shapes ${SHAPES:-expert_w13,expert_w2,wq_b,wo_b} --ks ${KS:-2.5,3,4} --moe \
        --rep ${REP:-50} --target-programs $tp --json $OUT/sweep_tp$tp.json 2>&1 \
        | tail -40 | tee $OUT/sweep_tp$tp.log
done
