"""The operator's page: /ui on `serve` and on the gateway. Thin routes: each reads the shared snapshot (or, for a
list read page by page, the broker), hands it to ``views.py`` and renders a Jinja template. Pages refresh
themselves when the snapshot changes: the page holds one server-sent-event stream (``/ui/events``) and, at each
tick, htmx fetches the same address again and swaps its ``<main>``. Writes (``--ui-admin``) are POSTs answered
with a redirect back and a line saying what was done; the middleware has checked their origin
(``ui/security.py``)."""

from __future__ import annotations

import asyncio
import logging
from typing import Any
from urllib.parse import quote, urlencode

from fastapi import Form, Request
from fastapi.responses import HTMLResponse, RedirectResponse, Response, StreamingResponse

from nodeagent.errors import HttpError
from nodeagent.fleet.batches import Batches
from nodeagent.fleet.history import NODE_KINDS, History
from nodeagent.ui import views
from nodeagent.ui.security import is_token, login_cookie, logout_cookie, session_of
from nodeagent.ui.snapshot import Snapshots
from nodeagent.values import Frozen

log = logging.getLogger(__name__)
NAV = (("fleet", "/ui", "Fleet"), ("queues", "/ui/queues", "Queues"), ("placement", "/ui/placement", "Placement"),
       ("batches", "/ui/batches", "Batches"), ("failures", "/ui/failures", "Failures"))


class UiConfig(Frozen):
    admin: bool = False  # the controls (--ui-admin)
    token: str | None = None  # the API's bearer token, which signs a browser in
    input_chars: int = 4000  # a task's input and output are cut at this length (0: not shown)
    redact: frozenset[str] = frozenset()  # keys whose values are hidden
    title: str = "node"


class FleetWork:
    """The fleet's work as the page reads it beyond the snapshot: from the queue."""

    def __init__(self, broker: Any) -> None:
        self.broker = broker

    async def history(self, snap: Any, minutes: int, window: str) -> tuple[History, History]:
        """The fleet's fields and the nodes' over the window (the snapshot holds the last hour of the fleet's)."""
        fleet = snap.history_view() if window == "1h" else await asyncio.to_thread(History.read, self.broker,
                                                                                    snap.at, minutes)
        return fleet, await asyncio.to_thread(History.read, self.broker, snap.at, minutes, NODE_KINDS)

    async def batches(self, snap: Any, after: str | None, limit: int) -> list[views.BatchRow]:
        got = await asyncio.to_thread(Batches(self.broker).list, after, limit)
        return [views.batch_row(b, snap.at) for b in got]

    async def failures(self, snap: Any, code: str | None, page_no: int) -> dict[str, Any]:
        return await asyncio.to_thread(views.failures_page, snap, self.broker, code, page_no)

    async def task(self, snap: Any, task_id: str, ui: UiConfig) -> Any:
        return await asyncio.to_thread(views.task_page, self.broker, task_id, snap.at, ui.redact, ui.input_chars)


class NoQueue:
    """A server that runs no queue: every list of the fleet's work is empty, and a task is the 404."""

    async def history(self, snap: Any, minutes: int, window: str) -> tuple[History, History]:
        empty = History({}, snap.history["first_minute"], snap.history["last_minute"])
        return empty, empty

    async def batches(self, snap: Any, after: str | None, limit: int) -> list[views.BatchRow]:
        return []

    async def failures(self, snap: Any, code: str | None, page_no: int) -> dict[str, Any]:
        return {"groups": [], "code": code, "total": 0, "dead": views.Paged([], 1, 0)}

    async def task(self, snap: Any, task_id: str, ui: UiConfig) -> Any:
        raise _NO_QUEUE


_NO_QUEUE = HttpError(404, "this server runs no queue: start it with --broker to see the fleet's work",
                      "not_found_error", "no_queue")


class Page:
    """What every route of the page shares: the templates, the settings, the snapshot, the queue (None: this server
    runs none), and the small steps a route takes (render, redirect back with a line, who is acting, the admin
    and queue checks, the page number)."""

    def __init__(self, env: Any, ui: UiConfig, snapshots: Snapshots, broker: Any) -> None:
        self.env, self.ui, self.snapshots, self.broker = env, ui, snapshots, broker
        self.work = FleetWork(broker) if broker is not None else NoQueue()

    def render(self, request: Request, template: str, active: str, status: int = 200, **ctx: Any) -> HTMLResponse:
        snap = ctx.pop("snap", None)
        here = request.url.path + (f"?{request.url.query}" if request.url.query else "")
        html = self.env.get_template(template).render(
            active=active, here=here, admin=self.ui.admin, title=self.ui.title, snap=snap, signed=bool(self.ui.token),
            flash=request.query_params.get("done"), live=ctx.pop("live", True), **ctx)
        return HTMLResponse(html, status_code=status)

    @staticmethod
    def back(to: str, done: str) -> RedirectResponse:
        sep = "&" if "?" in to else "?"
        return RedirectResponse(f"{to}{sep}{urlencode({'done': done})}", status_code=303)

    def who(self, request: Request) -> str:
        host = request.client.host if request.client else "?"
        return f"{host} ({'signed in with the token' if self.ui.token else 'no token configured'})"

    def admin_only(self) -> None:
        if not self.ui.admin:
            raise HttpError(403, "this page is read-only: start the server with --ui-admin to use its controls",
                            "permission_error", "read_only")

    @staticmethod
    def page_no(request: Request, name: str = "page") -> int:
        """The page number a query names (``views.page_number``: never an error; a page past the end is the last)."""
        return views.page_number(request.query_params.get(name))

    def queue(self) -> Any:
        """The broker a control acts on (the 404 where this server runs no queue)."""
        if self.broker is None:
            raise _NO_QUEUE
        return self.broker


def install(app: Any, snapshots: Snapshots, broker: Any, ui: UiConfig, sessions: Any, throttle: Any) -> set[str]:
    """The page's routes and files on ``app``; returns the routes' paths (for the metrics' labels). ``sessions``:
    the sign-ins (``ui/sessions.py``); ``throttle``: wrong tokens per client address (``server/throttle.py``)."""
    from importlib.resources import files

    import jinja2
    from fastapi import APIRouter
    from fastapi.staticfiles import StaticFiles

    env = jinja2.Environment(loader=jinja2.PackageLoader("nodeagent.ui", "templates"), autoescape=True,
                             undefined=jinja2.StrictUndefined, trim_blocks=True, lstrip_blocks=True)
    env.globals.update(ago=views.ago, seconds=views.seconds, gib=views.gib, nav=NAV)
    env.filters["part"] = lambda value: quote(str(value), safe="")  # one path segment: an id's / and ? encoded
    api = APIRouter()
    page = Page(env, ui, snapshots, broker)
    _page_routes(api, page)
    _live_routes(api, page)
    _sign_in_routes(api, page, sessions, throttle)
    _control_routes(api, page)

    @api.get("/favicon.ico", include_in_schema=False)
    async def favicon() -> Any:
        """The page's icon, where a browser looks for one on its own (the page declares it, too)."""
        from fastapi.responses import FileResponse

        return FileResponse(str(files("nodeagent.ui") / "static" / "favicon.svg"), media_type="image/svg+xml",
                            headers={"Cache-Control": "max-age=86400"})

    app.include_router(api)
    app.mount("/ui/static", StaticFiles(directory=str(files("nodeagent.ui") / "static")), name="ui-static")
    return {route.path for route in api.routes}


def _page_routes(api: Any, page: Page) -> None:
    """The pages: the fleet, its queues, placement, batches, failures, a task."""
    @api.get("/ui", response_class=HTMLResponse)
    async def fleet(request: Request) -> Any:
        snap = await page.snapshots.current()
        return page.render(request, "fleet.html", "fleet", snap=snap,
                           **views.fleet_page(snap, page.page_no(request), page.page_no(request, "lost_page")))

    @api.get("/ui/queues", response_class=HTMLResponse)
    async def queues(request: Request) -> Any:
        snap = await page.snapshots.current()
        window = request.query_params.get("window", "1h")
        window = window if window in views.WINDOWS_MIN else "1h"
        history, by_node = await page.work.history(snap, views.WINDOWS_MIN[window], window)
        return page.render(request, "queues.html", "queues", snap=snap, window=window,
                           windows=list(views.WINDOWS_MIN), paused=snap.fleet.paused_queues,
                           **views.queues_page(snap, history, by_node, page.page_no(request)))

    @api.get("/ui/placement", response_class=HTMLResponse)
    async def placement(request: Request) -> Any:
        snap = await page.snapshots.current()
        return page.render(request, "placement.html", "placement", snap=snap,
                           **views.placement_page(snap, page.page_no(request)))

    @api.get("/ui/batches", response_class=HTMLResponse)
    async def batches(request: Request) -> Any:
        snap = await page.snapshots.current()
        after = request.query_params.get("after") or None
        rows = await page.work.batches(snap, after, views.PAGE_SIZE + 1)
        more = len(rows) > views.PAGE_SIZE
        rows = rows[:views.PAGE_SIZE]
        return page.render(request, "batches.html", "batches", snap=snap, batches=rows, after=after,
                           next_after=rows[-1]["id"] if more and rows else None)

    @api.get("/ui/failures", response_class=HTMLResponse)
    async def failures(request: Request) -> Any:
        snap = await page.snapshots.current()
        code = request.query_params.get("code") or None
        found = await page.work.failures(snap, code, page.page_no(request))
        return page.render(request, "failures.html", "failures", snap=snap, **found)

    @api.get("/ui/tasks", response_class=HTMLResponse)
    async def find_task(request: Request) -> Any:
        task_id = (request.query_params.get("id") or "").strip()
        if task_id:
            return RedirectResponse(f"/ui/tasks/{quote(task_id, safe='')}", status_code=303)
        snap = await page.snapshots.current()
        return page.render(request, "task.html", "task", snap=snap, found=None, task_id="", live=False)

    @api.get("/ui/tasks/{task_id:path}", response_class=HTMLResponse)
    async def task(request: Request, task_id: str) -> Any:
        snap = await page.snapshots.current()
        found = await page.work.task(snap, task_id, page.ui)
        return page.render(request, "task.html", "task", snap=snap, found=found, task_id=task_id,
                           status=200 if found else 404)


def _live_routes(api: Any, page: Page) -> None:
    """The one server-sent-event stream a page holds: a tick when the snapshot changes."""
    @api.get("/ui/events")
    async def events(request: Request) -> Any:
        q = page.snapshots.open_stream()
        if q is None:
            raise HttpError(503, f"{page.snapshots.max_streams} live pages are open already (NODEAGENT_UI_STREAMS): "
                                 "close one, or reload later", "server_error", "too_many_streams",
                            headers={"Retry-After": "10"})

        async def stream() -> Any:
            try:
                yield "retry: 3000\n\n"
                async for tick in page.snapshots.ticks(q):
                    if await request.is_disconnected():
                        return
                    yield ": keep-alive\n\n" if tick is None else f"event: tick\ndata: {tick}\n\n"
            finally:
                page.snapshots.close_stream(q)

        return StreamingResponse(stream(), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-store", "X-Accel-Buffering": "no"})


def _sign_in_routes(api: Any, page: Page, sessions: Any, throttle: Any) -> None:
    """Signing in with the bearer token (throttled per client address) and out."""
    @api.get("/ui/login", response_class=HTMLResponse)
    async def login_form(request: Request) -> Any:
        return page.render(request, "login.html", "login", next=_local(request.query_params.get("next")),
                           error=None, live=False)

    @api.post("/ui/login")
    async def login(request: Request, token: str = Form(""), next: str = Form("/ui")) -> Any:
        if not page.ui.token:
            return RedirectResponse(_local(next), status_code=303)
        client = request.client.host if request.client else "?"
        if not is_token(token.strip(), page.ui.token):  # the right token always signs in
            wait = throttle.judge(client, False)
            log.warning("ui: a sign-in with a wrong token from %s", client)
            if wait:
                return page.render(request, "login.html", "login", status=429, next=_local(next), live=False,
                                   error=f"Too many wrong tokens from {client}: try again in {wait:.0f} s.")
            return page.render(request, "login.html", "login", status=401, next=_local(next),
                               error="That is not this server's token.", live=False)
        out = RedirectResponse(_local(next), status_code=303)
        session = await asyncio.to_thread(sessions.open, client)
        out.headers["set-cookie"] = login_cookie(session, request.url.scheme == "https")
        return out

    @api.post("/ui/logout")
    async def logout(request: Request) -> Any:
        """Ends the session (its cookie no longer opens the page, replayed or not) and clears the cookie."""
        await asyncio.to_thread(sessions.close, session_of({k.lower(): v for k, v in request.headers.items()}))
        out = RedirectResponse("/ui/login", status_code=303)
        out.headers["set-cookie"] = logout_cookie()
        return out


def _control_routes(api: Any, page: Page) -> None:
    """The controls (--ui-admin): each a POST that calls the operator API (fleet/controls.py) and redirects back
    with a line saying what was done."""
    from nodeagent.fleet import controls

    @api.post("/ui/nodes/{target:path}")
    async def node_control(request: Request, target: str) -> Any:
        node_id, action = _split_action(target)
        page.admin_only()
        if action not in ("hold", "resume"):
            return Response(status_code=404)
        await asyncio.to_thread(controls.hold_node, page.queue(), node_id, action == "hold", page.who(request))
        return page.back("/ui", f"{'held' if action == 'hold' else 'resumed'} node {node_id}: it "
                                f"{'claims nothing' if action == 'hold' else 'claims again'} from its next heartbeat")

    @api.post("/ui/queues/{target:path}")
    async def queue_control(request: Request, target: str) -> Any:
        queue, action = _split_action(target)
        page.admin_only()
        if action not in ("pause", "resume"):
            return Response(status_code=404)
        await asyncio.to_thread(controls.pause_queue, page.queue(), queue, action == "pause", page.who(request))
        return page.back("/ui/queues", f"{'paused' if action == 'pause' else 'resumed'} queue {queue}")

    @api.get("/ui/failures/replay", response_class=HTMLResponse)
    async def replay_confirm(request: Request) -> Any:
        page.admin_only()
        snap = await page.snapshots.current()
        code = request.query_params.get("code") or None
        count = sum(g["count"] for g in snap.dead if code is None or g["code"] == code)
        return page.render(request, "confirm.html", "failures", snap=snap, code=code, count=count, live=False)

    @api.post("/ui/failures/replay")
    async def replay(request: Request, code: str = Form(""), confirm: str = Form("")) -> Any:
        page.admin_only()
        if confirm != "replay":
            return page.back("/ui/failures", "nothing replayed: the confirmation was not given")
        n = len(await asyncio.to_thread(controls.replay_dead, page.queue(), page.who(request), code or None))
        return page.back("/ui/failures", f"replayed {n} dead letter{'s' if n != 1 else ''}"
                                         + (f" with code {code}" if code else ""))

    @api.post("/ui/tasks/{target:path}")
    async def task_control(request: Request, target: str) -> Any:
        task_id, action = _split_action(target)
        page.admin_only()
        if action not in ("cancel", "replay"):
            return Response(status_code=404)
        act = controls.cancel_task if action == "cancel" else controls.replay_task
        ok = await asyncio.to_thread(act, page.queue(), task_id, page.who(request))
        return page.back(f"/ui/tasks/{quote(task_id, safe='')}",
                         f"{action}{'led' if action == 'cancel' else 'ed'} task {task_id}" if ok else
                         f"task {task_id} was not {action}{'led' if action == 'cancel' else 'ed'}: it is no longer "
                         f"{'waiting or running' if action == 'cancel' else 'a dead letter'}")

    @api.post("/ui/batches/{target:path}")
    async def batch_cancel(request: Request, target: str) -> Any:
        batch_id, action = _split_action(target)
        page.admin_only()
        if action != "cancel":
            return Response(status_code=404)
        from nodeagent.fleet.batches import BatchError

        try:
            b = await asyncio.to_thread(controls.cancel_batch, page.queue(), batch_id, page.who(request))
        except BatchError as exc:  # no such batch: the API's 404
            raise HttpError(exc.status, str(exc), code=exc.code) from None
        return page.back("/ui/batches", f"batch {batch_id} is {b.get('status', 'cancelling')}")


def _split_action(target: str) -> tuple[str, str]:
    """An id (which may hold / and .., percent-encoded by the page) and the action after its last /."""
    name, _, action = target.rpartition("/")
    return name, action


def _local(to: str | None) -> str:
    """A redirect target on this page only (never another site)."""
    return to if to and to.startswith("/ui") and not to.startswith("//") else "/ui"


__all__ = ["UiConfig", "install"]
