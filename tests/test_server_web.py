"""The web chat at `/`, driven in a real headless browser (Debian's chromium and chromedriver,
through Selenium): send a message, see the answer stream in, keep the conversation, show tokens
per second. A screenshot is saved to artifacts/ for a person to look at."""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
from test_server_toy import ROOT, WORDS, Server, toy_server

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
CHROMEDRIVER = shutil.which("chromedriver")


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    # 25 ms per token, so that the answer visibly streams and tokens/s is a real number
    s = toy_server(tmp_path_factory.mktemp("web"), "-E", "delay_ms=25")
    yield s
    assert s.stop() == 0


@pytest.fixture
def browser() -> Iterator[object]:
    if CHROMIUM is None or CHROMEDRIVER is None:
        if os.environ.get("CI"):  # CI installs them: a missing browser there is a failure, not a skip
            pytest.fail("chromium or chromedriver is missing on the CI machine")
        pytest.skip(
            "needs Debian's chromium and chromium-driver (apt-get install chromium chromium-driver; .ci/run does)"
        )
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    profile = tempfile.mkdtemp(prefix="infer-web-")
    opts = webdriver.ChromeOptions()
    opts.binary_location = CHROMIUM
    for flag in (
        "--headless",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-background-networking",
        "--disable-component-update",
        "--disable-sync",
        "--no-first-run",
        "--disable-dev-shm-usage",
        f"--user-data-dir={profile}",
        "--window-size=1200,800",
    ):
        opts.add_argument(flag)
    driver = webdriver.Chrome(service=Service(CHROMEDRIVER), options=opts)
    try:
        yield driver
    finally:
        driver.quit()
        shutil.rmtree(profile, ignore_errors=True)


def test_web_chat_streams_an_answer(server: Server, browser: object) -> None:
    from selenium.webdriver.common.by import By
    from selenium.webdriver.remote.webdriver import WebDriver
    from selenium.webdriver.support.ui import WebDriverWait

    d: WebDriver = browser  # type: ignore[assignment]
    wait = WebDriverWait(d, 20, poll_frequency=0.02)
    d.get(server.url + "/")
    wait.until(
        lambda _: (
            "toy" in d.find_element(By.ID, "model").text and "slot" in d.find_element(By.ID, "model").text
        )
    )
    # settings the toy engine does not honour are disabled; the ones it does show the server's defaults
    assert not d.find_element(By.ID, "temperature").get_property("disabled")
    d.find_element(By.ID, "system").send_keys("You are terse.")
    d.find_element(By.ID, "max_tokens").send_keys("30")
    d.find_element(By.ID, "temperature").send_keys("0")

    d.find_element(By.ID, "prompt").send_keys("Tell me a story")
    d.find_element(By.ID, "send").click()
    answer = wait.until(lambda _: d.find_elements(By.CSS_SELECTOR, ".msg.assistant .content"))[0]
    # while it streams: part of the answer is there, and the live tokens/s too
    wait.until(lambda _: len(answer.text.split()) >= 3 and "t/s" in d.find_element(By.ID, "tps").text)
    partial = answer.text.split()
    assert "generating" in d.find_element(By.ID, "tps").text and len(partial) < 30
    # then the whole answer and its statistics
    stats = wait.until(lambda _: d.find_element(By.CSS_SELECTOR, ".msg.assistant .stats").text or None)
    assert "30 tokens" in stats and "t/s" in stats and "length" in stats
    words = answer.text.split()
    assert len(words) == 30 and set(words) <= set(WORDS) and words[: len(partial)] == partial

    # a second turn sends the whole conversation (the prompt grows), and the history shows both turns
    first_prompt = [e for e in server.events("request.done") if e["route"] == "/v1/chat/completions"][-1]
    d.find_element(By.ID, "prompt").send_keys("And then?")
    d.find_element(By.ID, "send").click()
    wait.until(
        lambda _: (
            len(d.find_elements(By.CSS_SELECTOR, ".msg.assistant .stats")) == 2
            and "t/s" in d.find_elements(By.CSS_SELECTOR, ".msg.assistant .stats")[1].text
        )
    )
    second_prompt = [e for e in server.events("request.done") if e["route"] == "/v1/chat/completions"][-1]
    assert second_prompt["prompt_tokens"] > first_prompt["prompt_tokens"] + len(" ".join(words))
    assert [e.text.split("\n")[0].lower() for e in d.find_elements(By.CSS_SELECTOR, ".msg .who")] == [
        "user",
        "assistant",
        "user",
        "assistant",
    ]

    artifacts = ROOT / "artifacts"
    artifacts.mkdir(exist_ok=True)
    shot = artifacts / "web-chat.png"
    d.save_screenshot(str(shot))
    assert shot.stat().st_size > 10_000

    # the conversation survives a reload; New chat clears it
    d.refresh()
    wait.until(lambda _: len(d.find_elements(By.CSS_SELECTOR, ".msg.assistant")) == 2)
    d.find_element(By.ID, "new-chat").click()
    assert d.find_elements(By.CSS_SELECTOR, ".msg") == []


def test_web_chat_shows_errors(server: Server, browser: object, tmp_path: Path) -> None:
    from selenium.webdriver.common.by import By
    from selenium.webdriver.remote.webdriver import WebDriver
    from selenium.webdriver.support.ui import WebDriverWait

    d: WebDriver = browser  # type: ignore[assignment]
    wait = WebDriverWait(d, 20, poll_frequency=0.05)
    d.get(server.url + "/")
    wait.until(lambda _: "slot" in d.find_element(By.ID, "model").text)
    d.find_element(By.ID, "prompt").send_keys("x" * 5000)  # over the toy's 4096-token context
    d.find_element(By.ID, "send").click()
    error = wait.until(lambda _: d.find_elements(By.CSS_SELECTOR, ".msg.error .content"))[0]
    assert "context" in error.text
