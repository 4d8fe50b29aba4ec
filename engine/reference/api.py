"""Request validation and per-request state for the builtin engine's HTTP server.

`Api` turns SGLang-native (/generate) and OpenAI-shaped bodies into one `GenRequest` (400 on
anything malformed, out of range or unsupported, never a silent default for a value that changes
the output), submits it to the round-robin scheduler, and builds SGLang's meta_info. `Reply` is one
request on the event loop: it gathers the scheduler's updates (from the engine thread, or from the
reader of the engine process's socket), decodes text, applies stop strings, and cancels the
request when its consumer goes away.
"""

from __future__ import annotations

import asyncio
import math
import threading
import time
import uuid
from concurrent.futures import Future
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, AsyncIterator

from ddtree.engine.errors import EngineError
from ddtree.engine.reference.params import ALGORITHMS, GenParams, SpecParams
from ddtree.engine.reference.scheduler import (EngineThread, Scheduler, ShuttingDown, Snapshot, Update,
                                               proposed_per_round)
from ddtree.engine.serving.launch import DEFAULT_BUDGET

if TYPE_CHECKING:  # torch: the HTTP processes never load it (the engine process does)
    from ddtree.engine.reference.engine import Engine

#: The chat roles OpenAI's API defines (SGLang's chat endpoint takes the same).
CHAT_ROLES = frozenset({"system", "developer", "user", "assistant", "tool", "function"})

#: What chat_template_kwargs may not set: apply_chat_template's own arguments (transformers 5),
#: and `messages` / `conversations`, the conversation as the template is given it. Each either
#: changes how the server applies the template or raised in there (a 400 that blamed the messages).
TEMPLATE_ARGUMENTS = frozenset({
    "conversation", "conversations", "messages", "tokenize", "add_generation_prompt", "return_dict",
    "return_tensors", "continue_final_message", "chat_template", "tools", "documents", "padding", "truncation",
    "max_length", "return_assistant_tokens_mask", "sanitize_control_tokens", "tokenizer_kwargs"})

#: How long /server_info and /metrics wait for the engine process's counters.
SNAPSHOT_TIMEOUT_S = 30.0


# No tokenizer in use packs more characters than this into one token on real text.
MAX_CHARS_PER_TOKEN = 32


class BadRequest(EngineError):
    """A request the server refuses as malformed (HTTP 400)."""

    exit_code = 2


@dataclass(frozen=True)
class ServerConfig:
    algorithm: str
    budget: int
    served_model_name: str
    model_path: str
    draft_path: str | None
    max_running: int = 8
    max_queued: int = 64
    graceful_timeout_s: float = 60.0
    #: One batched round over all running requests per turn (Engine.step_many) instead of one
    #: Session.step() per request.
    batch: bool = False
    #: DDTree budgets whose graphs warm-up captures besides `budget`'s (fast backend on CUDA).
    capture_budgets: tuple[int, ...] = ()
    #: Tokens a running request gathers before they leave (Scheduler's stream_interval).
    stream_interval: int = 1
    #: A file that gets one JSON line per scheduler turn (Scheduler's trace_turns), or None.
    trace_turns: str | None = None
    #: /generate streams each chunk's new text and ids only, not all so far (SGLang's flag).
    incremental_streaming_output: bool = False

    def __post_init__(self) -> None:
        if self.algorithm not in ALGORITHMS:
            raise BadRequest(f"unknown algorithm {self.algorithm!r}", hint="one of ar, dflash, ddtree")
        if self.budget < 0:
            raise BadRequest("budget must be >= 0")
        if self.max_running < 1:
            raise BadRequest(f"--max-running-requests must be at least 1, got {self.max_running}")
        if self.max_queued < 0:
            raise BadRequest(f"--max-queued-requests must be at least 0, got {self.max_queued}")
        if self.stream_interval < 1:
            raise BadRequest(f"stream interval must be >= 1, got {self.stream_interval}")


@dataclass(frozen=True)
class GenRequest:
    """A validated generation request, whatever endpoint it came from."""

    input_ids: list[int]
    gen: GenParams
    spec: SpecParams
    stops: tuple[str, ...] = ()
    trim_stop: bool = True
    skip_special_tokens: bool = True
    stream: bool = False
    rid: str = ""


# -- validation helpers ------------------------------------------------------------------------

def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _number(obj: dict, key: str, default: float, *, where: str) -> float:
    value = obj.get(key, default)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise BadRequest(f"{where}{key} must be a finite number, got {value!r}")
    return float(value)


def _int(obj: dict, key: str, default: int | None, *, where: str) -> int | None:
    value = obj.get(key, default)
    if value is None:
        return default
    if not _is_int(value):
        raise BadRequest(f"{where}{key} must be an integer, got {value!r}")
    return value


def _shown(n: int) -> str:
    """An integer for an error line: JSON allows any number of digits, a line should not echo them."""
    text = str(n)
    return text if len(text) <= 24 else f"{text[:8]}... ({len(text.lstrip('-'))} digits)"


def _bool(obj: dict, key: str, default: bool, *, where: str = "") -> bool:
    value = obj.get(key, default)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise BadRequest(f"{where}{key} must be true or false, got {value!r}")
    return value


def _stop_strings(value: Any, *, where: str) -> tuple[str, ...]:
    if value is None:
        return ()
    if isinstance(value, str):
        value = [value]
    if not isinstance(value, list) or not all(isinstance(s, str) for s in value):
        raise BadRequest(f"{where}stop must be a string or a list of strings")
    return tuple(s for s in value if s)


def _token_ids(value: Any, vocab_size: int | None, *, what: str) -> list[int]:
    if not isinstance(value, list) or not all(_is_int(t) for t in value):
        raise BadRequest(f"{what} must be a list of integers")
    if vocab_size is not None and any(t < 0 or t >= vocab_size for t in value):
        raise BadRequest(f"{what} holds a token id outside the vocabulary (0..{vocab_size - 1})")
    return list(value)


class Api:
    """The request handlers; one instance per server, bound to one engine and scheduler."""

    def __init__(self, engine: Engine | Any, config: ServerConfig, thread: EngineThread | None = None,
                 scheduler: Any = None) -> None:
        """`thread`: the one that loaded and warmed up the engine, which then runs its rounds.
        `scheduler`: one that runs them elsewhere (engine_loop.RemoteScheduler); `engine` is
        then that engine's EngineFacts."""
        self.engine = engine
        self.config = config
        self.scheduler = scheduler or Scheduler.for_server(engine, config, thread=thread)
        self.stats = self.scheduler.stats
        #: Where the rounds run (/server_info says): "thread" of this process, or their own "process".
        self.engine_loop = "thread" if scheduler is None else "process"
        self.draining = False
        self.started_at = time.time()
        tokenizer = engine.tokenizer
        # The model's embedding rows, which may exceed the tokenizer's size (padded vocabularies).
        self.vocab_size = engine.vocab_size or (len(tokenizer) if tokenizer is not None else None)
        self.has_chat_template = bool(getattr(tokenizer, "chat_template", None))
        self._couriers: dict[int, Courier] = {}
        # What a stream decodes its tail with, by skip_special_tokens ("" without a tokenizer).
        self.stream_decoders = {skip: (lambda ids: "") if tokenizer is None else stream_decoder(tokenizer, skip)
                                for skip in (True, False)}

    # -- request building ----------------------------------------------------------------------
    def _encode(self, text: str, **kwargs) -> list[int]:
        if self.engine.tokenizer is None:
            raise BadRequest("this model has no tokenizer", hint="send input_ids instead of text")
        # Refused before tokenizing: a text this long cannot fit the context window, and
        # tokenizing megabytes would hold a CPU for seconds first.
        limit = self.engine.context_window * MAX_CHARS_PER_TOKEN
        if len(text) > limit:
            raise BadRequest(f"prompt of {len(text)} characters cannot fit the context window "
                             f"({self.engine.context_window} tokens)", hint="shorten the prompt")
        return list(self.engine.tokenizer.encode(text, **kwargs))

    def courier(self, loop: asyncio.AbstractEventLoop) -> Courier:
        """The courier to this event loop (a server has one; tests may drive several)."""
        courier = self._couriers.get(id(loop))
        if courier is None or courier.loop is not loop:
            courier = self._couriers[id(loop)] = Courier(loop)
        return courier

    def _decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        if self.engine.tokenizer is None:
            return ""
        return self.engine.tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)

    def _spec(self, body: dict) -> SpecParams:
        ext = body.get("speculative")
        if ext is None:
            ext = {}
        if not isinstance(ext, dict):
            raise BadRequest("speculative must be an object {algorithm, budget}")
        # A misspelt key would run the server's default instead, unnoticed but in the timings.
        unknown = sorted(set(ext) - {"algorithm", "budget"})
        if unknown:
            raise BadRequest(f"unknown speculative keys: {', '.join(map(repr, unknown))}",
                             hint="speculative takes algorithm and budget")
        algorithm = ext.get("algorithm", self.config.algorithm)
        if not isinstance(algorithm, str) or algorithm.lower() not in ALGORITHMS:
            raise BadRequest(f"unknown algorithm {algorithm!r}", hint="one of ar, dflash, ddtree")
        algorithm = algorithm.lower()
        budget = _int(ext, "budget", self.config.budget, where="speculative.")
        max_budget = self.engine.max_budget
        if budget < 0 or (max_budget is not None and budget > max_budget):
            raise BadRequest(f"budget must be between 0 and {max_budget}, got {budget}")
        if algorithm != "ar" and self.engine.draft_name is None:
            raise BadRequest(f"algorithm {algorithm} needs a drafter", hint="this server was started without --draft")
        return SpecParams(algorithm=algorithm, budget=budget)

    def _check_prompt(self, input_ids: list[int], max_new_tokens: int | None) -> int:
        """Validates lengths; returns max_new_tokens (None means: the rest of the context window)."""
        if not input_ids:
            raise BadRequest("the prompt is empty")
        window = self.engine.context_window
        if window is not None and len(input_ids) >= window:
            raise BadRequest(f"the prompt has {len(input_ids)} tokens; the context window is {window}")
        if max_new_tokens is None:
            max_new_tokens = window - len(input_ids) if window is not None else 128
        if max_new_tokens < 1:
            raise BadRequest(f"max_new_tokens must be at least 1, got {_shown(max_new_tokens)}")
        if window is not None and len(input_ids) + max_new_tokens > window:
            raise BadRequest(
                f"the prompt ({len(input_ids)} tokens) plus max_new_tokens ({_shown(max_new_tokens)}) exceeds the "
                f"context window ({window})", hint="ask for fewer new tokens")
        return max_new_tokens

    def _gen(self, *, max_new_tokens: int, temperature: float, top_p: float, seed: int | None,
             stop_token_ids: list[int], ignore_eos: bool) -> GenParams:
        if temperature < 0:
            raise BadRequest(f"temperature must be >= 0, got {temperature}")
        if not 0.0 < top_p <= 1.0:
            raise BadRequest(f"top_p must be in (0, 1], got {top_p}")
        # The engine stops at the model's EOS tokens itself unless ignore_eos is set.
        return GenParams(max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p,
                         stop_token_ids=tuple(stop_token_ids), seed=seed, ignore_eos=ignore_eos)

    def parse_generate(self, body: dict) -> GenRequest:
        text, input_ids = body.get("text"), body.get("input_ids")
        if (text is None) == (input_ids is None):
            raise BadRequest("give exactly one of text or input_ids")
        if isinstance(text, list) or (isinstance(input_ids, list) and input_ids and isinstance(input_ids[0], list)):
            raise BadRequest("batch requests are not supported", hint="send one prompt per request")
        if text is not None:
            if not isinstance(text, str):
                raise BadRequest("text must be a string")
            ids = self._encode(text)
        else:
            ids = _token_ids(input_ids, self.vocab_size, what="input_ids")
        for key in ("return_logprob", "return_hidden_states"):
            if _bool(body, key, False):
                raise BadRequest(f"{key} is not supported by the builtin engine")
        sp = body.get("sampling_params") or {}
        if not isinstance(sp, dict):
            raise BadRequest("sampling_params must be an object")
        known = {"max_new_tokens", "temperature", "top_p", "top_k", "min_p", "stop", "stop_token_ids",
                 "ignore_eos", "seed", "sampling_seed", "n", "skip_special_tokens", "no_stop_trim",
                 "frequency_penalty", "presence_penalty", "repetition_penalty", "min_new_tokens",
                 "spaces_between_special_tokens"}
        unknown = sorted(set(sp) - known)
        if unknown:
            raise BadRequest(f"unknown sampling_params: {', '.join(unknown)}")
        self._defaults_only(sp, where="sampling_params.",
                            defaults={"top_k": (-1, 0), "min_p": (0,), "n": (1,), "frequency_penalty": (0,),
                                      "presence_penalty": (0,), "repetition_penalty": (1,),
                                      "min_new_tokens": (0,)})
        max_new = self._check_prompt(ids, _int(sp, "max_new_tokens", 128, where="sampling_params."))
        seed = _int(sp, "sampling_seed", None, where="sampling_params.")
        seed = _int(sp, "seed", seed, where="sampling_params.")
        stop_ids = _token_ids(sp.get("stop_token_ids") or [], self.vocab_size, what="sampling_params.stop_token_ids")
        gen = self._gen(max_new_tokens=max_new, temperature=_number(sp, "temperature", 1.0, where="sampling_params."),
                        top_p=_number(sp, "top_p", 1.0, where="sampling_params."), seed=seed,
                        stop_token_ids=stop_ids, ignore_eos=_bool(sp, "ignore_eos", False, where="sampling_params."))
        rid = body.get("rid")
        if rid is not None and not isinstance(rid, str):
            raise BadRequest("rid must be a string")
        return GenRequest(ids, gen, self._spec(body), _stop_strings(sp.get("stop"), where="sampling_params."),
                          trim_stop=not _bool(sp, "no_stop_trim", False, where="sampling_params."),
                          skip_special_tokens=_bool(sp, "skip_special_tokens", True, where="sampling_params."),
                          stream=_bool(body, "stream", False), rid=rid or uuid.uuid4().hex)

    @staticmethod
    def _defaults_only(obj: dict, *, where: str, defaults: dict[str, tuple]) -> None:
        for key, allowed in defaults.items():
            value = obj.get(key)
            if value is None:
                continue
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise BadRequest(f"{where}{key} must be a number, got {value!r}")
            if value not in allowed:
                raise BadRequest(f"{where}{key}={value!r} is not supported by the builtin engine",
                                 hint=f"leave it out or set it to {allowed[0]}")

    def parse_openai(self, body: dict, *, chat: bool) -> GenRequest:
        if chat:
            ids = self._chat_prompt(body.get("messages"), self._template_kwargs(body.get("chat_template_kwargs")))
            max_new = _int(body, "max_completion_tokens", None, where="")
            max_new = _int(body, "max_tokens", max_new, where="")
        else:
            prompt = body.get("prompt")
            if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
                prompt = prompt[0]
            if isinstance(prompt, str):
                ids = self._encode(prompt)
            elif isinstance(prompt, list) and all(_is_int(t) for t in prompt):
                ids = _token_ids(prompt, self.vocab_size, what="prompt")
            elif isinstance(prompt, list):
                raise BadRequest("batch prompts are not supported", hint="send one prompt per request")
            else:
                raise BadRequest("prompt must be a string or a list of token ids")
            max_new = _int(body, "max_tokens", 16, where="")
            if _bool(body, "echo", False):
                raise BadRequest("echo is not supported by the builtin engine")
            if body.get("suffix"):
                raise BadRequest("suffix is not supported by the builtin engine")
        if body.get("logprobs") not in (None, False, 0):
            raise BadRequest("logprobs are not supported by the builtin engine")
        # These change what comes out: served without them, the output would silently differ.
        if body.get("logit_bias"):
            raise BadRequest("logit_bias is not supported by the builtin engine")
        if body.get("tools"):
            raise BadRequest("tools are not supported by the builtin engine")
        response_format = body.get("response_format")
        if response_format is not None and response_format != {"type": "text"}:
            raise BadRequest("response_format is not supported by the builtin engine",
                             hint='leave it out or set it to {"type": "text"}')
        self._defaults_only(body, where="", defaults={"n": (1,), "best_of": (1,), "frequency_penalty": (0,),
                                                      "presence_penalty": (0,), "top_k": (-1, 0)})
        model = body.get("model")
        if model is not None and not isinstance(model, str):
            raise BadRequest("model must be a string")
        stream_options = body.get("stream_options")
        if stream_options is not None and not isinstance(stream_options, dict):
            raise BadRequest("stream_options must be an object")
        stream = _bool(body, "stream", False)
        if stream_options is not None and not stream:  # as OpenAI and vLLM answer it
            raise BadRequest("stream_options is only allowed with stream: true")
        max_new = self._check_prompt(ids, max_new)
        gen = self._gen(max_new_tokens=max_new, temperature=_number(body, "temperature", 1.0, where=""),
                        top_p=_number(body, "top_p", 1.0, where=""), seed=_int(body, "seed", None, where=""),
                        stop_token_ids=_token_ids(body.get("stop_token_ids") or [], self.vocab_size,
                                                  what="stop_token_ids"),
                        ignore_eos=_bool(body, "ignore_eos", False))
        return GenRequest(ids, gen, self._spec(body), _stop_strings(body.get("stop"), where=""),
                          stream=stream, rid=uuid.uuid4().hex)

    @staticmethod
    def _template_kwargs(value: Any) -> dict:
        """SGLang's chat_template_kwargs (Qwen3's enable_thinking, say): more variables for the template."""
        if value is None:
            return {}
        if not isinstance(value, dict):
            raise BadRequest("chat_template_kwargs must be an object")
        reserved = sorted(set(value) & TEMPLATE_ARGUMENTS)
        if reserved:
            raise BadRequest(f"chat_template_kwargs may not set {', '.join(reserved)}",
                             hint="the server sets how the template is applied")
        return value

    def _chat_prompt(self, messages: Any, template_kwargs: dict | None = None) -> list[int]:
        if not isinstance(messages, list) or not messages:
            raise BadRequest("messages must be a non-empty list")
        plain: list[dict[str, str]] = []
        for m in messages:
            if not isinstance(m, dict) or not isinstance(m.get("role"), str):
                raise BadRequest("each message must be an object with a string role")
            if m["role"] not in CHAT_ROLES:
                raise BadRequest(f"unknown message role {m['role']!r}",
                                 hint=f"roles are {', '.join(sorted(CHAT_ROLES))}")
            content = m.get("content")
            if content is None:
                content = ""
            if isinstance(content, list):
                parts = []
                for part in content:
                    if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                        raise BadRequest("only text content parts are supported")
                    parts.append(part["text"])
                content = "".join(parts)
            if not isinstance(content, str):
                raise BadRequest("message content must be a string or a list of text parts")
            plain.append({"role": m["role"], "content": content})
        if self.has_chat_template:
            try:
                text = self.engine.tokenizer.apply_chat_template(plain, tokenize=False, add_generation_prompt=True,
                                                                 **(template_kwargs or {}))
            except Exception as exc:  # a template can raise anything (jinja errors, raise_exception)
                raise BadRequest(f"the chat template rejected these messages: {exc}") from None
            return self._encode(text, add_special_tokens=False)
        # A model without a chat template: a minimal transcript format, announced in /server_info
        # as chat_template "fallback" (chat_template_kwargs have no template to reach).
        text = "".join(f"{m['role']}: {m['content']}\n" for m in plain) + "assistant:"
        return self._encode(text)

    # -- running a request ---------------------------------------------------------------------
    def submit(self, req: GenRequest) -> "Reply":
        return Reply(self, req)

    async def snapshot(self) -> Snapshot:
        """Counters, request counts and pool use, from wherever the rounds run."""
        got = self.scheduler.snapshot(time.perf_counter())
        if not isinstance(got, Future):
            return got
        try:
            # The engine process answers from its main thread, beside the engine thread; one that
            # is stuck must cost a poller a 503, not hang it.
            return await asyncio.wait_for(asyncio.wrap_future(got), SNAPSHOT_TIMEOUT_S)
        except asyncio.TimeoutError:
            raise ShuttingDown(f"the engine process did not answer within {SNAPSHOT_TIMEOUT_S:.0f} s") from None

    def meta_info(self, req: GenRequest, run: "Reply", *, final: bool) -> dict:
        ids = run.ids
        meta: dict[str, Any] = {
            "id": req.rid,
            "finish_reason": run.finish_reason_obj() if final else None,
            "prompt_tokens": len(req.input_ids),
            "completion_tokens": len(ids),
            "cached_tokens": 0,
        }
        if run.verify_ct > 0 and req.spec.algorithm != "ar":  # plain decoding reports no spec fields
            hist = list(run.accept_hist) or [0]
            rounds = sum(hist)
            correct = sum(drafts * count for drafts, count in enumerate(hist))
            proposed = run.verify_ct * proposed_per_round(req.spec.algorithm, req.spec.budget, self.engine.block_size)
            meta.update({
                "spec_verify_ct": run.verify_ct,
                "spec_accept_length": len(ids) / run.verify_ct,
                "spec_accept_rate": correct / proposed if proposed else 0.0,
                "spec_num_correct_drafts": correct,
                "spec_num_proposed_drafts": proposed,
                # SGLang's layout: index k counts verify rounds that accepted k drafts (bonus excluded).
                "spec_accept_histogram": hist,
                "spec_correct_drafts_histogram": hist,
                # Ours: mean tau over rounds (bonus included), which differs slightly from
                # completion_tokens / verify_ct (the prefill token and trimming count in the latter).
                "spec_tau_mean": (correct + rounds) / rounds if rounds else None,
            })
        meta["spec_algorithm"] = req.spec.algorithm
        meta["spec_budget"] = req.spec.budget
        # Ours: when the request was queued, got its first token and finished, in scheduler turns
        # (one round of every running request each): its wait measured in rounds, not seconds.
        meta["scheduler_turns"] = {"submitted": run.ticket.submitted_turn, "first_token": run.first_token_turn,
                                   "finished": run.finished_turn}
        if final:
            meta["e2e_latency"] = run.e2e_latency
        return meta


def stream_decoder(tokenizer: Any, skip_special_tokens: bool = True):
    """`ids -> text` for a stream's IncrementalText, equal to tokenizer.decode(ids, skip_special_tokens).

    A fast tokenizer without clean-up decodes in its Rust backend alone, which is all its decode
    does then, without the Python wrapper around it: about 1 us a call instead of 6, and a stream
    decodes twice an update. Any other tokenizer goes through its own decode."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if (backend is not None and getattr(tokenizer, "clean_up_tokenization_spaces", None) is False
            and _plain_fast_decode(type(tokenizer))):
        return lambda ids: backend.decode(ids, skip_special_tokens=skip_special_tokens)
    return lambda ids: tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)


def _plain_fast_decode(cls: type) -> bool:
    """Whether `cls` decodes as transformers' fast tokenizer does (some classes, Whisper's among
    them, override decode with more than the backend's)."""
    try:
        from transformers import PreTrainedTokenizerFast
    except ImportError:
        return False
    return all(getattr(cls, name, None) is getattr(PreTrainedTokenizerFast, name, None) for name in ("decode", "_decode"))


class IncrementalText:
    """The text of a growing token list, decoding only its tail at each step.

    Each step decodes a window that starts a few tokens back (the tokens of the last step), and
    keeps what it adds to that window's earlier decode. The overlap carries the context that
    decoding a token alone would lose (SentencePiece drops the leading space of the first token).
    A window ending in U+FFFD, half of a multi-byte character, adds nothing until it completes.
    """

    def __init__(self, decode) -> None:
        self.decode = decode
        self.text = ""
        self._prefix = 0  # window start
        self._read = 0    # tokens whose text is in self.text

    @property
    def read(self) -> int:
        """How many tokens' text is in self.text (a trailing half character's tokens are not)."""
        return self._read

    def extend(self, ids: list[int]) -> str:
        if len(ids) > self._read:
            before = self.decode(ids[self._prefix:self._read])
            after = self.decode(ids[self._prefix:])
            if len(after) > len(before) and not after.endswith("\ufffd"):
                self.text += after[len(before):]
                self._prefix, self._read = self._read, len(ids)
        return self.text


def _merged(first: Update, queue: asyncio.Queue) -> Update:
    """first and every update already queued behind it, as one: when the event loop falls behind
    the engine (many streams at a high token rate), a stream catches up in one chunk, one
    decode and one write instead of one per round."""
    if first.error is not None or first.done or queue.empty():
        return first
    parts = [first]
    while not queue.empty() and parts[-1].error is None and not parts[-1].done:
        parts.append(queue.get_nowait())
    last = parts[-1]
    return last._replace(new_ids=tuple(t for u in parts for t in u.new_ids),
                         new_accepts=tuple(a for u in parts for a in u.new_accepts))


class Courier:
    """Hands updates from the thread that delivers them (the engine thread, or the engine
    process's reader) to the event loop, one wake-up per burst: a batched round updates every
    running request at once, and a wake-up per update (a syscall, a loop turn and GIL hand-offs
    each) slowed the engine thread at high concurrency when it ran in this process."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self._lock = threading.Lock()
        self._items: list[tuple[asyncio.Queue, Update]] = []
        self._scheduled = False

    def put(self, queue: asyncio.Queue, update: Update) -> None:
        with self._lock:
            self._items.append((queue, update))
            if self._scheduled:
                return
            self._scheduled = True
        self.loop.call_soon_threadsafe(self._flush)

    def _flush(self) -> None:
        with self._lock:
            items, self._items = self._items, []
            self._scheduled = False
        for queue, update in items:
            queue.put_nowait(update)


class Reply:
    """One request on the event loop: submits the ticket, gathers updates, applies stop strings."""

    def __init__(self, api: Api, req: GenRequest) -> None:
        self.api, self.req = api, req
        self.loop = asyncio.get_running_loop()
        self.queue: asyncio.Queue[Update] = asyncio.Queue()
        self.t0 = time.perf_counter()
        self.ids: list[int] = []
        # Index k: rounds that accepted k drafts (tau - 1). Kept as updates arrive, so a chunk's
        # meta_info costs the same at round 1000 as at round 1.
        self.accept_hist: list[int] = []
        self.verify_ct = 0
        self.text = ""            # text so far, stable (never retracted) while streaming
        self.done = False
        self.finish_reason: str | None = None
        self.matched: str | int | None = None
        self.e2e_latency: float | None = None
        self.first_token_at: float | None = None
        self.first_token_turn: int | None = None
        self.finished_turn: int | None = None
        self._last_token_at: float | None = None
        self._detok = IncrementalText(api.stream_decoders[req.skip_special_tokens])
        self.ticket = api.scheduler.submit(req.input_ids, req.gen, req.spec, self._sink, hold=not req.stops)

    async def admission(self) -> None:
        """Wait for the engine to hold this request where another process decides that (several
        HTTP processes: engine_loop.RemoteScheduler), so that a refusal (QueueFull) can still be
        the response's status; elsewhere submitting decided it already."""
        admitted = getattr(self.ticket, "admitted", None)
        if admitted is not None:
            await asyncio.wrap_future(admitted)

    def _sink(self, update: Update) -> None:
        # Called on the scheduler's delivering thread; the courier hands it to the event loop.
        self.api.courier(self.loop).put(self.queue, update)

    def cancel(self) -> None:
        if not self.done:
            self.ticket.cancel()

    def finish_reason_obj(self) -> dict | None:
        if self.finish_reason == "length":
            return {"type": "length", "length": len(self.ids)}
        if self.finish_reason == "stop":
            return {"type": "stop", "matched": self.matched}
        if self.finish_reason is not None:
            return {"type": "abort", "message": self.finish_reason}
        return None

    async def updates(self) -> AsyncIterator["Reply"]:
        """Yields self after every update that changed anything; the last has done=True."""
        try:
            while not self.done:
                update = await self.queue.get()
                if self.first_token_at is not None:  # the first token keeps its own turn and time
                    update = _merged(update, self.queue)
                if update.error is not None:
                    self.done = True
                    raise update.error
                self._apply(update)
                yield self
        finally:
            self.cancel()

    def _apply(self, update: Update) -> None:
        now = time.perf_counter()
        stats = self.api.stats
        if update.new_ids:
            if self.first_token_at is None:
                self.first_token_at = now
                self.first_token_turn = update.turn
                stats.observe_ttft(now - self.t0)
            elif self._last_token_at is not None:
                stats.observe_itl(now - self._last_token_at, len(update.new_ids))
            self._last_token_at = now
        # Tokens whose text earlier updates searched for stop strings: a stop completes after them
        # (not after the last update's tokens, which may end in half a character not yet searched).
        searched = self._detok.read
        self.ids.extend(update.new_ids)
        for tau in update.new_accepts:
            drafts = max(tau - 1, 0)
            if drafts >= len(self.accept_hist):
                self.accept_hist.extend([0] * (drafts + 1 - len(self.accept_hist)))
            self.accept_hist[drafts] += 1
        self.verify_ct = max(self.verify_ct, update.verify_ct)
        if not (self.req.stream or self.req.stops or update.done):
            return  # nobody reads the text before the end: skip decoding per round
        # Decoding only the new tokens keeps a round's cost flat: the whole text decoded at every
        # update cost about 1 ms at 2k tokens, per stream, on the event loop (which, with
        # --engine-loop thread, shares the GIL with the engine thread). The final text is one
        # whole decode, so it is exact.
        full = self._detok.extend(self.ids) if not update.done else \
            self.api._decode(self.ids, self.req.skip_special_tokens)
        if self.req.stops and self._apply_stop(full, searched):
            self.ticket.cancel("stop")
        elif update.done:
            self.done = True
            self.finish_reason = update.finish_reason
            if self.finish_reason == "stop" and self.ids:
                self.matched = self.ids[-1]
            self.text = full
        else:
            # The decoder holds back a trailing half of a multi-byte character. With stop strings,
            # also hold back what could be the start of one, so text already streamed never has
            # to be taken back when the stop string completes.
            stable = full
            if self.req.stops:
                stable = stable[:max(0, len(stable) - (max(len(s) for s in self.req.stops) - 1))]
            if len(stable) > len(self.text) and stable.startswith(self.text):
                self.text = stable
        if self.done:
            self.e2e_latency = now - self.t0
            self.finished_turn = update.turn

    def _apply_stop(self, full: str, searched: int) -> bool:
        longest = max(len(s) for s in self.req.stops)
        start = max(0, len(self.text) - longest)
        hits = [(full.find(s, start), s) for s in self.req.stops]
        hits = [(pos, s) for pos, s in hits if pos >= 0]
        if not hits:
            return False
        pos, stop = min(hits)
        # Keep only the tokens up to the one that completed the stop string, as SGLang does.
        for k in range(searched + 1, len(self.ids) + 1):
            if stop in self.api._decode(self.ids[:k], self.req.skip_special_tokens)[start:]:
                del self.ids[k:]
                break
        self.text = full[:pos] if self.req.trim_stop else full[:pos + len(stop)]
        self.done, self.finish_reason, self.matched = True, "stop", stop
        return True
