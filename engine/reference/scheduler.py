"""Round-robin scheduling of decoding sessions on one engine thread, and the server's counters.

One thread owns the engine (`EngineThread`): the server loads the model, warms it up and runs
every round on it, so torch's CPU kernels keep one OpenMP pool (EngineThread says why). Each turn
it admits waiting requests, then advances every running session by exactly one round (one token
for AR, one draft + one verify for DFlash/DDTree; a new session's first round is its prefill). A
long request therefore delays a new one by at most one round of each other running request, never
by its whole generation.

With `batch=True` and an engine that has `step_many`, the turn prefills new sessions together
(each publishes its first token at once), then runs one batched round over the other running
sessions (at most max_running): every draft in one drafter forward, every verify in one target
forward. Otherwise each session steps alone (`Session.step()`), in turn. If a batched round
fails, the turn falls back to stepping each session alone, so one bad request fails by itself.

Nothing here imports torch: the scheduler only sees the Session API, so it is testable with a
double and reusable by any engine with that API.

Requests past `max_running + max_queued` are refused at once (`QueueFull`, a 503 at the HTTP
layer) rather than growing the queue without bound. A cancelled ticket (client gone, stop string
matched) has its session closed at the start of the next turn.

The scheduler counts its turns (`Scheduler.turns`); each ticket records the turn it was submitted
in and each update the turn that produced it, so fairness can be stated, and tested, in rounds
rather than seconds: a request submitted in turn t is admitted in turn t+1 when a slot is free.
"""

from __future__ import annotations

import gc
import json
import logging
import math
import queue
import threading
import time
from collections import deque
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any, Callable, NamedTuple

from ddtree.engine.errors import EngineError
from ddtree.engine.reference.params import within_prefill_cap

log = logging.getLogger(__name__)


class QueueFull(EngineError):
    """The server holds as many requests as it accepts; the client should retry later."""


class ShuttingDown(EngineError):
    """The server is stopping and takes no new requests."""


class Update(NamedTuple):
    """What one request gained since its previous update (made on the engine thread; with the
    engine in its own process, pickled to the HTTP one). A named tuple, not a dataclass: a turn
    makes one per running request, and a tuple is built, pickled and unpickled about ten times
    faster (a dataclass's pickling alone cost about 2 us an update on each side)."""

    new_ids: tuple[int, ...] = ()
    #: tau of each verify round finished since the previous update (bonus token included).
    new_accepts: tuple[int, ...] = ()
    verify_ct: int = 0
    done: bool = False
    finish_reason: str | None = None  # "length" | "stop" | "abort"
    error: EngineError | None = None
    #: When it was made (time.perf_counter); None for the error and abort updates, which take
    #: the time they are sent.
    at: float | None = None
    #: The scheduler turn that produced this update (Scheduler.turns).
    turn: int = 0


class Ticket:
    """One submitted request. `sink` is called with each `Update` on the engine thread (in the
    engine process, its sink sends the update to the HTTP process's own ticket)."""

    def __init__(self, input_ids: list[int], gen: Any, spec: Any, sink: Callable[[Update], None] | None,
                 hold: bool = True) -> None:
        self.input_ids = input_ids
        self.gen = gen
        self.spec = spec
        self.sink = sink
        #: Whether its tokens may wait for the stream interval. Not for a request with stop
        #: strings: the HTTP side matches them, so it must see every token as soon as it exists.
        self.hold = hold
        self.submitted_at = time.perf_counter()
        #: Scheduler.turns when it was queued; set by Scheduler.submit.
        self.submitted_turn = 0
        # A plain flag, not a threading.Event: setting and reading a bool is atomic under the GIL,
        # and an Event (a Condition and its lock) per request was 4% of the HTTP process's CPU
        # at a few tokens a request. Nothing waits on it.
        self._cancelled = False
        #: Why the consumer dropped it: "abort" (client gone, error) or "stop" (a stop string
        #: matched, so the request completed normally and counts as such).
        self.cancel_reason = "abort"
        self.finished = False

    def cancel(self, reason: str = "abort") -> None:
        """Ask the engine thread to drop this request; safe from any thread, idempotent."""
        if not self._cancelled:
            self.cancel_reason = reason
        self._cancelled = True

    @property
    def cancelled(self) -> bool:
        return self._cancelled


class EngineThread:
    """One long-lived thread that runs, in order, every call that touches the engine.

    Why one thread for loading, warm-up and decoding: torch's CPU kernels run on an OpenMP pool
    per calling thread, and a thread keeps its pool until it exits. A server that loaded and
    warmed up on the main thread and decoded on another held two pools; with more pool threads
    than cores, libgomp stops spinning between parallel regions, so each of a DDTree round's
    hundreds of small parallel ops put its worker to sleep and woke it through the kernel (about
    300 context switches a round on a 2-core CPU, 4-5 ms a round more than in process).
    """

    def __init__(self, name: str = "engine") -> None:
        self._calls: queue.SimpleQueue[tuple[Future, Callable[..., Any], tuple]] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._serve, name=name, daemon=True)
        self._thread.start()

    def submit(self, fn: Callable[..., Any], *args: Any) -> Future:
        """Queue fn(*args) on the engine thread; the future holds its result or its exception."""
        future: Future = Future()
        self._calls.put((future, fn, args))
        return future

    def call(self, fn: Callable[..., Any], *args: Any) -> Any:
        """Run fn(*args) on the engine thread and wait for it; its exception is raised here."""
        return self.submit(fn, *args).result()

    @property
    def ident(self) -> int | None:
        return self._thread.ident

    def _serve(self) -> None:
        while True:
            future, fn, args = self._calls.get()
            if not future.set_running_or_notify_cancel():
                continue
            try:
                result = fn(*args)
            except BaseException as exc:  # boundary: the caller gets it from the future
                future.set_exception(exc)
            else:
                future.set_result(result)


@dataclass
class _Active:
    ticket: Ticket
    session: Any
    emitted: int = 0
    rounds_seen: int = 0
    #: Tokens and rounds the counters have seen, which runs ahead of `emitted` and `rounds_seen`
    #: while the stream interval holds them: a request that ends early still counts every token.
    counted: int = 0
    rounds_counted: int = 0


# Latency histogram bounds (seconds): from sub-10 ms rounds on a GPU to minutes on a laptop CPU.
LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)


class Histogram:
    def __init__(self, bounds: tuple[float, ...] = LATENCY_BUCKETS) -> None:
        self.bounds = bounds
        self.counts = [0] * len(bounds)
        self.count = 0
        self.sum = 0.0

    def copy(self) -> "Histogram":
        other = Histogram(self.bounds)
        other.counts, other.count, other.sum = list(self.counts), self.count, self.sum
        return other

    def merged(self, other: "Histogram") -> "Histogram":
        """Both histograms' observations in one (the HTTP workers' TTFT and ITL, gathered)."""
        both = self.copy()
        both.counts = [a + b for a, b in zip(self.counts, other.counts)]
        both.count, both.sum = self.count + other.count, self.sum + other.sum
        return both

    def observe(self, value: float) -> None:
        self.count += 1
        self.sum += value
        for i, bound in enumerate(self.bounds):
            if value <= bound:
                self.counts[i] += 1


@dataclass(frozen=True)
class StatsView:
    """What /metrics and /server_info read from `Stats`, taken at one moment: plain values, so it
    crosses from the engine process to the HTTP one in one small message."""

    requests_total: int
    aborted_total: int
    prompt_tokens_total: int
    generation_tokens_total: int
    verify_calls_total: int
    batched_rounds_total: int
    avg_batch_size: float | None
    turns_total: int
    turn_seconds_total: float
    engine_seconds_total: float
    avg_accept_length: float | None
    recent_accept_length: float
    recent_accept_rate: float
    gen_throughput: float
    ttft: Histogram
    itl: Histogram
    e2e: Histogram


@dataclass(frozen=True)
class Snapshot:
    """The server's state for /metrics and /server_info: counters, request counts, KV pool use."""

    stats: StatsView
    running: int
    queued: int
    pool: dict | None
    #: Triton kernels compiled after the server's warm-up (None where nothing watches).
    late_compiles: int | None = None


class Stats:
    """Counters since boot plus short recent windows; every method is thread-safe."""

    WINDOW_ROUNDS = 512
    THROUGHPUT_WINDOW_S = 10.0

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.requests_total = 0
        self.aborted_total = 0
        self.prompt_tokens_total = 0
        self.generation_tokens_total = 0
        self.verify_calls_total = 0
        self.accepted_tokens_total = 0  # sum of tau over all verify rounds
        self.batched_rounds_total = 0   # turns that stepped several requests in one batched round
        self.batched_requests_total = 0  # request-rounds inside those
        # Where the engine thread's time goes: turns (admit, prefill, round, publish; the idle
        # wait for work excluded) and, inside them, the engine's own calls. The difference is the
        # scheduler's host time, which on a GPU adds to every round.
        self.turns_total = 0
        self.turn_seconds_total = 0.0
        self.engine_seconds_total = 0.0
        self._recent_rounds: deque[tuple[int, int]] = deque(maxlen=self.WINDOW_ROUNDS)  # (tau, proposed)
        self._recent_tokens: deque[tuple[float, int]] = deque()
        self.ttft = Histogram()
        self.e2e = Histogram()
        self.itl = Histogram()

    def add_rounds(self, accepts: tuple[int, ...], proposed_per_round: int) -> None:
        with self._lock:
            for tau in accepts:
                self.verify_calls_total += 1
                self.accepted_tokens_total += tau
                self._recent_rounds.append((tau, proposed_per_round))

    def add_batch(self, size: int) -> None:
        with self._lock:
            self.batched_rounds_total += 1
            self.batched_requests_total += size

    def add_turn(self, seconds: float, engine_seconds: float) -> None:
        with self._lock:
            self.turns_total += 1
            self.turn_seconds_total += seconds
            self.engine_seconds_total += engine_seconds

    def avg_batch_size(self) -> float | None:
        with self._lock:
            return self.batched_requests_total / self.batched_rounds_total if self.batched_rounds_total else None

    def add_tokens(self, n: int, now: float) -> None:
        with self._lock:
            self.generation_tokens_total += n
            self._recent_tokens.append((now, n))
            while self._recent_tokens and self._recent_tokens[0][0] < now - self.THROUGHPUT_WINDOW_S:
                self._recent_tokens.popleft()

    def add_request(self, prompt_tokens: int, *, aborted: bool, e2e_s: float | None) -> None:
        with self._lock:
            self.requests_total += 1
            self.prompt_tokens_total += prompt_tokens
            if aborted:
                self.aborted_total += 1
            if e2e_s is not None:
                self.e2e.observe(e2e_s)

    def observe_ttft(self, seconds: float) -> None:
        with self._lock:
            self.ttft.observe(seconds)

    def observe_itl(self, seconds: float, tokens: int) -> None:
        with self._lock:
            # One round commits several tokens at once; spread the gap over them as SGLang does.
            for _ in range(tokens):
                self.itl.observe(seconds / tokens)

    def avg_accept_length(self) -> float | None:
        """Mean tau since boot (SGLang's internal_states avg_spec_accept_length is cumulative too)."""
        with self._lock:
            return self.accepted_tokens_total / self.verify_calls_total if self.verify_calls_total else None

    def recent_accept(self) -> tuple[float, float]:
        """(mean tau, accept rate) over the last WINDOW_ROUNDS rounds; (0, 0) before any round."""
        with self._lock:
            rounds = list(self._recent_rounds)
        if not rounds:
            return 0.0, 0.0
        taus = sum(t for t, _ in rounds)
        proposed = sum(p for _, p in rounds)
        correct = sum(max(t - 1, 0) for t, _ in rounds)
        return taus / len(rounds), (correct / proposed if proposed else 0.0)

    def gen_throughput(self, now: float) -> float:
        with self._lock:
            while self._recent_tokens and self._recent_tokens[0][0] < now - self.THROUGHPUT_WINDOW_S:
                self._recent_tokens.popleft()
            tokens = sum(n for _, n in self._recent_tokens)
        return tokens / self.THROUGHPUT_WINDOW_S

    def view(self, now: float) -> StatsView:
        tau, rate = self.recent_accept()
        throughput = self.gen_throughput(now)
        batch = self.avg_batch_size()
        accept = self.avg_accept_length()
        with self._lock:
            return StatsView(
                requests_total=self.requests_total, aborted_total=self.aborted_total,
                prompt_tokens_total=self.prompt_tokens_total, generation_tokens_total=self.generation_tokens_total,
                verify_calls_total=self.verify_calls_total, batched_rounds_total=self.batched_rounds_total,
                avg_batch_size=batch, turns_total=self.turns_total, turn_seconds_total=self.turn_seconds_total,
                engine_seconds_total=self.engine_seconds_total, avg_accept_length=accept,
                recent_accept_length=tau, recent_accept_rate=rate,
                gen_throughput=throughput, ttft=self.ttft.copy(), itl=self.itl.copy(), e2e=self.e2e.copy())


def proposed_per_round(algorithm: str, budget: int, block_size: int) -> int:
    """Draft tokens one verify round checks: the tree's nodes, the chain's block, none for AR."""
    if algorithm == "ddtree":
        return budget
    if algorithm == "dflash":
        return block_size - 1
    return 0


class Scheduler:
    """Runs sessions of `engine` (the `Engine.start -> Session` API) round by round on one thread."""

    def __init__(self, engine: Any, *, max_running: int = 8, max_queued: int = 64, stats: Stats | None = None,
                 batch: bool = False, thread: EngineThread | None = None,
                 on_publish: Callable[[], None] | None = None, on_idle: Callable[[], None] | None = None,
                 stream_interval: int = 1,
                 trace_turns: str | None = None) -> None:
        """`on_publish` runs on the engine thread wherever updates are ready to leave together:
        after a turn's admissions, after its prefills, after each unbatched step, and at the end
        of the turn (the engine process sends what the sinks gathered, in one message).
        `on_idle` runs on the engine thread when a turn leaves nothing running or waiting (the
        engine process then sends what it held back for the GPU's next wait).
        `stream_interval`: a running request's tokens leave once at least this many are unsent
        (its first token and its end at once), as SGLang's --stream-interval.
        `trace_turns`: a file that gets one JSON line per turn (_trace), opened by the loop."""
        if max_running < 1 or max_queued < 0:
            raise ValueError("max_running must be >= 1 and max_queued >= 0")
        if isinstance(stream_interval, bool) or not isinstance(stream_interval, int) or stream_interval < 1:
            raise ValueError(f"stream_interval must be an int >= 1, got {stream_interval!r}")
        self.engine = engine
        self.batch = bool(batch) and hasattr(engine, "step_many")
        self.max_running = max_running
        self.max_queued = max_queued
        self.stats = stats or Stats()
        self._cond = threading.Condition()
        self._waiting: deque[Ticket] = deque()
        self._running: list[_Active] = []
        self._stopping = False
        #: The thread the rounds run on: pass the one that loaded the engine (see EngineThread).
        self._engine_thread = thread
        self._looping: Future | None = None
        self._engine_s = 0.0  # this turn's seconds inside engine calls (engine thread only)
        #: Turns started so far (each admits, then advances every running session by one round).
        self.turns = 0
        self._on_publish = on_publish
        self._on_idle = on_idle
        self.stream_interval = stream_interval
        self.trace_turns = trace_turns
        self._trace_file = None  # open while the loop runs, on the engine thread
        self._how = ""  # how this turn stepped its requests, for the trace
        # Whether this turn goes to the engine whole, new and running requests together, which
        # then caps its prefills; and how many new ones the engine held back under the cap.
        self._engine_caps, self._engine_held = False, 0
        self._note = ""  # what the engine said of a together turn that succeeded (its turn_note)
        self._parts: dict[str, float] = {}  # and where its time went (its turn_parts), if it said
        self._waits: dict[str, float] = {}  # its writes and GPU waits (turn_waits), if it said
        self._gc_s, self._gc_started = 0.0, None  # this turn's garbage collections (traced only)
        # Tokens published but not yet in the counters: booked once per publish point, not once
        # per request (a lock and a deque entry each, 64 a turn at c=64), and before any end.
        self._unbooked = 0
        self._loop_ident: int | None = None  # the thread the loop runs on, once it runs

    @classmethod
    def for_server(cls, engine: Any, config: Any, *, thread: EngineThread | None,
                   on_publish: Callable[[], None] | None = None,
                   on_idle: Callable[[], None] | None = None) -> "Scheduler":
        """The scheduler a server's configuration (api.ServerConfig) asks for, wherever it runs."""
        return cls(engine, max_running=config.max_running, max_queued=config.max_queued, batch=config.batch,
                   thread=thread, on_publish=on_publish, on_idle=on_idle, stream_interval=config.stream_interval,
                   trace_turns=getattr(config, "trace_turns", None))

    # -- any thread ---------------------------------------------------------------------------
    def start(self) -> Future:
        """Start the rounds; the future ends when the loop does (with its exception, if it raised)."""
        if self._engine_thread is None:
            self._engine_thread = EngineThread("engine-scheduler")
        self._looping = self._engine_thread.submit(self._loop)
        self._looping.add_done_callback(self._loop_ended)
        return self._looping

    @staticmethod
    def _loop_ended(looping: Future) -> None:
        if looping.exception() is not None:
            log.error("the scheduler loop failed", exc_info=looping.exception())

    def submit(self, input_ids: list[int], gen: Any, spec: Any, sink: Callable[[Update], None], *,
               hold: bool = True) -> Ticket:
        return self.enqueue(Ticket(input_ids, gen, spec, sink, hold))

    def enqueue(self, ticket: Ticket) -> Ticket:
        """Queue a ticket built by the caller (one whose sink needs the ticket itself)."""
        with self._cond:
            if self._stopping:
                raise ShuttingDown("the server is shutting down")
            ticket.submitted_turn = self.turns
            if len(self._waiting) + len(self._running) >= self.max_running + self.max_queued:
                raise QueueFull(
                    f"{self.max_running} requests running and {len(self._waiting)} queued",
                    hint="retry later, or start the server with a larger --max-queued-requests",
                )
            self._waiting.append(ticket)
            self._cond.notify()
        return ticket

    def counts(self) -> tuple[int, int]:
        """(running, queued) right now."""
        with self._cond:
            return len(self._running), len(self._waiting)

    def snapshot(self, now: float) -> Snapshot:
        running, queued = self.counts()
        pool_usage = getattr(self.engine, "pool_usage", None)
        late = getattr(self.engine, "late_compiles", None)
        return Snapshot(self.stats.view(now), running, queued, pool_usage() if pool_usage else None,
                        late() if late else None)

    @property
    def failure(self) -> str | None:
        """Why the rounds stopped for good (the loop raised), else None."""
        looping = self._looping
        if looping is None or not looping.done() or looping.cancelled() or looping.exception() is None:
            return None
        exc = looping.exception()
        return f"the engine loop failed: {type(exc).__name__}: {exc}"

    def stop(self, timeout: float = 30.0) -> None:
        """Stop after the current round; requests still held get an error update."""
        with self._cond:
            self._stopping = True
            self._cond.notify()
        if self._looping is not None:
            try:
                self._looping.result(timeout)
            except TimeoutError:
                log.warning("the engine thread did not stop within %.0f s; closing its sessions anyway", timeout)
            except Exception:  # logged by _loop_ended; its sessions are closed below all the same
                pass
        with self._cond:
            leftovers = [a.ticket for a in self._running] + list(self._waiting)
            sessions = [a.session for a in self._running]
            self._running.clear()
            self._waiting.clear()
        for session in sessions:
            session.close()
        for ticket in leftovers:
            self._finish(ticket, Update(done=True, finish_reason="abort", error=ShuttingDown("the server shut down")),
                         aborted=True)

    # -- engine thread --------------------------------------------------------------------------
    def _loop(self) -> None:
        self._loop_ident = threading.get_ident()
        self._trace_file = None
        if self.trace_turns:
            try:
                self._trace_file = open(self.trace_turns, "a", buffering=1)
            except OSError as exc:  # a debugging aid: serving goes on without it
                log.warning("no turn trace: cannot open %s (%s)", self.trace_turns, exc)
        if self._trace_file is not None:
            gc.callbacks.append(self._gc_timed)
        try:
            self._turns()
        finally:
            if self._gc_timed in gc.callbacks:
                gc.callbacks.remove(self._gc_timed)
            self._stop_trace()

    def _gc_timed(self, phase: str, info: dict) -> None:
        """gc.callbacks' hook while tracing: the turn's seconds in garbage collections (any
        thread's: a collection holds the GIL, so the engine's thread waits it out too)."""
        if phase == "start":
            self._gc_started = time.perf_counter()
        elif self._gc_started is not None:
            self._gc_s += time.perf_counter() - self._gc_started
            self._gc_started = None

    def _stop_trace(self) -> None:
        trace, self._trace_file = self._trace_file, None
        if trace is not None:
            try:
                trace.close()
            except OSError:
                pass

    def _turns(self) -> None:
        while True:
            with self._cond:
                idle = not self._waiting and not self._running and not self._stopping
            if idle and self._on_idle is not None:
                self._on_idle()
            with self._cond:
                while not self._waiting and not self._running and not self._stopping:
                    self._cond.wait()
                if self._stopping:
                    return
                self.turns += 1
                admit = []
                while self._waiting and len(self._running) + len(admit) < self.max_running:
                    admit.append(self._waiting.popleft())
            started, self._engine_s, self._gc_s = time.perf_counter(), 0.0, 0.0
            for ticket in admit:
                self._admit(ticket)
            self._published()
            with self._cond:
                turn = list(self._running)
            turn, held = self._cap_prefills(turn)
            self._engine_held, self._note, self._parts, self._waits = 0, "", {}, {}
            before = [len(a.session.output_ids) for a in turn] if self._trace_file is not None else []
            if self.batch and (len(turn) > 1 or (turn and self._lone_round(turn[0]))):
                self._advance_batch(turn)
            else:
                self._how = "alone"
                for active in turn:
                    self._advance(active)
                    self._published()
            self._published()
            held += self._engine_held
            seconds = time.perf_counter() - started
            self.stats.add_turn(seconds, self._engine_s)
            if self._trace_file is not None:
                self._trace(started, seconds, len(admit), turn, before, held)

    def _trace(self, started: float, seconds: float, admitted: int, turn: list[_Active],
               before: list[int], held: int = 0) -> None:
        """One JSON line for this turn: what bench/turn_trace.py needs to tell which turns make
        the inter-token and first-token tails (a stream's gap is the turns between its tokens).
        A write that fails (a full disk) ends the trace, not the serving."""
        after = [len(a.session.output_ids) for a in turn]
        # "new": the new requests this turn stepped or handed to the engine, less any the
        # prefill cap held back (those are "held", wherever the cap was applied).
        line = json.dumps({
            "turn": self.turns, "t": round(started, 6), "s": round(seconds, 6), "engine_s": round(self._engine_s, 6),
            "how": self._how, "note": self._note,
            "admitted": admitted, "new": sum(1 for n in before if n == 0) - self._engine_held,
            "running": sum(1 for n in before if n > 0), "firsts": sum(1 for b, a in zip(before, after) if b == 0 < a),
            "tokens": sum(after) - sum(before), "held": held,
            **({"parts": {k: round(v, 6) for k, v in self._parts.items()}} if self._parts else {}),
            **({"waits": {k: round(v, 6) for k, v in self._waits.items()}} if self._waits else {}),
            **({"gc": round(self._gc_s, 6)} if self._gc_s else {})}) + "\n"
        try:
            self._trace_file.write(line)
        except (OSError, ValueError) as exc:
            log.warning("turn trace stopped: writing %s failed (%s)", self.trace_turns, exc)
            self._stop_trace()

    def _engine(self, fn: Callable[..., Any], *args: Any) -> Any:
        """Call into the engine, counting the time towards this turn's engine seconds."""
        t0 = time.perf_counter()
        try:
            return fn(*args)
        finally:
            self._engine_s += time.perf_counter() - t0

    def _published(self) -> None:
        self._book_tokens()
        if self._on_publish is not None:
            self._on_publish()

    def _book_tokens(self) -> None:
        if self._unbooked:
            self.stats.add_tokens(self._unbooked, time.perf_counter())
            self._unbooked = 0

    def _admit(self, ticket: Ticket) -> None:
        if ticket.cancelled:
            self._finish(ticket, Update(done=True, finish_reason="abort"), aborted=True)
            return
        try:
            session = self._engine(self.engine.start, ticket.input_ids, ticket.gen, ticket.spec)
        except EngineError as exc:
            self._finish(ticket, Update(done=True, finish_reason="abort", error=exc), aborted=True)
            return
        except Exception as exc:  # boundary: one bad request must not stop the engine thread
            log.exception("engine.start failed")
            self._finish(ticket, Update(done=True, finish_reason="abort", error=EngineError(f"prefill failed: {exc}")),
                         aborted=True)
            return
        active = _Active(ticket, session)
        with self._cond:
            self._running.append(active)
        # Some engines commit the first token during prefill; report it now for a short TTFT.
        self._publish(active)

    def _advance(self, active: _Active) -> None:
        ticket, session = active.ticket, active.session
        if ticket.cancelled:
            stopped = ticket.cancel_reason == "stop"
            self._retire(active, Update(done=True, finish_reason="stop" if stopped else "abort"), aborted=not stopped)
            return
        if not session.done:
            try:
                self._engine(session.step)
            except EngineError as exc:
                self._retire(active, Update(done=True, finish_reason="abort", error=exc), aborted=True)
                return
            except Exception as exc:  # boundary: fail this request, keep serving the others
                log.exception("session.step failed")
                self._retire(active, Update(done=True, finish_reason="abort", error=EngineError(f"decoding failed: {exc}")),
                             aborted=True)
                return
        self._publish(active)

    def _cap_prefills(self, turn: list[_Active]) -> tuple[list[_Active], int]:
        """The turn less the new requests whose prefill would take it past the engine's
        max_prefill_tokens (the server's --max-prefill-tokens, as SGLang's), and how many those
        are: they wait a turn, keeping their place, so a burst of joiners prefills over several
        turns and no running stream's gap holds all of it. The first new request always goes.
        A turn that goes to the engine whole with mixed chunks (_advance_batch) is left to it:
        only the engine knows how much of each joiner rides in the round (a chunk) and what
        prefills on its own, and it caps the latter itself (Engine.step_many). Decides here,
        once a turn, whether the turn goes together (self._engine_caps)."""
        new = [a for a in turn if not (a.session.output_ids or a.session.done or a.ticket.cancelled)]
        self._engine_caps = self._together(turn, new)
        cap = getattr(self.engine, "max_prefill_tokens", 0)
        if cap <= 0 or self._engine_caps:
            return turn, 0
        go = dict(zip(map(id, new), within_prefill_cap([a.session.next_prefill_tokens() for a in new], cap)))
        kept = [a for a in turn if go.get(id(a), True)]
        return kept, len(turn) - len(kept)

    def _together(self, turn: list[_Active], new: list[_Active]) -> bool:
        """Whether _advance_batch steps this turn's new and running requests in one engine call."""
        live = len(turn) - len(new) - sum(1 for a in turn if a.session.done or a.ticket.cancelled)
        return (self.batch and len(turn) > 1 and bool(new) and live > 1
                and getattr(self.engine, "mixed_chunk", False))

    def _lone_round(self, active: _Active) -> bool:
        """Whether a request running by itself goes to the engine's step_many (Engine.lone_round:
        a pool slot without graphs of its own), not Session.step."""
        lone = getattr(self.engine, "lone_round", None)
        return lone is not None and not active.ticket.cancelled and lone(active.session)

    def _advance_batch(self, turn: list[_Active]) -> None:
        live, fresh = [], []
        for active in turn:
            if active.ticket.cancelled or active.session.done:
                self._advance(active)  # retires it
            elif not active.session.output_ids:
                fresh.append(active)  # not prefilled yet (a prefill always commits a token)
            else:
                live.append(active)
        if self._engine_caps:  # decided with the cap, in _cap_prefills
            self._how = "together"
            self._step_together(fresh + live, len(live))
            return
        self._how = "+".join(["prefill"] * bool(fresh) + ["round" if len(live) > 1 else "step"] * bool(live))
        # New requests prefill together and publish at once, before the others' round, so a
        # cohort's first tokens wait for one forward rather than for one each plus a round. A
        # lone one goes through step_many too: there its prompt's drafter rows go in with its
        # prefill (fast/batch.py), not in the gap to its second token.
        if fresh:
            try:
                self._step_many(fresh)
            except Exception as exc:  # boundary: find the culprit by prefilling each alone
                log.warning("batched prefill failed (%s: %s); prefilling one by one", type(exc).__name__, exc)
                for active in fresh:
                    self._advance(active)
            else:
                for active in fresh:
                    self._publish(active)
        else:
            for active in fresh:
                self._advance(active)
        if fresh:
            self._published()  # first tokens leave before the others' round, as promised above
        if len(live) > 1 or (live and self._lone_round(live[0])):
            self._step_together(live, len(live))
            return
        for active in live:
            self._advance(active)

    def _step_together(self, turn: list[_Active], live: int) -> None:
        """These requests in one engine call, `live` of them running. With mixed chunks on, new
        requests come too: the fast engine then folds new requests' chunks into the running
        round's forward (up to eight rows of them) and holds the other new ones back a turn
        (fast/ride.py), so running streams never wait for a prefill of its own. With a prefill cap the engine caps
        what of the new requests prefills on its own; stepping them one by one after a failure,
        this caps them itself (and holds them all when the failed call got some of them
        further: a prefill that finished before the failure stays done)."""
        fresh = [a for a in turn if not (a.session.output_ids or a.session.done or a.ticket.cancelled)]
        before = [a.session.next_prefill_tokens() for a in fresh]
        try:
            self._step_many(turn)
        except Exception as exc:  # boundary: find the culprit by stepping each request alone
            log.warning("batched round failed (%s: %s); stepping the requests one by one", type(exc).__name__, exc)
            if any(a.session.next_prefill_tokens() != n for a, n in zip(fresh, before)):
                go = [False] * len(fresh)
            else:
                go = within_prefill_cap(before, getattr(self.engine, "max_prefill_tokens", 0))
            held = {id(a) for a, ok in zip(fresh, go) if not ok and not a.session.output_ids}
            self._engine_held += len(held)
            for active in turn:
                if id(active) not in held:
                    self._advance(active)
            return
        self.stats.add_batch(live)
        now = time.perf_counter()
        for active in turn:
            self._publish(active, now)

    def _step_many(self, batch: list[_Active]) -> None:
        """engine.step_many over these requests; where the scheduler left the prefill cap to the
        engine this turn, what it held back counts in the turn's "held"."""
        self._engine(self.engine.step_many, [a.session for a in batch])
        for name, seconds in (getattr(self.engine, "turn_waits", None) or {}).items():
            self._waits[name] = self._waits.get(name, 0.0) + seconds  # a prefill's call, then a round's
        if self._engine_caps:
            self._engine_held += getattr(self.engine, "turn_held", 0)
            self._note = getattr(self.engine, "turn_note", "")
            self._parts = dict(getattr(self.engine, "turn_parts", None) or {})

    def _publish(self, active: _Active, now: float | None = None) -> None:
        """Send the tokens and rounds committed since the last update; retire a finished session.
        now: when the engine call that committed them returned (one clock read for a batch)."""
        session = active.session
        ids = session.output_ids
        accepts = session.accept_lengths
        now = time.perf_counter() if now is None else now
        spec = active.ticket.spec
        # Plain decoding has no verify rounds, as in SGLang without a speculative algorithm:
        # counting its steps would pull the acceptance gauges and counters towards 1.
        if len(accepts) > active.rounds_counted and spec.algorithm != "ar":
            self.stats.add_rounds(accepts[active.rounds_counted:],
                                  proposed_per_round(spec.algorithm, spec.budget, self.engine.block_size))
        self._unbooked += len(ids) - active.counted
        active.counted, active.rounds_counted = len(ids), len(accepts)
        # Held back until enough tokens gather: every update costs the HTTP side a chunk (decode,
        # JSON, a socket write), which at high token rates is what caps the server.
        if (active.ticket.hold and not session.done and active.emitted
                and len(ids) - active.emitted < self.stream_interval):
            return
        new_ids = tuple(ids[active.emitted:])
        new_accepts = tuple(accepts[active.rounds_seen:])
        active.emitted = len(ids)
        active.rounds_seen = len(accepts)
        if session.done:
            update = Update(new_ids, new_accepts, session.verify_ct, done=True,
                            finish_reason=session.finish_reason, at=now, turn=self.turns)
            self._retire(active, update, aborted=False)
        elif new_ids or new_accepts:
            self._send(active.ticket, Update(new_ids, new_accepts, session.verify_ct, at=now, turn=self.turns))

    def _retire(self, active: _Active, update: Update, *, aborted: bool) -> None:
        with self._cond:
            if active in self._running:
                self._running.remove(active)
        try:
            self._engine(active.session.close)
        finally:
            self._finish(active.ticket, update, aborted=aborted)

    def _finish(self, ticket: Ticket, update: Update, *, aborted: bool) -> None:
        if ticket.finished:
            return
        ticket.finished = True
        if threading.get_ident() == self._loop_ident:  # stop() may finish tickets from another thread
            self._book_tokens()  # a request's tokens are in the counters before its end is seen
        e2e = (update.at or time.perf_counter()) - ticket.submitted_at if not aborted else None
        self.stats.add_request(len(ticket.input_ids), aborted=aborted, e2e_s=e2e)
        self._send(ticket, update)

    def _send(self, ticket: Ticket, update: Update) -> None:
        if update.turn != self.turns:  # the error and abort updates are built without one
            update = update._replace(turn=self.turns)
        try:
            ticket.sink(update)
        except Exception:  # boundary: a consumer that went away must not stop the engine thread
            log.exception("delivering an update failed")
            ticket.cancel()


# -- Prometheus text exposition (format 0.0.4), with SGLang's metric names ----------------------

def _labels(labels: dict[str, str], extra: dict[str, str] | None = None) -> str:
    merged = {**labels, **(extra or {})}
    if not merged:
        return ""
    parts = []
    for key, value in merged.items():
        escaped = str(value).replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')
        parts.append(f'{key}="{escaped}"')
    return "{" + ",".join(parts) + "}"


def _number(value: float) -> str:
    if math.isinf(value):
        return "+Inf" if value > 0 else "-Inf"
    return repr(float(value))


def render_metrics(snapshot: Snapshot, labels: dict[str, str]) -> str:
    """The /metrics body: gauges, counters and latency histograms named as SGLang names them;
    with a KV pool (Engine.pool_usage), its use as SGLang's token_usage and our slot gauges."""
    stats, pool = snapshot.stats, snapshot.pool
    lab = _labels(labels)
    out: list[str] = []

    def scalar(name: str, kind: str, doc: str, value: float) -> None:
        out.append(f"# HELP {name} {doc}")
        out.append(f"# TYPE {name} {kind}")
        out.append(f"{name}{lab} {_number(value)}")

    def histogram(name: str, doc: str, hist: Histogram) -> None:
        out.append(f"# HELP {name} {doc}")
        out.append(f"# TYPE {name} histogram")
        for bound, count in zip(hist.bounds, hist.counts):
            out.append(f"{name}_bucket{_labels(labels, {'le': _number(bound)})} {_number(count)}")
        out.append(f"{name}_bucket{_labels(labels, {'le': '+Inf'})} {_number(hist.count)}")
        out.append(f"{name}_count{lab} {_number(hist.count)}")
        out.append(f"{name}_sum{lab} {_number(hist.sum)}")

    scalar("sglang:num_running_reqs", "gauge", "The number of running requests.", snapshot.running)
    scalar("sglang:num_queue_reqs", "gauge", "The number of requests in the waiting queue.", snapshot.queued)
    scalar("sglang:gen_throughput", "gauge", "The generation throughput (token/s).", stats.gen_throughput)
    scalar("sglang:spec_accept_length", "gauge",
           "The average acceptance length of speculative decoding (recent rounds).", stats.recent_accept_length)
    scalar("sglang:spec_accept_rate", "gauge",
           "The average acceptance rate of speculative decoding (recent rounds).", stats.recent_accept_rate)
    if pool is not None:
        scalar("sglang:token_usage", "gauge", "The token usage of the KV pool (0..1).", pool["token_usage"])
        scalar("ddtree:kv_pool_slots", "gauge", "Requests the KV pool holds.", pool["slots"])
        scalar("ddtree:kv_pool_used_slots", "gauge", "KV pool slots held by running requests.", pool["used_slots"])
        scalar("ddtree:kv_pool_bytes", "gauge", "Bytes of the KV pool.", pool["bytes"])
    counters = [
        ("sglang:prompt_tokens_total", "Number of prefill tokens processed.", stats.prompt_tokens_total),
        ("sglang:generation_tokens_total", "Number of generation tokens processed.", stats.generation_tokens_total),
        ("sglang:num_requests_total", "Number of requests processed.", stats.requests_total),
        ("sglang:num_aborted_requests_total", "Number of requests aborted.", stats.aborted_total),
        ("sglang:spec_verify_calls_total", "Number of speculative decoding verification calls.",
         stats.verify_calls_total),
        ("ddtree:scheduler_turns_total", "Scheduler turns (admit, prefill, one round, publish).", stats.turns_total),
        ("ddtree:scheduler_turn_seconds_total", "Seconds the engine thread spent in turns, idle waits excluded.",
         stats.turn_seconds_total),
        ("ddtree:engine_seconds_total", "Seconds of those turns inside engine calls (start, steps, rounds, close); "
         "the rest is the scheduler's own host time.", stats.engine_seconds_total),
    ]
    if snapshot.late_compiles is not None:
        counters.append(("ddtree:late_triton_compiles_total", "Triton kernels compiled while serving, after the "
                         "warm-up: each one a stall that every running stream waited through.",
                         snapshot.late_compiles))
    for name, doc, value in counters:
        scalar(name, "counter", doc, value)
    histogram("sglang:time_to_first_token_seconds", "Histogram of time to first token in seconds.", stats.ttft)
    histogram("sglang:inter_token_latency_seconds", "Histogram of inter-token latency in seconds.", stats.itl)
    histogram("sglang:e2e_request_latency_seconds", "Histogram of End-to-end request latency in seconds", stats.e2e)
    return "\n".join(out) + "\n"
