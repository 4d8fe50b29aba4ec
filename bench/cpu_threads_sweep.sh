#!/usr/bin/env bash
# The builtin server's CPU threads through a real sweep (the console's path: server, HTTP, sweep
# client), idle and beside busy processes. Each variant is a recipe whose [engine.env] sets the
# server's OpenMP environment; variants run A B C A B C; then every run is exported and summarised.
#
#   bash bench/cpu_threads_sweep.sh LOAD ROUNDS [VARIANT...]
#   bash bench/cpu_threads_sweep.sh 0 3                 # idle
#   bash bench/cpu_threads_sweep.sh 1 1 default torch2  # beside one busy process
#
# VARIANT: default (the server's own choice), torch2 (OMP_NUM_THREADS=2, torch's threads before the
# default changed), passive (that, with OMP_WAIT_POLICY=PASSIVE), spin10k (that, with
# GOMP_SPINCOUNT=10000). Runs in a store of its own under $OUT (default /tmp/cpu-threads-sweep).
set -euo pipefail
cd "$(dirname "$0")/.."
LOAD=${1:?LOAD (busy processes)}; ROUNDS=${2:?ROUNDS}; shift 2
if [ $# -gt 0 ]; then VARIANTS=("$@"); else VARIANTS=(default torch2); fi
OUT=${OUT:-/tmp/cpu-threads-sweep}
export XDG_DATA_HOME="$OUT/home-$LOAD"
# A store of its own (DDTREE_DB would win over XDG_DATA_HOME), and the servers' threads as each
# variant says, not as this shell's environment does.
unset DDTREE_DB OMP_NUM_THREADS OMP_WAIT_POLICY GOMP_SPINCOUNT
rm -rf "$XDG_DATA_HOME"; mkdir -p "$OUT"

env_of() {
  case $1 in
    default) ;;
    torch2) echo 'OMP_NUM_THREADS = "2"' ;;
    passive) printf 'OMP_NUM_THREADS = "2"\nOMP_WAIT_POLICY = "PASSIVE"\n' ;;
    spin10k) printf 'OMP_NUM_THREADS = "2"\nGOMP_SPINCOUNT = "10000"\n' ;;
    *) echo "unknown variant $1" >&2; exit 2 ;;
  esac
}
for v in "${VARIANTS[@]}"; do env_of "$v" > /dev/null || exit 2; done
for v in "${VARIANTS[@]}"; do
  cat > "$OUT/$v.toml" <<EOF
name = "threads-$v"
[engine]
kind = "builtin"
device = "cpu"
[engine.env]
$(env_of "$v")
[sweep]
budget = [16]
concurrency = [1, 2]
dataset = "builtin:code"
num_prompts = 10
max_new_tokens = 48
temperature = 0.0
warmup = 1
repeats = 2
baseline = ["ar", "dflash"]
EOF
done

pids=()
for _ in $(seq 1 "$LOAD"); do python3 -c "while True: pass" & pids+=($!); done
trap '[ ${#pids[@]} -eq 0 ] || kill "${pids[@]}" 2>/dev/null || true' EXIT
for r in $(seq 1 "$ROUNDS"); do
  for v in "${VARIANTS[@]}"; do
    echo "load $LOAD round $r: $v" >&2
    .venv/bin/ddtree-console sweep "$OUT/$v.toml" --name "$v" > "$OUT/log-$LOAD-$v-$r.txt" 2>&1
  done
done
n=$(( ROUNDS * ${#VARIANTS[@]} ))
for id in $(seq 1 "$n"); do .venv/bin/ddtree-console export "$id" --format json > "$OUT/export-$LOAD-$id.json"; done
.venv/bin/python - "$OUT" "$LOAD" "${VARIANTS[@]}" <<'EOF'
import glob, json, statistics, sys
out, load, variants = sys.argv[1], sys.argv[2], sys.argv[3:]
rows = {}
for f in glob.glob(f"{out}/export-{load}-*.json"):
    d = json.load(open(f))
    for p in d["points"]:
        if p.get("state") == "done":
            key = (p["algorithm"] + (f"-{p['budget']}" if p["algorithm"] == "ddtree" else ""), p["concurrency"])
            rows.setdefault(d["run"]["name"], {}).setdefault(key, []).append(p["output_tok_s"])
keys = sorted({k for v in rows.values() for k in v})
first = variants[0]
print(f"{load} busy processes: median output tok/s over rounds x repeats, and x {first}")
print(f"{'variant':10}" + "".join(f"{a} c{c}".rjust(18) for a, c in keys))
for v in variants:
    cells = []
    for k in keys:
        med, base = statistics.median(rows[v][k]), statistics.median(rows[first][k])
        cells.append(f"{med:7.1f} ({med / base:.2f}x)".rjust(18))
    print(f"{v:10}" + "".join(cells))
EOF
