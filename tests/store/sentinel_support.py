"""Runs with repeats written through the store's own functions, for the sentinel's store tests."""

import json

from ddtree.store import sweeps

HARDWARE = {"gpus": [{"index": 0, "name": "NVIDIA H200", "memory_total": 143_771_000_000, "nvlinks": 18}],
            "links": [["X"]], "driver_version": "575.51",
            "host": {"hostname": "gpu-a", "cpu_model": "AMD EPYC 9654", "cpus_logical": 384,
                     "memory_total": 2_200_000_000_000}}
SOFTWARE = {"python": "3.11.9", "packages": {"ddtree-console": "0.3.0", "torch": "2.13.0"}}
TAU = {8: 3.6, 16: 4.0, 32: 4.3, 64: 4.5}
TOKS = {8: 90.0, 16: 110.0, 32: 120.0, 64: 115.0}


def store_run(db, *, scale=1.0, tau_scale=None, wobble=0.0, hardware=HARDWARE, software=SOFTWARE,
              model="Qwen/Qwen3-8B", repeats=3) -> int:
    """A finished run: AR plus DDTree budgets 8-64 at c=1, `repeats` repeats each; tok/s times
    `scale` (+ `wobble` share), tau times tau_scale[budget] where given."""
    tau_scale = tau_scale or {}
    run_id = sweeps.create_run(db, job_id=None, name="r", recipe={}, engine_kind="builtin", model=model,
                               draft_model="z-lab/Qwen3-8B-DFlash-b16", hardware=hardware, software=software)
    planned, figures = [], {}
    cells = [("ar", None)] + [("ddtree", b) for b in TOKS]
    for alg, budget in cells:
        for rep in range(repeats):
            key = json.dumps({"algorithm": alg, "budget": budget, "concurrency": 1, "repeat": rep}, sort_keys=True)
            planned.append({"point_key": key, "idx": len(planned), "engine_kind": "builtin", "algorithm": alg,
                            "budget": budget, "tp": 1, "gpus": [], "concurrency": 1, "dataset": "builtin:code",
                            "temperature": 0.0, "repeat": rep, "max_new_tokens": 128})
            base = 50.0 if alg == "ar" else TOKS[budget]
            tau = 1.0 if alg == "ar" else TAU[budget] * tau_scale.get(budget, 1.0)
            figures[key] = {"output_tok_s": base * scale * (1 + wobble) + (rep - 1) * 0.8, "tau_weighted": tau,
                            "tau_mean": tau, "requests_ok": 8, "tau_hist": [0, 1, 2, 3]}
    ids = sweeps.ensure_points(db, run_id, planned)
    for key, metrics in figures.items():
        sweeps.record_point(db, ids[key], state="done", metrics=metrics, requests=[])
    sweeps.finish_run(db, run_id, "succeeded")
    return run_id
