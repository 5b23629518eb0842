"""The model's load progress on the terminal (``llamarunner serve`` and ``run``)."""

from __future__ import annotations

import shutil
from typing import TextIO


def progress_bar(progress: float, width: int) -> str:
    """``[#####-----]  50%``: ``width`` cells between the brackets."""
    progress = min(max(progress, 0.0), 1.0)
    filled = int(progress * width)
    return f"[{'#' * filled}{'-' * (width - filled)}] {int(progress * 100):3d}%"


class LoadProgress:
    """The model's load progress on ``stream``: on a terminal, one line redrawn in place (the
    server's log lines clear it before they are written, and it is drawn again after them);
    otherwise nothing, so that logs get plain lines only."""

    def __init__(self, stream: TextIO) -> None:
        self.stream = stream
        try:
            self.tty = stream.isatty()
        except (AttributeError, ValueError):
            self.tty = False
        self.shown = False

    def show(self, progress: float) -> None:
        if not self.tty:
            return
        columns = shutil.get_terminal_size((80, 24)).columns
        width = max(10, min(40, columns - 32))
        bar = progress_bar(progress, width)
        self.stream.write(f"\r\x1b[Kllamarunner: loading {bar}")
        self.stream.flush()
        self.shown = True

    def clear(self) -> None:
        if self.shown:
            self.stream.write("\r\x1b[K")
            self.stream.flush()
            self.shown = False
