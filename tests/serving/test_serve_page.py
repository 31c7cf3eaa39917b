"""The live page of `dgemma serve` (dgemma/serving/page.html) in a real headless Chromium driven by Selenium, against
a real `dgemma serve` on a free localhost port with a tiny random model: the page loads, a prompt streams visible
canvases (cells, accepted cells, a step counter that advances) and ends with the committed text and usage; a bad
sampler field shows the server's 400 in the error box; Stop aborts the stream and the server cancels the request.
Skipped only where selenium, chromium or chromedriver are missing (`apt-get install chromium-driver`)."""

from __future__ import annotations

import itertools
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections import deque
from pathlib import Path

import pytest

webdriver = pytest.importorskip("selenium.webdriver", reason="selenium not installed (pip install -e '.[dev]')")
httpx = pytest.importorskip("httpx")
pytest.importorskip("fastapi", reason="the serve extra is not installed (pip install -e '.[serve]')")

from selenium.webdriver.common.by import By  # noqa: E402
from selenium.webdriver.support.ui import WebDriverWait  # noqa: E402

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
CHROMEDRIVER = shutil.which("chromedriver") or ("/usr/bin/chromedriver" if Path("/usr/bin/chromedriver").exists()
                                                 else None)
pytestmark = [pytest.mark.integration,  # a browser and a server: the heavy tier
              pytest.mark.skipif(CHROMIUM is None or CHROMEDRIVER is None,
                                 reason="chromium and chromium-driver not installed (apt-get install chromium-driver)")]

CANVAS_LENGTH = 16  # the tiny preset's
TIMEOUT = 120


@pytest.fixture(scope="module")
def server():
    """`dgemma serve --preset tiny --random-init --port 0` as a subprocess (the real CLI and app); its URL is what it
    prints. Stopped with SIGINT (then killed) at teardown."""
    cmd = [sys.executable, "-m", "dgemma", "serve", "--preset", "tiny", "--random-init", "--host", "127.0.0.1",
           "--port", "0", "--max-batch", "4"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    lines: deque[str] = deque(maxlen=200)
    found: list[str] = []

    def drain() -> None:
        for line in proc.stdout:
            lines.append(line.rstrip())
            m = re.search(r"https?://(?:127\.0\.0\.1|localhost):(\d+)", line)
            if m and not found:
                found.append(f"http://127.0.0.1:{m.group(1)}")

    threading.Thread(target=drain, daemon=True).start()
    try:
        deadline = time.monotonic() + TIMEOUT
        while time.monotonic() < deadline and proc.poll() is None:
            if found:
                try:
                    if httpx.get(found[0] + "/health", timeout=5).status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
            time.sleep(0.2)
        else:
            pytest.fail("dgemma serve did not come up:\n" + "\n".join(lines))
        yield found[0]
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGINT)
            try:
                proc.wait(15)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(5)


@pytest.fixture
def browser():
    options = webdriver.ChromeOptions()
    for flag in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                 "--window-size=1400,1000"):
        options.add_argument(flag)
    options.binary_location = CHROMIUM
    driver = webdriver.Chrome(options=options, service=webdriver.ChromeService(executable_path=CHROMEDRIVER))
    driver.set_page_load_timeout(60)
    try:
        yield driver
    finally:
        driver.quit()


# Records the (canvas, step) values the step counter shows and the most accepted cells seen at once: steps of a tiny
# model come faster than Selenium polls.
RECORDER = """
window.__seen = {steps: [], maxAccepted: 0, maxCells: 0};
new MutationObserver(() => {
  const el = document.getElementById("step");
  if (el.dataset.step) {
    const last = window.__seen.steps[window.__seen.steps.length - 1];
    const now = [Number(el.dataset.canvas), Number(el.dataset.step)];
    if (!last || last[0] !== now[0] || last[1] !== now[1]) window.__seen.steps.push(now);
  }
  window.__seen.maxAccepted = Math.max(window.__seen.maxAccepted,
                                       document.querySelectorAll("#canvas .cell.accepted").length);
  window.__seen.maxCells = Math.max(window.__seen.maxCells, document.querySelectorAll("#canvas .cell").length);
}).observe(document.getElementById("out"), {subtree: true, childList: true, attributes: true, characterData: true});
"""


def open_page(driver, url: str) -> None:
    driver.get(url + "/")
    WebDriverWait(driver, 30).until(lambda d: d.execute_script("return document.body.dataset.ready") == "1")
    WebDriverWait(driver, 30).until(lambda d: d.find_element(By.ID, "model").get_attribute("value"))


def fill(driver, **fields: object) -> None:
    for name, value in fields.items():
        el = driver.find_element(By.ID, name)
        el.clear()
        el.send_keys(str(value))


def wait_state(driver, *states: str, timeout: float = TIMEOUT) -> str:
    WebDriverWait(driver, timeout).until(lambda d: d.execute_script("return document.body.dataset.state") in states)
    return driver.execute_script("return document.body.dataset.state")


def test_page_streams_denoising_steps_and_final_text(server, browser, tmp_path):
    open_page(browser, server)
    assert browser.find_element(By.ID, "mode-chat").is_selected()
    # pace 20: the page draws one step per 20 ms (a step per task), so the observer below sees every one
    fill(browser, prompt="Tell me about the sea.", max_tokens=48, max_denoising_steps=8, seed=7, pace=20)
    browser.execute_script(RECORDER)
    browser.find_element(By.ID, "generate").click()
    state = wait_state(browser, "done", "error")
    assert state == "done", browser.find_element(By.ID, "error").text
    browser.save_screenshot(str(tmp_path / "serving-page.png"))
    assert (tmp_path / "serving-page.png").stat().st_size > 10_000

    seen = browser.execute_script("return window.__seen")
    steps = [tuple(s) for s in seen["steps"]]
    assert len(steps) >= 2, steps
    # every step of every canvas, in order: (0, 1), (0, 2), ..., (1, 1), ... and never past max_denoising_steps
    assert steps[0] == (0, 1), steps
    assert all(b in ((a[0], a[1] + 1), (a[0] + 1, 1)) for a, b in itertools.pairwise(steps)), steps
    assert all(1 <= s <= 8 for _, s in steps), steps
    assert seen["maxCells"] == CANVAS_LENGTH
    assert seen["maxAccepted"] >= 1
    # what is left on screen: the last step of the last canvas, the counter, one history strip per canvas
    cells = browser.find_elements(By.CSS_SELECTOR, "#canvas .cell")
    assert len(cells) == CANVAS_LENGTH and all(c.is_displayed() for c in cells)
    assert browser.find_elements(By.CSS_SELECTOR, "#canvas .cell.accepted")
    canvases = {c for c, _ in steps}
    assert len(browser.find_elements(By.CSS_SELECTOR, "#history .hist")) == len(canvases)
    assert re.fullmatch(r"canvas \d+ · step \d+/8", browser.find_element(By.ID, "step").text)

    # the final text is the server's own answer for the same request (same seed: same text)
    committed = browser.execute_script("return document.getElementById('committed').textContent")
    answer = httpx.post(server + "/v1/chat/completions", timeout=TIMEOUT, json={
        "messages": [{"role": "user", "content": "Tell me about the sea."}], "max_tokens": 48,
        "max_denoising_steps": 8, "seed": 7}).json()
    assert committed == (answer["choices"][0]["message"]["content"] or "")
    status = browser.find_element(By.ID, "status").text
    usage = answer["usage"]
    assert f"tokens {usage['completion_tokens']} (+{usage['prompt_tokens']} prompt)" in status, status
    assert f"finish {answer['choices'][0]['finish_reason']}" in status, status
    assert f"steps {len(steps)} " in status, status
    assert f"tokens/forward {usage['completion_tokens'] / len(steps):.2f}" in status and "elapsed" in status, status
    assert not browser.find_element(By.ID, "error").is_displayed()


def test_page_completion_mode(server, browser):
    open_page(browser, server)
    browser.find_element(By.CSS_SELECTOR, "label[for=mode-completion]").click()
    fill(browser, prompt="Once upon a time", max_tokens=16, max_denoising_steps=4, seed=1)
    browser.find_element(By.ID, "generate").click()
    assert wait_state(browser, "done", "error") == "done", browser.find_element(By.ID, "error").text
    committed = browser.execute_script("return document.getElementById('committed').textContent")
    answer = httpx.post(server + "/v1/completions", timeout=TIMEOUT, json={
        "prompt": "Once upon a time", "max_tokens": 16, "max_denoising_steps": 4, "seed": 1}).json()
    assert committed == answer["choices"][0]["text"]
    assert browser.find_elements(By.CSS_SELECTOR, "#canvas .cell")


def test_page_shows_the_servers_400(server, browser):
    open_page(browser, server)
    fill(browser, prompt="Hello", entropy_bound=-1)
    browser.find_element(By.ID, "generate").click()
    assert wait_state(browser, "done", "error") == "error"
    error = browser.find_element(By.ID, "error")
    assert error.is_displayed()
    assert error.text.startswith("400 ") and "entropy_bound" in error.text, error.text
    assert not browser.find_elements(By.CSS_SELECTOR, "#canvas .cell")


def test_stop_aborts_the_stream_and_the_server_cancels(server, browser):
    open_page(browser, server)
    cancelled = engine_counter(server, "cancelled")
    # a long request: a random model is never confident, so each canvas runs all 256 steps (this seed's answer takes
    # about 20 s on one core); Stop as soon as the first step is drawn
    fill(browser, prompt="Write a long story.", max_tokens=1024, max_denoising_steps=256, seed=4)
    browser.find_element(By.ID, "generate").click()
    WebDriverWait(browser, TIMEOUT).until(lambda d: d.find_element(By.ID, "step").get_attribute("data-step"))
    browser.find_element(By.ID, "stop").click()
    assert wait_state(browser, "stopped", "done", "error", timeout=10) == "stopped"
    assert "stopped by you" in browser.find_element(By.ID, "status").text
    assert browser.find_element(By.ID, "generate").is_enabled()
    # the aborted fetch is a disconnect: the server cancels the engine request, frees its row, and serves on
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        health = httpx.get(server + "/health", timeout=10).json()
        if health["active"] == 0 and engine_counter(server, "cancelled") == cancelled + 1:
            break
        time.sleep(0.1)
    assert health["active"] == 0, health
    assert engine_counter(server, "cancelled") == cancelled + 1
    answer = httpx.post(server + "/v1/completions", timeout=TIMEOUT,
                        json={"prompt": "Hi", "max_tokens": 16, "max_denoising_steps": 2, "seed": 0})
    assert answer.status_code == 200 and answer.json()["usage"]["completion_tokens"] >= 1


def engine_counter(server: str, state: str) -> float:
    """dgemma_engine_requests_total{state=...} from /metrics."""
    text = httpx.get(server + "/metrics", timeout=10).text
    line = re.search(r'^dgemma_engine_requests_total\{state="' + re.escape(state) + r'"\} (\S+)$', text, re.M)
    return float(line.group(1))


def test_page_json_schema_field_constrains_the_answer_and_shows_the_grammar(server, browser):
    pytest.importorskip("llguidance")
    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 6},
                                               "ok": {"type": "boolean"}}, "required": ["name", "ok"],
              "additionalProperties": False}
    open_page(browser, server)
    fill(browser, prompt="Describe a person.", max_tokens=48, max_denoising_steps=4, seed=3, pace=20,
         json_schema=json.dumps(schema))
    browser.find_element(By.ID, "generate").click()
    assert wait_state(browser, "done", "error") == "done", browser.find_element(By.ID, "error").text
    committed = browser.execute_script("return document.getElementById('committed').textContent")
    answer = json.loads(committed)  # the random model writes valid JSON only through the grammar
    assert set(answer) == {"name", "ok"} and isinstance(answer["ok"], bool)
    assert re.search(r"grammar: pinned \d+, closed \d+", browser.find_element(By.ID, "stepstats").text)
    fill(browser, json_schema="{not json")
    browser.find_element(By.ID, "generate").click()
    assert wait_state(browser, "done", "error") == "error"
    assert "response_format" in browser.find_element(By.ID, "error").text
