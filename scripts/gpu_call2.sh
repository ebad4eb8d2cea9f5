set -o pipefail; export STRATA_PEER=1; source scripts/device_env.sh || exit 1
export TORCH_EXTENSIONS_DIR=/tmp/peer_build; mkdir -p $TORCH_EXTENSIONS_DIR
( MAX_JOBS=12 timeout 420 python3 -c "import exllamav3.ext; print('peer ext ok')" > $OUT/peer_build.log 2>&1; echo "build rc $?" >> $OUT/peer_build.log ) &
BUILD=$!
timeout 330 python3 -m pytest -q -m gpu tests/gpu/test_kernels_exl3_gpu.py tests/gpu/test_kernels_fp8fp4_gpu.py -p no:cacheprovider --timeout 90 -rf 2>&1 | tail -40 > $OUT/gpu_kernel_tests.log
wait $BUILD; tail -3 $OUT/peer_build.log
timeout 250 python3 -m strata.cli bench kernels --rows 1,2,6,512 --warmup 10 --rep 40 --json $OUT/kernels_exl3.json 2>&1 | tail -90
cat $OUT/gpu_kernel_tests.log
