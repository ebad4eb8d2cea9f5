# One device call (one GPU) for issue 5: the EXL3 fused kernel's launch and split-K schedule —
# first the early launch after rotate_in (programmatic dependent launch) against plain stream
# order at TARGET_PROGRAMS 512, then TARGET_PROGRAMS (programs a one-row launch aims for; it
# sets each output's summation order, so the engine keeps one value) swept over TPS; at
# decode's rows (1 and 6) on the V4.1 shapes and the grouped MoE case, each a separate
# `strata bench kernels` run tee'd to $OUT. Compare with kernels.md. Fits one 600 s call.
# On the device: source scripts/device_env.sh && bash scripts/device_exl3_sweep.sh
set -o pipefail
bench() {  # name, extra arguments
    timeout ${T:-100} python -m strata bench kernels --no-peer --rows ${ROWS:-1,6} \
        --shapes ${SHAPES:-expert_w13,expert_w2,wq_b,wo_b} --ks ${KS:-2.5,3,4} --moe \
        --rep ${REP:-50} "${@:2}" --json $OUT/sweep_$1.json 2>&1 | tail -40 \
        | tee $OUT/sweep_$1.log
}
bench nopdl_tp512 --target-programs 512 --no-pdl
for tp in ${TPS:-512 256 1024 2048}; do
    bench tp$tp --target-programs $tp
done
