#!/usr/bin/env bash
# Everything that needs a CUDA GPU, in one run that fits a short lease (under 10 minutes; about 4 expected on an H100/H200):
#   1. tests/test_cuda.py and the CUDA case of test_processing_inputs (skipped on CI, which has no GPU);
#   2. benchmarks/bench_train.py --device cuda: SE-ResNeXt101 training throughput, fp32 (TF32) vs AMP;
#   3. benchmarks/bench_fast_decode.py --device cuda: --fast-decode when the CPU only decodes.
#
# Usage, from the repository root:  bash benchmarks/gpu_checks.sh [DIR]
# The benchmarks write benchmarks/results/bench_train_cuda.json and bench_fast_decode_cuda.json (the
# docs' tables); the logs and a copy of both files go to DIR (default: $OUT if set, else
# /tmp/convnets_gpu). Each step has its own time limit; the exit status is non-zero if one failed.
set -u
out=${1:-${OUT:-/tmp/convnets_gpu}}
python=${PYTHON:-python3}
mkdir -p "$out"
export PYTHONUNBUFFERED=1
status=0

step() {  # step NAME SECONDS COMMAND...: run it, keep its log, show its end
    local name=$1 seconds=$2
    shift 2
    local start=$SECONDS
    timeout "$seconds" "$@" >"$out/$name.log" 2>&1
    local rc=$?
    echo "== $name: exit $rc after $((SECONDS - start)) s"
    tail -n "${TAIL:-15}" "$out/$name.log"
    [ "$rc" = 0 ] || status=1
}

nvidia-smi -L
"$python" -c 'import torch, torchvision, PIL; print("torch", torch.__version__, "torchvision", torchvision.__version__,
  "pillow", PIL.__version__, "cuda", torch.cuda.is_available())' || exit 1
step tests 200 "$python" -m pytest -q -p no:cacheprovider -o addopts=-rs tests/test_cuda.py \
    tests/test_processing_inputs.py::test_cuda_like_upstream
step train 150 "$python" benchmarks/bench_train.py --device cuda --arch se_resnext101_32x4d --tiny 0 \
    --batch-size 128 --image-size 224 --steps 30
step fast_decode 200 "$python" benchmarks/bench_fast_decode.py --device cuda --images 96 --skip-pixels --no-compile
cp benchmarks/results/bench_train_cuda.json benchmarks/results/bench_fast_decode_cuda.json "$out"/ 2>/dev/null
exit $status
