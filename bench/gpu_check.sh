#!/usr/bin/env bash
# The checks only a CUDA machine can make, in one go, each step bounded and logged on its own so that
# one failure leaves the others' results: the machine, the Triton kernels compiled and run natively
# against the PyTorch reference and the engine under CUDA graphs; with --bench also their speed
# (bench/kernels.py), the prefill kernel's launch choices swept (bench/triton_tune.py) and the whole
# engine on each attention backend (bench/gpu_engine.py); then the host's CPU, another CPU kind
# (AMX, AVX-512 BF16): every native CPU kernel test and the batch-invariance tests. The CPU kernels
# compile in the background from the start, while the GPU steps run.
#
#   bash bench/gpu_check.sh OUTDIR [--bench]   # OUTDIR gets one log per step
#
# Python packages the machine lacks can come as wheels in .whl/ (pyzmq, orjson, gguf).
set -u
out=${1:-gpu-check}
bench=${2:-}
mkdir -p "$out"
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 CONVEYOR_CACHE=/tmp/conveyor-cache
if compgen -G ".whl/*.whl" >/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
  export PYTHONPATH=/tmp/site
fi
export PYTHONPATH="${PYTHONPATH:+$PYTHONPATH:}$PWD"

step() {  # step NAME SECONDS COMMAND...: run it, log to OUTDIR/NAME.log, print one status line
  local name=$1 secs=$2; shift 2
  local t0=$SECONDS
  timeout -k 5 "$secs" "$@" >"$out/$name.log" 2>&1
  echo "$name: exit $? after $((SECONDS - t0)) s"
}

{ nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv; lscpu;
  python3 -c 'import torch, triton; print("torch", torch.__version__, "triton", triton.__version__)'; } >"$out/machine.log" 2>&1
echo "machine: $(head -2 "$out/machine.log" | tail -1)"
echo "cpu: $(grep -m1 'Model name' "$out/machine.log" | sed 's/  */ /g')"
step cpu_kernel_build 300 python3 -c 'import kernels.cpu as k; print(k.build())' &
build=$!
# pytest-xdist (in the machine's image) spreads tests over its cores: Triton compiles on the CPU
xdist=()
python3 -c 'import xdist' 2>/dev/null && xdist=(-n 4)
step triton_cuda_tests 300 env TRITON_INTERPRET=0 python3 -m pytest -q -p no:cacheprovider -rs "${xdist[@]}" tests/kernels/test_triton_cuda.py tests/kernels/test_cuda_graphs.py
if [ "$bench" = --bench ]; then
  step bench_kernels 100 python3 bench/kernels.py --dtype bfloat16
  step triton_tune 150 python3 bench/triton_tune.py --quick --max-seconds 120
  step engine_smollm2 100 python3 bench/gpu_engine.py --shape smollm2 --dtype bfloat16
  step engine_llama1b 110 python3 bench/gpu_engine.py --shape llama-1b --dtype bfloat16
fi
wait "$build"
# the CPU tests on 8 workers of two threads each
[ ${#xdist[@]} -gt 0 ] && xdist=(-n 8)
cpu_tests=(tests/kernels/test_cpu_attention.py tests/kernels/test_quant_gemm*.py
           tests/kernels/test_quant_int8*.py tests/kernels/test_layer_ops.py
           tests/kernels/test_fused_layer_ops.py tests/kernels/test_decoder_layers*.py)
step cpu_kernel_tests 200 env OMP_NUM_THREADS=2 python3 -m pytest -q -p no:cacheprovider -rs "${xdist[@]}" "${cpu_tests[@]}"
step cpu_invariance_tests 200 env OMP_NUM_THREADS=2 python3 -m pytest -q -p no:cacheprovider -rs "${xdist[@]}" tests/engine/test_batch_invariance.py tests/engine/test_quantized.py
tail -n 3 "$out"/*.log
