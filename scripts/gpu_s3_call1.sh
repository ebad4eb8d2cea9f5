# Session 3, device call 1 (nvidia-h200-x2): the EXL3 exactness diagnosis, the whole GPU suite
# (parallel included), exllamav3's extension built in the background for call 2.
set -o pipefail; export STRATA_PEER=1; source scripts/device_env.sh || exit 1
export TORCH_EXTENSIONS_DIR=/tmp/peer_build; mkdir -p $TORCH_EXTENSIONS_DIR; rm -f $TORCH_EXTENSIONS_DIR/*/lock
nvidia-smi -L; nproc; python3 -c "import torch, triton; print(torch.__version__, triton.__version__, torch.cuda.device_count())"
( MAX_JOBS=20 timeout 560 python3 -c "import exllamav3.ext; print('peer ext ok')" > $OUT/peer_build.log 2>&1; echo "build rc $?" >> $OUT/peer_build.log ) &
timeout 150 python3 scripts/exl3_diag.py 2>&1 | tee $OUT/exl3_diag.log
STRATA_GPU_RESULTS=$OUT/gpu_results.jsonl timeout 380 python3 -m pytest -q -m gpu tests/gpu -p no:cacheprovider --timeout 150 -rf 2>&1 | tee $OUT/gpu_tests.log | tail -45
wait; tail -3 $OUT/peer_build.log; ls $TORCH_EXTENSIONS_DIR/*/ 2>/dev/null | head -5
