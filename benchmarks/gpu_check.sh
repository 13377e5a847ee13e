#!/usr/bin/env bash
# What a machine with one CUDA GPU checks, in one go (a few minutes): the CUDA tests, the CLI on cuda, and a
# training step measured by the allocator beside the simulation's and the replay's predictions
# (benchmarks/gpu_step_check.py). Results go to ${OUT:-gpu-check}/. Uses the python3 that holds torch's CUDA build;
# streamlit, pyvis and playwright are not needed.
set -u
out=${OUT:-gpu-check}; mkdir -p "$out"
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
py=${PYTHON:-python3}
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
$py -c "import torch, transformers, peft; print('torch', torch.__version__, 'transformers', transformers.__version__, 'peft', peft.__version__, torch.cuda.get_device_name())"
# one process for the GPU tests (they read the allocator's peaks and fill the GPU on purpose), several for the rest
timeout 240 $py -m pytest -p no:cacheprovider -q -rA tests/test_cuda.py tests/test_cuda_record.py 2>&1 | tee "$out/pytest-cuda.log" | tail -40
timeout 240 $py -m pytest -p no:cacheprovider -q -n 4 tests/test_device.py tests/test_multi_gpu.py tests/test_allocator.py \
  tests/test_autocast.py 2>&1 | tee "$out/pytest-rest.log" | tail -15
cli() { timeout 180 $py -c "from graphviz_core.cli import main; raise SystemExit(main())" "$@"; }
cli graph --preset gpt2-small --device cuda -o "$out/gpt2-small-cuda.json" && echo "graph gpt2-small on cuda: ok"
cli memory --preset llama-tiny --device cuda --autocast bfloat16 --checkpoints -o "$out/llama-tiny-memory-cuda.json" \
  && echo "memory llama-tiny bf16 autocast on cuda: ok"
$py - "$out" <<'PY'
import json, sys
g = json.load(open(f"{sys.argv[1]}/gpt2-small-cuda.json"))
m = json.load(open(f"{sys.argv[1]}/llama-tiny-memory-cuda.json"))
print("gpt2-small on", g["device"], "nodes", g["summary"]["nodes"], "memory", g["memory"], "time", g["time"])
print("llama-tiny bf16 memory on cuda: peak", m.get("peak_bytes"), "training step", m.get("training_step"))
PY
cli debug --preset gpt2-tiny --device cuda --format json > "$out/debug-gpt2-tiny-cuda.json" && echo "debug gpt2-tiny on cuda: ok" \
  && cat "$out/debug-gpt2-tiny-cuda.json" | head -c 400; echo
# which attention kernel the GPU runs, the softmax kernels' own memory, and meta dry runs beside real captures
# (graphviz_core.capture.meta_kernels mirrors them)
timeout 180 $py benchmarks/gpu_sdpa_choice.py --dry-runs 2>&1 | grep -v -i warn | tee "$out/sdpa-choice.log"
# what recording costs on the GPU (the CPU's figures: benchmarks/bench_record.py)
timeout 240 $py benchmarks/gpu_record_bench.py --steps 21 --rounds 3 2>&1 | tee "$out/record-bench.log"
# STEP_CHECKS=0 leaves out the four step checks below (Llama 3.1 8B's shape cut to 2 layers: minutes)
[ "${STEP_CHECKS:-1}" = 0 ] && exit 0
for d in float32 bfloat16; do for e in True False; do
  PYTORCH_CUDA_ALLOC_CONF=expandable_segments:$e timeout 150 $py benchmarks/gpu_step_check.py --seq 4096 --dtype $d \
    --json "$out/step-$d-expandable-$e.json"
done; done
