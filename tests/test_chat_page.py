"""The chat page at `/` in a real browser: Debian's headless Chromium driven by selenium (chromedriver from the
system; nothing is downloaded) against a real `glmcore serve` on loopback started with --api-key. It sends a
message and sees the reply grow while it streams, stops one mid-way and checks the slot is freed, renders
hostile markdown without creating elements from it, shows reasoning and tool calls apart, and checks the
layout at 375 and 1280 px from element rectangles (screenshots are saved beside the test's tmp files)."""
import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

webdriver = pytest.importorskip("selenium.webdriver", reason="the browser tests need selenium (the dev extra)")
from selenium.common.exceptions import ElementClickInterceptedException, ElementNotInteractableException  # noqa: E402
from selenium.webdriver.chrome.options import Options  # noqa: E402
from selenium.webdriver.chrome.service import Service  # noqa: E402
from selenium.webdriver.common.by import By  # noqa: E402
from selenium.webdriver.support.ui import WebDriverWait  # noqa: E402

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
CHROMEDRIVER = shutil.which("chromedriver")
pytestmark = pytest.mark.skipif(not (CHROMIUM and CHROMEDRIVER), reason="no headless browser: apt-get install -y "
                                "chromium chromium-driver (.ci/run does)")
KEY = "page-test-key"
SCREENSHOT = os.environ.get("GLMCORE_CHAT_SCREENSHOT")     # a path: also save the 1280 px screenshot there


@pytest.fixture(scope="module")
def server(make_tiny):
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "glmcore.cli", "serve", "--model", str(make_tiny("glm4")),
                             "--backend", "torch", "--threads", "1", "--port", "0", "--slots", "2",
                             "--api-key", KEY, "--grace", "0"], stderr=subprocess.PIPE, text=True, env=env)
    try:
        line, deadline = "", time.monotonic() + 120
        while "glmcore serve:" not in line and time.monotonic() < deadline:
            line = proc.stderr.readline()
            assert line or proc.poll() is None, "the server exited before its startup line"
        m = re.search(r"chat page (http://127\.0\.0\.1:\d+)/ \| API \1/v1", line)
        assert m, line
        yield m.group(1)
    finally:
        proc.terminate()
        proc.wait(timeout=60)


@pytest.fixture(scope="module")
def browser():
    opts = Options()
    opts.binary_location = CHROMIUM
    for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu", "--no-first-run",
                "--window-size=1280,900"):
        opts.add_argument(arg)
    driver = webdriver.Chrome(service=Service(CHROMEDRIVER), options=opts)
    driver.set_script_timeout(30)
    yield driver
    driver.quit()


def busy_slots(url):
    return httpx.get(f"{url}/health", timeout=10).json()["busy_slots"]


def open_page(browser, url, key=KEY):
    browser.get(url + "/")
    browser.execute_script("localStorage.clear()")
    browser.get(url + "/")
    if key:
        WebDriverWait(browser, 20).until(lambda d: not d.find_element(By.ID, "settings").get_attribute("hidden"))
        field = browser.find_element(By.ID, "api_key")
        field.send_keys(key)
        browser.execute_script("arguments[0].dispatchEvent(new Event('change'))", field)
        WebDriverWait(browser, 20).until(lambda d: d.find_element(By.ID, "model").text)
        browser.find_element(By.ID, "toggle-settings").click()      # close the settings again


def watch_reply(browser):
    """Record the length of the last assistant message's text at every DOM change (in the page)."""
    browser.execute_script("""
        window.__lengths = [];
        new MutationObserver(() => {
            const all = document.querySelectorAll('.msg.assistant .content');
            if (all.length) window.__lengths.push(all[all.length - 1].textContent.length);
        }).observe(document.getElementById('log'), {childList: true, subtree: true, characterData: true});""")


def setting(browser, field, value):
    browser.execute_script("const e = document.getElementById(arguments[0]); e.value = arguments[1];"
                           "e.dispatchEvent(new Event('change'))", field, value)


def send(browser, text):
    box = browser.find_element(By.ID, "input")
    box.send_keys(text)
    browser.find_element(By.ID, "send").click()


def test_the_page_asks_for_the_key_then_streams_a_reply(server, browser):
    browser.get(server + "/")
    browser.execute_script("localStorage.clear()")
    browser.get(server + "/")
    WebDriverWait(browser, 20).until(lambda d: "API key" in d.find_element(By.ID, "status").text)
    open_page(browser, server)
    # near-uniform sampling: long replies (a stop token comes after ~700 tokens on average); a rare short one
    # that arrives within a frame or two is followed by another message
    setting(browser, "max_tokens", "300")
    setting(browser, "temperature", "2")
    setting(browser, "top_p", "1")
    for attempt in range(3):
        watch_reply(browser)
        send(browser, f"Tell me a long story ({attempt})")
        WebDriverWait(browser, 60).until(lambda d: d.find_element(By.ID, "send").is_displayed())
        lengths = browser.execute_script("return window.__lengths")
        final = browser.find_elements(By.CSS_SELECTOR, ".msg.assistant .content")[-1].text
        grew = sorted(set(x for x in lengths if x > 0))
        if final and len(grew) >= 3:
            break
    else:
        pytest.fail(f"the reply did not appear incrementally: {grew}")
    assert browser.find_elements(By.CSS_SELECTOR, ".msg.user")[-1].text.endswith(f"Tell me a long story ({attempt})")
    assert busy_slots(server) == 0


def test_stop_cancels_the_generation_and_frees_the_slot(server, browser):
    open_page(browser, server)
    # near-uniform sampling over the tiny model's vocabulary: a stop token comes after ~700 tokens on average;
    # a reply that still ends before the click is simply followed by another message
    setting(browser, "max_tokens", "4000")
    setting(browser, "temperature", "2")
    setting(browser, "top_p", "1")
    for attempt in range(8):
        watch_reply(browser)
        send(browser, f"go on and on ({attempt})")
        WebDriverWait(browser, 60, poll_frequency=0.02).until(
            lambda d: any(x > 0 for x in d.execute_script("return window.__lengths")))
        if busy_slots(server) == 1:
            stop = browser.find_element(By.ID, "stop")
            try:
                stop.click()
                break
            except ElementNotInteractableException:     # it ended between the two looks: try another
                pass
            except ElementClickInterceptedException:    # the same, where the hidden button lies under the title
                if stop.is_displayed():
                    raise
        WebDriverWait(browser, 60).until(lambda d: d.find_element(By.ID, "send").is_displayed())
    else:
        pytest.fail("every reply ended before it could be stopped")
    WebDriverWait(browser, 30).until(lambda d: d.find_element(By.ID, "send").is_displayed())
    deadline = time.monotonic() + 30
    while busy_slots(server) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert busy_slots(server) == 0, "the slot was not freed after stop"
    assert "(stopped)" in browser.find_elements(By.CSS_SELECTOR, ".msg.assistant")[-1].text
    metrics = httpx.get(f"{server}/metrics").text
    assert re.search(r'glmcore_requests_total\{endpoint="chat",status="disconnected"\} [1-9]', metrics), metrics
    # the conversation goes on after a stop; New chat clears it
    setting(browser, "max_tokens", "5")
    setting(browser, "temperature", "0.8")
    n = len(browser.find_elements(By.CSS_SELECTOR, ".msg.assistant"))
    send(browser, "short now")
    WebDriverWait(browser, 60).until(lambda d: len(d.find_elements(By.CSS_SELECTOR, ".msg.assistant")) == n + 1
                                     and d.find_element(By.ID, "send").is_displayed())
    browser.find_element(By.ID, "new").click()
    assert browser.find_elements(By.CSS_SELECTOR, ".msg") == []


def test_empty_sampling_settings_leave_the_models_recommendation(server, browser):
    """Temperature and top-p start empty ("model's"): the request then carries neither, and the server samples
    as the checkpoint recommends (glmcore.sampling.recommended); a value typed in is sent."""
    open_page(browser, server)
    assert browser.find_element(By.ID, "temperature").get_attribute("value") == ""
    setting(browser, "max_tokens", "2")
    browser.execute_script("window.__bodies = []; const f = window.fetch;"
                           "window.fetch = (u, o) => { if (o && o.body) window.__bodies.push(o.body); return f(u, o); }")
    sent = []
    for temperature in ("", "0.3"):
        setting(browser, "temperature", temperature)
        n = len(browser.find_elements(By.CSS_SELECTOR, ".msg.assistant"))
        send(browser, f"hi {temperature}")
        WebDriverWait(browser, 60).until(lambda d: len(d.find_elements(By.CSS_SELECTOR, ".msg.assistant")) == n + 1
                                         and d.find_element(By.ID, "send").is_displayed())
        sent.append(json.loads([b for b in browser.execute_script("return window.__bodies") if '"messages"' in b][-1]))
    assert "temperature" not in sent[0] and "top_p" not in sent[0]
    assert sent[1]["temperature"] == 0.3 and "top_p" not in sent[1]


def test_model_text_never_becomes_html(server, browser):
    open_page(browser, server)
    hostile = ('<img src=x onerror="window.__pwned=1"> **bold** `<b>x</b>`\n\n- <script>window.__pwned=2</script>\n'
               '```html\n<iframe src="javascript:alert(1)"></iframe>\n```\n# <u>title</u>')
    html_tags = browser.execute_script("""
        const div = document.createElement('div');
        document.getElementById('log').appendChild(div);
        renderMarkdown(div, arguments[0]);
        return [div.querySelectorAll('img,script,iframe,u,b').length, div.textContent,
                [...div.querySelectorAll('*')].map(e => e.tagName.toLowerCase())];""", hostile)
    count, text, tags = html_tags
    assert count == 0 and set(tags) <= {"p", "strong", "code", "ul", "li", "pre", "h1", "br", "em"}, tags
    assert '<img src=x onerror="window.__pwned=1">' in text and "<script>" in text
    assert browser.execute_script("return window.__pwned") is None


def test_reasoning_and_tool_calls_are_shown_apart(server, browser):
    """A scripted stream (fetch replaced in the page) with the server's reasoning_content and tool_calls deltas."""
    open_page(browser, server)
    chunks = [{"choices": [{"index": 0, "delta": {"reasoning_content": "Let me think <b>hard</b>."}}]},
              {"choices": [{"index": 0, "delta": {"content": "Checking the weather."}}]},
              {"choices": [{"index": 0, "delta": {"tool_calls": [{"index": 0, "id": "call_1", "type": "function",
                                                                  "function": {"name": "get_weather",
                                                                               "arguments": ""}}]}}]},
              {"choices": [{"index": 0, "delta": {"tool_calls": [{"index": 0,
                                                                  "function": {"arguments": '{"city": "Oslo"}'}}]}}]},
              {"choices": [{"index": 0, "delta": {}, "finish_reason": "tool_calls"}]}]
    body = "".join(f"data: {json.dumps(c)}\n\n" for c in chunks) + "data: [DONE]\n\n"
    browser.execute_script("""
        const body = arguments[0], real = window.fetch;
        window.fetch = (url, init) => url.endsWith('/chat/completions')
            ? Promise.resolve(new Response(body, {status: 200, headers: {'Content-Type': 'text/event-stream'}}))
            : real(url, init);""", body)
    send(browser, "weather in Oslo?")
    WebDriverWait(browser, 20).until(lambda d: d.find_elements(By.CSS_SELECTOR, ".msg.assistant .tool-call .args")
                                     and d.find_element(By.ID, "send").is_displayed())
    reply = browser.find_elements(By.CSS_SELECTOR, ".msg.assistant")[-1]
    assert reply.find_element(By.CSS_SELECTOR, ".reasoning .text").text == "Let me think <b>hard</b>."
    assert reply.find_element(By.CSS_SELECTOR, ".content").text == "Checking the weather."
    assert reply.find_element(By.CSS_SELECTOR, ".tool-call .name").text == "get_weather"
    assert json.loads(reply.find_element(By.CSS_SELECTOR, ".tool-call .args").text) == {"city": "Oslo"}


def rect(browser, selector):
    return browser.execute_script("const r = document.querySelector(arguments[0]).getBoundingClientRect();"
                                  "return [r.left, r.top, r.right, r.bottom];", selector)


def overlap(a, b):
    return min(a[2], b[2]) - max(a[0], b[0]) > 0.5 and min(a[3], b[3]) - max(a[1], b[1]) > 0.5


@pytest.mark.parametrize("width,height", [(375, 812), (1280, 900)])
def test_layout_at_phone_and_desktop_width(server, browser, tmp_path, width, height):
    open_page(browser, server)
    browser.set_window_size(width, height)
    # the viewport (not the window) is what the layout gets: size the window so the viewport is width wide
    inner = browser.execute_script("return window.innerWidth")
    browser.set_window_size(width + (width - inner), height)
    assert browser.execute_script("return window.innerWidth") == width
    setting(browser, "max_tokens", "60")
    send(browser, "A question long enough to wrap on a phone screen: how do the slots of the scheduler work?")
    WebDriverWait(browser, 60).until(lambda d: d.find_element(By.ID, "send").is_displayed()
                                     and d.find_elements(By.CSS_SELECTOR, ".msg.assistant"))
    code = 'A code block:\n```python\nprint("a rather long line of code that must scroll, not overflow the page")\n```'
    browser.execute_script("""
        const m = document.createElement('div'); m.className = 'msg assistant';
        const c = document.createElement('div'); c.className = 'content'; m.appendChild(c);
        document.getElementById('log').appendChild(m); renderMarkdown(c, arguments[0]);""", code)
    view_w = browser.execute_script("return document.documentElement.clientWidth")
    assert browser.execute_script("return document.documentElement.scrollWidth") <= view_w, "horizontal overflow"
    bar, log, composer = rect(browser, "#bar"), rect(browser, "#log"), rect(browser, "#composer")
    assert bar[3] <= log[1] + 0.5 and log[3] <= composer[1] + 0.5, (bar, log, composer)
    for r in (bar, log, composer):
        assert r[0] >= -0.5 and r[2] <= view_w + 0.5, r
    inp, btn = rect(browser, "#input"), rect(browser, "#send")
    assert not overlap(inp, btn) and btn[2] <= view_w + 0.5 and inp[2] - inp[0] > width * 0.5
    buttons = [rect(browser, s) for s in ("#new", "#toggle-settings")] + [rect(browser, "#title")]
    assert not any(overlap(a, b) for i, a in enumerate(buttons) for b in buttons[i + 1:]), buttons
    for msg in browser.find_elements(By.CSS_SELECTOR, ".msg"):
        r = browser.execute_script("const r = arguments[0].getBoundingClientRect(); return [r.left, r.right];", msg)
        assert r[0] >= 0 and r[1] <= view_w + 0.5, r
    font = browser.execute_script("return parseFloat(getComputedStyle("
                                  "document.querySelector('.msg .content')).fontSize)")
    assert font >= 13, "text too small to read"
    shot = tmp_path / f"chat-{width}.png"
    assert browser.save_screenshot(str(shot)) and shot.stat().st_size > 5000
    if SCREENSHOT and width == 1280:
        Path(SCREENSHOT).write_bytes(shot.read_bytes())
    browser.set_window_size(1280, 900)
