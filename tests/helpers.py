"""Small HTTP helpers for the end-to-end tests."""

from __future__ import annotations

import json
from typing import Any

import httpx


def complete(
    url: str, prompt: str, body: dict[str, Any] | None = None, **options: Any
) -> tuple[str, dict[str, Any]]:
    """Runs one streaming completion (``body``: extra top-level fields such as ``shift``);
    returns (text, final message)."""
    text = []
    request = {"prompt": prompt, "options": options, **(body or {})}
    with httpx.stream("POST", f"{url}/completion", json=request, timeout=300) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if not line:
                continue
            msg = json.loads(line)
            if msg["done"]:
                assert "error" not in msg, msg
                return "".join(text), msg
            text.append(msg["content"])
    raise AssertionError("stream ended without a final message")
