"""The browser face (`GET /`, `GET /dashboard`) in headless Chromium: the chat page streams,
stops (freeing the slot), keeps conversations across a reload, renders Markdown safely, asks
for the API key, and the dashboard shows a busy slot live.

Runs Debian's chromium and chromedriver through Selenium (never Selenium Manager, which would
download a browser). Skipped when they (or selenium) are missing, unless
``LLAMARUNNER_TESTS_REQUIRE_BROWSER`` is set (CI sets it): then that is a failure. Screenshots
for a developer to look at go to ``tests/artifacts/``.

The served model is a tiny "cycle" model: greedy, it writes "Lorem ipsu" over and over and never
ends by itself, so an answer lasts as long as its ``max_tokens`` (thousands of tokens a second).
"""

from __future__ import annotations

import json
import os
import re
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Callable

import httpx
import pytest

from llamarunner import Server

from helpers import Neighbour, wait_until
from tinymodel import write_cycle_model

REQUIRE_BROWSER_ENV = "LLAMARUNNER_TESTS_REQUIRE_BROWSER"


def browser_required() -> bool:
    return os.environ.get(REQUIRE_BROWSER_ENV, "") not in ("", "0")


if not browser_required():
    pytest.importorskip("selenium", reason="selenium is not installed")

from selenium import webdriver  # noqa: E402
from selenium.webdriver.chrome.service import Service  # noqa: E402
from selenium.webdriver.chrome.webdriver import WebDriver  # noqa: E402
from selenium.webdriver.common.by import By  # noqa: E402
from selenium.webdriver.support.ui import WebDriverWait  # noqa: E402

ARTIFACTS = Path(__file__).parent / "artifacts"
TEXT = "Lorem ipsu"  # the cycle model's text (its bytes must all differ)


def find_browser() -> tuple[str, str] | None:
    """(chromium, chromedriver) paths, or None."""
    chromium = next(
        (p for p in ("/usr/bin/chromium", shutil.which("chromium")) if p and os.path.exists(p)),
        None,
    )
    driver = next(
        (
            p
            for p in ("/usr/bin/chromedriver", shutil.which("chromedriver"))
            if p and os.path.exists(p)
        ),
        None,
    )
    return (chromium, driver) if chromium and driver else None


@pytest.fixture(scope="module")
def driver() -> Iterator[WebDriver]:
    found = find_browser()
    if found is None:
        why = "chromium and chromedriver are not installed (/usr/bin/chromium, chromedriver)"
        if browser_required():
            pytest.fail(f"{REQUIRE_BROWSER_ENV} is set but {why}")
        pytest.skip(why)
    chromium, chromedriver = found
    options = webdriver.ChromeOptions()
    options.binary_location = chromium
    for arg in (
        "--headless=new",
        "--no-sandbox",
        "--disable-dev-shm-usage",
        "--window-size=1280,860",
        "--no-first-run",
        "--disable-extensions",
    ):
        options.add_argument(arg)
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    d = webdriver.Chrome(service=Service(chromedriver), options=options)
    try:
        yield d
    finally:
        d.quit()


@pytest.fixture(scope="module")
def cycle_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_cycle_model(tmp_path_factory.mktemp("ui") / "cycle.gguf", TEXT)


@pytest.fixture(scope="module")
def server(cycle_model: Path) -> Iterator[Server]:
    # Slots of 4096 tokens: an answer may last ten slot contexts (40960 tokens), many seconds.
    with Server(str(cycle_model), port=0, parallel=2, ctx_size=4096, threads=1) as srv:
        yield srv


def wait(d: WebDriver, condition: Callable[[WebDriver], Any], timeout: float = 15) -> Any:
    return WebDriverWait(d, timeout, poll_frequency=0.05).until(condition)


def severe(d: WebDriver) -> list[dict[str, Any]]:
    """The console's errors since the last call (reading the log empties it)."""
    entries: list[dict[str, Any]] = d.get_log("browser")  # type: ignore[no-untyped-call]
    return [e for e in entries if e.get("level") == "SEVERE"]


def open_page(d: WebDriver, url: str, path: str = "/", fresh: bool = False) -> None:
    """Opens the page and waits until it has read the model list; ``fresh``: with empty
    storage (no conversations, settings or key)."""
    d.get(url + path)
    if fresh:
        d.execute_script("localStorage.clear()")
        d.get(url + path)
    wait(d, lambda d: d.execute_script("return document.getElementById('model').options.length"))


def set_settings(d: WebDriver, **values: str) -> None:
    """Types the settings (ids without ``#``, e.g. ``max_tokens="300"`` for ``#max-tokens``)
    into the settings panel and closes it."""
    d.find_element(By.ID, "settings-toggle").click()
    for name, value in values.items():
        field = d.find_element(By.ID, name.replace("_", "-"))
        field.clear()
        field.send_keys(value)
    d.find_element(By.ID, "settings-toggle").click()


def send(d: WebDriver, text: str) -> None:
    d.find_element(By.ID, "prompt").send_keys(text)
    d.find_element(By.ID, "send").click()


ANSWER_JS = """
const m = [...document.querySelectorAll('#messages .msg.assistant')].pop();
if (!m) return {state: '', text: '', meta: ''};
return {state: m.dataset.state, text: m.querySelector('.content').textContent,
        meta: m.querySelector('.meta').textContent};
"""


def answer(d: WebDriver) -> dict[str, str]:
    """The latest assistant message: its data-state, text and info line."""
    return dict(d.execute_script(ANSWER_JS))


def answered(d: WebDriver) -> dict[str, str]:
    """Waits for the latest answer to end; returns it."""
    wait(d, lambda d: answer(d)["state"] not in ("", "streaming"), timeout=30)
    return answer(d)


def busy_slots(url: str, headers: dict[str, str] | None = None) -> list[dict[str, Any]]:
    slots = httpx.get(f"{url}/slots", headers=headers, timeout=10).json()
    return [s for s in slots if s["busy"]]


def test_page_loads_without_console_errors(driver: WebDriver, server: Server) -> None:
    open_page(driver, server.url, fresh=True)
    assert driver.title == "llamarunner"
    assert driver.find_element(By.ID, "tab-chat").get_attribute("aria-selected") == "true"
    assert driver.find_element(By.ID, "chat-view").is_displayed()
    assert not driver.find_element(By.ID, "dashboard-view").is_displayed()
    # One model: no picker; no projector: no image button.
    assert not driver.find_element(By.ID, "model-picker").is_displayed()
    assert not driver.find_element(By.ID, "attach").is_displayed()
    # The same origin without text/html in Accept still gets Ollama's line.
    assert httpx.get(server.url + "/").text == "llamarunner is running"
    assert severe(driver) == []


def test_answer_streams_and_regenerates(driver: WebDriver, server: Server) -> None:
    open_page(driver, server.url, fresh=True)
    set_settings(driver, temperature="0", max_tokens="200")
    send(driver, "Hello there")
    done = answered(driver)
    assert done["state"] == "done", done
    assert done["text"].startswith(TEXT * 3), done
    assert "200 tokens" in done["meta"] and "tok/s" in done["meta"], done
    assert "prompt tokens cached" in done["meta"], done
    # Regenerate replaces the answer (the same prompt, now from the cache).
    driver.find_element(By.ID, "regenerate").click()
    again = answered(driver)
    assert again["state"] == "done" and again["text"] == done["text"], again
    cached = re.search(r"(\d+) of (\d+) prompt tokens cached", again["meta"])
    assert cached and int(cached.group(1)) > 0, again
    assert len(driver.find_elements(By.CSS_SELECTOR, "#messages .msg.assistant")) == 1
    assert severe(driver) == []


def test_stop_ends_the_stream_and_frees_the_slot(driver: WebDriver, server: Server) -> None:
    open_page(driver, server.url, fresh=True)
    set_settings(driver, temperature="0", max_tokens="40000")
    send(driver, "Write for a long time")
    # The answer grows while it streams.
    wait(driver, lambda d: answer(d)["state"] == "streaming" and len(answer(d)["text"]) > 0)
    first = len(answer(driver)["text"])
    wait(driver, lambda d: len(answer(d)["text"]) > first)
    assert answer(driver)["state"] == "streaming"
    assert busy_slots(server.url), "the answer holds no slot"
    assert driver.find_element(By.ID, "stop").is_displayed()
    driver.find_element(By.ID, "stop").click()
    wait(driver, lambda d: answer(d)["state"] != "streaming", timeout=30)
    stopped = answer(driver)
    assert stopped["state"] == "stopped", stopped
    assert stopped["text"].startswith(TEXT), stopped
    # Aborting the fetch closed the connection: the server cancelled it and freed the slot.
    wait_until(lambda: not busy_slots(server.url), "the stopped answer's slot to be free", 30)
    assert driver.find_element(By.ID, "send").is_displayed()
    assert not driver.find_element(By.ID, "stop").is_displayed()
    assert severe(driver) == []


def test_conversation_survives_a_reload(driver: WebDriver, server: Server) -> None:
    open_page(driver, server.url, fresh=True)
    set_settings(driver, temperature="0", max_tokens="30", top_k="5")
    send(driver, "First question")
    assert answered(driver)["state"] == "done"
    send(driver, "Second question")
    assert answered(driver)["state"] == "done"
    script = "return [...document.querySelectorAll('#messages .msg')].map(m => m.textContent)"
    before = driver.execute_script(script)
    assert len(before) == 4, before
    driver.refresh()
    wait(driver, lambda d: len(d.execute_script(script)) == 4)
    assert driver.execute_script(script) == before
    assert answer(driver)["state"] == "done"
    titles = [e.text for e in driver.find_elements(By.CSS_SELECTOR, "#conversations .open")]
    assert titles == ["First question"], titles
    # The settings were kept too.
    assert driver.find_element(By.ID, "max-tokens").get_attribute("value") == "30"
    assert driver.find_element(By.ID, "top-k").get_attribute("value") == "5"
    # A new chat starts empty; the old one stays listed.
    driver.find_element(By.ID, "new-chat").click()
    assert driver.find_elements(By.CSS_SELECTOR, "#messages .msg") == []
    send(driver, "Another chat")
    assert answered(driver)["state"] == "done"
    wait(driver, lambda d: len(d.find_elements(By.CSS_SELECTOR, "#conversations li")) == 2)
    assert severe(driver) == []


MARKDOWN = """## A heading

Some **bold**, *italic* and `inline <code>` text, a [link](https://example.com/a_b) and
[not a link](javascript:window.pwned=1).

<img src=x onerror="window.pwned=1"> <script>window.pwned=1</script>

- one
- two
  1. nested

```python
def greet(name):  # a comment
    return "hello " + name * 2
```

| model | tok/s |
|-------|------:|
| tiny  | 2000  |
"""


def test_markdown_is_rendered_safely(driver: WebDriver, server: Server) -> None:
    """An answer's Markdown is rendered (headings, emphasis, code, lists, tables, links) and
    its HTML is text: no tag or script of the model's gets into the page."""
    open_page(driver, server.url, fresh=True)
    conv = {
        "id": "md",
        "title": "Markdown",
        "updated": 1,
        "messages": [
            {"role": "user", "content": "Show me some Markdown <b>please</b>"},
            {"role": "assistant", "content": MARKDOWN, "state": "done"},
        ],
    }
    driver.execute_script(
        "localStorage.setItem('llamarunner.conversations', arguments[0]);"
        "localStorage.setItem('llamarunner.current', '\"md\"');",
        json.dumps([conv]),
    )
    driver.refresh()
    wait(driver, lambda d: d.find_elements(By.CSS_SELECTOR, "#messages .msg.assistant h2"))
    content = driver.find_element(By.CSS_SELECTOR, "#messages .msg.assistant .content")
    assert content.find_element(By.TAG_NAME, "h2").text == "A heading"
    assert content.find_element(By.TAG_NAME, "strong").text == "bold"
    assert content.find_element(By.TAG_NAME, "em").text == "italic"
    assert content.find_element(By.CSS_SELECTOR, "p code").text == "inline <code>"
    links = content.find_elements(By.TAG_NAME, "a")
    assert [a.get_attribute("href") for a in links] == ["https://example.com/a_b"]
    assert "noopener" in (links[0].get_attribute("rel") or "")
    assert "[not a link](javascript:window.pwned=1)" in content.text
    assert content.find_elements(By.TAG_NAME, "img") == []
    assert content.find_elements(By.TAG_NAME, "script") == []
    assert '<img src=x onerror="window.pwned=1">' in content.text
    assert driver.execute_script("return window.pwned") is None
    assert len(content.find_elements(By.CSS_SELECTOR, "ul > li")) == 2
    assert content.find_element(By.CSS_SELECTOR, "ul ol li").text == "nested"
    code = content.find_element(By.CSS_SELECTOR, ".code pre code")
    assert "def greet(name):" in code.text
    keywords = [e.text for e in code.find_elements(By.CSS_SELECTOR, ".tk")]
    assert keywords == ["def", "return"], keywords
    assert code.find_element(By.CSS_SELECTOR, ".tc").text == "# a comment"
    assert [e.text for e in content.find_elements(By.CSS_SELECTOR, "td")] == ["tiny", "2000"]
    user = driver.find_element(By.CSS_SELECTOR, "#messages .msg.user .content")
    assert user.text == "Show me some Markdown <b>please</b>"
    ARTIFACTS.mkdir(exist_ok=True)
    driver.save_screenshot(str(ARTIFACTS / "ui-chat.png"))
    assert severe(driver) == []


def test_dashboard_shows_a_busy_slot(driver: WebDriver, server: Server) -> None:
    open_page(driver, server.url, "/dashboard", fresh=True)
    assert driver.find_element(By.ID, "tab-dashboard").get_attribute("aria-selected") == "true"
    assert driver.find_element(By.ID, "dashboard-view").is_displayed()
    rows = "#slots tr[data-busy]"
    wait(driver, lambda d: len(d.find_elements(By.CSS_SELECTOR, rows)) == 2)
    with Neighbour(server.url):
        busy = wait(
            driver, lambda d: d.find_elements(By.CSS_SELECTOR, '#slots tr[data-busy="true"]')
        )
        assert len(busy) == 1
        cells = [td.text for td in busy[0].find_elements(By.TAG_NAME, "td")]
        assert cells[1] in ("busy", "paused") and cells[2] == "decode", cells
        wait(driver, lambda d: d.find_element(By.CSS_SELECTOR, "#stat-running .value").text == "1")
        wait(driver, lambda d: d.find_element(By.ID, "stat-gen-rate").text.count("tok/s"))
        ARTIFACTS.mkdir(exist_ok=True)
        driver.save_screenshot(str(ARTIFACTS / "ui-dashboard.png"))
    # Still live: the slot shows idle once the request is gone.
    wait(driver, lambda d: not d.find_elements(By.CSS_SELECTOR, '#slots tr[data-busy="true"]'))
    # The tab switches back to the chat, and the address with it.
    driver.find_element(By.ID, "tab-chat").click()
    assert driver.current_url == server.url + "/"
    assert driver.find_element(By.ID, "chat-view").is_displayed()
    assert severe(driver) == []


def test_the_page_asks_for_the_api_key(
    driver: WebDriver, cycle_model: Path, start_server: Callable[..., Server]
) -> None:
    srv = start_server(cycle_model, parallel=1, ctx_size=1024, threads=1, api_key="sekrit")
    assert httpx.get(srv.url + "/ui/app.js").status_code == 200  # the page needs no key
    driver.get(srv.url + "/")  # another port: another origin, so empty storage

    def dialog_open(d: WebDriver) -> bool:
        return bool(d.execute_script("return document.getElementById('key-dialog').open"))

    wait(driver, dialog_open)
    # A wrong key is refused, and asked for again.
    driver.find_element(By.ID, "api-key").send_keys("wrong")
    driver.find_element(By.ID, "api-key-save").click()
    wait(driver, lambda d: "refused" in d.find_element(By.ID, "key-why").text and dialog_open(d))
    field = driver.find_element(By.ID, "api-key")
    field.clear()
    field.send_keys("sekrit")
    driver.find_element(By.ID, "api-key-save").click()
    wait(
        driver, lambda d: d.execute_script("return document.getElementById('model').options.length")
    )
    assert not dialog_open(driver)
    assert driver.execute_script("return localStorage.getItem('llamarunner.key')") == '"sekrit"'
    set_settings(driver, temperature="0", max_tokens="20")
    send(driver, "Hello")
    done = answered(driver)
    assert done["state"] == "done" and done["text"].startswith(TEXT), done
    # After a reload the kept key is sent at once: no dialog.
    driver.refresh()
    wait(
        driver, lambda d: d.execute_script("return document.getElementById('model').options.length")
    )
    assert not dialog_open(driver)
    # The only console errors are the refused requests' (Chrome logs every 401).
    errors = [e for e in severe(driver) if "401" not in e.get("message", "")]
    assert errors == []
    headers = {"Authorization": "Bearer sekrit"}
    assert not busy_slots(srv.url, headers)
