"""The engine loop in its own process, as SGLang runs its scheduler: the HTTP side and the rounds
no longer share one GIL.

Measured before this (bench/RESULTS.md, issue 15): in one process the HTTP side (detokenizing,
SSE chunks, socket writes) held the GIL the engine thread needed between rounds, and the server
gave 0.34-0.91 of the same rounds in process. Here the engine process runs the real `Scheduler`
on its `EngineThread`; the HTTP process holds a `RemoteScheduler` with the same surface
(`submit`, `snapshot`, `stop`, `failure`), and the two talk over one socket pair, in pickled
messages:

    HTTP -> engine: (target "module:function", args, parent_pid)                  (once, at start)
                    | ("submit", tid, input_ids, gen, spec, hold) | ("cancel", tid, reason)
                    | ("snapshot", qid) | ("observed", ttft, itl) | ("stop", timeout_s)
    engine -> HTTP: ("ready", facts, config) | ("failed", exit_code, message)     (once, at start)
                    | ("updates", [(tid, submitted_turn, Update fields), ...])    (a turn's, or more)
                    | ("snapshot", qid, Snapshot) | ("stopped",) | ("dead", reason)

With --tokenizer-worker-num N there are N HTTP processes on one port, each with its own socket
pair to the one engine process (the first sends the start message; "ready" goes to all). At a
high token rate one HTTP process's CPU (a socket write per streamed chunk, mostly) caps a small
model's throughput: measured on an H100, 117 us of it per token at 8.5k tokens/s (bench/RESULTS.md).

A turn's updates go in one message, so a batched round over 64 requests costs one pickle and one
write, not 64; with the engine on a GPU, the engine's thread sends it while the GPU runs the next
round (_Outbox).
Nothing here imports torch.
"""

from __future__ import annotations

import ctypes
import importlib
import itertools
import logging
import os
import queue
import signal
import socket
import subprocess
import sys
import threading
import time
from concurrent.futures import Future
from multiprocessing.connection import Connection
from multiprocessing.connection import wait as connection_wait
from dataclasses import dataclass, replace
from functools import partial
from typing import Any, Callable

from ddtree.engine.errors import EngineError
from ddtree.engine.reference.scheduler import (EngineThread, Histogram, QueueFull, Scheduler, ShuttingDown, Snapshot,
                                               Stats, Ticket, Update)

log = logging.getLogger(__name__)

#: How the engine process writes to the HTTP side (_Outbox's modes): DDTREE_OUTBOX=wait|thread|inline
#: overrides the choice by device, to measure one against another (bench_server.py).
OUTBOX_MODES = ("wait", "thread", "inline")
OUTBOX_MODE = os.environ.get("DDTREE_OUTBOX", "")


@dataclass(frozen=True)
class EngineFacts:
    """What the HTTP side needs of a loaded engine, under the engine's own attribute names (the
    request parser and /server_info read either), so it can live in the other process."""

    tokenizer: Any
    context_window: int
    max_budget: int | None
    draft_name: str | None
    block_size: int
    vocab_size: int | None
    device: str
    backend: str
    backend_reason: str
    attention: str
    graphs: bool
    prefill_chunk: int
    mixed_chunk: bool = False
    max_prefill_tokens: int = 0
    cpu_threads: int | None = None
    outbox: str = ""  # how the engine process sends its updates (outbox_mode)
    cublas_workspace: str | None = None
    round_ahead: bool = False

    @classmethod
    def of(cls, engine: Any) -> "EngineFacts":
        return cls(tokenizer=engine.tokenizer, context_window=engine.context_window, max_budget=engine.max_budget,
                   draft_name=engine.draft_name, block_size=engine.block_size,
                   vocab_size=engine.vocab_size, device=str(engine.device),
                   backend=engine.backend, backend_reason=engine.backend_reason, attention=engine.attention,
                   graphs=bool(engine.graphs),
                   prefill_chunk=engine.prefill_chunk, mixed_chunk=bool(engine.mixed_chunk),
                   max_prefill_tokens=int(getattr(engine, "max_prefill_tokens", 0)),
                   cpu_threads=engine.cpu_threads, outbox=outbox_mode(engine),
                   cublas_workspace=getattr(engine, "cublas_workspace", None),
                   round_ahead=bool(getattr(engine, "round_ahead", False)))


# -- the engine process ------------------------------------------------------------------------

def die_with_parent(parent_pid: int) -> None:
    """Have the kernel kill this process when its parent dies (Linux), so a server killed with
    SIGKILL never leaves an engine holding the GPU. Elsewhere the closed pipe ends it instead."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        return
    if os.getppid() != parent_pid:  # the parent died before the call took effect
        os._exit(1)


class _Outbox:
    """The engine side of the socket. The updates gathered since the last flush leave as one
    message; messages leave in the order they were queued. Three ways to write them (`mode`):

    "wait" (an engine on a GPU, the default there): the engine's own thread writes a turn's
    updates while the GPU runs the next round. flush() holds them back; the engine calls push()
    right before it blocks on the GPU (Engine.on_gpu_wait: a graphed round, a batched prefill,
    an AR step), and the scheduler calls it when it runs out of work. Updates held for HOLD_S
    go at the next flush, so a turn with no such wait delays them by one turn at most. Measured
    on an H100 (bench/RESULTS.md, 1.7B shape, AR, c=64): with a sender thread the engine's calls
    ran 14-18% longer than in process, and py-spy put the engine thread in frames without the
    GIL while the sender pickled (every torch call releases the GIL, and the sender took it
    then); with this mode 7% longer, and the server gave 0.87 of in process against 0.77.
    "thread": a thread of their own pickles and writes them, overlapping the next turn. At most
    MAX_QUEUED messages wait: past that the engine's thread waits too, so an HTTP side that
    falls behind slows the rounds rather than the backlog growing without bound.
    "inline" (an engine on the CPU): the caller writes at once, as the round is the CPU's own
    work and a second thread only competes for it (measured: 5-10% longer AR steps on this
    2-core box).
    Messages other than updates (snapshots, "ready", "stopped", ...) come from the main thread
    and are written by it (by the sender thread in "thread" mode), after what was held."""

    MAX_QUEUED = 64
    HOLD_S = 0.002

    def __init__(self, conn: Any, mode: str = "thread") -> None:
        if mode not in OUTBOX_MODES:
            raise ValueError(f"outbox mode must be wait, thread or inline, got {mode!r}")
        self.conn = conn
        self.mode = mode
        self._lock = threading.Lock()
        self._items: list[tuple[int, int, Update]] = []
        self._first = 0.0  # when the oldest of _items was put ("wait")
        if mode == "thread":
            # A C queue: putting costs the engine's thread far less than a Condition's notify.
            self._queue: queue.SimpleQueue = queue.SimpleQueue()
            self._room = threading.Semaphore(self.MAX_QUEUED)
            threading.Thread(target=self._run, name="engine-outbox", daemon=True).start()

    def put(self, tid: int, ticket: Ticket, update: Update) -> None:
        with self._lock:
            if not self._items:
                self._first = time.perf_counter()
            self._items.append((tid, ticket.submitted_turn, update))

    def flush(self) -> None:
        """The updates put so far are ready to leave together ("wait": they are held a while)."""
        with self._lock:
            if self.mode == "wait" and self._items and time.perf_counter() - self._first < self.HOLD_S:
                return
            self._queue_items()

    def push(self) -> None:
        """Send what is held, now."""
        with self._lock:
            self._queue_items()

    def send(self, message: tuple) -> None:
        """Queue a message behind every update put before it."""
        with self._lock:
            self._queue_items()
            self._enqueue(message)

    def drain(self, timeout: float | None = None) -> bool:
        """Wait until everything queued so far has been written, or has failed to be (the HTTP
        side is gone); False if that took longer than timeout."""
        if self.mode != "thread":
            self.push()
            return True  # written by the callers themselves
        done = threading.Event()
        self._queue.put(done)
        return done.wait(timeout)

    def _queue_items(self) -> None:
        if self._items:
            self._enqueue(("updates", self._items))
            self._items = []

    def _enqueue(self, message: tuple) -> None:
        if self.mode != "thread":
            self._deliver(message)  # under self._lock, so writers take turns
            return
        self._room.acquire()
        self._queue.put(message)

    def _take(self, block: bool = True) -> Any:
        message = self._queue.get(block)
        if isinstance(message, tuple):
            self._room.release()
        return message

    def _run(self) -> None:
        next_up = None
        while True:
            message, next_up = (next_up if next_up is not None else self._take()), None
            if isinstance(message, threading.Event):  # a drain's mark: all before it has gone
                message.set()
                continue
            if message[0] == "updates":
                items = list(message[1])
                while next_up is None:  # the turns queued meanwhile go in the same message
                    try:
                        more = self._take(block=False)
                    except queue.Empty:
                        break
                    if isinstance(more, tuple) and more[0] == "updates":
                        items += more[1]
                    else:
                        next_up = more
                message = ("updates", items)
            self._deliver(message)

    def _deliver(self, message: tuple) -> None:
        if message[0] != "updates":
            self._write(message)
            return
        # As plain tuples: pickle handles those in C, a named tuple through copyreg in Python
        # (64 updates: about 10 us against 140).
        rows = [(tid, turn, tuple(update)) for tid, turn, update in message[1]]
        if self._write(("updates", rows)) is None:
            # One update that cannot be pickled (an error carrying something odd) must not lose
            # the others: they go one by one, and it ends its request with the reason.
            for tid, turn, fields in rows:
                if self._write(("updates", [(tid, turn, fields)])) is None:
                    why = EngineError("this request's update could not be pickled for the HTTP process")
                    abort = Update(done=True, finish_reason="abort", error=why)
                    self._write(("updates", [(tid, turn, tuple(abort))]))

    def _write(self, message: tuple) -> bool | None:
        """Send one message: True if it went, False if the HTTP side is gone (the socket's read
        end then tells the loop to stop), None if it cannot be pickled (logged)."""
        try:
            self.conn.send(message)
        except (BrokenPipeError, EOFError, OSError):
            return False
        except Exception:  # boundary: a message that cannot be pickled must not stop the rest
            log.exception("sending %s to the HTTP process failed", message[0])
            return None
        return True


def outbox_mode(engine: Any) -> str:
    """_Outbox's mode for this engine, unless DDTREE_OUTBOX names one. A fast GPU round leaves
    the host idle while it waits: the engine's thread writes then (the transformers path marks
    no such waits: a sender thread). A CPU round is the CPU's own work, which a second thread
    would only compete for."""
    if OUTBOX_MODE in OUTBOX_MODES:
        return OUTBOX_MODE
    if not str(getattr(engine, "device", "cpu")).startswith("cuda"):
        return "inline"
    return "wait" if getattr(engine, "backend", "") == "fast" else "thread"


def host(conns: list, engine: Any, config: Any, thread: EngineThread, greeting: tuple = ()) -> None:
    """Run `engine`'s rounds for the requests that arrive on `conns` (one per HTTP process), until
    each has said "stop" or gone away. Call after the engine is loaded and warmed up, on `thread`.

    Several HTTP processes (--tokenizer-worker-num) share the one engine: a request is known by
    (its process's index, its id there), its updates go back on its own process's socket, and an
    HTTP process that stops or dies takes its unfinished requests with it while the others run on.
    A worker's first message, ("hello",), is answered ("ready", *greeting): the loaded engine's
    facts go to each worker when it asks, through its outbox, so a worker that is slow to start or
    dies first holds up nothing and takes nothing down."""
    mode = outbox_mode(engine)
    outboxes = [_Outbox(conn, mode) for conn in conns]

    def publish() -> None:
        for outbox in outboxes:
            outbox.flush()

    def push() -> None:
        for outbox in outboxes:
            outbox.push()

    if mode == "wait":
        engine.on_gpu_wait = push
    scheduler = Scheduler.for_server(engine, config, thread=thread, on_publish=publish, on_idle=push)
    tickets: dict[tuple[int, int], Ticket] = {}
    # Each HTTP process's TTFT and ITL as it last sent them (it sends its own right before each
    # snapshot it asks for), kept after it leaves: every term only grows, so the sum /metrics
    # shows never falls, whichever process a poll reaches.
    observed: dict[int, tuple[Histogram, Histogram]] = {}

    def relay(key: tuple[int, int], ticket: Ticket, update: Update) -> None:
        if update.done or update.error is not None:
            tickets.pop(key, None)
        outboxes[key[0]].put(key[1], ticket, update)

    def loop_ended(looping: Future) -> None:
        # The rounds stopped for good (a bug): say why, then go, so the HTTP side fails what it
        # held and the server exits with the reason rather than hanging its requests.
        if not looping.cancelled() and looping.exception() is not None:
            for outbox in outboxes:
                outbox.send(("dead", scheduler.failure))
            for outbox in outboxes:
                outbox.drain(10.0)
            os._exit(1)

    def all_observed() -> tuple[Histogram, Histogram]:
        ttft, itl = Histogram(), Histogram()
        for their_ttft, their_itl in observed.values():
            ttft, itl = ttft.merged(their_ttft), itl.merged(their_itl)
        return ttft, itl

    def let_go(index: int) -> None:
        # An HTTP process that stops or dies while others serve: nobody reads its requests now.
        # (A copy first: the engine's thread retires finished tickets from the dict meanwhile.)
        for key, ticket in list(tickets.items()):
            if key[0] == index:
                ticket.cancel("abort")

    scheduler.start().add_done_callback(loop_ended)
    live = dict(enumerate(conns))
    while live:
        for conn in (connection_wait(list(live.values())) if len(live) > 1 else live.values()):
            index = conns.index(conn)
            try:
                message = conn.recv()
            except (EOFError, OSError):
                message = ("stop", 5.0, False)  # the HTTP process is gone: nobody reads what is left
            kind = message[0]
            if kind == "submit":
                _, tid, input_ids, gen, spec, hold = message
                key = (index, tid)
                ticket = Ticket(input_ids, gen, spec, None, hold)
                ticket.sink = partial(relay, key, ticket)
                tickets[key] = ticket
                try:
                    scheduler.enqueue(ticket)
                except EngineError as exc:  # one HTTP process: it caps what it sends, so only a race gets here
                    relay(key, ticket, Update(done=True, finish_reason="abort", error=exc))
                    outboxes[index].push()
                else:
                    if len(conns) > 1:  # several: this is where admission is decided (RemoteScheduler)
                        outboxes[index].send(("admitted", tid))
            elif kind == "cancel":
                ticket = tickets.get((index, message[1]))
                if ticket is not None:
                    ticket.cancel(message[2])
            elif kind == "observed":
                seen = observed.get(index)
                # Sent by two of its threads (its snapshot's and its timer's): keep the newer.
                if seen is None or message[1].count + message[2].count >= seen[0].count + seen[1].count:
                    observed[index] = (message[1], message[2])
            elif kind == "snapshot":
                snap = scheduler.snapshot(time.perf_counter())
                ttft, itl = all_observed()
                snap = replace(snap, stats=replace(snap.stats, ttft=ttft, itl=itl))
                outboxes[index].send(("snapshot", message[1], snap))
            elif kind == "hello":
                outboxes[index].send(("ready", *greeting))
            elif kind == "stop":
                del live[index]
                answer = len(message) < 3 or message[2]
                if live:
                    let_go(index)
                else:
                    scheduler.stop(message[1])
                if answer:
                    outboxes[index].send(("stopped",))
                    outboxes[index].drain(10.0)
                if not live:
                    for outbox in outboxes:
                        outbox.drain(10.0)
                    return
                break  # `live` changed: wait on what is left


# -- the HTTP process --------------------------------------------------------------------------

class EngineStartFailed(EngineError):
    """The engine process refused its arguments or failed to load; exit_code is its own."""

    def __init__(self, message: str, exit_code: int = 1) -> None:
        super().__init__(message)
        self.exit_code = exit_code


def start(target: str, args: Any, workers: int = 1) -> tuple[Any, list, EngineFacts, Any]:
    """Start the engine process, which calls `target` ("module:function") with (conns, args,
    parent_pid), and wait until it has loaded and warmed up the engine. `workers` sockets join
    it to the HTTP processes: the first is this process's, the others go to the workers it starts
    (http_workers.HttpWorkers), which each say "hello" for their "ready" (host()).
    Returns (process, conns, facts, config); raises EngineStartFailed."""
    pairs = [socket.socketpair() for _ in range(workers)]
    fds = [theirs.fileno() for _, theirs in pairs]
    # A process of its own, not multiprocessing's spawn: no resource-tracker process beside it,
    # and `ps` shows what it is. It stays in the server's process group, so the job layer's
    # signals to the group reach it.
    process = subprocess.Popen([sys.executable, "-m", __name__, ",".join(map(str, fds))], pass_fds=fds)
    conns = []
    for ours, theirs in pairs:
        theirs.close()
        conns.append(Connection(ours.detach()))
    conn = conns[0]
    try:
        conn.send((target, args, os.getpid()))
        message = conn.recv()
    except (EOFError, OSError):
        process.wait()
        raise EngineStartFailed(f"the engine process exited while loading (exit code {process.returncode})") from None
    if message[0] == "failed":
        try:
            process.wait(60)
        except subprocess.TimeoutExpired:
            process.kill()
        raise EngineStartFailed(message[2], message[1])
    _, facts, config = message
    return process, conns, facts, config


def _child(fds: str) -> None:
    # First thing: Ctrl-C and SIGTERM reach the whole process group, and the HTTP process (which
    # drains its requests, then says "stop") decides when the engine ends.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    conns = [Connection(int(fd)) for fd in fds.split(",")]
    try:
        target, args, parent_pid = conns[0].recv()
    except (EOFError, OSError):
        return
    module, function = target.split(":")
    getattr(importlib.import_module(module), function)(conns, args, parent_pid)


class _RemoteTicket(Ticket):
    def __init__(self, owner: "RemoteScheduler", tid: int, *args: Any) -> None:
        super().__init__(*args)
        self.owner, self.tid = owner, tid
        #: With several HTTP processes: the engine's word that it holds this request (True), or
        #: why not (QueueFull, ...), whichever comes first, its "admitted" or the first update.
        self.admitted: Future | None = Future() if owner.confirms_admission else None

    def settle_admission(self, error: BaseException | None = None) -> None:
        if self.admitted is not None and not self.admitted.done():
            _settle(self.admitted, True, error)

    def cancel(self, reason: str = "abort") -> None:
        first = not self.cancelled
        super().cancel(reason)
        if first and not self.finished:
            self.owner._send(("cancel", self.tid, self.cancel_reason))


def _settle(future: Future, result: Any = None, error: BaseException | None = None) -> None:
    """Resolve a future its waiter may have cancelled (a timed-out or dropped /metrics poll)."""
    if future.set_running_or_notify_cancel():
        if error is not None:
            future.set_exception(error)
        else:
            future.set_result(result)


class RemoteScheduler:
    """The HTTP side's scheduler: each request goes to the engine process, and its updates come
    back to the ticket's sink (on a reader thread, as a Scheduler calls sinks on its own).

    Two locks, never held together: `_lock` guards the tickets and queries, `_send_lock` the
    socket. Nobody holds `_lock` while a send may block on a full socket, so the reader, which
    needs `_lock` to retire a ticket, always drains the engine's side and the engine never
    waits on us for long."""

    #: Seconds between an HTTP worker's sends of its TTFT and ITL to the engine process (workers > 1).
    OBSERVED_EVERY_S = 0.5

    def __init__(self, process: Any, conn: Any, *, max_running: int, max_queued: int,
                 on_failure: Callable[[str], None] | None = None, workers: int = 1,
                 before_stop: Callable[[], None] | None = None) -> None:
        # process: the engine process, or None in an HTTP worker the server started (its parent
        # owns the engine; this side only talks to it).
        self.process, self.conn = process, conn
        self.max_running, self.max_queued = max_running, max_queued
        # One HTTP process admits here, at once. With several, none knows what the others hold:
        # each sends up to all of it, the engine admits or refuses (host()), and a streamed
        # response starts only once it has (Reply.admission), so a refusal is still a 503.
        self.capacity = max_running + max_queued
        self.workers = workers
        self._before_stop = before_stop
        #: TTFT and ITL, observed where the tokens reach the client; the rest comes with snapshot().
        self.stats = Stats()
        self._on_failure = on_failure
        self._lock = threading.Lock()
        self._send_lock = threading.Lock()
        self._tickets: dict[int, _RemoteTicket] = {}
        self._queries: dict[int, Future] = {}
        self._ids = itertools.count()
        self._stopping = False
        self._failure: str | None = None
        self._reader = threading.Thread(target=self._read, name="engine-reader", daemon=True)
        self._observed_done = threading.Event()

    def start(self) -> None:
        self._reader.start()
        if self.workers > 1:
            threading.Thread(target=self._send_observed, name="engine-observed", daemon=True).start()

    def _send_observed(self) -> None:
        """Send this process's TTFT and ITL to the engine process now and then, for the other HTTP
        processes' /metrics (the engine adds them up: host())."""
        sent = -1
        while not self._observed_done.wait(self.OBSERVED_EVERY_S):
            view = self.stats.view(time.perf_counter())
            if view.ttft.count + view.itl.count != sent:
                sent = view.ttft.count + view.itl.count
                if not self._send(("observed", view.ttft, view.itl)):
                    return

    @property
    def failure(self) -> str | None:
        return self._failure

    @property
    def confirms_admission(self) -> bool:
        """Whether the engine admits each request (several HTTP processes; see __init__)."""
        return self.workers > 1

    def submit(self, input_ids: list[int], gen: Any, spec: Any, sink: Callable[[Update], None], *,
               hold: bool = True) -> Ticket:
        with self._lock:
            if self._stopping or self._failure is not None:
                raise ShuttingDown(self._failure or "the server is shutting down")
            # The engine's scheduler holds no more than this side has sent and not seen finish,
            # so it never refuses what this side lets through; this side may refuse a little
            # early (final updates still on their way, at most the engine outbox's queue).
            if len(self._tickets) >= self.capacity:
                raise QueueFull(
                    f"{len(self._tickets)} requests held ({self.max_running} running, the rest queued)",
                    hint="retry later, or start the server with a larger --max-queued-requests",
                )
            tid = next(self._ids)
            ticket = _RemoteTicket(self, tid, input_ids, gen, spec, sink, hold)
            self._tickets[tid] = ticket
        if not self._send(("submit", tid, input_ids, gen, spec, hold)):
            with self._lock:
                self._tickets.pop(tid, None)
            raise ShuttingDown(self._failure or "the engine process is gone")
        return ticket

    def snapshot(self, now: float) -> Future:
        """A future of the engine's Snapshot, with the TTFT and ITL of every HTTP process in it
        (this one's sent just before, on the same socket, so it is current)."""
        future: Future = Future()
        with self._lock:
            if self._failure is not None:
                future.set_exception(ShuttingDown(self._failure))
                return future
            qid = next(self._ids)
            self._queries[qid] = future
        view = self.stats.view(now)
        if not (self._send(("observed", view.ttft, view.itl)) and self._send(("snapshot", qid))):
            with self._lock:
                mine = self._queries.pop(qid, None)
            if mine is not None:  # else the reader's _ended has failed it already
                _settle(mine, error=ShuttingDown(self._failure or "the engine process is gone"))
        return future

    def stop(self, timeout: float = 30.0) -> None:
        if self._before_stop is not None:
            self._before_stop()  # the other HTTP processes end first: the engine serves them till then
        with self._lock:
            self._stopping = True
        self._observed_done.set()
        self._send(("stop", timeout))
        self._reader.join(timeout + 10)
        if self.process is None:
            return
        try:
            self.process.wait(10)
        except subprocess.TimeoutExpired:
            log.warning("the engine process did not stop; killing it")
            self.process.kill()
            self.process.wait()
        if self.process.returncode not in (0, None) and self._failure is None:
            log.warning("the engine process exited with code %s while stopping", self.process.returncode)

    def _send(self, message: tuple) -> bool:
        """Send one message; False when the engine is gone (the reader then fails what it held)."""
        with self._send_lock:
            try:
                self.conn.send(message)
            except (OSError, EOFError):
                return False
        return True

    def _read(self) -> None:
        alive = False
        while True:
            try:
                message = self.conn.recv()
            except (EOFError, OSError):
                break
            except Exception as exc:  # a message that does not unpickle: which tickets it held is lost
                log.exception("a message from the engine process could not be read")
                self._failure = self._failure or (f"a message from the engine process could not be read "
                                                  f"({type(exc).__name__}: {exc})")
                alive = True
                break
            kind = message[0]
            if kind == "updates":
                self._deliver(message[1])
            elif kind == "snapshot":
                self._answer(message[1], message[2])
            elif kind == "admitted":
                ticket = self._tickets.get(message[1])
                if ticket is not None:
                    ticket.settle_admission()
            elif kind == "dead":  # the engine's loop raised; its process exits next
                self._failure = message[1]
            elif kind == "stopped":
                break
        self._ended(wait=not alive)

    def _deliver(self, items: list[tuple[int, int, tuple]]) -> None:
        for tid, turn, fields in items:
            ticket = self._tickets.get(tid)
            if ticket is None:
                continue
            update = Update._make(fields)
            ticket.submitted_turn = turn
            ticket.settle_admission(update.error)
            if update.done or update.error is not None:
                ticket.finished = True
                with self._lock:
                    self._tickets.pop(tid, None)
            try:
                ticket.sink(update)
            except Exception:  # boundary: one consumer that went away must not stop the reader
                log.exception("delivering an update failed")
                # Cancelling sends on the socket, which may block; the reader must keep draining
                # the engine's side, so the send goes from a thread of its own (a rare path).
                threading.Thread(target=ticket.cancel, name="engine-cancel", daemon=True).start()

    def _answer(self, qid: int, snapshot: Snapshot) -> None:
        with self._lock:
            future = self._queries.pop(qid, None)
        if future is None:
            return
        _settle(future, snapshot)  # TTFT and ITL in it: every HTTP process's, this one's included

    def _ended(self, wait: bool = True) -> None:
        """The engine process is gone (stopped, or died), or sent what this side cannot read
        (wait=False: it still runs, until the server's stop ends it): fail whatever it still held."""
        if wait and self.process is not None:
            try:
                self.process.wait(10)
            except subprocess.TimeoutExpired:
                pass
        with self._lock:
            if not self._stopping:
                code = "" if self.process is None else f" (exit code {self.process.returncode})"
                self._failure = self._failure or f"the engine process exited{code}"
            error = ShuttingDown(self._failure or "the server shut down")
            tickets, self._tickets = list(self._tickets.values()), {}
            queries, self._queries = list(self._queries.values()), {}
        for future in queries:
            _settle(future, error=error)
        for ticket in tickets:
            ticket.finished = True
            ticket.settle_admission(ShuttingDown(str(error)))
            try:
                ticket.sink(Update(done=True, finish_reason="abort", error=EngineError(str(error))))
            except Exception:
                log.exception("delivering an update failed")
        if not self._stopping and self._failure is not None:
            log.error("%s", self._failure)
            if self._on_failure is not None:
                self._on_failure(self._failure)


if __name__ == "__main__":
    _child(sys.argv[1])
