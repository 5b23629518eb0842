"""Small HTTP helpers for the end-to-end tests."""

from __future__ import annotations

import json
from typing import Any

import httpx


def complete(url: str, prompt: str, **options: Any) -> tuple[str, dict[str, Any]]:
    """Runs one streaming completion; returns (text, final message)."""
    text = []
    with httpx.stream(
        "POST", f"{url}/completion", json={"prompt": prompt, "options": options}, timeout=300
    ) as r:
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
