"""A run directory (docs/DESIGN.md §5) and the files in it, as the proxy keeps them:

    <name>.ckpt, <name>.ckpt.json   the engine's checkpoint and sidecar; if present, the run resumes
    <name>.loss.json                every train/val record of every launch (microgpt/loss_log.py)
    <name>.samples.json             [{step, prompt, text}]: decoded samples of the current phase
    <name>.state.json               status, step, phase, checkpoint, pid, tokens, throughput, ETA, config
    <name>.lock                     held by the one proxy running the run (its pid inside)
    archive/step_<s>/               at polish step s: the checkpoint, samples and state of pretraining
"""
import fcntl
import os
import shutil
import stat
import time

from microgpt.atomic import atomic_open, fsync_dir, remove_stale_temps, write_bytes_atomic, write_json_atomic
from microgpt.checkpoint import HEADER_BYTES, SIDECAR_READ_MAX, CheckpointError, read_header, sidecar_step
from microgpt.files import DuplicateKeyError, file_kind, open_lock_file, open_regular, read_json
from microgpt.loss_log import parse_json

STATE_SECONDS = 0.5  # .state.json is rewritten at most this often (and at every event)
TOKEN_FILE = "dashboard.token"  # the training dashboard's token, kept in the run directory (proxy_server.load_token)
# `--serve DIR`'s token, a file of its own: served read-only (the page even shows it when bound
# beyond loopback), it must not be the token that stops a run trained in DIR.
VIEWER_TOKEN_FILE = "viewer.token"


class RunBusyError(RuntimeError):
    pass


class RunFileError(OSError):
    pass


def lock_run(path):
    """One proxy per run: a second one would append to the same loss log, "repair" the first one's
    write in progress and launch a second engine on the same checkpoint. The flock lives as long as
    the returned file stays open (the kernel drops it when the process dies, however it dies).
    A symbolic link planted there is refused, not followed (the pid written below would overwrite
    whatever it points to), and so is a FIFO (files.open_lock_file: an OSError, one error line)."""
    f = os.fdopen(open_lock_file(path, os.O_RDWR), "r+")
    try:
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        f.seek(0)
        holder = f.read().strip() or "?"
        f.close()
        raise RunBusyError(f"another proxy (pid {holder}) is running this run ({path}); stop it "
                           "first, or give this one another --run-dir") from None
    f.truncate(0)
    f.write(f"{os.getpid()}\n")
    f.flush()
    return f


class RunFiles:
    """The paths of one run directory."""

    def __init__(self, run_dir, name):
        self.dir = os.path.abspath(run_dir)
        self.name = name
        base = os.path.join(self.dir, name)
        self.ckpt = base + ".ckpt"
        self.loss = base + ".loss.json"
        self.samples = base + ".samples.json"
        self.state = base + ".state.json"
        self.lock = base + ".lock"
        self.token = os.path.join(self.dir, TOKEN_FILE)

    @classmethod
    def named_after(cls, run_dir):
        """The files of run_dir as the tools that take a run directory find them: the run named
        after the directory (runs/<name>/<name>.ckpt, as the proxy lays a run out by default)."""
        return cls(run_dir, os.path.basename(os.path.normpath(os.path.abspath(run_dir))))

    def refuse_special_files(self):
        """Every file of the run that exists must be a regular file: the proxy's open() of a FIFO
        would wait for ever, and a log that is /dev/null would swallow every record."""
        for path in (self.loss, self.state, self.samples, self.lock, self.ckpt, self.ckpt + ".json", self.ckpt + ".prev",
                     self.ckpt + ".prev.json"):
            try:
                mode = os.stat(path).st_mode
            except OSError:  # missing (it is made), or a symlink loop (replaced when written)
                continue
            if not stat.S_ISREG(mode):
                raise RunFileError(f"{path} is {file_kind(mode)}, not a regular file; move it away")

    def remove_stale_temps(self):
        """The temp files of the proxy's atomic writes (atomic.py: PATH.tmpPID) that a proxy killed
        mid-write left behind, in the run directory and its archives (a polish checkpoint's copy is
        checkpoint-sized); the caller holds the run's lock, so no other proxy writes them now."""
        names = [os.path.basename(p) for p in (self.loss, self.samples, self.state)]
        remove_stale_temps(self.dir, names, locked=True)
        archive = os.path.join(self.dir, "archive")
        if not os.path.isdir(archive) or os.path.islink(archive):  # a link's target is none of the run's
            return
        kept = names + [os.path.basename(self.ckpt), os.path.basename(self.ckpt) + ".json"]
        with os.scandir(archive) as entries:
            for entry in entries:
                if entry.name.startswith("step_") and entry.is_dir(follow_symlinks=False):
                    remove_stale_temps(entry.path, kept, locked=True)

    def archive_dir(self, step):
        return os.path.join(self.dir, "archive", f"step_{step}")

    def existing(self):
        """Which of the run directory and its files exist now (the dashboard's token too: a launch
        the engine refuses must not leave one made for it behind)."""
        return {p for p in (self.dir, self.ckpt, self.loss, self.samples, self.state, self.lock, self.token)
                if os.path.lexists(p)}

    def remove_all_but(self, existed):
        """Undo a launch that never started: remove what was not there before (existing()), the
        whole directory if it was new. Returns what is left to say about it."""
        if self.dir not in existed:
            shutil.rmtree(self.dir, ignore_errors=True)
            return f"removed {self.dir}, which this launch had created"
        for path in self.existing() - existed:
            os.remove(path)
        return f"{self.dir} is as it was"


def roll_back_checkpoint(ckpt):
    """Make the previous checkpoint slot (PATH.prev, the engine's, see host/checkpoint.h) the newest
    and keep the newest as the previous one, so that the engine resumes from the older state and
    repeats the steps in between; the newer state is only set aside, never lost (if the older one
    turned out damaged, the engine's refusal names it). Three pairs of renames through PATH.ahead,
    each done only where its source is there and its target is not: a rollback cut short by a
    crash is finished by the next call, whichever rename it stopped at."""
    pairs = [(ckpt, ckpt + ".ahead"), (ckpt + ".prev", ckpt), (ckpt + ".ahead", ckpt + ".prev")]
    for src, dst in pairs:
        if os.path.exists(src) and not os.path.exists(dst):
            if os.path.exists(src + ".json"):
                os.replace(src + ".json", dst + ".json")
            os.replace(src, dst)
    fsync_dir(os.path.dirname(ckpt))


def undo_a_cut_checkpoint_write(ckpt):
    """An engine killed between the last two renames of a checkpoint write (host/checkpoint.h:
    ckpt_write renames the new sidecar, then the new checkpoint) leaves the new sidecar beside the
    old checkpoint, which is then also the previous slot: one file under both names (a hard link).
    The engine refuses that newest slot, so the same command could not resume. The write is undone
    instead: the previous slot's sidecar goes back beside the checkpoint it describes, and the run
    resumes from that checkpoint (its later records are superseded). Only that exact state is
    touched. Returns (the sidecar's step, the checkpoint's) where it was undone, else None."""
    prev = ckpt + ".prev"
    try:
        if not os.path.samefile(ckpt, prev):
            return None
        step, _ = read_header(ckpt)
        with open(prev + ".json", "rb") as f:
            side = f.read(SIDECAR_READ_MAX + 1)
    except (OSError, CheckpointError):
        return None
    cut = sidecar_step(ckpt)
    if sidecar_step(prev) != step or cut == step or len(side) > SIDECAR_READ_MAX:
        return None
    write_bytes_atomic(ckpt + ".json", side)
    return cut, step


def _is_state(x):
    """A state as the proxy writes it: an object whose losses and training time (the summary of a
    finished run formats them as it finds them) are numbers or null."""
    return isinstance(x, dict) and all(isinstance(x.get(key), (int, float, type(None)))
                                       for key in ("loss", "val_loss", "elapsed_s"))


def _is_sample(x):
    """A sample as the proxy writes it: an object whose step (steps are compared) is a number."""
    return isinstance(x, dict) and isinstance(x.get("step", 0), (int, float))


class RunState:
    """The run's .state.json and .samples.json, in memory and on disk.

    The main thread owns every write; the server's threads only read .state and .samples, which are
    replaced, never mutated, so a reader always holds a consistent snapshot; the *_version counters
    tell the live stream what changed."""

    def __init__(self, files):
        self.files = files
        self.messages = []  # what loading had to repair, for the proxy to say
        self.unread = {}  # path -> "missing" or "damaged": a file that load() found no value in
        self.samples = self.load(files.samples, "a list of samples", [],
                                 lambda v: isinstance(v, list) and all(map(_is_sample, v)))
        if not os.path.exists(files.samples):
            write_json_atomic(files.samples, [])
        self.state = self.load(files.state, "a JSON object of a run's state", {}, _is_state)
        self.state_version = self.samples_version = 0
        self.state_written = 0.0
        self.state_dirty = False
        self.held = False  # True while a launch has not started: nothing is written (see write_state)

    def load(self, path, what, empty, valid):
        """A run file the proxy wrote, or `empty` if it is missing. One that is not what the proxy
        writes (hand-edited, damaged) is moved aside (move_aside), never silently dropped."""
        try:
            with open(path, "rb") as f:
                value = parse_json(f.read())  # as the dashboard will read it: no NaN
            if valid(value):
                return value
            why = f"not {what}"
        except FileNotFoundError:
            self.unread[path] = "missing"
            return empty
        except DuplicateKeyError as e:
            why = f"ambiguous: {e}"
        except ValueError:
            why = "not valid JSON"
        aside = move_aside(path)
        self.unread[path] = "damaged"
        self.messages.append(f"warning: {path} was {why}; moved it to {aside} and started anew")
        return empty

    def set_state(self, force=False, **changes):
        self.state = {**self.state, **changes, "updated_at": round(time.time(), 3)}
        self.state_version += 1
        self.state_dirty = True
        if force:
            self.write_state()

    def write_state(self, due_only=False):
        """Write .state.json if it changed (and, with due_only, if STATE_SECONDS have passed); not
        while held: an engine that refuses its config at start-up must leave nothing behind."""
        if (not self.state_dirty or self.held
                or (due_only and time.monotonic() - self.state_written < STATE_SECONDS)):
            return
        write_json_atomic(self.files.state, self.state)
        self.state_dirty = False
        self.state_written = time.monotonic()

    def set_samples(self, samples):
        self.samples = samples
        self.samples_version += 1
        write_json_atomic(self.files.samples, samples)


def move_aside(path):
    """Rename path to PATH.damaged, or PATH.damaged.N where that is taken: a second damaged copy
    replaced the first (a file damaged again after a restart), and the first was lost. Returns the
    new name. The lock held keeps another proxy from taking the same name meanwhile."""
    aside, n = path + ".damaged", 1
    while os.path.lexists(aside):
        aside, n = f"{path}.damaged.{n}", n + 1
    os.rename(path, aside)
    return aside


def archived_state_path(files, step):
    """The run's state in the archive of polish step `step`: written last, so its presence says this
    run's archive of that step is made. Another run sharing the directory (another name) may have
    archived the same step there: the folder alone says nothing of this run."""
    return os.path.join(files.archive_dir(step), os.path.basename(files.state))


def archive_samples_and_state(run_state, step):
    """Move .samples.json and .state.json aside into the archive of `step`, the state last, and
    start fresh samples for the polish phase."""
    files = run_state.files
    os.makedirs(files.archive_dir(step), exist_ok=True)
    write_json_atomic(os.path.join(files.archive_dir(step), os.path.basename(files.samples)), run_state.samples)
    write_json_atomic(archived_state_path(files, step), run_state.state)
    run_state.set_samples([])


def _open_slot(path, step):
    """(sidecar, checkpoint) of the checkpoint slot at path as two open binary files, if both say
    `step`, else None. Opened once and copied from there, so a slot the engine replaces meanwhile
    (its next checkpoint is a new file renamed over this one) is still the one copied."""
    files = []
    try:
        for name in (path + ".json", path):
            files.append(os.fdopen(open_regular(name), "rb"))
        side, head = parse_json(files[0].read(SIDECAR_READ_MAX)), files[1].read(HEADER_BYTES)
        if (isinstance(side, dict) and side.get("step") == step and len(head) == HEADER_BYTES
                and int.from_bytes(head[:4], "little", signed=True) == step):
            return files
    except (OSError, ValueError):
        pass
    for f in files:
        f.close()
    return None


def keep_checkpoint(dest, ckpt, step, state_name):
    """Copy the checkpoint of `step` into an archive (sidecar first: the checkpoint's presence means
    the copy is whole) and point the archived state at it; returns whether it was kept. The engine
    goes on training while this copies, and may already have checkpointed again (every step, in a
    small run): the step's checkpoint is then its previous slot, or gone, and is never taken from a
    later one."""
    for slot in (ckpt, ckpt + ".prev"):
        opened = _open_slot(slot, step)
        if opened:
            break
    else:
        return False
    with opened[0] as side, opened[1] as body:
        for src, target in ((side, ckpt + ".json"), (body, ckpt)):
            src.seek(0)
            with atomic_open(os.path.join(dest, os.path.basename(target))) as fout:
                shutil.copyfileobj(src, fout)
    point_archived_state_at(dest, os.path.join(dest, os.path.basename(ckpt)), step, state_name)
    return True


def point_archived_state_at(dest, kept, step, state_name):
    """The archive's state names its kept checkpoint (keep_checkpoint's last write; a polish replayed
    after a proxy killed just before it does it then). Rewritten only where it names another."""
    state_path = os.path.join(dest, state_name)
    state = read_json(state_path, {})
    state = state if isinstance(state, dict) else {}
    if (state.get("checkpoint"), state.get("checkpoint_step")) != (kept, step):
        write_json_atomic(state_path, {**state, "checkpoint": kept, "checkpoint_step": step})
