#!/usr/bin/env bash
# The measurements a lent GPU machine makes in one call (issue 43's fixed host work, launch cost
# and host_overhead rows on a GPU; the first step on the machine's 16 CPU cores), each part
# bounded so that the whole fits one 9-minute call:
#
#   bash benchmarks/gpu_check.sh OUT_DIR
#
# Runs on the machine's own JAX, flax and optax (no install: the package is laid out as
# setup.cfg installs it, in a temporary copy of the checkout that the parts run from, since
# ``python -m`` puts the working directory first on the path). A persistent compilation
# cache is shared by the parts, so a program compiled by one is loaded by the next.
set -u
out=${1:?usage: gpu_check.sh OUT_DIR}
mkdir -p "$out"
export PYTHONUNBUFFERED=1
site=$(mktemp -d)
cp -r meshpar examples benchmarks "$site/" && cp -r passes "$site/meshpar/passes" \
    && cp -r runtime "$site/meshpar/runtime" && cd "$site" || exit 1
export JAX_COMPILATION_CACHE_DIR=$(mktemp -d) JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS=0
part() {  # part NAME SECONDS COMMAND...: runs COMMAND under a time limit, its output to the log
    local name=$1 limit=$2
    shift 2
    echo "=== $name (limit ${limit}s) $(date +%T)"
    timeout "$limit" "$@" 2>&1 | tee "$out/$name.log" | grep -v "^WARNING\|^I0000\|^W0000"
    echo "=== $name: exit ${PIPESTATUS[0]} $(date +%T)"
}
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
python3 -c "import jax, flax, optax; print('jax', jax.__version__, 'flax', flax.__version__, jax.devices())"
# Fixed host work per step, per handler (issue 43: at most 1 ms outside the programs).
part handlers_tiny 60 python3 -m benchmarks.profile_step --handlers --model tiny \
    --layout one_mesh_interleaved --micro-batches 8 --steps 50
part dispatch 60 python3 -m benchmarks.profile_step --dispatch --model tiny --calls 1000
# A launch's cost inside real steps, operands as launched and made ready first.
part launches 60 python3 -m benchmarks.profile_step --launches --model tiny --micro-batches 8 --steps 20
part host_tiny 110 python3 -m benchmarks.host_overhead --models tiny --steps 12 \
    --layouts one_mesh_interleaved one_mesh_zb_v --micro-batches 2 8 32 --json "$out/host_tiny.json"
part host_large 150 python3 -m benchmarks.host_overhead --models large --steps 12 \
    --layouts one_mesh_interleaved --micro-batches 4 8 --json "$out/host_large.json"
# The first step on the machine's 16 CPU cores: does compiling side by side pay where cores are many?
JAX_COMPILATION_CACHE_DIR= JAX_PLATFORMS=cpu part first_step_cpu16 100 python3 -m benchmarks.first_step \
    --jobs main --caches cold,warm --rounds 2 --json "$out/first_step_cpu16.json"
