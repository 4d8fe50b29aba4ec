cd /work/main/bench
for rep in 1 2; do
  for cap in 16384 256; do
    timeout 900 ../.venv/bin/python bench_server.py --grid --concurrency 16 --algorithms ar,ddtree --budgets 16 --waves 4 \
      --skip-inprocess --skip-batching --max-prefill-tokens $cap --trace-turns /tmp/cap/turns-$cap-$rep --out /tmp/cap/grid-$cap-$rep.json \
      > /tmp/cap/log-$cap-$rep.txt 2>&1
  done
done
echo done > /tmp/cap/finished
