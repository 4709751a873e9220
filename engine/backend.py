"""The narrow interface between the engine loop and whatever generates tokens.

A backend is single-threaded: only the engine thread calls ``add``, ``cancel``
and ``step``. ``check`` is the exception: it reads configuration only and is
called on the event loop to reject a request with a 400 before it is queued.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal, Protocol

from tokenwire.engine.sampling import SamplingParams

FinishReason = Literal["stop", "length", "abort", "error"]


class RequestRejected(Exception):
    """The request can never be served as asked (the client's fault) or not now (ours)."""

    def __init__(self, message: str, *, http_status: int = 400, param: str | None = None,
                 overloaded: bool = False) -> None:
        super().__init__(message)
        self.message = message
        self.http_status = http_status
        self.param = param
        self.overloaded = overloaded
        """Refused for load (the waiting queue is full), not because the engine is down:
        a dialect that tells the two apart says so (Anthropic's 529 ``overloaded_error``)."""


@dataclass(frozen=True, slots=True)
class GenerationRequest:
    """One sequence to generate."""

    request_id: str
    prompt_token_ids: tuple[int, ...]
    params: SamplingParams


@dataclass(frozen=True, slots=True)
class RequestOutput:
    """What one step produced for one request."""

    request_id: str
    text: str
    """New text, complete characters only, never part of a stop string."""
    token_ids: tuple[int, ...]
    """Tokens generated this step."""
    prompt_tokens: int
    completion_tokens: int
    """Tokens generated so far, the stop token included: what billing counts."""
    finished: bool = False
    finish_reason: FinishReason | None = None
    stop_reason: int | str | None = None
    """The stop token id or stop string that ended the output, if one did."""
    error: str | None = None
    admitted_s: float | None = None
    """On a request's first output: ``time.monotonic()`` when it was admitted
    (left the waiting queue), for the queue-wait and prefill metrics."""


@dataclass(frozen=True, slots=True)
class BackendStats:
    """A snapshot for metrics, taken on the engine thread after each step."""

    running: int
    """Sequences admitted: decoding or prefilling."""
    waiting: int
    kv_tokens_in_use: int
    """Real tokens held in KV caches (padding excluded)."""
    kv_cells_allocated: int
    """Padded KV slots occupied per layer (what left padding really costs)."""
    kv_tokens_reserved: int
    """Admission accounting: prompt + max_tokens of every admitted request."""
    extra: dict[str, int] = field(default_factory=dict)


class EngineBackend(Protocol):
    """Add, cancel, step: everything the engine loop needs from a token generator."""

    def check(self, request: GenerationRequest) -> None:
        """Raise :class:`RequestRejected` if ``request`` can never be admitted. Thread-safe."""
        ...

    def add(self, request: GenerationRequest) -> None:
        """Queue ``request``; it joins the batch when admission allows."""
        ...

    def cancel(self, request_id: str) -> None:
        """Abort ``request_id``; its row leaves before the next forward pass."""
        ...

    def step(self) -> list[RequestOutput]:
        """Run one scheduling step and return what each request produced."""
        ...

    def has_work(self) -> bool:
        """Whether ``step`` would do anything."""
        ...

    def stats(self) -> BackendStats:
        """Current load, for metrics."""
        ...
