"""The dashboard's server (docs/DESIGN.md §5) against an adversary: the token on every read, no
wildcard CORS, the Host check beyond loopback, bounded connections and streams, stalled clients
dropped, a NUL in a path; and `--serve DIR` following runs on disk. Most tests serve a directory of
runs in this process (microgpt/run_view.py); one runs the real proxy and CPU engine."""
import contextlib
import errno
import itertools
import json
import os
import shutil
import signal
import socket
import stat
import subprocess
import sys
import threading
import time

import pytest
import requests

from proxy_util import PROXY, Proxy, ProxyFixtureDir, proxy_env

from microgpt import proxy_server, run_view
from microgpt.loss_log import LossLog


def make_run(root, name, n, state=None):
    """A run directory root/name with n train records, a state and samples."""
    d = root / name
    d.mkdir(parents=True, exist_ok=True)
    log = LossLog(str(d / f"{name}.loss.json"))
    log.append([{"step": i, "loss": 5.0 / i ** 0.3, "lr": 1e-3, "grad_norm": 1.0, "tokens": 64 * i,
                 "elapsed": 0.01 * i, "tokens_per_s": 6400.0} for i in range(1, n + 1)])
    (d / f"{name}.state.json").write_text(json.dumps(state or {"name": name, "status": "finished",
                                                               "step": n, "steps": n}))
    (d / f"{name}.samples.json").write_text(json.dumps([{"step": n, "prompt": "A", "text": "bc"}]))
    return log


@pytest.fixture
def served_dir(tmp_path):
    """`--serve DIR` on two runs, in this process: (server, root)."""
    root = tmp_path / "runs"
    make_run(root, "alpha", 300)
    make_run(root, "beta", 200)
    server = proxy_server.start_for_directory(str(root), "127.0.0.1", 0, None)
    yield server, root
    server.shutdown()


def get(server, path, token=True, **kw):
    headers = kw.pop("headers", {})
    if token:
        headers["X-Run-Token"] = server.token
    return requests.get(server.url + path, headers=headers, timeout=10, **kw)


def test_every_read_needs_the_token(served_dir):
    server, _ = served_dir
    reads = ["api/runs", "api/state?run=alpha/alpha", "api/samples?run=alpha/alpha",
             "api/records?run=alpha/alpha", "files/", "files/alpha/alpha.loss.json"]
    for path in reads:
        assert get(server, path, token=False).status_code == 403, path
        assert get(server, path, token=False, headers={"X-Run-Token": "x" * 24}).status_code == 403, path
        assert get(server, path).status_code == 200, path
        # ?token= works where a header cannot be set (EventSource)
        sep = "&" if "?" in path else "?"
        assert get(server, f"{path}{sep}token={server.token}", token=False).status_code == 200, path
    stream = get(server, "api/stream?run=alpha/alpha", token=False, stream=True)
    assert stream.status_code == 403
    # The page itself holds no data (on loopback it loads and asks for the token).
    page = get(server, "", token=False)
    assert page.status_code == 200 and "<canvas" in page.text


def test_a_read_without_run_among_several_says_to_name_one(served_dir):
    """`run` may be left out when one run is served; with several, a read without it answered "no
    such run", as if the runs were missing, not that one must be named."""
    server, _ = served_dir
    for path in ("api/state", "api/samples", "api/records"):
        r = get(server, path)
        assert r.status_code == 404 and "?run=" in r.json()["error"] and "api/runs" in r.json()["error"], path
    assert get(server, "api/state?run=gamma/gamma").json()["error"] == "no such run"


def test_no_wildcard_cors(served_dir):
    server, _ = served_dir
    # Another site's page is refused even with the token (one that leaked, say in a pasted URL).
    for origin in ("http://evil.example", "https://127.0.0.1.evil.example", "http://localhost:1",
                   server.url.replace("http:", "https:").rstrip("/")):
        r = get(server, "api/state?run=alpha/alpha", headers={"Origin": origin})
        assert r.status_code == 403 and "another site" in r.json()["error"], origin
        assert "Access-Control-Allow-Origin" not in r.headers, origin
    # The page the server itself served names the server as its Origin (its buttons POST so).
    own = get(server, "api/state?run=alpha/alpha", headers={"Origin": server.url.rstrip("/")})
    assert own.status_code == 200 and own.json()["name"] == "alpha"
    # A page opened from disk (origin "null", or "file://") may read, with the token like anyone else.
    for origin in ("null", "file://"):
        r = get(server, "api/state?run=alpha/alpha", headers={"Origin": origin})
        assert r.headers["Access-Control-Allow-Origin"] == origin and r.json()["name"] == "alpha"
    assert get(server, "api/state?run=alpha/alpha", token=False,
               headers={"Origin": "null"}).status_code == 403


def test_a_host_port_out_of_range_is_no_server_error(served_dir):
    """The Origin check built this server's URL by parsing the Host header's port: a port over
    65535 (any local client, no token needed) was a 500 and a traceback on the proxy's terminal."""
    server, _ = served_dir
    for host in ("localhost:99999", "127.0.0.1:65536", "[::1]:99999"):
        assert get(server, "api/runs", token=False, headers={"Host": host}).status_code == 403, host
        r = get(server, "api/runs", headers={"Host": host})
        assert r.status_code == 200 and r.json() == [{"id": "alpha/alpha", "name": "alpha"},
                                                     {"id": "beta/beta", "name": "beta"}], host


def test_the_page_may_run_only_its_own_script(served_dir):
    server, _ = served_dir
    policy = get(server, "").headers["Content-Security-Policy"]
    assert "script-src 'sha256-" in policy and "unsafe-inline" not in policy.split("script-src")[1].split(";")[0]
    assert "connect-src 'self'" in policy


def test_a_path_routing_would_redirect_is_answered_in_json_not_an_html_redirect(served_dir):
    """Flask answers a path one slash off a route (/files, api//runs) with a redirect whose HTML page
    echoes the URL asked for, token and all, past the JSON error handler (a routing redirect is not
    an error to Flask). Such paths are now the route itself, or a JSON 404."""
    server, _ = served_dir
    r = get(server, f"files?token={server.token}", token=False, allow_redirects=False)
    assert r.status_code == 200 and r.json() == sorted(r.json()), r.text
    r = get(server, f"api//runs?token={server.token}", token=False, allow_redirects=False)
    assert r.status_code == 404 and server.token not in r.text and "error" in r.json(), r.text


def test_a_nul_byte_in_a_file_path_is_a_clean_404(served_dir):
    server, _ = served_dir
    for path in ("files/%00", "files/alpha/alpha.loss.json%00", "files/%00/../../etc/passwd"):
        assert get(server, path).status_code == 404, path


def test_an_index_of_thousands_of_digits_is_a_clean_400(served_dir):
    """int() refuses strings of over 4300 digits: such a from=, limit= or Last-Event-ID was a 500."""
    server, _ = served_dir
    huge = "9" * 5000
    for path in (f"api/records?run=alpha/alpha&from={huge}", f"api/records?run=alpha/alpha&limit={huge}",
                 f"api/stream?run=alpha/alpha&from={huge}"):
        assert get(server, path).status_code == 400, path
    # a reconnecting stream's Last-Event-ID that is no index is ignored, as any other non-index is
    r = get(server, "api/stream?run=alpha/alpha", headers={"Last-Event-ID": huge}, stream=True)
    try:
        assert r.status_code == 200
    finally:
        r.close()
    assert get(server, "api/records?run=alpha/alpha&from=99999999999999999").json()["records"] == []


def test_the_token_is_stable_and_owner_only(tmp_path):
    root = tmp_path / "runs"
    make_run(root, "alpha", 5)
    tokens = []
    for _ in range(2):
        server = proxy_server.start_for_directory(str(root), "127.0.0.1", 0, None)
        tokens.append(server.token)
        server.shutdown()
    assert tokens[0] == tokens[1] and len(tokens[0]) >= 16
    path = root / proxy_server.VIEWER_TOKEN_FILE
    assert stat.S_IMODE(path.stat().st_mode) == 0o600 and path.stat().st_uid == os.getuid()
    path.chmod(0o644)  # readable by others: no longer a secret, so it is replaced
    assert proxy_server.load_token(str(root), proxy_server.VIEWER_TOKEN_FILE) != tokens[0]
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    # Not a file at all, in a directory that cannot take a new one: a token for this process only,
    # with a warning, never a traceback.
    path.unlink()
    path.mkdir()
    assert len(proxy_server.load_token(str(root), proxy_server.VIEWER_TOKEN_FILE)) >= 16 and path.is_dir()


def test_serving_a_run_directory_read_only_hands_out_no_token_that_stops_its_run(tmp_path):
    """`--serve` of a run's own directory used the training proxy's dashboard.token, and its page
    shows the token when bound beyond loopback: a viewer could stop the run with it."""
    root = tmp_path / "runs"
    make_run(root, "alpha", 5)
    run_dir = root / "alpha"
    trainer_token = proxy_server.load_token(str(run_dir))
    server = proxy_server.start_for_directory(str(run_dir), "127.0.0.1", 0, None)
    try:
        assert server.token != trainer_token
        assert (run_dir / proxy_server.TOKEN_FILE).read_text().strip() == trainer_token
        assert (run_dir / proxy_server.VIEWER_TOKEN_FILE).read_text().strip() == server.token
        assert get(server, "api/runs").status_code == 200
    finally:
        server.shutdown()


def test_a_token_file_that_is_no_text_is_replaced_not_a_traceback(tmp_path, capsys):
    """An owner-only token file damaged into bytes that are no UTF-8 was a UnicodeDecodeError at
    every start of the proxy or of --serve; it is no token, so it is replaced, as any other."""
    path = tmp_path / proxy_server.TOKEN_FILE
    path.write_bytes(b"\xff\xfe" + b"a" * 30 + b"\n")
    path.chmod(0o600)
    token = proxy_server.load_token(str(tmp_path))
    assert len(token) >= 16 and token.isascii() and path.read_text().strip() == token
    assert "making a new token" in capsys.readouterr().err


def test_a_link_planted_at_the_token_temp_name_is_not_written_through(tmp_path):
    """The token's temp name is foreseeable (TOKEN.PID.tmp): a link planted there must neither
    receive the secret nor leave it in a file others can read."""
    root = tmp_path / "runs"
    make_run(root, "alpha", 5)
    outside = tmp_path / "outside.txt"
    outside.write_text("untouched\n")
    outside.chmod(0o644)
    tmp = root / f"{proxy_server.TOKEN_FILE}.{os.getpid()}.tmp"
    tmp.symlink_to(outside)
    token = proxy_server.load_token(str(root))
    assert outside.read_text() == "untouched\n"
    path = root / proxy_server.TOKEN_FILE
    assert path.read_text().strip() == token and stat.S_IMODE(path.stat().st_mode) == 0o600
    assert not os.path.lexists(tmp)


def test_a_non_loopback_host_warns_and_needs_the_token_everywhere(tmp_path, capsys):
    root = tmp_path / "runs"
    make_run(root, "alpha", 5)
    server = proxy_server.start_for_directory(str(root), "127.0.0.2", 0, None)
    try:
        assert "WARNING: --host 127.0.0.2 is not loopback" in capsys.readouterr().err
        port = server.url.rstrip("/").rsplit(":", 1)[1]
        assert get(server, "", token=False).status_code == 403  # the page too
        assert get(server, "").status_code == 200
        for host in ("evil.example", "127.0.0.2.nip.io", f"attacker.example:{port}"):
            assert get(server, "api/runs", headers={"Host": host}).status_code == 403, host
        for host in (f"127.0.0.2:{port}", f"localhost:{port}", socket.gethostname()):
            assert get(server, "api/runs", headers={"Host": host}).status_code == 200, host
    finally:
        server.shutdown()


def test_the_served_directory_follows_runs_on_disk(served_dir):
    server, root = served_dir
    assert [r["name"] for r in get(server, "api/runs").json()] == ["alpha", "beta"]
    assert get(server, "api/records?run=beta/beta&from=198").json()["next"] == 200
    assert get(server, "api/records").status_code == 404  # two runs: say which
    # Another proxy appends and starts a run: both show up.
    log = LossLog(str(root / "beta" / "beta.loss.json"))
    log.append([{"step": 201, "loss": 1.0}])
    make_run(root, "gamma", 3)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        msg = get(server, "api/records?run=beta/beta&from=199").json()
        if msg["total"] == 201 and len(get(server, "api/runs").json()) == 3:
            break
        time.sleep(0.1)
    assert [r["step"] for r in msg["records"]] == [200, 201]
    assert get(server, "api/state?run=gamma/gamma").json()["name"] == "gamma"
    # Read-only: no controls.
    assert requests.post(server.url + "api/stop", headers={"X-Run-Token": server.token},
                         timeout=10).status_code == 405


def descriptors_of(path):
    """How many of this process's open descriptors are of `path` (as /proc names it)."""
    fds = [f"/proc/self/fd/{fd}" for fd in os.listdir("/proc/self/fd")]
    return sum(1 for fd in fds if os.path.islink(fd) and os.readlink(fd) == str(path))


def test_a_run_removed_or_renamed_is_no_more_listed_and_its_log_closed(served_dir):
    """The served directory kept every run it had found: one removed stayed listed, its records
    served and its log open (the disk space of a removed log held as long as the server ran), and
    one renamed was listed twice. Both now follow the directory."""
    server, root = served_dir
    assert get(server, "api/records?run=beta/beta").json()["total"] == 200
    log = root / "beta" / "beta.loss.json"
    held = descriptors_of(log)
    shutil.rmtree(root / "beta")
    (root / "alpha").rename(root / "delta")
    deadline = time.monotonic() + 30
    while [r["id"] for r in get(server, "api/runs").json()] != ["delta/alpha"]:
        assert time.monotonic() < deadline, get(server, "api/runs").json()
        time.sleep(0.1)
    assert get(server, "api/records?run=beta/beta").status_code == 404
    assert get(server, "api/records?run=delta/alpha").json()["total"] == 300
    assert descriptors_of(f"{log} (deleted)") == held - 1  # the server's; make_run's writer keeps its own


def first_stream_records(server, query, headers=None):
    """The first `records` message of a live stream: (event id, message)."""
    with requests.get(server.url + "api/stream?" + query, headers={"X-Run-Token": server.token, **(headers or {})},
                      stream=True, timeout=10) as r:
        event = {}
        for line in r.iter_lines():
            if not line and event.get("event") == "records":
                return int(event["id"]), json.loads(event["data"])
            if line:
                key, _, value = line.decode().partition(": ")
                event[key] = value
            else:
                event = {}


def test_a_stream_past_the_end_of_a_replaced_log_starts_it_over(served_dir):
    """A log moved away and started anew (PROXY.md's way out of a damaged one) holds fewer records
    than a page following it has seen: a reconnecting stream, from its last event id, sent nothing
    until the new log grew past that index, then its records from there on, as if they continued
    the old log. It sends the new log from its first record instead."""
    server, root = served_dir
    path = root / "alpha" / "alpha.loss.json"
    os.rename(path, str(path) + ".old")
    LossLog(str(path)).append([{"step": i, "loss": 9.0} for i in range(1, 11)])
    time.sleep(run_view.REFRESH_SECONDS + 0.05)
    for query, headers in (("run=alpha/alpha&from=300", None), ("run=alpha/alpha", {"Last-Event-ID": "300"})):
        event_id, msg = first_stream_records(server, query, headers)
        assert (event_id, msg["next"], msg["total"]) == (10, 10, 10)
        assert [r["step"] for r in msg["records"]] == list(range(1, 11))
    path.write_bytes(b"[\n]")  # no record at all: an empty page, from the start
    time.sleep(run_view.REFRESH_SECONDS + 0.05)
    assert first_stream_records(server, "run=alpha/alpha&from=10") == (0, {"next": 0, "total": 0, "records": []})


def test_a_state_file_of_the_wrong_type_is_served_as_empty(served_dir):
    server, root = served_dir
    (root / "alpha" / "alpha.state.json").write_text("null")
    (root / "alpha" / "alpha.samples.json").write_text('{"not": "a list"}')
    time.sleep(0.3)  # past run_view.REFRESH_SECONDS
    assert get(server, "api/state?run=alpha/alpha").json() == {}
    assert get(server, "api/samples?run=alpha/alpha").json() == []


def test_a_huge_state_file_is_served_as_empty_with_one_warning(served_dir, capsys):
    """Read whole, a 4 GB sparse state file took all the server's memory (a MemoryError, a 500 and
    a traceback), after which the state stayed empty until the file changed."""
    server, root = served_dir
    state = root / "alpha" / "alpha.state.json"
    with open(state, "r+b") as f:
        f.truncate(4 << 30)
    time.sleep(run_view.REFRESH_SECONDS + 0.05)
    for _ in range(2):
        r = get(server, "api/state?run=alpha/alpha")
        assert r.status_code == 200 and r.json() == {}
    assert [ln for ln in capsys.readouterr().err.splitlines() if "alpha.state.json" in ln] == \
        [f"warning: {state}: {4 << 30} bytes, more than a run's state or samples take ({run_view.JSON_FILE_MAX}); "
         "shown as empty"]


@pytest.mark.parametrize("damage, whole", [(b'"loss":}', 10), (b'"loss":NaN}', 10), (b'"loss":1}{"x":1}', 10),
                                           # valid JSON, each record alone too, but not the layout the
                                           # records are cut by: answers holding them were unparseable
                                           (b'"loss":1},', 10), (b'"loss":\r1}', 10),
                                           (b'"loss":1},\n', 11), (b'"loss":1},\n[', 11),
                                           # beyond a double: JSON.parse reads Infinity, which no
                                           # axis can hold (one such step emptied every chart)
                                           (b'"loss":1e999}', 10), (b'"loss":-' + b"9" * 400 + b'}', 10),
                                           # longer than a read: awaited for ever as a write under
                                           # way, the log silently shown no further
                                           (b'"loss":1,"x":"' + b"x" * run_view.READ_BYTES + b'"}', 10)])
def test_a_damaged_record_in_a_served_log_is_not_served(served_dir, damage, whole, capsys):
    """`--serve` follows logs it does not validate at start; records are served as raw bytes, so
    one damaged record (a hand edit, a NaN that Python's json takes and JSON.parse does not) made
    every answer holding it unparseable: the dashboard showed none of those 20000 records. The log
    is now served up to the record before the damage."""
    server, root = served_dir
    path = root / "alpha" / "alpha.loss.json"
    lines = path.read_bytes().split(b"\n")
    assert lines[11].startswith(b'{"live":1,"step":11,')
    lines[11] = lines[11].split(b'"loss":')[0] + damage + b","
    path.write_bytes(b"\n".join(lines))
    r = get(server, "api/records?run=alpha/alpha")
    msg = json.loads(r.content, parse_constant=lambda name: pytest.fail(f"{name} served"))
    assert [rec["step"] for rec in msg["records"]] == list(range(1, whole + 1)) and msg["total"] == whole
    for first in range(whole):  # every page of them parses too
        json.loads(get(server, f"api/records?run=alpha/alpha&from={first}&limit=1").content)
    assert [ln for ln in capsys.readouterr().err.splitlines() if "alpha.loss.json" in ln] == \
        [f"warning: {path}: record {whole + 1} is damaged; shown up to the one before it"]


def open_stream(server, run="alpha/alpha", rcvbuf=None):
    """A raw stream request that is never read: (socket, status line)."""
    host, port = server.url.split("/")[2].split(":")
    s = socket.socket()
    if rcvbuf:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
    s.connect((host, int(port)))
    s.sendall(f"GET /api/stream?run={run}&token={server.token} HTTP/1.1\r\nHost: {host}:{port}\r\n\r\n"
              .encode())
    return s, s.recv(64).split(b"\r\n")[0]


def test_an_answer_of_large_records_is_bounded_in_bytes(served_dir, monkeypatch):
    """An answer held up to CHUNK records and a stream message STREAM_CHUNK, whatever their size: a
    log of records of megabytes each (in a served directory) made every answer gigabytes in the
    server's memory. Past MESSAGE_BYTES an answer ends (one record more at most), and the cursor
    takes the client on to the rest."""
    monkeypatch.setattr(proxy_server, "MESSAGE_BYTES", 50_000, raising=False)
    server, root = served_dir
    big = root / "big"
    big.mkdir()
    LossLog(str(big / "big.loss.json")).append([{"step": i, "loss": 1.0, "pad": "x" * 10_000}
                                                for i in range(1, 41)])
    steps, cursor, pages = [], 0, 0
    while cursor < 40:
        r = get(server, f"api/records?run=big/big&from={cursor}")
        assert len(r.content) < 50_000 + 2 * 10_100, len(r.content)
        msg = r.json()
        steps += [rec["step"] for rec in msg["records"]]
        cursor, pages = msg["next"], pages + 1
    assert steps == list(range(1, 41)) and pages > 1
    with get(server, "api/stream?run=big/big", stream=True) as s:
        head = next(s.iter_lines())
    assert head.startswith(b"id: ") and int(head[4:]) < 40


def test_streams_and_connections_are_bounded(served_dir):
    server, _ = served_dir
    before = threading.active_count()
    held = [open_stream(server) for _ in range(proxy_server.MAX_STREAMS)]
    try:
        assert all(b" 200 " in line for _, line in held)
        assert b" 503 " in open_stream(server)[1]  # one stream too many
        idle = []
        for _ in range(3 * proxy_server.MAX_CONNECTIONS):  # connections that never send a request
            c = socket.create_connection(server.url.split("/")[2].split(":"))
            idle.append(c)
        time.sleep(0.5)
        # one thread per connection, and no more than MAX_CONNECTIONS of them
        assert threading.active_count() - before <= proxy_server.MAX_CONNECTIONS
        for c in idle:
            c.close()
    finally:
        for s, _ in held:
            s.close()


def test_a_stream_whose_client_left_frees_its_slot_at_once(served_dir):
    """A stream of a run with nothing new to send noticed that its client had gone only when its
    next ping failed, up to PING_SECONDS later: a dashboard of finished runs reloaded a few times
    was told "too many live streams" with no other dashboard open. A client that closes is
    noticed within a poll."""
    server, _ = served_dir
    for _ in range(2):  # the second round's streams need the first round's slots
        held = [open_stream(server) for _ in range(proxy_server.MAX_STREAMS)]
        assert all(b" 200 " in line for _, line in held)
        for s, _ in held:
            s.settimeout(0.2)
            with contextlib.suppress(socket.timeout):
                while s.recv(1 << 16):  # what a browser does: take what came, then close
                    pass
            s.close()
        time.sleep(1)


def test_a_client_that_stops_reading_is_dropped(tmp_path, monkeypatch):
    """A stream whose client takes nothing fills the socket buffers; after SEND_TIMEOUT_SECONDS the
    server drops it and its slot is free again. Enough records that the buffers fill."""
    monkeypatch.setattr(proxy_server._RequestHandler, "timeout", 1)
    root = tmp_path / "runs"
    make_run(root, "big", 150000)  # ~18 MB of records: more than the socket buffers hold
    server = proxy_server.start_for_directory(str(root), "127.0.0.1", 0, None)
    try:
        stalled = [open_stream(server, "big/big", rcvbuf=4096) for _ in range(proxy_server.MAX_STREAMS)]
        assert all(b" 200 " in line for _, line in stalled)
        deadline = time.monotonic() + 60
        status = b""
        while time.monotonic() < deadline:
            s, status = open_stream(server, "big/big")
            s.close()
            if b" 200 " in status:
                break
            time.sleep(0.2)
        assert b" 200 " in status, "stalled streams were never dropped"
        for s, _ in stalled:
            s.close()
    finally:
        server.shutdown()


@contextlib.contextmanager
def _connection_with_short_timeout(server, monkeypatch):
    """A client socket to `server`, whose per-receive timeout is lowered to 0.5 s; afterwards an
    ordinary request must be served as before."""
    monkeypatch.setattr(proxy_server._RequestHandler, "timeout", 0.5)
    port = server.httpd.socket.getsockname()[1]
    with socket.create_connection(("127.0.0.1", port), timeout=5) as s:
        yield s
    assert get(server, "api/runs").status_code == 200


def _dropped_while_sending(s, chunks, pause):
    """Sends each chunk `pause` seconds after the last; True once the server has closed the
    connection, False if every chunk went through."""
    for chunk in chunks:
        time.sleep(pause)
        try:
            s.sendall(chunk)
        except OSError:
            return True
    return False


def test_a_client_that_trickles_its_request_is_dropped(served_dir, monkeypatch):
    """Slowloris: a request head sent a line at a time, each line within the per-receive timeout,
    held its connection (one of MAX_CONNECTIONS) for ever; the whole head must come within the
    timeout. The client below trickles for 8 timeouts; the server drops it long before."""
    server, _ = served_dir
    with _connection_with_short_timeout(server, monkeypatch) as s:
        s.sendall(b"GET /api/runs HTTP/1.1\r\nHost: 127.0.0.1\r\n")
        dropped = _dropped_while_sending(s, (b"X-Trickle-%d: x\r\n" % i for i in range(40)), 0.1)
        if not dropped:
            try:
                s.sendall(b"X-Run-Token: " + server.token.encode() + b"\r\n\r\n")
                dropped = s.recv(100) == b""
            except OSError:
                dropped = True
        assert dropped, "a client trickling its request head for 4 s was still served (timeout 0.5 s)"


def test_a_client_that_trickles_bytes_after_its_request_is_dropped(served_dir, monkeypatch):
    """After a response, werkzeug reads and discards whatever the client sends next, up to 10 GB,
    each read within the per-receive timeout: a client that kept sending a byte now and then held
    its connection (one of MAX_CONNECTIONS) for ever, without the token (a 403 is a response too).
    The client below sends a byte every few milliseconds for 8 timeouts and more; the server drops
    it long before."""
    server, _ = served_dir
    with _connection_with_short_timeout(server, monkeypatch) as s:
        s.sendall(b"POST /api/stop HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: 100000000\r\n\r\n")
        dropped = _dropped_while_sending(s, itertools.repeat(b"x", 2000), 0.002)
        assert dropped, "a client sending bytes after its request for 4 s was still held (timeout 0.5 s)"


def test_a_page_elsewhere_cannot_stop_the_run_even_with_the_token(tmp_path, cpu_binary):
    """A control request that a foreign page sends with the token (no preflight is needed for
    ?token=) is refused and the run goes on; the same request from the server's own page stops it."""
    exp = ProxyFixtureDir(tmp_path)
    p = Proxy.start(exp.config(steps=10**6, checkpoint={"every": 0}), exp.run_dir, cpu_binary)
    try:
        url, token = p.url_and_token()
        p.wait_state(lambda s: s.get("step", 0) >= 2)
        foreign = requests.post(f"{url}api/stop?token={token}", headers={"Origin": "http://evil.example"},
                                timeout=10)
        assert foreign.status_code == 403
        step = p.state()["step"]
        p.wait_state(lambda s: s["step"] >= step + 5)
        assert p.proc.poll() is None and p.state()["status"] == "running"
        own = requests.post(f"{url}api/stop?token={token}", headers={"Origin": url.rstrip("/")}, timeout=10)
        assert own.status_code == 202 and p.wait() == 0, p.describe()
        assert exp.state()["status"] == "stopped"
    finally:
        p.kill()


def test_clients_that_never_read_do_not_hold_up_training(tmp_path, cpu_binary):
    """The real proxy and engine, and far more clients than it serves, none of which reads: the
    proxy keeps its threads bounded and keeps recording the engine's steps."""
    exp = ProxyFixtureDir(tmp_path)
    p = Proxy.start(exp.config(steps=10**6, checkpoint={"every": 0}), exp.run_dir, cpu_binary)
    try:
        url, token = p.url_and_token()
        host, port = url.split("/")[2].split(":")
        p.wait_state(lambda s: s.get("step", 0) >= 5)
        clients = []
        for i in range(300):
            c = socket.create_connection((host, int(port)))
            if i < 2 * proxy_server.MAX_STREAMS:
                c.sendall(f"GET /api/stream?token={token} HTTP/1.1\r\nHost: {host}\r\n\r\n".encode())
            clients.append(c)
        step = p.state()["step"]
        p.wait_state(lambda s: s["step"] >= step + 200, timeout=120)
        threads = len(os.listdir(f"/proc/{p.proc.pid}/task"))
        assert threads <= proxy_server.MAX_CONNECTIONS + 10, threads
        for c in clients:
            c.close()
        assert p.stop() == 0
        assert [r["step"] for r in exp.loss() if r.get("loss") is not None][-1] >= step + 200
        assert (exp.run_dir / proxy_server.TOKEN_FILE).read_text().strip() == token
    finally:
        p.kill()


def test_the_log_follower_serves_only_complete_records(tmp_path, monkeypatch):
    """`--serve` reads logs that another process is writing: a record counts once its line is
    whole, a log read in small pieces is the same log, and a log replaced by a repair is indexed
    again."""
    monkeypatch.setattr(run_view, "READ_BYTES", 97)  # lines cross every piece's edge
    path = tmp_path / "x.loss.json"
    log = LossLog(str(path))
    log.append([{"step": i, "loss": 1.0 / i, "note": "é" * (i % 5)} for i in range(1, 40)])
    follower = run_view.LogFollower(path.name, run_view.ServedDir(str(tmp_path)))
    follower.refresh()
    whole = json.loads(path.read_bytes())
    assert len(follower) == 39 and json.loads(follower.read_json(0, 100)[0]) == whole
    # An append caught half-written: ",\n{record" without its end, then the rest.
    data = path.read_bytes()
    torn = data[:-2] + b',\n{"live":1,"step":40,"lo'
    path.write_bytes(torn)
    follower.refresh()
    assert len(follower) == 39
    path.write_bytes(data[:-2] + b',\n{"live":1,"step":40,"loss":0.025}\n]')
    follower.refresh()
    assert len(follower) == 40 and json.loads(follower.read_json(38, 5)[0])[-1]["step"] == 40
    # Replaced (a new inode, as a repair writes it): indexed from scratch.
    fresh = tmp_path / "fresh.json"
    fresh.write_bytes(b'[\n{"live":1,"step":1,"loss":2.0}\n]')
    os.replace(fresh, path)
    follower.refresh()
    assert json.loads(follower.read_json(0, 10)[0]) == [{"live": 1, "step": 1, "loss": 2.0}]
    follower.close()
    follower.root.close()


def test_serve_dir_from_the_command_line(tmp_path):
    """`training_proxy.py --serve DIR`: one line with the URL, the runs listed, Ctrl-C or a closed
    terminal (SIGHUP) ends it;
    a config and --serve together, or neither, or a DIR that is not one, is a usage error."""
    root = tmp_path / "runs"
    make_run(root, "alpha", 10)
    make_run(root, "beta", 10)
    proc = subprocess.Popen([sys.executable, str(PROXY), "--serve", str(root), "--port", "0"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=proxy_env())
    try:
        line = proc.stdout.readline()
        assert "serving 2 runs of" in line and "read-only" in line, line
        url, token = line.split(": ", 1)[1].strip().split("?token=")
        runs = requests.get(url + "api/runs", headers={"X-Run-Token": token}, timeout=10).json()
        assert [r["name"] for r in runs] == ["alpha", "beta"]
        # a closed terminal ends it too: on SIGHUP it went on, orphaned, holding its port and token
        proc.send_signal(signal.SIGHUP)
        assert proc.wait(timeout=30) == 0
    finally:
        proc.kill()
    for args in (["cfg.json", "--serve", str(root)], [], ["--serve", str(root / "alpha" / "alpha.loss.json")]):
        res = subprocess.run([sys.executable, str(PROXY), *args], capture_output=True, text=True,
                             env=proxy_env(), timeout=60)
        assert res.returncode == 2 and "error:" in res.stderr and "Traceback" not in res.stderr, args


def test_a_directory_of_more_runs_than_the_soft_open_files_limit_serves_them_all(tmp_path):
    """Each run served keeps its loss log open: under a soft limit of descriptors (1024 by default;
    64 here) a directory of more runs than that showed the ones past it without records, said
    they could not be read, and failed connections."""
    import resource
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and hard < 1024:
        pytest.skip(f"a hard limit of {hard} descriptors")
    root = tmp_path / "runs"
    n = 100
    for k in range(n):
        d = root / f"r{k}"
        d.mkdir(parents=True)
        LossLog(str(d / f"r{k}.loss.json")).append([{"step": 1, "loss": 3.0, "seg": 1, "elapsed": 0.0}])
    proc = subprocess.Popen([sys.executable, str(PROXY), "--serve", str(root), "--port", "0"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=proxy_env(),
                            preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_NOFILE, (64, hard)))
    try:
        url, token = proc.stdout.readline().split(": ", 1)[1].strip().split("?token=")
        with requests.Session() as s:
            totals = [s.get(url + f"api/records?run=r{k}/r{k}", headers={"X-Run-Token": token},
                            timeout=10).json()["total"] for k in range(n)]
        assert totals == [1] * n
    finally:
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=30)
    assert "cannot read it" not in err and "Traceback" not in err, err[-2000:]


def test_malformed_requests_write_nothing_on_the_proxys_terminal(tmp_path):
    """http.server wrote a line on stderr for every request it could not parse (a bad request line,
    a path too long, too many headers, another HTTP version): any local client, without the
    token, could add lines to the proxy's terminal or log file without end, between its own
    messages and through its progress line. They are answered, and not written."""
    root = tmp_path / "runs"
    make_run(root, "alpha", 10)
    proc = subprocess.Popen([sys.executable, str(PROXY), "--serve", str(root), "--port", "0"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=proxy_env())
    try:
        url = proc.stdout.readline().split(": ", 1)[1].strip().split("?token=")[0]
        host, port = url.split("/")[2].split(":")
        for head in (b"GARBAGE\r\n\r\n", b"GET / HTTP/9.9\r\n\r\n", b"GET /" + b"a" * 70000 + b" HTTP/1.1\r\n\r\n",
                     b"GET / HTTP/1.1\r\n" + b"X-A: b\r\n" * 200 + b"\r\n"):
            with socket.create_connection((host, int(port)), timeout=10) as s:
                s.sendall(head)
                assert s.recv(64), head[:20]  # an answer (to GARBAGE, an HTTP/0.9 one: no status line)
        assert requests.get(url + "api/runs", timeout=10).status_code == 403
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=30) == 0
        assert proc.stderr.read() == ""
    finally:
        proc.kill()


def test_files_linked_from_outside_the_served_directory_are_not_served(served_dir, tmp_path):
    """A run's state, samples or loss log that is a symbolic link to a file outside the served
    directory was served through /api/state, /api/samples and /api/records (only /files/ checked
    where a path leads): nothing outside the directory is served, whatever the links say."""
    server, root = served_dir
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "secret.json").write_text(json.dumps({"secret": "outside"}))
    (outside / "secrets.json").write_text(json.dumps([{"step": 1, "prompt": "s", "text": "outside"}]))
    make_run(outside, "far", 5)
    evil = root / "evil"
    make_run(root, "evil", 2)
    for name, target in (("state", outside / "secret.json"), ("samples", outside / "secrets.json"),
                         ("loss", outside / "far" / "far.loss.json")):
        os.unlink(evil / f"evil.{name}.json")
        os.symlink(target, evil / f"evil.{name}.json")
    os.symlink(outside / "far" / "far.loss.json", root / "linked.loss.json")
    time.sleep(run_view.SCAN_SECONDS + 0.1)
    answers = [get(server, f"api/{what}?run={run}") for what in ("state", "samples", "records")
               for run in ("evil/evil", "linked")]
    assert all("outside" not in r.text and '"step":5' not in r.text for r in answers), [r.text for r in answers]
    assert get(server, "api/state?run=alpha/alpha").json()["name"] == "alpha"


def test_a_json_named_link_to_a_file_that_is_no_json_is_not_served(served_dir):
    """Only .json files are served, but /files/ looked at the name asked for, not the file it leads
    to: a link x.json to the directory's dashboard.token (or a checkpoint) inside the directory,
    put there by anyone who can write in it, served the token, which answers for every run."""
    server, root = served_dir
    os.symlink("../dashboard.token", root / "alpha" / "leak.json")
    os.symlink("../alpha/alpha.loss.json", root / "beta" / "alpha-log.json")  # a .json: served
    r = get(server, "files/alpha/leak.json")
    assert r.status_code == 404 and server.token not in r.text
    assert get(server, "files/beta/alpha-log.json").json()[0]["step"] == 1


@pytest.mark.parametrize("state, sample_step", [("NaN", "Infinity"),
                                                # numbers beyond a double's range: Python's json
                                                # read 1e999 as inf and wrote it back as Infinity
                                                ("1e999", "-1e999"), ("9" * 400, "-" + "9" * 400)])
def test_a_state_file_holding_nan_is_served_as_empty(served_dir, state, sample_step):
    """Python's json reads NaN and Infinity, JSON.parse does not: a state or samples file holding
    one (a hand edit) was served as it was, an answer the dashboard could not parse. Such a file
    is served as empty, as one of the wrong type is."""
    server, root = served_dir
    (root / "alpha" / "alpha.state.json").write_text('{"name": "alpha", "loss": %s}' % state)
    (root / "alpha" / "alpha.samples.json").write_text('[{"step": %s, "prompt": "A", "text": "b"}]' % sample_step)
    time.sleep(0.3)  # past run_view.REFRESH_SECONDS
    for what, empty in (("state", {}), ("samples", [])):
        r = get(server, f"api/{what}?run=alpha/alpha")
        assert json.loads(r.text, parse_constant=lambda c: pytest.fail(f"{c} served")) == empty
    s, _ = open_stream(server)
    with s:  # the live stream's state too
        s.settimeout(5)
        data = b""
        while b"event: samples" not in data:
            data += s.recv(1 << 16)
    state_line = data.split(b"event: state\ndata: ")[1].split(b"\n")[0]
    assert json.loads(state_line, parse_constant=lambda c: pytest.fail(f"{c} served")) == {}


def test_a_fifo_in_the_served_directory_does_not_hang_the_server(served_dir):
    """Opening a FIFO for reading waits for a writer: a state file or loss log that was one (made by
    anyone who can write in the directory) held the request, and the run's lock, for ever. Only
    regular files are read: the FIFO is served as no file."""
    server, root = served_dir
    os.unlink(root / "alpha" / "alpha.state.json")
    os.mkfifo(root / "alpha" / "alpha.state.json")
    (root / "gamma").mkdir()
    os.mkfifo(root / "gamma" / "gamma.loss.json")
    time.sleep(run_view.SCAN_SECONDS + 0.1)
    assert get(server, "api/state?run=alpha/alpha").json() == {}
    assert get(server, "api/records?run=gamma/gamma").json()["records"] == []
    assert get(server, "api/state?run=beta/beta").json()["name"] == "beta"


def test_a_log_that_cannot_be_read_is_served_without_records(served_dir, monkeypatch, capsys):
    """Another user's run in a shared directory, its log owner-only: the PermissionError went up
    through every request that looked at the run, a 500 and a traceback on the terminal each
    time (a tab's stream reconnects every few seconds). It is served without records, with one
    warning; the other runs are served as before. (Permission is simulated: root reads any
    file.)"""
    server, root = served_dir
    log = str(root / "beta" / "beta.loss.json")
    open_regular = run_view.open_regular

    def refuse_beta(path, flags=0, dir_fd=None):  # ServedDir.open opens the last name in its directory
        if os.path.basename(path) == "beta.loss.json":
            raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), path)
        return open_regular(path, flags, dir_fd)

    monkeypatch.setattr(run_view, "open_regular", refuse_beta)
    for _ in range(3):
        r = get(server, "api/records?run=beta/beta")
        assert r.status_code == 200 and r.json() == {"next": 0, "total": 0, "records": []}
        time.sleep(run_view.REFRESH_SECONDS + 0.05)  # each request looks at the file again
    assert get(server, "api/state?run=beta/beta").json()["name"] == "beta"
    assert get(server, "api/records?run=alpha/alpha").json()["total"] == 300
    warnings = [ln for ln in capsys.readouterr().err.splitlines() if "beta.loss.json" in ln]
    assert warnings == [f"warning: {log}: cannot read it (Permission denied); shown without its records"]


def test_a_file_swapped_for_a_link_after_the_check_is_not_served(served_dir, tmp_path, monkeypatch):
    """/files/ checked where a path leads, then opened the path again by name: a file swapped for a
    link out of the served directory between the two (by anyone who can write in it) was served,
    and one swapped for a FIFO held the request for ever. What is checked is what is opened now."""
    server, root = served_dir
    (tmp_path / "secret.json").write_text(json.dumps({"secret": "outside"}))
    target = root / "alpha" / "alpha.state.json"
    real_realpath = os.path.realpath

    def swap_after_the_check(path, *args, **kw):
        real = real_realpath(path, *args, **kw)
        if real == str(target) and not os.path.islink(target):  # the check has looked: swap now
            os.unlink(target)
            os.symlink(tmp_path / "secret.json", target)
        return real

    monkeypatch.setattr(os.path, "realpath", swap_after_the_check)
    r = get(server, "files/alpha/alpha.state.json")
    assert os.path.islink(target), "the check never looked at the file"
    assert r.status_code == 404 and "outside" not in r.text, r.text


@pytest.mark.parametrize("swapped", ["the directory", "a directory above it"])
def test_the_served_directory_swapped_for_a_link_after_the_start_leads_nowhere_else(tmp_path, swapped):
    """The served directory was found by its name at every listing and open: renamed after the
    start, and it (or a directory above it) replaced by a link to another directory (another
    user's runs, /etc), the server listed and served that directory's files instead. It serves the
    directory it opened at the start, wherever that is now, and nothing of the other one."""
    root, other = tmp_path / "up" / "runs", tmp_path / "elsewhere" / "runs"
    make_run(root, "alpha", 300)
    make_run(root, "beta", 200)
    make_run(other, "alpha", 5, state={"name": "alpha", "secret": "elsewhere"})  # the same run's name
    make_run(other, "gamma", 5)
    (other / "secret.json").write_text(json.dumps({"secret": "elsewhere"}))
    server = proxy_server.start_for_directory(str(root), "127.0.0.1", 0, None)
    try:
        files = get(server, "files/").json()
        assert get(server, "api/records?run=alpha/alpha").json()["total"] == 300
        moved, link, target = ((root.parent / "runs.old", root, other) if swapped == "the directory"
                               else (tmp_path / "up.old", root.parent, other.parent))
        link.rename(moved)
        link.symlink_to(target, target_is_directory=True)
        held = moved / "runs" if swapped != "the directory" else moved
        time.sleep(max(run_view.SCAN_SECONDS, run_view.REFRESH_SECONDS) + 0.1)
        answers = [get(server, path) for path in (
            "files/", "files/secret.json", "files/gamma/gamma.state.json", "files/alpha/alpha.state.json",
            "api/runs", "api/state?run=alpha/alpha", "api/samples?run=alpha/alpha",
            "api/records?run=alpha/alpha", "api/state?run=gamma/gamma", "api/records?run=gamma/gamma")]
        assert all("elsewhere" not in r.text and "gamma" not in r.text for r in answers), \
            [r.text for r in answers]
        assert get(server, "files/").json() == files
        assert [r["id"] for r in get(server, "api/runs").json()] == ["alpha/alpha", "beta/beta"]
        assert get(server, "api/records?run=alpha/alpha").json()["total"] == 300
        assert get(server, "api/records?run=beta/beta&from=199").json()["next"] == 200
        assert get(server, "files/alpha/alpha.state.json").json()["name"] == "alpha"
        assert descriptors_of(held) == 1  # the directory opened at the start, held to the end
    finally:
        server.shutdown()
    assert descriptors_of(held) == 0


def test_served_dir_open_takes_a_directory_swapped_for_a_link_after_its_check_as_no_file(tmp_path, monkeypatch):
    """O_NOFOLLOW guards the last name only: a directory on the way swapped for a link out of the
    served directory between the check and the open (a rename and a symlink, by anyone who can
    write in it) was followed, and the file at the link's end served. Each name is opened
    without following a link now."""
    root, outside = tmp_path / "served", tmp_path / "outside"
    (root / "run").mkdir(parents=True)
    (root / "run" / "x.json").write_text("inside")
    outside.mkdir()
    (outside / "x.json").write_text("outside")
    real_inside = run_view.inside

    def swap_after_the_check(r, path):
        real = real_inside(r, path)
        os.rename(root / "run", root / "run.real")
        os.symlink(outside, root / "run")
        return real

    monkeypatch.setattr(run_view, "inside", swap_after_the_check)
    with pytest.raises(FileNotFoundError):
        with run_view.ServedDir(str(root)) as served:
            os.close(served.open("run/x.json"))
    monkeypatch.undo()
    os.unlink(root / "run")
    os.rename(root / "run.real", root / "run")
    with run_view.ServedDir(str(root)) as served, os.fdopen(served.open("run/x.json")) as f:  # the same path, untouched
        assert f.read() == "inside"


def test_served_dir_open_takes_a_file_swapped_for_a_link_after_its_check_as_no_file(tmp_path, monkeypatch):
    """The check (run_view.inside) resolves links; a file swapped for a link between the check and
    the open (O_NOFOLLOW: ELOOP) is no file, as ServedDir.open promises, for the dashboard's /files/
    and the loss-log follower alike, not an OSError of another kind."""
    (tmp_path / "secret").write_text("x")
    (tmp_path / "log").symlink_to(tmp_path / "secret")
    monkeypatch.setattr(run_view, "inside", lambda root, path: str(tmp_path / "log"))  # the check ran before
    with pytest.raises(FileNotFoundError):
        with run_view.ServedDir(str(tmp_path)) as served:
            served.open("log")
