"""The typed results of `Client` and `AsyncClient` calls."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Completion:
    """A finished completion."""

    text: str
    done_reason: str
    prompt_eval_count: int = 0
    prompt_cached_count: int = 0
    prompt_eval_duration: int = 0
    """Nanoseconds."""
    eval_count: int = 0
    eval_duration: int = 0
    """Nanoseconds."""
    thinking: str = ""
    """A thinking model's reasoning, split from ``text`` (`Client.chat` with ``think``)."""


@dataclass(frozen=True)
class CompletionChunk:
    """One line of a streamed completion; the last has ``done=True`` and the statistics."""

    content: str
    done: bool
    done_reason: str | None = None
    prompt_eval_count: int | None = None
    prompt_cached_count: int | None = None
    prompt_eval_duration: int | None = None
    eval_count: int | None = None
    eval_duration: int | None = None
    thinking: str = ""
    """Reasoning (`Client.chat` with ``think``): a chunk holds either it or ``content``."""


@dataclass(frozen=True)
class HealthStatus:
    """The server's state."""

    status: str
    progress: float
    slots_idle: int = 0
    slots_processing: int = 0
    error: str | None = None


@dataclass(frozen=True)
class TokenPiece:
    """A token and the text it renders to (`Client.tokenize` with ``with_pieces=True``)."""

    id: int
    piece: str | bytes
    """Its text (special tokens as written, ``<s>``); bytes when they are not valid UTF-8 by
    themselves (part of a character)."""
