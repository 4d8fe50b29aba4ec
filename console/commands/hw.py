"""`ddtree-console hw [--json] [--tp N] [--from FILE]`: GPUs, links, NUMA nodes, CPU, memory, disks.

`--json` prints what the table shows as one JSON object (the GPU view plus a `host` key), which
`--from FILE` reads back, so a report recorded on one machine can be viewed (and placed) on another.
`--tp N` adds the best GPU sets for tensor-parallel size N and how to pin a server next to them (on a
machine without a GPU, a note that there is none to place on).
`--fit MODEL_DIR` prints instead a VRAM estimate for serving that local model at tp N (default 1):
weights from its safetensors headers (+ `--draft DIR`), KV cache per token from its config.json times
`--context` x `--concurrency`, against the memory of this machine's first N GPUs (or `--gpu-mem-gb`),
with a note for a tp the engines refuse (attention or KV heads it cannot split evenly).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from ddtree.console.disks import disk_figures
from ddtree.engine.errors import EngineError
from ddtree.engine.machine.host import DiskInfo, HostInfo, host_info
from ddtree.engine.machine.hw import LINK_MEANING, GpuInfo, GpuView, format_cpulist, gpu_view
from ddtree.engine.machine.placement import Placement, check_tp, suggest
from ddtree.engine.machine.preflight import MAX_TP, estimate_vram
from ddtree.store.db import data_dir
from ddtree.engine.units import plural

GIB = 1024**3
NO_GPU_NOTE = "no GPU to place on"
FIT_CONTEXT = 8192
FIT_CONCURRENCY = 1


class HwInputError(EngineError):
    exit_code = 2


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("hw", help="GPUs, links, NUMA nodes, CPU, memory, disks",
                              description="Show the machine: GPUs through NVML (memory, use, power, clocks, PCIe, "
                                          "NVLink, processes), the GPU-to-GPU link matrix, NUMA nodes, CPU, memory "
                                          "and the disks that hold the HF cache and the data folder.")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of tables")
    p.add_argument("--tp", type=int, metavar="N", help="also suggest GPU sets for tensor-parallel size N, or note that there is no GPU to place on "
                        "(with --fit: the tp to estimate at, default 1)")
    p.add_argument("--from", dest="from_file", metavar="FILE", help="show a report saved with --json instead")
    fit = p.add_argument_group("VRAM fit estimate",
                               "weights from the safetensors headers plus the KV cache from config.json "
                               "(layers x kv heads x head_dim x 2 x dtype bytes per token), per GPU at --tp, "
                               "against the first --tp GPUs' memory x 0.88 (SGLang's static memory share); "
                               "notes a --tp that SGLang and vLLM refuse (one that cannot split the model's "
                               "attention or KV heads evenly)")
    fit.add_argument("--fit", metavar="MODEL_DIR", help="estimate whether the local model MODEL_DIR fits")
    fit.add_argument("--draft", metavar="DIR", help="with --fit: add this drafter's weights")
    # None until given, so that one given without --fit is refused even at its default value
    fit.add_argument("--context", type=int, metavar="N", help=f"with --fit: tokens per sequence (default {FIT_CONTEXT})")
    fit.add_argument("--concurrency", type=int, metavar="N", help=f"with --fit: sequences at once (default {FIT_CONCURRENCY})")
    fit.add_argument("--gpu-mem-gb", type=float, metavar="G",
                     help="with --fit: assume GPUs of G GB (default: this machine's, or the --from report's)")
    p.set_defaults(command_module=__name__)


def collect(args: argparse.Namespace) -> tuple[GpuView, HostInfo | None]:
    if args.from_file is not None:
        if not args.from_file.strip():
            raise HwInputError("--from needs a file name, got an empty one", "write one with `ddtree-console hw --json`")
        try:
            data = json.loads(Path(args.from_file).read_text())
        except OSError as exc:
            raise HwInputError(f"cannot read {args.from_file}: {exc.strerror}") from None
        except ValueError:
            raise HwInputError(f"{args.from_file} is not JSON", "write it with `ddtree-console hw --json`") from None
        if not isinstance(data, dict):
            raise HwInputError(f"{args.from_file} is not a hw report")
        try:
            view = GpuView.from_dict(data)
            host = HostInfo.from_dict(data["host"]) if data.get("host") else None
        except (TypeError, KeyError, ValueError) as exc:
            raise HwInputError(f"{args.from_file} is not a hw report ({exc})") from None
        return view, host
    return gpu_view(), host_info(data_dir=data_dir(getattr(args, "db", None)), cpu_interval=0.1)


def _size(n: float) -> str:
    return f"{n / 1e9:.2f} GB" if n >= 1e9 else f"{n / 1e6:.2f} MB"


def _count(n: int) -> str:
    return f"{n / 1e9:.2f} B" if n >= 1e9 else f"{n / 1e6:.2f} M"


def fit(args: argparse.Namespace, view: GpuView | None) -> int:
    if not Path(args.fit).expanduser().exists():  # before the GPUs: they are moot without a model
        raise HwInputError(f"model folder {args.fit} does not exist", "--fit takes a local model folder (with config.json)")
    tp = 1 if args.tp is None else args.tp
    if not 1 <= tp <= MAX_TP:
        # before the list of tp GPU sizes below is built
        raise HwInputError(f"--tp must be 1..{MAX_TP}, got {tp}")
    if args.gpu_mem_gb is not None:
        if not 0 < args.gpu_mem_gb < 1e6:
            raise HwInputError(f"--gpu-mem-gb must be a positive number, got {args.gpu_mem_gb}")
        totals = [int(args.gpu_mem_gb * 1e9)] * tp
        where = f"{tp} x {args.gpu_mem_gb:g} GB (given)"
    else:
        gpus = view.gpus if view is not None else []
        totals = [g.memory_total for g in gpus[:tp] if g.memory_total]
        if len(totals) < tp:
            reason = f"this machine has {plural(len(gpus), 'GPU')} with known memory" if gpus else \
                f"no GPUs here ({(view.reason if view else None) or 'none found'})"
            raise HwInputError(f"tp {tp} needs {plural(tp, 'GPU')}: {reason}", "pass --gpu-mem-gb G to assume GPUs of G GB")
        where = f"GPUs {', '.join(str(g.index) for g in gpus[:tp])} ({', '.join(g.name or '?' for g in gpus[:tp])})"
    est = estimate_vram(args.fit, totals, tp, context=FIT_CONTEXT if args.context is None else args.context,
                        concurrency=FIT_CONCURRENCY if args.concurrency is None else args.concurrency,
                        draft_dir=args.draft)
    if args.json:
        json.dump(dict(est.to_dict(), gpus=where), sys.stdout, indent=1)
        sys.stdout.write("\n")
        return 0
    kv = est.kv
    kind = (f"MLA latent {kv.head_dim}" if kv.mla else f"{kv.kv_heads} kv heads x {kv.head_dim} x 2")
    dtypes = ", ".join(f"{k} {_size(v)}" for k, v in est.weights.dtypes.items())
    lines = [f"VRAM fit: {est.model} at tp {tp} on {where}",
             f"  weights   {_size(est.weights.bytes):>10}  {_count(est.weights.params)} params in "
             f"{plural(est.weights.files, 'file')} ({dtypes})"]
    if est.draft_weights:
        lines.append(f"  drafter   {_size(est.draft_weights.bytes):>10}  {_count(est.draft_weights.params)} params")
    lines.append(f"  KV cache  {kv.bytes_per_token / 1024:7.1f} KiB/token ({kv.layers} layers x {kind} x "
                 f"{kv.dtype_bytes} B) x {est.context} tokens x {est.concurrency} = {_size(est.kv_bytes)}")
    lines.append(f"  per GPU   {_size(est.per_gpu_weights)} weights + {_size(est.per_gpu_kv)} KV = "
                 f"{_size(est.per_gpu_needed)} of {_size(est.per_gpu_budget)} "
                 f"({est.mem_fraction:.2f} x {_size(est.gpu_total_bytes)})")
    lines.append(f"  {'fits' if est.fits else 'does NOT fit'}; room for {est.max_tokens:,} KV tokens "
                 f"(context x concurrency) at tp {tp}")
    lines += [f"  note: {note}" for note in est.notes]
    sys.stdout.write("\n".join(lines) + "\n")
    return 0


def run(args: argparse.Namespace) -> int:
    if getattr(args, "fit", None):
        view = collect(args)[0] if args.gpu_mem_gb is None else None
        return fit(args, view)
    if any(getattr(args, k, None) is not None for k in ("draft", "context", "concurrency", "gpu_mem_gb")):
        raise HwInputError("--draft, --context, --concurrency and --gpu-mem-gb go with --fit MODEL_DIR")
    view, host = collect(args)
    placements: list[Placement] = []
    if args.tp is not None:
        check_tp(args.tp)
        # no GPU is what the machine view already says, not a mistake in the command: the view still prints
        if view.gpus:
            placements = suggest(view.gpus, view.links, args.tp, numa=host.numa if host else None, limit=3)
    if args.json:
        out = view.to_dict()
        out["host"] = host.to_dict() if host else None
        if args.tp is not None:
            out["placement"] = {"tp": args.tp, "suggestions": [p.to_dict() for p in placements]}
            if not view.gpus:
                out["placement"]["note"] = NO_GPU_NOTE
        json.dump(out, sys.stdout, indent=1)
        sys.stdout.write("\n")
        return 0
    sys.stdout.write(render(view, host, placements, tp=args.tp))
    return 0


# -- text ---------------------------------------------------------------------------------------
def _table(headers: list[str], rows: list[list[str]]) -> list[str]:
    widths = [max(len(h), *(len(r[i]) for r in rows)) if rows else len(h) for i, h in enumerate(headers)]
    line = lambda cells: "  ".join(c.ljust(w) for c, w in zip(cells, widths)).rstrip()  # noqa: E731
    return [line(headers), *(line(r) for r in rows)]


def _na(value, fmt: str = "{}") -> str:
    return "n/a" if value is None else fmt.format(value)


def _gib(n: int | None) -> str:
    return "n/a" if n is None else f"{n / GIB:.1f}"


def _pcie(g: GpuInfo) -> str:
    if g.pcie_gen is None and g.pcie_width is None:
        return "n/a"
    text = f"gen{_na(g.pcie_gen)}/{_na(g.pcie_gen_max)} x{_na(g.pcie_width)}/{_na(g.pcie_width_max)}"
    return text + " DEGRADED" if g.pcie_degraded else text


def _gpu_rows(view: GpuView) -> list[str]:
    rows = []
    for g in view.gpus:
        mem = f"{_gib(g.memory_used)}/{_gib(g.memory_total)} GiB"
        power = f"{_na(g.power_w, '{:.0f}')}/{_na(g.power_cap_w, '{:.0f}')} W"
        clocks = f"{_na(g.clock_sm_mhz)}/{_na(g.clock_sm_max_mhz)}"
        nv = sum(link.active for link in g.nvlinks)
        procs = ", ".join(f"{p.name or '?'}({p.pid})" for p in g.processes[:3])
        if len(g.processes) > 3:
            procs += f" +{len(g.processes) - 3}"
        rows.append([str(g.index), g.name or "n/a", (g.bus_id or "n/a")[-12:], mem, _na(g.util_gpu, "{:.0f}%"),
                     _na(g.temperature_c, "{:.0f}C"), power, clocks, _pcie(g), str(nv) if g.nvlinks else "-",
                     _na(g.numa_node), procs or "-"])
    return _table(["GPU", "Name", "Bus", "Memory", "Util", "Temp", "Power", "SM MHz", "PCIe", "NVLink", "NUMA",
                   "Processes"], rows)


def _links(view: GpuView) -> list[str]:
    n = len(view.gpus)
    headers = [""] + [f"GPU{i}" for i in range(n)] + ["CPU Affinity", "NUMA"]
    rows = []
    for i, g in enumerate(view.gpus):
        cpus = format_cpulist(g.cpu_affinity) if g.cpu_affinity else "n/a"
        rows.append([f"GPU{i}", *view.links[i], cpus, _na(g.numa_node)])
    used = {x for row in view.links for x in row if x != "X"}
    legend = []
    for key, meaning in LINK_MEANING.items():
        if key in used or (key == "NV#" and any(u.startswith("NV") for u in used)):
            legend.append(f"  {key:<5} {meaning}")
    return _table(headers, rows) + (["Legend:", *legend] if legend else [])


def _unavailable(view: GpuView) -> list[str]:
    lines = []
    for g in view.gpus:
        for field_name, reason in sorted(g.unavailable.items()):
            lines.append(f"  GPU{g.index} {field_name}: {reason}")
    return lines


def _host(host: HostInfo) -> list[str]:
    out = [f"Host {host.hostname}: {host.cpu_model or 'unknown CPU'}, {host.cpus_logical} logical CPUs"
           + (f" ({host.cpus_physical} cores)" if host.cpus_physical else "")
           + f", CPU use {_na(host.cpu_percent, '{:.0f}%')}"
           + (f", load {host.load_avg[0]:.2f} {host.load_avg[1]:.2f} {host.load_avg[2]:.2f}" if host.load_avg else ""),
           f"Memory: {_gib(host.memory_total - host.memory_available)}/{_gib(host.memory_total)} GiB used "
           f"({host.memory_percent:.0f}%), {_gib(host.memory_available)} GiB available", "", "NUMA nodes"]
    out += _table(["Node", "CPUs", "Memory GiB", "Free GiB", "Distances"],
                  [[str(n.node), format_cpulist(n.cpus) or "-", _gib(n.memory_total), _gib(n.memory_free),
                    " ".join(map(str, n.distances)) or "-"] for n in host.numa])
    out += ["", "Disks"]
    out += _table(["Role", "Path", "Mount", "FS", "Free GB", "Total GB", "Used"],
                  [[d.role, d.path, d.mount or "?", d.fstype or "?", f"{d.free / 1e9:.1f}", f"{d.total / 1e9:.1f}",
                    _used_pct(d)] for d in host.disks])
    return out


def _used_pct(d: DiskInfo) -> str:
    pct = disk_figures(d.total, d.used, d.free).used_pct
    return "?" if pct is None else f"{pct}%"


def _placements(tp: int, placements: list[Placement]) -> list[str]:
    out = [f"Placement for TP {tp} (best first)"]
    for rank, p in enumerate(placements, 1):
        nodes = ",".join(map(str, p.numa_nodes)) or "?"
        out.append(f"  {rank}. GPUs {','.join(map(str, p.gpus))}  worst link {p.worst_link}  NUMA {nodes}  "
                   f"CPUs {p.cpulist or '?'}")
        env = " ".join(f"{k}={v}" for k, v in p.env.items())
        out.append(f"     {env} {' '.join(p.numactl)} <server command>".rstrip())
        for note in p.notes:
            out.append(f"     note: {note}")
    return out


def render(view: GpuView, host: HostInfo | None, placements: list[Placement] | None = None,
           tp: int | None = None) -> str:
    lines: list[str] = []
    if view.gpus:
        head = f"GPUs: {len(view.gpus)}"
        if view.driver_version:
            head += f"  driver {view.driver_version}"
        if view.cuda_driver_version:
            head += f"  CUDA {view.cuda_driver_version}"
        lines += [head, *_gpu_rows(view), "", "Links", *_links(view)]
        missing = _unavailable(view)
        if missing:
            lines += ["", "Unavailable", *missing]
    else:
        lines.append(f"GPUs: none ({view.reason or 'unknown reason'})")
    if placements:
        lines += ["", *_placements(tp or len(placements[0].gpus), placements)]
    elif tp is not None and not view.gpus:
        lines += ["", f"Placement for TP {tp}: {NO_GPU_NOTE}"]
    if host is not None:
        lines += ["", *_host(host)]
    return "\n".join(lines) + "\n"
