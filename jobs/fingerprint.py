"""What makes two sweep runs comparable: the software that decides the figures and the hardware.

Stored on the run row when it starts (runs.software, runs.hardware); History compares them and
warns when two runs' versions differ.
"""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
from importlib.metadata import PackageNotFoundError, version

SOFTWARE = ("ddtree-console", "torch", "transformers", "tokenizers", "safetensors", "huggingface_hub", "httpx",
            "sglang", "vllm", "flashinfer-python")


def software_versions(python: str | None = None) -> dict:
    """Versions of the packages that decide the figures, from this interpreter (no imports) and,
    when the engine runs under another one, from that interpreter too."""
    out: dict = {"python": platform.python_version(), "platform": platform.platform(), "packages": {}}
    for name in SOFTWARE:
        try:
            out["packages"][name] = version(name)
        except PackageNotFoundError:
            continue
    if python and os.path.realpath(python) != os.path.realpath(sys.executable):
        script = ("import json, platform\nfrom importlib.metadata import version\nout = {}\n"
                  f"for n in {list(SOFTWARE)!r}:\n    try: out[n] = version(n)\n    except Exception: pass\n"
                  "print(json.dumps({'python': platform.python_version(), 'packages': out}))")
        try:
            done = subprocess.run([python, "-c", script], capture_output=True, text=True, timeout=60,
                                  start_new_session=True, stdin=subprocess.DEVNULL)
            out["engine_python"] = json.loads(done.stdout) if done.returncode == 0 else {"error": done.stderr[-300:]}
        except (OSError, subprocess.TimeoutExpired, ValueError) as exc:
            out["engine_python"] = {"error": str(exc)}
    return out


def hardware_fingerprint(data_dir: str | None = None) -> dict:
    """What makes two runs comparable: GPUs (model, memory, bus, NUMA, links), driver, CPU, memory."""
    from ddtree.engine.machine.host import host_info
    from ddtree.engine.machine.hw import gpu_view

    view = gpu_view()
    host = host_info(data_dir=data_dir)
    gpus = [{"index": g.index, "name": g.name, "uuid": g.uuid, "bus_id": g.bus_id, "numa_node": g.numa_node,
             "memory_total": g.memory_total, "power_cap_w": g.power_cap_w, "pcie_gen_max": g.pcie_gen_max,
             "pcie_width_max": g.pcie_width_max, "nvlinks": len(g.nvlinks)} for g in view.gpus]
    return {
        "gpus": gpus, "links": view.links, "driver_version": view.driver_version,
        "cuda_driver_version": view.cuda_driver_version, "gpu_reason": view.reason,
        "host": {"hostname": host.hostname, "cpu_model": host.cpu_model, "cpus_logical": host.cpus_logical,
                 "cpus_physical": host.cpus_physical, "memory_total": host.memory_total,
                 "numa": [{"node": n.node, "cpus": len(n.cpus)} for n in host.numa]},
    }
