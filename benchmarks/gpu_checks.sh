#!/usr/bin/env bash
# Everything that needs a CUDA GPU, in steps that fit a short lease (2-6 minutes each on an H100/H200):
#   tests        tests/test_cuda.py and the CUDA case of test_processing_inputs (CI has no GPU);
#   train        benchmarks/bench_train.py --device cuda: SE-ResNeXt101 training step, fp32 (TF32) vs AMP;
#   fast_decode  benchmarks/bench_fast_decode.py --device cuda: --fast-decode when the CPU only decodes;
#   inference    benchmarks/bench_inference.py --device cuda: fp16 inference against timm's, at batch 1 and 256;
#   decode_tests tests/test_cuda.py's cases of JPEGs decoded on the GPU (issue 38), about 1 minute;
#   decode       benchmarks/bench_decode.py: predict with --decode device / cpu against the model alone on
#                12 MP and ImageNet-size JPEGs, and the device path's agreement with Pillow's (2-4 minutes).
# Issue 38 alone, in one lease:  bash benchmarks/gpu_checks.sh "$OUT" decode_tests decode
#
# Usage, from the repository root:  bash benchmarks/gpu_checks.sh [DIR [STEP ...]]   (default: every step)
# The benchmarks write benchmarks/results/bench_*_cuda.json (the docs' tables); the logs and a copy
# of those files go to DIR (default: $OUT if set, else /tmp/convnets_gpu). Each step has its own
# time limit; the exit status is non-zero if one failed.
set -u
out=${1:-${OUT:-/tmp/convnets_gpu}}
shift $(( $# > 0 ? 1 : 0 ))
steps=" ${*:-tests train fast_decode inference decode} "
python=${PYTHON:-python3}
mkdir -p "$out"
export PYTHONUNBUFFERED=1
status=0

step() {  # step NAME SECONDS COMMAND...: run it (if asked for), keep its log, show its end
    local name=$1 seconds=$2
    shift 2
    [[ $steps == *" $name "* ]] || return 0
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
step tests 260 "$python" -m pytest -q -p no:cacheprovider -o addopts=-rs tests/test_cuda.py \
    tests/test_processing_inputs.py::test_cuda_like_upstream
step train 150 "$python" benchmarks/bench_train.py --device cuda --arch se_resnext101_32x4d --tiny 0 \
    --batch-size 128 --image-size 224 --steps 30
step fast_decode 200 "$python" benchmarks/bench_fast_decode.py --device cuda --images 96 --skip-pixels --no-compile
step decode_tests 150 "$python" -m pytest -q -p no:cacheprovider -o addopts=-rs tests/test_cuda.py \
    -k "device_path or decodes_on_the_gpu or decode_on_the_gpu"
step decode 420 "$python" benchmarks/bench_decode.py --device cuda
step inference 420 "$python" benchmarks/bench_inference.py --device cuda --models resnext101_32x4d,se_resnext101_32x4d \
    --batch-sizes 1,256 --variants "timm fp16,eager fp16,optimized fp16 no-compile,optimized fp16" --calls 10
cp benchmarks/results/bench_*_cuda.json "$out"/ 2>/dev/null
exit $status
