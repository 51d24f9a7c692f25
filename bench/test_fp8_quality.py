"""bench/fp8_quality.py, the 2000-step fp8-against-bf16 quality runs, without a GPU: the schedule
it gives the runs, the pass rule (fp8's final validation loss within 1% of bf16's), the summary and
chart over the runs of two invocations, the markdown for docs/ANDREA.md, and a whole `run` against
a stand-in engine; and microgpt/svg_chart.py, the SVG writer the chart is drawn with.
"""
import json
import math
import os
import subprocess
import sys
import xml.etree.ElementTree as ET

import pytest

from engine_util import REPO, python_env

SCRIPT = REPO / "bench" / "fp8_quality.py"
SVG = "{http://www.w3.org/2000/svg}"


@pytest.fixture(scope="module")
def quality():
    import fp8_quality
    return fp8_quality


def records(precision, final, steps=2000, every=100, ms=2.0, n_params=1000):
    """An engine's stdout for a run whose validation loss falls linearly to `final`."""
    lines = [{"event": "environment", "commit": "abc1234", "gpu": "NVIDIA H200", "date": "2026-12-01T16:00:00Z"},
             {"event": "start", "n_params": n_params, "steps": steps, "precision": precision, "tokens_per_step": 4096}]
    for s in range(1, steps + 1):
        lines.append({"step": s, "loss": 5.0, "ms": ms})
        if s % every == 0:
            lines.append({"step": s, "val_loss": final + (steps - s) / steps})
    return "\n".join(json.dumps(r) for r in lines) + "\n"


def write_runs(folder, model, bf16, fp8, **kw):
    folder.mkdir(parents=True, exist_ok=True)
    for precision, final in (("bf16", bf16), ("fp8", fp8)):
        if final is not None:
            (folder / f"{model}-{precision}.jsonl").write_text(records(precision, final, **kw))


@pytest.mark.parametrize("bf16, why", [({"steps": 4000}, "scheduled for 4000 steps, not 2000"),
                                       ({"n_params": 2000}, "other models or batches"),
                                       ({"every": 200}, "validated at other steps")])
def test_the_summary_compares_only_runs_of_one_schedule_model_and_validation(tmp_path, bf16, why):
    """The two precisions of a model may come from two folders (run --precision): runs of another
    length (another learning-rate schedule, a final loss at another step), another model or batch,
    or validated at other steps are no comparison, however close their final losses."""
    (tmp_path / "a").mkdir()
    (tmp_path / "a" / "ANDREA-12M-bf16.jsonl").write_text(records("bf16", 5.0, **bf16))
    write_runs(tmp_path / "b", "ANDREA-12M", None, 5.01)
    out = summary_cmd(tmp_path / "a", tmp_path / "b")
    assert out.returncode == 1 and "FAIL (" in out.stdout and why in out.stdout, out.stdout + out.stderr
    assert json.loads((tmp_path / "a" / "fp8-quality.json").read_text())["models"]["ANDREA-12M"]["rel_diff"] is None


def summary_cmd(*args):
    return subprocess.run([sys.executable, str(SCRIPT), "summary", *map(str, args)], capture_output=True, text=True,
                          timeout=60, env=python_env())


def test_warmup_keeps_the_shipped_fraction_of_the_run(quality):
    from bench_common import load_config, experiment_path, train_settings
    t12 = train_settings(load_config(experiment_path("12M")))
    t120 = train_settings(load_config(experiment_path("120M")))
    assert quality.scaled_warmup(t12, 2000) == 20          # 200 of 20000
    assert quality.scaled_warmup(t120, 2000) == 77         # 500 of 13000
    assert quality.scaled_warmup({"steps": 1000, "warmup_steps": 0}, 10) == 1


def test_fp8_passes_within_one_percent_of_bf16_either_way(quality):
    def run(final, steps=2000, precision=None):
        return {"final_val_loss": final, "steps": steps, "precision": precision, "scheduled_steps": 2000,
                "shape": [1000, 4096], "val": [[2000, final]]}

    def compare(bf16, fp8=None):
        runs = {"bf16": dict(bf16, precision="bf16")}
        if fp8:
            runs["fp8"] = dict(fp8, precision=fp8["precision"] or "fp8")
        return quality.compare(runs, 2000)

    assert compare(run(4.0), run(4.0396))["pass"]        # 0.99% worse
    assert compare(run(4.0), run(3.97))["pass"]
    worse = compare(run(4.0), run(4.0401))
    assert not worse["pass"] and worse["rel_diff"] == pytest.approx(0.0401 / 4.0)
    assert not compare(run(4.0), run(3.95))["pass"]      # 1.25% better: not "within"
    for fp8, why in ((None, "missing"), (run(4.0, 1999), "fp8 stopped"), (run(None), "no finite"),
                     (run(4.0, precision="bf16"), "fp8 run's engine did not train in it")):
        c = compare(run(4.0), fp8)
        assert not c["pass"] and c["rel_diff"] is None and why in c["why"]


def test_a_run_without_a_finite_final_validation_loss_has_none(quality, tmp_path):
    path = tmp_path / "r.jsonl"
    path.write_text(records("fp8", 4.0).replace('"val_loss": 4.0}', '"val_loss": NaN}'))
    r = quality.read_run(str(path))
    assert r["steps"] == 2000 and r["final_val_loss"] is None and r["val"][-1][1] is None
    assert r["environment"]["commit"] == "abc1234" and r["ms_per_step"] == 2.0


def test_the_summary_joins_two_invocations_and_draws_both_models(tmp_path):
    write_runs(tmp_path / "a", "ANDREA-120M", 4.0, 4.02)
    write_runs(tmp_path / "b", "ANDREA-12M", 5.0, 5.01)
    out = summary_cmd(tmp_path / "a", tmp_path / "b", "--out", tmp_path / "docs")
    assert out.returncode == 0, out.stderr
    assert "ANDREA-12M: bf16 5.0000 (2.00 ms/step)  fp8 5.0100 (2.00 ms/step)  PASS" in out.stdout
    doc = json.loads((tmp_path / "docs" / "fp8-quality.json").read_text())
    assert doc["pass"] and doc["steps"] == 2000 and doc["tolerance"] == 0.01 and doc["commit"] == "abc1234"
    m = doc["models"]["ANDREA-120M"]
    assert m["rel_diff"] == pytest.approx(0.005) and m["runs"]["fp8"]["val"][0] == [100, pytest.approx(4.02 + 0.95)]
    assert len(m["runs"]["bf16"]["val"]) == 20
    root = ET.parse(tmp_path / "docs" / "fp8-quality.svg").getroot()
    texts = [t.text for t in root.iter(SVG + "text")]
    assert len(list(root.iter(SVG + "polyline"))) == 4
    assert texts.index("ANDREA-12M: validation loss") < texts.index("ANDREA-120M: validation loss")  # small first
    assert texts.count("bf16") == texts.count("fp8") == 2


def test_the_summary_fails_when_fp8_is_off_or_nothing_is_there(tmp_path):
    write_runs(tmp_path / "a", "ANDREA-12M", 5.0, 5.1)
    out = summary_cmd(tmp_path / "a")
    assert out.returncode == 1 and "ANDREA-12M" in out.stdout and "FAIL (|+2.00%| > 1%)" in out.stdout
    assert not json.loads((tmp_path / "a" / "fp8-quality.json").read_text())["pass"]
    write_runs(tmp_path / "b", "ANDREA-12M", 5.0, 5.0, steps=1500)            # stopped early
    assert summary_cmd(tmp_path / "b").returncode == 1
    (tmp_path / "empty").mkdir()
    out = summary_cmd(tmp_path / "empty")
    assert out.returncode == 2 and out.stderr.startswith("error: no <model>-<precision>.jsonl")


def test_the_markdown_is_the_table_and_the_chart(tmp_path):
    write_runs(tmp_path, "ANDREA-12M", 5.0, 5.01)
    write_runs(tmp_path, "ANDREA-120M", 4.0, 4.1, ms=17.0)
    summary_cmd(tmp_path)
    out = subprocess.run([sys.executable, str(SCRIPT), "markdown", str(tmp_path / "fp8-quality.json"), "--chart",
                          "images/fp8-quality.svg"], capture_output=True, text=True, timeout=60, env=python_env())
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert lines[0] == "2000 steps each, same seed and data; NVIDIA H200, commit abc1234, 2026-12-01."
    assert lines[4] == "| ANDREA-12M | 5.0000 | 5.0100 | +0.20% | yes | 2.00 | 2.00 |"
    assert lines[5] == r"| ANDREA-120M | 4.0000 | 4.1000 | +2.50% | NO (\|+2.50%\| \> 1%) | 17.00 | 17.00 |"
    assert "![validation loss, bf16 and fp8](images/fp8-quality.svg)" in lines


def strict_json(path):
    def refuse(name):
        raise ValueError(f"{name} is not JSON")
    return json.loads(path.read_text(), parse_constant=refuse)


def test_a_diverged_run_fails_and_its_curve_ends_where_its_losses_stop(tmp_path):
    """The engine writes null for a NaN validation loss: the summary still draws the chart (the
    line leaves those points out), writes strict JSON and fails the model."""
    write_runs(tmp_path, "ANDREA-12M", 5.0, None)
    lines = records("fp8", 5.0).splitlines()
    for i, line in enumerate(lines):
        r = json.loads(line)
        if "val_loss" in r and r["step"] >= 1500:
            lines[i] = f'{{"step": {r["step"]}, "val_loss": {"NaN" if r["step"] == 1500 else "null"}}}'
    (tmp_path / "ANDREA-12M-fp8.jsonl").write_text("\n".join(lines) + "\n")
    out = summary_cmd(tmp_path)
    assert out.returncode == 1 and "FAIL (no finite final validation loss)" in out.stdout, out.stderr
    doc = strict_json(tmp_path / "fp8-quality.json")
    assert doc["models"]["ANDREA-12M"]["runs"]["fp8"]["val"][-1] == [2000, None]
    [bf16_line, fp8_line] = ET.parse(tmp_path / "fp8-quality.svg").getroot().iter(SVG + "polyline")
    assert len(bf16_line.get("points").split()) == 20 and len(fp8_line.get("points").split()) == 14


def test_damaged_records_are_skipped_and_repeated_steps_count_once(quality, tmp_path):
    path = tmp_path / "r.jsonl"
    lines = records("fp8", 4.0, steps=1000).splitlines()
    junk = ["not json", "[1, 2]", '{"step": "7", "loss": 1, "ms": 1}', '{"step": true, "val_loss": 1}',
            '{"step": 20, "loss": 1, "ms": "slow"}', '{"step": 21, "loss": 1, "ms": 1e999}',
            '{"step": 30, "val_loss": "low"}', '{"step": 30, "val_loss": -1e999}']
    path.write_text("\n".join(lines[:50] + junk + lines[50:] + lines[2:]) + '\n{"step": 1001, "loss": 4.0, "ms"')
    with open(path, "ab") as f:
        f.write(b'\n{"step": 1002, "loss": 4.0, "ms": 1\xff}\n')    # not UTF-8: that line is left out
    r = quality.read_run(str(path))
    assert r["steps"] == 1000 and r["ms_per_step"] == 2.0 and r["final_val_loss"] == 4.0
    assert [30, None] in r["val"] and [7, None] not in r["val"]
    write_runs(tmp_path / "twice", "ANDREA-12M", 5.0, 5.0, steps=1000)
    for f in (tmp_path / "twice").iterdir():                 # 1000 steps written twice are not 2000
        f.write_text(f.read_text() + f.read_text())
    out = summary_cmd(tmp_path / "twice")
    assert out.returncode == 1 and "stopped before step 2000" in out.stdout


def test_the_summary_refuses_a_run_in_two_folders_and_a_step_count_below_one(tmp_path):
    write_runs(tmp_path / "a", "ANDREA-12M", 5.0, 5.0)
    write_runs(tmp_path / "b", "ANDREA-12M", 5.0, 5.1)
    out = summary_cmd(tmp_path / "a", tmp_path / "b", "--out", tmp_path / "docs")
    assert out.returncode == 2 and out.stderr.startswith("error: ANDREA-12M-bf16.jsonl is in both")
    assert not (tmp_path / "docs").exists()
    out = summary_cmd(tmp_path / "a", "--steps", "0")
    assert out.returncode == 2 and out.stderr == "error: --steps must be >= 1\n"


def test_the_markdown_escapes_names_and_refuses_other_json(tmp_path):
    write_runs(tmp_path, "A|<img src=x>_[l](j)", 5.0, 5.1)
    summary_cmd(tmp_path)
    out = subprocess.run([sys.executable, str(SCRIPT), "markdown", str(tmp_path / "fp8-quality.json")],
                         capture_output=True, text=True, timeout=60, env=python_env())
    row = out.stdout.splitlines()[4]
    assert row.startswith("| A\\|\\<img src=x\\>\\_\\[l\\](j) | 5.0000 | 5.1000 | +2.00% | NO (\\|+2.00%\\| \\> 1%) |")
    assert row.replace("\\|", "").count("|") == 8                                   # seven cells
    for bad in ('{"kind": "bench"}', "[1]", '{"kind": "fp8_quality", "models": []}'):
        (tmp_path / "bad.json").write_text(bad)
        out = subprocess.run([sys.executable, str(SCRIPT), "markdown", str(tmp_path / "bad.json")],
                             capture_output=True, text=True, timeout=60, env=python_env())
        assert out.returncode == 2 and out.stderr.startswith("error: not an fp8 quality summary"), out.stderr


def test_the_environment_line_cannot_rename_the_summary_or_break_the_markdown(tmp_path):
    write_runs(tmp_path, "ANDREA-12M", 5.0, 5.0)
    for f in tmp_path.glob("*.jsonl"):
        env = ('{"event": "environment", "kind": "other", "source": "x", "date": 20261201, "gpu": ["H"], '
               '"commit": "<c1>"}')
        f.write_text(env + "\n" + f.read_text().split("\n", 1)[1])
    assert summary_cmd(tmp_path).returncode == 0
    doc = json.loads((tmp_path / "fp8-quality.json").read_text())
    assert doc["kind"] == "fp8_quality" and doc["source"] == "bench/fp8_quality.py" and doc["commit"] == "<c1>"
    assert "date" not in doc and "gpu" not in doc

    def md(*chart):
        return subprocess.run([sys.executable, str(SCRIPT), "markdown", str(tmp_path / "fp8-quality.json"), *chart],
                              capture_output=True, text=True, timeout=60, env=python_env())
    out = md("--chart", "my charts/fp8 (1).svg")
    assert out.returncode == 0, out.stderr
    first = out.stdout.splitlines()[0]
    assert first == r"2000 steps each, same seed and data; GPU unknown, commit \<c1\>, date unknown."
    assert "![validation loss, bf16 and fp8](<my charts/fp8 (1).svg>)" in out.stdout
    out = md("--chart", "a>b.svg")
    assert out.returncode == 2 and out.stderr.startswith("error: --chart 'a>b.svg': a link cannot hold")


def test_one_folder_named_twice_counts_once_and_a_pipe_is_refused(tmp_path):
    write_runs(tmp_path / "a", "ANDREA-12M", 5.0, 5.01)
    (tmp_path / "link").symlink_to(tmp_path / "a")
    out = summary_cmd(tmp_path / "a", f"{tmp_path / 'a'}/", tmp_path / "link")
    assert out.returncode == 0, out.stderr
    assert list(json.loads((tmp_path / "a" / "fp8-quality.json").read_text())["models"]) == ["ANDREA-12M"]
    os.mkfifo(tmp_path / "a" / "ANDREA-120M-fp8.jsonl")    # reading it would wait for a writer for ever
    out = summary_cmd(tmp_path / "a")
    assert out.returncode == 2 and out.stderr == f"error: {tmp_path / 'a' / 'ANDREA-120M-fp8.jsonl'} is not a regular file\n"


def test_a_record_file_whose_name_is_no_text_is_passed_over(tmp_path):
    """Bytes that are no UTF-8 (or a line break) in a model name could be neither printed nor drawn:
    such a file is no record `run` wrote, and the others are summarised."""
    write_runs(tmp_path, "ANDREA-12M", 5.0, 5.01)
    for stem in (b"ANDREA-\xff", b"A\nB"):
        (tmp_path / (stem + b"-bf16.jsonl").decode(errors="surrogateescape")).write_text(records("bf16", 5.0))
    out = summary_cmd(tmp_path)
    assert out.returncode == 0, out.stderr
    assert list(json.loads((tmp_path / "fp8-quality.json").read_text())["models"]) == ["ANDREA-12M"]


def markdown_of(tmp_path, doc):
    (tmp_path / "doc.json").write_text(json.dumps(doc))
    return subprocess.run([sys.executable, str(SCRIPT), "markdown", str(tmp_path / "doc.json")],
                          capture_output=True, text=True, timeout=60, env=python_env())


def _edit(model=None, run=None, **top):
    def edit(doc):
        entry = doc["models"]["ANDREA-12M"]
        entry["runs"]["fp8"].update(run or {})
        entry.update(model or {})
        doc.update(top)
    return edit


SUMMARY_DAMAGE = {"model_not_an_object": lambda doc: doc["models"].update({"ANDREA-12M": 1}),
                  "runs_not_an_object": _edit(model={"runs": [1]}), "pass_not_a_flag": _edit(model={"pass": "yes"}),
                  "rel_diff_text": _edit(model={"rel_diff": "x"}), "loss_a_list": _edit(run={"final_val_loss": [1]}),
                  "ms_not_finite": _edit(run={"ms_per_step": 1e400}), "steps_markup": _edit(steps="<b>2000</b>")}


@pytest.mark.parametrize("damage", sorted(SUMMARY_DAMAGE))
def test_the_markdown_refuses_a_summary_the_summary_would_not_write(tmp_path, damage):
    """A hand-edited summary gets one error line (no traceback, no markup passed through)."""
    write_runs(tmp_path, "ANDREA-12M", 5.0, 5.01)
    assert summary_cmd(tmp_path).returncode == 0
    doc = json.loads((tmp_path / "fp8-quality.json").read_text())
    assert markdown_of(tmp_path, doc).returncode == 0
    SUMMARY_DAMAGE[damage](doc)
    out = markdown_of(tmp_path, doc)
    assert out.returncode == 2 and out.stdout == "" and out.stderr.startswith("error: the summary's"), out.stderr
    assert len(out.stderr.splitlines()) == 1, out.stderr


def test_runs_of_two_commits_name_both_in_the_summary_and_its_markdown(tmp_path):
    """run --precision fp8 joined to an earlier bf16 folder: the summary's commit is not the first
    folder's alone (that would credit the candidate's result to the baseline's commit) but each
    run's, named by its run; a field the runs agree on stays as it is."""
    for precision, folder, commit, day in (("bf16", "a", "base111", "01"), ("fp8", "b", "cand222", "02")):
        (tmp_path / folder).mkdir()
        (tmp_path / folder / f"ANDREA-12M-{precision}.jsonl").write_text(
            records(precision, 5.0).replace('"abc1234"', f'"{commit}"').replace("2026-12-01", f"2026-12-{day}"))
    assert summary_cmd(tmp_path / "a", tmp_path / "b").returncode == 0
    doc = json.loads((tmp_path / "a" / "fp8-quality.json").read_text())
    assert doc["commit"] == "base111 (ANDREA-12M bf16), cand222 (ANDREA-12M fp8)" and doc["gpu"] == "NVIDIA H200"
    out = markdown_of(tmp_path / "a", doc)
    assert out.returncode == 0 and out.stdout.splitlines()[0].endswith(
        "commit base111 (ANDREA-12M bf16), cand222 (ANDREA-12M fp8), 2026-12-01, 2026-12-02."), out.stdout


def test_the_markdown_cuts_the_date_before_escaping_it(tmp_path):
    write_runs(tmp_path, "ANDREA-12M", 5.0, 5.01)
    assert summary_cmd(tmp_path).returncode == 0
    doc = json.loads((tmp_path / "fp8-quality.json").read_text())
    doc["date"] = "123456789<ignored"
    out = markdown_of(tmp_path, doc)
    assert out.returncode == 0 and out.stdout.splitlines()[0].endswith(r", 123456789\<."), out.stdout


@pytest.mark.parametrize("name", ["../escaped", "/tmp/abs", ".hidden", "a b", "<b>", 12])
def test_a_run_refuses_a_config_name_that_is_not_a_file_name(tmp_path, name):
    cfg = json.loads((REPO / "experiments" / "ANDREA-12M-TRAIN.json").read_text())
    cfg["name"] = name
    (tmp_path / "c.json").write_text(json.dumps(cfg))
    out = subprocess.run([sys.executable, str(SCRIPT), "run", str(tmp_path / "c.json"), "--out", str(tmp_path / "o"),
                          "--engine", "/bin/true"], capture_output=True, text=True, timeout=60, env=python_env())
    assert out.returncode == 2 and out.stderr.startswith("error: the config's name"), out.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c.json"]


def test_a_run_refuses_a_timeout_below_one_and_no_validation(tmp_path):
    for flags, message in ((["--timeout", "0"], "--timeout must be >= 1"),
                           (["--steps", "50", "--eval-every", "100"], "--eval-every 100 > --steps 50")):
        out = subprocess.run([sys.executable, str(SCRIPT), "run", "12M", "--out", str(tmp_path / "o"), *flags],
                             capture_output=True, text=True, timeout=60, env=python_env())
        assert out.returncode == 2 and message in out.stderr and not (tmp_path / "o").exists()


STANDIN = """#!/usr/bin/env python3
import json, sys
argv = [p for a in sys.argv[1:] for p in (a.split("=", 1) if a.startswith("--") else [a])]
args = dict(zip(argv[0::2], argv[1::2]))
steps, every = int(args["--train.steps"]), int(args["--eval.every"])
with open(sys.argv[0] + "." + args["--train.precision"] + ".flags", "w") as f:
    json.dump(args, f)
print(json.dumps({"event": "start", "steps": steps, "precision": args["--train.precision"]}))
for s in range(1, steps + 1):
    print(json.dumps({"step": s, "loss": 4.0, "ms": 1.0}))
    if s % every == 0:
        print(json.dumps({"step": s, "val_loss": 4.0 - s / 1000}))
"""


def standin_engine(tmp_path):
    """The stand-in engine and real-text shards of a whole run in tmp_path: (engine, shard flags)."""
    engine = tmp_path / "engine"
    engine.write_text(STANDIN)
    engine.chmod(0o755)
    from microgpt.shards import write_shard
    for split in ("train", "val"):
        write_shard(str(tmp_path / f"t_{split}_000000.bin"), list(range(100)) * 10)
    return engine, ["--data", str(tmp_path / "t_train_*.bin"), "--val", str(tmp_path / "t_val_*.bin")]


def test_a_whole_run_trains_both_precisions_from_the_experiment(tmp_path):
    engine, shards = standin_engine(tmp_path)
    out = subprocess.run([sys.executable, str(SCRIPT), "run", "12M", "--out", str(tmp_path / "out"), "--steps", "40",
                          "--eval-every", "10", "--engine", str(engine), *shards], capture_output=True, text=True,
                         timeout=120, env=python_env(ANDREA_COMMIT="feed123"))
    assert out.returncode == 0, out.stderr
    for precision in ("bf16", "fp8"):
        flags = json.loads((tmp_path / f"engine.{precision}.flags").read_text())
        assert flags["--train.precision"] == precision and flags["--train.seed"] == "1337"
        assert flags["--train.steps"] == "40" and flags["--train.warmup_steps"] == "1"   # 200/20000 of 40, at least 1
        assert flags["--eval.every"] == "10" and flags["--eval.batches"] == "20"
        assert flags["--data.val"] == str(tmp_path / "t_val_*.bin")
        assert flags["--sample.every"] == "0" and flags["--checkpoint.every"] == "0"
        assert not any(f.startswith("--polish") for f in flags)
    summary = summary_cmd(tmp_path / "out", "--steps", "40")
    assert summary.returncode == 0, summary.stdout + summary.stderr
    doc = json.loads((tmp_path / "out" / "fp8-quality.json").read_text())
    assert doc["commit"] == "feed123" and doc["models"]["ANDREA-12M"]["rel_diff"] == 0.0


def test_one_precision_runs_alone_and_joins_the_other_from_an_earlier_folder(tmp_path):
    engine, shards = standin_engine(tmp_path)
    for precision in ("bf16", "fp8"):
        out = subprocess.run([sys.executable, str(SCRIPT), "run", "12M", "--out", str(tmp_path / precision), "--steps",
                              "40", "--eval-every", "10", "--engine", str(engine), "--precision", precision, *shards],
                             capture_output=True, text=True, timeout=120, env=python_env())
        assert out.returncode == 0, out.stderr
        assert [p.name for p in (tmp_path / precision).glob("*.jsonl")] == [f"ANDREA-12M-{precision}.jsonl"]
    summary = summary_cmd(tmp_path / "bf16", tmp_path / "fp8", "--steps", "40")
    assert summary.returncode == 0, summary.stdout + summary.stderr
    bad = subprocess.run([sys.executable, str(SCRIPT), "run", "12M", "--precision", "fp16", *shards],
                         capture_output=True, text=True, timeout=60, env=python_env())
    assert bad.returncode == 2 and "--precision" in bad.stderr


def test_engine_args_reach_every_run_after_the_configs_flags(tmp_path):
    """--engine-arg: a candidate's runtime setting (the FP8 classifier's) in both runs' commands."""
    engine, shards = standin_engine(tmp_path)
    out = subprocess.run([sys.executable, str(SCRIPT), "run", "12M", "--out", str(tmp_path / "out"), "--steps", "20",
                          "--eval-every", "10", "--engine", str(engine), "--engine-arg=--train.fp8_classifier=all",
                          "--engine-arg=--eval.batches=3", *shards],
                         capture_output=True, text=True, timeout=120, env=python_env())
    assert out.returncode == 0, out.stderr
    for precision in ("bf16", "fp8"):
        flags = json.loads((tmp_path / f"engine.{precision}.flags").read_text())
        assert flags["--train.fp8_classifier"] == "all" and flags["--eval.batches"] == "3"   # the last one given
        assert "--train.fp8_classifier=all --eval.batches=3\n" in out.stdout


def test_a_run_without_real_text_is_refused(tmp_path):
    out = subprocess.run([sys.executable, str(SCRIPT), "run", "12M", "--out", str(tmp_path), "--data",
                          str(tmp_path / "none_*.bin")], capture_output=True, text=True, timeout=60, env=python_env())
    assert out.returncode == 2 and out.stderr.startswith("error: no shards match --data")


def test_svg_figures_are_valid_and_escape_their_text():
    from microgpt.svg_chart import svg_figure
    svg = svg_figure("a <b> & c", [("p<1>", "lines", [("x&y", [1, 2, 3], [3.0, 2.0, 1.0])]),
                                   ("flat", "lines", [("z", [1, 2], [1.0, 1.0])])])
    root = ET.fromstring(svg)
    texts = [t.text for t in root.iter(SVG + "text")]
    assert "a <b> & c" in texts and "p<1>" in texts and "x&y" in texts
    [first, second] = root.iter(SVG + "polyline")
    points = [tuple(map(float, p.split(","))) for p in first.get("points").split()]
    assert points[0][1] < points[-1][1] and points[0][0] < points[-1][0]   # falls left to right (SVG y grows down)
    assert len(second.get("points").split()) == 2                         # a flat series still draws


def test_svg_lines_leave_out_points_that_are_not_finite_and_text_drops_control_characters():
    from microgpt.svg_chart import svg_figure
    svg = svg_figure("t\x1b[31m", [("p\x00", "lines", [("a\x07", [1, 2, 3, 4], [2.0, None, float("nan"), 1.0]),
                                                       ("b", [1, 2], [float("inf"), None])])])
    root = ET.fromstring(svg)                                              # XML 1.0 forbids \x1b even escaped
    assert [t.text for t in root.iter(SVG + "text")][:2] == ["t[31m", "p"]
    [a, b] = root.iter(SVG + "polyline")
    assert len(a.get("points").split()) == 2 and b.get("points") == "" and "nan" not in svg


def test_svg_points_of_values_near_a_doubles_limit_stay_on_the_panel():
    """Finite values whose span is beyond a double's range (a loss of 1e308 in a run's file, with
    -1e308 beside it) made the scale's hi - lo infinite: the point at hi was drawn at "nan"."""
    from microgpt.svg_chart import svg_figure
    svg = svg_figure("t", [("y", "lines", [("a", [1, 2, 3], [-1e308, 0.0, 1e308])]),
                           ("x", "lines", [("b", [-1.7e308, 0.0, 1.7e308], [1.0, 2.0, 3.0])])])
    for line in ET.fromstring(svg).iter(SVG + "polyline"):
        points = [tuple(map(float, p.split(","))) for p in line.get("points").split()]
        assert len(points) == 3 and all(math.isfinite(v) for p in points for v in p), points
        assert points[0][0] < points[1][0] < points[2][0] and points[0][1] > points[2][1]


def test_svg_text_drops_the_noncharacters_and_lone_surrogates_xml_forbids():
    """A label (a data source's name, read from JSON) holding U+FFFF made a figure no XML parser
    reads, and one holding a lone surrogate ("\\ud800" in the JSON) a figure that could not be
    written as UTF-8 at all."""
    from microgpt.svg_chart import svg_figure
    svg = svg_figure("t\ufffe", [("p", "lines", [("a\uffffb\ud800c\udfffd", [1, 2], [1.0, 2.0])])])
    root = ET.fromstring(svg.encode("utf-8"))
    assert [t.text for t in root.iter(SVG + "text")][0] == "t" and "abcd" in [t.text for t in root.iter(SVG + "text")]


def test_svg_axes_of_constant_series_at_any_magnitude_and_points_with_x_not_finite():
    from microgpt.svg_chart import svg_figure
    svg = svg_figure("t", [("big y", "lines", [("a", [1, 2, 3], [2e7] * 3)]),        # lo + 1e-9 == lo there
                           ("big x", "lines", [("b", [1e17] * 3, [1.0, 2.0, 3.0])]),  # lo + 1 == lo there
                           ("x not finite", "lines", [("c", [1, float("nan"), 3], [1.0, 2.0, 3.0])])])
    a, b, c = (p.get("points").split() for p in ET.fromstring(svg).iter(SVG + "polyline"))
    assert len(a) == 3 and len(b) == 3 and len(c) == 2 and "nan" not in svg


def test_the_gpu_check_names_the_quality_stages(tmp_path):
    out = subprocess.run(["bash", str(REPO / "scripts" / "fp8-check.sh"), "nosuch"], capture_output=True, text=True,
                         timeout=60, env=python_env(OUT=str(tmp_path)))
    assert out.returncode == 2 and "unknown stage 'nosuch'" in out.stderr
    assert "quality2000_12M quality2000_120M" in out.stderr


@pytest.mark.parametrize("stage", ["sanitizer timing", "quality2000", "", "stage_build"])
def test_the_gpu_check_takes_only_whole_stage_names(tmp_path, stage):
    out = subprocess.run(["bash", str(REPO / "scripts" / "fp8-check.sh"), stage], capture_output=True, text=True,
                         timeout=60, env=python_env(OUT=str(tmp_path)))
    assert out.returncode == 2 and f"error: unknown stage '{stage}'" in out.stderr
