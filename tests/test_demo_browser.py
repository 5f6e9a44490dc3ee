"""The browser demo end to end: headless Chromium (Debian's /usr/bin/chromium,
driven by Selenium through /usr/bin/chromedriver) loads `/` from a real
orpheus-tiny server on loopback, speaks through /v1/realtime and reports what
it measured on `window.mstarDemo` and in the page.

Skipped when Chromium, its driver or Selenium is missing;
`scripts/browser_test.sh` installs them and runs this file.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import tempfile
import threading
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from http_support import running_engine, serving_app

from mstar.config import ServerConfig
from mstar.http.server import build_app

CHROMIUM = "/usr/bin/chromium"
DRIVER = "/usr/bin/chromedriver"
MODEL = "orpheus-tiny"
HEARING_MODEL = "qwen3-omni-tiny"
KEY = "sk-demo-key"

try:
    from selenium import webdriver
    from selenium.common.exceptions import TimeoutException
    from selenium.webdriver.chrome.options import Options
    from selenium.webdriver.chrome.service import Service
    from selenium.webdriver.common.by import By
    from selenium.webdriver.common.keys import Keys
    from selenium.webdriver.support.ui import Select, WebDriverWait
except ImportError:
    webdriver = None

_missing = [what for what, ok in ((CHROMIUM, os.path.exists(CHROMIUM)), (DRIVER, os.path.exists(DRIVER)),
                                  ("the selenium package", webdriver is not None)) if not ok]
if _missing:
    pytest.skip(f"no {', '.join(_missing)}: run scripts/browser_test.sh (apt chromium chromium-driver, "
                "pip selenium)", allow_module_level=True)

# headless, and nothing that reaches outside the machine or waits for a user gesture to play audio
FLAGS = ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync",
         "--autoplay-policy=no-user-gesture-required", "--disable-dev-shm-usage")


def serve_in_thread(config: ServerConfig | None = None, model: str = MODEL) -> Iterator[str]:
    """`model` (orpheus-tiny) behind the app, on a loop of its own in a thread:
    the Selenium calls block, so the server cannot share the test's loop."""
    started = threading.Event()
    box: dict[str, Any] = {}

    async def serve() -> None:
        try:
            async with running_engine(model) as engine, \
                    serving_app(build_app(engine, manage_engine=False, config=config), handler_cancellation=True,
                                access_log=None, shutdown_timeout=1.0) as url:
                box["stop"] = asyncio.Event()
                box["loop"] = asyncio.get_running_loop()
                box["url"] = url
                started.set()
                await box["stop"].wait()
        except Exception as e:  # surfaced in the test thread
            box["error"] = e
        finally:
            started.set()

    thread = threading.Thread(target=asyncio.run, args=(serve(),), name="demo-server", daemon=True)
    thread.start()
    assert started.wait(180), "the server did not start"
    if "error" in box:
        raise box["error"]
    yield box["url"]
    box["loop"].call_soon_threadsafe(box["stop"].set)
    thread.join(60)


@pytest.fixture(scope="module")
def server() -> Iterator[str]:
    yield from serve_in_thread()


@pytest.fixture(scope="module")
def keyed_server() -> Iterator[str]:
    yield from serve_in_thread(ServerConfig(api_key=KEY))


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    yield from chromium()


def chromium(*flags: str) -> Iterator[Any]:
    profile = tempfile.mkdtemp(prefix="mstar-chromium-")
    options = Options()
    options.binary_location = CHROMIUM
    for flag in (*FLAGS, *flags, f"--user-data-dir={profile}"):
        options.add_argument(flag)
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    driver = webdriver.Chrome(service=Service(executable_path=DRIVER), options=options)
    try:
        yield driver
    finally:
        driver.quit()
        shutil.rmtree(profile, ignore_errors=True)


def demo(driver: Any) -> dict[str, Any]:
    return driver.execute_script("return window.mstarDemo")


def wait_for(driver: Any, check: Callable[[dict[str, Any]], bool], what: str, timeout: float = 120) -> dict:
    try:
        # the page's state is None until its script has run (a loaded box can poll before that)
        WebDriverWait(driver, timeout, poll_frequency=0.05).until(lambda d: (s := demo(d)) is not None and check(s))
    except TimeoutException:
        pytest.fail(f"timed out waiting for {what}; page state {demo(driver)}; console {driver.get_log('browser')}")
    return demo(driver)


def open_page(driver: Any, server: str, max_tokens: int, stream: bool = False) -> None:
    """A fresh page, connected, with the token limit and mode set."""
    driver.get_log("browser")  # the log outlives pages: what an earlier test left is not this page's
    driver.get(server + "/")
    wait_for(driver, lambda s: s["connected"] and s["session"] is not None, "session.created", timeout=30)
    driver.find_element(By.ID, "maxTokens").send_keys(str(max_tokens))
    if stream:
        driver.find_element(By.ID, "streamMode").click()


def type_text(driver: Any, text: str) -> Any:
    box = driver.find_element(By.ID, "text")
    box.clear()
    box.send_keys(text)
    return box


def text_of(driver: Any, element_id: str) -> str:
    return driver.find_element(By.ID, element_id).text


def no_console_errors(driver: Any) -> None:
    severe = [e for e in driver.get_log("browser") if e["level"] == "SEVERE"]
    assert not severe, severe


def test_speak_streams_audio_and_measures_it(server: str, browser: Any) -> None:
    open_page(browser, server, max_tokens=60)
    voices = [o.get_attribute("value") for o in Select(browser.find_element(By.ID, "voice")).options]
    assert "tara" in voices and "leo" in voices
    Select(browser.find_element(By.ID, "voice")).select_by_value("leo")
    assert browser.find_element(By.ID, "mic").get_attribute("disabled") is not None
    assert text_of(browser, "micNote") == "this model takes no audio input"
    said = "Hello from the browser test."
    type_text(browser, said)
    browser.find_element(By.ID, "speak").click()

    state = wait_for(browser, lambda s: len(s["responses"]) == 1, "response.done")
    assert state["responses"][0] in ("completed", "incomplete"), state
    assert state["errors"] == [], state["errors"]
    assert state["session"]["audio"]["output"]["voice"] == "leo"  # session.update took the picked voice
    assert state["audioBytes"] > 0 and state["audioBytes"] % 2 == 0
    assert state["ttfaMs"] is not None and state["ttfaMs"] > 0
    assert state["transcript"] == said
    assert state["audioState"] == "running"  # Web Audio played it (to headless Chromium's null sink)
    assert text_of(browser, "audioBytes") == str(state["audioBytes"])
    assert abs(int(text_of(browser, "ttfa")) - state["ttfaMs"]) <= 1  # JS rounds halves its own way
    assert text_of(browser, "transcript") == said
    assert text_of(browser, "status") == state["responses"][0]
    no_console_errors(browser)


def test_stop_cancels_the_response_and_playback(server: str, browser: Any) -> None:
    open_page(browser, server, max_tokens=1000)  # ~30 s of generation on CPU: still running when stopped
    type_text(browser, "A long answer that the listener interrupts.")
    browser.find_element(By.ID, "speak").click()
    wait_for(browser, lambda s: s["audioBytes"] > 0 and s["scheduled"] > 0, "the first audio playing")
    browser.find_element(By.ID, "stop").click()
    assert demo(browser)["scheduled"] == 0  # local playback stopped at once, before the server answers

    state = wait_for(browser, lambda s: len(s["responses"]) == 1, "response.done after response.cancel", 30)
    assert state["responses"] == ["cancelled"] and state["errors"] == []
    assert state["audioSeconds"] < 20  # far less than the 1000 tokens would have made
    assert text_of(browser, "status") == "cancelled"
    no_console_errors(browser)


def test_stream_text_adds_to_the_running_response(server: str, browser: Any) -> None:
    open_page(browser, server, max_tokens=200, stream=True)
    box = type_text(browser, "First part.")
    box.send_keys(Keys.ENTER)  # stream mode: Enter speaks, and while it speaks, sends more
    wait_for(browser, lambda s: s["audioBytes"] > 0, "the first audio")
    assert box.get_attribute("value") == ""
    type_text(browser, "Second part.").send_keys(Keys.ENTER)

    state = wait_for(browser, lambda s: s["responses"] and not s["active"], "response.done")
    assert state["errors"] == [], state["errors"]
    assert state["transcript"] == "First part. Second part."
    # one response: the second text joined it while it ran (the first part takes seconds to say)
    assert len(state["responses"]) == 1 and state["responses"][0] in ("completed", "incomplete"), state
    no_console_errors(browser)


def test_the_page_takes_the_servers_api_key(keyed_server: str, browser: Any) -> None:
    browser.get(keyed_server + "/")
    state = wait_for(browser, lambda s: s["errors"], "the page to be refused", timeout=30)
    assert state["errors"] == [{"code": "auth", "message": "the server wants an API key: enter it above"}]
    assert not state["connected"]
    browser.find_element(By.ID, "apiKey").send_keys(KEY + Keys.TAB)  # the field's change event: on leaving it
    # the models come with the key as a bearer header, the websocket with it as the subprotocol
    state = wait_for(browser, lambda s: s["connected"] and s["session"] is not None, "session.created", 30)
    assert state["session"]["model"] == MODEL
    browser.find_element(By.ID, "maxTokens").send_keys("30")
    type_text(browser, "Hello with a key.")
    browser.find_element(By.ID, "speak").click()
    state = wait_for(browser, lambda s: len(s["responses"]) == 1, "response.done")
    assert state["responses"][0] in ("completed", "incomplete") and state["audioBytes"] > 0, state
    assert len(state["errors"]) == 1  # only the refusal before the key


@pytest.fixture
def stoppable_server() -> Iterator[tuple[str, Callable[[], None]]]:
    """A server of the test's own, stopped when the test says (it stops at the end otherwise)."""
    serving = serve_in_thread()
    url = next(serving)
    yield url, lambda: next(serving, None)
    next(serving, None)


def test_a_refused_response_ends_the_pages_wait(server: str, browser: Any) -> None:
    open_page(browser, server, max_tokens=99_999_999)  # over the context: the server refuses response.create
    type_text(browser, "Too long an answer.")
    browser.find_element(By.ID, "speak").click()
    state = wait_for(browser, lambda s: s["errors"] and not s["active"], "the refusal to end the response", 30)
    assert [e["code"] for e in state["errors"]] == ["invalid_value"], state["errors"]
    assert state["responses"] == ["failed"] and text_of(browser, "status") == "failed"
    assert browser.find_element(By.ID, "stop").get_attribute("disabled") is not None

    limit = browser.find_element(By.ID, "maxTokens")  # a fixed limit: Speak starts a response again
    limit.clear()
    limit.send_keys("20")
    browser.find_element(By.ID, "speak").click()
    state = wait_for(browser, lambda s: len(s["responses"]) == 2, "the second response's response.done")
    assert state["responses"][1] in ("completed", "incomplete") and state["audioBytes"] > 0, state
    no_console_errors(browser)


def test_a_new_key_mid_response_ends_that_response(server: str, browser: Any) -> None:
    open_page(browser, server, max_tokens=1000)
    type_text(browser, "A long answer that a new key cuts short.")
    browser.find_element(By.ID, "speak").click()
    wait_for(browser, lambda s: s["audioBytes"] > 0, "the first audio")
    browser.find_element(By.ID, "apiKey").send_keys("sk-any" + Keys.TAB)  # the server has no key: still let in
    state = wait_for(browser, lambda s: not s["active"] and s["connected"], "the page to reconnect, idle", 30)
    assert state["responses"] == ["disconnected"] and state["scheduled"] == 0, state
    assert browser.find_element(By.ID, "sendMore").get_attribute("disabled") is not None

    browser.find_element(By.ID, "maxTokens").clear()
    browser.find_element(By.ID, "maxTokens").send_keys("20")
    browser.find_element(By.ID, "speak").click()
    state = wait_for(browser, lambda s: len(s["responses"]) == 2, "a response on the new socket")
    assert state["responses"][1] in ("completed", "incomplete") and state["errors"] == [], state
    no_console_errors(browser)


def test_the_server_ending_the_session_is_shown(stoppable_server: tuple[str, Callable[[], None]],
                                                browser: Any) -> None:
    url, stop_server = stoppable_server
    open_page(browser, url, max_tokens=1000)
    type_text(browser, "A long answer the server's shutdown cuts short.")
    browser.find_element(By.ID, "speak").click()
    wait_for(browser, lambda s: s["audioBytes"] > 0, "the first audio")
    stop_server()
    state = wait_for(browser, lambda s: not s["connected"] and not s["active"], "the socket's close", 30)
    # the close's code 1001 comes with the server's reason; the user reads why the answer stopped
    assert {"code": "websocket", "message": "the realtime session closed: the server is shutting down"} \
        in state["errors"], state["errors"]
    assert "the server is shutting down" in text_of(browser, "errors")


@pytest.fixture(scope="module")
def hearing_server() -> Iterator[str]:
    yield from serve_in_thread(model=HEARING_MODEL)


@pytest.fixture(scope="module")
def listening_browser() -> Iterator[Any]:
    """Chromium whose microphone is its fake device (a tone that does not stop), granted without asking."""
    yield from chromium("--use-fake-device-for-media-stream", "--use-fake-ui-for-media-stream")


def test_stopping_the_microphone_mid_turn_answers_that_turn(hearing_server: str, listening_browser: Any) -> None:
    """The server's VAD heard speech start and waits for silence; recording
    stops first: the page commits the turn, which the server stops, commits
    and answers as the silence would have."""
    open_page(listening_browser, hearing_server, max_tokens=4)
    listening_browser.find_element(By.ID, "mic").click()
    wait_for(listening_browser, lambda s: s["vad"] == "speech", "the VAD hearing the fake microphone", 60)
    listening_browser.find_element(By.ID, "mic").click()
    # the server's own response (its VAD answers a turn), which the page follows
    state = wait_for(listening_browser, lambda s: s["active"] and s["audioBytes"] > 0, "the turn's answer", 120)
    assert len(state["turns"]) == 1 and state["turns"][0][1] is not None, state["turns"]  # its speech_stopped came
    no_console_errors(listening_browser)
