"""The chat page and the isolation dashboard in headless Chromium, as a person would use them,
against a real `bulkhead serve`: ask a question and watch the answer stream in, stop a
generation, hostile model output rendered as text under the page's CSP, the API key prompt
and a 401, the dashboard's counters moving after a request, and both pages on a phone
(390 x 844: nothing wider than the screen, the prompt box full width).

Needs Debian's `chromium` and `chromium-driver` (scripts/test.sh installs them as root) and
selenium (tests/python/requirements.txt); skips, saying why, without them. Screenshots of
both pages go to $BULKHEAD_SCREENSHOT_DIR (docs/img for the README), else a temporary folder:
    BULKHEAD_SCREENSHOT_DIR=docs/img BULKHEAD_BIN=target/debug/bulkhead \\
        "$(tests/python/venv.sh)/bin/pytest" -rs tests/python/test_web_ui.py
"""

import json
import os
import shutil
import threading
import time
import urllib.request
from pathlib import Path

import pytest

from bulkhead_server import MODEL, serve

webdriver = pytest.importorskip("selenium.webdriver", reason="selenium is not installed (tests/python/requirements.txt)")
from selenium.common.exceptions import TimeoutException  # noqa: E402
from selenium.webdriver.common.by import By  # noqa: E402
from selenium.webdriver.common.keys import Keys  # noqa: E402
from selenium.webdriver.support.ui import WebDriverWait  # noqa: E402

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
DRIVER = shutil.which("chromedriver")
if not (CHROMIUM and DRIVER):
    pytest.skip(
        "the browser tests need Debian's chromium and chromium-driver (apt-get install chromium chromium-driver)",
        allow_module_level=True,
    )

KEY = "sk-web-ui-browser-test"
ADMIN = "web-ui-operator-key"  # the dashboard's cache series are on the operator's page


@pytest.fixture(scope="module")
def server():
    with serve("--admin-key", ADMIN) as srv:
        yield srv


@pytest.fixture(scope="module")
def browser():
    opts = webdriver.ChromeOptions()
    opts.binary_location = CHROMIUM
    for a in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--window-size=1280,860",
              "--hide-scrollbars", "--no-proxy-server", "--force-device-scale-factor=1"):
        opts.add_argument(a)
    opts.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    # The driver from Debian's package, named: selenium must not look for (or download) one.
    d = webdriver.Chrome(options=opts, service=webdriver.ChromeService(executable_path=DRIVER))
    d.set_script_timeout(30)
    try:
        yield d
    finally:
        d.quit()


@pytest.fixture(scope="module")
def shots(tmp_path_factory):
    d = os.environ.get("BULKHEAD_SCREENSHOT_DIR")
    path = Path(d) if d else tmp_path_factory.mktemp("screenshots")
    path.mkdir(parents=True, exist_ok=True)
    return path


def wait(browser, what, cond, timeout=30):
    try:
        return WebDriverWait(browser, timeout, poll_frequency=0.05).until(lambda d: cond(d))
    except TimeoutException:
        logs = "\n".join(str(e) for e in browser.get_log("browser"))
        raise AssertionError(f"timed out waiting for {what}; browser log:\n{logs}") from None


def csp_violations(browser):
    """Console messages about the Content-Security-Policy (reading them clears the log)."""
    return [e["message"] for e in browser.get_log("browser") if "Content Security Policy" in e["message"]]


def metrics(addr):
    with urllib.request.urlopen(f"http://{addr}/metrics", timeout=10) as r:
        return r.read().decode()


def metric_sum(text, name, **labels):
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            if all(f'{k}="{v}"' in line for k, v in labels.items()):
                total += float(line.rsplit(" ", 1)[1])
    return total


def set_field(browser, id_, value):
    e = browser.find_element(By.ID, id_)
    e.clear()
    e.send_keys(str(value))


def last_answer(browser):
    return browser.find_elements(By.CSS_SELECTOR, "#messages .msg.assistant")[-1]


def ask(browser, text, answered=True):
    """Types `text` into the prompt box and presses Enter, watching the answer's text length
    on every DOM change (window.__lengths) to see it stream; waits for the answer to start
    unless `answered` is false."""
    browser.execute_script(
        """
        window.__lengths = [];
        const m = document.getElementById('messages');
        if (window.__observer) window.__observer.disconnect();
        window.__observer = new MutationObserver(() => {
            const a = m.querySelectorAll('.msg.assistant');
            if (a.length) window.__lengths.push(a[a.length - 1].querySelector('.body').textContent.length);
        });
        window.__observer.observe(m, {subtree: true, childList: true, characterData: true});
        """
    )
    before = len(browser.find_elements(By.CSS_SELECTOR, "#messages .msg.assistant"))
    box = browser.find_element(By.ID, "prompt")
    box.send_keys(text)
    box.send_keys(Keys.ENTER)
    if answered:
        wait(browser, "the answer to start", lambda d: len(d.find_elements(By.CSS_SELECTOR, "#messages .msg.assistant")) > before)


def test_chat_streams_an_answer_and_stop_ends_a_generation(server, browser, shots):
    browser.get(f"http://{server.addr}/")
    wait(browser, "the model list", lambda d: d.find_element(By.ID, "model").get_attribute("value") == MODEL)
    assert not browser.find_element(By.ID, "key-box").is_displayed(), "no key asked for: no tenants"
    set_field(browser, "system", "You are a concise assistant.")
    set_field(browser, "temperature", 0)
    set_field(browser, "max-tokens", 96)

    ask(browser, "Write a Python function that reverses a string.")
    answer = last_answer(browser)
    wait(browser, "the answer to finish", lambda d: answer.get_attribute("data-done"))
    assert answer.get_attribute("data-done") in ("stop", "length"), answer.get_attribute("data-done")
    text = answer.find_element(By.CSS_SELECTOR, ".body").text
    assert text.strip(), "an answer"
    lengths = browser.execute_script("return window.__lengths")
    grew = sorted(set(n for n in lengths if n > 0))
    assert len(grew) >= 3, f"the answer appeared at once, not streamed: {lengths}"
    stats = browser.find_element(By.ID, "stats").text
    assert "TTFT" in stats and "tokens/s" in stats, stats
    assert browser.find_element(By.ID, "send").is_enabled() and not browser.find_element(By.ID, "stop").is_enabled()
    browser.save_screenshot(str(shots / "chat.png"))

    # Stop: a long answer, stopped once text has appeared; the server sees the client go.
    gone = metric_sum(metrics(server.addr), "bulkhead:request_failure_total", reason="client_gone")
    set_field(browser, "max-tokens", 400)
    set_field(browser, "temperature", 0.8)
    ask(browser, "Write a long story about a lighthouse keeper and the sea.")
    answer = last_answer(browser)
    wait(browser, "some streamed text", lambda d: len(answer.find_element(By.CSS_SELECTOR, ".body").text) > 20)
    assert browser.find_element(By.ID, "stop").is_enabled()
    browser.find_element(By.ID, "stop").click()
    wait(browser, "the generation to stop", lambda d: answer.get_attribute("data-done"))
    assert answer.get_attribute("data-done") == "stopped", answer.get_attribute("data-done")
    stopped_at = answer.find_element(By.CSS_SELECTOR, ".body").text
    assert "stopped" in browser.find_element(By.ID, "stats").text
    time.sleep(0.5)
    assert answer.find_element(By.CSS_SELECTOR, ".body").text == stopped_at, "text kept coming after Stop"
    deadline = time.monotonic() + 10
    while metric_sum(metrics(server.addr), "bulkhead:request_failure_total", reason="client_gone") <= gone:
        assert time.monotonic() < deadline, "the server never saw the stopped request end"
        time.sleep(0.1)
    assert csp_violations(browser) == []


HOSTILE = [
    "Try <script>window.__pwned = 'script'</script> this ",
    "and <img src=x onerror=\"window.__pwned = 'img'\"> that, ",
    "[click me](javascript:window.__pwned='link') and [the docs](https://example.org/docs).\n\n",
    "```html\n<b>not bold</b><script>window.__pwned = 'code'</script>\n```\n",
    "**bold** and `<i>code</i>` <iframe srcdoc=\"x\"></iframe>",
]


def test_model_output_with_html_renders_as_text(server, browser):
    """The page's own fetch answers with a stream of hostile Markdown: every path through the
    renderer, none of which may make an element from the model's text."""
    browser.get(f"http://{server.addr}/")
    wait(browser, "the model list", lambda d: d.find_element(By.ID, "model").get_attribute("value") == MODEL)
    chunks = [
        "data: " + json.dumps({"object": "chat.completion.chunk", "choices": [{"index": 0, "delta": {"content": c}, "finish_reason": None}]}) + "\n\n"
        for c in HOSTILE
    ]
    chunks.append("data: " + json.dumps({"choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]}) + "\n\ndata: [DONE]\n\n")
    browser.execute_script(
        """
        const chunks = arguments[0];
        const real = window.fetch;
        window.fetch = (url, init) => {
            if (url !== '/v1/chat/completions') return real(url, init);
            const enc = new TextEncoder();
            const body = new ReadableStream({
                async start(c) {
                    for (const x of chunks) { c.enqueue(enc.encode(x)); await new Promise(r => setTimeout(r, 20)); }
                    c.close();
                }
            });
            return Promise.resolve(new Response(body, {status: 200, headers: {'content-type': 'text/event-stream'}}));
        };
        """,
        chunks,
    )
    ask(browser, "Show me some HTML.")
    answer = last_answer(browser)
    wait(browser, "the answer to finish", lambda d: answer.get_attribute("data-done") == "stop")
    body = answer.find_element(By.CSS_SELECTOR, ".body")
    assert browser.execute_script("return window.__pwned") is None
    assert body.find_elements(By.CSS_SELECTOR, "script, img, iframe, b, i") == []
    links = body.find_elements(By.CSS_SELECTOR, "a")
    assert [a.get_attribute("href") for a in links] == ["https://example.org/docs"]
    assert links[0].get_attribute("rel") == "noopener noreferrer nofollow"
    text = body.text
    for literal in ("<script>window.__pwned = 'script'</script>", "<img src=x onerror=", "[click me](javascript:", "<b>not bold</b>", "<i>code</i>"):
        assert literal in text, f"{literal!r} not shown as text in {text!r}"
    assert body.find_element(By.CSS_SELECTOR, "pre code").text.startswith("<b>not bold</b>")
    assert body.find_element(By.CSS_SELECTOR, "strong").text == "bold"
    assert csp_violations(browser) == []


def test_dashboard_counters_move_after_a_request(server, browser, shots):
    browser.set_window_size(1400, 1100)
    browser.get(f"http://{server.addr}/dashboard")
    wait(browser, "the first scrape", lambda d: d.find_element(By.ID, "status").text.startswith("live"))
    wait(browser, "the worker pools", lambda d: len(d.find_elements(By.CSS_SELECTOR, "#pools .pool")) == 2)

    def cell(check):
        """A check's "ran" cell, read in one script: the table is redrawn every second, so an
        element found first and read later may be gone (stale)."""
        sel = f"#checks tr[data-check={check}] td:nth-child(3)"
        return browser.execute_script(f"const e = document.querySelector('{sel}'); return e ? e.textContent : '';")

    def coverage():
        return (cell("coverage").split() or [""])[0]

    def generated():
        return browser.find_element(By.ID, "tokens-total").text

    before = (coverage(), generated())
    prompt = "Name three colours of the rainbow."
    req = urllib.request.Request(
        f"http://{server.addr}/v1/chat/completions",
        data=json.dumps({"model": MODEL, "messages": [{"role": "user", "content": prompt}], "max_tokens": 12}).encode(),
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(req, timeout=60) as r:
        completion = json.load(r)["choices"][0]["message"]["content"]
    wait(browser, "the counters to move", lambda d: coverage() != before[0] and generated() != before[1], timeout=10)
    assert int(coverage()) > int(before[0] or 0)
    assert browser.find_element(By.ID, "failures").text == "0"
    ttft = browser.find_element(By.ID, "ttft").text
    assert ttft.count("·") == 2 and "–" not in ttft, ttft
    page = browser.find_element(By.TAG_NAME, "body").text
    assert prompt not in page and completion.strip()[:20] not in page, "the dashboard shows no prompt or completion"
    assert csp_violations(browser) == []

    # The prefix cache's pages and fence checks are the operator's: hidden without the key,
    # shown once it is entered (and the key is not shown).
    def fence():
        return cell("tenant_fence")

    assert fence() == "operator's key" and "cached and free: operator's key" in page, page
    browser.find_element(By.ID, "admin-key").send_keys(ADMIN)
    browser.find_element(By.CSS_SELECTOR, "#operator button").click()
    wait(browser, "the operator's page", lambda d: fence() != "operator's key", timeout=10)
    assert fence()[:1].isdigit(), fence()
    wait(browser, "the cache pages", lambda d: " cached · " in d.find_element(By.ID, "pools").text, timeout=5)
    assert not browser.find_element(By.ID, "operator").is_displayed()
    assert ADMIN not in browser.find_element(By.TAG_NAME, "body").text

    # The screenshot while a long answer is generated: pages leased, a request running.
    long = urllib.request.Request(
        f"http://{server.addr}/v1/completions",
        data=json.dumps({"model": MODEL, "prompt": "The lighthouse", "max_tokens": 400, "ignore_eos": True}).encode(),
        headers={"Content-Type": "application/json"},
    )
    t = threading.Thread(target=lambda: urllib.request.urlopen(long, timeout=120).read())
    t.start()
    try:
        wait(browser, "a running request", lambda d: d.find_element(By.ID, "running").text == "1", timeout=20)
        height = browser.execute_script("return document.documentElement.scrollHeight")
        browser.set_window_size(1400, height + 120)  # the whole page, for the README
        time.sleep(1.2)  # one more scrape at the new size
        browser.save_screenshot(str(shots / "dashboard.png"))
    finally:
        t.join()
        browser.set_window_size(1280, 860)


PHONE = (390, 844)  # an iPhone 12 to 15 held upright, in CSS pixels


def phone_layout(browser):
    """What a phone-width page must hold to: nothing wider than the screen (no sideways
    scrolling), and the widest element's right edge on it."""
    return browser.execute_script(
        """
        const doc = document.documentElement;
        let widest = null, right = 0;
        for (const e of document.body.querySelectorAll('*')) {
            const r = e.getBoundingClientRect();
            if (r.width && r.right > right) { right = r.right; widest = e.tagName + (e.id ? '#' + e.id : '') + (e.className ? '.' + e.className : ''); }
        }
        return {inner: window.innerWidth, scroll: doc.scrollWidth, right: Math.ceil(right), widest};
        """
    )


def test_both_pages_fit_a_phone_held_upright(server, browser, shots):
    """At 390 x 844 the chat's settings go above the conversation (beside it they left the
    prompt box one letter wide) and the dashboard's tiles, pools and tables fit the width."""
    browser.execute_cdp_cmd(
        "Emulation.setDeviceMetricsOverride", {"width": PHONE[0], "height": PHONE[1], "deviceScaleFactor": 1, "mobile": True}
    )
    try:
        browser.get(f"http://{server.addr}/")
        wait(browser, "the model list", lambda d: d.find_element(By.ID, "model").get_attribute("value") == MODEL)
        layout = phone_layout(browser)
        # A page wider than the screen makes a phone zoom out to fit it: the viewport grows.
        assert layout["inner"] == PHONE[0], f"the chat page is wider than the phone: {layout}"
        prompt = browser.find_element(By.ID, "prompt").rect
        assert prompt["width"] >= 0.8 * PHONE[0], f"the prompt box is {prompt['width']} px wide at {PHONE[0]} px"
        assert layout["scroll"] <= PHONE[0] and layout["right"] <= PHONE[0], f"the chat page is wider than the phone: {layout}"
        send = browser.find_element(By.ID, "send").rect
        assert send["x"] + send["width"] <= PHONE[0] and send["y"] + send["height"] <= PHONE[1], f"Send is off the screen: {send}"
        set_field(browser, "temperature", 0)
        set_field(browser, "max-tokens", 48)
        ask(browser, "Write a Python function that reverses a string.")
        answer = last_answer(browser)
        wait(browser, "the answer to finish", lambda d: answer.get_attribute("data-done"))
        layout = phone_layout(browser)
        assert layout["scroll"] <= PHONE[0], f"the chat page scrolls sideways with an answer: {layout}"
        browser.save_screenshot(str(shots / "chat-phone.png"))

        browser.get(f"http://{server.addr}/dashboard")
        wait(browser, "the first scrape", lambda d: d.find_element(By.ID, "status").text.startswith("live"))
        wait(browser, "the worker pools", lambda d: len(d.find_elements(By.CSS_SELECTOR, "#pools .pool")) == 2)
        wait(browser, "the latencies", lambda d: "–" not in d.find_element(By.ID, "ttft").text)
        layout = phone_layout(browser)
        assert layout["scroll"] <= PHONE[0] and layout["right"] <= PHONE[0], f"the dashboard is wider than the phone: {layout}"
        browser.save_screenshot(str(shots / "dashboard-phone.png"))
        assert csp_violations(browser) == []
    finally:
        browser.execute_cdp_cmd("Emulation.clearDeviceMetricsOverride", {})


def test_with_tenants_the_page_asks_for_a_key_and_shows_a_401(browser):
    with serve("--role", "gateway", "--worker-listen", "127.0.0.1:0", "--api-key", KEY, wait_ready=False) as gw:
        browser.get(f"http://{gw.addr}/")
        key = browser.find_element(By.ID, "api-key")
        assert key.is_displayed(), "the key box shows at once"
        error = browser.find_element(By.ID, "error")
        wait(browser, "the 401 on the page", lambda d: "401" in error.text)
        assert "needs an API key" in error.text, error.text
        # A wrong key: refused, and said so.
        key.send_keys("sk-wrong", Keys.TAB)
        wait(browser, "the refusal", lambda d: "refused this API key" in error.text)
        # The right key: the models load, the error goes; the key is in session storage only.
        key.clear()
        key.send_keys(KEY, Keys.TAB)
        wait(browser, "the model list", lambda d: d.find_element(By.ID, "model").get_attribute("value") == MODEL)
        assert not error.is_displayed()
        assert browser.execute_script("return sessionStorage.getItem('bulkhead.apiKey')") == KEY
        assert browser.execute_script("return localStorage.length") == 0
        assert browser.get_cookies() == []
        # A chat request with a wrong key gets a 401, on the page.
        browser.execute_script("sessionStorage.setItem('bulkhead.apiKey', 'sk-stale')")
        ask(browser, "hello?", answered=False)
        wait(browser, "the 401 for the chat request", lambda d: "401" in error.text and error.is_displayed())
        assert browser.find_elements(By.CSS_SELECTOR, "#messages .msg.assistant") == [], "no empty answer left behind"
        assert csp_violations(browser) == []
        browser.execute_script("sessionStorage.clear()")
