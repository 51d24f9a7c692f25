"""The dashboard's web server (docs/DESIGN.md §5, §6): the page, the runs' data, live updates, and
two controls of the run being trained.

    GET  /                     scripts/live-loss-dashboard.html
    GET  /api/runs             [{"id", "name"}] of the runs served (one, or a directory's)
    GET  /api/state?run=ID     a run's state (as in <name>.state.json)
    GET  /api/samples?run=ID   the samples of the current phase
    GET  /api/records?run=ID&from=i&limit=n   loss-log records i.. as {"next","total","records"}
    GET  /api/stream?run=ID&from=i   Server-Sent Events: "records" (id = index after the last record
                               sent, so a reconnecting EventSource resumes where it stopped),
                               "state", "samples" whenever they change
    GET  /files/               the served directory's JSON files; GET /files/<path> one of them
    POST /api/checkpoint       checkpoint now (SIGUSR1)      } the run being trained only
    POST /api/stop             checkpoint and stop (SIGTERM) }

`run` may be left out when one run is served. Every request but the page itself needs the token
(header X-Run-Token, or ?token= where a header cannot be set: EventSource, links); when the server
is bound to anything but loopback, the page needs it too. The token is kept in the served directory
(TOKEN_FILE, owner-only), so it outlives a launch: a tab left open keeps working after a relaunch.
`--serve DIR` keeps its own (VIEWER_TOKEN_FILE), so that serving a run's own directory read-only
hands out no token that can stop the run.

No wildcard CORS: only a page opened from disk (origin "null", or "file://") is allowed to read,
and only with the token. A request that names another site's page as its Origin is refused even
with the token: a token that leaked (a pasted URL) cannot simply be used from a page elsewhere.
The Host header must name this machine (a loopback name, an IP literal, or this host's name), so
a page cannot reach the server through DNS rebinding.

Resources are bounded so that no client can slow training: at most MAX_CONNECTIONS connections
(one thread each), MAX_STREAMS live streams, one message of at most STREAM_CHUNK records (and
MESSAGE_BYTES) buffered per stream, and a client that does not take its data, or send a
request's head, within SEND_TIMEOUT_SECONDS, or goes on sending for longer after its answer, is
dropped. The engine's output is read by the proxy's own threads, which never wait on a client.
"""
import base64
import contextlib
import hashlib
import hmac
import ipaddress
import json
import logging
import os
import resource
import secrets
import select
import signal
import socket
import stat
import sys
import threading
import time

from flask import Flask, Response, abort, jsonify, request, send_file
from werkzeug.exceptions import HTTPException
from werkzeug.serving import ThreadedWSGIServer, WSGIRequestHandler

from microgpt.atomic import open_new
from microgpt.cli import say
from microgpt.run_dir import TOKEN_FILE, VIEWER_TOKEN_FILE
from microgpt.run_view import RunDirectory, ServedDir

HERE = os.path.dirname(os.path.abspath(__file__))
DASHBOARD = os.path.join(os.path.dirname(HERE), "scripts", "live-loss-dashboard.html")
CHUNK = 20000  # records per /api/records answer at most
STREAM_CHUNK = 5000  # records per stream message: catches up fast, bounds each stream's buffer
# bytes of records per answer or message at most (and one record more): a log of records of
# megabytes each (not the proxy's, whose are hundreds of bytes) made each answer gigabytes in memory
MESSAGE_BYTES = 1 << 23
POLL_SECONDS = 0.2
PING_SECONDS = 15
MAX_CONNECTIONS = 64
MAX_STREAMS = 16
SEND_TIMEOUT_SECONDS = 10
LOOPBACK = ("127.0.0.1", "localhost", "::1")
FILE_ORIGINS = ("null", "file://")  # how browsers name a page opened from disk


def is_loopback(host):
    """Only these binds keep the server on this machine: 127.0.0.2 is reachable by other users'
    containers and namespaces that share lo, and 0.0.0.0 by the network."""
    return host in LOOPBACK


# ---------------------------------------------------------------------------------------------------
# The token


def load_token(directory, name=TOKEN_FILE):
    """The dashboard token kept in `directory` as `name`, created on first use: a file only its
    owner can read. Where it cannot be kept (a read-only directory), a token for this process
    only, with a warning."""
    path = os.path.join(directory, name)
    token = _read_token(path)
    if token:
        return token
    token = secrets.token_urlsafe(18)
    try:
        _write_token(path, token)
    except FileExistsError:  # another process made one meanwhile: use that one
        token = _read_token(path) or token
    except OSError as e:
        say(f"warning: cannot keep the dashboard token in {path} ({e.strerror or e}): this token lasts "
            "as long as this process")
    return token


def _read_token(path):
    """The token kept at path, if it is a file of ours that nobody else can read; else None. One
    that others could read is no secret: it is removed (and a new one made)."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return None
    if stat.S_ISREG(st.st_mode) and st.st_uid == os.getuid() and not st.st_mode & 0o077:
        # bytes: a file damaged into something that is no UTF-8 was a UnicodeDecodeError, a
        # traceback at every start; a token is ASCII (it goes in a header), anything else is no token
        with open(path, "rb") as f:
            token = f.read(1024).decode("ascii", "replace").strip()
        if len(token) >= 16 and token.replace("-", "").replace("_", "").isalnum():
            return token
    say(f"warning: {path} was not an owner-only token file; making a new token")
    try:
        os.unlink(path)
    except OSError:
        pass
    return None


def _write_token(path, token):
    """Written whole, owner-only from its first byte, and never over a token another process
    kept meanwhile (os.link refuses to replace: FileExistsError). The temp name is foreseeable:
    atomic.open_new removes whatever holds it and creates the file afresh, so a planted link or
    file never receives the secret."""
    tmp = f"{path}.{os.getpid()}.tmp"
    try:
        with open_new(tmp, "wb", 0o600) as f:
            f.write((token + "\n").encode())
            f.flush()
            os.fsync(f.fileno())
        os.link(tmp, path)
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)


# ---------------------------------------------------------------------------------------------------
# What is served: the run being trained, or a directory of runs (read-only, see run_view.py)


class TrainedRun:
    """The training proxy's own run (training_proxy.Run): one run, with controls."""

    controllable = True

    def __init__(self, run):
        self.run, self.root = run, ServedDir(run.dir)

    def close(self):
        self.root.close()

    def listing(self):
        return [{"id": self.run.name, "name": self.run.name, "controls": True}]

    def get(self, run_id):
        return self.run if run_id in (None, self.run.name) else None


def create_app(served, bind_host, token):
    app = Flask(__name__)
    # a path one slash off a route is that route, or no route: never a redirect, whose HTML page
    # (which Flask sends past plain_error) echoes the URL asked for, token and all
    app.url_map.strict_slashes = app.url_map.merge_slashes = False
    exposed = not is_loopback(bind_host)
    # this machine's names, looked up once (getfqdn may wait on DNS)
    own_names = {socket.gethostname().lower(), socket.getfqdn().lower()} if exposed else set()
    streams = threading.BoundedSemaphore(MAX_STREAMS)

    @app.before_request
    def guard():
        if not _host_allowed(request.host, exposed, own_names):
            abort(403, "the Host header must name this machine")
        # this server's origin as a browser spells it; not request.host_url, which parses the
        # port: a Host of localhost:99999 was a 500, with a traceback on the proxy's terminal
        if not _origin_allowed(request.headers.get("Origin"), f"{request.scheme}://{request.host}"):
            abort(403, "requests from another site's page are refused")
        if request.method == "OPTIONS" or (request.path == "/" and not exposed):
            return  # a CORS preflight; the page itself holds no data and asks for the token
        given = request.headers.get("X-Run-Token") or request.args.get("token", "")
        if not hmac.compare_digest(given.encode(), token.encode()):
            abort(403, "this needs the dashboard's token: open the URL the proxy printed "
                       "(…/?token=…)")

    @app.after_request
    def headers(resp):
        origin = request.headers.get("Origin")
        if origin in FILE_ORIGINS:  # the dashboard opened from disk
            resp.headers["Access-Control-Allow-Origin"] = origin
            resp.headers["Access-Control-Allow-Headers"] = "X-Run-Token"
            resp.headers["Access-Control-Allow-Methods"] = "GET, POST"
        resp.headers["Vary"] = "Origin"
        resp.headers["Cache-Control"] = "no-store"
        resp.headers["X-Content-Type-Options"] = "nosniff"
        resp.headers["Referrer-Policy"] = "no-referrer"  # the token is in the page's URL
        return resp

    def the_run():
        run_id = request.args.get("run")
        run = served.get(run_id)
        if run is None and run_id is None:  # several runs served (or none yet): say which is meant
            abort(404, "name the run with ?run=ID (GET /api/runs lists the runs served)")
        if run is None:
            abort(404, "no such run")
        return run

    @app.errorhandler(HTTPException)
    def plain_error(e):  # a short JSON answer, never an HTML page that echoes the request
        return jsonify(error=e.description), e.code

    @app.get("/")
    def dashboard():
        with open(DASHBOARD, "rb") as f:
            page = f.read()
        return Response(page, mimetype="text/html", headers={"Content-Security-Policy": _page_policy(page)})

    @app.get("/api/runs")
    def runs():
        return jsonify(served.listing())

    @app.get("/api/state")
    def state():
        return jsonify(the_run().state)

    @app.get("/api/samples")
    def samples():
        return jsonify(the_run().samples)

    @app.get("/api/records")
    def records():
        run = the_run()
        first = _int_arg("from", 0)
        limit = min(_int_arg("limit", CHUNK), CHUNK)
        return Response(_records_message(run.log, first, limit)[0], mimetype="application/json")

    @app.get("/api/stream")
    def stream():
        run = the_run()
        first = _int_arg("from", 0)
        last_id = request.headers.get("Last-Event-ID", "")
        if _is_index(last_id):  # EventSource reconnecting after a drop
            first = int(last_id)
        if not streams.acquire(blocking=False):
            abort(503, f"too many live streams (at most {MAX_STREAMS}): close other dashboards")
        events = _events(run, first, request.environ["werkzeug.socket"])
        resp = Response(events, mimetype="text/event-stream", headers={"X-Accel-Buffering": "no"})
        resp.call_on_close(streams.release)  # however the stream ends, even before its first byte
        return resp

    @app.get("/files/")
    def file_list():
        found = []
        for d, _dirs, names in served.root.walk():  # from the directory opened at the start
            found += [os.path.join(d, n) for n in names if n.endswith(".json")]
        return jsonify(sorted(found))

    @app.get("/files/<path:rel>")
    def run_file(rel):
        # opened once, where the check found it (ServedDir.open): a file swapped for a link or a FIFO
        # after a check by name would be served from outside, or hold the request for ever
        if not rel.endswith(".json"):
            abort(404)
        try:
            fd = served.root.open(rel, ".json")
        except OSError:
            abort(404)
        return send_file(os.fdopen(fd, "rb"), mimetype="application/json")

    def control(action, sig):
        if not served.controllable:
            abort(405, "this server only shows runs")
        os.kill(os.getpid(), sig)  # the proxy's own handler forwards it to the engine
        return jsonify(ok=True, action=action), 202

    app.post("/api/checkpoint")(lambda: control("checkpoint", signal.SIGUSR1))
    app.post("/api/stop", endpoint="stop")(lambda: control("stop", signal.SIGTERM))
    return app


def _page_policy(page):
    """The page may run its own script and nothing else (the script's hash), and talk only to this
    server: even a text that slipped into the page as HTML could not run or send anything."""
    script = page.split(b"<script>", 1)[1].split(b"</script>", 1)[0]
    digest = base64.b64encode(hashlib.sha256(script).digest()).decode()
    return (f"default-src 'none'; script-src 'sha256-{digest}'; style-src 'unsafe-inline'; "
            "connect-src 'self'; img-src data:; base-uri 'none'; form-action 'none'; "
            "frame-ancestors 'none'")


def _host_allowed(host_header, exposed, own_names):
    """The Host header's name (port dropped) is a loopback name, or, when bound beyond loopback,
    an IP literal or one of own_names: never a name someone else's DNS can point here."""
    name = host_header[1:].split("]")[0] if host_header.startswith("[") else host_header.rsplit(":", 1)[0]
    if name in LOOPBACK:
        return True
    if not exposed:
        return False
    try:
        ipaddress.ip_address(name)
        return True
    except ValueError:
        return name.lower() in own_names


def _origin_allowed(origin, own_origin):
    """No Origin (a same-origin read, curl), this server's own origin (the page it served, whose
    buttons POST), or a page opened from disk. Browsers name the page behind every cross-site
    request, so a page elsewhere holding a leaked token is refused; though not from a sandboxed
    frame, which is origin "null" too, so the token stays the gate."""
    return origin is None or origin in FILE_ORIGINS or origin == own_origin


INDEX_DIGITS = 18  # any record index fits; int() refuses strings of over 4300 digits


def _is_index(text):
    """Plain ASCII digits only, and not too many: str.isdigit() also accepts "²", and int() refuses
    a 5000-digit string; either would be a 500 instead of a clean 400."""
    return text.isascii() and text.isdigit() and len(text) <= INDEX_DIGITS


def _int_arg(name, default):
    value = request.args.get(name, str(default))
    if not _is_index(value):
        abort(400, f"{name} must be a non-negative integer")
    return int(value)


def _records_message(log, first, limit):
    """({"next","total","records"} as bytes, next): raw bytes from the log, never parsed here."""
    body, nxt = log.read_json(first, limit, MESSAGE_BYTES)
    # One record per line on disk; a message is one line (SSE data may not contain newlines, and
    # records never do: json.dumps escapes them).
    msg = b'{"next":%d,"total":%d,"records":' % (nxt, len(log)) + body.replace(b"\n", b"") + b"}"
    return msg, nxt


def _events(run, cursor, sock):
    """The live stream: everything from cursor on, then whatever is new, as it appears. One message
    is built at a time, and only once the previous one was handed to the socket: a client that
    does not read costs one message and its socket buffer, until the send timeout drops it. A
    client that closes its connection (sock) ends the stream at once, not at the next write."""
    seen_state = seen_samples = None
    last_sent = time.monotonic()
    while True:
        out = []
        total = len(run.log)
        if cursor != total:
            # past the end: the log was replaced by a shorter one (moved away and started anew), so
            # it is sent from its first record, a page the client sees start before its cursor
            msg, cursor = _records_message(run.log, cursor if cursor < total else 0, STREAM_CHUNK)
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
        if cursor >= len(run.log) and _client_gone(sock, POLL_SECONDS):
            return


def _client_gone(sock, seconds):
    """Waits `seconds`; True if the client closed its connection meanwhile. Without this, a stream
    with nothing new to send noticed a client gone only when a ping failed, PING_SECONDS later,
    and kept its slot (one of MAX_STREAMS) that long: a page of several finished runs, reloaded a
    few times, was refused as "too many live streams"."""
    poller = select.poll()  # not select.select, which refuses a descriptor over 1023
    poller.register(sock, select.POLLIN)
    if not poller.poll(seconds * 1000):
        return False
    try:
        if sock.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT) == b"":
            return True  # end of file: the client closed
    except BlockingIOError:
        return False
    except OSError:
        return True  # reset
    time.sleep(seconds)  # bytes the client sent after its request: not an end, and no busy loop
    return False


# ---------------------------------------------------------------------------------------------------
# The HTTP server


class _RequestHandler(WSGIRequestHandler):
    timeout = SEND_TIMEOUT_SECONDS  # on every send and receive: a client that stalls is dropped

    def handle_one_request(self):
        """The timeout bounds each receive, not a request: a client sending its head a line at a
        time, each within the timeout, would keep its connection (and one of MAX_CONNECTIONS)
        for ever. So the whole head, or an idle keep-alive wait, must come within the timeout."""
        self.server.heads.arm(self.connection, self.timeout)
        try:
            super().handle_one_request()
        finally:
            self.server.heads.disarm(self.connection)

    def parse_request(self):
        ok = super().parse_request()  # reads the headers
        self.server.heads.disarm(self.connection)
        return ok

    def log_request(self, *args):  # no line per request
        pass

    def log_error(self, *args):
        """Nor per malformed request (http.server's send_error: a bad request line, a path too
        long, too many headers): any local client, without the token, could add lines to the
        proxy's terminal or log without end. An error in the app is still said (server.log)."""


class _HeadDeadlines:
    """Connections whose request head is still coming (or whose answer is sent), each with the time
    by which it must have come (or the client have stopped sending); one thread, for all of them,
    drops those that are late."""

    def __init__(self):
        self.due, self.lock, self.stopped = {}, threading.Lock(), threading.Event()
        threading.Thread(target=self._drop_late, daemon=True).start()

    def arm(self, conn, seconds):
        with self.lock:
            self.due[conn] = time.monotonic() + seconds

    def disarm(self, conn):
        with self.lock:
            self.due.pop(conn, None)

    def _drop_late(self):
        while not self.stopped.wait(0.1):
            now = time.monotonic()
            with self.lock:
                late = [conn for conn, due in self.due.items() if due < now]
                for conn in late:
                    del self.due[conn]
            for conn in late:
                try:
                    conn.shutdown(socket.SHUT_RDWR)  # the handler's blocked read returns
                except OSError:
                    pass


class _BoundedServer(ThreadedWSGIServer):
    """werkzeug's threaded server, with at most MAX_CONNECTIONS connections (and so threads) at a
    time: one more is answered 503 and closed at once, without a thread."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.slots = threading.BoundedSemaphore(MAX_CONNECTIONS)
        self.heads = _HeadDeadlines()
        self.app = self._bounded_drain(self.app)

    def _bounded_drain(self, app):
        """Once a response is sent, werkzeug reads and throws away whatever else the client sends
        (so that it sees the answer rather than a reset), up to 10 GB, each read within the
        timeout: a client sending a byte now and then after its request (no token needed: a 403
        is a response too) kept its connection for ever, and 64 of them shut every dashboard out.
        So what follows a response must end within the timeout, as a request head must."""
        def serve(environ, start_response):
            body = app(environ, start_response)
            try:
                for data in body:  # not `yield from`, which would close body too: twice
                    yield data
                self.heads.arm(environ["werkzeug.socket"], self.RequestHandlerClass.timeout)
            finally:
                if hasattr(body, "close"):
                    body.close()
        return serve

    def process_request(self, request, client_address):
        if not self.slots.acquire(blocking=False):
            try:
                request.setblocking(False)
                request.send(b"HTTP/1.1 503 Service Unavailable\r\nContent-Length: 0\r\n"
                             b"Connection: close\r\n\r\n")
            except OSError:
                pass
            self.shutdown_request(request)
            return
        super().process_request(request, client_address)

    def process_request_thread(self, request, client_address):
        try:
            super().process_request_thread(request, client_address)
        finally:
            self.slots.release()


def _bind(host, port):
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    return socket.create_server((host, port), family=family, backlog=64)


class Server:
    def __init__(self, httpd, host, served, token):
        self.httpd, self.served, self.token = httpd, served, token
        shown = f"[{host}]" if ":" in host else host
        self.url = f"http://{shown}:{httpd.socket.getsockname()[1]}/"
        self.thread = threading.Thread(target=httpd.serve_forever, daemon=True)

    def shutdown(self):
        self.httpd.shutdown()
        self.httpd.heads.stopped.set()
        self.served.close()  # the served directory's descriptor: nothing under it is served any more


def exposure_warning(host, port):
    """Said loudly when the server is reachable beyond loopback."""
    bar = "!" * 78
    return (f"{bar}\nWARNING: --host {host} is not loopback: anyone who can reach this machine on "
            f"port {port} can connect.\nEvery request needs the token in the printed URL, but the "
            "traffic is plain HTTP: anyone on the\nway can read the token and the run. Prefer the "
            f"default host and a tunnel:\n    ssh -L {port}:127.0.0.1:{port} THIS-MACHINE\n{bar}")


def start(served, host, port, default_port, token):
    """Serve in a background thread; port None means default_port, or any free port if taken."""
    logging.getLogger("werkzeug").setLevel(logging.ERROR)
    app = create_app(served, host, token)
    try:
        sock = _bind(host, default_port if port is None else port)
    except OSError:
        if port is not None:
            raise
        sock = _bind(host, 0)
    # werkzeug would print and sys.exit() on a bind error, so the socket is bound here instead.
    httpd = _BoundedServer(host, sock.getsockname()[1], app, handler=_RequestHandler,
                           fd=sock.fileno())
    sock.close()  # the server holds its own duplicate of the descriptor
    server = Server(httpd, host, served, token)
    if not is_loopback(host):
        print(exposure_warning(host, httpd.socket.getsockname()[1]), file=sys.stderr, flush=True)
    server.thread.start()
    return server


def start_for_run(run, host, port, default_port):
    """The training proxy's server: its run, with the run directory's token."""
    return start(TrainedRun(run), host, port, default_port, load_token(run.dir))


def start_for_directory(root, host, port, default_port):
    """`--serve DIR`: every run under DIR, read-only, with DIR's viewer token: never the token of
    a run trained in DIR itself, which would let a viewer stop that run."""
    _raise_open_files_limit()
    return start(RunDirectory(root), host, port, default_port, load_token(root, VIEWER_TOKEN_FILE))


def _raise_open_files_limit():
    """Every run served keeps its loss log open (run_view.LogFollower), so a directory of a thousand
    runs took every descriptor of the usual soft limit (1024): the runs past it were shown without
    records, with a warning that they could not be read, and connections failed. The soft limit is
    raised to the hard one (as Go's runtime does for every program); descriptors past 1023 are fine
    here, nothing uses select.select."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != hard:
        with contextlib.suppress(ValueError, OSError):  # an unlimited hard limit, which Linux refuses
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
