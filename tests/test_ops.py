"""Operator endpoints end to end: /tokenize, /detokenize, /props, /slots and slot files
(save, restart, restore), and the load progress bar of ``llamarunner serve``."""

from __future__ import annotations

import hashlib
import os
import pty
import re
import select
import signal
import struct
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.configuration import set_hypothesis_home_dir

from llamarunner import BadRequestError, Client, Server, TokenPiece
from llamarunner._progress import progress_bar
from llamarunner.config import ServerConfig, model_name

from helpers import (
    ServeProcess,
    complete,
    metric,
    slot_file_state,
    stream_lines,
    wait_idle,
    wait_until,
)
from tinymodel import byte_tokens, vocabulary

TINY_VOCAB = len(vocabulary()[0])

set_hypothesis_home_dir(Path(tempfile.gettempdir()) / "llamarunner-hypothesis")


def post(url: str, path: str, body: Any = None) -> httpx.Response:
    return httpx.post(f"{url}{path}", json=body, timeout=60)


def error_type(r: httpx.Response) -> str:
    return str(r.json()["error"]["type"])


# --- tokenize / detokenize -----------------------------------------------------------------


def test_tokenize_and_detokenize_round_trip_on_the_tiny_model(tiny_server: Server) -> None:
    client = tiny_server.client()
    # Bytes the vocabulary has no piece for: BOS, "\u2581" as three byte tokens, the bytes.
    assert client.tokenize("xyz", add_special=True) == byte_tokens("xyz")
    assert client.tokenize("xyz") == byte_tokens("xyz")[1:]
    assert client.tokenize("") == []
    tokens = client.tokenize("hello world")
    assert all(isinstance(t, int) for t in tokens) and tokens
    pieces = client.tokenize("xyz", add_special=True, with_pieces=True)
    assert pieces == [
        TokenPiece(1, "<s>"),
        TokenPiece(3 + 0xE2, b"\xe2"),
        TokenPiece(3 + 0x96, b"\x96"),
        TokenPiece(3 + 0x81, b"\x81"),
        TokenPiece(3 + ord("x"), "x"),
        TokenPiece(3 + ord("y"), "y"),
        TokenPiece(3 + ord("z"), "z"),
    ]
    # Detokenizing joins the pieces (special tokens as written).
    assert client.detokenize(byte_tokens("xyz")) == "<s>\u2581xyz"
    joined = b"".join(
        p.piece.encode() if isinstance(p.piece, str) else p.piece
        for p in client.tokenize("hello world", with_pieces=True)
    )
    assert client.detokenize(tokens) == joined.decode()
    assert client.detokenize([]) == ""


def test_the_nul_byte_token_renders_as_nothing(tiny_server: Server) -> None:
    """The byte token <0x00> (id 3) has no text: a piece ends at its first NUL byte (as
    llama-cpp-2 gave pieces up to 0.1.154), so generated text never holds a NUL, which a prompt
    may not hold (a conversation's assistant turns are sent back as prompt text)."""
    client = tiny_server.client()
    assert client.detokenize([3 + ord("a"), 3, 3 + ord("b")]) == "ab"
    with pytest.raises(BadRequestError) as e:
        client.tokenize("a\x00b")
    assert "nul byte found in provided data at position: 1" in str(e.value)


def test_the_async_client_tokenizes_too(tiny_server: Server) -> None:
    import asyncio

    from llamarunner import AsyncClient

    async def run() -> tuple[list[int], str]:
        async with AsyncClient(tiny_server.url) as client:
            tokens = await client.tokenize("xyz")
            return tokens, await client.detokenize(tokens)

    tokens, text = asyncio.run(run())
    assert tokens == byte_tokens("xyz")[1:]
    assert text == "\u2581xyz"


def test_bad_token_ids_and_oversized_inputs_are_refused(tiny_server: Server) -> None:
    client = tiny_server.client()
    for bad in ([-1], [TINY_VOCAB], [1, 2**40]):
        with pytest.raises(BadRequestError) as e:
            client.detokenize(bad)
        assert e.value.type == "invalid_request", bad
    url = tiny_server.url
    for body, kind in [
        ({"tokens": [1.5]}, "invalid_json"),
        ({"tokens": "1 2"}, "invalid_json"),
        ({"tokens": [2**70]}, "invalid_json"),
        ({}, "invalid_request"),
    ]:
        r = post(url, "/detokenize", body)
        assert r.status_code == 400 and error_type(r) == kind, (body, r.text)
    # More text than a prompt may have (32 bytes per slot token, at least 64 KiB)...
    r = post(url, "/tokenize", {"content": "x" * (64 * 1024 + 1)})
    assert r.status_code == 400 and error_type(r) == "context_length_exceeded", r.text
    # ... more ids than one call may give, and a body over --max-body.
    r = post(url, "/detokenize", {"tokens": [5] * 65_537})
    assert r.status_code == 400 and error_type(r) == "context_length_exceeded", r.text
    r = post(url, "/tokenize", {"content": "x" * (9 * 1024 * 1024)})
    assert r.status_code == 413 and error_type(r) == "payload_too_large"
    # The server still serves.
    assert client.tokenize("xyz") == byte_tokens("xyz")[1:]


# --- props and the slot table --------------------------------------------------------------


def test_props_describe_the_served_model(tiny_server: Server) -> None:
    r = httpx.get(f"{tiny_server.url}/props", timeout=10)
    assert r.status_code == 200
    props = r.json()
    assert props["model_alias"] == "tiny"
    assert props["model_path"] == "tiny-model.gguf"  # the file's name only, never its path
    assert props["total_slots"] == 2
    assert props["n_ctx"] == 512
    assert props["default_generation_settings"]["n_ctx"] == 512
    assert (props["bos_token"], props["bos_token_id"]) == ("<s>", 1)
    assert (props["eos_token"], props["eos_token_id"]) == ("</s>", 2)
    assert "{%" in props["chat_template"] and props["chat_template_name"]
    assert props["model"]["architecture"] == "llama"
    assert props["model"]["n_vocab"] == TINY_VOCAB
    assert props["slot_save"] is False
    assert props["build_info"].startswith("llamarunner ")
    assert props["llama_cpp_2_version"]
    assert "CPU" in props["system_info"], props["system_info"]


def test_props_ps_and_metrics_say_where_the_model_runs(tiny_server: Server) -> None:
    url = tiny_server.url
    props = httpx.get(f"{url}/props", timeout=10).json()
    placed = props["devices"]
    kinds = {d["kind"] for d in placed["devices"]}
    assert "cpu" in kinds, placed
    cpu = next(d for d in placed["devices"] if d["kind"] == "cpu")
    # The CPU's memory is the host's.
    assert 0 < cpu["memory_free"] <= cpu["memory_total"], cpu
    # llama.cpp offloads the blocks and the output layer.
    assert placed["layers_total"] == props["model"]["n_layer"] + 1
    if not kinds & {"gpu", "integrated_gpu"}:
        assert (placed["backend"], placed["layers_offloaded"], placed["vram_bytes"]) == (
            "CPU",
            0,
            0,
        )
    ps = httpx.get(f"{url}/api/ps", timeout=10).json()["models"][0]
    assert ps["size_vram"] == placed["vram_bytes"]
    assert metric(url, "model_layers_offloaded") == placed["layers_offloaded"]
    assert metric(url, "model_vram_bytes") == placed["vram_bytes"]
    text = httpx.get(f"{url}/metrics", timeout=10).text
    labels = f'backend="CPU",device="{cpu["name"]}",kind="cpu"'
    total = f"llamarunner:device_memory_total_bytes{{{labels}"
    line = next(line for line in text.splitlines() if line.startswith(total))
    assert float(line.rsplit(" ", 1)[1]) == cpu["memory_total"]


def test_the_slot_table_shows_phase_and_tokens_generated(tiny_server: Server) -> None:
    url = tiny_server.url
    wait_idle(url)
    slots = httpx.get(f"{url}/slots", timeout=10).json()
    assert {s["phase"] for s in slots} == {"idle"}
    assert all(s["generated_tokens"] == 0 and s["prompt_tokens"] == 0 for s in slots)
    body = {"prompt": "xyz", "options": {"num_predict": 100_000, "ignore_eos": True}}
    lines = stream_lines(url, body)
    for _ in range(5):
        assert next(lines)["done"] is False
    busy = [s for s in httpx.get(f"{url}/slots", timeout=10).json() if s["busy"]]
    assert len(busy) == 1, busy
    slot = busy[0]
    assert slot["phase"] == "decode"
    assert slot["prompt_tokens"] == len(byte_tokens("xyz"))
    assert slot["prompt_processed_tokens"] == slot["prompt_tokens"]
    assert slot["generated_tokens"] >= 4
    lines.close()  # closing the stream cancels the request
    wait_idle(url)


# --- slot files ----------------------------------------------------------------------------


def serve_flags(tmp: Path) -> list[str]:
    return ["--port", "0", "--threads", "1", "--parallel", "2", "--slot-save-path", str(tmp)]


@pytest.fixture
def slot_dir(tmp_path: Path) -> Path:
    return tmp_path / "slots"  # made by the server


def test_slot_files_are_off_without_a_directory(tiny_server: Server) -> None:
    for action in ("save", "restore"):
        r = post(tiny_server.url, f"/slots/0?action={action}", {"filename": "x.bin"})
        assert r.status_code == 501, r.text
        assert error_type(r) == "not_supported"
        assert "--slot-save-path" in r.json()["error"]["message"]


def test_a_saved_slot_survives_a_restart_and_its_prefix_is_reused(
    tiny_model: Path, eos_model: Path, slot_dir: Path
) -> None:
    prompt = "the cat is the dog and the world of hello " * 4
    with ServeProcess(str(tiny_model), *serve_flags(slot_dir)) as first:
        url = first.wait_ready()
        text, done = complete(url, prompt, num_predict=6, temperature=0, ignore_eos=True)
        wait_idle(url)
        saved = post(url, "/slots/0?action=save", {"filename": "system.bin"})
        assert saved.status_code == 200, saved.text
        n = saved.json()["n_saved"]
        # The prompt and every generated token but the last are in the cache.
        assert n == done["prompt_eval_count"] + 5
        assert saved.json()["n_written"] == (slot_dir / "system.bin").stat().st_size
        first.proc.send_signal(signal.SIGINT)
        assert first.wait(30) == 0

    with ServeProcess(str(tiny_model), *serve_flags(slot_dir)) as second:
        url = second.wait_ready()
        restored = post(url, "/slots/1?action=restore", {"filename": "system.bin"})
        assert restored.status_code == 200, restored.text
        assert restored.json()["n_restored"] == n
        table = httpx.get(f"{url}/slots", timeout=10).json()
        assert [s["cached_tokens"] for s in table] == [0, n]
        again, done = complete(url, prompt, num_predict=6, temperature=0, ignore_eos=True)
        # All but the last prompt token come from the restored cache, and the greedy text is
        # the one the first server wrote: the restored KV is the computed one.
        assert done["prompt_cached_count"] == done["prompt_eval_count"] - 1
        assert again == text

    # Another model (same shapes, other weights) refuses the file.
    with ServeProcess(str(eos_model), *serve_flags(slot_dir)) as other:
        url = other.wait_ready()
        r = post(url, "/slots/0?action=restore", {"filename": "system.bin"})
        assert r.status_code == 400 and error_type(r) == "invalid_slot_file", r.text
        assert "another model" in r.json()["error"]["message"]


@pytest.fixture
def slot_server(tiny_model: Path, slot_dir: Path) -> Iterator[str]:
    with ServeProcess(str(tiny_model), *serve_flags(slot_dir)) as serve:
        yield serve.wait_ready()


def test_hostile_file_names_are_refused(slot_server: str, slot_dir: Path) -> None:
    url = slot_server
    outside = slot_dir.parent / "escape.bin"
    names = [
        "../escape.bin",
        str(outside),
        "..",
        ".",
        "",
        ".hidden.bin",
        "a/b.bin",
        "a\\b.bin",
        "a\x00b.bin",
        "x" * 129,
        "name with spaces.bin",
        "caf\u00e9.bin",
        "%2e%2e%2fescape.bin",
    ]
    for name in names:
        for action in ("save", "restore"):
            r = post(url, f"/slots/0?action={action}", {"filename": name})
            assert r.status_code == 400, (action, name, r.text)
            assert error_type(r) == "invalid_request", (action, name)
    for body in [{}, {"filename": None}, {"filename": 5}, ["x.bin"]]:
        r = post(url, "/slots/0?action=save", body)
        assert r.status_code == 400, (body, r.text)
    assert not outside.exists()
    assert sorted(p.name for p in slot_dir.iterdir()) == []
    # Unknown slots and actions.
    assert post(url, "/slots/2?action=erase").status_code == 404
    assert error_type(post(url, "/slots/2?action=erase")) == "slot_not_found"
    assert error_type(post(url, "/slots/-1?action=erase")) == "invalid_request"
    assert error_type(post(url, "/slots/0?action=delete")) == "invalid_request"
    r = post(url, "/slots/0?action=restore", {"filename": "missing.bin"})
    assert r.status_code == 404 and error_type(r) == "file_not_found"


def test_a_busy_slot_is_refused_and_erase_empties_an_idle_one(slot_server: str) -> None:
    url = slot_server
    # A file to restore exists (a restore of a missing one is a 404 before the slot is asked).
    assert post(url, "/slots/0?action=save", {"filename": "b.bin"}).status_code == 200
    body = {"prompt": "xyz", "options": {"num_predict": 100_000, "ignore_eos": True}}
    lines = stream_lines(url, body)
    next(lines)

    def busy_slots() -> list[dict[str, Any]]:
        return [s for s in httpx.get(f"{url}/slots", timeout=10).json() if s["busy"]]

    wait_until(lambda: len(busy_slots()) == 1, "the request to show in /slots")
    busy = busy_slots()[0]
    for action, payload in [("save", {"filename": "b.bin"}), ("restore", {"filename": "b.bin"})]:
        r = post(url, f"/slots/{busy['id']}?action={action}", payload)
        assert r.status_code == 409 and error_type(r) == "slot_busy", r.text
    r = post(url, f"/slots/{busy['id']}?action=erase")
    assert r.status_code == 409 and error_type(r) == "slot_busy"
    # The running request is untouched.
    assert next(lines)["done"] is False
    lines.close()
    wait_idle(url)
    cached = next(
        s["cached_tokens"]
        for s in httpx.get(f"{url}/slots", timeout=10).json()
        if s["id"] == busy["id"]
    )
    assert cached > 0
    r = post(url, f"/slots/{busy['id']}?action=erase")
    assert r.status_code == 200 and r.json() == {"id_slot": busy["id"], "n_erased": cached}
    _, done = complete(url, "xyz", num_predict=2)
    assert done["prompt_cached_count"] == 0


def test_restoring_a_garbage_file_is_a_clean_error_and_the_server_keeps_serving(
    slot_server: str, slot_dir: Path
) -> None:
    url = slot_server
    complete(url, "hello world", num_predict=4, temperature=0)
    wait_idle(url)
    assert post(url, "/slots/0?action=save", {"filename": "good.bin"}).status_code == 200
    good = (slot_dir / "good.bin").read_bytes()
    (slot_dir / "garbage.bin").write_bytes(os.urandom(4096))
    (slot_dir / "truncated.bin").write_bytes(good[: len(good) // 2])
    flipped = bytearray(good)
    flipped[len(flipped) // 2] ^= 0xFF
    (slot_dir / "flipped.bin").write_bytes(bytes(flipped))
    (slot_dir / "empty.bin").write_bytes(b"")
    (slot_dir / "a-directory").mkdir()
    for name in ["garbage.bin", "truncated.bin", "flipped.bin", "empty.bin", "a-directory"]:
        r = post(url, "/slots/1?action=restore", {"filename": name})
        assert r.status_code == 400, (name, r.text)
        assert error_type(r) == "invalid_slot_file", (name, r.text)
        assert name in r.json()["error"]["message"]
        assert str(slot_dir) not in r.json()["error"]["message"]  # no server paths
    # Nor can a save replace a directory.
    r = post(url, "/slots/0?action=save", {"filename": "a-directory"})
    assert r.status_code == 400 and error_type(r) == "invalid_request", r.text
    assert "is a directory" in r.json()["error"]["message"]
    assert httpx.get(f"{url}/health", timeout=10).status_code == 200
    _, again = complete(url, "hello world", num_predict=4, temperature=0)
    assert again["eval_count"] == 4
    r = post(url, "/slots/1?action=restore", {"filename": "good.bin"})
    assert r.status_code == 200, r.text


def forge_first_cell(good: bytes, pos: int) -> bytes:
    """The slot file ``good`` (``ops/slot_file.rs``'s layout) with the first KV cell of its
    llama.cpp state moved to position ``pos``, its checksum made again: what anyone who can
    write into the slot directory can make. The state: an 8-byte header, the stream count,
    then stream 0's cell count and its cells (position, 1, sequence id: 12 bytes each)."""
    _, o, _ = slot_file_state(good)
    assert struct.unpack_from("<iIi", good, o + 16) == (0, 1, 0)  # position 0 of sequence 0
    return forge_cells(good, {0: pos})


def forge_cells(good: bytes, positions: dict[int, int]) -> bytes:
    """The slot file ``good`` with cell ``i`` of stream 0 (taken modulo its cell count) moved
    to position ``positions[i]``, its checksum made again (see ``forge_first_cell``)."""
    _, o, _ = slot_file_state(good)
    body = bytearray(good[:-32])
    (cells,) = struct.unpack_from("<I", body, o + 12)
    for i, pos in positions.items():
        struct.pack_into("<i", body, o + 16 + 12 * (i % cells), pos)
    return bytes(body) + hashlib.sha256(bytes(body)).digest()


def test_a_forged_state_with_a_position_twice_is_refused_and_the_slot_serves(
    slot_server: str, slot_dir: Path
) -> None:
    """Found by the generator below: cell 1 moved to position 0 kept the last position (so the
    token count matched), and llama.cpp refused the slot's every later decode."""
    url = slot_server
    complete(url, "hello world", num_predict=4, temperature=0)
    wait_idle(url)
    assert post(url, "/slots/0?action=save", {"filename": "good.bin"}).status_code == 200
    good = (slot_dir / "good.bin").read_bytes()
    (slot_dir / "forged.bin").write_bytes(forge_cells(good, {1: 0}))
    r = post(url, "/slots/0?action=restore", {"filename": "forged.bin"})
    assert r.status_code == 400 and error_type(r) == "invalid_slot_file", r.text
    assert "two cells at position 0" in r.text, r.text
    _, done = complete(url, "hello world", num_predict=2, temperature=0)
    assert done["eval_count"] == 2


@settings(
    max_examples=40,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture],
)
@given(
    st.dictionaries(
        st.integers(0, 63),
        st.one_of(st.integers(-(2**31), 2**31 - 1), st.sampled_from([-1, 0, 2**31 - 1])),
        min_size=1,
        max_size=4,
    )
)
def test_generated_cell_positions_are_restored_or_refused_and_the_slot_serves(
    slot_server: str, slot_dir: Path, positions: dict[int, int]
) -> None:
    """Any positions a forged state gives its cells: the restore is a 200 or a 400, and the
    slot serves the next request (the lowest free slot, 0, the one restored into)."""
    url = slot_server
    good_file = slot_dir / "good.bin"
    if not good_file.exists():
        complete(url, "hello world", num_predict=4, temperature=0)
        wait_idle(url)
        assert post(url, "/slots/0?action=save", {"filename": "good.bin"}).status_code == 200
    (slot_dir / "forged.bin").write_bytes(forge_cells(good_file.read_bytes(), positions))
    wait_idle(url)
    r = post(url, "/slots/0?action=restore", {"filename": "forged.bin"})
    assert r.status_code in (200, 400), r.text
    if r.status_code == 400:
        assert error_type(r) == "invalid_slot_file", r.text
    _, done = complete(url, "hello world", num_predict=2, temperature=0)
    assert done["eval_count"] == 2


@pytest.mark.parametrize("pos", [2**31 - 1, -1, -7, -(2**31)])
def test_a_forged_state_whose_cell_no_removal_reaches_leaves_every_slot_serving(
    slot_server: str, slot_dir: Path, pos: int
) -> None:
    """llama.cpp removes cells by position range, from 0 to below 2**31 - 1, and takes -1 for
    a free cell: a state giving a cell a position outside that range left the slot failing
    every decode until a restart. Now the state is refused before llama.cpp reads it."""
    url = slot_server
    complete(url, "hello world", num_predict=4, temperature=0)
    wait_idle(url)
    assert post(url, "/slots/0?action=save", {"filename": "good.bin"}).status_code == 200
    good = (slot_dir / "good.bin").read_bytes()
    (slot_dir / "forged.bin").write_bytes(forge_first_cell(good, pos))
    r = post(url, "/slots/0?action=restore", {"filename": "forged.bin"})
    assert r.status_code == 400 and error_type(r) == "invalid_slot_file", r.text
    # Refused by the walk of the state's bytes, before llama.cpp read it.
    assert f"holds a cell at position {pos}," in r.text, r.text
    table = httpx.get(f"{url}/slots", timeout=10).json()
    assert [s["cached_tokens"] for s in table] == [0, 0]
    # Slot 0, the lowest free one, serves again; so does erase, and a good restore.
    _, again = complete(url, "hello world", num_predict=4, temperature=0)
    assert again["eval_count"] == 4 and again["prompt_cached_count"] == 0
    wait_idle(url)
    assert post(url, "/slots/0?action=erase").status_code == 200
    r = post(url, "/slots/0?action=restore", {"filename": "good.bin"})
    assert r.status_code == 200, r.text
    _, cached = complete(url, "hello world", num_predict=4, temperature=0)
    assert cached["prompt_cached_count"] > 0
    assert httpx.get(f"{url}/health", timeout=10).json()["status"] == "ready"


# --- the load progress bar -----------------------------------------------------------------


def test_progress_bar_rendering() -> None:
    assert progress_bar(0.0, 10) == "[----------]   0%"
    assert progress_bar(0.5, 10) == "[#####-----]  50%"
    assert progress_bar(1.0, 10) == "[##########] 100%"
    assert progress_bar(7.0, 4) == "[####] 100%"
    assert progress_bar(-1.0, 4) == "[----]   0%"


def test_the_ready_line_names_the_model() -> None:
    assert model_name(ServerConfig(model="/m/gemma-3.gguf")) == "gemma-3"
    assert model_name(ServerConfig(model="/m/gemma-3.gguf", alias="g")) == "g"
    assert model_name(ServerConfig(model="/m/weights.bin")) == "weights.bin"


def read_pty_until(fd: int, pattern: str, timeout: float = 120) -> str:
    """What the terminal ``fd`` shows until ``pattern`` matches (or the process closed it)."""
    out = b""
    deadline = time.monotonic() + timeout
    while not re.search(pattern, out.decode("utf-8", "replace")):
        left = deadline - time.monotonic()
        assert left > 0, f"no {pattern!r} within {timeout} s: {out!r}"
        ready, _, _ = select.select([fd], [], [], left)
        if not ready:
            continue
        try:
            chunk = os.read(fd, 65536)
        except OSError:  # EIO: the other end is closed
            chunk = b""
        if not chunk:
            raise AssertionError(f"the terminal closed before {pattern!r}: {out!r}")
        out += chunk
    return out.decode("utf-8", "replace")


def test_serve_on_a_terminal_shows_a_progress_bar_then_the_ready_line(tiny_model: Path) -> None:
    controller, terminal = pty.openpty()
    env = {k: v for k, v in os.environ.items() if not k.startswith("LLAMARUNNER_")}
    proc = subprocess.Popen(
        [sys.executable, "-m", "llamarunner", "serve", str(tiny_model), "--port", "0"],
        stdin=subprocess.DEVNULL,
        stdout=terminal,
        stderr=terminal,
        env=env,
    )
    os.close(terminal)
    try:
        shown = read_pty_until(controller, r"ready on http://\S+ \(model tiny\)")
        assert re.search(r"\r\x1b\[Kllamarunner: loading \[[#-]+\] +\d+%", shown), repr(shown)
        assert "[" + "#" * 10 in shown and "100%" in shown, repr(shown)
        # The bar is cleared before the ready line, which stands on a line of its own.
        bar_end = shown.rindex("100%")
        assert "\r\x1b[K" in shown[bar_end:], repr(shown)
        proc.send_signal(signal.SIGINT)
        read_pty_until(controller, "shutting down")
        assert proc.wait(timeout=30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=30)
        os.close(controller)


def test_serve_without_a_terminal_writes_plain_lines(tiny_model: Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("LLAMARUNNER_")}
    with ServeProcess(str(tiny_model), "--port", "0", env=env) as serve:
        url = serve.wait_ready()
        assert re.search(r"ready on \S+ \(model tiny\)", serve.log)
        complete(url, "hello", num_predict=2)
        serve.proc.send_signal(signal.SIGINT)
        assert serve.wait(timeout=30) == 0
    log = serve.log
    assert "\r" not in log and "\x1b[" not in log, repr(log)
    assert "loading [" not in log and "[#" not in log, repr(log)


# --- the real model ------------------------------------------------------------------------


@pytest.mark.real_model
def test_tokenize_round_trip_on_the_real_model(default_model: Path) -> None:
    with Server(str(default_model), port=0, threads=2, ctx_size=512) as srv:
        client = srv.client()
        text = "The capital of France is Paris. Ünïcödé, 日本語 and emoji 🙂 too."
        tokens = client.tokenize(text)
        assert client.detokenize(tokens) == text
        assert len(tokens) < len(text.encode())
        with_bos = client.tokenize(text, add_special=True)
        props = httpx.get(f"{srv.url}/props", timeout=10).json()
        assert with_bos == [props["bos_token_id"], *tokens]
        assert client.detokenize(with_bos) == props["bos_token"] + text
        pieces = client.tokenize(text, with_pieces=True)
        assert [p.id for p in pieces] == tokens
        # A piece that is part of a character comes as bytes; the pieces join into the text.
        joined = b"".join(p.piece.encode() if isinstance(p.piece, str) else p.piece for p in pieces)
        assert joined.decode() == text
        # Special tokens in the text are parsed.
        assert client.tokenize(props["bos_token"]) == [props["bos_token_id"]]
        with pytest.raises(BadRequestError):
            client.detokenize([props["model"]["n_vocab"]])
        assert props["model"]["architecture"] == "gemma3"
        assert props["n_ctx"] == 512


@pytest.mark.real_model
def test_a_real_model_slot_survives_a_restart(default_model: Path, slot_dir: Path) -> None:
    system = (
        "You are a careful assistant. Answer in one short sentence, in plain English, and "
        "say so when you do not know. " * 6
    )
    prompt = system + "Q: What is the capital of France?\nA:"
    # Greedy text is compared across the restart, so both sides decode alike: no drafts, and
    # the answer compared is the second one, which (as after the restore) decodes the
    # prompt's last token alone (llama.cpp's CPU kernels are not batch-invariant).
    flags = [*serve_flags(slot_dir), "--ctx-size", "1024", "--threads", "2", "--draft-max", "0"]
    with ServeProcess(str(default_model), *flags) as first:
        url = first.wait_ready()
        complete(url, prompt, num_predict=8, temperature=0)
        wait_idle(url)
        text, done = complete(url, prompt, num_predict=8, temperature=0)
        assert done["prompt_cached_count"] == done["prompt_eval_count"] - 1
        wait_idle(url)
        r = post(url, "/slots/0?action=save", {"filename": "system.bin"})
        assert r.status_code == 200, r.text
        n = r.json()["n_saved"]
        assert n >= done["prompt_eval_count"]
        first.proc.send_signal(signal.SIGINT)
        assert first.wait(30) == 0
    with ServeProcess(str(default_model), *flags) as second:
        url = second.wait_ready()
        r = post(url, "/slots/0?action=restore", {"filename": "system.bin"})
        assert r.status_code == 200, r.text
        assert r.json()["n_restored"] == n
        again, done = complete(url, prompt, num_predict=8, temperature=0)
        assert done["prompt_cached_count"] == done["prompt_eval_count"] - 1
        assert again == text
        wait_idle(url)
        # Another question after the same system prompt reuses all of the system prompt (but
        # for its last token, which may merge with what follows it).
        other = system + "Q: What is the capital of Italy?\nA:"
        _, done = complete(url, other, num_predict=4, temperature=0)
        system_tokens = len(Client(url).tokenize(system, add_special=True))
        assert done["prompt_cached_count"] >= system_tokens - 2, (done, system_tokens)
        # A forged cell in the full-attention cache, the first of this sliding-window model's
        # two (llama.cpp's range checks see only the windowed one): the walk of the state's
        # bytes refuses it, and the server serves on.
        wait_idle(url)
        good = (slot_dir / "system.bin").read_bytes()
        (slot_dir / "forged.bin").write_bytes(forge_first_cell(good, -7))
        r = post(url, "/slots/0?action=restore", {"filename": "forged.bin"})
        assert r.status_code == 400 and "holds a cell at position -7" in r.text, r.text
        _, done = complete(url, prompt, num_predict=4, temperature=0)
        assert done["eval_count"] == 4
