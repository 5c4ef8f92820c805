"""The operator's page in a real browser: Debian's headless Chromium, driven by Playwright with `executable_path`
(Playwright's own browser download is never used). A gateway with fake-backend workers on a real queue, SQLite and
Redis; the page live over server-sent events, never reloaded while it is watched.

What a browser does not add (the token's cookie, the policy's headers, paging at scale) is in tests/test_ui.py."""

from __future__ import annotations

import json
import os
import shutil
import time
from pathlib import Path
from urllib.parse import urlparse

import pytest
from test_gateway import Fleet, engine_url

from nodeagent.client import Client
from nodeagent.tasks.contracts import ClassifyTask

TOKEN = "browser-token"
Q = "classify.v1"
CHROMIUM = os.environ.get("NODEAGENT_CHROMIUM") or shutil.which("chromium") or "/usr/bin/chromium"
ARGS = ["--no-sandbox", "--disable-gpu", "--disable-background-networking", "--disable-component-update",
        "--disable-sync", "--no-first-run", "--disable-dev-shm-usage"]
SCREENSHOT = os.environ.get("NODEAGENT_UI_SCREENSHOT")  # a path: the fleet page is saved there (the README's picture)
WAIT_MS = 30_000


@pytest.fixture(scope="module")
def browser():
    if not Path(CHROMIUM).exists():
        raise AssertionError(f"no Chromium at {CHROMIUM}: install Debian's chromium (scripts/test does), "
                             "or set NODEAGENT_CHROMIUM to one")
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        b = p.chromium.launch(executable_path=CHROMIUM, args=ARGS, headless=True)
        yield b
        b.close()


class Watched:
    """A browser tab on the fleet's page that records what should never happen: a console error, an uncaught
    exception, a request to anywhere but the page's own server, a full reload."""

    def __init__(self, browser, base: str) -> None:
        self.base, self.origin = base, urlparse(base).netloc
        self.context = browser.new_context(viewport={"width": 1400, "height": 900})
        self.errors: list[str] = []
        self.outside: list[str] = []
        self.context.route("**/*", self._route)
        self.page = self.context.new_page()
        self.page.on("console", lambda m: self.errors.append(f"console {m.type}: {m.text}") if m.type == "error"
                     else None)
        self.page.on("pageerror", lambda e: self.errors.append(f"page error: {e}"))
        self.page.set_default_timeout(WAIT_MS)

    def _route(self, route) -> None:
        url = route.request.url
        if urlparse(url).netloc == self.origin:
            route.continue_()
        else:
            self.outside.append(url)
            route.abort()

    def open(self, path: str) -> None:
        self.page.goto(self.base + path)
        self.page.evaluate("window.__sameLoad = true")  # gone if the page is ever reloaded

    def wait_for(self, selector: str) -> None:
        self.page.wait_for_selector(selector, state="attached")

    def still_the_same_load(self) -> bool:
        return self.page.evaluate("window.__sameLoad === true")

    def close(self) -> None:
        self.context.close()
        assert not self.errors, self.errors
        assert not self.outside, f"the page reached outside its server: {self.outside}"


@pytest.fixture(params=["sqlite", "redis"])
def fleet(request, tmp_path_factory):
    f = Fleet(engine_url(request, tmp_path_factory), tmp_path_factory.mktemp("ui-browser"), "--token", TOKEN,
              "--ui-admin", env={"NODEAGENT_UI_REFRESH_S": "0.3"})
    yield f
    f.stop()


def test_the_fleet_page_follows_a_killed_node_from_ok_to_stale_to_lost_without_a_reload(fleet, browser):
    fleet.worker("w1", "fake")
    fleet.worker("w2", "fake", "--heartbeat", "2")  # its stale spell (1.5 to 3 beats) long enough to be seen
    fleet.ready(2)
    tab = Watched(browser, fleet.base)
    try:
        tab.page.goto(f"{fleet.base}/ui?token={TOKEN}")  # the sign-in link: the cookie set, the token gone
        assert tab.page.url == f"{fleet.base}/ui"
        tab.page.evaluate("window.__sameLoad = true")
        tab.wait_for('tr[data-node="w1"][data-status="ok"]')
        tab.wait_for('tr[data-node="w2"][data-status="ok"]')
        assert tab.page.locator("#count-ok").inner_text() == "2"
        fleet.kill("w2")
        tab.wait_for('tr[data-node="w2"][data-status="stale"]')
        tab.wait_for('#lost tr[data-node="w2"][data-status="lost"]')  # folded away with the lost
        assert tab.page.locator('#nodes tr[data-node="w2"]').count() == 0
        assert tab.page.locator("#count-lost").inner_text() == "1"
        assert tab.page.locator('tr[data-node="w1"][data-status="ok"]').count() == 1
        assert tab.still_the_same_load()
        if SCREENSHOT:
            Path(SCREENSHOT).parent.mkdir(parents=True, exist_ok=True)
            tab.page.click("#lost summary")  # the lost node unfolded for the picture
            tab.page.screenshot(path=SCREENSHOT, full_page=True)
    finally:
        tab.close()


def until(condition, timeout_s: float = 30.0) -> None:
    """Polled from here: a predicate evaluated in the page would need eval, which the page's policy forbids."""
    deadline = time.time() + timeout_s
    while not condition():
        assert time.time() < deadline, "the page did not get there in time"
        time.sleep(0.1)


def _chart_total(tab: Watched, chart: str) -> float:
    """The sum of a chart's points, as the page holds them now (swapped in with each refresh)."""
    data = json.loads(tab.page.get_attribute(f'[data-chart="{chart}"]', "data-series") or "{}")
    return sum(v or 0 for s in data.get("series", []) for v in s["values"])


def test_queue_depth_and_throughput_move_as_tasks_are_submitted(fleet, browser):
    fleet.worker("w1", "fake:latency_ms=150")
    fleet.ready(1)
    client = Client(fleet.broker)
    client.wait(client.submit(ClassifyTask(input="first", labels=["a", "b"])), timeout=30)  # the queue exists
    tab = Watched(browser, fleet.base)
    try:
        tab.page.goto(f"{fleet.base}/ui/queues?window=1h&token={TOKEN}")
        tab.page.evaluate("window.__sameLoad = true")
        tab.wait_for(f'tr[data-queue="{Q}"]')
        until(lambda: _chart_total(tab, "throughput") >= 1)
        done_before = _chart_total(tab, "throughput")
        ids = [client.submit(ClassifyTask(input=f"task {i}", labels=["a", "b"])) for i in range(30)]
        deepest, deadline = 0, time.time() + 60
        while time.time() < deadline:  # the depth column rises, then drains, as the page is pushed new snapshots
            cell = tab.page.locator(f'tr[data-queue="{Q}"] td[data-field="ready"]')
            deepest = max(deepest, int(cell.inner_text()) if cell.count() else 0)
            if deepest and int(cell.inner_text()) == 0:
                break
            tab.page.wait_for_timeout(100)
        assert deepest >= 5, deepest
        assert all(client.wait(i, timeout=60).status == "ok" for i in ids)
        until(lambda: _chart_total(tab, "throughput") >= done_before + 30)  # the chart's data counts the 30
        for chart in ("depth", "throughput"):  # and uPlot drew it again after the swap that brought it
            # drawn on htmx:afterSettle, a moment after the swap whose data the line above read: waited for, not raced
            tab.wait_for(f'[data-chart="{chart}"][data-drawn="1"] canvas')
            assert tab.page.locator(f'[data-chart="{chart}"] canvas').count() <= 1  # never drawn twice over
        ok = int(tab.page.locator(f'tr[data-queue="{Q}"] td[data-field="ok"]').inner_text())
        assert ok >= 31
        assert tab.still_the_same_load()
    finally:
        tab.close()


def test_a_dead_letter_is_shown_under_its_code_and_replayed_from_the_page(fleet, browser):
    fleet.worker("w1", "fake:fail=poison")
    fleet.ready(1)
    client = Client(fleet.broker)
    dead = client.submit(ClassifyTask(input="poison pill", labels=["a", "b"]), max_attempts=1)
    assert client.wait(dead, timeout=30).error.code == "backend_error"
    tab = Watched(browser, fleet.base)
    try:
        tab.page.goto(f"{fleet.base}/ui/failures?token={TOKEN}")
        tab.wait_for('#codes tr[data-code="backend_error"]')
        assert tab.page.locator('#codes tr[data-code="backend_error"] td.num').inner_text() == "1"
        tab.page.click(f'#dead tr[data-task="{dead}"] a')  # the task: its attempts and input
        tab.wait_for("#attempts")
        assert "poison pill" in tab.page.locator("#input").inner_text()
        assert "w1" in tab.page.locator("#attempts").inner_text()
        tab.page.goto(f"{fleet.base}/ui/failures")
        tab.page.click('#codes tr[data-code="backend_error"] a.button')  # replay by code: a confirmation first
        tab.wait_for("#confirm-replay")
        assert fleet.broker.get(dead).state == "dead"  # nothing happens before it is confirmed
        tab.page.click("#confirm-replay")
        tab.page.wait_for_selector(".flash")
        assert "replayed 1 dead letter" in tab.page.locator(".flash").inner_text()
        # the worker fails it again (the input still holds the poison); the replay itself is what is proved
        deadline = time.time() + 30
        while time.time() < deadline and len(fleet.broker.get(dead).history) < 2:
            time.sleep(0.2)
        assert len(fleet.broker.get(dead).history) == 2
        replays = [e for e in fleet.broker.events() if e["kind"] == "control"]
        assert replays and replays[0]["action"] == "replay dead letters" and replays[0]["target"] == "backend_error"
    finally:
        tab.close()


def test_read_only_the_page_offers_no_control_and_refuses_a_forged_one(tmp_path, browser):
    f = Fleet(f"sqlite://{tmp_path / 'q.db'}", tmp_path, "--token", TOKEN)  # no --ui-admin
    try:
        f.worker("w1", "fake:fail=poison")
        f.ready(1)
        client = Client(f.broker)
        dead = client.submit(ClassifyTask(input="poison", labels=["a", "b"]), max_attempts=1)
        client.wait(dead, timeout=30)
        tab = Watched(browser, f.base)
        try:
            tab.page.goto(f"{f.base}/ui/failures?token={TOKEN}")
            tab.wait_for('#codes tr[data-code="backend_error"]')
            assert tab.page.locator("a.button, form.inline").count() == 0
            assert tab.page.locator(".mode").inner_text() == "read-only"
            status = tab.page.evaluate("""async () => {
                const body = new URLSearchParams({code: "backend_error", confirm: "replay"});
                const r = await fetch("/ui/failures/replay", {method: "POST", body});
                return [r.status, (await r.json()).error.code];
            }""")
            assert status == [403, "read_only"]
            tab.errors = [e for e in tab.errors if "403" not in e]  # the browser logs the refusal it was sent
            assert f.broker.get(dead).state == "dead"
        finally:
            tab.close()
    finally:
        f.stop()


def test_without_the_token_the_page_is_refused_until_signed_in(tmp_path, browser):
    f = Fleet(f"sqlite://{tmp_path / 'q.db'}", tmp_path, "--token", TOKEN)
    try:
        f.up()
        tab = Watched(browser, f.base)
        try:
            tab.page.goto(f"{f.base}/ui/queues")
            assert urlparse(tab.page.url).path == "/ui/login"
            assert tab.page.locator("#nodes, #queues").count() == 0
            tab.page.fill('input[name="token"]', "wrong")
            tab.page.click("form.login button")
            tab.wait_for('form.login [role="alert"]')
            assert "That is not this server" in tab.page.locator('[role="alert"]').inner_text()
            tab.errors = [e for e in tab.errors if "401" not in e]  # the refused sign-in's status, logged
            tab.page.fill('input[name="token"]', TOKEN)
            tab.page.click("form.login button")
            tab.page.wait_for_url(f"{f.base}/ui/queues")
            assert tab.page.locator("header nav [aria-current=page]").inner_text() == "Queues"
            cookies = {c["name"]: c for c in tab.context.cookies()}
            [cookie] = cookies.values()
            assert cookie["httpOnly"] and cookie["sameSite"] == "Strict" and TOKEN not in cookie["value"]
        finally:
            tab.close()
    finally:
        f.stop()


def test_the_page_loads_with_no_console_error_its_icon_included(tmp_path, browser):
    """Every request the browser makes on its own is answered: the page declares its icon, and /favicon.ico (what a
    browser asks for where none is declared) is served without the token: no 401 in the console."""
    import httpx

    f = Fleet(f"sqlite://{tmp_path / 'q.db'}", tmp_path, "--token", TOKEN)
    try:
        f.up()
        tab = Watched(browser, f.base)
        answered: list[tuple[str, int]] = []
        tab.page.on("response", lambda r: answered.append((urlparse(r.url).path, r.status)))
        try:
            tab.page.goto(f"{f.base}/ui/login")
            tab.page.fill('input[name="token"]', TOKEN)
            tab.page.click("form.login button")
            tab.page.wait_for_url(f"{f.base}/ui")
            tab.page.wait_for_load_state("networkidle")
            icon = tab.page.locator('link[rel="icon"]').get_attribute("href")
            assert icon == "/ui/static/favicon.svg"
            fetched = tab.page.evaluate(f"fetch('{icon}').then(r => [r.status, r.headers.get('content-type')])")
            assert fetched == [200, "image/svg+xml"]
            assert not [a for a in answered if a[1] >= 400], answered
        finally:
            tab.close()  # fails on any console error
        bare = httpx.get(f.base + "/favicon.ico", timeout=10)  # no token, no cookie: a browser's own request
        assert bare.status_code == 200 and bare.headers["content-type"] == "image/svg+xml" and b"<svg" in bare.content
    finally:
        f.stop()
