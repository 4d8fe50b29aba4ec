"""Hardware: host load and CPU use, the GPU table, the link matrix, NUMA nodes and their GPUs, GPU sets for a TP size."""

from __future__ import annotations

from rich.text import Text
from textual.app import ComposeResult
from textual.containers import Horizontal, Vertical, VerticalScroll
from textual.validation import Integer
from textual.widgets import Input, Label, Static

from ddtree.console.widgets.rowtable import RowTable
from ddtree.console.words import plural
from ddtree.console.widgets.tables import fmt_bytes, sync_table

# PCIe last: at 80 columns the figures that change (memory, util, power) and the NUMA node stay on screen.
GPU_COLUMNS = ("GPU", "NAME", "MEMORY", "UTIL", "TEMP", "POWER", "NUMA", "PROCS", "PCIE")


def _num(value, unit: str = "", spec: str = ".0f") -> str:
    return "-" if value is None else f"{format(value, spec)}{unit}"


def gpu_memory(used: int | None, total: int | None) -> str:
    """`0.6/85.5 GB`: one unit for both, so the column stays narrow enough for 80 columns."""
    if not total:
        return "-"
    if total < 1e9 or used is None:
        return f"{fmt_bytes(used)}/{fmt_bytes(total)}"
    return f"{used / 1e9:.1f}/{total / 1e9:.1f} GB"


def gpu_rows(view) -> list[tuple[str, tuple]]:
    rows = []
    for g in view.gpus:
        mem = gpu_memory(g.memory_used, g.memory_total)
        pcie = "-" if g.pcie_gen is None else f"gen{g.pcie_gen} x{g.pcie_width}"
        if g.pcie_degraded:
            pcie = Text(pcie + f" (<x{g.pcie_width_max})", style="red")
        power = "-" if g.power_w is None else f"{g.power_w:.0f}/{_num(g.power_cap_w)}W"
        rows.append((str(g.index), (str(g.index), (g.name or "-").replace("NVIDIA ", ""), mem, _num(g.util_gpu, "%"),
                                    _num(g.temperature_c, "C"), power, _num(g.numa_node, "", "d"),
                                    str(len(g.processes)), pcie)))
    return rows


def link_matrix(view) -> Text:
    from ddtree.engine.machine.hw import LINK_MEANING

    n = len(view.links)
    if not n:
        return Text("link matrix: unavailable", style="dim")
    out = Text()
    out.append("      " + "".join(f"GPU{j:<3}" for j in range(n)) + "\n", style="bold")
    for i, row in enumerate(view.links):
        out.append(f"GPU{i:<3}", style="bold")
        for level in row:
            style = "green" if level.startswith("NV") else ("red" if level == "SYS" else "")
            out.append(f"{level:<6}", style=style)
        out.append("\n")
    seen = sorted({lvl if not lvl.startswith("NV") else "NV#" for row in view.links for lvl in row} - {"X"})
    for key in seen:
        out.append(f"  {key:<5}", style="bold")
        out.append(f"{LINK_MEANING.get(key, '')}\n", style="dim")
    out.rstrip()
    return out


def numa_text(view, host) -> Text:
    out = Text()
    if host is None:
        return Text("NUMA: reading…", style="dim")
    from ddtree.engine.machine.hw import format_cpulist

    gpus_of: dict[int | None, list[int]] = {}
    for g in (view.gpus if view is not None else []):
        gpus_of.setdefault(g.numa_node, []).append(g.index)
    out.append(f"{host.hostname}: {host.cpu_model or 'CPU'}, {host.cpus_logical} CPUs, "
               f"{fmt_bytes(host.memory_total)} memory\n")
    if not host.numa:
        out.append("NUMA: not reported by this kernel (one node assumed)\n", style="dim")
    for node in host.numa:
        gpus = gpus_of.get(node.node, [])
        out.append(f"node {node.node}", style="bold")
        out.append(f": CPUs {format_cpulist(node.cpus)}, memory {fmt_bytes(node.memory_total)}, "
                   f"GPUs {', '.join(map(str, gpus)) or 'none'}\n")
    if gpus_of.get(None):
        out.append(f"GPUs with unknown NUMA node: {', '.join(map(str, gpus_of[None]))}\n", style="yellow")
    out.rstrip()
    return out


def host_load_text(host) -> Text:
    """Host load and CPU use: a box busy with other work makes every figure measured on it noise."""
    if host is None:
        return Text("host load: reading…", style="dim")
    out = Text()
    cpus = host.cpus_logical or 1
    if host.load_avg is None:
        out.append("load average: unavailable on this platform", style="dim")
        busy = False
    else:
        one, five, fifteen = host.load_avg
        busy = one > cpus
        out.append("load ", style="bold")
        out.append(f"{one:.2f} {five:.2f} {fifteen:.2f}", style="bold yellow" if busy else "")
        out.append(f" (1/5/15 min) on {cpus} CPUs", style="dim")
    out.append("  CPU use ", style="bold")
    out.append("-" if host.cpu_percent is None else f"{host.cpu_percent:.0f}%")
    if host.memory_total:
        out.append("  memory ", style="bold")
        out.append(f"{host.memory_percent:.0f}% used")
    if busy:
        out.append("\nbusy box: more runnable tasks than CPUs; sweep figures measured now will be flagged "
                   "contended", style="yellow")
    return out


def suggestions(view, host, tp: int) -> Text:
    from ddtree.engine.errors import EngineError
    from ddtree.engine.machine.placement import suggest

    if view is None or not view.gpus:
        return Text("no GPU to place a server on", style="dim")
    try:
        placements = suggest(view.gpus, view.links, tp, numa=host.numa if host is not None else None)
    except EngineError as exc:
        return Text(str(exc), style="red")
    out = Text()
    for rank, p in enumerate(placements, 1):
        out.append(f"{rank}. GPUs {','.join(map(str, p.gpus))}", style="bold")
        out.append(f"  NUMA {','.join(map(str, p.numa_nodes)) or '?'}  worst link {p.worst_link}  "
                   f"{' '.join(p.numactl) or 'no pinning'}\n")
        for note in p.notes:
            out.append(f"   {note}\n", style="yellow")
    out.rstrip()
    return out


class HardwarePane(Vertical):
    """Read-only: what NVML and /sys say about the machine. The driver line and the host's load
    stay at the top; the rest scrolls (at 80x24 it does not fit)."""

    ALLOW_MAXIMIZE = True
    _homed = False  # scrolled to the top once the first GPU view arrived

    def compose(self) -> ComposeResult:
        yield Static("", id="gpu-reason")
        yield Static("", id="host-load")
        with VerticalScroll(id="hw-body"):
            yield Static("GPUs", classes="pane-title")
            yield RowTable(*GPU_COLUMNS, id="gpus")
            yield Static("Links", classes="pane-title")
            yield Static("", id="links")
            yield Static("NUMA", classes="pane-title")
            yield Static("", id="numa")
            yield Static("GPU sets for a tensor-parallel size", classes="pane-title")
            with Horizontal(classes="form-row"):
                yield Label("TP size")
                yield Input("2", id="tp", type="integer", validators=[Integer(minimum=1, maximum=64)],
                            restrict=r"[0-9]*", max_length=2, compact=True)
            yield Static("", id="placements")

    def on_mount(self) -> None:
        self.watch(self.app, "hardware", self.show)

    def show(self, hardware) -> None:
        view, host = hardware if hardware is not None else (None, None)
        reason = self.query_one("#gpu-reason", Static)
        if view is None:
            reason.update(Text("reading the hardware…", style="dim"))
        elif not view.gpus:
            reason.update(Text.assemble(("No GPU: ", "bold yellow"), (view.reason or "NVML found no GPU", "yellow"),
                                        ("\nEverything else works: the builtin engine runs on the CPU.", "dim")))
        else:
            reason.update(Text(f"driver {view.driver_version or '?'}, CUDA {view.cuda_driver_version or '?'}, "
                               f"{plural(len(view.gpus), 'GPU')}", style="dim"))
        sync_table(self.query_one("#gpus", RowTable), gpu_rows(view) if view is not None else [])
        self.query_one("#links", Static).update(link_matrix(view) if view is not None else "")
        self.query_one("#numa", Static).update(numa_text(view, host))
        self.query_one("#host-load", Static).update(host_load_text(host))
        self._place()
        if view is not None and not self._homed:
            # the first data grows the tables under a scroll made while they were empty: start at the top
            self._homed = True
            self.call_after_refresh(self.query_one("#hw-body", VerticalScroll).scroll_home, animate=False)

    def _place(self) -> None:
        field = self.query_one("#tp", Input)
        hardware = self.app.hardware
        if hardware is None:
            return
        if not field.is_valid or not field.value:
            self.query_one("#placements", Static).update(Text("TP size must be an integer from 1 to 64", style="red"))
            return
        self.query_one("#placements", Static).update(suggestions(hardware[0], hardware[1], int(field.value)))

    def on_input_changed(self, event: Input.Changed) -> None:
        if event.input.id == "tp":
            self._place()
