#!/usr/bin/env bash
# The GPU checks and GPU figures in one run, for a machine with one CUDA GPU:
#
#     OUT=/some/folder bash scripts/gpu_checks.sh
#
# The GPU tests (tests/test_gpu.py: apply without host syncs, GPU values and gradients equal
# to CPU, autobatch decoding with reads, list arguments of N models as one BatchModule,
# max_rows / offload), TreeLSTM throughput at 1-1024 trees per fold, N LeNets / MLPs as one
# BatchModule, sweeps of N TreeLSTMs and of 8 child-sum TreeLSTMs, and a batch larger than
# the memory allowed completed with max_rows / offload.  Each step has its own time limit, so one that hangs does not take the
# others with it; the log and the JSON results (benchmarks/results/*_cuda.json,
# memory_gpu.json, docs/tree_throughput_cuda.png) are copied into $OUT.
#
# Where fold is not installed, it runs from the checkout: the optional C recorders are built
# in place, and wheels in .whl/ (greenlet, conllu) are installed into a scratch folder.
set -u
export PYTHONUNBUFFERED=1
OUT=${OUT:-runs/gpu}
mkdir -p "$OUT"
log="$OUT/log.txt"
step() {  # step LIMIT_S NAME COMMAND...
    local limit=$1 name=$2
    shift 2
    echo "=== $name ($(date +%T))" | tee -a "$log"
    timeout "$limit" "$@" 2>&1 | tee -a "$log"
    echo "=== $name: exit ${PIPESTATUS[0]}" | tee -a "$log"
}
if ls .whl/*.whl >/dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:$PWD
fi
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv 2>&1 | tee -a "$log"
python3 setup.py -q build_ext --inplace 2>&1 | tail -3 | tee -a "$log"
python3 -c "import torch, fold, fold._crecord, fold._clazy, greenlet; print('torch', torch.__version__, torch.cuda.get_device_name())" 2>&1 | tee -a "$log"

step 90 "GPU tests" python3 -m pytest -q -p no:cacheprovider tests/test_gpu.py -rs
step 150 "TreeLSTM throughput" python3 benchmarks/tree_throughput.py --device cuda --reps 5 --save
step 100 "LeNets" python3 benchmarks/models.py --device cuda --models 10 100 1000 --reps 5 --save
step 80 "MLPs" python3 benchmarks/models.py --device cuda --arch mlp --models 10 100 1000 --reps 5 --save
step 120 "TreeLSTM sweep" python3 benchmarks/sweep.py --device cuda --models 8 32 128 --reps 3 --only treelstm --save
step 90 "child-sum sweep" python3 benchmarks/sweep.py --device cuda --only childsum --reps 3 --save
step 60 "memory" python3 benchmarks/memory_gpu.py --device cuda --save
cp benchmarks/results/*_cuda.json benchmarks/results/memory_gpu.json docs/tree_throughput_cuda.png "$OUT"/ 2>/dev/null
step "${SUITE_S:-100}" "test suite with CUDA present" python3 -m pytest -q -x -p no:cacheprovider
