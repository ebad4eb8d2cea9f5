# Session 3, device call 3: the EXL3 GPU exactness tests after the wgmma change.
set -o pipefail; source scripts/device_env.sh || exit 1
timeout 250 python3 -m pytest -q -m gpu tests/gpu/test_kernels_exl3_gpu.py -p no:cacheprovider --timeout 200 -rf \
  -k "fused_equals or batch_invariant or moe or wgmma or ladder" 2>&1 | tee $OUT/exl3_gpu_tests.log
