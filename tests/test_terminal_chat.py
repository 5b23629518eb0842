"""`llamarunner run`: the terminal chat, driven through a real pseudo-terminal (so that
readline, Ctrl-C as the terminal's interrupt character and end of input behave as for a user),
against a tiny random model. The server's metrics tell what each message sent."""

from __future__ import annotations

import fcntl
import io
import os
import re
import select
import socket
import struct
import subprocess
import sys
import termios
import time
from pathlib import Path
from typing import Any, Callable

import httpx
import pytest

from llamarunner import Server
from llamarunner.terminal_chat import AnswerPrinter

from helpers import metric, wait_until
from tinymodel import write_cycle_model

pytestmark = pytest.mark.skipif(sys.platform == "win32", reason="needs a pty")

# Runs `python -m llamarunner ARGS` with the pty (its stdin) as the controlling terminal, so
# that Ctrl-C typed on it sends SIGINT, as in a shell.
# SIGINT is set to its default first: a test run started in the background by a
# non-interactive shell (as CI may be) has it ignored, and an ignored signal stays ignored
# through exec, so Python would install no KeyboardInterrupt handler.
_ON_TTY = (
    "import fcntl, os, signal, sys, termios; signal.signal(signal.SIGINT, signal.SIG_DFL); "
    "fcntl.ioctl(0, termios.TIOCSCTTY, 0); "
    "os.execv(sys.executable, [sys.executable, '-m', 'llamarunner', *sys.argv[1:]])"
)
PROMPT = ">>> "


# The system calls a process waits for input in, on x86-64 and arm64 Linux: poll, select,
# pselect6, ppoll (arm64 has only the last two, numbered 72 and 73 there).
_WAIT_SYSCALLS = {"x86_64": {7, 23, 270, 271}, "aarch64": {72, 73}}


def waiting_for_input(pid: int) -> bool:
    """Whether the process is blocked in a wait for input (its ``/proc/PID/syscall``). Where
    that cannot be read (another system, no permission), true after half a second."""
    calls = _WAIT_SYSCALLS.get(os.uname().machine)
    try:
        with open(f"/proc/{pid}/syscall") as f:
            first = f.read().split(maxsplit=1)[0]
    except (OSError, IndexError):
        calls = None
    if calls is None:
        time.sleep(0.5)
        return True
    return first.isdigit() and int(first) in calls


class Chat:
    """`llamarunner run ARGS` on a pty. `expect` reads its output until a pattern appears
    (within a deadline) and returns what came before; `line` types a line."""

    def __init__(self, *args: str, home: Path) -> None:
        env = {
            k: v
            for k, v in os.environ.items()
            if not k.startswith("LLAMARUNNER_") or k == "LLAMARUNNER_LOG"
        }
        env.update(TERM="xterm", XDG_CACHE_HOME=str(home), HOME=str(home))
        env.pop("NO_COLOR", None)
        master, slave = os.openpty()
        fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 40, 200, 0, 0))
        self.proc = subprocess.Popen(
            [sys.executable, "-c", _ON_TTY, "run", *args],
            stdin=slave,
            stdout=slave,
            stderr=slave,
            start_new_session=True,
            env=env,
        )
        os.close(slave)
        self.fd = master
        self.pending = ""
        self.transcript = ""
        self.closed = False

    def _read(self, timeout: float) -> None:
        if self.closed:
            return
        ready, _, _ = select.select([self.fd], [], [], max(timeout, 0))
        if not ready:
            return
        try:
            data = os.read(self.fd, 65536)
        except OSError:  # EIO: the other side is closed
            data = b""
        if not data:
            self.closed = True
            return
        text = data.decode("latin-1")
        self.pending += text
        self.transcript += text

    def expect(self, pattern: str, timeout: float = 30) -> str:
        """Reads until ``pattern`` (a regex) appears; returns the output before it, and
        consumes it and the match."""
        deadline = time.monotonic() + timeout
        while True:
            m = re.search(pattern, self.pending)
            if m:
                before = self.pending[: m.start()]
                self.pending = self.pending[m.end() :]
                return before
            left = deadline - time.monotonic()
            if left <= 0 or self.closed:
                why = "output ended" if self.closed else f"not within {timeout} s"
                raise AssertionError(
                    f"{pattern!r} did not appear ({why}); the end of the output: "
                    f"{self.transcript[-3000:]!r}"
                )
            self._read(min(left, 0.2))

    def prompt(self, timeout: float = 30) -> str:
        return self.expect(re.escape(PROMPT), timeout)

    def type(self, text: str) -> None:
        os.write(self.fd, text.encode())

    def line(self, text: str) -> None:
        self.type(text + "\r")

    def say(self, text: str, timeout: float = 30) -> str:
        """Types ``text`` at the prompt; returns the output up to the next prompt, without
        the echo of the line."""
        self.line(text)
        self.expect(re.escape(text) + r"\r\n", timeout)
        return self.prompt(timeout)

    def wait(self, timeout: float = 30) -> int:
        deadline = time.monotonic() + timeout
        while self.proc.poll() is None:
            assert time.monotonic() < deadline, f"still running: {self.transcript[-3000:]!r}"
            self._read(0.05)
        while not self.closed:
            self._read(0.05)
        return self.proc.returncode

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(30)
        os.close(self.fd)


@pytest.fixture
def chat(tmp_path: Path) -> Any:
    """Starts `llamarunner run ARGS` on a pty, at its first prompt; killed after the test."""
    started: list[Chat] = []

    def start(*args: str, wait_prompt: bool = True) -> Chat:
        c = Chat(*args, home=tmp_path)
        started.append(c)
        if wait_prompt:
            c.prompt(timeout=60)
        return c

    yield start
    for c in started:
        c.close()


class Requests:
    """What the server saw since it was made: generation requests, their prompt tokens and
    generated tokens (from /metrics)."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.start = self._now()

    def _now(self) -> tuple[float, float, float]:
        return (
            metric(self.url, "request_prompt_tokens_count"),
            metric(self.url, "request_prompt_tokens_sum"),
            metric(self.url, "request_generation_tokens_sum"),
        )

    def since(self) -> tuple[int, int, int]:
        """(requests, prompt tokens, generated tokens) since the start, or the last call."""
        now = self._now()
        delta = tuple(int(a - b) for a, b in zip(now, self.start))
        self.start = now
        return delta[0], delta[1], delta[2]


def busy_slots(url: str) -> int:
    slots = httpx.get(f"{url}/slots", timeout=10).json()
    return sum(1 for s in slots if s["busy"])


def test_a_message_gets_a_streamed_answer_and_the_conversation_is_kept(
    tiny_server: Server, chat: Callable[..., Chat]
) -> None:
    c = chat("--host", tiny_server.url)
    assert "Set max_tokens to 40" in c.say("/set max_tokens 40")
    assert "Set ignore_eos to True" in c.say("/set ignore_eos true")
    seen = Requests(tiny_server.url)
    answer = c.say("hello")
    assert answer.strip(), "no answer printed"
    assert answer.endswith("\r\n\r\n"), repr(answer)  # the answer's line ended, then a blank one
    n, first_prompt, generated = seen.since()
    assert (n, generated) == (1, 40)
    # The next message carries the conversation: its prompt holds the first message and the
    # 40 tokens of the answer as well.
    assert c.say("and then").strip()
    n, second_prompt, _ = seen.since()
    assert n == 1
    assert second_prompt >= first_prompt + 40, (first_prompt, second_prompt)
    assert "messages:   4 in the conversation" in c.say("/show")


def test_ctrl_c_stops_the_answer_and_frees_the_slot(
    tiny_model: Path, start_server: Callable[..., Server], chat: Callable[..., Chat]
) -> None:
    # Slots of 4096 tokens: an answer that ignores EOS runs to ten slot contexts, far longer
    # than the test takes, unless it is stopped.
    srv = start_server(tiny_model, ctx_size=4096, parallel=1)
    c = chat("--host", srv.url)
    c.say("/set ignore_eos true")
    c.line("tell me everything")
    c.expect(r"tell me everything\r\n")
    c.expect(r"[^\s]")  # the answer has started to print
    wait_until(lambda: busy_slots(srv.url) == 1, "the answer to be generating", timeout=10)
    c.type("\x03")
    c.prompt(timeout=10)
    wait_until(lambda: busy_slots(srv.url) == 0, "the slot to be freed", timeout=30)
    # The chat goes on, the part of the answer that was printed kept in the conversation.
    assert "messages:   2 in the conversation" in c.say("/show")
    c.say("/set max_tokens 3")
    assert c.say("go on").strip()
    c.line("/bye")
    assert c.wait() == 0


def test_bye_ctrl_d_and_ctrl_c_at_the_prompt(
    tiny_server: Server, chat: Callable[..., Chat], tmp_path: Path
) -> None:
    c = chat("--host", tiny_server.url)
    # The prompt is written before readline waits for input: a Ctrl-C typed in that moment
    # is lost (its SIGINT lands before the select() that it would interrupt). A person never
    # types that fast; wait until the chat is blocked waiting for input.
    wait_until(lambda: waiting_for_input(c.proc.pid), "the chat to wait for input", 30)
    c.type("\x03")  # at an empty prompt: a hint, and the chat goes on
    assert "Use /bye or Ctrl-D to leave." in c.prompt()
    assert "unknown command '/nope'" in c.say("/nope")
    assert "/set system TEXT" in c.say("/?")
    c.line("/bye")
    assert c.wait() == 0
    assert "Traceback" not in c.transcript
    history = (tmp_path / "llamarunner" / "run_history").read_text()
    assert "/nope" in history and "/bye" in history

    d = chat("--host", tiny_server.url)
    d.type("\x04")  # Ctrl-D: the end of input
    assert d.wait() == 0


def test_a_server_that_cannot_be_reached_is_one_line(chat: Callable[..., Chat]) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    c = chat("--host", f"127.0.0.1:{port}", wait_prompt=False)
    assert c.wait() == 1
    assert "llamarunner: error: cannot reach" in c.transcript
    assert "Traceback" not in c.transcript


def test_server_errors_are_one_line_and_the_chat_goes_on(
    tiny_model: Path, start_server: Callable[..., Server], chat: Callable[..., Chat]
) -> None:
    srv = start_server(tiny_model, ctx_size=512, api_key="sesame")
    c = chat("--host", srv.url, "--api-key", "wrong", wait_prompt=False)
    assert c.wait() == 1
    assert "llamarunner: error:" in c.transcript and "401" in c.transcript

    c = chat("--host", srv.url, "--api-key", "sesame")
    c.say("/set max_tokens 3")
    assert c.say("hello").strip()
    srv.stop()  # the server goes away
    out = c.say("hello again")
    assert "Error: cannot reach" in out and "Traceback" not in out, out
    assert "messages:   2 in the conversation" in c.say("/show")  # the failed one was dropped
    c.line("/bye")
    assert c.wait() == 0


def test_set_validates_and_clear_forgets(tiny_server: Server, chat: Callable[..., Chat]) -> None:
    c = chat("--host", tiny_server.url)
    for bad in (
        "/set temperature abc",
        "/set temperature -1",
        "/set temperature nan",
        "/set top_p 1.5",
        "/set top_k 2.5",
        "/set max_tokens 0",
        "/set seed x",
        "/set ignore_eos maybe",
        "/set colour 1",
        "/set system",
    ):
        assert "Error:" in c.say(bad), bad
    shown = c.say("/show")
    assert "parameters: server defaults" in shown and "system:     (none)" in shown
    assert "Set temperature to 0.0." in c.say("/set temperature 0")
    c.say("/set max_tokens 30")
    c.say("/set parameter ignore_eos on")  # Ollama's spelling
    assert "temperature 0.0, max_tokens 30, ignore_eos True" in c.say("/show")

    seen = Requests(tiny_server.url)
    first = c.say("hello there")
    n, first_prompt, generated = seen.since()
    assert (n, generated) == (1, 30)
    assert "Cleared" in c.say("/clear")
    assert "messages:   0 in the conversation" in c.say("/show")
    second = c.say("hello there")
    n, second_prompt, generated = seen.since()
    assert (n, generated) == (1, 30)
    # The same prompt (the conversation was cleared), and greedy (temperature 0 was sent).
    assert second_prompt == first_prompt
    assert first == second and first.strip()
    c.say("/unset temperature")
    assert "temperature" not in c.say("/show").split("parameters:")[1].split("\n")[0]


def test_a_block_between_triple_quotes_is_one_message(
    tiny_server: Server, chat: Callable[..., Chat]
) -> None:
    c = chat("--host", tiny_server.url)
    c.say("/set max_tokens 1")
    seen = Requests(tiny_server.url)
    c.say("X")
    n, one_byte, _ = seen.since()
    assert n == 1
    c.say("/clear")
    lines = ["FIRST-LINE-0123456789", "SECOND-LINE-9876543210", "THIRD-LINE-ABCDEFGHIJ"]
    c.line('"""' + lines[0])
    c.expect(re.escape("... "))
    c.line(lines[1])
    c.expect(re.escape("... "))
    c.line(lines[2] + '"""')
    c.prompt()
    n, block, _ = seen.since()
    assert n == 1, "the block was not sent as one message"
    # One byte token per character (and per newline between the lines) beyond the one of "X".
    text = "\n".join(lines)
    assert block - one_byte == len(text) - 1, (block, one_byte, len(text))


def test_run_a_model_in_this_process(tiny_model: Path, chat: Callable[..., Chat]) -> None:
    c = chat(str(tiny_model), "--ctx-size", "512", "--threads", "2", wait_prompt=False)
    c.expect(r"llamarunner: loading .*tiny\.gguf", timeout=60)
    c.expect(r"chatting with tiny;", timeout=60)
    c.prompt(timeout=30)
    c.say("/set max_tokens 8")
    assert c.say("hi").strip()
    c.type("\x04")
    assert c.wait() == 0
    assert "Traceback" not in c.transcript


def test_usage_errors(tmp_path: Path, chat: Callable[..., Chat]) -> None:
    for args in ([str(tmp_path / "missing.gguf")], ["--host", "127.0.0.1:1", "--ctx-size", "64"]):
        c = chat(*args, wait_prompt=False)
        assert c.wait() == 2, args
        assert "llamarunner: error:" in c.transcript and "Traceback" not in c.transcript


def test_reasoning_is_dimmed_on_a_terminal_and_marked_elsewhere() -> None:
    # The server splits the reasoning out (its splitter's cases: chat/reasoning.rs); the
    # chunks carry it apart from the content.
    plain = io.StringIO()
    printer = AnswerPrinter(plain, color=False)
    for thinking, content in [("w", ""), ("hy", ""), ("", "Because.")]:
        printer.feed(content, thinking)
    printer.finish()
    assert plain.getvalue() == "Thinking...\nwhy\n...done thinking.\n\nBecause.\n\n"
    assert printer.content == "Because."  # what the conversation keeps
    tty = io.StringIO()
    printer = AnswerPrinter(tty, color=True)
    printer.feed(thinking="why")
    printer.feed("Because.")
    printer.finish()
    assert "\x1b[2mwhy\x1b[0m" in tty.getvalue() and printer.content == "Because."


def test_a_thinking_model_s_reasoning_is_dimmed_between_markers(
    tmp_path_factory: pytest.TempPathFactory, chat: Callable[..., Chat]
) -> None:
    # A model that writes "OK</think>" over and over under a template that opens the think
    # block (Qwen3's): the server splits the reasoning out, the chat dims it.
    thinker = write_cycle_model(tmp_path_factory.mktemp("think") / "thinker.gguf", "OK</think>")
    template = Path(__file__).parent / "templates" / "qwen3.jinja"
    with Server(str(thinker), port=0, ctx_size=512, threads=2, chat_template=str(template)) as srv:
        c = chat("--host", srv.url)
        c.say("/set max_tokens 12")
        c.say("/set temperature 0")
        answer = c.say("hi")
        dim, reset = "\x1b[2m", "\x1b[0m"
        plain = re.sub(r"\x1b\[[0-9]*m", "", answer)
        assert plain == "Thinking...\r\nOK\r\n...done thinking.\r\n\r\nOK\r\n\r\n", repr(answer)
        thinking, content = answer.split("...done thinking.")
        assert thinking.startswith(f"{dim}Thinking...{reset}") and f"{dim}O" in thinking
        assert content == f"{reset}\r\n\r\nOK\r\n\r\n", repr(answer)  # not dimmed
        c.line("/bye")
        assert c.wait() == 0


def test_without_a_model_or_the_default_model_it_explains(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    import llamarunner.config
    from llamarunner.cli import main

    def not_installed() -> Path:
        raise ImportError("no default model")

    monkeypatch.setattr(llamarunner.config, "_import_default_model", not_installed)
    assert main(["run"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    assert "--host URL" in err[0] and "pip install 'llamarunner[default-model]'" in err[0]


def test_help_describes_the_commands_and_the_flags_that_apply() -> None:
    r = subprocess.run(
        [sys.executable, "-m", "llamarunner", "run", "--help"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode == 0
    for text in ("--host URL", "--api-key", "--ctx-size", "--parallel", "--threads", "/set system"):
        assert text in r.stdout, text
    for flag in ("--port", "--mmproj", "--models-dir"):
        assert flag not in r.stdout, flag
