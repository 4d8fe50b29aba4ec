"""Schema migrations, applied in order by `open_db`.

Append-only: never edit or reorder a migration that has shipped; add a new function at the END
of this file (a database in the field may have any prefix of this list applied). Each migration
runs inside one transaction together with the record of it having been applied.

Conventions: every table has an integer primary key `id`; times are Unix epoch seconds (REAL);
JSON documents are TEXT columns whose names say so in the comments below.
"""

from __future__ import annotations

from sqlite_utils import Database
from sqlite_utils.migrations import Migrations

#: The name of our migration set in `_sqlite_migrations` (other sets may share the file).
MIGRATION_SET = "ddtree-console"

#: Written into the SQLite header (`PRAGMA application_id`) so a foreign database is recognised.
APPLICATION_ID = 0x64647472  # "ddtr"

migrations = Migrations(MIGRATION_SET)


@migrations()
def m001_initial(db: Database) -> None:
    db.execute(f"PRAGMA application_id = {APPLICATION_ID}")
    db["jobs"].create(
        {
            "id": int,
            "kind": str,
            "name": str,
            "state": str,
            "spec": str,  # JSON
            "result": str,  # JSON
            "host": str,  # hostname of the machine the runner runs on
            "pid": int,  # runner pid
            "pgid": int,  # runner process group (its own session)
            "pid_started": float,  # runner's process start time, to tell a reused pid apart
            "log_path": str,
            "progress_done": float,
            "progress_total": float,
            "progress_message": str,
            "heartbeat_at": float,
            "cancel_requested_at": float,
            "cancel_grace_s": float,
            "created_at": float,
            "started_at": float,
            "ended_at": float,
            "error": str,
        },
        pk="id",
        not_null=["kind", "state", "spec", "created_at"],
    )
    db["jobs"].create_index(["state"])
    db["job_events"].create(
        {"id": int, "job_id": int, "at": float, "state": str, "message": str},
        pk="id",
        not_null=["job_id", "at", "state"],
        foreign_keys=[("job_id", "jobs", "id")],
    )
    db["job_events"].create_index(["job_id"])
    # Child processes a runner started (ctx.spawn), so a cancel or a reconcile can still reach
    # them after the runner itself died.
    db["processes"].create(
        {
            "id": int,
            "job_id": int,
            "name": str,
            "argv": str,  # JSON list
            "pid": int,
            "pgid": int,
            "pid_started": float,
            "log_path": str,
            "started_at": float,
            "ended_at": float,
            "returncode": int,
        },
        pk="id",
        not_null=["job_id", "name", "pid", "started_at"],
        foreign_keys=[("job_id", "jobs", "id")],
    )
    db["processes"].create_index(["job_id"])
    db["downloads"].create(
        {
            "id": int,
            "job_id": int,
            "repo_id": str,
            "revision": str,
            "include": str,  # JSON list of globs
            "local_dir": str,
            "state": str,
            "bytes_total": int,
            "bytes_done": int,
            "files_total": int,
            "files_done": int,
            "rate_bps": float,
            "eta_s": float,
            "disk_free_bytes": int,
            "reserve_bytes": int,
            "created_at": float,
            "updated_at": float,
            "ended_at": float,
            "error": str,
        },
        pk="id",
        foreign_keys=[("job_id", "jobs", "id")],
    )
    db["downloads"].create_index(["job_id"])
    db["engines"].create(
        {
            "id": int,
            "job_id": int,
            "kind": str,  # builtin | sglang | vllm
            "model": str,
            "draft_model": str,
            "algorithm": str,
            "budget": int,
            "block_size": int,
            "tp": int,
            "gpus": str,  # JSON list
            "python": str,
            "extra_args": str,  # JSON list
            "host": str,
            "port": int,
            "base_url": str,
            "pid": int,
            "pgid": int,
            "log_path": str,
            "state": str,
            "created_at": float,
            "ready_at": float,
            "ended_at": float,
            "error": str,
        },
        pk="id",
        foreign_keys=[("job_id", "jobs", "id")],
    )
    db["engines"].create_index(["job_id"])
    db["runs"].create(
        {
            "id": int,
            "job_id": int,
            "name": str,
            "recipe": str,  # the recipe as JSON (what `export --format recipe` turns back into TOML)
            "recipe_path": str,
            "recipe_git_rev": str,
            "engine_kind": str,
            "model": str,
            "draft_model": str,
            "hardware": str,  # JSON fingerprint
            "software": str,  # JSON versions
            "state": str,
            "points_total": int,
            "created_at": float,
            "started_at": float,
            "ended_at": float,
            "error": str,
        },
        pk="id",
        not_null=["created_at"],
        foreign_keys=[("job_id", "jobs", "id")],
    )
    db["runs"].create_index(["job_id"])
    db["points"].create(
        {
            "id": int,
            "run_id": int,
            # parameters (one grid cell)
            "engine_kind": str,
            "algorithm": str,
            "budget": int,
            "block_size": int,
            "tp": int,
            "concurrency": int,
            "dataset": str,
            "temperature": float,
            "repeat": int,
            "num_prompts": int,
            "max_new_tokens": int,
            "state": str,
            "started_at": float,
            "ended_at": float,
            # metrics
            "requests_ok": int,
            "requests_failed": int,
            "output_tokens": int,
            "duration_s": float,
            "output_tok_s": float,
            "req_s": float,
            "ttft_p50": float,
            "ttft_p90": float,
            "ttft_p99": float,
            "itl_p50": float,
            "itl_p90": float,
            "itl_p99": float,
            "e2e_p50": float,
            "e2e_p90": float,
            "e2e_p99": float,
            "tau_mean": float,
            "tau_weighted": float,
            "tau_hist": str,  # JSON list, index = accept length
            "speedup_vs_ar": float,
            "speedup_vs_dflash": float,
            "gpu_util_mean": float,
            "gpu_power_mean": float,
            "error": str,
        },
        pk="id",
        foreign_keys=[("run_id", "runs", "id")],
    )
    db["points"].create_index(["run_id"])
    db["requests"].create(
        {
            "id": int,
            "point_id": int,
            "idx": int,
            "ok": int,
            "prompt_tokens": int,
            "completion_tokens": int,
            "ttft_s": float,
            "itl_mean_s": float,
            "e2e_s": float,
            "verify_ct": int,
            "accept_length": float,
            "started_at": float,
            "error": str,
        },
        pk="id",
        foreign_keys=[("point_id", "points", "id")],
    )
    db["requests"].create_index(["point_id"])
    db["telemetry"].create(
        {
            "id": int,
            "at": float,
            "gpu_index": int,
            "util": float,
            "mem_used": int,
            "mem_total": int,
            "power_w": float,
            "temp_c": float,
            "job_id": int,
            "point_id": int,
        },
        pk="id",
        not_null=["at"],
    )
    db["telemetry"].create_index(["at"])


@migrations()
def m002_sweep_points(db: Database) -> None:
    # Sweeps (issue 7): a point's identity within its run, so a resumed sweep updates the row it
    # left behind instead of adding a second one; the GPU set; failure causes; repeat agreement.
    db["points"].add_column("point_key", str)  # JSON of the grid parameters (jobs/plan.point_key)
    db["points"].add_column("gpus", str)  # JSON list
    db["points"].add_column("baseline", int)  # 1 when measured only as a baseline for speedups
    db["points"].add_column("idx", int)  # position in the plan (run order)
    db["points"].add_column("tok_s_per_user", float)
    db["points"].add_column("failures", str)  # JSON {cause: count}
    db["points"].add_column("warnings", str)  # JSON list
    db["points"].add_column("repeat_spread", float)  # (max - min) / median of output tok/s over repeats
    db["points"].add_column("unstable", int)  # 1 when repeats disagree by more than the recipe allows
    db["points"].create_index(["run_id", "point_key"], unique=True)
    db["requests"].add_column("finish_reason", str)
    db["requests"].add_column("detail", str)
    db["requests"].add_column("accept_hist", str)  # JSON list, index = accept length


@migrations()
def m003_point_counters(db: Database) -> None:
    # SGLang/vLLM engines (issue 8): a point's acceptance from the difference of the server's
    # Prometheus counters scraped just before and just after it (never the cumulative
    # /server_info figure, which mixes every run since the server booted).
    db["points"].add_column("tau_counters", float)  # tokens per verify round over the point
    db["points"].add_column("accept_counters", str)  # JSON: engine.metrics.RunAcceptance.to_dict()


@migrations()
def m004_engine_backend(db: Database) -> None:
    # Builtin engines (issue 14): which backend the server chose ("fast" | "transformers"), read
    # from its listening announcement once it is up; NULL for sglang/vllm and older rows.
    db["engines"].add_column("backend", str)


def _cell_key(point_key: str) -> str | None:
    """The point key without its repeat (store/sweeps.cell_key; repeated here so this migration
    keeps doing what it did when later code changes)."""
    import json

    try:
        params = json.loads(point_key)
    except (TypeError, ValueError):
        return None
    if not isinstance(params, dict):
        return None
    params.pop("repeat", None)
    return json.dumps(params, sort_keys=True, separators=(",", ":"))


@migrations()
def m005_point_repeats(db: Database) -> None:
    # Repeats (issue 16): each repeat of a grid cell is its own point row; `cell_key` names the cell
    # (the point key less the repeat), so the repeats of a cell are one indexed lookup and the unique
    # index keeps every (cell, repeat) exactly once however often a run is resumed. `cv` is the
    # coefficient of variation of the cell's output tok/s over its done repeats (store/stats.py).
    db["points"].add_column("cell_key", str)
    db["points"].add_column("cv", float)
    rows = db.execute("SELECT id, point_key FROM points WHERE point_key IS NOT NULL").fetchall()
    for point_id, key in rows:
        db.execute("UPDATE points SET cell_key = ? WHERE id = ?", [_cell_key(key), point_id])
    db["points"].create_index(["run_id", "cell_key", "repeat"], unique=True)


@migrations()
def m006_point_contention(db: Database) -> None:
    # Contention (issue 16): what competed with each point while it ran, so a busy box is visible
    # wherever the point is shown. `contention` is JSON (engine/contention.Contention.to_dict() plus
    # "reasons"); `contended` is 1 when any reason was found, 0 when none, NULL when not measured.
    db["points"].add_column("contention", str)  # JSON
    db["points"].add_column("contended", int)
