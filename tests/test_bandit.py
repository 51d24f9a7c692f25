"""The data mixture and the FIREHOSE bandit (docs/FIREHOSE-BANDIT.md): data.sources, the arm of every
micro-batch, the bandit's probabilities, its state across a resume, per-source validation loss, and
the errors of bad mixture configs. CPU engine; the arms of the GPU engine are checked against it
(marker `gpu`)."""
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

import engine_util as eu
from engine_util import TINY, tiny_args
from proxy_util import ProxyFixtureDir, proxy_env, run_to_end
from test_distributed import REL_TOL, run_ranks, run_single
from test_engine import alloc_counter  # noqa: F401  (the fixture: the LD_PRELOAD allocation counter)

from microgpt import config, engines
from microgpt.checkpoint import read_sidecar

PROXY = eu.REPO / "microgpt" / "training_proxy.py"
V = eu.TINY_VOCAB


def chain_tokens(n, seed):
    """Tokens of a learnable process over the TINY vocabulary: mostly next = (3·prev + 7) mod V, a
    random token one time in ten. A tiny model learns it within a hundred steps."""
    rng = np.random.default_rng(seed)
    noise, random = rng.random(n) < 0.1, rng.integers(0, V, n)
    x = np.empty(n, dtype=np.int64)
    x[0] = 0
    for i in range(1, n):
        x[i] = random[i] if noise[i] else (3 * x[i - 1] + 7) % V
    return x


class Sources:
    """Shards of two sources: `useful` (train and val from the chain process, the validation
    distribution), `noise` (uniform random tokens, with its own val)."""

    def __init__(self, d):
        d.mkdir(parents=True, exist_ok=True)
        eu.write_shard(d / "useful_train_000000.bin", chain_tokens(16384, 11))
        eu.write_shard(d / "useful_val_000000.bin", chain_tokens(4096, 12))
        self.useful_train, self.val = str(d / "useful_train_*.bin"), str(d / "useful_val_*.bin")
        self.noise_train = eu.write_random_shards(d, "noise_train", 1, 16384, V, seed=13)
        self.noise_val = eu.write_random_shards(d, "noise_val", 1, 4096, V, seed=14)

    def flags(self, **weights):
        """--data.sources.N.* of noise (0) and useful (1), and data.val = the useful val."""
        w = {"noise": 1.0, "useful": 1.0, **weights}
        return {"data.sources.0.name": "noise", "data.sources.0.train": self.noise_train,
                "data.sources.0.val": self.noise_val, "data.sources.0.weight": w["noise"],
                "data.sources.1.name": "useful", "data.sources.1.train": self.useful_train,
                "data.sources.1.val": self.val, "data.sources.1.weight": w["useful"],
                "data.val": self.val}


@pytest.fixture(scope="module")
def sources(tmp_path_factory):
    return Sources(tmp_path_factory.mktemp("bandit_sources"))


def mixture_args(sources, steps, **overrides):
    """TINY on the two sources (data.train dropped: data.sources replaces it)."""
    settings = {**sources.flags(), "train.steps": steps, "train.lr": 3e-3, "data.train": None, **overrides}
    return [a for a in tiny_args("unused", **settings)]


def without_arms(records):
    """exact_records with the "arm" field taken out of every train record."""
    out = {}
    for key, text in records.items():
        rec = json.loads(text)
        rec.pop("arm", None)
        out[key] = json.dumps(rec, sort_keys=True)
    return out


def arms_of(result):
    """The source of every micro-batch, in order."""
    return [a for r in result.steps for a in (r["arm"] if isinstance(r["arm"], list) else [r["arm"]])]


# ---------------------------------------------------------------------------------------------------
# One source: the mixture and the bandit change nothing


def test_one_source_with_the_bandit_is_a_plain_run(cpu_binary, random_shards, tmp_path):
    """A plain data.train run, the same shards as the one source of data.sources, and that with the
    bandit probing at every step: the same losses, validation losses and checkpoint bytes. The
    bandit really ran (its probes are forward passes between steps), with p = [1] throughout."""
    base = {"train.steps": 12, "eval.every": 4, "eval.batches": 2, "train.grad_accum": 2}
    plain_ckpt, source_ckpt, bandit_ckpt = tmp_path / "plain.ckpt", tmp_path / "source.ckpt", tmp_path / "bandit.ckpt"
    plain = eu.run_ok(cpu_binary, tiny_args(random_shards.train, random_shards.val, **base, checkpoint=plain_ckpt))
    one = {"data.train": None, "data.sources.0.name": "only", "data.sources.0.train": random_shards.train}
    source = eu.run_ok(cpu_binary, tiny_args("x", random_shards.val, **base, **one, checkpoint=source_ckpt))
    bandit = eu.run_ok(cpu_binary, tiny_args("x", random_shards.val, **base, **one, checkpoint=bandit_ckpt,
                                             **{"bandit.every": 1, "bandit.eta": 1.0}))
    assert all("arm" not in r for r in plain.steps)
    assert all(r["arm"] == [0, 0] for r in source.steps + bandit.steps)
    assert without_arms(eu.exact_records(source)) == eu.exact_records(plain)
    assert without_arms(eu.exact_records(bandit)) == eu.exact_records(plain)
    events = bandit.events("bandit")
    assert [e["step"] for e in events] == list(range(1, 13)) and all(e["p"] == [1] for e in events)
    assert source_ckpt.read_bytes() == plain_ckpt.read_bytes() == bandit_ckpt.read_bytes()
    assert "bandit" not in read_sidecar(source_ckpt) and read_sidecar(bandit_ckpt)["bandit"]["rounds"] == 12


# ---------------------------------------------------------------------------------------------------
# Two sources


def test_static_mixture_draws_by_weight(cpu_binary, sources):
    """Without a bandit the arms follow the weights (1:3) and nothing else: 400 micro-batches, the
    share of source 1 within 3.5 standard deviations (0.076) of 0.75; arms are a function of the
    seed, so this is deterministic, and another seed draws other arms."""
    res = eu.run_ok(cpu_binary, mixture_args(sources, 200, **{"train.grad_accum": 2, "data.sources.1.weight": 3.0}))
    arms = arms_of(res)
    assert len(arms) == 400 and set(arms) == {0, 1}
    assert abs(np.mean(arms) - 0.75) < 3.5 * np.sqrt(0.75 * 0.25 / 400)
    assert res.events("start")[0]["sources"] == ["noise", "useful"] and res.events("start")[0]["p"] == [0.25, 0.75]
    assert not res.events("bandit")
    other = eu.run_ok(cpu_binary, mixture_args(sources, 20, **{"data.sources.1.weight": 3.0, "train.seed": 7}))
    assert arms_of(other) != arms[:20]


def test_bandit_shifts_weight_to_the_useful_source(cpu_binary, sources):
    """Useful source (the validation distribution) against random tokens, equal prior weights,
    default bandit settings (probing every step): within 300 steps of the TINY model the useful
    source's probability passes 0.9, and the draws follow it."""
    res = eu.run_ok(cpu_binary, mixture_args(sources, 300, **{"bandit.every": 1, "train.warmup_steps": 0}))
    events = res.events("bandit")
    assert len(events) == 300 and all(len(e["p"]) == 2 and abs(sum(e["p"]) - 1) < 1e-8 for e in events)
    assert events[0]["p"] == [0.5, 0.5]
    above = [e["step"] for e in events if e["p"][1] > 0.9]
    assert above and above[0] <= 300, [e["p"] for e in events[::25]]
    assert events[-1]["p"][1] > 0.9
    late = arms_of(res)[-100:]
    assert np.mean(late) > 0.8, late
    # every probe event is one arm's score, importance-weighted
    for e in events:
        assert [i for i, x in enumerate(e["reward"]) if x != 0] in ([], [e["arm"]])


def test_validation_loss_per_source(cpu_binary, sources):
    """Every evaluation reports each source's val loss by name; the useful source's val shards are
    data.val, so its loss is the overall one to the bit. Without data.val the overall loss is the
    sources' mean by prior weight."""
    res = eu.run_ok(cpu_binary, mixture_args(sources, 6, **{"eval.every": 3, "eval.batches": 2}))
    vals = res.vals
    assert [v["step"] for v in vals] == [3, 6]
    for v in vals:
        assert set(v["val_loss_by_source"]) == {"noise", "useful"}
        assert v["val_loss_by_source"]["useful"] == v["val_loss"]
    no_val = eu.run_ok(cpu_binary, mixture_args(sources, 3, **{"eval.every": 3, "eval.batches": 2, "data.val": None,
                                                               "data.sources.1.weight": 3.0}))
    v = no_val.vals[0]
    by = v["val_loss_by_source"]
    assert v["val_loss"] == pytest.approx(0.25 * by["noise"] + 0.75 * by["useful"], rel=1e-6)


def test_a_source_of_weight_zero_is_evaluated_never_trained_on(cpu_binary, sources):
    res = eu.run_ok(cpu_binary, mixture_args(sources, 20, **{"data.sources.0.weight": 0.0, "bandit.every": 1,
                                                             "eval.every": 20, "eval.batches": 1}))
    assert set(arms_of(res)) == {1} and all(e["p"] == [0, 1] for e in res.events("bandit"))
    assert set(res.vals[0]["val_loss_by_source"]) == {"noise", "useful"}


BANDIT_LEARN_C = r"""
#include "microgpt/host/mixture.h"
static void show(const Mixture* m, const BanditRound* b) {
    printf("%.17g %.17g %.17g %.17g %d %.17g %.17g %.17g\n", m->gain[0], m->gain[1], m->reward_mean, m->reward_var,
           m->rounds, m->p[0], b->z, b->reward[0]);
}
int main(void) {
    static Config c;
    static Mixture m;
    BanditRound b;
    int r;
    c.bandit.enabled = 1; c.bandit.gamma = 0.1f; c.bandit.reward_decay = 0.5f;
    m.n = m.n_active = 2; m.prior[0] = m.prior[1] = 0.5; m.eta = 1.0;
    mixture_reset_bandit(&m, &c);
    for (r = 0; r < 6; r++) { /* past the warm-up: rewards count */
        b.arm = r % 2; b.loss_before = 3.0 - 0.1 * r; b.loss_after = b.loss_before - 0.05 - 0.01 * r;
        bandit_learn(&m, &c, &b);
    }
    show(&m, &b);
    b.arm = 0; b.loss_before = 2.0; b.loss_after = INFINITY; /* the probe after the step overflowed */
    bandit_learn(&m, &c, &b);
    show(&m, &b);
    return 0;
}
"""


def test_a_probe_that_overflowed_teaches_the_bandit_nothing(tmp_path):
    """A probe loss that is no finite number (an overflow of a low-precision forward) says nothing
    about the source. It was taken as a drop of 0: scored against the typical drop, that is a
    penalty of up to -3/p for the arm, and it pulled the running mean and variance with it. Now the
    gains, the statistics and p stay as they were, and the round's z and rewards are 0. The GPU
    engine's probes are what can overflow, so bandit_learn itself is run here."""
    src, exe = tmp_path / "bandit_learn.c", tmp_path / "bandit_learn"
    src.write_text(BANDIT_LEARN_C)
    build = subprocess.run(["gcc", "-std=c99", "-O2", "-fopenmp", "-D_POSIX_C_SOURCE=200809L", "-I", str(eu.REPO),
                            "-o", str(exe), str(src), "-lm"], capture_output=True, text=True)
    assert build.returncode == 0, build.stderr
    before, after = subprocess.run([str(exe)], capture_output=True, text=True, check=True).stdout.split("\n")[:2]
    gains_stats_p = lambda line: line.split()[:6]  # noqa: E731  (gain 0 and 1, mean, variance, rounds, p_0)
    assert float(before.split()[0]) != 0.0  # the bandit had learned: the test covers a state that moves
    assert gains_stats_p(after) == gains_stats_p(before)
    assert [float(x) for x in after.split()[6:]] == [0.0, 0.0]


def test_no_allocation_in_the_loop_with_the_bandit(cpu_binary, sources, alloc_counter):
    """Drawing sources, probing, learning and per-source evaluation use what was allocated at start
    (the shim and the thread count as in test_engine.py's test of the plain loop)."""
    args = mixture_args(sources, 6, **{"bandit.every": 2, "train.grad_accum": 2, "eval.every": 3, "eval.batches": 1})
    res = eu.run_ok(cpu_binary, args, env={"LD_PRELOAD": str(alloc_counter), "OMP_NUM_THREADS": "2"})
    assert any(l.startswith("ALLOC ") for l in res.lines), "the shim reported nothing: is it loaded?"
    first = next(i for i, l in enumerate(res.lines) if l.startswith('{"step"'))
    last = next(i for i, l in enumerate(res.lines) if l.startswith('{"event":"exit"'))
    in_loop = [l for l in res.lines[first:last] if "ALLOC" in l]
    assert not in_loop, f"{len(in_loop)} allocations inside the training loop, e.g. {in_loop[:5]}"
    assert len(res.events("bandit")) == 3 and all("val_loss_by_source" in v for v in res.vals)


@pytest.mark.parametrize("bandit", [False, True], ids=["static", "bandit"])
def test_two_ranks_draw_what_one_rank_with_twice_the_accumulation_draws(cpu_binary, sources, tmp_path, bandit):
    """Data parallelism (docs/DESIGN.md §17): rank r's micro-batch j is micro-batch r·accum + j of the
    step, so 2 ranks draw (and rank 0 reports) the sources of a 1-rank run with 2× accumulation, and
    train on the same windows: losses agree within test_distributed.py's tolerance (the gradient
    sums are grouped differently). With the bandit, rank 0's probe loss is broadcast, so both ranks
    hold one state; p agrees with the 1-rank run's to 1e-3 (measured 1e-4: dividing the probe-loss
    drops by their running deviation magnifies the last digits the two groupings differ in)."""
    extra = {"bandit.every": 1, "bandit.eta": 0.5, "bandit.reward_decay": 0.5} if bandit else {}
    base = mixture_args(sources, 30, **extra)
    one = run_single(cpu_binary, base + ["--train.grad_accum", "2", "--checkpoint", str(tmp_path / "one.ckpt")])
    two = run_ranks(cpu_binary, base + ["--checkpoint", str(tmp_path / "two.ckpt")], 2)
    arms = lambda records: [r["arm"] for r in records if "loss" in r]  # noqa: E731
    assert arms(two) == arms(one) and all(len(a) == 2 for a in arms(two))
    assert len({a for pair in arms(two) for a in pair}) == 2
    losses = lambda records: np.array([r["loss"] for r in records if "loss" in r])  # noqa: E731
    assert eu.rel_err(losses(two), losses(one)) < REL_TOL
    p = lambda records: np.array([r["p"] for r in records if r.get("event") == "bandit"])  # noqa: E731
    assert len(p(two)) == (30 if bandit else 0) and (not bandit or np.abs(p(two) - p(one)).max() < 1e-3)


# ---------------------------------------------------------------------------------------------------
# Exact resume


@pytest.mark.parametrize("accum, every", [(1, 1), (2, 3)], ids=["accum1-every1", "accum2-every3"])
def test_exact_resume_with_the_bandit(engine, sources, tmp_path, accum, every):
    """SIGTERM mid-run and resume: the same arms, probabilities, rewards, losses and final checkpoint
    bytes as the run that was never stopped, on each engine. The bandit's state travels in the
    sidecar. (A GPU step takes far less time than a CPU one: the GPU run is longer, so the signal
    still lands before its end.)"""
    steps = 40 if engine.name == "cpu" else 400
    args = mixture_args(sources, steps, **{"bandit.every": every, "train.grad_accum": accum, "eval.every": 10,
                                           "eval.batches": 1, "bandit.eta": 0.5, "bandit.reward_decay": 0.5})
    ref_ckpt, ckpt = tmp_path / "ref.ckpt", tmp_path / "run.ckpt"
    ref = eu.run_ok(engine.binary, args + ["--checkpoint", ref_ckpt])
    first = eu.run_with_signal(engine.binary, args + ["--checkpoint", ckpt], signal.SIGTERM, 7)
    assert first.rc == 0 and first.exit_event["reason"] == "signal", first.describe()
    k = first.exit_event["step"]
    assert 7 <= k < steps
    side = read_sidecar(ckpt)["bandit"]
    assert side["rounds"] == k // every and len(side["gain"]) == len(side["p"]) == 2
    second = eu.run_ok(engine.binary, args + ["--checkpoint", ckpt, "--resume"])
    assert second.events("start")[0]["p"] == first.events("bandit")[-1]["p"]  # the start event reports the resumed p
    assert eu.merged_exact_records(first, second) == eu.exact_records(ref)
    bandit_lines = [[ln for ln in r.lines if '"event":"bandit"' in ln] for r in (ref, first, second)]
    assert bandit_lines[1] + bandit_lines[2] == bandit_lines[0] and len(bandit_lines[0]) == steps // every
    assert len(set(arms_of(ref))) == 2 and max(e["p"][1] for e in ref.events("bandit")) > 0.6  # it did move
    assert ckpt.read_bytes() == ref_ckpt.read_bytes()
    assert read_sidecar(ckpt)["bandit"] == read_sidecar(ref_ckpt)["bandit"]


def test_resuming_a_run_without_bandit_state_starts_it_afresh(cpu_binary, sources, tmp_path):
    ckpt = tmp_path / "c.ckpt"
    eu.run_ok(cpu_binary, mixture_args(sources, 4, checkpoint=ckpt))
    res = eu.run_ok(cpu_binary, mixture_args(sources, 8, checkpoint=ckpt, resume=True, **{"bandit.every": 2}))
    assert "holds no bandit state" in res.stderr
    assert res.events("bandit")[0]["step"] == 6 and read_sidecar(ckpt)["bandit"]["rounds"] == 2


def _bandit_edit(**edit):
    def damage(side):
        side["bandit"].update(edit)
    return damage


BANDIT_DAMAGE = {"gain_nan": _bandit_edit(gain=[float("nan"), 0.0]), "gain_infinite": _bandit_edit(gain=[1e400, 0.0]),
                 "gain_text": _bandit_edit(gain=["x", 0.0]), "gain_not_a_list": _bandit_edit(gain=3),
                 "rounds_negative": _bandit_edit(rounds=-1), "rounds_huge": _bandit_edit(rounds=1e300),
                 # more probe rounds than the 4 steps before the checkpoint; INT_MAX overflowed the count
                 "rounds_past_the_steps": _bandit_edit(rounds=5), "rounds_int_max": _bandit_edit(rounds=2147483647),
                 "variance_negative": _bandit_edit(reward_var=-1.0), "mean_nan": _bandit_edit(reward_mean=float("nan")),
                 # beyond what drops of float losses give: a mean of 1e308 overflowed the variance to inf
                 # (every later z 0, the sidecar's reward_var null); a variance of 1e308 silenced the rewards
                 "mean_huge": _bandit_edit(reward_mean=1e308), "variance_huge": _bandit_edit(reward_var=1e308),
                 "gains_overflow": _bandit_edit(gain=[1.7e308, -1.7e308])}


@pytest.mark.parametrize("damage", sorted(BANDIT_DAMAGE))
def test_a_bandit_state_no_run_leaves_starts_the_bandit_afresh(cpu_binary, sources, tmp_path, damage):
    """The sidecar has no checksum: a bandit state with numbers no run leaves (probabilities that are
    no numbers would draw the sources by accident) is reported, and the bandit starts afresh from
    the prior, as a fresh run's does."""
    ckpt = tmp_path / "c.ckpt"
    args = mixture_args(sources, 4, checkpoint=ckpt, **{"bandit.every": 2, "bandit.eta": 2.0})
    fresh = eu.run_ok(cpu_binary, args)
    side = read_sidecar(ckpt)
    BANDIT_DAMAGE[damage](side)
    (tmp_path / "c.ckpt.json").write_text(json.dumps(side))
    res = eu.run_ok(cpu_binary, mixture_args(sources, 8, checkpoint=ckpt, resume=True,
                                             **{"bandit.every": 2, "bandit.eta": 2.0}))
    assert "is not well-formed" in res.stderr or "probabilities that are no numbers" in res.stderr, res.describe()
    assert res.events("start")[0]["p"] == fresh.events("start")[0]["p"], res.describe()
    assert all(np.isfinite(e["p"]).all() for e in res.events("bandit")) and read_sidecar(ckpt)["bandit"]["rounds"] == 2


@pytest.mark.parametrize("change", ["reordered", "renamed"])
def test_resuming_with_the_sources_reordered_starts_the_bandit_afresh(cpu_binary, sources, tmp_path, change):
    """The gains belong to sources by name: a resume that lists the same number of sources in
    another order (or under other names) must not hand one source's gain to another; it warns
    and starts the bandit afresh from the prior, as for another number of sources
    (docs/DESIGN.md §19)."""
    ckpt = tmp_path / "c.ckpt"
    bandit = {"bandit.every": 1, "bandit.eta": 0.5, "bandit.reward_decay": 0.5}
    eu.run_ok(cpu_binary, mixture_args(sources, 20, checkpoint=ckpt, **bandit))
    assert read_sidecar(ckpt)["bandit"]["p"][1] > 0.6  # the state favours "useful", source 1
    swapped = {"data.sources.0.name": "useful", "data.sources.0.train": sources.useful_train,
               "data.sources.0.val": sources.val, "data.sources.1.name": "noise",
               "data.sources.1.train": sources.noise_train, "data.sources.1.val": sources.noise_val}
    edit = swapped if change == "reordered" else {"data.sources.1.name": "useful2"}
    res = eu.run_ok(cpu_binary, mixture_args(sources, 22, checkpoint=ckpt, resume=True, **bandit, **edit))
    assert "bandit starts afresh" in res.stderr and "noise" in res.stderr, res.describe()
    assert res.events("start")[0]["p"] == [0.5, 0.5], res.describe()
    assert read_sidecar(ckpt)["bandit"]["rounds"] == 2


def test_resuming_on_another_probe_set_says_so(cpu_binary, sources, tmp_path):
    """data.val decides a bandit run's draws (its probes score the sources), but data_crc32c covers
    the training shards only: a resume on other data.val shards went on without a word, its draws
    no longer those of the run it continues. The bandit state keeps the probe set's fingerprint; a
    resume on another one says so and goes on from the state, one on the same says nothing."""
    bandit = {"bandit.every": 1, "bandit.eta": 0.5, "bandit.reward_decay": 0.5}
    for name in ("same", "other"):
        eu.run_ok(cpu_binary, mixture_args(sources, 6, checkpoint=tmp_path / f"{name}.ckpt", **bandit))
    runs = {name: eu.run_ok(cpu_binary, mixture_args(sources, 8, checkpoint=tmp_path / f"{name}.ckpt", resume=True,
                                                     **bandit, **({"data.val": sources.noise_val} if name == "other"
                                                                  else {})))
            for name in ("same", "other")}
    assert "data.val" not in runs["same"].stderr, runs["same"].describe()
    warned = [l for l in runs["other"].stderr.splitlines() if "other data.val shards" in l]
    assert len(warned) == 1 and warned[0].startswith("warning: "), runs["other"].describe()
    p = [run.events("start")[0]["p"] for run in runs.values()]
    assert "starts afresh" not in runs["other"].stderr and p[0] == p[1] != [0.5, 0.5]  # the learned state, kept


@pytest.mark.parametrize("value", [None, "x"], ids=["null", "text"])
def test_a_probe_fingerprint_that_is_no_number_says_so(cpu_binary, sources, tmp_path, value):
    """The bandit state has no checksum: a probe_crc32c that is no number read as absent, as in a
    sidecar written before the member, and the resume said nothing of whether its probes had
    measured this run's data.val. It says it cannot tell, once, and goes on from the state."""
    ckpt = tmp_path / "c.ckpt"
    bandit = {"bandit.every": 1, "bandit.eta": 0.5, "bandit.reward_decay": 0.5}
    eu.run_ok(cpu_binary, mixture_args(sources, 6, checkpoint=ckpt, **bandit))
    side = read_sidecar(ckpt)
    side["bandit"]["probe_crc32c"] = value
    (tmp_path / "c.ckpt.json").write_text(json.dumps(side))
    res = eu.run_ok(cpu_binary, mixture_args(sources, 8, checkpoint=ckpt, resume=True, **bandit))
    warned = [l for l in res.stderr.splitlines() if "probe_crc32c" in l]
    assert len(warned) == 1 and warned[0].startswith("warning: "), res.describe()
    assert "starts afresh" not in res.stderr and res.events("start")[0]["p"] != [0.5, 0.5], res.describe()


def test_a_re_indented_sidecar_resumes_the_bandit_exactly(cpu_binary, sources, tmp_path):
    """JSON whitespace anywhere in the member (a tool re-indented the sidecar, spaces around its
    colons) reads the same state."""
    args = mixture_args(sources, 4, **{"bandit.every": 2, "bandit.eta": 0.5})
    for name in ("plain", "pretty"):
        eu.run_ok(cpu_binary, args + ["--checkpoint", tmp_path / f"{name}.ckpt"])
    pretty = tmp_path / "pretty.ckpt.json"
    pretty.write_text(json.dumps(json.loads(pretty.read_text()), indent=1, separators=(" ,", " : ")))
    more = mixture_args(sources, 8, resume=True, **{"bandit.every": 2, "bandit.eta": 0.5})
    runs = [eu.run_ok(cpu_binary, more + ["--checkpoint", tmp_path / f"{name}.ckpt"]) for name in ("plain", "pretty")]
    assert "bandit starts afresh" not in runs[1].stderr, runs[1].describe()
    assert eu.exact_records(runs[0]) == eu.exact_records(runs[1])


# ---------------------------------------------------------------------------------------------------
# Bad configs: one clear error naming the key


@pytest.mark.parametrize("overrides, words", [
    ({"data.sources.1.weight": -1}, ["--data.sources.1.weight", "-1"]),
    ({"data.sources.0.weight": 0, "data.sources.1.weight": 0}, ["data.sources.N.weight", "every weight is 0"]),
    ({"data.sources.1.wieght": 1}, ["unknown flag", "--data.sources.1.wieght"]),
    ({"data.sources.1.train": "/nonexistent/x_*.bin"}, ["data.sources.1.train", "no shard matches"]),
    ({"data.sources.0.val": "/nonexistent/v_*.bin"}, ["data.sources.0.val", "no shard matches"]),
    ({"data.sources.1.train": None}, ["--data.sources.1.train"]),
    ({"data.sources.1.name": "noise"}, ["--data.sources.1.name", "already the name"]),
    ({"data.sources.1.name": "a b"}, ["--data.sources.1.name", "letters"]),
    ({"data.sources.32.name": "x"}, ["--data.sources.32.name", "at most 32"]),
    ({"data.train": "x_*.bin"}, ["--data.train", "not both"]),
    ({"bandit.gamma": 0.2}, ["--bandit.every"]),
    ({"bandit.every": 0}, ["--bandit.every", "outside"]),
    ({"bandit.every": 2, "data.val": None}, ["bandit.every", "--data.val"]),
    ({"bandit.every": 2, "bandit.reward_decay": 0}, ["--bandit.reward_decay", "never learn"]),
], ids=["negative-weight", "all-zero", "unknown-key", "empty-train-glob", "empty-val-glob", "missing-train",
        "duplicate-name", "bad-name", "too-many", "train-and-sources", "bandit-without-every", "every-0",
        "bandit-without-val", "reward-decay-0"])
def test_bad_mixture_flags_are_one_clear_error(cpu_binary, sources, overrides, words):
    res = eu.run_engine(cpu_binary, mixture_args(sources, 3, **overrides), timeout=30)
    assert res.rc == 2 and len(res.errors) == 1 and not res.steps, res.describe()
    assert all(w in res.errors[0] for w in words), res.errors


@pytest.mark.parametrize("name", ["a\nerror: forged", "a\x1b[2Jb", "a\x01b"], ids=["newline", "escape", "control"])
def test_a_source_name_with_a_control_character_is_one_error_line(cpu_binary, sources, name):
    """The error names the offending byte instead of echoing it: a newline in a name must not split
    the one error line in two (a second, forged "error:" line), nor a terminal escape reach the
    terminal."""
    res = eu.run_engine(cpu_binary, mixture_args(sources, 3, **{"data.sources.1.name": name}), timeout=30)
    lines = res.stderr.strip().splitlines()
    assert res.rc == 2 and len(lines) == 1 and not res.steps, res.describe()
    assert "--data.sources.1.name" in lines[0] and "0x%02x" % ord(name[1]) in lines[0], lines
    assert all(ch.isprintable() for ch in lines[0]), lines


@pytest.mark.parametrize("overrides", [{"data.sources.1.na\nerror: forged": "x"},
                                       {"data.sources.1.train": "/nonexistent/a\nerror: forged_*.bin"},
                                       {"data.sources.1.weight": "1\x1b[2J"}], ids=["flag", "glob", "value"])
def test_any_error_echoing_a_control_character_stays_one_printable_line(cpu_binary, sources, overrides):
    """Whatever user text an error quotes (a flag's name, a glob, a value), a newline in it must not
    split the one error line (a forged second "error:" line), nor an escape reach the terminal."""
    res = eu.run_engine(cpu_binary, mixture_args(sources, 3, **overrides), timeout=30)
    lines = res.stderr.strip().splitlines()
    assert res.rc == 2 and len(lines) == 1 and lines[0].startswith("error: "), res.describe()
    assert all(ch.isprintable() for ch in lines[0]) and ("\\x0a" in lines[0] or "\\x1b" in lines[0]), lines


@pytest.fixture(scope="module")
def flags(cpu_binary):
    return engines.engine_flags(str(cpu_binary))


def mixture_config(**data):
    return {"name": "mix", "model": {"n_layer": 2, "d_model": 32, "n_head": 4, "seq_len": 16, "vocab_size": V},
            "train": {"steps": 3, "batch_size": 4},
            "data": {"sources": [{"name": "a", "train": "a_*.bin", "weight": 1.0},
                                 {"name": "b", "train": "b_*.bin", "val": "bv_*.bin", "weight": 2}],
                     "val": "v_*.bin", **data},
            "bandit": {"every": 5, "gamma": 0.2}}


def test_config_sources_become_indexed_flags(flags):
    cfg = mixture_config()
    config.validate_config(cfg, flags)
    args = config.engine_args(cfg, flags, [], "/r/x.ckpt", resume=False)
    pairs = dict(zip(args[::2], args[1::2]))
    assert pairs["--data.sources.0.name"] == "a" and pairs["--data.sources.1.name"] == "b"
    assert pairs["--data.sources.1.train"] == str(eu.REPO / "b_*.bin")          # a glob: repository-relative
    assert pairs["--data.sources.1.val"] == str(eu.REPO / "bv_*.bin")
    assert float(pairs["--data.sources.1.weight"]) == 2.0 and pairs["--bandit.every"] == "5"
    assert "--data.sources.0.val" not in pairs and "--data.train" not in pairs


@pytest.mark.parametrize("change, message", [
    ({"sources": [{"name": "a", "train": "a", "weight": -1}]}, '"data.sources[0].weight" must be at least 0'),
    ({"sources": [{"name": "a", "train": "a", "wieght": 1}]}, 'unknown key "data.sources[0].wieght"'),
    ({"sources": [{"name": "a", "train": ""}]}, '"data.sources[0].train" must be a glob pattern'),
    ({"sources": [{"name": "a"}]}, 'missing key "data.sources[0].train"'),
    ({"sources": [{"train": "a"}]}, 'missing key "data.sources[0].name"'),
    ({"sources": []}, '"data.sources" must be a list of objects'),
    ({"sources": [{"name": "a", "train": "a"}] * 33}, '"data.sources" holds 33 items; at most 32'),
    ({"train": "t_*.bin"}, '"data.train" and "data.sources", not both'),
    ({"sources": [{"name": "a\nerror: forged", "train": "a"}]}, '"data.sources[0].name" must be letters'),
    ({"sources": [{"name": "caf\u00e9", "train": "a"}]}, '"data.sources[0].name" must be letters'),  # the engine's are ASCII
    ({"sources": [{"name": "a", "train": "a"}, {"name": "a", "train": "b"}]},
     '"data.sources[1].name" "a" is already the name of data.sources[0]'),
])
def test_bad_mixture_config_names_the_key(flags, change, message):
    cfg = mixture_config(**change)
    with pytest.raises(config.ConfigError, match=None) as e:
        config.validate_config(cfg, flags)
    assert message in str(e.value)


def test_the_shipped_bandit_experiment(flags):
    """experiments/ANDREA-12M-BANDIT.json is a valid config; its sources are the folders `make data`
    writes (every corpus source of scripts/fetch-assets.py, Shakespeare and the fallback
    conversations), and model and optimiser are ANDREA-12M's."""
    import importlib.util
    spec = importlib.util.spec_from_file_location("fetch_assets", eu.REPO / "scripts" / "fetch-assets.py")
    fetch_assets = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(fetch_assets)
    cfg = config.load_config(eu.REPO / "experiments" / "ANDREA-12M-BANDIT.json", flags)
    plain = config.load_config(eu.REPO / "experiments" / "ANDREA-12M-TRAIN.json", flags)
    names = [s["name"] for s in cfg["data"]["sources"]]
    assert sorted(names) == sorted([*fetch_assets.CORPUS, "shakespeare", "chitchat"])
    for s in cfg["data"]["sources"]:
        n = s["name"]
        assert s["train"] == f"data/megachat/sources/{n}/{n}_train_*.bin"
        assert s.get("val", f"data/megachat/sources/{n}/{n}_val_*.bin") == f"data/megachat/sources/{n}/{n}_val_*.bin"
    assert cfg["model"] == plain["model"] and cfg["train"] == plain["train"] and cfg["data"]["val"] == plain["data"]["val"]
    assert "bandit" in cfg and "bandit" not in plain


def test_the_shipped_bandit_experiment_names_only_val_shards_make_data_writes():
    """prep-megachat.py leaves a source's own val set out when it holds fewer than
    --min-shard-tokens tokens (docs/ANDREA.md's table gives each source's count), and the engine
    refuses a data.sources.N.val glob that matches no shard: sympy-doc's 7,512 val tokens made
    the shipped experiment fail at start on the default data."""
    import importlib.util
    import re
    spec = importlib.util.spec_from_file_location("prep_megachat", eu.REPO / "scripts" / "prep-megachat.py")
    prep = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(prep)
    val_tokens = {m[1]: int(m[2].replace(",", "")) for m in
                  re.finditer(r"^\| ([\w-]+) \|.*\| ([\d,]+) \|$", (eu.REPO / "docs" / "ANDREA.md").read_text(), re.M)}
    cfg = json.loads((eu.REPO / "experiments" / "ANDREA-12M-BANDIT.json").read_text())
    for s in cfg["data"]["sources"]:
        assert s["name"] in val_tokens, s["name"]
        written = val_tokens[s["name"]] >= prep.DEFAULT_MIN_SHARD_TOKENS
        assert ("val" in s) == written, (s["name"], val_tokens[s["name"]])


def test_passes_warning_per_source(tmp_path):
    """The proxy's warning about reading data more than MAX_PASSES times looks at each source, by
    the share of the steps its prior weight gives it."""
    from microgpt.shards import run_passes_warnings
    eu.write_shard(tmp_path / "big_train_000000.bin", np.zeros(10000, np.uint16))
    eu.write_shard(tmp_path / "small_train_000000.bin", np.zeros(1000, np.uint16))
    cfg = {"model": {"seq_len": 10}, "train": {"batch_size": 10, "steps": 100},
           "data": {"sources": [{"name": "big", "train": str(tmp_path / "big_train_*.bin")},
                                {"name": "small", "train": str(tmp_path / "small_train_*.bin"), "weight": 1.0}]}}
    [line] = run_passes_warnings(cfg)  # 100 steps x 100 tokens, half each: 0.5 and 5 passes
    assert 'data.sources[1] ("small"' in line and "5.0 passes" in line
    cfg["data"]["sources"][1]["weight"] = 0.5  # a third of 10000 tokens: 3.3 passes over 1000
    assert run_passes_warnings(cfg) == []


def test_the_proxy_keeps_what_the_dashboard_draws(cpu_binary, tmp_path):
    """Through the proxy: .loss.json holds the launch records with the sources' names and p, the
    arms, the per-source validation losses and the bandit records (placed on the tokens axis), also
    across a second launch that resumes the run (docs/PROXY.md)."""
    exp = ProxyFixtureDir(tmp_path)
    cfg = json.loads(exp.config(steps=20).read_text())
    cfg["data"] = {"sources": [{"name": "a", "train": str(exp.train), "val": str(exp.val)},
                               {"name": "b", "train": str(exp.train), "weight": 3}], "val": str(exp.val)}
    cfg["bandit"] = {"every": 2}
    path = tmp_path / "mix.json"
    path.write_text(json.dumps(cfg))
    for steps in (20, 30):
        cfg["train"]["steps"] = steps
        path.write_text(json.dumps(cfg))
        proxy, rc = run_to_end(path, exp.run_dir, cpu_binary)
        assert rc == 0, proxy.describe()
    records = [r for r in exp.loss() if r.get("live", 1)]
    launches = [r for r in records if r.get("event") in ("start", "resume")]
    assert [r["event"] for r in launches] == ["start", "resume"]
    assert all(r["sources"] == ["a", "b"] and len(r["p"]) == 2 for r in launches)
    assert launches[0]["p"] == [0.275, 0.725]  # (1 - γ)·prior + γ/K
    bandit = [r for r in records if r.get("event") == "bandit"]
    assert [r["step"] for r in bandit] == list(range(2, 31, 2))
    assert all(r["tokens"] == r["step"] * 2 * 32 and "elapsed" in r for r in bandit)
    assert all(r["arm"] in (0, 1) for r in records if "loss" in r)
    vals = [r for r in records if "val_loss" in r]
    assert vals and all(set(r["val_loss_by_source"]) == {"a"} for r in vals)


def proxy_on_config(cpu_binary, tmp_path, cfg):
    """The proxy run on the config cfg (written to tmp_path/mix.json; its run directory
    tmp_path/run): its CompletedProcess and its stderr's lines."""
    path = tmp_path / "mix.json"
    path.write_text(json.dumps(cfg))
    res = subprocess.run([sys.executable, str(PROXY), str(path), "--engine-binary", str(cpu_binary),
                          "--run-dir", str(tmp_path / "run")], capture_output=True, text=True, env=proxy_env(),
                         timeout=60)
    return res, res.stderr.strip().splitlines()


def test_proxy_refuses_a_bad_mixture_before_launching(cpu_binary, tmp_path):
    """Through the proxy: exit 2, one error line naming the key, no run directory."""
    cfg = mixture_config()
    cfg["data"]["sources"][1]["weight"] = "heavy"
    res, lines = proxy_on_config(cpu_binary, tmp_path, cfg)
    assert res.returncode == 2 and len(lines) == 1 and '"data.sources[1].weight" must be a number' in lines[0]
    assert not (tmp_path / "run").exists()


def test_proxy_refuses_a_bad_source_name_before_its_warnings(cpu_binary, tmp_path):
    """A source's name is the proxy's to refuse, as the engine would: found only by the engine, it was
    first printed as it stood in the proxy's warning about passes over the data, where a newline in
    it forged an "error:" line. One error line, the name escaped, no run directory."""
    exp = ProxyFixtureDir(tmp_path)
    cfg = json.loads(exp.config(steps=20000).read_text())  # 20000 steps read the shards ~30 times: a warning
    cfg["data"] = {"sources": [{"name": "a\nerror: forged", "train": str(exp.train)},
                               {"name": "b", "train": str(exp.train)}], "val": str(exp.val)}
    res, lines = proxy_on_config(cpu_binary, tmp_path, cfg)
    assert res.returncode == 2 and len(lines) == 1 and '"data.sources[0].name"' in lines[0], res.stderr
    assert "forged" in lines[0] and not (tmp_path / "run").exists()


# ---------------------------------------------------------------------------------------------------
# The GPU engine draws what the CPU engine draws


@pytest.mark.gpu
def test_gpu_engine_draws_the_cpu_engines_arms(cpu_binary, sources):
    """A static mixture's sources are a function of config and seed alone: the GPU engine draws the
    CPU engine's, all 400 micro-batches. With the bandit (fp32, probing every step) the rewards come
    from each engine's own probe losses, which differ in the last bits; over 60 steps p agrees to
    1e-3, and so do the draws (one could differ only if u fell within that distance of a boundary
    of p: for 60 draws, a chance of about 1e-2 at worst, and then this test names the step)."""
    from conftest import gpu_present
    if not gpu_present():
        pytest.skip("no GPU (nvidia-smi -L lists none)")
    cuda = Path(os.environ.get("ANDREA_CUDA_BINARY", eu.CUDA_BINARY))
    if not cuda.exists():
        pytest.skip(f"{cuda} not built (make cuda)")
    static = mixture_args(sources, 200, **{"train.grad_accum": 2, "data.sources.1.weight": 3.0})
    assert arms_of(eu.run_ok(cuda, static)) == arms_of(eu.run_ok(cpu_binary, static))
    args = mixture_args(sources, 60, **{"bandit.every": 1, "bandit.eta": 0.5, "bandit.reward_decay": 0.5,
                                        "train.precision": "fp32"})
    cpu, gpu = eu.run_ok(cpu_binary, args), eu.run_ok(cuda, args)
    first_diff = next((i for i, (a, b) in enumerate(zip(arms_of(cpu), arms_of(gpu))) if a != b), None)
    assert first_diff is None and len(arms_of(gpu)) == 60, f"the engines drew different sources at step {first_diff}"
    p_cpu = np.array([e["p"] for e in cpu.events("bandit")])
    p_gpu = np.array([e["p"] for e in gpu.events("bandit")])
    assert p_cpu.shape == p_gpu.shape == (60, 2)
    assert np.abs(p_cpu - p_gpu).max() < 1e-3, np.abs(p_cpu - p_gpu).max()
    assert np.abs(p_cpu[:, 1] - 0.5).max() > 0.1  # the bandit moved, so the comparison covers its updates


# ---------------------------------------------------------------------------------------------------
# The experiment's scripts (run for real on a GPU; here on the CPU engine, tiny)


def experiment_sources_dir(sources, tmp_path):
    """The two sources as the per-source folders `make data` writes (SRC/SRC_train_*.bin, ...)."""
    src = tmp_path / "sources"
    for name, train, val in (("noise", sources.noise_train, sources.noise_val), ("useful", sources.useful_train, sources.val)):
        (src / name).mkdir(parents=True)
        for pattern, split in ((train, "train"), (val, "val")):
            for i, path in enumerate(sorted(Path(pattern).parent.glob(Path(pattern).name))):
                (src / name / f"{name}_{split}_{i:06d}.bin").write_bytes(path.read_bytes())
    return src


def tiny_experiment(sources, tmp_path):
    """An --experiment of the TINY model, its data.val the useful source's."""
    experiment = tmp_path / "tiny-bandit.json"
    experiment.write_text(json.dumps({
        "name": "tiny-bandit",
        "model": {k.split(".")[1]: v for k, v in TINY.items() if k.startswith("model.")},
        "train": {"batch_size": 4, "steps": 1, "lr": 3e-3, "warmup_steps": 0},
        "data": {"sources": [], "val": sources.val},
        "eval": {"every": 10, "batches": 2},
        "bandit": {"every": 1}}))
    return experiment


def test_experiment_scripts_run_and_draw(sources, tmp_path):
    """scripts/bandit-experiment.py on two per-source folders with the TINY model: three runs of
    equal steps and tokens, the bandit's p only in the bandit run, per-source validation losses;
    scripts/plot-bandit.py draws the three figures (SVG here, where matplotlib may be missing)."""
    src, experiment = experiment_sources_dir(sources, tmp_path), tiny_experiment(sources, tmp_path)
    out = tmp_path / "out"
    res = subprocess.run([sys.executable, str(eu.REPO / "scripts" / "bandit-experiment.py"), "--out", str(out),
                          "--steps", "40", "--eval-every", "10", "--engine", "cpu", "--experiment", str(experiment),
                          "--sources-dir", str(src)], capture_output=True, text=True, env=eu.python_env(), timeout=300)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    doc = json.loads((out / "bandit-experiment.json").read_text())
    assert doc["sources"] == ["noise", "useful"] and set(doc["runs"]) == {"bandit", "static-uniform", "static-natural"}
    for run, r in doc["runs"].items():
        assert r["steps"] == 40 and r["tokens"] == 40 * 4 * 16, run
        assert [v["step"] for v in r["val"]] == [10, 20, 30, 40]
        assert set(r["val"][-1]["by_source"]) == {"noise", "useful"}
        assert bool(r["p"]) == (run == "bandit") and r["arm_share"][-1]["step"] == 40
    assert doc["runs"]["static-natural"]["prior"] == [0.5, 0.5]  # both sources hold 16384 train tokens
    assert (out / "bandit-bandit.json").exists()
    plot = subprocess.run([sys.executable, str(eu.REPO / "scripts" / "plot-bandit.py"), str(out), "--svg"],
                          capture_output=True, text=True, timeout=120, env=eu.python_env())
    assert plot.returncode == 0, plot.stderr
    import xml.etree.ElementTree as ET
    for stem in ("bandit-val-loss", "bandit-val-by-source", "bandit-mixture"):
        root = ET.parse(out / f"{stem}.svg").getroot()
        assert len(list(root.iter("{http://www.w3.org/2000/svg}polyline")) +
                   list(root.iter("{http://www.w3.org/2000/svg}polygon"))) >= 2, stem


def test_a_relative_sources_dir_is_the_working_folders(sources, tmp_path):
    """--sources-dir relative to the working folder: the script found and counted the shards there,
    but gave the runs the relative globs, which the proxy resolves against the repository: the runs
    failed (no shard matches), or trained on another folder of the same name in the repository."""
    experiment_sources_dir(sources, tmp_path)
    res = subprocess.run([sys.executable, str(eu.REPO / "scripts" / "bandit-experiment.py"), "--out", "out",
                          "--steps", "2", "--eval-every", "1", "--engine", "cpu", "--runs", "bandit",
                          "--experiment", str(tiny_experiment(sources, tmp_path)), "--sources-dir", "sources"],
                         capture_output=True, text=True, env=eu.python_env(), timeout=120, cwd=tmp_path)
    assert res.returncode == 0, res.stderr[-3000:]
    trained = json.loads((tmp_path / "out" / "bandit-bandit.json").read_text())["config"]["data"]["sources"]
    assert [s["train"] for s in trained] == [str(tmp_path / "sources" / name / f"{name}_train_*.bin")
                                             for name in ("noise", "useful")]


@pytest.mark.parametrize("blocked", ["out-is-a-file", "result-is-a-folder"])
def test_results_that_cannot_be_written_are_one_clear_error(sources, tmp_path, blocked):
    """An --out that cannot be a folder ended the script in a traceback from os.makedirs; a result
    that cannot be written (a full disk; here a folder in its place) in one from atomic_open, after
    the run. One `error:` line naming the path, a non-zero exit; an --out that cannot be a folder is
    refused before any run."""
    out = tmp_path / "out"
    if blocked == "out-is-a-file":
        out.write_text("")
    else:
        (out / "bandit-bandit.json").mkdir(parents=True)
    res = subprocess.run([sys.executable, str(eu.REPO / "scripts" / "bandit-experiment.py"), "--out", str(out),
                          "--steps", "2", "--engine", "cpu", "--runs", "bandit", "--experiment",
                          str(tiny_experiment(sources, tmp_path)),
                          "--sources-dir", str(experiment_sources_dir(sources, tmp_path))],
                         capture_output=True, text=True, env=eu.python_env(), timeout=120)
    errors = [line for line in res.stderr.splitlines() if line.startswith("error: ")]
    assert res.returncode == 1 and len(errors) == 1 and "Traceback" not in res.stderr, res.stderr[-3000:]
    assert str(out) in errors[0] and ("=== bandit" in res.stdout) == (blocked == "result-is-a-folder"), errors


@pytest.mark.parametrize("flags, words", [(["--runs", "static-natural,bandt"], ["--runs", "'bandt'"]),
                                          (["--steps", "0"], ["--steps 0"]),
                                          (["--eval-every", "-1"], ["--eval-every -1"])],
                         ids=["unknown-run", "steps-0", "eval-every-negative"])
def test_an_unknown_run_is_one_clear_error_before_any_run(sources, tmp_path, flags, words):
    """scripts/bandit-experiment.py --runs with a name that is no run looked it up only when its turn
    came: a KeyError traceback, after the runs before it had trained. It is refused up front: one
    `error:` line naming it, exit 2, nothing run or written. So are --steps below 1 and a negative
    --eval-every, which the first run's proxy refused: two error lines, after a run's banner."""
    out = tmp_path / "out"
    res = subprocess.run([sys.executable, str(eu.REPO / "scripts" / "bandit-experiment.py"), "--out", str(out),
                          "--engine", "cpu", *flags, "--experiment", str(tiny_experiment(sources, tmp_path)),
                          "--sources-dir", str(experiment_sources_dir(sources, tmp_path))],
                         capture_output=True, text=True, env=eu.python_env(), timeout=120)
    lines = res.stderr.splitlines()
    assert res.returncode == 2 and len(lines) == 1 and all(w in lines[0] for w in words), res.stderr
    assert not out.exists() and not res.stdout


def start_long_experiment(sources, tmp_path, src, out):
    """scripts/bandit-experiment.py's bandit run, far too long to finish during a test, in a
    session of its own (a terminal's Ctrl-C reaches all of it)."""
    return subprocess.Popen([sys.executable, str(eu.REPO / "scripts" / "bandit-experiment.py"), "--out", str(out),
                             "--steps", "1000000", "--engine", "cpu", "--runs", "bandit", "--experiment",
                             str(tiny_experiment(sources, tmp_path)), "--sources-dir", str(src)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=eu.python_env(),
                            start_new_session=True)


def experiment_engine(exp, src):
    """The pid of the engine the experiment's proxy started on the sources in `src`, once it has
    trained a little."""
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and exp.poll() is None:
        time.sleep(0.2)
        for pid in filter(str.isdigit, os.listdir("/proc")):
            try:
                argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
            except OSError:
                continue
            if argv[0].endswith(b"microgpt_cpu") and str(src).encode() in b" ".join(argv):
                time.sleep(1)  # past its start: a few steps trained
                return int(pid)
    raise AssertionError("the engine never started")


def test_an_evaluation_that_overflowed_is_summarised(sources, tmp_path, monkeypatch, capsys):
    """An evaluation whose loss was no finite number (a low-precision overflow) is null in the
    records; the script's closing summary formatted it with :.4f, a TypeError traceback after every
    run had trained. It is shown as null, and the results are written as they are."""
    import runpy
    script = runpy.run_path(str(eu.REPO / "scripts" / "bandit-experiment.py"))
    records = [{"step": s, "loss": 4.0, "tokens": 64 * s, "ms": 1.0, "arm": 0} for s in (1, 2)] + \
              [{"step": 2, "val_loss": None, "val_loss_by_source": {"noise": None, "useful": 3.5}}]
    script["main"].__globals__["train"] = lambda cfg, work, engine: (records, 1.0)
    out = tmp_path / "out"
    monkeypatch.setattr(sys, "argv", ["bandit-experiment.py", "--out", str(out), "--steps", "2", "--engine", "cpu",
                                      "--runs", "static-uniform", "--experiment",
                                      str(tiny_experiment(sources, tmp_path)),
                                      "--sources-dir", str(experiment_sources_dir(sources, tmp_path))])
    assert script["main"]() == 0
    assert "final val_loss null  noise null  useful 3.500" in capsys.readouterr().out
    assert json.loads((out / "bandit-experiment.json").read_text())["final"]["static-uniform"]["val_loss"] is None


def test_a_run_a_signal_stopped_is_not_compared(sources, tmp_path):
    """The proxy ends a run that a signal stopped (SIGTERM to the engine: a scheduler, an operator)
    with exit status 0, "run the same command to resume". scripts/bandit-experiment.py took it as
    finished: it went on with the other runs and compared the stopped run's last evaluation with
    theirs at the full steps, exit 0. Now it is one `error:` line and a non-zero exit, and no
    comparison is written (one run is enough to show it)."""
    src, out = experiment_sources_dir(sources, tmp_path), tmp_path / "out"
    exp = start_long_experiment(sources, tmp_path, src, out)
    try:
        os.kill(experiment_engine(exp, src), signal.SIGTERM)
        _, err = exp.communicate(timeout=120)
    finally:
        exp.kill()
    errors = [line for line in err.splitlines() if line.startswith("error: ")]
    assert exp.returncode == 1 and len(errors) == 1, err[-3000:]
    assert "bandit-experiment-bandit stopped at step" in errors[0] and "of 1000000" in errors[0], errors
    assert not (out / "bandit-experiment.json").exists()


def test_ctrl_c_is_one_line_no_traceback(sources, tmp_path):
    """Ctrl-C (SIGINT to the whole session, as a terminal sends it) mid-run ended
    scripts/bandit-experiment.py in a KeyboardInterrupt traceback. It is one "interrupted" line and
    exit status 130, as the other tools (microgpt/cli.py)."""
    src, out = experiment_sources_dir(sources, tmp_path), tmp_path / "out"
    exp = start_long_experiment(sources, tmp_path, src, out)
    try:
        experiment_engine(exp, src)
        os.killpg(exp.pid, signal.SIGINT)
        _, err = exp.communicate(timeout=120)
    finally:
        exp.kill()
    assert exp.returncode == 130 and "Traceback" not in err, err[-3000:]
    assert err.splitlines()[-1].startswith("bandit-experiment: interrupted; "), err[-3000:]
    assert not (out / "bandit-experiment.json").exists()


@pytest.mark.parametrize("damage", ["bad-magic", "no-tokens"])
def test_a_damaged_source_shard_is_one_clear_error_before_any_run(sources, tmp_path, damage):
    """scripts/bandit-experiment.py reads every source's token count (the static-natural weights)
    before the runs: a shard with a damaged header ended it in a ShardError traceback, sources
    whose shards hold no tokens in a ZeroDivisionError. One `error:` line naming the shard or the
    source, a non-zero exit, nothing run or written."""
    src, out = experiment_sources_dir(sources, tmp_path), tmp_path / "out"
    for name in ("noise", "useful"):
        shard = src / name / f"{name}_train_000000.bin"
        if damage == "bad-magic":
            shard.write_bytes(b"\0" * 4 + shard.read_bytes()[4:])
        else:
            eu.write_shard(shard, np.zeros(0, np.uint16))
    res = subprocess.run([sys.executable, str(eu.REPO / "scripts" / "bandit-experiment.py"), "--out", str(out),
                          "--engine", "cpu", "--sources-dir", str(src)],
                         capture_output=True, text=True, env=eu.python_env(), timeout=120)
    lines = res.stderr.splitlines()
    assert res.returncode != 0 and len(lines) == 1 and lines[0].startswith("error: "), res.stderr
    assert ("bad magic" in lines[0] and "noise_train_000000.bin" in lines[0]) if damage == "bad-magic" else \
        "noise hold no tokens" in lines[0], lines
    assert not out.exists()


def test_plot_bandit_without_evaluations_or_results(tmp_path):
    """scripts/plot-bandit.py on results without evaluations (bandit-experiment.py --eval-every 0)
    divided by zero laying out a figure with no panels; on a folder without results it ended in a
    FileNotFoundError traceback. It draws what there is (the bandit's p), and says in one `error:`
    line what is missing."""
    plot = lambda d: subprocess.run([sys.executable, str(eu.REPO / "scripts" / "plot-bandit.py"), str(d), "--svg"],  # noqa: E731
                                    capture_output=True, text=True, timeout=120, env=eu.python_env())
    p = [{"step": s, "p": [0.5 - s / 100, 0.5 + s / 100]} for s in (1, 2, 3)]
    runs = {"bandit": {"sources": ["a", "b"], "val": [], "p": p}, "static-uniform": {"sources": ["a", "b"], "val": [], "p": []}}
    (tmp_path / "bandit-experiment.json").write_text(json.dumps({"sources": ["a", "b"], "runs": runs}))
    res = plot(tmp_path)
    assert res.returncode == 0, res.stderr
    assert sorted(f.name for f in tmp_path.glob("*.svg")) == ["bandit-mixture.svg"]
    del runs["bandit"]  # results, but nothing to draw: no evaluations and no bandit run
    (tmp_path / "bandit-experiment.json").write_text(json.dumps({"sources": ["a", "b"], "runs": runs}))
    for res, words in ((plot(tmp_path), "nothing to draw"), (plot(tmp_path / "nothing-here"), "cannot read")):
        lines = res.stderr.splitlines()
        assert res.returncode == 2 and len(lines) == 1 and lines[0].startswith("error: "), res.stderr
        assert words in lines[0] and "bandit-experiment.json" in lines[0], lines


GARBLED_RESULTS = {
    "runs-a-list": {"sources": ["a"], "runs": []},
    "loss-a-string": {"sources": ["a"], "runs": {"bandit": {"sources": ["a"], "p": [],
                                                          "val": [{"step": 1, "val_loss": "x", "by_source": {}}]}}},
    "p-too-short": {"sources": ["a", "b"], "runs": {"bandit": {"sources": ["a", "b"], "val": [],
                                                               "p": [{"step": 1, "p": [0.5]}]}}},
    "p-null": {"sources": ["a", "b"], "runs": {"bandit": {"sources": ["a", "b"], "val": [],
                                                          "p": [{"step": 1, "p": [0.5, None]}]}}},
    # Python's json writes and reads NaN: the stack drew it as "nan" coordinates
    "p-nan": {"sources": ["a", "b"], "runs": {"bandit": {"sources": ["a", "b"], "val": [],
                                                         "p": [{"step": 1, "p": [float("nan"), 0.5]}]}}},
}


@pytest.mark.parametrize("garbled", sorted(GARBLED_RESULTS))
def test_plot_bandit_on_garbled_results_is_one_clear_error(tmp_path, garbled):
    """scripts/plot-bandit.py on a bandit-experiment.json of the wrong shape (runs a list, a loss
    that is no number, a p with too few or null entries) ended in a traceback (AttributeError,
    IndexError, or a TypeError from the SVG drawing), or (a NaN) drew nonsense. One `error:` line,
    exit 2, no figure."""
    (tmp_path / "bandit-experiment.json").write_text(json.dumps(GARBLED_RESULTS[garbled]))
    res = subprocess.run([sys.executable, str(eu.REPO / "scripts" / "plot-bandit.py"), str(tmp_path), "--svg"],
                         capture_output=True, text=True, timeout=120, env=eu.python_env())
    lines = res.stderr.splitlines()
    assert res.returncode == 2 and len(lines) == 1 and "is not the results of" in lines[0], res.stderr
    assert not list(tmp_path.glob("*.svg"))


def test_plot_bandit_keeps_the_old_figure_when_a_write_fails(tmp_path):
    """plot-bandit.py opened each figure with open(path, "w"): a write that failed midway (a full
    disk; here the file size limit, RLIMIT_FSIZE) left the figure truncated, and the OSError was a
    traceback. Figures are written atomically: the one that was there stays whole, and the failure
    is one `error:` line, exit 1."""
    import resource

    def small_files():  # writes past 2 KB fail with EFBIG (SIGXFSZ ignored, so they fail, not kill)
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (2048, 2048))

    p = [{"step": s, "p": [0.5 - s / 1000, 0.5 + s / 1000]} for s in range(1, 200)]
    (tmp_path / "bandit-experiment.json").write_text(json.dumps(
        {"sources": ["a", "b"], "runs": {"bandit": {"sources": ["a", "b"], "val": [], "p": p}}}))
    old = tmp_path / "bandit-mixture.svg"
    old.write_text("<svg>the figure of an earlier run</svg>\n")
    res = subprocess.run([sys.executable, str(eu.REPO / "scripts" / "plot-bandit.py"), str(tmp_path), "--svg"],
                         capture_output=True, text=True, timeout=120, env=eu.python_env(), preexec_fn=small_files)
    lines = res.stderr.splitlines()
    assert res.returncode == 1 and len(lines) == 1 and lines[0].startswith("error: cannot write"), res.stderr
    assert old.read_text() == "<svg>the figure of an earlier run</svg>\n"
    assert sorted(f.name for f in tmp_path.iterdir()) == ["bandit-experiment.json", "bandit-mixture.svg"]


@pytest.mark.parametrize("experiment, words", [
    ([], "the config must be a JSON object"),
    ({"name": "x", "train": 5}, '"train" must be an object'),
    ({"name": "x", "train": {"steps": 1}, "data": 3}, '"data" must be an object'),
    ({"name": "x", "train": {"steps": 1}, "data": {"sources": [], "val": "v"}, "eval": []}, '"eval" must be an object'),
    ({"name": "x", "train": {"steps": 1, "warmup_steps": "a"}, "data": {"sources": [], "val": "v"}},
     '"train.warmup_steps"'),
    ({"name": "x", "model": {k.split(".")[1]: v for k, v in TINY.items() if k.startswith("model.")},
      "train": {"steps": 1}, "data": {"sources": []}}, 'missing key "data.val"'),
    # no bandit section: the "bandit" run trained the static uniform mixture and was reported as the bandit
    ({"name": "x", "model": {k.split(".")[1]: v for k, v in TINY.items() if k.startswith("model.")},
      "train": {"steps": 1}, "data": {"sources": [], "val": "v"}}, 'missing key "bandit.every"'),
])
def test_a_bad_experiment_is_one_clear_error(cpu_binary, sources, tmp_path, experiment, words):
    """scripts/bandit-experiment.py read its --experiment as any JSON and indexed into it: a section
    that is no object, a mistyped key or no data.val ended it in a traceback. The config is checked
    against the engine's flags first: one `error:` line naming the key, a non-zero exit, nothing run."""
    path, out = tmp_path / "experiment.json", tmp_path / "out"
    path.write_text(json.dumps(experiment))
    res = subprocess.run([sys.executable, str(eu.REPO / "scripts" / "bandit-experiment.py"), "--out", str(out),
                          "--engine", "cpu", "--experiment", str(path),
                          "--sources-dir", str(experiment_sources_dir(sources, tmp_path))],
                         capture_output=True, text=True, env=eu.python_env(), timeout=120)
    lines = res.stderr.splitlines()
    assert res.returncode != 0 and len(lines) == 1 and lines[0].startswith(f"error: config {path}: "), res.stderr
    assert words in lines[0] and not out.exists()
