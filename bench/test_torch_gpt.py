"""The PyTorch baseline is the same model as the engine: checked against the float64 numpy reference
(tests/reference.py) on a tiny shape: loss, every gradient, and several clipped AdamW steps.

    pytest bench/test_torch_gpt.py        (skipped where torch is not installed)

torch is not in requirements.txt. PyPI's Linux wheel of torch is the CUDA build (it depends on cuDNN,
cuBLAS, NCCL and a dozen more nvidia-* packages, a few GB), which runs on a CPU too; PyTorch's own
index has a CPU-only wheel (pip install torch --index-url https://download.pytorch.org/whl/cpu). The
last tests need a CUDA GPU.
"""
import json
import os
import sys

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="torch is not installed: the PyTorch baseline cannot be checked "
                            "(a CPU build is enough, see this file's docstring)")

import reference as ref
from bench_common import experiment_path, lr_at, model_shape
from engine_util import python_env
from torch_gpt import GPT, make_optimizer, train_step

HERE = os.path.dirname(os.path.abspath(__file__))

TINY = ref.ModelConfig(vocab_size=50, padded_vocab_size=64, n_layer=2, d_model=16, n_head=4, seq_len=8)


def tiny_shape(cfg=TINY):
    return {k: getattr(cfg, k) for k in ("vocab_size", "padded_vocab_size", "n_layer", "d_model", "n_head",
                                         "seq_len", "d_ff")}


def tiny_model(flat):
    model = GPT(tiny_shape()).double()
    model.load_flat(torch.from_numpy(flat))
    return model


def batch(rng, B=2):
    x = rng.integers(0, TINY.vocab_size, size=(B, TINY.seq_len))
    y = rng.integers(0, TINY.vocab_size, size=(B, TINY.seq_len))
    return x, y


def test_flat_layout_round_trips():
    flat = ref.init_params(TINY, np.random.default_rng(1))
    assert np.array_equal(tiny_model(flat).flat().numpy(), flat)


def test_loss_and_every_gradient_match_reference():
    rng = np.random.default_rng(2)
    flat = ref.init_params(TINY, rng, std=0.3)
    x, y = batch(rng)
    want_loss, want_grads = ref.loss_and_grads(flat, TINY, x, y)
    model = tiny_model(flat)
    loss = model(torch.from_numpy(x), torch.from_numpy(y))
    loss.backward()
    assert abs(loss.item() - want_loss) <= 1e-12 * abs(want_loss)
    got = model.flat(use_grad=True).numpy()
    offset = 0
    for name, shape in ref.param_shapes(TINY):
        n = int(np.prod(shape))
        np.testing.assert_allclose(got[offset:offset + n], want_grads[offset:offset + n], rtol=1e-9,
                                   atol=1e-12, err_msg=name)
        offset += n


def test_clipped_adamw_steps_match_reference():
    rng = np.random.default_rng(3)
    flat = ref.init_params(TINY, rng, std=0.3)
    batches = [batch(rng) for _ in range(4)]
    tc = ref.TrainConfig(lr=1e-2, weight_decay=0.1, grad_clip=0.5)
    params, m, v = flat.copy(), np.zeros_like(flat), np.zeros_like(flat)
    want = ref.train(params, m, v, TINY, tc, batches)
    assert all(norm > tc.grad_clip for _, norm in want), "the clip must be exercised"

    model = tiny_model(flat)
    t = {"lr": tc.lr, "beta1": tc.beta1, "beta2": tc.beta2, "eps": tc.eps, "weight_decay": tc.weight_decay}
    opt = make_optimizer(model, t, fused=False)
    for (x, y), (want_loss, want_norm) in zip(batches, want):
        loss, norm = train_step(model, opt, [(torch.from_numpy(x), torch.from_numpy(y))], tc.lr, tc.grad_clip,
                                autocast=lambda: torch.autocast("cpu", enabled=False))
        assert loss.item() == pytest.approx(want_loss, rel=1e-10)
        assert norm.item() == pytest.approx(want_norm, rel=1e-10)
    np.testing.assert_allclose(model.flat().numpy(), params, rtol=1e-9, atol=1e-12)


def test_grad_accumulation_is_the_mean_of_micro_batches():
    rng = np.random.default_rng(4)
    flat = ref.init_params(TINY, rng, std=0.3)
    (x1, y1), (x2, y2) = batch(rng), batch(rng)
    l1, g1 = ref.loss_and_grads(flat, TINY, x1, y1)
    l2, g2 = ref.loss_and_grads(flat, TINY, x2, y2)
    model = tiny_model(flat)
    opt = make_optimizer(model, {"lr": 0.0, "beta1": 0.9, "beta2": 0.95, "eps": 1e-8, "weight_decay": 0.0},
                         fused=False)
    micro = [(torch.from_numpy(x1), torch.from_numpy(y1)), (torch.from_numpy(x2), torch.from_numpy(y2))]
    loss, norm = train_step(model, opt, micro, 0.0, 0.0, autocast=lambda: torch.autocast("cpu", enabled=False))
    assert loss.item() == pytest.approx((l1 + l2) / 2, rel=1e-12)
    assert norm.item() == pytest.approx(np.linalg.norm((g1 + g2) / 2), rel=1e-10)


def test_padded_vocabulary_takes_no_probability_and_no_gradient():
    rng = np.random.default_rng(5)
    flat = ref.init_params(TINY, rng, std=0.3)
    p = ref.unflatten(flat, TINY)
    p["wte"][TINY.vocab_size:] = 5.0   # padded rows that would dominate the softmax if it saw them
    x, y = batch(rng)
    model = tiny_model(flat)
    loss = model(torch.from_numpy(x), torch.from_numpy(y))
    loss.backward()
    assert loss.item() == pytest.approx(ref.forward(flat, TINY, x, y)[0], rel=1e-12)
    assert not model.wte.weight.grad[TINY.vocab_size:].any()


def test_initialisation_follows_design():
    shape = dict(tiny_shape(), n_layer=4, d_model=64, n_head=4, d_ff=256, padded_vocab_size=2048,
                 vocab_size=2000)
    torch.manual_seed(0)
    model = GPT(shape)
    assert model.wte.weight.std().item() == pytest.approx(0.02, rel=0.02)
    assert model.blocks[0].qkv.weight.std().item() == pytest.approx(0.02, rel=0.05)
    assert model.blocks[0].fc_proj.weight.std().item() == pytest.approx(0.02 / np.sqrt(8), rel=0.05)
    assert model.blocks[0].proj.weight.std().item() == pytest.approx(0.02 / np.sqrt(8), rel=0.1)
    assert torch.equal(model.lnf.weight, torch.ones(64)) and not model.lnf.bias.any()


def test_shipped_shapes_have_the_spec_parameter_counts():
    for name, approx in (("12M", 12.4e6), ("120M", 124e6)):
        with open(experiment_path(name)) as f:
            shape = model_shape(json.load(f))
        cfg = ref.ModelConfig(**{k: shape[k] for k in tiny_shape()})
        with torch.device("meta"):
            n = sum(p.numel() for p in GPT(shape, seed=None).parameters())
        assert n == ref.num_params(cfg)
        assert n == pytest.approx(approx, rel=0.01)


def test_lr_schedule_warmup_then_cosine_to_min():
    t = {"steps": 100, "warmup_steps": 10, "lr": 1e-3, "min_lr": 1e-4, "schedule": "cosine"}
    assert lr_at(0, t) == pytest.approx(1e-4)
    assert lr_at(9, t) == pytest.approx(1e-3)
    assert lr_at(10, t) == pytest.approx(1e-3)
    assert lr_at(55, t) == pytest.approx(5.5e-4)
    assert lr_at(100, t) == pytest.approx(1e-4)


# ----------------------------------------------------------------------------- against the CPU engine
# The baseline must draw the engine's exact initial weights and windows (bench/engine_rng.py):
# then one forward/backward agrees to fp32 rounding, and a short fp32 run follows the same curve.

CPU_ENGINE = os.path.join(os.path.dirname(HERE), "build", "microgpt_cpu")
ENGINE_SHAPE = {"n_layer": 2, "d_model": 32, "n_head": 4, "seq_len": 16, "vocab_size": 100,
                "padded_vocab_size": 128, "d_ff": 128}


@pytest.fixture
def engine_run(tmp_path):
    """A tiny experiment on random-token shards and a function running the CPU engine on it."""
    if not os.access(CPU_ENGINE, os.X_OK):
        pytest.skip("build/microgpt_cpu not built (make cpu)")
    from microgpt.shards import write_shard
    rng = np.random.default_rng(7)
    for name, n in (("a", 3000), ("b", 5000)):   # two shards: the window rule spans shards
        write_shard(str(tmp_path / f"train_{name}.bin"), rng.integers(0, 100, size=n))
    cfg = {"name": "tiny", "model": {k: v for k, v in ENGINE_SHAPE.items()},
           "train": {"batch_size": 4, "grad_accum": 2, "steps": 12, "seed": 42, "lr": 3e-3, "min_lr": 3e-4,
                     "warmup_steps": 3, "schedule": "cosine", "weight_decay": 0.1, "grad_clip": 0.5},
           "data": {"train": str(tmp_path / "train_*.bin")}}
    path = tmp_path / "tiny.json"
    path.write_text(json.dumps(cfg))

    def run(*extra):
        import subprocess
        flags = [f"--{s}.{k}={v}" for s in ("model", "train", "data") for k, v in cfg[s].items()]
        out = subprocess.run([CPU_ENGINE, *flags, "--train.precision=fp32", *extra], capture_output=True,
                             text=True, timeout=120)
        assert out.returncode == 0, out.stderr
        return [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]
    return cfg, path, run


def test_first_step_loss_and_gradients_match_cpu_engine(engine_run, tmp_path):
    from torch_gpt import Windows
    import engine_rng
    cfg, _, run = engine_run
    run(f"--dump-grads={tmp_path / 'grads.bin'}")
    dump = np.fromfile(tmp_path / "grads.bin", dtype="<f4")
    model = GPT(dict(ENGINE_SHAPE), seed=cfg["train"]["seed"])
    data = Windows(cfg["data"]["train"], 16, 100, cfg["train"]["seed"], engine_rng.STREAM_TRAIN)
    x, y = data.batch(0, cfg["train"]["batch_size"])
    loss = model(torch.from_numpy(x), torch.from_numpy(y))
    loss.backward()
    assert loss.item() == pytest.approx(float(dump[0]), rel=1e-5)
    # The two fp32 backwards sum in different orders, so a gradient differs by rounding on the order of
    # an fp32 ulp of the largest terms summed, not of itself: near-zero gradients (cancellations) differ
    # by 1e-2 relative and more, so the bound is absolute. Measured on the CPU (torch 2.15, AVX2): at
    # most 1.49e-8 here (one ulp of the largest gradient, 0.13); over 20 other data and init seeds at
    # most 2.24e-8, and 2.98e-8 with ATen's scalar kernels (ATEN_CPU_CAPABILITY=default); the same with
    # one thread. atol 1e-7: 3.4x the worst of those, 6.7x this seed's (was rtol 2e-3, atol 2e-6).
    np.testing.assert_allclose(model.flat(use_grad=True).numpy(), dump[1:], rtol=0, atol=1e-7)


def test_short_fp32_run_follows_cpu_engine(engine_run):
    import subprocess
    cfg, path, run = engine_run
    engine = [r for r in run() if "loss" in r]
    out = subprocess.run([sys.executable, os.path.join(HERE, "torch_gpt.py"), str(path), "--device", "cpu",
                          "--precision", "fp32"], capture_output=True, text=True, timeout=120, env=python_env())
    assert out.returncode == 0, out.stderr
    mine = [json.loads(line) for line in out.stdout.splitlines() if '"loss"' in line]
    assert len(mine) == len(engine) == cfg["train"]["steps"]
    for e, t in zip(engine, mine):
        assert t["lr"] == pytest.approx(e["lr"], rel=1e-6)
        assert t["loss"] == pytest.approx(e["loss"], rel=1e-4), f"step {e['step']}"
        assert t["grad_norm"] == pytest.approx(e["grad_norm"], rel=1e-3), f"step {e['step']}"


# ----------------------------------------------------------------------------- on the GPU
# The benchmark's PyTorch modes: compiled, with CUDA graphs (a new step marked each step), on the
# same tiny run as above; each must train as eager does (bf16 rounding apart) and say which mode ran.

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU visible to torch")


@needs_cuda
@pytest.mark.gpu
@pytest.mark.parametrize("mode", ["default", "reduce-overhead"])
def test_compiled_modes_train_as_eager_does(engine_run, mode):
    import subprocess
    _, path, _ = engine_run

    def losses(compile_mode):
        out = subprocess.run([sys.executable, os.path.join(HERE, "torch_gpt.py"), str(path), "--device", "cuda",
                              "--precision", "bf16", "--compile", compile_mode], capture_output=True, text=True,
                             timeout=600, env=python_env())
        assert out.returncode == 0, out.stderr
        records = [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]
        assert records[0]["compile"] == compile_mode
        return [r["loss"] for r in records if "loss" in r]

    eager, compiled = losses("none"), losses(mode)
    assert len(compiled) == len(eager) == 12
    # bf16 autocast: fused kernels round differently. 2e-2 rests on no measurement of this run on a GPU
    # (none is recorded in docs/BENCHMARKS.md, bench/results.jsonl or the log). The nearest recorded
    # figures are the benchmark's 200-step final losses (H200, dc4e87f): eager, compile and reduce-overhead
    # within 1.4e-5 at 12M (5.2964), 0.11 % at 120M (4.9831 / 4.9779 / 4.9872). A CPU stand-in (inductor
    # on the CPU, this run) differed by at most 8.7e-6 a step. Kept until measured here on a GPU; on
    # random tokens these losses stay within 1 % of ln(100), so the check catches gross failures only.
    np.testing.assert_allclose(compiled, eager, rtol=2e-2)


def torchao_importable():
    import importlib.util
    return importlib.util.find_spec("torchao") is not None


@pytest.mark.skipif(torchao_importable(), reason="torchao is installed: its absence cannot be checked here")
def test_fp8_without_torchao_is_one_error_line(engine_run):
    import subprocess
    _, path, _ = engine_run
    out = subprocess.run([sys.executable, os.path.join(HERE, "torch_gpt.py"), str(path), "--device", "cpu",
                          "--precision", "fp8"], capture_output=True, text=True, timeout=120, env=python_env())
    assert out.returncode == 2 and out.stdout == ""
    assert out.stderr.startswith("error: --precision fp8 needs torchao") and out.stderr.count("\n") == 1


def fp8_capable():
    return torch.cuda.is_available() and torch.cuda.get_device_capability() >= (8, 9)


@pytest.mark.gpu
@pytest.mark.skipif(not fp8_capable() or not torchao_importable(),
                    reason="needs torchao and a GPU with FP8 tensor cores (compute capability 8.9+)")
def test_torchao_fp8_trains_as_bf16_does_with_cuda_graphs(engine_run):
    """The fp8 baseline of the benchmark: torchao's float8 products, compiled with CUDA graphs, follow
    bf16 eager's loss on the tiny run (E4M3/E5M2 rounding: a looser tolerance than the compiled bf16
    modes' 2e-2) and the start record names torchao's version."""
    import subprocess
    _, path, _ = engine_run

    def run(precision, compile_mode):
        out = subprocess.run([sys.executable, os.path.join(HERE, "torch_gpt.py"), str(path), "--device", "cuda",
                              "--precision", precision, "--compile", compile_mode], capture_output=True, text=True,
                             timeout=600, env=python_env())
        assert out.returncode == 0, out.stderr
        return [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]

    fp8 = run("fp8", "reduce-overhead")
    assert fp8[0]["precision"] == "fp8" and fp8[0]["torchao"] and fp8[0]["compile"] == "reduce-overhead"
    bf16 = [r["loss"] for r in run("bf16", "none") if "loss" in r]
    fp8 = [r["loss"] for r in fp8 if "loss" in r]
    assert len(fp8) == len(bf16) == 12
    # 5e-2 rests on no measurement of this run on a GPU (none is recorded). The nearest recorded figures
    # are the benchmark's 200-step final losses, torchao fp8 against bf16 (both reduce-overhead, not
    # eager), 30 runs in bench/results.jsonl (H200, H100): -0.05 % to +0.13 % at 12M, -1.06 % to +2.85 %
    # at 120M (b679dee: 5.1427 against 5.0003, torchao's float8 ending high, docs/BENCHMARKS.md). 5e-2 is
    # 1.75x that largest gap, from a larger model and a longer run than this one; kept until measured.
    np.testing.assert_allclose(fp8, bf16, rtol=5e-2)


@needs_cuda
@pytest.mark.gpu
def test_the_matmul_rate_is_measured():
    import subprocess
    out = subprocess.run([sys.executable, os.path.join(HERE, "matmul_peak.py"), "--n", "2048", "--reps", "5"],
                         capture_output=True, text=True, timeout=300, env=python_env())
    assert out.returncode == 0, out.stderr
    r = json.loads(out.stdout)
    assert r["n"] == 2048 and r["reps"] == 5 and 0 < r["tflops"] <= r["tflops_max"]
