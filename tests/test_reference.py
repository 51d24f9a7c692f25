"""The float64 reference (tests/reference.py) against finite differences, and the CPU engine against
the reference: loss, every gradient tensor (--dump-grads), and five AdamW steps (weights, m, v).
"""
import itertools
import shutil

import numpy as np
import pytest

import engine_util as eu
import reference as R

from microgpt.checkpoint import read_checkpoint, write_checkpoint

# ----------------------------------------------------------------------------- reference vs finite differences

FD_CFG = R.ModelConfig(vocab_size=11, padded_vocab_size=16, n_layer=2, d_model=8, n_head=2, seq_len=5, d_ff=12)
FD_B = 2
FD_H = 1e-5        # central-difference step
FD_SAMPLES = 12    # entries checked per tensor (every entry if the tensor is smaller)
# In float64 the central difference has truncation error ~h²·|f'''| ≈ 1e-10 and rounding error
# ~eps·|loss|/h ≈ 1e-10; measured per-tensor relative errors are below 5e-8. A wrong backward gives
# errors of order 1, so 1e-6 separates the two by orders of magnitude either way.
FD_RTOL = 1e-6


def fd_setup(seed=0):
    rng = np.random.default_rng(seed)
    params = R.init_params(FD_CFG, rng, std=0.3)  # large weights: attention far from uniform, no tiny grads
    inputs = rng.integers(0, FD_CFG.vocab_size, (FD_B, FD_CFG.seq_len))
    targets = rng.integers(0, FD_CFG.vocab_size, (FD_B, FD_CFG.seq_len))
    return rng, params, inputs, targets


def test_reference_backward_matches_finite_differences():
    rng, params, inputs, targets = fd_setup()
    _, grads = R.loss_and_grads(params, FD_CFG, inputs, targets)
    p_views, g_views = R.unflatten(params, FD_CFG), R.unflatten(grads, FD_CFG)
    for name, shape in R.param_shapes(FD_CFG):
        p, g = p_views[name], g_views[name]
        all_idx = list(np.ndindex(shape))
        picks = all_idx if len(all_idx) <= FD_SAMPLES else [all_idx[i] for i in rng.choice(len(all_idx), FD_SAMPLES, replace=False)]
        if name == "wte":  # real rows only here; padded rows are checked below
            picks = [ix for ix in picks if ix[0] < FD_CFG.vocab_size]
        fd, an = [], []
        for ix in picks:
            old = p[ix]
            p[ix] = old + FD_H
            loss_plus = R.forward(params, FD_CFG, inputs, targets)[0]
            p[ix] = old - FD_H
            loss_minus = R.forward(params, FD_CFG, inputs, targets)[0]
            p[ix] = old
            fd.append((loss_plus - loss_minus) / (2 * FD_H))
            an.append(g[ix])
        fd, an = np.array(fd), np.array(an)
        assert np.linalg.norm(fd) > 1e-4, f"{name}: gradient too small for the check to mean anything"
        err = np.linalg.norm(an - fd) / np.linalg.norm(fd)
        assert err <= FD_RTOL, f"{name}: backward vs finite differences, relative error {err:.3g} > {FD_RTOL:g}"
    assert not g_views["wte"][FD_CFG.vocab_size:].any(), "padded wte rows received gradient"


def test_reference_loss_is_over_real_vocab_only():
    """With wte = 0 every real logit is 0, so the loss is exactly ln(V), not ln(padded V)."""
    _, params, inputs, targets = fd_setup()
    R.unflatten(params, FD_CFG)["wte"][...] = 0.0
    loss = R.forward(params, FD_CFG, inputs, targets)[0]
    assert abs(loss - np.log(FD_CFG.vocab_size)) < 1e-12, loss


def test_reference_clipping_and_adamw_formulas():
    g = np.array([3.0, 4.0])                        # norm 5
    clipped, norm = R.clip_grads(g, 1.0)
    assert norm == 5.0 and np.allclose(clipped, [0.6, 0.8])
    assert np.array_equal(R.clip_grads(g, 10.0)[0], g)   # below the threshold: untouched
    assert np.array_equal(R.clip_grads(g, 0.0)[0], g)    # 0 disables clipping
    # first step: m = (1-b1) g, v = (1-b2) g², bias-corrected update = g/(|g|+eps) = ±1 (eps tiny)
    tc = R.TrainConfig(lr=0.1, weight_decay=0.5, eps=1e-12)
    p, m, v = np.array([1.0, 1.0]), np.zeros(2), np.zeros(2)
    R.adamw_step(p, np.array([2.0, -3.0]), m, v, 1, tc.lr, tc, mask=np.array([1.0, 0.0]))
    assert np.allclose(m, [0.2, -0.3]) and np.allclose(v, [0.2, 0.45])
    assert np.allclose(p, [1.0 - 0.1 * (1.0 + 0.5), 1.0 + 0.1])  # decay only where mask is 1


# ----------------------------------------------------------------------------- CPU engine vs reference

ENG_CFG = R.ModelConfig(vocab_size=50, padded_vocab_size=64, n_layer=2, d_model=16, n_head=2, seq_len=8, d_ff=40)
ENG_B = 4
N_SHARDS = 3      # each shard holds exactly one window (T+1 tokens), so a batch row is one of 3 windows
INIT_STD = 0.1    # larger than the engine's 0.02 so attention and every gradient tensor are far from trivial
LR = 1e-2
N_STEPS = 5

# fp32 engine vs float64 reference, per tensor ||engine - ref|| / ||ref||:
# * loss and gradients: one forward/backward through 2 small layers, sums of at most a few hundred
#   terms; measured ≲1e-6. GRAD_RTOL = 2e-5 leaves >10x headroom; any real bug gives errors ≳1e-2.
# * after 5 AdamW steps: m, v and weights inherit the gradient error, and Adam's g/sqrt(v) normalises
#   each element, so an element whose gradient is near fp32 noise can take a step of a different
#   size; measured ≲1e-5. STATE_RTOL = 1e-4; a wrong step (lr, decay, bias correction) gives ≳1e-2.
LOSS_RTOL = 1e-6
GRAD_RTOL = 2e-5
STATE_RTOL = 1e-4


def engine_args(shard_glob, ckpt, **overrides):
    settings = {
        "model.n_layer": ENG_CFG.n_layer, "model.d_model": ENG_CFG.d_model, "model.n_head": ENG_CFG.n_head,
        "model.seq_len": ENG_CFG.seq_len, "model.d_ff": ENG_CFG.d_ff, "model.vocab_size": ENG_CFG.vocab_size,
        "model.padded_vocab_size": ENG_CFG.padded_vocab_size, "train.batch_size": ENG_B, "train.grad_accum": 1,
        "train.steps": N_STEPS, "train.seed": 1337, "train.lr": LR, "train.warmup_steps": 0,
        "train.schedule": "constant", "train.weight_decay": 0.1, "train.grad_clip": 0,
        "train.precision": "fp32", "checkpoint": ckpt, "resume": True,
    }
    settings.update(overrides)
    return eu.tiny_args(shard_glob, **settings)


@pytest.fixture
def engine_setup(tmp_path):
    """Shards, a step-0 checkpoint with random weights (m = v = 0), and the reference's view of both."""
    rng = np.random.default_rng(7)
    T = ENG_CFG.seq_len
    windows = [rng.integers(0, ENG_CFG.vocab_size, T + 1) for _ in range(N_SHARDS)]
    for i, w in enumerate(windows):
        eu.write_shard(tmp_path / f"win_{i:06d}.bin", w)
    params = R.init_params(ENG_CFG, rng, std=INIT_STD).astype(np.float32).astype(np.float64)  # what the engine loads
    ckpt = tmp_path / "start.ckpt"
    write_checkpoint(ckpt, 0, params, np.zeros_like(params), np.zeros_like(params))
    return {"glob": str(tmp_path / "win_*.bin"), "ckpt": ckpt, "params": params, "windows": windows}


def candidate_batches(windows):
    """Every batch the engine can draw, up to the order of its rows (which the loss and the summed
    gradients do not depend on): multisets of B windows out of the shards."""
    for combo in itertools.combinations_with_replacement(range(len(windows)), ENG_B):
        rows = np.stack([windows[i] for i in combo])
        yield combo, rows[:, :-1], rows[:, 1:]


def match_batch(params, windows, engine_loss):
    """The engine's batch is drawn by its RNG; find it as the one candidate whose reference loss
    matches the engine's loss, and insist that no other candidate comes close."""
    scored = sorted((abs(R.forward(params, ENG_CFG, x, y)[0] - engine_loss), combo, x, y)
                    for combo, x, y in candidate_batches(windows))
    (best, combo, x, y), runner_up = scored[0], scored[1][0]
    assert best <= LOSS_RTOL * abs(engine_loss) + 1e-7, \
        f"engine loss {engine_loss} matches no possible batch (closest differs by {best:.3g})"
    assert runner_up > 100 * max(best, 1e-7), "two batches give nearly the same loss: cannot tell which was used"
    return combo, x, y


def test_engine_gradients_match_reference(cpu_binary, engine_setup, tmp_path):
    s = engine_setup
    dump = tmp_path / "grads.bin"
    res = eu.run_engine(cpu_binary, engine_args(s["glob"], s["ckpt"], dump_grads=dump))
    assert res.rc == 0, res.describe()
    loss, grads = eu.read_grad_dump(dump)
    assert grads.size == R.num_params(ENG_CFG), f"dump holds {grads.size} grads, expected {R.num_params(ENG_CFG)}"
    combo, inputs, targets = match_batch(s["params"], s["windows"], loss)
    assert len(set(combo)) > 1, f"step 0's batch uses one window only {combo}: pick another seed so rows differ"
    ref_loss, ref_grads = R.loss_and_grads(s["params"], ENG_CFG, inputs, targets)
    assert abs(loss - ref_loss) <= LOSS_RTOL * abs(ref_loss), f"loss {loss} vs reference {ref_loss}"
    got, want = R.unflatten(grads.astype(np.float64), ENG_CFG), R.unflatten(ref_grads, ENG_CFG)
    for name, _ in R.param_shapes(ENG_CFG):
        err = eu.rel_err(got[name], want[name])
        assert err <= GRAD_RTOL, f"gradient {name}: relative error {err:.3g} > {GRAD_RTOL:g}"
    assert not got["wte"][ENG_CFG.vocab_size:].any(), "engine gave padded wte rows a gradient"


@pytest.mark.parametrize("grad_clip", [0.0, 0.05], ids=["no_clip", "clip_active"])
def test_engine_adamw_steps_match_reference(cpu_binary, engine_setup, tmp_path, grad_clip):
    s = engine_setup
    ckpt = tmp_path / "run.ckpt"
    shutil.copy(s["ckpt"], ckpt)  # the engine writes its final checkpoint over the one it resumed from
    res = eu.run_engine(cpu_binary, engine_args(s["glob"], ckpt, **{"train.grad_clip": grad_clip}))
    assert res.rc == 0, res.describe()
    steps = sorted(res.steps, key=lambda r: r["step"])
    assert [r["step"] for r in steps] == list(range(1, N_STEPS + 1)), res.describe()

    tc = R.TrainConfig(lr=LR, weight_decay=0.1, grad_clip=grad_clip)
    params = s["params"].copy()
    m, v = np.zeros_like(params), np.zeros_like(params)
    for i, record in enumerate(steps):
        # the engine's batch for this step, found from its reported loss at the reference's weights
        _, inputs, targets = match_batch(params, s["windows"], record["loss"])
        [(loss, norm)] = R.train(params, m, v, ENG_CFG, tc, [(inputs, targets)], first_step=i)
        assert abs(record["grad_norm"] - norm) <= GRAD_RTOL * norm, f"step {i + 1}: grad_norm {record['grad_norm']} vs {norm}"
        if grad_clip:
            assert norm > grad_clip, f"step {i + 1}: norm {norm} does not exceed grad_clip, clipping untested"

    final = read_checkpoint(ckpt)
    assert final.step == N_STEPS
    # the weight change is compared too: the weights themselves are dominated by their common start
    state = [("weights", final.params, params), ("weight change", final.params - s["params"], params - s["params"]),
             ("m", final.m, m), ("v", final.v, v)]
    for label, got_flat, want_flat in state:
        got, want = R.unflatten(got_flat.astype(np.float64), ENG_CFG), R.unflatten(want_flat, ENG_CFG)
        for name, _ in R.param_shapes(ENG_CFG):
            err = eu.rel_err(got[name], want[name])
            assert err <= STATE_RTOL, f"{label} {name} after {N_STEPS} steps: relative error {err:.3g} > {STATE_RTOL:g}"
