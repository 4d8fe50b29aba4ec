#!/usr/bin/env bash
# One entry point for a fresh clone:
#   ./dev.sh console   set everything up, then start the console on the builtin engine with the demo pair
#   ./dev.sh test      set everything up, then run the whole test suite (what CI runs)
#   ./dev.sh quick     the tests not marked slow, in two processes, for the inner loop (no reinstall)
#   ./dev.sh setup     only set up .venv
set -euo pipefail
cd "$(dirname "$0")"
VENV=${DDTREE_VENV:-.venv}

setup() {
    if [ ! -x "$VENV/bin/python" ]; then
        python3 -m venv "$VENV"
    fi
    "$VENV/bin/python" -m pip install -q --upgrade pip
    # torch first, pinned to the CPU build this kind of machine keeps on disk; an unpinned torch
    # would pull a multi-GB CUDA build. On a GPU box, install the torch you want before this.
    if ! "$VENV/bin/python" -c 'import torch' 2>/dev/null; then
        "$VENV/bin/python" -m pip install -q torch==2.13.0
    fi
    # Without CUDA, Triton's interpreter runs the tree-attention kernels in the tests (3.7.1 and
    # later work with numpy 2). A CUDA torch brings the triton it was built with: left alone.
    if "$VENV/bin/python" -c 'import sys, torch; sys.exit(torch.version.cuda is not None)' 2>/dev/null \
        && ! "$VENV/bin/python" -c 'import triton' 2>/dev/null; then
        "$VENV/bin/python" -m pip install -q 'triton>=3.7.1'
    fi
    # A strict editable install gives a real ddtree/ tree (import-linter needs files, not the
    # lenient mode's import hook); swapping its per-file links for folder links makes new modules
    # importable without reinstalling.
    "$VENV/bin/python" -m pip install -q -e '.[engine,dev]' --config-settings editable_mode=strict 2>/dev/null
    local tree
    tree=$(echo build/__editable__.ddtree_console-*/ddtree)
    for pkg in console engine jobs store assets; do
        rm -rf "${tree:?}/$pkg"
        ln -s "$PWD/$pkg" "$tree/$pkg"
    done
}

quick_halves() {
    # The test files split in two halves of about equal size (largest first, each to the lighter
    # half), one process each with its own temp folder; the logs show after both end, and the
    # exit status is the first failure's.
    local tmp pid rc=0 size f wa=0 wb=0
    local -a a=() b=()
    tmp=$(mktemp -d)
    while read -r size f; do
        if (( wa <= wb )); then a+=("$f"); wa=$((wa + size)); else b+=("$f"); wb=$((wb + size)); fi
    done < <(find tests -name 'test_*.py' -printf '%s %p\n' | sort -rn)
    "$VENV/bin/python" -m pytest -q -m "not slow" -p no:cacheprovider --basetemp="$tmp/a" "${a[@]}" \
        > "$tmp/a.log" 2>&1 &
    pid=$!
    "$VENV/bin/python" -m pytest -q -m "not slow" -p no:cacheprovider --basetemp="$tmp/b" "${b[@]}" \
        > "$tmp/b.log" 2>&1 || rc=$?
    wait "$pid" || rc=$?
    cat "$tmp/a.log" "$tmp/b.log"
    rm -rf "$tmp"
    return "$rc"
}

case "${1:-}" in
    setup) setup ;;
    console)
        setup
        shift
        exec "$VENV/bin/ddtree-console" --demo "$@"
        ;;
    test)
        setup
        shift
        "$VENV/bin/lint-imports"
        exec "$VENV/bin/python" -m pytest -q "$@"
        ;;
    quick)
        # No reinstall on every run (the editable install links the folders, so edits show at
        # once), one OpenMP thread per process. Without arguments two pytest processes split the
        # test files (the box has 2 cores); with arguments one process gets them.
        [ -x "$VENV/bin/python" ] || setup
        shift
        "$VENV/bin/lint-imports"
        export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
        if [ $# -gt 0 ]; then
            exec "$VENV/bin/python" -m pytest -q -m "not slow" "$@"
        fi
        quick_halves
        ;;
    *)
        sed -n '2,6p' "$0" | sed 's/^# \{0,1\}//'
        exit 2
        ;;
esac
