"""How a download's progress is shown: a bar redrawn in place on a terminal, a plain line
every few seconds otherwise (logs, CI), or JSON lines in Ollama's ``/api/pull`` format for a
program that reads them (the server's ``/api/pull`` runs ``llamarunner pull --progress
json``)."""

from __future__ import annotations

import json
import shutil
import sys
import time
from typing import Protocol, TextIO

from .._progress import progress_bar


class Progress(Protocol):
    """Told of each file's download: ``start``, ``update`` (bytes so far, as often as it
    likes), ``finish``; ``status`` for a step that is not a download."""

    def status(self, text: str) -> None: ...

    def start(self, name: str, digest: str | None, total: int | None) -> None: ...

    def update(self, done: int) -> None: ...

    def finish(self) -> None: ...


def human_size(n: float) -> str:
    """``253.1 MB``: bytes as people read them (powers of 1000)."""
    for unit in ("B", "KB", "MB", "GB"):
        if n < 1000 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return f"{n:.1f} GB"  # pragma: no cover - the loop returns


class TerminalProgress:
    """One line per file, redrawn in place on a terminal; a line every ``every`` seconds (and
    at the end) otherwise."""

    def __init__(self, stream: TextIO | None = None, every: float = 5.0) -> None:
        self.stream = stream if stream is not None else sys.stderr
        try:
            self.tty = self.stream.isatty()
        except (AttributeError, ValueError):
            self.tty = False
        self.every = every
        self.name = ""
        self.total: int | None = None
        self.done = 0
        self.started = 0.0
        self.last_line = 0.0

    def status(self, text: str) -> None:
        self.stream.write(f"llamarunner: {text}\n")
        self.stream.flush()

    def start(self, name: str, digest: str | None, total: int | None) -> None:
        self.name, self.total, self.done = name, total, 0
        self.started = self.last_line = time.monotonic()
        if not self.tty:
            size = f" ({human_size(total)})" if total else ""
            self.status(f"downloading {name}{size}")

    def _line(self) -> str:
        elapsed = max(time.monotonic() - self.started, 1e-6)
        rate = f"{human_size(self.done / elapsed)}/s"
        if self.total:
            columns = shutil.get_terminal_size((80, 24)).columns
            bar = progress_bar(self.done / self.total, max(10, min(30, columns - 60)))
            return f"{self.name} {bar} {human_size(self.done)} of {human_size(self.total)}, {rate}"
        return f"{self.name} {human_size(self.done)}, {rate}"

    def update(self, done: int) -> None:
        self.done = done
        now = time.monotonic()
        if self.tty:
            self.stream.write(f"\r\x1b[K{self._line()}")
            self.stream.flush()
        elif now - self.last_line >= self.every:
            self.last_line = now
            self.status(self._line())

    def finish(self) -> None:
        if self.tty:
            self.stream.write(f"\r\x1b[K{self._line()}\n")
            self.stream.flush()
        else:
            self.status(self._line())


class JsonProgress:
    """Ollama's ``/api/pull`` progress objects, one per line: ``{"status": "pulling
    <digest>", "digest": ..., "total": N, "completed": M}``, at most every ``every`` seconds
    per file (and at its start and end)."""

    def __init__(self, stream: TextIO | None = None, every: float = 0.25) -> None:
        self.stream = stream if stream is not None else sys.stdout
        self.every = every
        self.digest = ""
        self.total: int | None = None
        self.last = 0.0

    def _emit(self, obj: dict[str, object]) -> None:
        self.stream.write(json.dumps(obj) + "\n")
        self.stream.flush()

    def status(self, text: str) -> None:
        self._emit({"status": text})

    def start(self, name: str, digest: str | None, total: int | None) -> None:
        self.digest = f"sha256:{digest}" if digest else name
        self.total = total
        self.last = time.monotonic()
        self._emit(self._object(0))

    def _object(self, done: int) -> dict[str, object]:
        obj: dict[str, object] = {"status": f"pulling {self.digest}", "digest": self.digest}
        if self.total is not None:
            obj["total"] = self.total
        obj["completed"] = done
        return obj

    def update(self, done: int) -> None:
        now = time.monotonic()
        if now - self.last >= self.every:
            self.last = now
            self._emit(self._object(done))

    def finish(self) -> None:
        self._emit(self._object(self.total or 0))


class NoProgress:
    """Says nothing (a program that only wants the result)."""

    def status(self, text: str) -> None:
        pass

    def start(self, name: str, digest: str | None, total: int | None) -> None:
        pass

    def update(self, done: int) -> None:
        pass

    def finish(self) -> None:
        pass
