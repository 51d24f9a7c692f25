"""bench/timeline.py, the summary of bench/timeline.c's records: a step is the stretch between two
AdamW ends, its idle time is where no record runs, and a kernel's exclusive time is what it adds
after everything that started before it had ended (a programmatic launch waits inside its
predecessor). On records made up here, whose figures are known."""
import subprocess
import sys

import engine_util as eu

HEADER = "start_ns,end_ns,stream,blocks,threads,smem,regs,name\n"


def write_run(path, steps=5):
    """steps steps of 100 µs: a product 0–30 µs, a kernel launched inside it (20–50), a side-stream
    kernel (35–45), nothing 50–60, AdamW 60–100 (µs from the step's start)."""
    lines = [HEADER]
    for s in range(steps):
        t = s * 100_000
        lines += [f"{t},{t + 30_000},7,132,256,0,32,_Z9k_productv\n",
                  f"{t + 20_000},{t + 50_000},7,64,256,0,32,_Z5k_pdlv\n",
                  f"{t + 35_000},{t + 45_000},9,8,256,0,32,_Z6k_sidev\n",
                  f"{t + 60_000},{t + 100_000},7,512,256,0,32,_Z7k_adamwv\n"]
    path.write_text("".join(lines))


def run(*args):
    return subprocess.run([sys.executable, str(eu.REPO / "bench" / "timeline.py"), *map(str, args)],
                          capture_output=True, text=True, timeout=60, env=eu.python_env(), cwd=eu.REPO)


def figures(out):
    return {line.split()[0]: float(line.split()[1]) for line in out.splitlines()
            if line.startswith("  ") and not line.startswith("   ") and len(line.split()) == 2}


def test_a_step_is_summed_between_two_adamw_ends(tmp_path):
    write_run(tmp_path / "k.csv")
    res = run(tmp_path / "k.csv", "--steps", "2", "--list", tmp_path / "step.csv")
    assert res.returncode == 0, res.stderr
    f = figures(res.stdout)
    assert f["step_us"] == 100.0 and f["kernels"] == 4 and f["side_kernels"] == 1
    assert f["idle_us"] == 10.0  # 50–60 µs
    assert f["side_hidden_us"] == 10.0 and f["side_alone_us"] == 0.0
    # exclusive: the product 30, the kernel launched inside it 20 more, the side one 0, AdamW 40
    rows = {line.split()[-1]: line.split() for line in res.stdout.splitlines() if line.startswith("    ")}
    assert rows["k_pdl"][1:3] == ["30.0", "20.0"] and rows["k_side"][1:3] == ["10.0", "0.0"]
    listed = (tmp_path / "step.csv").read_text().splitlines()
    assert listed[0].startswith("start_us,") and len(listed) == 5 and listed[1].startswith("0.00,30.00,")


def test_records_it_cannot_read_are_one_error_line(tmp_path):
    (tmp_path / "bad.csv").write_text(HEADER + "1,2,3,four,5,6,7,x\n")
    res = run(tmp_path / "bad.csv")
    assert res.returncode == 1 and res.stderr.startswith("error: ") and "line 2" in res.stderr
    assert len(res.stderr.splitlines()) == 1


def test_a_record_that_ends_before_it_starts_is_one_error_line(tmp_path):
    (tmp_path / "bad.csv").write_text(HEADER + "50,40,7,1,1,0,0,k\n")
    res = run(tmp_path / "bad.csv")
    assert res.returncode == 1 and res.stderr.startswith("error: ") and "line 2 ends before it starts" in res.stderr
    assert len(res.stderr.splitlines()) == 1


def test_a_run_without_two_whole_steps_is_refused(tmp_path):
    write_run(tmp_path / "k.csv", steps=2)
    res = run(tmp_path / "k.csv")
    assert res.returncode == 1 and "no whole step" in res.stderr and len(res.stderr.splitlines()) == 1


def test_the_last_step_is_summed_by_part(tmp_path):
    """Parts by name (bench/timeline.py's PARTS): a product, an attention kernel launched inside it, a
    memset, AdamW; exclusive times as above."""
    lines = [HEADER]
    for s in range(3):
        t = s * 100_000
        lines += [f"{t},{t + 30_000},7,132,256,0,32,nvjet_sm90_tst_128x128_64x6\n",
                  f"{t + 20_000},{t + 50_000},7,64,256,0,32,_Z16k_attn_fwd_wgmmav\n",
                  f"{t + 55_000},{t + 56_000},7,1,1,0,0,[memset]\n",
                  f"{t + 60_000},{t + 100_000},7,512,256,0,32,_Z7k_adamwv\n"]
    (tmp_path / "k.csv").write_text("".join(lines))
    res = run(tmp_path / "k.csv", "--steps", "1")
    assert res.returncode == 0, res.stderr
    parts = {line.split()[1]: line.split()[2:] for line in res.stdout.splitlines() if line.startswith("  part ")}
    assert parts == {"products": ["30.0", "1"], "attention": ["20.0", "1"], "memsets_copies": ["1.0", "1"],
                     "adamw_norm": ["40.0", "1"]}
