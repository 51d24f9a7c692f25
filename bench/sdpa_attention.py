"""PyTorch's attention kernels at the attention shapes of ANDREA-120M and ANDREA-12M, for comparison
with bench/attn_bench.cu (the engine's flash kernels): FlashAttention-2 (PyTorch's flash backend),
cuDNN's fused attention and the memory-efficient kernel, each causal, bf16, on random inputs.

For each backend: the forward alone and the backward (forward + backward minus forward), the median
of 30 launches timed with CUDA events after 5 warm-up launches: µs per launch (one layer), TFLOP/s
of the causal half counted as attn_bench counts it (forward 2 products, backward 5), and µs per
training step (× layers). At ANDREA-12M's shapes each launch is shorter than PyTorch's own overhead
from Python, so only the ANDREA-120M lines compare kernels. Needs a CUDA GPU and torch; a
measurement, not a test.

    python3 bench/sdpa_attention.py
"""
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

SHAPES = {"120M": (8, 12, 1024, 64, 12), "12M": (8, 6, 512, 32, 6)}  # B, H, T, head size, layers
BACKENDS = (SDPBackend.FLASH_ATTENTION, SDPBackend.CUDNN_ATTENTION, SDPBackend.EFFICIENT_ATTENTION)


def median_us(fn, reps=30, warmup=5):
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) * 1000.0)
    return sorted(times)[len(times) // 2]


def main():
    for model, (B, H, T, D, layers) in SHAPES.items():
        q, k, v = (torch.randn(B, H, T, D, device="cuda", dtype=torch.bfloat16, requires_grad=True)
                   for _ in range(3))
        dout = torch.randn(B, H, T, D, device="cuda", dtype=torch.bfloat16)
        product = 2.0 * B * H * T * (T + 1) / 2 * D  # one product over the causal half
        for backend in BACKENDS:
            try:
                with sdpa_kernel([backend]):
                    fwd = median_us(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True))
                    both = median_us(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True).backward(dout))
            except RuntimeError as err:  # a backend that refuses the shape or GPU
                print(f"sdpa {model:5s} {backend.name:20s} error: {str(err).splitlines()[0]}")
                continue
            bwd = both - fwd
            print(f"sdpa {model:5s} {backend.name:20s} forward {fwd:8.1f} us {2 * product / fwd / 1e6:6.1f} TFLOP/s"
                  f" {fwd * layers:8.1f} us/step   backward {bwd:8.1f} us {5 * product / bwd / 1e6:6.1f} TFLOP/s"
                  f" {bwd * layers:8.1f} us/step")


if __name__ == "__main__":
    main()
