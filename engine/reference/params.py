"""Generation and speculation parameters, and the result of one generation."""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass, field

from ddtree.engine.reference.errors import BadParams

ALGORITHMS = ("ar", "dflash", "ddtree")

# The seeds a torch.Generator takes (manual_seed); one outside fails the request's first round.
SEED_MIN, SEED_MAX = -2**63, 2**64 - 1


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


@dataclass(frozen=True)
class GenParams:
    max_new_tokens: int = 128
    temperature: float = 0.0
    top_p: float = 1.0
    stop_token_ids: tuple[int, ...] = ()
    seed: int | None = None
    # Keep going past EOS (benchmarks want fixed-length outputs); stop_token_ids still stop.
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        if not _is_int(self.max_new_tokens) or self.max_new_tokens < 1:
            raise BadParams(f"max_new_tokens must be a positive integer, got {self.max_new_tokens!r}")
        if isinstance(self.temperature, bool) or not isinstance(self.temperature, (int, float)) \
                or not math.isfinite(self.temperature) or self.temperature < 0:
            raise BadParams(f"temperature must be a finite number >= 0, got {self.temperature!r}")
        if isinstance(self.top_p, bool) or not isinstance(self.top_p, (int, float)) \
                or not 0 < self.top_p <= 1:
            raise BadParams(f"top_p must be in (0, 1], got {self.top_p!r}")
        stops = self.stop_token_ids
        if isinstance(stops, (str, bytes)) or not hasattr(stops, "__iter__"):
            raise BadParams(f"stop_token_ids must be a list of token ids, got {stops!r}")
        stops = tuple(stops)
        if not all(_is_int(t) and t >= 0 for t in stops):
            raise BadParams(f"stop_token_ids must be non-negative integers, got {list(stops)!r}")
        object.__setattr__(self, "stop_token_ids", stops)
        if self.seed is not None and not (_is_int(self.seed) and SEED_MIN <= self.seed <= SEED_MAX):
            raise BadParams(f"seed must be an integer in {SEED_MIN}..{SEED_MAX}, got {self.seed!r}")
        object.__setattr__(self, "temperature", float(self.temperature))
        object.__setattr__(self, "top_p", float(self.top_p))
        object.__setattr__(self, "ignore_eos", bool(self.ignore_eos))

    @property
    def greedy(self) -> bool:
        return self.temperature < 1e-5


@dataclass(frozen=True)
class SpecParams:
    algorithm: str = "ddtree"
    budget: int = 32

    def __post_init__(self) -> None:
        if self.algorithm not in ALGORITHMS:
            raise BadParams(f"unknown algorithm {self.algorithm!r}", f"use one of {', '.join(ALGORITHMS)}")
        if not _is_int(self.budget) or self.budget < 0:
            raise BadParams(f"budget must be an integer >= 0, got {self.budget!r}")


TIMING_KEYS = ("prefill", "draft", "tree", "verify", "commit")


def within_prefill_cap(counts: list[int], cap: int) -> list[bool]:
    """Which of a turn's new requests prefill now, in order, given each one's next prefill
    tokens: as many as fit in `cap` tokens (0: no cap), the first always, a later one that fits
    going ahead of an earlier one that does not (the server's --max-prefill-tokens, as SGLang's).
    The scheduler and the engine's batched step both apply it: one rule, whoever prefills."""
    go, tokens = [], 0
    for n in counts:
        fits = cap <= 0 or not tokens or tokens + n <= cap
        go.append(fits)
        tokens += n if fits else 0
    return go


def accept_histogram(accept_lengths: list[int], block_size: int) -> list[int]:
    """Counts of tau = 1..max(block_size, longest seen); entry i is tau = i + 1."""
    counts = Counter(accept_lengths)
    top = max([block_size, *accept_lengths]) if accept_lengths else block_size
    return [counts.get(t, 0) for t in range(1, max(top, 1) + 1)]


@dataclass
class GenResult:
    output_ids: list[int]
    accept_lengths: list[int]
    verify_ct: int
    finish_reason: str | None
    prompt_tokens: int
    elapsed_s: float
    # Seconds per phase (prefill, draft, tree, verify, commit), summed over rounds.
    timings: dict[str, float] = field(default_factory=dict)
    block_size: int = 1

    @property
    def accept_histogram(self) -> list[int]:
        """Rounds per tau = 1..block_size (entry i counts tau = i + 1)."""
        return accept_histogram(self.accept_lengths, self.block_size)

    @property
    def accepted_depths(self) -> list[int]:
        """Draft tokens accepted per round (tau without the bonus)."""
        return [t - 1 for t in self.accept_lengths]

    @property
    def tau_mean(self) -> float:
        return sum(self.accept_lengths) / len(self.accept_lengths) if self.accept_lengths else 0.0

    @property
    def completion_tokens(self) -> int:
        return len(self.output_ids)
