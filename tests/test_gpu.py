"""GPU engine checks (docs/DESIGN.md §8): every test here is marked `gpu` and skips without an NVIDIA GPU or
without build/microgpt_cuda. Run on the GPU machine by scripts/gpu-check.sh:

    python3 -m pytest -m gpu -v tests/test_gpu.py

What is compared, and how tightly (relative, normwise per tensor):
  * kernel by kernel: build/kernel_check (tests/kernel_check.cu; its own tolerance table);
  * one forward/backward of the whole model (--dump-grads) against the CPU engine: loss and every
    gradient tensor. fp32 must agree to 1e-4 (no TF32; the rest is summation order, ~1e-6);
    bf16 to 5e-2 and fp16 to 2e-2 (16-bit activations: ~5e-3 and ~1e-3 measured on a CPU
    emulation of the kernels; the loss also carries 16-bit logits), tf32 as fp16 (fp32 activations,
    but every product's inputs rounded to TF32's 10-bit mantissa, as fp16's); padded embedding
    rows must get exactly zero gradient;
  * ten AdamW steps with grad_accum 2 against the CPU engine: every loss, lr, grad norm and the
    final checkpoint (fp32 tight; bf16 losses within 2e-2);
  * exact resume after SIGTERM in bf16, fp16 and fp8 (fp32 resume, SIGUSR1 and device memory are
    also run on the GPU by tests/test_engine.py through its `engine` fixture), fp16 overflow
    handling, the memory plan, and the refusal of shapes FP8 products cannot contract;
  * replayed graphs against launch by launch and synchronised after every launch, bit for bit, with
    what docs/DESIGN.md §9 makes the engine do on a small model: programmatic dependent launch on a
    9.0+ GPU (kernel_check's banner says so too) and the weight gradients on the side stream;
  * precision fp8 against the CPU engine's fp8 emulation (docs/DESIGN.md §18): loss within 2e-2, and
    each gradient tensor within 5e-2 + 3x that tensor's fp8 noise (its CPU fp8 vs CPU fp32 distance,
    measured 0.07-0.11 for the linear weights of these shapes), at most 0.5. The emulation casts the
    CPU's fp32 activations where the GPU casts bf16 ones, so some fp8 codes differ by one step, and
    each difference moves the values cast after it: over a few layers the two fp8 runs drift apart
    by about fp8's own rounding noise (two independent roundings: ~1.4x it). The GPU's fp8 GELU
    takes the hardware's approximate tanh where the emulation keeps glibc's tanhf: it moves the
    codes by far less than that noise (kernel_check's "gelu fast tanh" lines). A wrong layout,
    transposition or scale gives errors of order 1. The GPU's fp8 gradients must also differ from
    its bf16 ones (the FP8 path ran).
The engines are compared on tiny configurations with small vocabularies, in seconds.
"""
import ctypes
import json
import os
import re
import shutil
import subprocess

import numpy as np
import pytest

import engine_util as eu
from conftest import gpu_present
from engine_util import rel_err, run_ok, tiny_args

from microgpt.checkpoint import read_checkpoint, read_sidecar

pytestmark = pytest.mark.gpu

KERNEL_CHECK = eu.BUILD / "kernel_check"
KERNEL_CHECK_SRC = eu.REPO / "tests" / "kernel_check.cu"
# ANDREA_CUDA_ENGINE / ANDREA_KERNEL_CHECK: test other builds of the two GPU binaries (for instance
# builds of the same sources against a CPU emulation of CUDA, or a -D variant built with
# KERNEL_VARIANTS); no GPU is then required. ANDREA_CUDA_BASELINE: a second engine build that the
# one under test must match bit for bit (a variant that only reorders work against the default build;
# bench/engine-ab.sh runs it so).
OVERRIDE_ENGINE = os.environ.get("ANDREA_CUDA_ENGINE")
OVERRIDE_KERNEL_CHECK = os.environ.get("ANDREA_KERNEL_CHECK")
BASELINE_ENGINE = os.environ.get("ANDREA_CUDA_BASELINE")

# Two shapes: TINY with a padded vocabulary, and one with odd sizes everywhere (T not a multiple of
# any tile, head size 16, d_ff not 4·d, rows B·T = 111).
SHAPES = {
    "tiny": {"model.padded_vocab_size": 128},
    "odd": {"model.n_layer": 3, "model.d_model": 48, "model.n_head": 3, "model.d_ff": 100, "model.seq_len": 37,
            "model.vocab_size": 100, "model.padded_vocab_size": 128, "train.batch_size": 3},
    # d_model 64, 128 positions, 256 padded rows: in bf16 on Hopper, the fused classifier backward
    # (cuda/classifier_grad.cuh; 200 words: the last vocabulary tile masked, a block of padded rows)
    "cls": {"model.n_layer": 1, "model.d_model": 64, "model.n_head": 2, "model.d_ff": 128, "model.seq_len": 64,
            "model.vocab_size": 200, "model.padded_vocab_size": 256, "train.batch_size": 2},
}
GRAD_TOL = {"fp32": 1e-4, "tf32": 2e-2, "bf16": 5e-2, "fp16": 2e-2, "fp8": 5e-2}
FP8_GRAD_TOL_NOISE, FP8_GRAD_TOL_MAX = 3.0, 0.5  # fp8: 5e-2 + 3 x the tensor's fp8 noise, at most 0.5
LOSS_TOL = {"fp32": 1e-5, "tf32": 5e-3, "bf16": 1e-2, "fp16": 5e-3, "fp8": 2e-2}
# FP8 products need d_model, d_ff and T multiples of 16: an odd-sized fp8 shape within that rule
# (3 heads of 16, d_ff not 4·d, 3 sequences)
FP8_SHAPES = {
    "tiny": {"model.padded_vocab_size": 128},
    "odd": {"model.n_layer": 3, "model.d_model": 48, "model.n_head": 3, "model.d_ff": 112, "model.seq_len": 48,
            "model.vocab_size": 100, "model.padded_vocab_size": 128, "train.batch_size": 3},
}


@pytest.fixture(scope="module")
def cuda_binary():
    if OVERRIDE_ENGINE:
        return OVERRIDE_ENGINE
    if not gpu_present():
        pytest.skip("no GPU (nvidia-smi -L lists none)")
    if not eu.CUDA_BINARY.exists():
        pytest.skip(f"{eu.CUDA_BINARY} not built (make cuda)")
    return eu.CUDA_BINARY


def build_variant(suffix, flags, *binaries):
    """Builds the build/ binaries named (each ending in `suffix`) with the compile-time `flags` (the
    Makefile's VARIANT_SUFFIX and KERNEL_VARIANTS), beside the default build."""
    targets = [str(b.relative_to(eu.REPO)) for b in binaries]
    made = subprocess.run(["make", "-B", "-j2", f"VARIANT_SUFFIX={suffix}", f"KERNEL_VARIANTS={flags}", *targets],
                          cwd=eu.REPO, capture_output=True, text=True, timeout=900)
    assert made.returncode == 0, made.stdout[-2000:] + made.stderr[-2000:]


@pytest.fixture(scope="module")
def kernel_check_binary(cuda_binary):
    """build/kernel_check: `make kernel-check` (remade when its source is newer)."""
    if OVERRIDE_KERNEL_CHECK:
        return OVERRIDE_KERNEL_CHECK
    if not KERNEL_CHECK.exists() or KERNEL_CHECK.stat().st_mtime < KERNEL_CHECK_SRC.stat().st_mtime:
        made = subprocess.run(["make", "kernel-check"], cwd=eu.REPO, capture_output=True, text=True, timeout=900)
        assert made.returncode == 0 and KERNEL_CHECK.exists(), \
            f"make kernel-check failed:\n{made.stdout[-3000:]}\n{made.stderr[-3000:]}"
    return KERNEL_CHECK


# ---------------------------------------------------------------------------------------------------
# kernels

def test_kernel_check(kernel_check_binary):
    """Every kernel pair against its CPU layer, fp32/bf16/fp16, fresh random inputs (seed printed).
    kernel_check launches through the engine's launch helper: on a 9.0+ GPU, running the Makefile's
    build (kernels compiled for the GPU), every kernel is a programmatic dependent launch."""
    res = subprocess.run([str(kernel_check_binary)], capture_output=True, text=True, timeout=600)
    failed = [l for l in res.stdout.splitlines() if l.startswith("FAIL")]
    assert res.returncode == 0 and not failed, "\n".join(failed[:40]) + "\n" + res.stdout[-2000:] + res.stderr[-2000:]
    assert "checks, 0 failed" in res.stdout.splitlines()[-1]
    if not OVERRIDE_KERNEL_CHECK:
        banner = res.stdout.splitlines()[0]
        major = int(re.search(r"\(cc (\d+)\.\d+\)", banner).group(1))
        assert (", programmatic dependent launch" in banner) == (major >= 9), banner


def run_kernel_check_only(binary, only, marker=None, count=0):
    """`kernel_check --only ONLY`: exit status 0, a positive count of checks and none failed; where
    `marker` is given, exactly `count` lines holding it, each a PASS."""
    res = subprocess.run([str(binary), "--only", only], capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-2000:]
    m = re.search(r"kernel_check: (\d+) checks, 0 failed", res.stdout.splitlines()[-1])
    assert m and int(m.group(1)) > 0, res.stdout[-2000:]
    if marker:
        lines = [line for line in res.stdout.splitlines() if marker in line]
        assert len(lines) == count and all(line.startswith("PASS") for line in lines), "\n".join(lines)


def assert_kernel_check_refuses(binary, args, message):
    """kernel_check ARGS: one error line holding `message` and exit status 2."""
    bad = subprocess.run([str(binary), *args], capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and message in bad.stderr and bad.stderr.count("\n") == 1, bad.stderr


def test_kernel_check_attention_only(kernel_check_binary):
    """`--only attn` (bench/attn-variants.sh checks each build with it): the attention pair
    alone, at every shape, passing; an unknown --only value is one error line and exit status 2."""
    run_kernel_check_only(kernel_check_binary, "attn")
    assert_kernel_check_refuses(kernel_check_binary, ["--only", "mlpx"], "error: --only takes attn")


def test_kernel_check_classifier_only(kernel_check_binary):
    """`--only classifier` (the sanitizer stage of scripts/gpu-check.sh runs it): the classifier's
    loss and backward alone, bf16, passing, with a path line per shape and fusion setting; it
    refuses a precision it has no checks in."""
    run_kernel_check_only(kernel_check_binary, "classifier", "classifier backward:", 18)
    assert_kernel_check_refuses(kernel_check_binary, ["--only", "classifier", "--prec", "fp16"],
                                "--only classifier checks bf16 alone")


def test_kernel_check_mlp_only(kernel_check_binary):
    """`--only mlp` (the sanitizer stage of scripts/gpu-check.sh runs it over Hopper's GELU-backward
    product): the MLP pair at its two pingpong shapes, bf16, passing, each with a path line naming
    the kernel the GPU should run (the pingpong kernel on Hopper, cuBLASLt elsewhere); it refuses
    another precision."""
    run_kernel_check_only(kernel_check_binary, "mlp", "GELU-backward product:", 2)
    assert_kernel_check_refuses(kernel_check_binary, ["--only", "mlp", "--prec", "fp16"],
                                "--only mlp checks bf16 alone")


def test_kernel_check_embedding_only(kernel_check_binary):
    """`--only embed` (a short run for compute-sanitizer over embed.cuh): the embedding pair at its
    own shapes in fp32, bf16 and fp16, passing, the token sums' order bit for bit at each; it
    refuses fp8, which has no embedding checks of its own."""
    run_kernel_check_only(kernel_check_binary, "embed", "dwte_ord", 3 * 6 * 2)
    assert_kernel_check_refuses(kernel_check_binary, ["--only", "embed", "--prec", "fp8"],
                                "--only embed has no fp8 checks")


def test_kernel_check_names_the_attention_kernels_that_ran(kernel_check_binary):
    """`--only attn` reports, once per 16-bit type, which attention forward and which dK/dV kernel
    ran, and passes only if each is the one the GPU should run: the Hopper (wgmma) kernels on
    compute capability 9.0 (the Makefile builds sm_90a), the mma.sync kernels elsewhere
    (docs/DESIGN.md §9)."""
    res = subprocess.run([str(kernel_check_binary), "--only", "attn"], capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-2000:]
    for kernel in (" forward kernel ", " dK/dV kernel "):
        paths = [line for line in res.stdout.splitlines() if kernel in line]
        assert len(paths) == 2 and all(line.startswith("PASS") for line in paths), \
            "\n".join(paths) or res.stdout[-2000:]


def test_attn_bench_prints_every_kernel(cuda_binary):
    """bench/attn_bench.cu, the flash kernels' microbenchmark (bench/attn-variants.sh runs one per
    build): one line per model and kernel, with a positive time."""
    made = subprocess.run(["make", "build/attn_bench"], cwd=eu.REPO, capture_output=True, text=True, timeout=900)
    assert made.returncode == 0, made.stdout[-2000:] + made.stderr[-2000:]
    res = subprocess.run([str(eu.BUILD / "attn_bench")], capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-2000:]
    rows = [line.split() for line in res.stdout.splitlines()]
    want = [(m, k) for m in ("120M", "12M") for k in ("forward", "delta", "dk_dv", "dq", "backward")]
    assert [(r[1], r[2]) for r in rows] == want, res.stdout
    assert all(r[0] == "attn_bench" and float(r[3]) > 0 for r in rows), res.stdout


def test_lt_algos_probes_every_product_of_a_step_in_the_generators_format(cuda_binary, tmp_path):
    """bench/lt_algos.cu at ANDREA-12M: a line per product of the step, bf16 and fp8, learnt from the
    engine's own calls (launches a step counted), that bench/lt_table.py reads and makes a table of."""
    import lt_table
    made = subprocess.run(["make", "build/lt_algos"], cwd=eu.REPO, capture_output=True, text=True, timeout=900)
    assert made.returncode == 0, made.stdout[-2000:] + made.stderr[-2000:]
    res = subprocess.run([str(eu.BUILD / "lt_algos"), "12M"], capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-2000:]
    if " cc=9.0 " not in res.stdout:
        pytest.skip("the fixed table is for compute capability 9.0 (the generator refuses others)")
    env, products = lt_table.parse(res.stdout)
    assert env["sms"] > 0 and env["cublaslt"] > 0
    calls = {(p["prec"], p["key"]): p["calls"] for p in products}
    # the products of one layer run 6 times a step; dx = dout W^T (N x C x C) by W_O's backward and
    # the three of QKV's: 24; the classifier's, one chunk of 4096 rows, once
    assert calls[("bf16", "bf16.bf16.bf16.plain.nt.4096x192x192.ld192.192.192")] == 24
    assert calls[("bf16", "bf16.bf16.bf16.plain.nt.4096x50304x192.ld192.192.50304")] == 1
    assert calls[("bf16", "bf16.bf16.fp32.plain.tn.50304x192x4096.ld50304.192.192")] == 1
    assert calls[("bf16", "bf16.bf16.fp32.plain.tn.192x768x4096.ld192.768.768")] == 6
    assert {p["product"] for p in products if p["prec"] == "bf16"} == {
        "qkv_fwd", "wo_fwd", "mlp_fwd", "classifier", "mlp_bwd", "wo_bwd", "qkv_bwd"}
    # fp8: W_O's forward and its dx have one shape, as W_1's forward and W_2's dx have, and W_2's
    # forward and W_1's dx; below d_model 512 the input gradients accumulate fast as the forward's
    # products do (FP8_FAST_INPUT_GRADS_BELOW: the kind fp8fa), so each shape is one key: QKV's
    # forward, those three, QKV's dx and the 4 weight gradients
    assert calls[("fp8", "e4m3.e4m3.bf16.fp8fa.nt.4096x192x192.ld192.192.192")] == 12
    assert calls[("fp8", "e4m3.e4m3.bf16.fp8fa.nt.4096x768x192.ld192.192.768")] == 12
    assert calls[("fp8", "e4m3.e4m3.bf16.fp8fa.nt.4096x192x768.ld768.768.192")] == 12
    # no product with bf16 out (the forward's, the input gradients) accumulates slowly (kind fp8)
    assert not [p for p in products if p["prec"] == "fp8" and ".fp8." in p["key"] and ".bf16." in p["key"]]
    assert len([p for p in products if p["prec"] == "fp8"]) == 9
    assert all(p["offers"] >= 1 and p["rule_us"] > 0 and p["best_us"] > 0 for p in products)
    (tmp_path / "lt.txt").write_text(res.stdout)
    assert lt_table.main([str(tmp_path / "lt.txt"), "-o", str(tmp_path / "table.h")]) == 0


def cublaslt_version(binary):
    """cublasLtGetVersion() of the libcublasLt that `binary` loads (ldd), or None."""
    linked = subprocess.run(["ldd", str(binary)], capture_output=True, text=True).stdout
    m = re.search(r"libcublasLt\.so\S* => (/\S+)", linked)
    if not m:
        return None
    lib = ctypes.CDLL(m.group(1))
    lib.cublasLtGetVersion.restype = ctypes.c_size_t
    return lib.cublasLtGetVersion()


def test_the_fixed_table_applies_only_on_the_gpu_and_cublaslt_it_was_measured_on(cuda_binary, random_shards,
                                                                                   tmp_path):
    """A model with ANDREA-12M's products (4096 rows, d_model 192, d_ff 768, padded vocabulary
    50304): the engine says it takes the table's algorithms exactly when this GPU has the table's
    name (an H100 has the H200's compute capability and multiprocessor count), compute capability
    9.0 and multiprocessor count, and this cuBLASLt is the table's; which of the step's products
    the table holds (bench/lt_table.py's choice) does not enter that decision."""
    header = (eu.REPO / "microgpt" / "cuda" / "lt_table_sm90.h").read_text()
    name = re.search(r'#define LT_TABLE_GPU_NAME "(.*)"', header).group(1)
    sms = int(re.search(r"#define LT_TABLE_SM_COUNT (\d+)", header).group(1))
    version = int(re.search(r"#define LT_TABLE_CUBLASLT_VERSION (\d+)", header).group(1))
    res = run_ok(cuda_binary, tiny_args(random_shards.train, **{
        "model.n_layer": 1, "model.d_model": 192, "model.n_head": 3, "model.d_ff": 768, "model.seq_len": 512,
        "model.vocab_size": 50257, "model.padded_vocab_size": 50304, "train.batch_size": 8,
        "train.precision": "bf16", "dump_grads": tmp_path / "gpu.grads"}))
    device = re.search(r"device \d+: (.*), compute capability (\d+\.\d+),", res.stderr)
    got_sms = int(re.search(r"\((\d+) multiprocessors\)", res.stderr).group(1))
    expected = (device.group(1) == name and device.group(2) == "9.0" and got_sms == sms
                and cublaslt_version(cuda_binary) == version)
    applied = f"cuBLASLt algorithms: the fixed table measured on {name}" in res.stderr
    assert applied == expected, (device.groups(), got_sms, cublaslt_version(cuda_binary), res.stderr[-2000:])


# ---------------------------------------------------------------------------------------------------
# the whole model against the CPU engine

@pytest.mark.parametrize("precision", ["fp32", "tf32", "bf16", "fp16"])
@pytest.mark.parametrize("shape", list(SHAPES))
def test_gradients_match_cpu_engine(cuda_binary, cpu_binary, random_shards, tmp_path, shape, precision):
    overrides = SHAPES[shape]
    cpu_dump, gpu_dump = tmp_path / "cpu.grads", tmp_path / "gpu.grads"
    run_ok(cpu_binary, tiny_args(random_shards.train, **{**overrides, "dump_grads": cpu_dump}))
    run_ok(cuda_binary, tiny_args(random_shards.train, **{**overrides, "dump_grads": gpu_dump,
                                                           "train.precision": precision}))
    cpu_loss, cpu_grads = eu.read_grad_dump(cpu_dump)
    gpu_loss, gpu_grads = eu.read_grad_dump(gpu_dump)
    assert cpu_grads.size == gpu_grads.size
    assert abs(gpu_loss - cpu_loss) <= LOSS_TOL[precision] * abs(cpu_loss), (gpu_loss, cpu_loss)

    errors = {}
    for name, (sl, _) in eu.tensor_slices(eu.layout_for(overrides)).items():
        errors[name] = rel_err(gpu_grads[sl], cpu_grads[sl])
    bad = {k: v for k, v in errors.items() if not v <= GRAD_TOL[precision]}
    assert not bad, f"{precision}: tensors beyond {GRAD_TOL[precision]}: {bad}\nall: {errors}"

    s = {**eu.TINY, **overrides}
    V, d = s["model.vocab_size"], s["model.d_model"]
    wte, (Vp, _) = eu.tensor_slices(eu.layout_for(overrides))["wte"]
    padded = gpu_grads[wte.start + V * d: wte.stop]
    assert padded.size == (Vp - V) * d and not padded.any(), "padded wte rows received gradient"


def test_ten_adamw_steps_match_cpu_engine(cuda_binary, cpu_binary, random_shards, tmp_path):
    settings = {**SHAPES["tiny"], "train.steps": 10, "train.grad_accum": 2, "train.lr": 3e-3, "train.warmup_steps": 2,
                "train.weight_decay": 0.1, "eval.every": 5, "eval.batches": 2}
    args = tiny_args(random_shards.train, random_shards.val, **settings)
    cpu = run_ok(cpu_binary, args + ["--checkpoint", tmp_path / "cpu.ckpt"])
    gpu = run_ok(cuda_binary, args + ["--checkpoint", tmp_path / "gpu.ckpt"])
    # every step and both validations on each side, so that the pairs below are all of them
    assert [r["step"] for r in gpu.steps] == [r["step"] for r in cpu.steps] == list(range(1, 11))
    assert [v["step"] for v in gpu.vals] == [v["step"] for v in cpu.vals] == [5, 10], (cpu.vals, gpu.vals)
    for c, g in zip(cpu.steps, gpu.steps):
        assert g["lr"] == c["lr"]
        assert abs(g["loss"] - c["loss"]) <= 1e-5 * abs(c["loss"]), (c, g)
        assert abs(g["grad_norm"] - c["grad_norm"]) <= 1e-4 * abs(c["grad_norm"]), (c, g)
    for c, g in zip(cpu.vals, gpu.vals):
        assert abs(g["val_loss"] - c["val_loss"]) <= 1e-5 * abs(c["val_loss"]), (c, g)
    a, b = read_checkpoint(tmp_path / "cpu.ckpt"), read_checkpoint(tmp_path / "gpu.ckpt")
    assert a.step == b.step == 10
    assert rel_err(b.params, a.params) <= 1e-5, rel_err(b.params, a.params)
    assert rel_err(b.m, a.m) <= 1e-4, rel_err(b.m, a.m)
    assert rel_err(b.v, a.v) <= 1e-4, rel_err(b.v, a.v)


def test_bf16_training_tracks_cpu_engine(cuda_binary, cpu_binary, random_shards):
    settings = {**SHAPES["odd"], "train.steps": 10, "train.lr": 3e-3, "train.warmup_steps": 2}
    cpu = run_ok(cpu_binary, tiny_args(random_shards.train, **settings))
    gpu = run_ok(cuda_binary, tiny_args(random_shards.train, **{**settings, "train.precision": "bf16"}))
    assert gpu.events("start")[0]["compute_precision"] == "bf16"
    assert [r["step"] for r in gpu.steps] == [r["step"] for r in cpu.steps] == list(range(1, 11))
    for c, g in zip(cpu.steps, gpu.steps):
        assert abs(g["loss"] - c["loss"]) <= 2e-2 * abs(c["loss"]), (c, g)


# ---------------------------------------------------------------------------------------------------
# exact resume, fp16 loss scaling, memory, refusals

RESUME = {"train.steps": 400, "train.lr": 3e-3, "train.warmup_steps": 3, "eval.every": 50, "eval.batches": 2,
          "sample.every": 100, "sample.tokens": 6, "sample.prompt": ["1,2,3", "7"]}


@pytest.mark.parametrize("precision", ["bf16", "fp16", "fp8"])
def test_exact_resume_after_sigterm(cuda_binary, random_shards, tmp_path, precision):
    args = tiny_args(random_shards.train, random_shards.val, **{**RESUME, "train.precision": precision})
    ref_ckpt, ckpt = eu.check_exact_resume_after_sigterm(cuda_binary, args, RESUME["train.steps"], tmp_path)
    assert read_sidecar(ckpt)["loss_scale"] == read_sidecar(ref_ckpt)["loss_scale"]


def test_exact_resume_through_the_fused_classifier_backward(cuda_binary, random_shards, tmp_path):
    """bf16 at a shape the fused classifier backward takes on Hopper (elsewhere the loss rows':
    the engine says which), resumed exactly through SIGTERM."""
    settings = {**RESUME, **SHAPES["cls"], "train.precision": "bf16"}
    res = run_ok(cuda_binary, tiny_args(random_shards.train, random_shards.val, **{**settings, "train.steps": 3}))
    fused = "classifier backward: the softmax folded into its products" in res.stderr
    assert fused == ("compute capability 9.0" in res.stderr), res.stderr[-2000:]
    args = tiny_args(random_shards.train, random_shards.val, **settings)
    eu.check_exact_resume_after_sigterm(cuda_binary, args, RESUME["train.steps"], tmp_path)


def test_fp16_overflow_skips_steps_and_lowers_the_scale(cuda_binary, random_shards, tmp_path):
    """A loss scale of 2^30 overflows fp16 at once: the step must be skipped (weights and moments
    untouched, grad_norm null), the scale halved each time, and training must recover."""
    ckpt = tmp_path / "run.ckpt"

    def args(steps, resume=False):
        return tiny_args(random_shards.train, **{"train.precision": "fp16", "checkpoint": ckpt, "train.steps": steps,
                                                 "resume": resume})

    first = run_ok(cuda_binary, args(1))
    assert first.steps[0]["loss_scale"] == 65536 and "skipped" not in first.steps[0]
    side = read_sidecar(ckpt)
    side["loss_scale"] = float(2 ** 30)
    (tmp_path / "run.ckpt.json").write_text(json.dumps(eu.reseal_values(side)))
    shutil.copyfile(ckpt, tmp_path / "start.ckpt")
    shutil.copyfile(tmp_path / "run.ckpt.json", tmp_path / "start.ckpt.json")

    one = run_ok(cuda_binary, args(2, resume=True))
    assert one.steps[0]["skipped"] is True and one.steps[0]["loss_scale"] == 2 ** 29, one.steps
    assert one.steps[0]["grad_norm"] is None
    before, after = read_checkpoint(tmp_path / "start.ckpt"), read_checkpoint(ckpt)
    assert after.step == 2
    assert np.array_equal(before.params, after.params) and np.array_equal(before.m, after.m) \
        and np.array_equal(before.v, after.v), "a skipped step changed the state"
    assert read_sidecar(ckpt)["loss_scale"] == 2 ** 29

    shutil.copyfile(tmp_path / "start.ckpt", ckpt)
    shutil.copyfile(tmp_path / "start.ckpt.json", tmp_path / "run.ckpt.json")
    many = run_ok(cuda_binary, args(31, resume=True))
    scales = [r["loss_scale"] for r in many.steps]
    skipped = [bool(r.get("skipped")) for r in many.steps]
    n_skip = skipped.index(False) if False in skipped else len(skipped)
    assert 0 < n_skip < len(skipped), f"never recovered: {scales}"
    assert scales[:n_skip] == [2.0 ** (29 - i) for i in range(n_skip)], scales
    # later batches may overflow at the scale the first clean step found, but mostly they don't, and
    # the scale only ever goes down here (growth needs 1000 steps)
    assert skipped.count(False) >= 10, skipped
    assert all(b <= a for a, b in zip(scales, scales[1:])), scales
    assert all(r["grad_norm"] is not None for r, s in zip(many.steps, skipped) if not s)
    assert all(np.isfinite(r["loss"]) for r in many.steps)


@pytest.mark.parametrize("precision", ["fp32", "bf16", "fp16", "fp8"])
def test_graphs_give_the_same_bits_as_launch_by_launch(cuda_binary, random_shards, tmp_path, precision):
    """The training step runs as replayed CUDA graphs; ANDREA_NO_GRAPH=1 and ANDREA_CUDA_SYNC=1 run the
    same work launch by launch. Every record and the final checkpoint must be identical: a graph that
    replayed stale tokens, a stale learning rate or loss scale would differ from step 2 on. The model
    is small enough (B·T·d_model = 111·48, one tile) that the engine runs its weight gradients on the
    side stream (docs/DESIGN.md §9): as graph branches, as two streams launch by launch, and with every
    launch synchronised, so a missing wait between the streams shows as a difference; and on a 9.0+
    GPU its kernels are programmatic dependent launches (edges of the graph, a programmatic stream)."""
    shape = FP8_SHAPES["odd"] if precision == "fp8" else SHAPES["odd"]
    args = tiny_args(random_shards.train, random_shards.val, **{
        **shape, "train.precision": precision, "train.steps": 5, "train.grad_accum": 2, "train.lr": 3e-3,
        "train.warmup_steps": 2, "eval.every": 2, "eval.batches": 2, "sample.every": 5, "sample.tokens": 5,
        "sample.prompt": ["1,2"]})
    runs = {}
    for mode, env in (("graph", {}), ("eager", {"ANDREA_NO_GRAPH": "1"}), ("sync", {"ANDREA_CUDA_SYNC": "1"})):
        ckpt = tmp_path / f"{mode}.ckpt"
        runs[mode] = (run_ok(cuda_binary, args + ["--checkpoint", ckpt], env=env), ckpt.read_bytes())
    ref = eu.exact_records(runs["graph"][0])
    assert len([k for k in ref if k[0] == "train"]) == 5
    for mode, (res, _) in runs.items():
        assert "backward: weight gradients on a side stream" in res.stderr, res.stderr[-2000:]
        # planned for half the GPU, unless the fixed table chooses the algorithms (docs/DESIGN.md §9)
        planned = re.search(r"side stream's products: planned for (\d+) of (\d+) multiprocessors", res.stderr)
        if "cuBLASLt algorithms: the fixed table" in res.stderr:
            assert planned is None and "planned for the whole GPU" in res.stderr, res.stderr[-2000:]
        else:
            assert planned and int(planned[1]) == int(planned[2]) // 2, res.stderr[-2000:]
        if not OVERRIDE_ENGINE:  # the Makefile's build: kernels compiled for this GPU
            major = int(re.search(r"compute capability (\d+)\.\d+", res.stderr).group(1))
            programmatic = "kernel launches: programmatic dependent launch" in res.stderr
            assert programmatic == (major >= 9), f"{mode}: " + res.stderr[-2000:]
    for mode in ("eager", "sync"):
        assert eu.exact_records(runs[mode][0]) == ref, f"{mode} run differs from the graph run"
        assert runs[mode][1] == runs["graph"][1], f"{mode} run's checkpoint differs from the graph run's"


@pytest.mark.parametrize("precision", ["fp32", "bf16", "fp16", "fp8"])
def test_same_bits_as_the_baseline_build(cuda_binary, random_shards, tmp_path, precision):
    """ANDREA_CUDA_BASELINE set: the engine under test and the baseline build give identical records and
    checkpoints (grad_accum 2, so both gradient graphs and the accumulation run)."""
    if not BASELINE_ENGINE:
        pytest.skip("ANDREA_CUDA_BASELINE not set: no second build to compare with")
    args = tiny_args(random_shards.train, random_shards.val, **{
        **FP8_SHAPES["odd"], "train.precision": precision, "train.steps": 4, "train.grad_accum": 2,
        "train.lr": 3e-3, "train.warmup_steps": 2, "eval.every": 2, "eval.batches": 2, "sample.every": 4,
        "sample.tokens": 5, "sample.prompt": ["1,2"]})
    runs = {}
    for name, binary in (("baseline", BASELINE_ENGINE), ("tested", cuda_binary)):
        ckpt = tmp_path / f"{name}.ckpt"
        runs[name] = (eu.exact_records(run_ok(binary, args + ["--checkpoint", ckpt])), ckpt.read_bytes())
    assert len([k for k in runs["tested"][0] if k[0] == "train"]) == 4
    assert runs["tested"][0] == runs["baseline"][0], "records differ from the baseline build's"
    assert runs["tested"][1] == runs["baseline"][1], "checkpoint differs from the baseline build's"


# Logits chunks of 16 KiB: 64 rows of 16-bit logits (32 of fp32) at the odd shapes' padded vocabulary of
# 128, so their 111 or 144 positions take 2 or 3 chunks (4 in fp32), as ANDREA-12M's 4096 take 2 in fp32.
SMALL_CHUNKS_FLAGS = "-DLOGITS_CHUNK_BYTES=16384"


@pytest.fixture(scope="module")
def small_chunks_build(cuda_binary):
    """The engine built with small logits chunks (LOGITS_CHUNK_BYTES, cuda/loss.cuh) beside the default
    one: build/microgpt_cuda_chunks."""
    if OVERRIDE_ENGINE:
        pytest.skip("ANDREA_CUDA_ENGINE names one prebuilt engine; the small-chunks variant is built from source")
    engine = eu.BUILD / "microgpt_cuda_chunks"
    build_variant("_chunks", SMALL_CHUNKS_FLAGS, engine)
    return engine


@pytest.mark.parametrize("precision", ["fp32", "bf16", "fp16", "fp8"])
def test_side_stream_over_several_logits_chunks_gives_the_bits_of_synchronised_launches(
        small_chunks_build, random_shards, tmp_path, precision):
    """The side stream's products are ordered against the main stream only by events (docs/DESIGN.md
    §9). ANDREA_CUDA_SYNC=1 synchronises the whole device after every launch and product, so there the
    two streams never overlap: a missing wait shows as records or a checkpoint of the replayed graphs
    (or of the unsynchronised launches) that differ from it. Here the loss runs in several chunks:
    each chunk's dwte on the side stream, the next chunk's logits written after it, the later chunks
    and the embedding backward adding into the same wte gradient; grad_accum 2 (the += graph),
    validation and sampling between steps."""
    check_side_stream_over_chunks(small_chunks_build, random_shards, tmp_path, precision)


# A GPT-2 vocabulary and 16384 positions at d_model 64: the default engine's logits in two chunks
# (10624 and 5760 rows, whole 128-row blocks), each with the fused classifier backward on Hopper
# (cuda/classifier_grad.cuh), its dwte on the side stream
FUSED_CHUNKS = {"model.n_layer": 1, "model.d_model": 64, "model.n_head": 2, "model.d_ff": 128, "model.seq_len": 512,
                "model.vocab_size": 50257, "model.padded_vocab_size": 50304, "train.batch_size": 32}


def test_side_stream_over_the_fused_classifier_chunks_gives_the_bits_of_synchronised_launches(
        cuda_binary, random_shards, tmp_path):
    """As the test above, through the fused classifier backward (on a GPU of compute capability 9.0;
    elsewhere through the loss rows, and the engine says which)."""
    stderr = check_side_stream_over_chunks(cuda_binary, random_shards, tmp_path, "bf16", FUSED_CHUNKS)
    fused = "classifier backward: the softmax folded into its products" in stderr
    assert fused == ("compute capability 9.0" in stderr), stderr[-2000:]


def check_side_stream_over_chunks(engine, random_shards, tmp_path, precision, shape=None):
    """The body of the test above for an engine built with small logits chunks, at the odd shape of
    the precision or at `shape` (tests/test_fp8_classifier.py's). Returns the synchronised run's
    standard error."""
    shape = shape or (FP8_SHAPES["odd"] if precision == "fp8" else SHAPES["odd"])
    args = tiny_args(random_shards.train, random_shards.val, **{
        **shape, "train.precision": precision, "train.steps": 5, "train.grad_accum": 2, "train.lr": 3e-3,
        "train.warmup_steps": 2, "eval.every": 2, "eval.batches": 2, "sample.every": 5, "sample.tokens": 5,
        "sample.prompt": ["1,2"]})
    positions = shape["train.batch_size"] * shape["model.seq_len"]
    runs = {}
    for mode, env in (("sync", {"ANDREA_CUDA_SYNC": "1"}), ("graph", {}), ("eager", {"ANDREA_NO_GRAPH": "1"})):
        ckpt = tmp_path / f"{mode}.ckpt"
        res = run_ok(engine, args + ["--checkpoint", ckpt], env=env)
        assert "backward: weight gradients on a side stream" in res.stderr, res.stderr[-2000:]
        chunk = int(re.search(r"logits in chunks of (\d+) rows", res.stderr).group(1))
        assert chunk < positions, f"{chunk}-row chunks of {positions} positions: the loss ran in one chunk"
        runs[mode] = (eu.exact_records(res), ckpt.read_bytes())
        if mode == "sync":
            stderr = res.stderr
    assert len([k for k in runs["sync"][0] if k[0] == "train"]) == 5
    for mode in ("graph", "eager"):
        assert runs[mode][0] == runs["sync"][0], f"{mode} run's records differ from the synchronised run's"
        assert runs[mode][1] == runs["sync"][1], f"{mode} run's checkpoint differs from the synchronised run's"
    return stderr


def test_memory_plan_and_constant_device_memory(cuda_binary, random_shards):
    res = run_ok(cuda_binary, tiny_args(random_shards.train, random_shards.val, **{
        **SHAPES["odd"], "train.precision": "bf16", "train.steps": 6, "eval.every": 2, "eval.batches": 2,
        "sample.every": 3, "sample.tokens": 40, "sample.prompt": ["1,2"]}))
    mem = res.events("memory")
    assert len(mem) == 1
    groups = mem[0]["groups"]
    assert sum(groups.values()) == mem[0]["total_bytes"]
    for g in ("params", "grads", "adam", "weights_lowp", "activations"):
        assert groups[g] > 0, groups
    n = eu.layout_for({"model.n_layer": 3, "model.d_model": 48, "model.seq_len": 37,
                       "model.padded_vocab_size": 128, "model.d_ff": 100})["n_params"]
    assert groups["params"] >= 4 * n and groups["adam"] >= 8 * n and groups["weights_lowp"] >= 2 * n
    dev = res.events("device_memory")
    assert [d["step"] for d in dev] == [1, 6], dev
    assert dev[0]["bytes"] == dev[1]["bytes"], f"device memory grew during training: {dev}"
    assert dev[0]["bytes"] >= mem[0]["total_bytes"]


# The backward's side stream by its rule (docs/DESIGN.md §9): a model whose input-gradient product
# ([B·T, d_model], in 128×128 tiles) is under one wave of the GPU's multiprocessors, and one over it
# on any GPU of up to 256 (4096·1024 / 16384 = 256 tiles).
SIDE_RULE_SHAPES = {
    "small": SHAPES["odd"],
    "wide": {"model.n_layer": 1, "model.d_model": 1024, "model.n_head": 16, "model.d_ff": 1024, "model.seq_len": 256,
             "train.batch_size": 16},
}
CUBLAS_WORKSPACE_BYTES = 32 << 20  # microgpt/cuda/common.cuh's CUBLAS_WORKSPACE_BYTES


@pytest.mark.parametrize("shape", sorted(SIDE_RULE_SHAPES))
def test_side_stream_follows_the_product_size(cuda_binary, random_shards, shape):
    """The engine says which way its backward runs and why, the rule holds for this GPU's
    multiprocessor count, and the side stream's cuBLAS workspace is allocated only when it is used."""
    cfg = {**eu.TINY, **SIDE_RULE_SHAPES[shape]}
    res = run_ok(cuda_binary, tiny_args(random_shards.train, random_shards.val, **{
        **SIDE_RULE_SHAPES[shape], "train.precision": "bf16", "train.steps": 2}))
    m = re.search(r"backward: weight gradients (on a side stream|in line)\D*\((\d+) multiprocessors\)", res.stderr)
    assert m, res.stderr[-2000:]
    tiles = -(-cfg["train.batch_size"] * cfg["model.seq_len"] * cfg["model.d_model"] // (128 * 128))
    side = m.group(1) == "on a side stream"
    assert side == (tiles < int(m.group(2))), (tiles, m.group(0))
    if shape == "small":
        assert side, m.group(0)
    workspace = res.events("memory")[0]["groups"]["cublas_workspace"]
    assert workspace == (2 if side else 1) * CUBLAS_WORKSPACE_BYTES, workspace


# ---------------------------------------------------------------------------------------------------
# precision fp8 (docs/DESIGN.md §18)

@pytest.mark.parametrize("shape", sorted(FP8_SHAPES))
def test_fp8_gradients_match_cpu_fp8_emulation(cuda_binary, cpu_binary, random_shards, tmp_path, shape):
    """Loss and every gradient tensor of one micro-batch, GPU fp8 against the CPU engine's fp8 (see the
    module docstring for the tolerances); and the GPU's fp8 must differ from its bf16 (the FP8 path
    ran)."""
    dumps = {}
    for name, binary, precision in (("cpu8", cpu_binary, "fp8"), ("cpu32", cpu_binary, "fp32"),
                                    ("gpu8", cuda_binary, "fp8"), ("gpu16", cuda_binary, "bf16")):
        path = tmp_path / f"{name}.grads"
        res = run_ok(binary, tiny_args(random_shards.train, **{**FP8_SHAPES[shape], "train.precision": precision,
                                                                "dump_grads": path}))
        assert res.events("start")[0]["compute_precision"] == (precision if name != "cpu32" else "fp32")
        dumps[name] = eu.read_grad_dump(path)
    (cpu_loss, cpu8), (gpu_loss, gpu8) = dumps["cpu8"], dumps["gpu8"]
    assert abs(gpu_loss - cpu_loss) <= LOSS_TOL["fp8"] * abs(cpu_loss), (gpu_loss, cpu_loss)
    report, bad, unchanged = {}, {}, []
    for name, (sl, _) in eu.tensor_slices(eu.layout_for(FP8_SHAPES[shape])).items():
        err = rel_err(gpu8[sl], cpu8[sl])
        noise = rel_err(cpu8[sl], dumps["cpu32"][1][sl])  # what fp8 itself changes in this tensor
        tol = min(FP8_GRAD_TOL_MAX, FP8_GRAD_TOL_NOISE * noise + GRAD_TOL["fp8"])
        report[name] = (round(err, 4), round(noise, 4))
        if not err <= tol:
            bad[name] = (err, tol)
        if ".W_" in name and rel_err(gpu8[sl], dumps["gpu16"][1][sl]) <= 1e-3:
            unchanged.append(name)
    assert not bad, f"fp8 {shape}: tensors beyond tolerance (err, tol): {bad}\n(err, fp8 noise) of all: {report}"
    assert not unchanged, f"GPU fp8 gradients equal to its bf16 ones: the FP8 products did not run ({unchanged})"
    print(f"fp8 {shape}: loss gpu {gpu_loss} cpu {cpu_loss}; (err, fp8 noise) per tensor {report}")


def test_fp8_training_tracks_cpu_fp8_emulation(cuda_binary, cpu_binary, random_shards):
    settings = {**FP8_SHAPES["odd"], "train.steps": 10, "train.lr": 3e-3, "train.warmup_steps": 2,
                "train.precision": "fp8"}
    cpu = run_ok(cpu_binary, tiny_args(random_shards.train, **settings))
    gpu = run_ok(cuda_binary, tiny_args(random_shards.train, **settings))
    assert [r["step"] for r in gpu.steps] == [r["step"] for r in cpu.steps] == list(range(1, 11))
    # Derived, not measured: no GPU figure of this test's per-step gaps is recorded (docs/BENCHMARKS.md
    # and the log say only that it passed, at 3e-2). Step 1's loss is the micro-batch loss that
    # test_fp8_gradients_match_cpu_fp8_emulation["odd"] holds within LOSS_TOL["fp8"] (2e-2). Later steps
    # add the drift of weights trained on the GPU's fp8 gradients, which that test lets differ from the
    # CPU's by at most 0.5 normwise: about 7x fp8's own noise (0.07-0.11 for the linear weights). Measured
    # on the CPU at this test's settings, that noise moves the losses little: the fp32 loss of fp8-trained
    # weights is within 1.3e-4 (relative) of the fp32-trained weights' at steps 3-10, and CPU fp8 within
    # 6e-6 to 1.3e-4 of CPU fp32 at every step. Scaled 7x: 9e-4, so LOSS_TOL["fp8"] + 1e-3 (was 3e-2).
    tol = LOSS_TOL["fp8"] + 1e-3
    for c, g in zip(cpu.steps, gpu.steps):
        assert abs(g["loss"] - c["loss"]) <= tol * abs(c["loss"]), (c, g)


def test_fp8_graphs_give_the_same_bits_as_launch_by_launch(cuda_binary, random_shards, tmp_path):
    args = tiny_args(random_shards.train, random_shards.val, **{
        **FP8_SHAPES["odd"], "train.precision": "fp8", "train.steps": 5, "train.grad_accum": 2, "train.lr": 3e-3,
        "train.warmup_steps": 2, "eval.every": 2, "eval.batches": 2, "sample.every": 5, "sample.tokens": 5,
        "sample.prompt": ["1,2"]})
    runs = {}
    for mode, env in (("graph", {}), ("eager", {"ANDREA_NO_GRAPH": "1"})):
        ckpt = tmp_path / f"{mode}.ckpt"
        runs[mode] = (run_ok(cuda_binary, args + ["--checkpoint", ckpt], env=env), ckpt.read_bytes())
    assert eu.exact_records(runs["eager"][0]) == eu.exact_records(runs["graph"][0])
    assert runs["eager"][1] == runs["graph"][1], "the eager run's checkpoint differs from the graph run's"


def test_fp8_memory_plan_holds_the_fp8_weights_and_the_kept_casts(cuda_binary, random_shards):
    groups = {}
    for precision in ("fp8", "bf16"):
        res = run_ok(cuda_binary, tiny_args(random_shards.train, **{**FP8_SHAPES["odd"], "train.precision": precision,
                                                                    "train.steps": 2}))
        groups[precision] = res.events("memory")[0]["groups"]
    n = eu.layout_for(FP8_SHAPES["odd"])["n_params"]
    assert groups["fp8"]["weights_lowp"] >= 4 * n, groups  # the bf16 copy and two fp8 copies
    # the forward's casts kept transposed for the backward: per layer ln1, attention output, ln2 [N, C]
    # and h_gelu [N, F], one byte each; and the bf16 h_gelu [N, F] of one layer instead of every
    # layer's (the fp8 backward reads the kept cast). Here all multiples of the plan's 256 bytes.
    s = FP8_SHAPES["odd"]
    L, N, F = s["model.n_layer"], s["train.batch_size"] * s["model.seq_len"], s["model.d_ff"]
    kept, h_gelu_saved = L * N * (3 * s["model.d_model"] + F), (L - 1) * N * F * 2
    assert groups["fp8"]["activations"] - groups["bf16"]["activations"] == kept - h_gelu_saved, groups


def test_fp8_shapes_it_cannot_contract_are_refused(cuda_binary, random_shards):
    # T = 15: the products would contract over B·T = 60 positions, not a multiple of 16
    res = eu.run_engine(cuda_binary, tiny_args(random_shards.train, **{"train.precision": "fp8", "model.seq_len": 15}))
    assert res.rc == 2 and res.steps == [], res.describe()
    assert len(res.errors) == 1 and "fp8" in res.errors[0] and "multiples of 16" in res.errors[0], res.stderr


def test_a_model_too_large_for_the_gpu_is_refused_before_training(cuda_binary, random_shards):
    # 2.0e9 parameters (under the checkpoint format's 2^31 limit: 32 GB of fp32 state) and 65536
    # tokens per micro-batch, whose saved activations alone need about 170 GB (every input limit holds).
    huge = {"model.n_layer": 10, "model.d_model": 4096, "model.n_head": 64, "model.seq_len": 16,
            "train.batch_size": 4096}
    res = eu.run_engine(cuda_binary, tiny_args(random_shards.train, **huge))
    assert res.rc != 0 and res.steps == [], res.describe()
    assert len(res.errors) == 1, res.stderr
    assert "needs" in res.errors[0] and "free" in res.errors[0], res.errors[0]
    assert res.events("device_memory") == [], "it trained instead of refusing"


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_a_gpu_checkpoint_resumes_on_the_cpu_engine(cuda_binary, cpu_binary, random_shards, tmp_path, precision):
    """Checkpoints are fp32 in the layout of docs/DESIGN.md §3 whatever the precision, so a run stopped
    on the GPU continues on the CPU engine (and in fp32): from the same checkpoint both engines take
    the same next steps, within the GPU run's precision tolerance."""
    settings = {**SHAPES["tiny"], "train.lr": 3e-3, "train.warmup_steps": 2}
    half = tiny_args(random_shards.train, **{**settings, "train.steps": 4, "train.precision": precision})
    run_ok(cuda_binary, half + ["--checkpoint", tmp_path / "gpu.ckpt"])
    for name in ("cpu", "gpu2"):
        shutil.copy(tmp_path / "gpu.ckpt", tmp_path / f"{name}.ckpt")
        shutil.copy(tmp_path / "gpu.ckpt.json", tmp_path / f"{name}.ckpt.json")
    full = tiny_args(random_shards.train, **{**settings, "train.steps": 8})
    cpu = run_ok(cpu_binary, full + ["--checkpoint", tmp_path / "cpu.ckpt", "--resume"])
    gpu = run_ok(cuda_binary, full + ["--checkpoint", tmp_path / "gpu2.ckpt", "--resume"])
    assert [r["step"] for r in cpu.steps] == [r["step"] for r in gpu.steps] == [5, 6, 7, 8]
    for c, g in zip(cpu.steps, gpu.steps):
        assert abs(g["loss"] - c["loss"]) <= LOSS_TOL["fp32"] * abs(c["loss"]), (c, g)
    a, b = read_checkpoint(tmp_path / "cpu.ckpt"), read_checkpoint(tmp_path / "gpu2.ckpt")
    assert a.step == b.step == 8 and rel_err(b.params, a.params) <= 1e-5
