#!/usr/bin/env bash
# Everything that needs a real GPU box, in one pass (the lent H200 machines have no network and
# no project venv). Writes its outputs under $OUT (default ./gpu-check-out). Needs wheels for the
# pure-Python deps the image lacks in .whl/ (sqlite-utils, starlette, uvicorn, textual, ...).
#   bash bench/gpu_check.sh
set -u
OUT=${OUT:-$PWD/gpu-check-out}; mkdir -p "$OUT"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
if ls .whl/*.whl >/dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl || exit 1
fi
python3 -m pip install -q --no-index --no-deps --no-build-isolation --target /tmp/site . || exit 1
export PYTHONPATH=/tmp/site
cd /tmp  # import the installed package, not the source folders
src=$OLDPWD
log() { echo; echo "=== $*"; }
{
log versions; python3 -c 'import torch, transformers, sys; print(sys.version.split()[0], torch.__version__, transformers.__version__, torch.cuda.device_count())'
log nvidia-smi; nvidia-smi
log "nvidia-smi topo -m"; nvidia-smi topo -m
log "numactl -H"; numactl -H 2>&1 || echo "numactl missing"
} > "$OUT/system.txt" 2>&1
python3 -m ddtree.console.cli hw --json > "$OUT/hw.json" 2>"$OUT/hw.err"
{
log "hw"; python3 -m ddtree.console.cli hw
for tp in 1 2 4 8; do log "hw --tp $tp"; python3 -m ddtree.console.cli hw --tp $tp; done
} > "$OUT/hw.txt" 2>&1
python3 "$src/bench/capture_pane.py" --pane 2 --out "$OUT/hardware-pane.svg" > "$OUT/capture.log" 2>&1
{
log "sampler 60 s at 1 Hz, all GPUs"
python3 "$src/bench/bench_sampler.py" --seconds 60 --rate 1 --db
log "engine cuda tests"
cd "$src" && python3 -m pytest -q -p no:cacheprovider tests/engine/reference/test_cuda.py 2>&1 | tail -15; cd /tmp
log "engine forward cost on cuda"
timeout 150 python3 "$src/bench/bench_engine.py" forward --device cuda --shapes 8b,1.7b --out "$OUT/bench-forward.json" 2>&1 | tail -40
log "builtin server on cuda, demo pair: batched rounds vs one request per forward"
timeout 170 python3 "$src/bench/bench_server.py" --device cuda --concurrency 1,4,8 --budgets 16,64 --num-prompts 16 --max-new-tokens 64 --repeats 1 --out "$OUT/bench-server-cuda.json" 2>&1 | tail -40
} > "$OUT/gpu.txt" 2>&1
echo "outputs in $OUT"; ls -la "$OUT"
