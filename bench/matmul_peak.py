"""The GPU's bf16 matmul rate as this machine delivers it now: the denominator of the benchmark's MFU.

    python3 bench/matmul_peak.py [--n 8192] [--reps 30]

One n×n×n bf16 product (torch.matmul, fp32 accumulation, cuBLAS's choice of kernel), launched
--reps times after a warm-up, each launch timed alone with CUDA events; prints one JSON line
{"tflops": median rate, "tflops_max": best launch, "n", "reps", "device", "torch", "torch_cuda"}.
The inputs are random normal values: zeroed inputs draw less power and run faster than a real
product does. A rate measured in the same run as the step times is the ceiling those steps had.
"""
import json
import statistics
import sys

import torch

from microgpt.cli import ArgumentParser


def product_seconds(n, reps, warmup=5):
    """Each launch's time in seconds, measured on the device between two events."""
    a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    out = torch.empty(n, n, device="cuda", dtype=torch.bfloat16)
    for _ in range(warmup):
        torch.matmul(a, b, out=out)
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        torch.matmul(a, b, out=out)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1000.0)
    return times


def main(argv):
    p = ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--n", type=int, default=8192, help="product size n (n×n by n×n)")
    p.add_argument("--reps", type=int, default=30, help="timed launches")
    args = p.parse_args(argv)
    if args.n < 1 or args.reps < 1:
        print("error: --n and --reps must be >= 1", file=sys.stderr)
        return 2
    if not torch.cuda.is_available():
        print("error: no CUDA device visible to torch", file=sys.stderr)
        return 2
    flops = 2.0 * args.n ** 3
    times = product_seconds(args.n, args.reps)
    print(json.dumps({"tflops": flops / statistics.median(times) / 1e12, "tflops_max": flops / min(times) / 1e12,
                      "n": args.n, "reps": args.reps, "device": torch.cuda.get_device_name(),
                      "torch": torch.__version__, "torch_cuda": torch.version.cuda}))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
