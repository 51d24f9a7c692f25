"""The proxy's web server (SPEC §5): the dashboard, the run's data, live updates, and two controls.

    GET  /                     scripts/live-loss-dashboard.html
    GET  /api/state            the run's state (as in <name>.state.json)
    GET  /api/samples          the samples of the current phase
    GET  /api/records?from=i&limit=n   loss-log records i.. as {"next","total","records"}
    GET  /api/stream?from=i    Server-Sent Events: "records" (id = index after the last record sent,
                               so a reconnecting EventSource resumes where it stopped), "state",
                               "samples" whenever they change
    GET  /files/               the run directory's JSON files; GET /files/<path> one of them
    POST /api/checkpoint       checkpoint now (SIGUSR1)            } header X-Run-Token: <token>
    POST /api/stop             checkpoint and stop (SIGTERM)      } (printed with the URL)

The cursor is a record index, not a step: steps repeat after a resume, indices never do. Read-only
endpoints allow any origin, so the dashboard opened from disk can use them; nothing outside the run
directory is reachable, and only JSON files inside it. On a loopback address the Host header must be
a loopback name too, so a web page cannot reach the server through DNS rebinding.
"""
import hmac
import json
import logging
import os
import signal
import socket
import threading
import time

from flask import Flask, Response, abort, jsonify, request, send_file
from werkzeug.serving import make_server

HERE = os.path.dirname(os.path.abspath(__file__))
DASHBOARD = os.path.join(os.path.dirname(HERE), "scripts", "live-loss-dashboard.html")
CHUNK = 20000  # records per message: big enough to catch up fast, small enough to parse smoothly
POLL_SECONDS = 0.2
PING_SECONDS = 15
LOOPBACK = ("127.0.0.1", "localhost", "::1")


def create_app(run, bind_host):
    app = Flask(__name__)

    @app.before_request
    def check_host():
        if bind_host in LOOPBACK:
            host = request.host.rsplit(":", 1)[0] if not request.host.endswith("]") else request.host
            if host.strip("[]") not in LOOPBACK:
                abort(403, "Host must be a loopback name")

    @app.after_request
    def headers(resp):
        resp.headers["Access-Control-Allow-Origin"] = "*"
        resp.headers["Access-Control-Allow-Headers"] = "X-Run-Token"
        resp.headers["Cache-Control"] = "no-store"
        return resp

    @app.get("/")
    def dashboard():
        return send_file(DASHBOARD, mimetype="text/html")

    @app.get("/api/state")
    def state():
        return jsonify(run.state)

    @app.get("/api/samples")
    def samples():
        return jsonify(run.samples)

    @app.get("/api/records")
    def records():
        first = _int_arg("from", 0)
        limit = min(_int_arg("limit", CHUNK), CHUNK * 10)
        return Response(_records_message(run.log, first, limit)[0], mimetype="application/json")

    @app.get("/api/stream")
    def stream():
        first = _int_arg("from", 0)
        last_id = request.headers.get("Last-Event-ID", "")
        if _is_index(last_id):  # EventSource reconnecting after a drop
            first = int(last_id)
        return Response(_events(run, first), mimetype="text/event-stream",
                        headers={"X-Accel-Buffering": "no"})

    @app.get("/files/")
    def file_list():
        root = os.path.realpath(run.dir)
        found = []
        for d, _dirs, names in os.walk(root):
            found += [os.path.relpath(os.path.join(d, n), root) for n in names if n.endswith(".json")]
        return jsonify(sorted(found))

    @app.get("/files/<path:rel>")
    def run_file(rel):
        path = _inside(run.dir, rel)
        if path is None or not path.endswith(".json") or not os.path.isfile(path):
            abort(404)
        return send_file(path, mimetype="application/json")

    @app.post("/api/checkpoint")
    def checkpoint():
        _require_token(run.token)
        os.kill(os.getpid(), signal.SIGUSR1)  # the proxy's own handler forwards it
        return jsonify(ok=True, action="checkpoint"), 202

    @app.post("/api/stop")
    def stop():
        _require_token(run.token)
        os.kill(os.getpid(), signal.SIGTERM)
        return jsonify(ok=True, action="stop"), 202

    return app


def _is_index(text):
    """Plain ASCII digits only: str.isdigit() also accepts "²", which int() then refuses."""
    return text.isascii() and text.isdigit()


def _int_arg(name, default):
    value = request.args.get(name, str(default))
    if not _is_index(value):
        abort(400, f"{name} must be a non-negative integer")
    return int(value)


def _require_token(token):
    given = request.headers.get("X-Run-Token", "")
    if not hmac.compare_digest(given.encode(), token.encode()):
        abort(403, "this action needs the run's token (header X-Run-Token)")


def _inside(root, rel):
    """The real path of rel under root, or None if it leaves root (.., absolute, symlink)."""
    root = os.path.realpath(root)
    path = os.path.realpath(os.path.join(root, rel))
    return path if os.path.commonpath([root, path]) == root and path != root else None


def _records_message(log, first, limit):
    """({"next","total","records"} as bytes, next): raw bytes from the log, never parsed here."""
    body, nxt = log.read_json(first, limit)
    # One record per line on disk; a message is one line (SSE data may not contain newlines, and
    # records never do: json.dumps escapes them).
    msg = b'{"next":%d,"total":%d,"records":' % (nxt, len(log)) + body.replace(b"\n", b"") + b"}"
    return msg, nxt


def _events(run, cursor):
    """The live stream: everything from cursor on, then whatever is new, as it appears."""
    seen_state = seen_samples = None
    last_sent = time.monotonic()
    while True:
        out = []
        if cursor < len(run.log):
            msg, cursor = _records_message(run.log, cursor, CHUNK)
            out.append(b"id: %d\nevent: records\ndata: " % cursor + msg + b"\n\n")
        if run.state_version != seen_state:
            seen_state = run.state_version
            out.append(b"event: state\ndata: " + json.dumps(run.state).encode() + b"\n\n")
        if run.samples_version != seen_samples:
            seen_samples = run.samples_version
            out.append(b"event: samples\ndata: " + json.dumps(run.samples).encode() + b"\n\n")
        now = time.monotonic()
        if not out and now - last_sent > PING_SECONDS:
            out.append(b": ping\n\n")  # a write is how a dropped client is noticed
        if out:
            last_sent = now
            yield b"".join(out)
        if cursor >= len(run.log):
            time.sleep(POLL_SECONDS)


def _bind(host, port):
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    return socket.create_server((host, port), family=family, backlog=64)


class Server:
    def __init__(self, httpd, host):
        self.httpd = httpd
        shown = f"[{host}]" if ":" in host else host
        self.url = f"http://{shown}:{httpd.socket.getsockname()[1]}/"
        self.thread = threading.Thread(target=httpd.serve_forever, daemon=True)

    def shutdown(self):
        self.httpd.shutdown()


def start(run, host, port, default_port):
    """Serve in a background thread; port None means default_port, or any free port if taken."""
    logging.getLogger("werkzeug").setLevel(logging.ERROR)  # no line per request
    app = create_app(run, host)
    try:
        sock = _bind(host, default_port if port is None else port)
    except OSError:
        if port is not None:
            raise
        sock = _bind(host, 0)
    # werkzeug would print and sys.exit() on a bind error, so the socket is bound here instead.
    httpd = make_server(host, sock.getsockname()[1], app, threaded=True, fd=sock.fileno())
    sock.close()  # werkzeug holds its own duplicate of the descriptor
    server = Server(httpd, host)
    server.thread.start()
    return server
