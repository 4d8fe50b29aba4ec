# Sourced by bench/gpu_rows.sh, gpu_attention.sh and gpu_demo_dtype.sh, from the checkout's root,
# with OUT set: installs this checkout to /tmp/site, puts it on PYTHONPATH, makes OUT absolute (the
# scripts cd), and notes the GPU in $OUT/gpu.txt.
# A warm machine keeps the last install, and pip --target does not replace it: so it starts clean.
export PYTHONUNBUFFERED=1
mkdir -p "$OUT" && OUT=$(cd "$OUT" && pwd)
rm -rf /tmp/site
python3 -m pip install -q --no-index --no-deps --no-build-isolation --target /tmp/site . >/tmp/install.log 2>&1 \
    || { cat /tmp/install.log; exit 1; }
export PYTHONPATH=/tmp/site
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv > "$OUT/gpu.txt" 2>&1
