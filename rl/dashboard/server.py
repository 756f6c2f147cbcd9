"""The live dashboard: a local HTTP server (standard library) for one page that polls for changes.

The page and plotly.js (the copy bundled in the plotly package) are served from this machine, so
it works with no network. `/api/state?since=V` answers with the whole set of panels only when a
run folder changed since version V; the page redraws the charts that differ, without a reload.
"""
from __future__ import annotations

import json
import threading
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from importlib import resources
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlparse

from plotly.utils import PlotlyJSONEncoder

from rl.dashboard.model import RunData
from rl.dashboard.charts import Chart
from rl.dashboard.domains import domain_chart, has_families, heldout_domain_rows, run_domains
from rl.dashboard.panels import build_panels
from rl.dashboard.plotly_render import figure_json
from rl.dashboard.runfolder import is_run_folder
from rl.run_folder import CONFIG, METRICS
from rl.dashboard.samples import QueryError, SampleQuery, filter_options, find_sample, find_samples

STATIC = resources.files("rl.dashboard") / "static"
CONTENT_TYPES = {".html": "text/html; charset=utf-8", ".js": "text/javascript; charset=utf-8",
                 ".css": "text/css; charset=utf-8"}


class DashboardError(ValueError):
    """A problem with what `rl dashboard` was asked to show or where to listen, as one line."""


def plotly_js() -> bytes:
    return (resources.files("plotly") / "package_data" / "plotly.min.js").read_bytes()


def run_names(paths: list[Path]) -> list[str]:
    """Folder names, with the parent folder added where two runs share a name."""
    names = [p.name for p in paths]
    return [f"{p.parent.name}/{p.name}" if names.count(p.name) > 1 else p.name for p in paths]


class Dashboard:
    """The runs shown and the state the page polls, rebuilt when a run folder changes."""

    def __init__(self, run_dirs: list[Path]) -> None:
        paths = [Path(p).resolve() for p in run_dirs]
        if not paths:
            raise DashboardError("name at least one run folder")
        for path in paths:
            if not is_run_folder(path):
                raise DashboardError(f"{path} is not a run folder (no {CONFIG} or {METRICS})")
        if len(set(paths)) != len(paths):
            raise DashboardError("a run folder is named twice")
        self.runs = [RunData(p, name) for p, name in zip(paths, run_names(paths))]
        self.version = 0
        self._state = b""
        self._figures: dict[str, tuple[str, dict[str, Any]]] = {}  # chart id -> (its spec, its figure)
        self._lock = threading.Lock()

    def refresh(self) -> int:
        """Re-read the run folders; the state's version, bumped when anything changed."""
        with self._lock:
            changed = [run.refresh() for run in self.runs]  # every run, not just up to the first change
            if any(changed) or not self._state:
                self.version += 1
                self._state = json.dumps(self._build(), cls=PlotlyJSONEncoder).encode()
            return self.version

    def state(self) -> bytes:
        return self._state

    def _build(self) -> dict[str, Any]:
        panels = []
        for panel in build_panels(self.runs):
            panels.append({
                "id": panel.id, "title": panel.title,
                "charts": [{"id": c.id, "has_data": c.has_data, "figure": self._figure(c)} for c in panel.charts],
                "tables": [{"id": t.id, "title": t.title, "columns": t.columns, "rows": t.rows} for t in panel.tables],
            })
        # the domain picker's choices: every domain of runs of many domains (one is drawn on request)
        picks = sorted({d for run in self.runs for d in run_domains(run)}) if has_families(self.runs) else []
        return {"version": self.version, "runs": [run.name for run in self.runs], "panels": panels,
                "filters": filter_options(self.runs), "domains": picks}

    def _figure(self, chart: Chart) -> dict[str, Any]:
        """Drawing a figure costs tens of milliseconds: only charts whose content changed are redrawn."""
        spec = repr(chart)
        cached = self._figures.get(chart.id)
        if cached is None or cached[0] != spec:
            cached = self._figures[chart.id] = (spec, figure_json(chart))
        return cached[1]

    def domain(self, name: str) -> dict[str, Any] | None:
        """One domain's chart (reward and pass rate per step, its family's reward) and held-out cells."""
        with self._lock:
            if not any(name in run_domains(run) for run in self.runs):
                return None
            rows = [row for run in self.runs for row in heldout_domain_rows(run, name)]
            return {"figure": figure_json(domain_chart(self.runs, name)),
                    "heldout": {"columns": ["run", "effort", "held-out before -> after"], "rows": rows}}

    def samples(self, params: dict[str, str]) -> dict[str, Any]:
        with self._lock:
            return find_samples(self.runs, SampleQuery.parse(params))

    def sample(self, run: str, uid: str) -> dict[str, Any] | None:
        with self._lock:
            return find_sample(self.runs, run, uid)


class Handler(BaseHTTPRequestHandler):
    dashboard: Dashboard  # set on the subclass `serve` makes

    def do_GET(self) -> None:  # noqa: N802 - the http.server API
        url = urlparse(self.path)
        params = {k: v[-1] for k, v in parse_qs(url.query).items()}
        try:
            if url.path == "/":
                self._send(HTTPStatus.OK, (STATIC / "index.html").read_bytes(), CONTENT_TYPES[".html"])
            elif url.path == "/static/plotly.min.js":
                self._send(HTTPStatus.OK, plotly_js(), CONTENT_TYPES[".js"], cache=True)
            elif url.path in ("/static/app.js", "/static/style.css"):
                name = url.path.rsplit("/", 1)[1]
                self._send(HTTPStatus.OK, (STATIC / name).read_bytes(), CONTENT_TYPES[Path(name).suffix])
            elif url.path == "/api/state":
                version = self.dashboard.refresh()
                if params.get("since") == str(version):
                    self._json({"version": version})
                else:
                    self._send(HTTPStatus.OK, self.dashboard.state(), "application/json")
            elif url.path == "/api/samples":
                self._json(self.dashboard.samples(params))
            elif url.path == "/api/domain":
                found = self.dashboard.domain(params.get("name", ""))
                if found is None:
                    self._json({"error": f"no domain {params.get('name', '')!r} in these runs"}, HTTPStatus.NOT_FOUND)
                else:
                    self._json(found, cls=PlotlyJSONEncoder)
            elif url.path == "/api/sample":
                found = self.dashboard.sample(params.get("run", ""), params.get("uid", ""))
                if found is None:
                    self._json({"error": "no such sample (it may have left the recent window)"}, HTTPStatus.NOT_FOUND)
                else:
                    self._json({"sample": found})
            else:
                self._json({"error": f"no such page: {url.path}"}, HTTPStatus.NOT_FOUND)
        except QueryError as exc:
            self._json({"error": str(exc)}, HTTPStatus.BAD_REQUEST)
        except (BrokenPipeError, ConnectionResetError):
            pass  # the page went away mid-answer

    def _json(self, obj: Any, status: HTTPStatus = HTTPStatus.OK, cls: type[json.JSONEncoder] | None = None) -> None:
        self._send(status, json.dumps(obj, default=None if cls else str, cls=cls).encode(), "application/json")

    def _send(self, status: HTTPStatus, body: bytes, content_type: str, cache: bool = False) -> None:
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        self.send_header("Cache-Control", "max-age=3600" if cache else "no-store")
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - quiet: one poll a second
        pass


def make_server(dashboard: Dashboard, host: str = "127.0.0.1", port: int = 8050) -> ThreadingHTTPServer:
    """A server for `dashboard` on host:port (port 0: any free port; see `server_address`)."""
    handler = type("DashboardHandler", (Handler,), {"dashboard": dashboard})
    try:
        server = ThreadingHTTPServer((host, port), handler)
    except OSError as exc:
        raise DashboardError(f"cannot listen on {host}:{port} ({exc.strerror or exc}); pick another --port") from None
    server.daemon_threads = True
    return server
