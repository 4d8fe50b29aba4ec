"""Every action of the console, once: the command palette (ctrl+p) and the help screen read it."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

from textual.app import App, SystemCommand
from textual.binding import Binding


@dataclass(frozen=True)
class Action:
    key: str | None
    action: str  # a Textual action string run on the app
    title: str
    help: str
    pane: str | None = None  # the pane whose key it is (None: everywhere)
    #: The action is the pane's own (run on the pane widget, the pane shown first), not the app's.
    local: bool = False
    footer: str | None = None  # the label in the pane's footer (None: the pane binds no key for it)
    binding_id: str | None = None  # the pane binding's id, kept stable so a keymap can name it


PANES = (
    ("overview", "1", "Overview", "running jobs, GPU strip, disk headroom"),
    ("hardware", "2", "Hardware", "GPUs, links, NUMA nodes, suggested GPU sets"),
    ("downloads", "3", "Downloads", "downloads with rate, ETA and disk headroom"),
    ("engines", "4", "Engines", "running servers, their health and logs"),
    ("sweeps", "5", "Sweeps", "live budget curves and the points of a sweep"),
    ("history", "6", "History", "all runs: filter, sort, compare, export"),
)

#: Shorter tab titles for a narrow terminal (app.TABS_FULL_W): the full ones need 69 columns, and
#: the tab bar would cut "6 History" mid-word at 60.
SHORT_TITLES = {"hardware": "HW", "downloads": "DL"}

LOCAL = True  # a row's last field: the action is the pane's own (see Action.local)

#: Each pane's own keys: (key, action, title, help, footer label, binding id), and LOCAL where the pane
#: widget runs it. A row with no footer label is listed in the palette and help only.
PANE_ACTIONS: dict[str, tuple[tuple, ...]] = {
    "overview": (
        ("l", "toggle_log", "Show the job's log", "the selected job's log instead of GPUs and disks",
         "Log", "overview_log", LOCAL),
        ("x", "cancel_job", "Cancel the selected job", "asks for confirmation", "Cancel", "overview_cancel", LOCAL),
        ("g", "goto_job", "Go to the job's pane", "its sweep, engine or download (Enter too)",
         "Go to pane", "overview_goto", LOCAL),
    ),
    "downloads": (
        ("d", "new_download", "Start a download", "repo id, include globs and disk reserve",
         "New download", "new_download"),
        ("x", "stop_download", "Stop the selected download", "asks for confirmation", "Stop", "stop_download"),
    ),
    "engines": (
        ("n", "new_engine", "Start an engine", "the builtin server on a model and drafter",
         "New engine", "new_engine"),
        ("x", "stop_engine", "Stop the selected engine", "asks for confirmation", "Stop", "stop_engine"),
        ("f", "engine_follow", "Follow the engine log", "keep the log scrolled to its end",
         "Follow", "engine_follow"),
        ("w", "engine_wrap", "Wrap the engine log", "wrap long log lines", "Wrap", "engine_wrap"),
        ("/", "engine_search", "Search the engine log", "show only lines containing a text",
         "Search", "engine_search"),
        ("a", "toggle_stopped", "Stopped engines too", "list stopped and failed engines as well",
         "Stopped too", "engine_show_stopped", LOCAL),
    ),
    "sweeps": (
        ("n", "new_sweep", "Start a sweep", "from a form or a recipe file, with the plan shown first",
         "New sweep", "new_sweep"),
        ("x", "stop_sweep", "Stop the shown sweep", "asks for confirmation; resume later", "Stop", "stop_sweep"),
        ("e", "settle_sweep", "Measure extra repeats", "a new run of the budgets the recommendation cannot "
         "decide yet, with the repeats it asks for (as `sweep --settle`)", "More", "settle_sweep"),
        ("[", "sweep_prev", "Previous run", "show the previous run's curves", "Prev run", "sweep_prev"),
        ("]", "sweep_next", "Next run", "show the next run's curves", "Next run", "sweep_next"),
        ("h", "toggle_heatmap", "Show the acceptance heatmap", "budgets by accepted length per round, "
         "instead of the curves", "Heatmap", "sweep_heatmap", LOCAL),
    ),
    "history": (
        ("/", "history_filter", "Filter runs", "name, model, engine, state or recipe text",
         "Filter", "history_filter"),
        ("enter", "history_open", "Open the run", "its points, settings, environment and log", None, None),
        ("space", "history_mark", "Select a run", "select two or more to compare", "Select", "history_mark"),
        ("c", "history_compare", "Compare selected runs", "settings, metric deltas, overlaid curves",
         "Compare", "history_compare"),
        ("e", "history_export", "Export the run", "csv, json, md or recipe", "Export", "history_export"),
        ("s", "history_sort", "Sort runs", "cycle the sort column", "Sort", "history_sort"),
    ),
}

ACTIONS: tuple[Action, ...] = (
    *(Action(key, f"show_pane('{pane}')", f"Go to {title}", text) for pane, key, title, text in PANES),
    Action("m", "maximize_pane", "Maximise / restore the pane", "the current pane fills the screen"),
    Action("?", "help", "Help", "keys and what each pane shows"),
    Action("t", "toggle_theme", "Dark / light theme", "switch between the dark and the light theme"),
    Action("r", "refresh", "Refresh now", "read the store at once instead of at the next poll"),
    Action("q", "quit", "Quit", "close the console; jobs keep running"),
    *(Action(key, action, title, text, pane, local=bool(rest and rest[0]), footer=footer, binding_id=binding_id)
      for pane, rows in PANE_ACTIONS.items() for key, action, title, text, footer, binding_id, *rest in rows),
)

_KEY_NAMES = {"/": "slash", "[": "left_square_bracket", "]": "right_square_bracket"}


def bindings(pane: str) -> list[Binding]:
    """A pane's BINDINGS, from its rows above: so the footer, the palette and the help name the same keys."""
    return [Binding(_KEY_NAMES.get(a.key, a.key), a.action if a.local else f"app.{a.action}", a.footer,
                    id=a.binding_id,
                    # priority, so the keys typed right behind / reach the box (the app skips it while typing)
                    priority=a.key == "/")
            for a in ACTIONS if a.pane == pane and a.footer]


def system_commands(app: App) -> Iterator[SystemCommand]:
    """The palette's entries: every action above, run through the app."""
    for a in ACTIONS:
        key = f" ({a.key})" if a.key else ""
        where = f" ({a.pane})" if a.pane else ""
        yield SystemCommand(a.title + key, a.help + where, lambda a=a: run(app, a))


async def run(app: App, a: Action) -> None:
    """Run an action from the palette: the app's, or the pane's own with that pane shown first."""
    if not a.local:
        await app.run_action(a.action)
        return
    await app.run_action(f"show_pane('{a.pane}')")
    await app.query_one(f"#{a.pane}").run_action(a.action)
