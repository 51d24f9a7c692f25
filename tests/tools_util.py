"""The float64 reference (tests/reference.py) run on a checkpoint, for the tests of the tools that use
a trained model (chat, evaluate, export): its log-probabilities and its greedy continuation; and an
engine killed at start."""
import numpy as np

import reference as ref
from microgpt.checkpoint import read_checkpoint, read_sidecar


def reference_model(ckpt):
    """(ModelConfig, float64 flat parameters) of a checkpoint, its shape from the sidecar."""
    shape = read_sidecar(ckpt)["fingerprint"]
    cfg = ref.ModelConfig(shape["vocab_size"], shape["padded_vocab_size"], shape["n_layer"], shape["d_model"],
                          shape["n_head"], shape["seq_len"], shape["d_ff"])
    return cfg, read_checkpoint(ckpt).params.astype(np.float64)


def reference_log_probs(cfg, flat, ids):
    """[len(ids), vocab_size] log-probabilities of the next token at every position of ids."""
    inputs = np.array([ids])
    _, cache = ref.forward(flat, cfg, inputs, np.zeros_like(inputs))
    return np.log(cache["probs"][0])


def reference_greedy(cfg, flat, prompt, max_tokens, stop=()):
    """Greedy continuation of prompt: the argmax token each step, until a stop token (included),
    max_tokens tokens, or the context (seq_len) is full."""
    ids, out = list(prompt), []
    while len(out) < max_tokens and len(ids) < cfg.seq_len:
        token = int(np.argmax(reference_log_probs(cfg, flat, ids)[-1]))
        out.append(token)
        if token in stop:
            break
        ids.append(token)
    return out


def killed_engine(tmp_path):
    """An engine that writes the memory plan an engine writes at start, then is killed (kill -9, the
    OOM killer), as a shell script."""
    fake = tmp_path / "killed_engine"
    fake.write_text("#!/bin/sh\necho 'memory plan (cpu): params 6.5 MB, total 59.7 MB' >&2\nkill -9 $$\n")
    fake.chmod(0o755)
    return fake

