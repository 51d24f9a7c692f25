"""ANDREA (docs/DESIGN.md §2) in PyTorch: the baseline the engine is benchmarked against (docs/DESIGN.md §9).

Same model, initial weights, training and validation windows (drawn from the engine's own
counter-based generator, bench/engine_rng.py), optimizer, schedule and clipping as the engine
(docs/DESIGN.md). Losses still drift apart slowly: the arithmetic differs in rounding. Two precisions:

    --precision bf16   bf16 autocast, fused AdamW, flash attention through SDPA, and --compile:
                         default         torch.compile(model) (the default)
                         reduce-overhead torch.compile with CUDA graphs; each step begins with
                                         torch.compiler.cudagraph_mark_step_begin()
                         max-autotune    reduce-overhead plus autotuned product kernels (compiling
                                         takes minutes)
                         none            eager
    --precision fp8    bf16 with the blocks' linear layers (QKV, attention output, MLP up and down)
                       trained in float8 by torchao (convert_to_float8_training, tensorwise scaling:
                       E4M3 weights and activations, E5M2 gradients, a dynamic scale per tensor), the
                       classifier in bf16 (the engine's fp8 mode runs the classifier's three
                       products in FP8 from d_model 512 by default, the logits' alone with
                       train.fp8_classifier logits, docs/DESIGN.md §18); --compile as for bf16.
                       torchao is imported as it is installed (not in requirements.txt: it needs a
                       CUDA torch); where it is missing this precision stops with one error line.
    --precision fp32   eager fp32 with TF32 matmuls allowed, fused AdamW

It prints the engine's stdout format (docs/DESIGN.md §3.8), so bench.py reads both the same way:
step records {"step","loss","lr","grad_norm","ms","tokens_per_s","tokens"}, {"step","val_loss"},
{"event":"device_memory",...} at the first and last step, and a final {"event":"torch_memory",...}.

    python3 bench/torch_gpt.py [12M|120M|CONFIG] [--precision bf16|fp8|fp32] [--compile MODE] [--steps N]
                               [--data GLOB] [--val GLOB] [--device cuda|cpu] [--model.n_layer N ...]
"""
import contextlib
import json
import sys
import time

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

import engine_rng
from bench_common import (BenchError, experiment_path, load_config, lr_at, model_shape, param_shapes, shard_paths,
                          train_settings)
from microgpt.cli import ArgumentParser
from microgpt.shards import ShardError, read_shard

# -----------------------------------------------------------------------------
# the model


class Block(nn.Module):
    def __init__(self, d, n_head, d_ff):
        super().__init__()
        self.n_head = n_head
        self.ln1 = nn.LayerNorm(d, eps=1e-5)
        # W_Q, W_K, W_V as one [3d, d] matrix: the same model, one matmul instead of three
        self.qkv = nn.Linear(d, 3 * d, bias=False)
        self.proj = nn.Linear(d, d, bias=False)          # W_O
        self.ln2 = nn.LayerNorm(d, eps=1e-5)
        self.fc = nn.Linear(d, d_ff, bias=False)         # W_1
        self.fc_proj = nn.Linear(d_ff, d, bias=False)    # W_2

    def forward(self, x):
        B, T, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(d, dim=2)
        # head h uses columns [h*hs, (h+1)*hs) of Q, K, V, as in the engine
        q, k, v = (t.view(B, T, self.n_head, d // self.n_head).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).contiguous().view(B, T, d))
        x = x + self.fc_proj(F.gelu(self.fc(self.ln2(x)), approximate="tanh"))
        return x


class GPT(nn.Module):
    def __init__(self, shape, seed=1337):
        """seed None leaves torch's default initialisation (for shape-only uses)."""
        super().__init__()
        self.shape = shape
        d = shape["d_model"]
        self.wte = nn.Embedding(shape["padded_vocab_size"], d)
        self.wpe = nn.Embedding(shape["seq_len"], d)
        self.blocks = nn.ModuleList(Block(d, shape["n_head"], shape["d_ff"]) for _ in range(shape["n_layer"]))
        self.lnf = nn.LayerNorm(d, eps=1e-5)
        if seed is not None:
            self.init_weights(seed)

    def init_weights(self, seed):
        """The engine's initial weights exactly (docs/DESIGN.md §2, drawn from the engine's counter-based
        generator): N(0, 0.02), W_O and W_2 N(0, 0.02/sqrt(2 n_layer)), LayerNorm gamma 1, beta 0."""
        self.load_flat(engine_rng.init_params(param_shapes(self.shape), self.shape["n_layer"], seed))

    def forward(self, idx, targets):
        T = idx.shape[1]
        x = self.wte(idx) + self.wpe(torch.arange(T, device=idx.device))
        for block in self.blocks:
            x = block(x)
        logits = F.linear(self.lnf(x), self.wte.weight)   # tied, [B, T, padded_vocab]
        V = self.shape["vocab_size"]
        # softmax over the real vocabulary only: padded columns take no probability mass
        return F.cross_entropy(logits[..., :V].reshape(-1, V), targets.reshape(-1))   # fp32 under autocast

    # -- the flat parameter vector of docs/DESIGN.md §2 (weights [in, out]), for checks against other
    #    implementations; the torch Linear stores [out, in], hence the transposes.

    def flat_tensors(self, use_grad=False):
        """The model's tensors in docs/DESIGN.md §2 order, each as the engine lays it out."""
        get = (lambda p: p.grad) if use_grad else (lambda p: p.data)
        d = self.shape["d_model"]
        out = [get(self.wte.weight), get(self.wpe.weight)]
        for b in self.blocks:
            qkv = get(b.qkv.weight)
            out += [qkv[0:d].t(), qkv[d:2 * d].t(), qkv[2 * d:].t(), get(b.proj.weight).t(),
                    get(b.fc.weight).t(), get(b.fc_proj.weight).t(),
                    get(b.ln1.weight), get(b.ln1.bias), get(b.ln2.weight), get(b.ln2.bias)]
        return out + [get(self.lnf.weight), get(self.lnf.bias)]

    def flat(self, use_grad=False):
        return torch.cat([t.reshape(-1) for t in self.flat_tensors(use_grad)])

    @torch.no_grad()
    def load_flat(self, vec):
        """Set every parameter from a flat vector in docs/DESIGN.md §2 order."""
        targets = self.flat_tensors()
        vec = torch.as_tensor(vec, dtype=targets[0].dtype)
        n = sum(t.numel() for t in targets)
        if vec.numel() != n:
            raise BenchError(f"flat vector has {vec.numel()} values, the model has {n}")
        offset = 0
        for t in targets:
            t.copy_(vec[offset:offset + t.numel()].view(t.shape))   # t may be a transposed view
            offset += t.numel()


def make_optimizer(model, t, fused):
    """AdamW with decoupled decay on the 2-D tensors only (docs/DESIGN.md §3.2)."""
    params = list(model.parameters())
    groups = [{"params": [p for p in params if p.dim() == 2], "weight_decay": t["weight_decay"]},
              {"params": [p for p in params if p.dim() != 2], "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=t["lr"], betas=(t["beta1"], t["beta2"]), eps=t["eps"], fused=fused)


# -----------------------------------------------------------------------------
# data: windows of T+1 tokens drawn uniformly over all windows of all shards (never across a shard)


class Windows:
    """The engine's windows exactly (data.h): window b of a batch starts at a position drawn from
    rng(seed, stream, counter0 + b) over all windows of T+1 tokens of all shards."""

    def __init__(self, pattern, T, vocab_size, seed, stream):
        paths = shard_paths(pattern)
        role = "train" if stream == engine_rng.STREAM_TRAIN else "val"
        if not paths:
            raise BenchError(f"no {role} shards match {pattern}")
        try:
            self.shards = [read_shard(p) for p in paths]
        except ShardError as e:
            raise BenchError(str(e))
        for p, s in zip(paths, self.shards):
            if s.size and int(s.max()) >= vocab_size:
                raise BenchError(f"{p}: token id {int(s.max())} >= vocab_size {vocab_size}")
        self.T, self.seed, self.stream = T, seed, stream
        self.first_window = [0]
        for s in self.shards:
            self.first_window.append(self.first_window[-1] + max(0, s.size - T))
        if self.first_window[-1] == 0:
            raise BenchError(f"{role} shards {pattern} hold no window of seq_len+1 = {T + 1} tokens")

    def batch(self, counter0, B):
        """(inputs, targets) as int64 arrays [B, T]."""
        starts = engine_rng.window_starts(self.first_window, self.seed, self.stream, counter0, B)
        w = np.stack([self.shards[i][j:j + self.T + 1] for i, j in starts]).astype(np.int64)
        return w[:, :-1], w[:, 1:]


# -----------------------------------------------------------------------------
# training


def emit(record):
    print(json.dumps(record), flush=True)


def to_device(a, device):
    # a plain copy: each step ends in a sync anyway, so pinned memory would buy no overlap
    return torch.from_numpy(a).to(device)


AUTOCAST_PRECISIONS = ("bf16", "fp8")   # bf16 autocast around the model; fp8 adds torchao's float8 products


def setup_precision(precision, device):
    """Global switches for the mode; returns the autocast context factory."""
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True     # the "PyTorch fp32 (tf32)" baseline of the targets
        torch.backends.cudnn.allow_tf32 = True
    if precision in AUTOCAST_PRECISIONS:
        if device.type == "cuda":
            # flash attention only, so a silent fallback to another SDPA kernel is an error instead
            torch.backends.cuda.enable_math_sdp(False)
            torch.backends.cuda.enable_mem_efficient_sdp(False)
            torch.backends.cuda.enable_cudnn_sdp(False)
            torch.backends.cuda.enable_flash_sdp(True)
        return lambda: torch.autocast(device_type=device.type, dtype=torch.bfloat16)
    return contextlib.nullcontext


def device_used_bytes(device):
    """Bytes in use on the whole device as the driver sees it (includes the CUDA context)."""
    free, total = torch.cuda.mem_get_info(device)
    return total - free


def evaluate(model, val, B, n_batches, autocast, device):
    total = 0.0
    with torch.no_grad(), autocast():
        for i in range(n_batches):
            x, y = val.batch(i * B, B)
            total += model(to_device(x, device), to_device(y, device)).item()
    return total / n_batches


def clip_grads(params, grad_clip):
    """Global L2 norm; scale by grad_clip/norm when it exceeds grad_clip (the engine's rule, exactly:
    torch's clip_grad_norm_ adds 1e-6 to the norm). Returns the norm before clipping, on the device."""
    grads = [p.grad for p in params]
    norm = torch.nn.utils.get_total_norm(grads)
    if grad_clip > 0:
        torch._foreach_mul_(grads, torch.clamp(grad_clip / norm, max=1.0))
    return norm


def train_step(model, opt, batches, lr, grad_clip, autocast):
    """One optimizer step over len(batches) micro-batches; returns (mean loss, grad norm) as device
    tensors so the caller decides when to synchronise."""
    params = [p for group in opt.param_groups for p in group["params"]]
    loss_sum = 0.0
    for x, y in batches:
        with autocast():
            loss = model(x, y)
        (loss / len(batches)).backward()
        loss_sum = loss_sum + loss.detach()
    norm = clip_grads(params, grad_clip)
    for group in opt.param_groups:
        group["lr"] = lr
    opt.step()
    opt.zero_grad(set_to_none=True)
    return loss_sum / len(batches), norm


def float8_training(model):
    """torchao's float8 training on every nn.Linear of the model (the blocks' four products; the
    classifier is F.linear on the tied embedding, so it stays bf16, as torchao's documentation
    advises for the last layer; the engine's fp8 mode runs its logits product in FP8 from d_model
    512). Tensorwise recipe: each operand cast with a dynamic per-tensor scale from its amax,
    E4M3 forward, E5M2 gradients. Returns torchao's version."""
    try:
        import torchao
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training
    except ImportError as e:
        raise BenchError(f"--precision fp8 needs torchao's float8 training, which is not importable here ({e}); "
                         "install torchao matching this torch (docs/BENCHMARKS.md)") from None
    convert_to_float8_training(model, config=Float8LinearConfig.from_recipe_name("tensorwise"))
    return torchao.__version__


COMPILE_MODES = ("none", "default", "reduce-overhead", "max-autotune")
CUDA_GRAPH_MODES = ("reduce-overhead", "max-autotune")   # torch.compile modes that replay CUDA graphs


def compiled(model, mode):
    """The model as the step runs it: itself (mode none) or torch.compile'd in that mode."""
    if mode == "none":
        return model
    return torch.compile(model) if mode == "default" else torch.compile(model, mode=mode)


def ddp_setup(device):
    """PyTorch DDP under torchrun's variables (WORLD_SIZE > 1): the baseline for the engine's data
    parallelism (docs/DESIGN.md §17, scripts/multi-gpu-check.sh). Returns (rank, world, device)."""
    import os
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world == 1:
        return 0, 1, device
    rank = int(os.environ["RANK"])
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", rank)))
    torch.cuda.set_device(device)
    torch.distributed.init_process_group("nccl", device_id=device)
    return rank, world, device


def train(cfg, args):
    shape, t = model_shape(cfg), train_settings(cfg)
    rank, world, device = ddp_setup(torch.device(args.device))
    global emit
    if rank != 0:
        emit = lambda record: None  # noqa: E731  (rank 0 reports, as the engine's ranks do)
    autocast = setup_precision(args.precision, device)
    B, T, accum = t["batch_size"], shape["seq_len"], t["grad_accum"]

    train_data = Windows(args.data, T, shape["vocab_size"], t["seed"], engine_rng.STREAM_TRAIN)
    val_data = Windows(args.val, T, shape["vocab_size"], t["seed"], engine_rng.STREAM_VAL) if args.val else None

    model = GPT(shape, t["seed"]).to(device)
    torchao_version = float8_training(model) if args.precision == "fp8" else None
    compile_mode = args.compile if args.precision in AUTOCAST_PRECISIONS else "none"
    step_model = compiled(model, compile_mode)
    if world > 1:  # gradients averaged over the ranks; each rank's micro-batches as the engine's
        step_model = torch.nn.parallel.DistributedDataParallel(step_model, device_ids=[device.index])
    opt = make_optimizer(model, t, fused=device.type == "cuda")
    n_params = sum(p.numel() for p in model.parameters())
    emit({"event": "start", "engine": "torch", "n_params": n_params, "steps": t["steps"],
          "precision": args.precision, "compile": compile_mode, "torch": torch.__version__,
          "torch_cuda": torch.version.cuda, "torchao": torchao_version,
          "tokens_per_step": B * T * accum * world, "world_size": world})

    for s in range(t["steps"]):
        t0 = time.perf_counter()
        lr = lr_at(s, t)
        batches = [tuple(to_device(a, device) for a in train_data.batch(((s * world + rank) * accum + j) * B, B))
                   for j in range(accum)]
        if compile_mode in CUDA_GRAPH_MODES:
            # a new step: the graphs' outputs of the last one (loss, gradients) are no longer read
            torch.compiler.cudagraph_mark_step_begin()
        loss, norm = train_step(step_model, opt, batches, lr, t["grad_clip"], autocast)
        loss_val, norm_val = torch.stack([loss, norm]).tolist()   # one sync per step, as the engine's loss read
        ms = (time.perf_counter() - t0) * 1000.0
        emit({"step": s + 1, "loss": loss_val, "lr": lr, "grad_norm": norm_val, "ms": ms,
              "tokens_per_s": B * T * accum * world / (ms / 1000.0), "tokens": (s + 1) * B * T * accum * world})
        if device.type == "cuda" and s in (0, t["steps"] - 1):
            emit({"event": "device_memory", "step": s + 1, "bytes": device_used_bytes(device)})

    if val_data is not None:
        n_batches = cfg.get("eval", {}).get("batches", 20)
        emit({"step": t["steps"], "val_loss": evaluate(model, val_data, B, n_batches, autocast, device)})
    if device.type == "cuda":
        emit({"event": "torch_memory", "peak_allocated": torch.cuda.max_memory_allocated(device),
              "peak_reserved": torch.cuda.max_memory_reserved(device),
              "device_used": device_used_bytes(device)})
    emit({"event": "exit", "step": t["steps"], "reason": "finished"})


def apply_overrides(cfg, pairs):
    """--section.key VALUE pairs (the engine's flag names) override the config; numbers stay numbers."""
    if len(pairs) % 2:
        raise BenchError(f"flag {pairs[-1]} needs a value")
    for flag, value in zip(pairs[::2], pairs[1::2]):
        if not flag.startswith("--") or flag.count(".") != 1:
            raise BenchError(f"unknown flag {flag}")
        section, key = flag[2:].split(".")
        for cast in (int, float, str):
            try:
                cfg.setdefault(section, {})[key] = cast(value)
                break
            except ValueError:
                continue


def parse_args(argv):
    p = ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("config", nargs="?", default="12M", help="12M, 120M (shipped experiments) or a config path")
    p.add_argument("--precision", choices=("bf16", "fp8", "fp32"), default="bf16")
    p.add_argument("--steps", type=int, help="override train.steps")
    p.add_argument("--data", help="train shard glob (default: the config's data.train)")
    p.add_argument("--val", help="val shard glob (default: the config's data.val; '' for none)")
    p.add_argument("--device", default="cuda")
    p.add_argument("--compile", choices=COMPILE_MODES, default="default",
                   help="bf16, fp8: torch.compile mode, or none for eager (fp32 always runs eager)")
    args, rest = p.parse_known_args(argv)
    cfg = load_config(experiment_path(args.config))
    apply_overrides(cfg, rest)
    if args.steps is not None:
        cfg["train"]["steps"] = args.steps
    if "steps" not in cfg["train"] or cfg["train"]["steps"] < 1:
        raise BenchError("train.steps must be given and >= 1")
    data = cfg.get("data", {})
    args.data = args.data or data.get("train")
    if not args.data:
        raise BenchError("no train data: give --data or data.train in the config")
    args.val = data.get("val") if args.val is None else args.val
    return cfg, args


def main(argv):
    try:
        cfg, args = parse_args(argv)
        if args.device.startswith("cuda") and not torch.cuda.is_available():
            raise BenchError("no CUDA device visible to torch (use --device cpu for a smoke run)")
        train(cfg, args)
    except BenchError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
