"""The web console in a real browser (Debian's chromium, driven by Playwright) against a
real local cluster: a coordinator holding layers 0-1 and two workers sharing 2-5, on
127.0.0.1, behind an API key; and, for tokens per forward while an answer streams, a
coordinator alone on the shared WeDLM checkpoint (skipped when ../shared is absent).
Screenshots of both views go to tests/artifacts/."""

from __future__ import annotations

import os
import re
import shutil
import signal
import time
from contextlib import contextmanager
from pathlib import Path

import httpx
import openai
import pytest

from tests.conftest import shared_model
from tests.support.cluster_harness import (
    cluster_name,
    free_port,
    http_coordinator,
    spawn,
    start_coordinator,
    start_worker,
    wait_until,
)
from tests.support.paths import TESTS_DIR
from wedlm_client.client import WedlmClient

KEY = "console-test-key"
ARTIFACTS = TESTS_DIR / "artifacts"
CHROMIUM = os.environ.get("WEDLM_CHROMIUM", "/usr/bin/chromium")
QUESTION = "what is a cluster of machines for"
WEDLM = {"mode": "wedlm", "window": 8, "threshold": 50.0}  # commits several tokens a forward


def _browser_or_skip():
    """Playwright and Debian's chromium; in CI (CI, or WEDLM_REQUIRE_BROWSER as .ci/run
    sets) their absence fails the tests, locally it skips them with the reason."""
    problem = None
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        problem = "playwright is not installed (pip install -e '.[test]')"
    if problem is None and not (Path(CHROMIUM).exists() or shutil.which(CHROMIUM)):
        problem = f"no chromium at {CHROMIUM} (apt-get install chromium; WEDLM_CHROMIUM)"
    if problem is not None:
        if os.environ.get("CI") or os.environ.get("WEDLM_REQUIRE_BROWSER"):
            pytest.fail(f"the console's browser tests need a browser: {problem}")
        pytest.skip(problem)
    return sync_playwright


@pytest.fixture(scope="module")
def browser():
    sync_playwright = _browser_or_skip()
    with sync_playwright() as p:
        b = p.chromium.launch(executable_path=CHROMIUM, headless=True, args=["--no-sandbox"])
        yield b
        b.close()


@contextmanager
def local_cluster(model: Path):
    """A coordinator (layers 0-1, behind KEY) and two workers on 127.0.0.1."""
    name = cluster_name()
    procs, workers = [], []
    try:
        for _ in range(2):  # fixed ports: a worker restarted there is the same member
            port = free_port()
            proc, address = start_worker(model, name, "--no-bonjour", "--port", str(port))
            procs.append(proc)
            workers.append({"proc": proc, "address": address, "port": port})
        coord, address = start_coordinator(
            model, name, "--no-bonjour", "--worker", workers[0]["address"],
            "--worker", workers[1]["address"], "--expect", "2", "--layers", "0-1",
            "--http-port", "0", "--api-key", KEY,
        )  # fmt: skip
        procs.append(coord)
        http = coord.expect(r"HTTP API on (http://\S+/v1)").group(1)
        console = coord.expect(r"console on (http://\S+)").group(1)  # the start log's line
        coord.expect("serving")
        info = {"model": model, "name": name, "address": address, "http": http,
                "root": http.removesuffix("/v1"), "console": console, "workers": workers,
                "procs": procs}  # fmt: skip
        yield info
    finally:
        for p in procs:
            p.stop()


@pytest.fixture(scope="module")
def cluster(checkpoint_dir, browser):
    with local_cluster(checkpoint_dir("wedlm_qwen2", seed=47, num_hidden_layers=6)) as info:
        yield info


@contextmanager
def new_page(browser):
    """A fresh tab (its own sessionStorage: the key is asked again); its script errors fail."""
    context = browser.new_context(viewport={"width": 1280, "height": 900})
    page = context.new_page()
    errors: list[str] = []
    page.on("pageerror", lambda error: errors.append(str(error)))
    try:
        yield page
    finally:
        context.close()
    assert not errors, f"the page's script failed: {errors}"


@pytest.fixture
def page(browser, cluster):
    with new_page(browser) as page:
        yield page


def open_console(page, cluster, view: str = "cluster") -> None:
    page.goto(f"{cluster['root']}/#{view}")
    page.fill("#key-input", KEY)
    page.press("#key-input", "Enter")
    page.wait_for_selector("#main:not([hidden])")
    page.wait_for_selector(".layer-seg", state="attached")


def status(cluster) -> dict:
    with WedlmClient(cluster["address"], api_key=KEY) as client:
        return client.status_dict()  # what `wedlm status --json` prints


def status_segments(st: dict) -> list[tuple[int, int]]:
    start, _, end = st["local_layers"].partition("-")
    segments = [(int(start), int(end))]
    for w in st["workers"]:
        info = w.get("info", {})
        if w.get("health") == "serving" and info.get("has_layers"):
            segments.append((int(info.get("layer_start", 0)), int(info["layer_end"])))
    return sorted(segments)


def page_segments(page) -> list[tuple[int, int]]:
    segs = page.eval_on_selector_all(
        ".layer-seg[data-member]", "els => els.map(e => [e.dataset.start, e.dataset.end])"
    )
    return sorted((int(a), int(b)) for a, b in segs)


def member_states(page) -> dict[str, str]:
    return dict(
        page.eval_on_selector_all(
            ".member", "els => els.map(e => [e.dataset.member, e.dataset.state])"
        )
    )


def test_without_the_key_the_page_asks_and_the_data_is_401(page, cluster):
    page.goto(cluster["root"] + "/")
    page.wait_for_selector("#key-dialog:not([hidden])")
    assert page.is_hidden("#main")
    for path in ("/console/state", "/console/events"):
        for headers in ({}, {"Authorization": "Bearer wrong"}):
            reply = httpx.get(cluster["root"] + path, headers=headers, timeout=10)
            assert reply.status_code == 401, (path, reply.text)
            assert reply.json()["error"]["code"] == "invalid_api_key"
    # a wrong key is refused on the page too, and it asks again
    page.fill("#key-input", "wrong")
    page.press("#key-input", "Enter")
    page.wait_for_function("document.querySelector('#key-error').textContent.includes('key')")
    assert page.is_hidden("#main")
    assert httpx.get(cluster["root"] + "/console/static/console.js").status_code == 200


def test_cluster_view_shows_the_members_and_the_plan(page, cluster):
    open_console(page, cluster)
    page.wait_for_function("document.querySelectorAll('.member[data-state=serving]').length == 3")
    st = status(cluster)
    assert page_segments(page) == status_segments(st) == [(0, 1), (2, 3), (4, 5)]
    names = page.eval_on_selector_all(".member h3", "els => els.map(e => e.textContent)")
    assert len(names) == 3
    worker_ids = {w["info"]["node_id"] for w in st["workers"]}
    assert worker_ids | {"coordinator"} == set(member_states(page))
    cards = page.inner_text("#members")
    assert "GiB" in cards and ("cpu:" in cards or "gpu:" in cards), cards
    assert page.inner_text("#running") == "0"
    ARTIFACTS.mkdir(exist_ok=True)
    page.screenshot(path=str(ARTIFACTS / "console-cluster-start.png"), full_page=True)
    page.set_viewport_size({"width": 390, "height": 844})  # a phone
    page.wait_for_timeout(300)
    page.screenshot(path=str(ARTIFACTS / "console-cluster-phone.png"), full_page=True)
    width = page.evaluate("document.documentElement.scrollWidth")
    assert width <= 390, f"the page scrolls sideways at phone width ({width}px)"


def test_chat_streams_the_greedy_answer_grouped_by_forward(page, cluster):
    with openai.OpenAI(base_url=cluster["http"], api_key=KEY, max_retries=0) as client:
        request = {"model": cluster["model"].name, "max_tokens": 24,
                   "messages": [{"role": "user", "content": QUESTION}]}  # fmt: skip
        expected = client.chat.completions.create(**request, extra_body=WEDLM)
        chunks = list(client.chat.completions.create(
            **request, stream=True, stream_options={"include_usage": True},
            extra_body={**WEDLM, "stream_commits": True},
        ))  # fmt: skip
    # the grouping field: every content chunk says its forwards; they add up to usage's
    groups = [c.model_extra["wedlm"] for c in chunks if c.choices and c.choices[0].delta.content]
    usage = chunks[-1].usage
    assert sum(g["forwards"] for g in groups) == usage.model_extra["forwards"]
    assert sum(g["tokens"] for g in groups) == usage.completion_tokens
    assert any(g["tokens"] > 1 for g in groups), groups  # parallel commits happened
    answer = expected.choices[0].message.content

    open_console(page, cluster, "chat")
    page.select_option("#mode", "wedlm")
    page.fill("#window", "8")
    page.fill("#threshold", "50")
    page.fill("#max-tokens", "24")
    page.fill("#prompt", QUESTION)
    page.press("#prompt", "Enter")  # the keyboard sends
    page.wait_for_selector(".msg.assistant[data-done]")
    assert page.get_attribute(".msg.assistant", "data-done") == "done"
    assert page.inner_text(".msg.assistant .answer") == answer
    spans = page.eval_on_selector_all(
        ".msg.assistant .fw", "els => els.map(e => [+e.dataset.forwards, +e.dataset.tokens])"
    )
    assert len(spans) < expected.usage.completion_tokens  # fewer groups than tokens
    assert sum(t for _, t in spans) == expected.usage.completion_tokens
    assert page.locator(".msg.assistant .fw.multi").count() >= 1
    tpf = float(page.inner_text(".msg.assistant .tpf"))
    assert tpf == pytest.approx(expected.usage.completion_tokens / usage.model_extra["forwards"],
                                abs=0.01)  # fmt: skip
    assert tpf > 1 and float(page.inner_text(".msg.assistant .tps")) > 0
    ARTIFACTS.mkdir(exist_ok=True)
    page.screenshot(path=str(ARTIFACTS / "console-chat.png"), full_page=True)


def cancelled(cluster) -> float:
    metrics = httpx.get(cluster["root"] + "/metrics", timeout=10).text
    for line in metrics.splitlines():
        if line.startswith('wedlm:request_success_total{finished_reason="cancelled"}'):
            return float(line.split()[-1])
    return 0.0


def test_stop_cancels_the_request(page, cluster):
    open_console(page, cluster, "chat")
    before = cancelled(cluster)
    page.select_option("#mode", "ar")
    page.fill("#max-tokens", "400")
    # this checkpoint's greedy answer runs to max_tokens ("tell me a long story" ends after
    # 43 tokens, which a loaded machine may stream whole before the click)
    page.fill("#prompt", "tell me a long story about the sea")
    page.click("#send")
    page.wait_for_selector(".msg.assistant .fw")
    page.click("#stop")
    page.wait_for_selector(".msg.assistant[data-done=stopped]")
    assert page.is_enabled("#send") and page.is_disabled("#stop")
    # the server cancelled it (its KV freed), and the running count is back to 0
    wait_until(lambda: cancelled(cluster) == before + 1, 10, "the request cancelled")
    page.click("#tab-cluster")
    page.wait_for_function("document.querySelector('#running').textContent == '0'", timeout=10_000)
    st = status(cluster)
    assert st.get("running", 0) == 0 and st.get("queued", 0) == 0


def test_killed_worker_shows_lost_replans_and_comes_back(page, cluster):
    open_console(page, cluster)
    page.wait_for_function("document.querySelectorAll('.member[data-state=serving]').length == 3")
    victim = cluster["workers"][1]
    victim_id = next(
        w["info"]["node_id"] for w in status(cluster)["workers"]
        if w["address"] == victim["address"]
    )  # fmt: skip
    before = page.locator(".recovery").count()
    killed = time.monotonic()
    os.kill(victim["proc"].popen.pid, signal.SIGKILL)
    victim["proc"].popen.wait(10)
    page.wait_for_selector(f".member[data-member='{victim_id}'][data-state=lost]", timeout=15_000)
    lost_after = time.monotonic() - killed
    # the plan changes: two stages now, none on the lost worker, as `wedlm status` says
    # (until the re-plan, the lost worker's layers show as a gap in the bar)
    wait_until(lambda: page_segments(page) == [(0, 1), (2, 5)], 30, "the new plan on the page")
    assert page_segments(page) == status_segments(status(cluster))
    assert page.locator(f".layer-seg[data-member='{victim_id}']").count() == 0
    page.wait_for_function(
        f"document.querySelectorAll('.recovery').length > {before}", timeout=15_000
    )
    assert "recovered" in page.inner_text("#recoveries")
    assert lost_after < 10, f"the card showed the loss after {lost_after:.1f} s"
    page.screenshot(path=str(ARTIFACTS / "console-cluster-lost.png"), full_page=True)

    proc, _ = start_worker(
        cluster["model"], cluster["name"], "--no-bonjour", "--port", str(victim["port"])
    )
    cluster["procs"].append(proc)
    victim["proc"] = proc
    page.wait_for_selector(
        f".member[data-member='{victim_id}'][data-state=serving]", timeout=30_000
    )
    wait_until(lambda: page_segments(page) == [(0, 1), (2, 3), (4, 5)], 30, "the worker back")
    assert page_segments(page) == status_segments(status(cluster))
    page.wait_for_timeout(1500)  # the plots take in the last seconds
    page.screenshot(path=str(ARTIFACTS / "console-cluster.png"), full_page=True)


# What the chat view's last answer shows, recorded by a MutationObserver at every change of
# the log (so a state that lasts a few milliseconds is still seen, whatever the speed).
RECORD_ANSWER = """() => {
  window.seen = [];
  new MutationObserver(() => {
    const msg = [...document.querySelectorAll('.msg.assistant')].pop();
    if (!msg) return;
    const live = msg.querySelector('.live');
    const tpf = live && live.querySelector('.live-tpf');
    window.seen.push({live: live ? live.className : null, text: live ? live.textContent : null,
                      fw: msg.querySelectorAll('.fw').length, tpf: tpf ? tpf.textContent : null,
                      done: msg.dataset.done || null});
  }).observe(document.querySelector('#log'),
             {subtree: true, childList: true, characterData: true, attributes: true});
}"""


def test_chat_says_prefilling_until_the_first_token(page, cluster):
    open_console(page, cluster, "chat")
    page.select_option("#mode", "ar")
    page.fill("#max-tokens", "8")
    page.evaluate(RECORD_ANSWER)
    page.fill("#prompt", " ".join([QUESTION] * 4))  # a longer prompt: a longer prefill
    page.click("#send")
    page.wait_for_selector(".msg.assistant[data-done]")
    done = page.get_attribute(".msg.assistant", "data-done")
    assert done == "done", page.inner_text(".msg.assistant")
    seen = page.evaluate("window.seen")
    prefilling = [s for s in seen if s["live"] == "live prefilling"]
    assert prefilling, seen
    assert all(s["fw"] == 0 for s in prefilling), "prefilling… shown beside a token"
    assert re.fullmatch(r"prefilling… \d+\.\d s", prefilling[0]["text"]), prefilling[0]
    first = next(i for i, s in enumerate(seen) if s["fw"] > 0)
    assert seen.index(prefilling[0]) < first
    assert seen[first]["live"] == "live decoding", seen[first]  # counts from the first token
    # the answer's final line replaces the live one
    assert page.locator(".msg.assistant .live").count() == 0
    assert page.locator(".msg.assistant .stats .tpf").count() == 1


def test_ttft_plot_has_a_point_per_request_second(page, cluster):
    open_console(page, cluster)
    with openai.OpenAI(base_url=cluster["http"], api_key=KEY, max_retries=0) as client:
        client.chat.completions.create(
            model=cluster["model"].name, max_tokens=4,
            messages=[{"role": "user", "content": QUESTION}],
        )  # fmt: skip
    page.wait_for_selector("#plot-ttft .point", state="attached", timeout=15_000)
    shown = page.inner_text("#val-ttft")
    assert re.fullmatch(r"last \d+ ms", shown), shown
    values = page.eval_on_selector_all("#plot-ttft .point", "els => els.map(e => +e.dataset.value)")
    assert values, shown
    # the page rounds with toFixed (136.5 -> 137), not Python's round-half-even (-> 136)
    last = page.evaluate("v => Number(v).toFixed(0)", values[-1])
    assert last == shown.split()[1], (values, shown)


def test_the_start_logs_console_url_opens_the_console(page, cluster):
    url = cluster["console"]
    assert url == cluster["root"] + "/", url  # the API's host and port, at /
    page.goto(url)
    page.wait_for_selector("#key-dialog:not([hidden])")
    page.fill("#key-input", KEY)
    page.press("#key-input", "Enter")
    page.wait_for_selector("#main:not([hidden])")
    page.wait_for_function("document.querySelector('#model').textContent.includes('layers')")
    assert page.inner_text("#model").startswith(cluster["model"].name)
    assert page.title() == "wedlm-cluster console"


def test_the_local_clusters_start_log_names_the_console_too(browser, cluster):
    """`wedlm-coordinator local` (a worker process and a coordinator here) prints the
    console's URL beside the API's; the page there loads, no key asked (none was set)."""
    proc = spawn(
        "coordinator.service.server_cli", "local", "--model", str(cluster["model"]),
        "--workers", "1", "--http-port", "0", "--keep-running",
    )  # fmt: skip
    try:
        api = proc.expect(r"HTTP API on (http://\S+)/v1").group(1)
        url = proc.expect(r"web console on (http://\S+)").group(1)
        assert url == api + "/", (url, api)
        with new_page(browser) as page:
            page.goto(url)
            page.wait_for_selector("#main:not([hidden])")
            page.wait_for_selector(".member[data-state=serving]")
            assert page.inner_text("#model").startswith(cluster["model"].name)
    finally:
        proc.stop()


def lost_age(page) -> int:
    text = page.inner_text(".member[data-state=lost] .badge")
    m = re.fullmatch(r"lost (\d+) s ago", text)
    assert m, text
    return int(m.group(1))


def test_lost_worker_age_counts_from_the_loss_and_its_error_reads_as_words(browser, checkpoint_dir):
    # a cluster of its own: its first loss (the module's cluster has lost and re-planned
    # already), and nothing to restart after
    with local_cluster(checkpoint_dir("wedlm_qwen2", seed=47, num_hidden_layers=6)) as c:
        lost_worker_age_and_words(browser, c)


def lost_worker_age_and_words(browser, cluster) -> None:
    victim = cluster["workers"][1]
    wait_until(lambda: status_segments(status(cluster)) == [(0, 1), (2, 3), (4, 5)], 30, "plan")
    # killed while no console is open: the page opened later counts from the loss itself
    killed = time.time()
    os.kill(victim["proc"].popen.pid, signal.SIGKILL)
    victim["proc"].popen.wait(10)
    try:
        wait_until(lambda: status_segments(status(cluster)) == [(0, 1), (2, 5)], 60, "re-plan")
    except AssertionError as e:
        log = "".join(cluster["procs"][2].log[-30:])
        raise AssertionError(f"{e}: status {status(cluster)}; coordinator: {log}") from None
    replanned = time.time()  # the coordinator found it gone before this
    time.sleep(4)
    with new_page(browser) as page:
        open_console(page, cluster)
        card = ".member[data-state=lost]"  # named by its address: never seen up by a page
        page.wait_for_selector(f"{card} .age")
        assert page.locator(card).count() == 1
        assert victim["address"] in page.inner_text(card)
        first = lost_age(page)
        # at least the time since the re-plan (less the 1 s the text may lag), not "0 s"
        assert int(time.time() - replanned) - 1 <= first <= time.time() - killed + 1, first
        page.wait_for_function(  # and it counts up between snapshots
            f"+document.querySelector(\"{card} .age\").textContent.split(' ')[1] > {first}",
            timeout=10_000,
        )  # fmt: skip
        # the banner in words; gRPC's text behind a closed toggle
        page.wait_for_selector(f"{card} .detail-box")
        detail = page.inner_text(f"{card} p.detail")
        assert detail.startswith(f"worker {victim['address']} stopped answering ("), detail
        assert "UNAVAILABLE" not in page.inner_text("#members")
        raw = page.locator(f"{card} details.raw")
        assert raw.get_attribute("open") is None
        page.click(f"{card} details.raw summary")
        page.wait_for_timeout(1500)  # a snapshot or two re-render the card: it stays open
        assert raw.get_attribute("open") is not None
        code = page.inner_text(f"{card} details.raw code")
        assert code.startswith(f"worker {victim['address']}: UNAVAILABLE: "), code
        recoveries = page.inner_text("#recoveries")
        assert f"worker {victim['address']} stopped answering" in recoveries, recoveries
        ARTIFACTS.mkdir(exist_ok=True)
        page.screenshot(path=str(ARTIFACTS / "console-cluster-lost-detail.png"), full_page=True)


@pytest.fixture(scope="module")
def wedlm_root(browser):
    """A coordinator alone (every layer in-process) on the shared WeDLM checkpoint."""
    with http_coordinator(shared_model("wedlm-smollm2-135m-r2"), "--api-key", KEY) as c:
        yield c.root


def test_tokens_per_forward_counts_while_a_wedlm_answer_streams(browser, wedlm_root):
    with new_page(browser) as page:
        open_console(page, {"root": wedlm_root}, "chat")
        page.select_option("#mode", "wedlm")
        page.fill("#max-tokens", "32")
        page.evaluate(RECORD_ANSWER)
        page.fill("#prompt", "Count from 1 to 40, separated by commas.")
        page.click("#send")
        page.wait_for_selector(".msg.assistant[data-done]", timeout=300_000)
        assert page.get_attribute(".msg.assistant", "data-done") == "done"
        seen = page.evaluate("window.seen")
        live = [s["tpf"] for s in seen if s["tpf"] is not None and not s["done"]]
        assert len(set(live)) >= 2, f"tokens per forward did not change while streaming: {live}"
        assert any(float(v) > 1 for v in live), live  # parallel commits, counted live
        # the last live figure is the answer's own, which the final line states
        final = page.inner_text(".msg.assistant .stats .tpf")
        assert live[-1] == final, (live[-1], final)
        ARTIFACTS.mkdir(exist_ok=True)
        page.screenshot(path=str(ARTIFACTS / "console-chat-wedlm.png"), full_page=True)
