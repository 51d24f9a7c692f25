"""Float64 numpy reference of the ANDREA model (docs/DESIGN.md §2) and its training step (docs/DESIGN.md §3, DESIGN.md).

The CPU engine is checked against this file, and this file is checked by finite differences
(tests/test_reference.py), so it is written for reading, not speed: one function per layer, forward
and backward side by side, the same math as microgpt/cpu/*.h.

Model: pre-LayerNorm GPT-2 without biases in linear layers, tied embeddings padded to
padded_vocab_size rows, GELU (tanh), causal attention, mean cross-entropy over the real vocabulary.
Parameters live in one flat vector in docs/DESIGN.md §2 order: wte, wpe, per layer W_Q W_K W_V W_O W_1 W_2
ln1.gamma ln1.beta ln2.gamma ln2.beta, then lnf.gamma lnf.beta.
"""
from dataclasses import dataclass

import numpy as np

from engine_util import layout_for, tensor_shapes

from microgpt.checkpoint import split_params

LN_EPS = 1e-5
GELU_SCALE = np.sqrt(2.0 / np.pi)
GELU_CUBIC = 0.044715


@dataclass
class ModelConfig:
    vocab_size: int
    padded_vocab_size: int
    n_layer: int
    d_model: int
    n_head: int
    seq_len: int
    d_ff: int = 0  # 0 means 4 * d_model, as the engine's default

    def __post_init__(self):
        if self.d_ff == 0:
            self.d_ff = 4 * self.d_model


# ----------------------------------------------------------------------------- parameter layout

def layout(cfg):
    """The engine's layout (`--layout-json`) for this shape: the flat order of docs/DESIGN.md §2,
    also the checkpoint order: wte, wpe, h{l}.W_Q ... h{l}.ln2.beta, lnf.gamma, lnf.beta."""
    return layout_for({"model.vocab_size": cfg.vocab_size, "model.padded_vocab_size": cfg.padded_vocab_size,
                       "model.n_layer": cfg.n_layer, "model.d_model": cfg.d_model, "model.n_head": cfg.n_head,
                       "model.seq_len": cfg.seq_len, "model.d_ff": cfg.d_ff})


def param_shapes(cfg):
    """[(name, shape)] in flat order."""
    return tensor_shapes(layout(cfg))


def num_params(cfg):
    return layout(cfg)["n_params"]


def unflatten(flat, cfg):
    """{name: view into flat} with the layout's shapes; writing a view writes the flat vector."""
    return split_params(flat, layout(cfg))


def decay_mask(cfg):
    """Flat float64 mask: 1 where weight decay applies (the layout's "decay": every 2-D tensor)."""
    return np.concatenate([np.full(int(np.prod(t["shape"])), 1.0 if t["decay"] else 0.0)
                           for t in layout(cfg)["tensors"]])


def init_params(cfg, rng, std=0.02):
    """Random weights for tests (not the engine's seeded init): N(0, std) weights, LayerNorm
    gamma near 1 and beta near 0 but perturbed so their gradients are exercised in full.
    Tests use std well above 0.02 so attention is far from uniform and no gradient is tiny."""
    flat = np.zeros(num_params(cfg))
    p = unflatten(flat, cfg)
    for name, arr in p.items():
        if name.endswith("gamma"):
            arr[...] = 1.0 + 0.1 * rng.standard_normal(arr.shape)
        elif name.endswith("beta"):
            arr[...] = 0.1 * rng.standard_normal(arr.shape)
        else:
            arr[...] = std * rng.standard_normal(arr.shape)
    return flat


# ----------------------------------------------------------------------------- layers

def embed_forward(tokens, wte, wpe):
    T = tokens.shape[1]
    return wte[tokens] + wpe[None, :T]


def embed_backward(dout, tokens, dwte, dwpe):
    np.add.at(dwte, tokens, dout)       # repeated tokens accumulate
    dwpe[:tokens.shape[1]] += dout.sum(axis=0)


def layernorm_forward(x, gamma, beta):
    mean = x.mean(axis=-1, keepdims=True)
    rstd = 1.0 / np.sqrt(((x - mean) ** 2).mean(axis=-1, keepdims=True) + LN_EPS)
    xhat = (x - mean) * rstd
    return xhat * gamma + beta, (xhat, rstd)


def layernorm_backward(dout, cache, gamma):
    xhat, rstd = cache
    dgamma = (dout * xhat).reshape(-1, xhat.shape[-1]).sum(axis=0)
    dbeta = dout.reshape(-1, xhat.shape[-1]).sum(axis=0)
    g = dout * gamma
    dx = rstd * (g - g.mean(axis=-1, keepdims=True) - xhat * (g * xhat).mean(axis=-1, keepdims=True))
    return dx, dgamma, dbeta


def split_heads(x, H):
    B, T, d = x.shape
    return x.reshape(B, T, H, d // H).transpose(0, 2, 1, 3)  # [B, H, T, hs]


def merge_heads(x):
    B, H, T, hs = x.shape
    return x.transpose(0, 2, 1, 3).reshape(B, T, H * hs)


def attention_forward(q, k, v, H):
    """q, k, v [B, T, d] -> out [B, T, d], att [B, H, T, T] (causal softmax, scale 1/sqrt(hs))."""
    qh, kh, vh = split_heads(q, H), split_heads(k, H), split_heads(v, H)
    T, hs = qh.shape[2], qh.shape[3]
    scores = qh @ kh.transpose(0, 1, 3, 2) / np.sqrt(hs)
    scores = np.where(np.tril(np.ones((T, T), dtype=bool)), scores, -np.inf)
    scores -= scores.max(axis=-1, keepdims=True)
    att = np.exp(scores)
    att /= att.sum(axis=-1, keepdims=True)
    return merge_heads(att @ vh), att


def attention_backward(dout, att, q, k, v, H):
    qh, kh, vh = split_heads(q, H), split_heads(k, H), split_heads(v, H)
    hs = qh.shape[3]
    dh = split_heads(dout, H)
    datt = dh @ vh.transpose(0, 1, 3, 2)
    dvh = att.transpose(0, 1, 3, 2) @ dh
    dscores = att * (datt - (att * datt).sum(axis=-1, keepdims=True)) / np.sqrt(hs)  # masked: att = 0
    dqh = dscores @ kh
    dkh = dscores.transpose(0, 1, 3, 2) @ qh
    return merge_heads(dqh), merge_heads(dkh), merge_heads(dvh)


def gelu_forward(x):
    return 0.5 * x * (1.0 + np.tanh(GELU_SCALE * (x + GELU_CUBIC * x ** 3)))


def gelu_backward(dout, x):
    th = np.tanh(GELU_SCALE * (x + GELU_CUBIC * x ** 3))
    dth = (1.0 - th ** 2) * GELU_SCALE * (1.0 + 3.0 * GELU_CUBIC * x ** 2)
    return dout * (0.5 * (1.0 + th) + 0.5 * x * dth)


def classifier_forward(x, wte, targets, V):
    """Tied logits over the real vocabulary only; returns mean loss and probs [B, T, V]."""
    logits = x @ wte[:V].T
    logits -= logits.max(axis=-1, keepdims=True)
    probs = np.exp(logits)
    probs /= probs.sum(axis=-1, keepdims=True)
    picked = np.take_along_axis(probs, targets[..., None], axis=-1)[..., 0]
    return -np.log(picked).mean(), probs


def classifier_backward(probs, x, wte, targets, V):
    """dloss = 1/N per position; padded wte rows get no gradient."""
    N = targets.size
    dlogits = probs.copy()
    np.put_along_axis(dlogits, targets[..., None], np.take_along_axis(dlogits, targets[..., None], -1) - 1.0, -1)
    dlogits /= N
    dx = dlogits @ wte[:V]
    dwte_real = dlogits.reshape(-1, V).T @ x.reshape(-1, x.shape[-1])
    return dx, dwte_real


# ----------------------------------------------------------------------------- whole model

def forward(flat, cfg, inputs, targets):
    """Mean loss and the cache backward needs. inputs, targets: int arrays [B, T]."""
    p = unflatten(flat, cfg)
    H = cfg.n_head
    x = embed_forward(inputs, p["wte"], p["wpe"])
    layers = []
    for l in range(cfg.n_layer):
        w = {name.split(".", 1)[1]: arr for name, arr in p.items() if name.startswith(f"h{l}.")}
        c = {"x_in": x}
        c["ln1"], c["ln1_cache"] = layernorm_forward(x, w["ln1.gamma"], w["ln1.beta"])
        c["q"], c["k"], c["v"] = c["ln1"] @ w["W_Q"], c["ln1"] @ w["W_K"], c["ln1"] @ w["W_V"]
        c["y"], c["att"] = attention_forward(c["q"], c["k"], c["v"], H)
        x = x + c["y"] @ w["W_O"]
        c["x_mid"] = x
        c["ln2"], c["ln2_cache"] = layernorm_forward(x, w["ln2.gamma"], w["ln2.beta"])
        c["h"] = c["ln2"] @ w["W_1"]
        c["g"] = gelu_forward(c["h"])
        x = x + c["g"] @ w["W_2"]
        layers.append((w, c))
    xf, lnf_cache = layernorm_forward(x, p["lnf.gamma"], p["lnf.beta"])
    loss, probs = classifier_forward(xf, p["wte"], targets, cfg.vocab_size)
    return loss, {"p": p, "layers": layers, "xf": xf, "lnf_cache": lnf_cache, "probs": probs}


def backward(cache, cfg, inputs, targets):
    """Flat gradient of the mean loss, same layout as the parameters."""
    p = cache["p"]
    grads = np.zeros(num_params(cfg))
    g = unflatten(grads, cfg)
    H, V = cfg.n_head, cfg.vocab_size
    dxf, g["wte"][:V] = classifier_backward(cache["probs"], cache["xf"], p["wte"], targets, V)
    dx, g["lnf.gamma"][...], g["lnf.beta"][...] = layernorm_backward(dxf, cache["lnf_cache"], p["lnf.gamma"])
    for l in reversed(range(cfg.n_layer)):
        w, c = cache["layers"][l]
        gl = lambda name: g[f"h{l}.{name}"]  # noqa: E731  (gradient view of this layer)
        # MLP branch: x = x_mid + gelu(ln2 @ W_1) @ W_2
        gl("W_2")[...] = c["g"].reshape(-1, cfg.d_ff).T @ dx.reshape(-1, cfg.d_model)
        dh = gelu_backward(dx @ w["W_2"].T, c["h"])
        gl("W_1")[...] = c["ln2"].reshape(-1, cfg.d_model).T @ dh.reshape(-1, cfg.d_ff)
        dln2, gl("ln2.gamma")[...], gl("ln2.beta")[...] = layernorm_backward(dh @ w["W_1"].T, c["ln2_cache"], w["ln2.gamma"])
        dx = dx + dln2
        # attention branch: x_mid = x_in + attn(ln1) @ W_O
        gl("W_O")[...] = c["y"].reshape(-1, cfg.d_model).T @ dx.reshape(-1, cfg.d_model)
        dq, dk, dv = attention_backward(dx @ w["W_O"].T, c["att"], c["q"], c["k"], c["v"], H)
        ln1 = c["ln1"].reshape(-1, cfg.d_model)
        gl("W_Q")[...] = ln1.T @ dq.reshape(-1, cfg.d_model)
        gl("W_K")[...] = ln1.T @ dk.reshape(-1, cfg.d_model)
        gl("W_V")[...] = ln1.T @ dv.reshape(-1, cfg.d_model)
        dln1_out = dq @ w["W_Q"].T + dk @ w["W_K"].T + dv @ w["W_V"].T
        dln1, gl("ln1.gamma")[...], gl("ln1.beta")[...] = layernorm_backward(dln1_out, c["ln1_cache"], w["ln1.gamma"])
        dx = dx + dln1
    embed_backward(dx, inputs, g["wte"], g["wpe"])
    return grads


def loss_and_grads(flat, cfg, inputs, targets):
    loss, cache = forward(flat, cfg, inputs, targets)
    return loss, backward(cache, cfg, inputs, targets)


# ----------------------------------------------------------------------------- optimizer

@dataclass
class TrainConfig:
    lr: float = 6e-4
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-8
    weight_decay: float = 0.1
    grad_clip: float = 1.0  # 0 disables clipping


def clip_grads(grads, grad_clip):
    """Global L2 clipping: scale by grad_clip/norm when the norm exceeds grad_clip.
    Returns (clipped grads, norm before clipping)."""
    norm = float(np.sqrt(np.sum(grads * grads)))
    if grad_clip > 0 and norm > grad_clip:
        grads = grads * (grad_clip / norm)
    return grads, norm


def adamw_step(params, grads, m, v, t, lr, tc, mask):
    """One AdamW update in place, t = 1-based step; decoupled decay where mask is 1.
    Same formula and order as microgpt/cpu/adamw.h."""
    m[...] = tc.beta1 * m + (1.0 - tc.beta1) * grads
    v[...] = tc.beta2 * v + (1.0 - tc.beta2) * grads * grads
    mhat = m / (1.0 - tc.beta1 ** t)
    vhat = v / (1.0 - tc.beta2 ** t)
    params -= lr * (mhat / (np.sqrt(vhat) + tc.eps) + tc.weight_decay * mask * params)


def train(params, m, v, cfg, tc, batches, first_step=0):
    """Run one optimizer step per (inputs, targets) batch at constant LR tc.lr, starting after
    `first_step` completed steps. Updates params, m, v in place; returns [(loss, grad_norm)]."""
    mask = decay_mask(cfg)
    history = []
    for i, (inputs, targets) in enumerate(batches):
        loss, grads = loss_and_grads(params, cfg, inputs, targets)
        grads, norm = clip_grads(grads, tc.grad_clip)
        adamw_step(params, grads, m, v, first_step + i + 1, tc.lr, tc, mask)
        history.append((loss, norm))
    return history
