"""What the proxy does with each line the engine prints (docs/DESIGN.md §3 lists the events): loss
records go to the loss log, everything else updates the run's state, samples and archive."""
import collections
import json
import os
import time

from microgpt.config import config_changes, describe_changes
from microgpt.loss_log import parse_json
from microgpt.run_dir import archive_samples_and_state, archived_state_path, keep_checkpoint, point_archived_state_at
from microgpt.terminal import say, terminal


def _count(v):
    return isinstance(v, int) and not isinstance(v, bool) and v >= 0


def _number(v):
    return isinstance(v, (int, float)) and not isinstance(v, bool)


COUNT = (_count, "a whole number >= 0")
NUMBER_OR_NULL = (lambda v: v is None or _number(v), "a number or null")  # null: not finite (§15)
TEXT = (lambda v: isinstance(v, str), "a string")
TOKEN_IDS = (lambda v: isinstance(v, list) and all(map(_count, v)), "a list of token ids")
# The mixture's fields (docs/DESIGN.md §19): a source's index (one per micro-batch), its names, and
# numbers per source (p, rewards, losses), which the dashboard and scripts/bandit-experiment.py index
# and count with ("arm": "x" was a traceback there, at the end of a run of hours).
ARMS = (lambda v: _count(v) or (isinstance(v, list) and all(map(_count, v))), "a source index or a list of them")
NAMES = (lambda v: isinstance(v, list) and all(isinstance(x, str) for x in v), "a list of source names")
NUMBERS_OR_NULL = (lambda v: isinstance(v, list) and all(x is None or _number(x) for x in v),
                   "a list of numbers or null")
LOSS_BY_NAME = (lambda v: isinstance(v, dict) and all(x is None or _number(x) for x in v.values()),
                "an object of numbers or null")

# The fields of the engine's records (docs/DESIGN.md §3.8, §19) that the proxy computes with, formats
# or passes to the state, the log and the archive, by name; a sample's tokens are its ids.
RECORD_FIELDS = {"event": TEXT, "step": COUNT, "steps": COUNT, "tokens_per_step": COUNT, "tokens": COUNT,
                 "total_bytes": COUNT, "loss": NUMBER_OR_NULL, "val_loss": NUMBER_OR_NULL,
                 "lr": NUMBER_OR_NULL, "grad_norm": NUMBER_OR_NULL, "tokens_per_s": NUMBER_OR_NULL,
                 "ms": NUMBER_OR_NULL, "phase": TEXT, "path": TEXT, "reason": TEXT,
                 "arm": ARMS, "sources": NAMES, "p": NUMBERS_OR_NULL, "reward": NUMBERS_OR_NULL,
                 "val_loss_by_source": LOSS_BY_NAME, "probe_loss": NUMBER_OR_NULL, "drop": NUMBER_OR_NULL,
                 "z": NUMBER_OR_NULL}
SAMPLE_FIELDS = {**RECORD_FIELDS, "prompt": COUNT, "prompt_tokens": TOKEN_IDS, "tokens": TOKEN_IDS}


def engine_record(line):
    """The one way a line of the engine's stdout becomes a record: (record, None), or (None, why
    not). A line that is no JSON object as the log is read back (text, NaN, 1e999, deep nesting) is
    (None, None): no protocol, shown as it came. An object with a field of another type than the
    engine prints (`"loss": "abc"`, `"step": "x"`: a damaged or foreign engine) is (None, which
    field), never handed on: the handlers, the log and the state would fail on it or keep it."""
    try:
        rec = parse_json(line)
    except ValueError:
        return None, None
    if not isinstance(rec, dict):
        return None, None
    fields = SAMPLE_FIELDS if rec.get("event") == "sample" else RECORD_FIELDS
    for name, value in rec.items():
        valid, what = fields.get(name, (None, None))
        if valid and not valid(value):
            return None, (f'a record whose "{name}" is {_cut(json.dumps(value), 40)}, not {what}: '
                          f'{_cut(json.dumps(rec, separators=(",", ":")), 160)}')  # one line, no control bytes
    return rec, None


def _cut(text, limit):
    return text if len(text) <= limit else text[:limit] + "..."


def decode_tokens(ids):
    """Token ids -> text; if the tokenizer cannot load, the ids themselves (a sample is never lost)."""
    try:
        from microgpt import tokenizer  # tiktoken loads only for runs that sample
        return tokenizer.decode(ids)
    except Exception as e:  # TokenizerUnavailable, or tiktoken missing entirely
        if not getattr(decode_tokens, "warned", False):
            say(f"warning: samples are kept as token ids, the tokenizer is unavailable ({e})")
            decode_tokens.warned = True
        return " ".join(str(i) for i in ids)


class Clock:
    """Launch number and elapsed training time across launches: every record says which launch
    (seg) wrote it and how long the run had trained by then, so resumes can be told apart.
    The time trained is measured on the monotonic clock: the wall clock set back or forward
    meanwhile (NTP, a VM restored) made it negative, or a day longer than it was."""

    def __init__(self, seg):
        self.seg = seg
        self.t0 = time.time()  # the launch's wall time, for its start record
        self.m0 = time.monotonic()
        self.base = 0.0  # training time of earlier launches, up to the step this one resumed at

    def restart(self, base):
        self.base, self.t0, self.m0 = base, time.time(), time.monotonic()

    def elapsed(self):
        return round(self.base + time.monotonic() - self.m0, 3)


class Throughput:
    """Seconds per step and tokens per second over the last WINDOW train records."""

    WINDOW = 64

    def __init__(self):
        self.window = collections.deque(maxlen=self.WINDOW)  # (time, step, tokens)

    def add(self, now, rec):
        """-> (seconds per step, tokens per second or None) as of this record."""
        self.window.append((now, rec["step"], rec.get("tokens", 0)))
        t0, s0, k0 = self.window[0]
        if len(self.window) >= 2 and rec["step"] > s0 and now > t0:
            return (now - t0) / (rec["step"] - s0), (rec.get("tokens", 0) - k0) / (now - t0)
        return (rec.get("ms") or 0) / 1000, rec.get("tokens_per_s")  # too early: the engine's (null: not finite)


class EventHandler:
    """Dispatches the engine's stdout lines. `run` gives the config, files, state and loss buffer."""

    def __init__(self, run):
        self.run = run
        self.steps = run.cfg["train"]["steps"]
        self.tokens_per_step = None
        self.exit_reason = None
        self.started = False  # the engine said "start": its config was accepted
        self.polish_step = None  # set from the polish event until its checkpoint is archived
        self.throughput = Throughput()
        self.checkpoint_every = run.cfg.get("checkpoint", {}).get("every", 0)
        self.polish_start = run.cfg.get("polish", {}).get("start_step")
        self.checkpoint_asked = False  # a signal asked the engine for a checkpoint not yet written

    def handle_line(self, line):
        rec, fault = engine_record(line)
        if fault:  # a damaged or foreign engine: said, and skipped
            say(f"warning: the engine printed {fault}; not logged")
            return
        if rec is None:  # not protocol: show it rather than lose it
            terminal.passthrough(line)
            return
        handler = {None: self.on_record, "start": self.on_start, "sample": self.on_sample,
                   "polish": self.on_polish, "checkpoint": self.on_checkpoint,
                   "exit": self.on_exit, "memory": self.on_memory,
                   "bandit": self.on_bandit}.get(rec.get("event"))
        if handler:
            handler(rec)

    def add_record(self, rec):
        rec.update(seg=self.run.clock.seg, time=round(time.time(), 3), elapsed=self.run.clock.elapsed())
        self.run.buffer.add(rec)

    def on_start(self, rec):
        """The engine has loaded its checkpoint (or initialised) at step k: from here on, anything
        the log holds beyond k is a future that will not happen."""
        run, k = self.run, rec.get("step", 0)
        self.started = True
        run.store.held = False
        self.steps = rec.get("steps", self.steps)
        self.tokens_per_step = rec.get("tokens_per_step")
        run.buffer.flush(force=True)
        marked = run.log.supersede_after(k)
        tokens = self.log_launch(k, marked, {key: rec[key] for key in ("sources", "p") if key in rec})
        self.supersede_samples_after(k)
        polish = run.cfg.get("polish")
        phase = "polish" if polish and k >= polish["start_step"] else "pretrain"
        run.store.set_state(force=True, status="running", step=k, steps=self.steps, phase=phase,
                            tokens=tokens, elapsed_s=run.clock.base, seg=run.clock.seg)
        what = f"resuming at step {k}" if k else "starting at step 0"
        extra = f"; {marked} logged records beyond step {k} marked superseded" if marked else ""
        say(f"{run.name}: {what} of {self.steps} ({rec.get('engine', '?')} engine, "
            f"{rec.get('n_params', '?')} parameters){extra}")

    def log_launch(self, k, marked, mixture):
        """The start (or resume) record of this launch at step k (with `mixture`: the data sources'
        names and p, for runs with data.sources), and what changed in the config since the last
        launch; returns the tokens trained up to k."""
        run = self.run
        before = run.log.last_live(lambda r: "elapsed" in r and r.get("step", 0) <= k)
        run.clock.restart(before["elapsed"] if before else 0.0)
        tokens = before.get("tokens", 0) if before else 0
        stamp = {"seg": run.clock.seg, "time": round(run.clock.t0, 3), "elapsed": run.clock.base}
        kind = "resume" if len(run.log) else "start"
        records = [{"event": kind, "step": k, "tokens": tokens, **stamp, "superseded": marked, **mixture}]
        previous = run.previous_config
        changed = config_changes(previous, run.cfg) if isinstance(previous, dict) else {}
        if changed:
            records.append({"event": "config", "step": k, "changed": changed, **stamp})
            say(f"the config changed since the last launch: {describe_changes(changed)}")
        run.log.append(records)
        return tokens

    def supersede_samples_after(self, k):
        samples = self.run.store.samples
        if any(s.get("step", 0) > k and not s.get("superseded") for s in samples):
            self.run.store.set_samples([dict(s, superseded=True) if s.get("step", 0) > k else s
                                        for s in samples])

    def on_memory(self, rec):
        self.run.store.set_state(memory_bytes=rec.get("total_bytes"))

    def place_on_tokens(self, rec):
        """Records the engine prints without tokens (validation, bandit) get them from their step."""
        if self.tokens_per_step and isinstance(rec.get("step"), int):
            rec.setdefault("tokens", rec["step"] * self.tokens_per_step)

    def on_bandit(self, rec):
        """The mixture's p after a probe step (docs/FIREHOSE-BANDIT.md): kept for the dashboard."""
        self.place_on_tokens(rec)
        self.add_record(rec)

    def on_record(self, rec):
        if "step" not in rec or ("loss" not in rec and "val_loss" not in rec):
            return
        if "loss" in rec:
            self.on_train(rec)
        else:
            self.place_on_tokens(rec)
            self.run.store.set_state(val_loss=rec["val_loss"], val_step=rec["step"])
        self.add_record(rec)
        if "loss" in rec and self.checkpoint_may_follow(rec["step"]):
            self.run.flush(force=True)

    def checkpoint_may_follow(self, step):
        """The engine checkpoints right after this step's record (and its eval and samples): the
        records up to it go to disk first, so a checkpoint never gets ahead of the log (a proxy
        killed after it would lose them for good: the next run starts after them)."""
        return (step >= self.steps or self.checkpoint_asked or step == self.polish_start
                or (self.checkpoint_every > 0 and step % self.checkpoint_every == 0))

    def on_train(self, rec):
        now = time.monotonic()  # rates over a wall clock that jumps would be a day off
        sec_per_step, tokens_per_s = self.throughput.add(now, rec)
        eta = max(0, self.steps - rec["step"]) * sec_per_step
        self.run.store.set_state(
            step=rec["step"], tokens=rec.get("tokens"), phase=rec.get("phase", "pretrain"),
            tokens_per_s=round(tokens_per_s, 1) if tokens_per_s else None, eta_s=round(eta, 1),
            loss=rec.get("loss"), lr=rec.get("lr"), elapsed_s=self.run.clock.elapsed())

    def on_sample(self, rec):
        texts, i = self.run.prompt_texts, rec.get("prompt", 0)
        prompt = (texts[i] if isinstance(i, int) and 0 <= i < len(texts)
                  else decode_tokens(rec.get("prompt_tokens", [])))
        rs = self.run.store
        rs.set_samples(rs.samples + [{"step": rec.get("step"), "prompt": prompt,
                                      "text": decode_tokens(rec.get("tokens", []))}])

    def on_polish(self, rec):
        """Pretraining ends at step s (the engine switches data and LR itself, so resume stays
        exact). Its samples and state are archived right here, at the boundary; the checkpoint the
        engine writes next, before the first polish step (reason "polish"), joins the archive: the
        state at the switch. The loss log is never archived: it is one history."""
        run, s = self.run, rec.get("step", 0)
        rs = run.store
        if not self.polish_logged(s):
            self.add_record({"event": "polish", "step": s, "tokens": rs.state.get("tokens")})
        run.flush(force=True)
        dest = run.files.archive_dir(s)
        if os.path.exists(archived_state_path(run.files, s)):  # a resume that replays the boundary
            say(f"polish at step {s}: {dest} holds this run's archive, keeping its samples and state")
            if any(x.get("step", 0) <= s for x in rs.samples):  # replayed: the archive has them
                rs.set_samples([x for x in rs.samples if x.get("step", 0) > s])
        else:
            rs.set_state(step=s)
            archive_samples_and_state(rs, s)
            say(f"archived the pretraining samples and state in {dest}")
        kept = os.path.join(dest, os.path.basename(run.files.ckpt))
        if not os.path.exists(kept):
            self.polish_step = s
            say(f"polish phase starts at step {s}: the engine's checkpoint of this step will be kept")
        else:  # kept by a launch whose proxy may have been killed before its state said so
            point_archived_state_at(dest, kept, s, os.path.basename(run.files.state))
        rs.set_state(force=True, phase="polish", archive=os.path.relpath(dest, run.files.dir))

    def polish_logged(self, s):
        """Whether the log holds a live polish record of step s: a launch that resumed from the
        boundary's own checkpoint hears the engine's polish event again (a resume from before it
        superseded the old record). The newest live records back to the first one before step s."""
        rec = self.run.log.last_live(lambda r: r.get("event") == "polish" or r.get("step", 0) < s)
        return rec is not None and rec.get("event") == "polish" and rec.get("step") == s

    def on_checkpoint(self, rec):
        """Records first (their steps are now behind the checkpoint), then the state that says so."""
        self.run.flush(force=True)
        self.checkpoint_asked = False
        ckpt = rec.get("path") or self.run.files.ckpt
        self.run.store.set_state(force=True, checkpoint=ckpt, checkpoint_step=rec.get("step"))
        if self.polish_step is not None and rec.get("reason") == "polish":
            dest = self.run.files.archive_dir(self.polish_step)
            step = rec.get("step")
            if keep_checkpoint(dest, ckpt, step, os.path.basename(self.run.files.state)):
                say(f"kept the checkpoint of step {step} in {dest}")
            else:
                say(f"warning: the checkpoint of step {step} was replaced by later ones before it could be "
                    f"kept; {dest} holds the samples and state of that step without it")
            self.polish_step = None

    def on_exit(self, rec):
        self.exit_reason = rec.get("reason")
        self.run.store.set_state(step=rec.get("step", self.run.store.state.get("step")))
