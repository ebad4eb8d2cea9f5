set -o pipefail; export STRATA_PEER=1; source scripts/device_env.sh || exit 1
nproc; nvidia-smi --query-gpu=name,memory.total --format=csv
mkdir -p .peer_build
( MAX_JOBS=13 timeout 580 python3 -c "import exllamav3.ext; print('peer ext ok')" > $OUT/peer_build.log 2>&1; echo "build rc $?" >> $OUT/peer_build.log ) &
timeout 330 python3 -m pytest -q -m gpu tests/gpu -p no:cacheprovider --timeout 120 -rf 2>&1 | tail -60 | tee $OUT/gpu_tests.log
python3 -m strata.bench.load /tmp/lb --size 8GB --device cuda:0 --runs 3 --cold --json $OUT/load_folder.json 2>&1 | tail -3
python3 -m strata.bench.load /tmp/lb --size 8GB --device cuda:0 --runs 3 --cold --pack --json $OUT/load_pack.json 2>&1 | tail -3
wait; tail -5 $OUT/peer_build.log; ls .peer_build/*/ 2>/dev/null | head
