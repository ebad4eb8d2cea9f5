# Sourced at the start of a GPU-machine command (see bench/results/*.md): installs the carried
# wheels (.whl/, and .whl/peer/ for the exllamav3 comparison) and sets the environment.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl ${STRATA_PEER:+.whl/peer/*.whl} || return 1
export PYTHONPATH=/tmp/site:$PWD ATEN_CPU_CAPABILITY=default PYTHONUNBUFFERED=1
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export TORCH_EXTENSIONS_DIR=$PWD/.peer_build TORCH_CUDA_ARCH_LIST=9.0 EXL3_INT8_GEMV=0
