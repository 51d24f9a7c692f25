"""Each CPU layer of microgpt/cpu/*.h against the float64 reference layers of tests/reference.py.

tests/layer_harness.c runs one layer's forward and backward on inputs written here. Gradient buffers
start non-zero, so a backward that overwrites instead of accumulating (+=) fails. Every layer is
also run with 1 and 3 threads and must give bit-identical results (docs/DESIGN.md §3: deterministic).

Tolerance: fp32 against float64 on O(1) random data with sums of at most a few hundred terms;
the per-tensor relative error ||cpu - ref|| / ||ref|| is ~1e-7 in practice, RTOL = 2e-6 leaves
headroom for platform differences (libm, FMA) while any real mistake gives errors near 1.
"""
import os
import subprocess

import numpy as np
import pytest

import reference as R

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RTOL = 2e-6


@pytest.fixture(scope="module")
def harness(tmp_path_factory):
    exe = str(tmp_path_factory.mktemp("harness") / "layer_harness")
    src = os.path.join(ROOT, "tests", "layer_harness.c")
    build = subprocess.run(["gcc", "-std=c99", "-O2", "-fopenmp", "-Wall", "-Werror", "-o", exe, src, "-lm"],
                           capture_output=True, text=True)
    assert build.returncode == 0, f"building {src} failed:\n{build.stderr}"
    return exe


def run_layer(exe, tmp_path, layer, dims, inputs, threads=2):
    """Write inputs (float32, int32 for integer arrays), run the harness, return every .bin file."""
    work = tmp_path / f"{layer}_{threads}"
    work.mkdir()
    for name, arr in inputs.items():
        dtype = np.int32 if np.issubdtype(np.asarray(arr).dtype, np.integer) else np.float32
        np.asarray(arr, dtype=dtype).tofile(work / f"{name}.bin")
    env = dict(os.environ, OMP_NUM_THREADS=str(threads))
    subprocess.run([exe, layer, str(work)] + [str(x) for x in dims], check=True, env=env)
    return {f[:-4]: np.fromfile(work / f, dtype=np.float32) for f in os.listdir(work) if f.endswith(".bin")}


def check(name, got, want, rtol=RTOL):
    got = np.asarray(got, dtype=np.float64).ravel()
    want = np.asarray(want, dtype=np.float64).ravel()
    assert got.shape == want.shape, f"{name}: shape {got.shape} != {want.shape}"
    err = np.linalg.norm(got - want) / max(np.linalg.norm(want), 1e-30)
    print(f"{name}: {err:.3g}")
    assert err <= rtol, f"{name}: relative error {err:.3g} > {rtol:g}"


def run_and_check_determinism(exe, tmp_path, layer, dims, inputs):
    out1 = run_layer(exe, tmp_path, layer, dims, inputs, threads=1)
    out3 = run_layer(exe, tmp_path, layer, dims, inputs, threads=3)
    for name in out1:
        assert np.array_equal(out1[name], out3[name]), f"{layer}.{name}: 1 vs 3 threads differ"
    return out1


def f32(a):
    """Round inputs to float32 first, so the reference sees exactly what the C code sees."""
    return np.asarray(a, dtype=np.float32).astype(np.float64)


@pytest.fixture
def rng():
    return np.random.default_rng(1234)


def test_embed(harness, tmp_path, rng):
    B, T, d, Vp = 3, 7, 20, 13
    tokens = rng.integers(0, 10, (B, T))
    tokens[0, :3] = 5  # repeated tokens must accumulate
    x = {k: f32(rng.standard_normal(s)) for k, s in
         [("wte", (Vp, d)), ("wpe", (T, d)), ("dout", (B, T, d)), ("dwte", (Vp, d)), ("dwpe", (T, d))]}
    got = run_and_check_determinism(harness, tmp_path, "embed", (B, T, d, Vp), dict(x, tokens=tokens))
    check("out", got["out"], R.embed_forward(tokens, x["wte"], x["wpe"]))
    dwte, dwpe = x["dwte"].copy(), x["dwpe"].copy()
    R.embed_backward(x["dout"], tokens, dwte, dwpe)
    check("dwte", got["dwte"], dwte)
    check("dwpe", got["dwpe"], dwpe)


def test_layernorm(harness, tmp_path, rng):
    N, d = 37, 70  # d not a multiple of the 64-column block
    x = {k: f32(rng.standard_normal(s)) for k, s in
         [("x", (N, d)), ("gamma", d), ("beta", d), ("dout", (N, d)), ("dx", (N, d)), ("dgamma", d), ("dbeta", d)]}
    x["x"] = f32(x["x"] * 3.0 + 5.0)  # a large mean exercises the two-pass variance
    got = run_and_check_determinism(harness, tmp_path, "layernorm", (N, d), x)
    out, cache = R.layernorm_forward(x["x"], x["gamma"], x["beta"])
    check("out", got["out"], out)
    check("rstd", got["rstd"], cache[1])
    check("mean", got["mean"], x["x"].mean(axis=-1))
    dx, dgamma, dbeta = R.layernorm_backward(x["dout"], cache, x["gamma"])
    check("dx", got["dx"], x["dx"] + dx)
    check("dgamma", got["dgamma"], x["dgamma"] + dgamma)
    check("dbeta", got["dbeta"], x["dbeta"] + dbeta)


def test_matmul(harness, tmp_path, rng):
    N, n_in, n_out = 23, 19, 29  # none a multiple of the 4-row tile or the 8-lane dot product
    x = {k: f32(rng.standard_normal(s)) for k, s in
         [("x", (N, n_in)), ("w", (n_in, n_out)), ("dout", (N, n_out)), ("dx", (N, n_in)), ("dw", (n_in, n_out))]}
    got = run_and_check_determinism(harness, tmp_path, "matmul", (N, n_in, n_out), x)
    check("out", got["out"], x["x"] @ x["w"])
    check("dx", got["dx"], x["dx"] + x["dout"] @ x["w"].T)
    check("dw", got["dw"], x["dw"] + x["x"].T @ x["dout"])


def test_attention(harness, tmp_path, rng):
    B, T, d, H = 2, 9, 12, 3
    x = {k: f32(rng.standard_normal((B, T, d))) for k in ["q", "k", "v", "dout", "dq", "dk", "dv"]}
    got = run_and_check_determinism(harness, tmp_path, "attention", (B, T, d, H), x)
    out, att = R.attention_forward(x["q"], x["k"], x["v"], H)
    check("out", got["out"], out)
    check("att", got["att"], att)  # includes the zeros above the diagonal
    dq, dk, dv = R.attention_backward(x["dout"], att, x["q"], x["k"], x["v"], H)
    check("dq", got["dq"], x["dq"] + dq)
    check("dk", got["dk"], x["dk"] + dk)
    check("dv", got["dv"], x["dv"] + dv)


def test_gelu(harness, tmp_path, rng):
    n = 1001
    x = {k: f32(rng.standard_normal(n) * 3) for k in ["x", "dout", "dx"]}
    got = run_and_check_determinism(harness, tmp_path, "gelu", (n,), x)
    check("out", got["out"], R.gelu_forward(x["x"]))
    check("dx", got["dx"], x["dx"] + R.gelu_backward(x["dout"], x["x"]))


def test_residual(harness, tmp_path, rng):
    n = 333
    x = {k: f32(rng.standard_normal(n)) for k in ["a", "b", "dout", "da", "db"]}
    got = run_and_check_determinism(harness, tmp_path, "residual", (n,), x)
    check("out", got["out"], x["a"] + x["b"])
    check("da", got["da"], x["da"] + x["dout"])
    check("db", got["db"], x["db"] + x["dout"])


def test_classifier(harness, tmp_path, rng):
    N, d, V, Vp = 300, 16, 50, 64  # N > 256 chunks' worth of single rows: chunks hold several rows
    x = {k: f32(rng.standard_normal(s)) for k, s in [("x", (N, d)), ("wte", (Vp, d)), ("dx", (N, d))]}
    x["dwte"] = f32(np.concatenate([rng.standard_normal((V, d)), np.zeros((Vp - V, d))]))
    targets = rng.integers(0, V, N)
    got = run_and_check_determinism(harness, tmp_path, "classifier", (N, d, V, Vp), dict(x, targets=targets))
    loss, probs = R.classifier_forward(x["x"], x["wte"], targets, V)
    check("loss", got["loss"], [loss])
    probs_padded = np.concatenate([probs, np.zeros((N, Vp - V))], axis=1)
    check("probs", got["probs"], probs_padded)
    dx, dwte_real = R.classifier_backward(probs, x["x"], x["wte"], targets, V)
    check("dx", got["dx"], x["dx"] + dx)
    check("dwte", got["dwte"][:V * d], x["dwte"][:V] + dwte_real)
    assert not got["dwte"][V * d:].any(), "padded wte rows received gradient"


def test_adamw(harness, tmp_path, rng):
    n, t = 1000, 3
    tc = R.TrainConfig(lr=1e-2, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.1)
    x = {"p": f32(rng.standard_normal(n)), "g": f32(rng.standard_normal(n)),
         "m": f32(rng.standard_normal(n) * 0.1), "v": f32(rng.random(n) * 0.1)}
    hyper = [tc.lr, tc.beta1, tc.beta2, tc.eps, tc.weight_decay]
    got = run_and_check_determinism(harness, tmp_path, "adamw", (n, t), dict(x, hyper=f32(hyper)))
    p, m, v = x["p"].copy(), x["m"].copy(), x["v"].copy()
    # the C code sees float32 hyper-parameters; give the reference the same values
    tc32 = R.TrainConfig(*[float(np.float32(h)) for h in hyper])
    R.adamw_step(p, x["g"], m, v, t, tc32.lr, tc32, np.ones(n))
    check("m", got["m"], m)
    check("v", got["v"], v)
    check("p", got["p"], p)
    # the step itself, not just p; p - p_old cancels ~7 of float32's 24 bits at lr 1e-2, hence 5e-5
    check("update", got["p"] - x["p"], p - x["p"], rtol=5e-5)
