# Session 3, device call 2 (warm after call 1): EXL3 kernels vs exllamav3 (peer in a child
# process), then `strata bench decode` in the four parallel modes on 2 GPUs.
set -o pipefail; export STRATA_PEER=1; source scripts/device_env.sh || exit 1
export TORCH_EXTENSIONS_DIR=/tmp/peer_build
timeout 330 python3 -m strata.cli bench kernels --rows 1,2,6,512 --warmup 10 --rep 30 --peer-timeout 320 --json $OUT/kernels_exl3.json 2>&1 | tail -8
for p in layer tp; do
  timeout 100 python3 -m strata.cli bench decode --device cuda --dtype bfloat16 --parallel $p --devices cuda:0,cuda:1 --modes plain,dspark,oracle --runs 2 --json $OUT/parallel_$p.json 2>&1 | tail -14
done
timeout 60 python3 -m strata.cli bench decode --device cuda:0 --dtype bfloat16 --modes plain,dspark,oracle --runs 2 --json $OUT/single.json 2>&1 | tail -6
