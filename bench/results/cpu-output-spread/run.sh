# Fixed output lengths (ratio 1) against spread ones (ratio 0.25: 16-64 tokens), A B A B, on the
# demo-shaped random pair (no trained EOS, so every request runs to its length), c=16.
cd /work/main/bench
mkdir -p /tmp/spread
for rep in 1 2; do
  for ratio in 1.0 0.25; do
    timeout 900 ../.venv/bin/python bench_server.py --grid --random-shape demo --concurrency 16 --algorithms ar,ddtree \
      --budgets 16 --waves 4 --skip-batching --output-len-ratio $ratio \
      --trace-turns /tmp/spread/turns-$ratio-$rep --out /tmp/spread/grid-$ratio-$rep.json \
      > /tmp/spread/log-$ratio-$rep.txt 2>&1
  done
done
echo done > /tmp/spread/finished
