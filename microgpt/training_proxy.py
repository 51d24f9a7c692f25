#!/usr/bin/env python3
"""The training proxy (docs/DESIGN.md §5): launches an engine on an experiment config, records what
it reports in the run directory, and serves the live dashboard.

    python microgpt/training_proxy.py experiments/ANDREA-12M-TRAIN.json [--engine cuda|cpu]
        [--run-dir DIR] [--host 127.0.0.1] [--port 8765] [--keep-serving]
    python microgpt/training_proxy.py --serve runs/     every run under runs/, read-only

The run directory (default runs/<name>/ under the repository root) is described in run_dir.py, the
engine's supervision and signals in supervisor.py, the config in config.py. See docs/PROXY.md for
the user's view and the server's endpoints.
"""
import errno
import math
import os
import signal
import sys
import threading
import time

# Signals that arrive while the proxy starts, before the supervisor takes them over: a stop is
# honoured (nothing is launched). Held from before the imports below, which take a tenth of a
# second or more: a Ctrl-C there was a KeyboardInterrupt traceback, a SIGTERM a silent death.
EARLY_SIGNALS = []


# The signals the proxy takes: SIGTERM, SIGINT, SIGUSR1, and SIGHUP (a closed terminal: a stop) unless
# it started ignored, as `nohup` starts a program so that it goes on when the terminal closes.
HANDLED_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1) + (
    () if signal.getsignal(signal.SIGHUP) == signal.SIG_IGN else (signal.SIGHUP,))
STOP_SIGNALS = tuple(sig for sig in HANDLED_SIGNALS if sig != signal.SIGUSR1)


def hold_signals():
    for sig in HANDLED_SIGNALS:
        signal.signal(sig, lambda sig, _frame: EARLY_SIGNALS.append(sig))


if __name__ == "__main__":
    hold_signals()
    # `>&-` or `2>&-`: the proxy's messages go nowhere and it trains as usual (microgpt.terminal
    # takes sys.stdout and sys.stderr as they are when it is imported, below)
    from microgpt.cli import no_output_to_devnull
    no_output_to_devnull()

from microgpt.checkpoint import sidecar_step, whole_checkpoint_step
from microgpt.cli import IO_ERROR, USAGE_ERROR, ArgumentParser, fail
from microgpt.config import ConfigError, load_config, resolve_path, tokenize_prompts
from microgpt.engines import ENGINES, ROOT, EngineChoiceError, engine_flags, is_built, select_engine
from microgpt.loss_log import LossLogError
from microgpt.run_dir import RunBusyError
from microgpt.shards import run_passes_warnings
from microgpt.supervisor import Run, Supervisor, summarize
from microgpt.terminal import say, terminal

DEFAULT_PORT = 8765
# The most engine processes the proxy starts, all on this machine (one per GPU): far above any
# machine's GPUs, yet a typo's 10^8 is refused before an environment is built for each.
RANKS_MAX = 1024
LINGER_SECONDS = 0.6  # a few live-stream polls (proxy_server.POLL_SECONDS) after the run ends


def parse_args(argv):
    p = ArgumentParser(description="Train with an engine, log the run and serve its "
                       "live dashboard (see docs/PROXY.md).")
    p.add_argument("config", nargs="?", help="experiment JSON, e.g. experiments/ANDREA-12M-TRAIN.json")
    p.add_argument("--serve", metavar="DIR", help="train nothing: show every run under DIR (a run "
                   "directory or a directory of them) on one dashboard, read-only, until Ctrl-C")
    p.add_argument("--engine", choices=sorted(ENGINES), default=None,
                   help="build/microgpt_cuda (default when built and a GPU is visible; else the "
                        "CPU engine, with a warning) or build/microgpt_cpu")
    p.add_argument("--engine-binary", metavar="PATH",
                   help="run this engine executable instead (a custom build, or a test double)")
    p.add_argument("--ranks", "--gpus", type=int, default=1, metavar="N",
                   help="data-parallel processes on this machine, one per GPU with the CUDA engine "
                        "(docs/DESIGN.md §17; default 1)")
    p.add_argument("--run-dir", help="run directory (default: runs/<name>/ in the repository)")
    p.add_argument("--host", default="127.0.0.1", help="address the dashboard binds (default "
                   "127.0.0.1: this machine only)")
    p.add_argument("--port", type=int, default=None,
                   help=f"dashboard port (default {DEFAULT_PORT}, or a free one if that is taken; "
                        "0: any free port)")
    p.add_argument("--no-server", action="store_true", help="do not serve the dashboard")
    p.add_argument("--progress-every", type=float, metavar="SECONDS", default=None,
                   help="print the progress line this often (default: every second, rewritten in "
                        "place, on a terminal; every 30 s otherwise; 0: never)")
    p.add_argument("--keep-serving", action="store_true",
                   help="keep the dashboard up after the engine exits (or for a finished run), "
                        "until Ctrl-C")
    args = p.parse_args(argv)
    if not 1 <= args.ranks <= RANKS_MAX:
        p.error(f"--ranks must be in [1, {RANKS_MAX}]")
    if args.port is not None and not 0 <= args.port <= 65535:
        p.error("--port must be in [0, 65535]")
    if args.progress_every is not None and not 0 <= args.progress_every < math.inf:  # also not NaN
        p.error("--progress-every must be a finite number of seconds >= 0")
    if args.run_dir == "":  # "$RUN_DIR" unset: the default would take, or resume, another run
        p.error("--run-dir is empty (an unset shell variable?): give a directory, or leave the flag "
                "out for runs/<name>/")
    # "$ENGINE" unset: the default engine trained in the custom build's place; "$RUNS" unset: --serve
    # "" was taken as no --serve, and the proxy failed on the config it then lacked (a traceback);
    # "$HOST" unset: the dashboard was bound to every interface, reachable from the network
    for what, value in (("--engine-binary", args.engine_binary), ("--serve", args.serve),
                        ("the experiment config", args.config), ("--host", args.host)):
        if value == "":
            p.error(f"{what} is empty (an unset shell variable?)")
    if (args.config is None) == (args.serve is None):
        p.error("give an experiment config to train, or --serve DIR to look at runs")
    return args


def pick_engine(args):
    """--engine-binary as given, or select_engine's pick (its warning printed once, there)."""
    if args.engine_binary:
        engine = os.path.abspath(args.engine_binary)
        if not is_built(engine):
            raise EngineChoiceError(f"engine {engine} not found or not executable")
        return engine
    return select_engine(args.engine)


def open_run(args):
    """The run (config checked, run directory locked) or one error line and exit 2."""
    try:
        engine = pick_engine(args)
        flags = engine_flags(engine)  # the config's keys come from the engine itself
    except EngineChoiceError as e:
        # a terminal's Ctrl-C reaches the flag query too (one process group) and ends it: that is
        # the stop asked for, not an engine to rebuild
        if (stop := early_stop()) is not None:
            say(nothing_launched(stop))
            sys.exit(0)
        fail(str(e))
    try:
        cfg = load_config(args.config, flags)
        prompt_ids = tokenize_prompts(cfg, flags)
    except ConfigError as e:
        fail(f"{args.config}: {e}")
    for line in run_passes_warnings(cfg, resolve_path, {key: flag["default"] for key, flag in flags.items()}):
        print(line, file=sys.stderr, flush=True)
    run_dir = args.run_dir or os.path.join(ROOT, "runs", cfg["name"])
    if os.path.lexists(run_dir) and not os.path.isdir(run_dir):  # making it: "[Errno 17] File exists"
        fail(f"--run-dir {run_dir} exists and is no directory")
    try:
        return Run(cfg, flags, args.config, run_dir, engine, prompt_ids)
    except OSError as e:  # a write's error names no file (a full disk): say which run it was
        # a disk that fails the write is exit 1, as for the engines and a finished run's state below;
        # run files that are not what they should be (a link, a FIFO) are the input's fault, exit 2
        fail(f"cannot prepare the run in {run_dir}: {e.strerror}" if e.strerror and not e.filename else str(e),
             IO_ERROR if e.errno in (errno.ENOSPC, errno.EDQUOT, errno.EIO) else USAGE_ERROR)
    except (RunBusyError, LossLogError) as e:
        fail(str(e))


def early_stop():
    """The stop (SIGTERM, SIGINT, SIGHUP) that arrived before the engine was launched, or None."""
    return next((sig for sig in EARLY_SIGNALS if sig in STOP_SIGNALS), None)


def nothing_launched(sig):
    return f"{signal.Signals(sig).name} before the engine started: nothing launched"


def main(argv):
    hold_signals()
    args = parse_args(argv)
    if args.serve:
        return serve_directory(args)
    if args.progress_every is not None:
        terminal.interval = args.progress_every
    run = open_run(args)
    done = whole_checkpoint_step(run.files.ckpt)
    server = None
    if not args.no_server:
        from microgpt import proxy_server  # flask loads only when the dashboard is served
        try:
            server = proxy_server.start_for_run(run, args.host, args.port, DEFAULT_PORT)
        except OSError as e:
            fail(f"cannot serve the dashboard on {args.host}:{args.port}: {e.strerror or e}")
        say(f"dashboard: {server.url}?token={server.token}")

    supervisor = Supervisor(run, args.ranks)
    for sig in HANDLED_SIGNALS:
        signal.signal(sig, supervisor.on_signal)
    stop = early_stop()
    if stop is not None:
        say(nothing_launched(stop))
        code = 0
    elif (done is not None and done >= run.steps and sidecar_step(run.files.ckpt) == done
          and run.previous_config in (None, run.cfg)):
        # header and sidecar agree (a damaged header is the engine's to refuse, with its way back);
        # a config changed since the last launch is the engine's to judge: it refuses a model of
        # another shape, which was "already finished" here, its old summary shown as the new one's
        try:
            run.store.set_state(force=True, status="finished", pid=None, step=done, steps=run.steps,
                                checkpoint=run.files.ckpt, checkpoint_step=done)
        except OSError as e:  # a full disk: the engine is not involved, so no proxy failure
            fail(f"{run.files.state}: cannot record that the run is finished: {e.strerror or e}", IO_ERROR)
        say(f"{run.name} already finished: checkpoint {run.files.ckpt} is at step {done} of "
            f"{run.steps}; nothing to train")
        summarize(run, 0.0)
        code = 0
    else:
        code = supervisor.run_engine()
    if server and not args.keep_serving:
        time.sleep(LINGER_SECONDS)  # let open dashboards receive the final status before we go
    if server and args.keep_serving:
        serve_until_signal("run over; still serving the dashboard, Ctrl-C to quit")
    run.log.close()
    return code


def serve_directory(args):
    """--serve DIR: the dashboard of every run under DIR, read-only, until Ctrl-C."""
    if not os.path.isdir(args.serve):
        fail(f"--serve {args.serve}: not a directory")
    from microgpt import proxy_server
    try:
        server = proxy_server.start_for_directory(args.serve, args.host, args.port, DEFAULT_PORT)
    except OSError as e:
        fail(f"cannot serve the dashboard on {args.host}:{args.port}: {e.strerror or e}")
    n = len(server.served.listing())
    say(f"serving {n} run{'s' * (n != 1)} of {args.serve} (read-only; runs started later appear "
        f"too): {server.url}?token={server.token}")
    serve_until_signal("Ctrl-C to quit")
    return 0


def serve_until_signal(message):
    say(message)
    stop = threading.Event()
    for sig in STOP_SIGNALS:  # a closed terminal too: an orphaned server would hold its port and token
        signal.signal(sig, lambda *_: stop.set())
    while not stop.wait(0.5):
        pass


def imported_checkout():
    """The checkout this script is in, or None when Python imported that checkout's microgpt package.
    Another checkout installed with `pip install -e` would otherwise be imported instead: its engine
    would train and its runs/ receive the run."""
    here = os.path.dirname(os.path.dirname(os.path.realpath(__file__)))
    return None if os.path.realpath(ROOT) == here else here


if __name__ == "__main__":
    if (here := imported_checkout()) is not None:
        fail(f"this proxy is in {here}, but Python imports the microgpt package of {ROOT}: run "
             f"`pip install -e .` in {here} (or this command in {ROOT})")
    sys.exit(main(sys.argv[1:]))
