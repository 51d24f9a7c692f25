"""The fixed cuBLASLt algorithm table of a GPU (microgpt/cuda/lt_table_sm90.h for the H200, read by
lt_table.h; docs/DESIGN.md §9) from the output of bench/lt_algos.cu.

    python3 bench/lt_table.py lt.txt [-o microgpt/cuda/lt_table_sm90.h] [--min-gain-pct 3]

A product's fastest offer enters the table when it is another configuration than the rule's,
faster than the rule's by at least --min-gain-pct (a smaller gain is taken for noise: the probe's
medians of one product move by about that much from run to run), gave bitwise the same output
twice (repeat=1), matches the rule's output to DIFF_MAX, uses one of cuBLASLt's reduction schemes
(none, in place, compute type, output type: every split-K reduction cuBLASLt has, none of them
atomics-based; the header's cublasLtReductionScheme_t) and a workspace within the engine's. The
header says where and when the table was measured, carries each entry's probe line, and lists the
products left out and why. Written atomically; bad input is one `error:` line and exit status 1.
"""
import math
import os
import re
import shlex
import sys
import tempfile

from microgpt.cli import ArgumentParser

DEFAULT_OUT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "microgpt", "cuda", "lt_table_sm90.h")
CONFIG_FIELDS = ("algo_id", "tile", "stages", "splitk", "reduction", "swizzle", "custom", "inner_shape",
                 "cluster_shape")
DETERMINISTIC_REDUCTIONS = (0, 1, 2, 4)  # cublasLtReductionScheme_t: NONE, INPLACE, COMPUTE_TYPE, OUTPUT_TYPE
# Two fp32 accumulations of the same products in other orders differ by rounding: a bf16 output by
# about one unit in the last place of its largest values (2^-8, 0.4 %); 2 % still catches a wrong result.
DIFF_MAX = 0.02
ENV_FIELDS = ("gpu", "cc", "sms", "driver", "cublaslt", "cudart", "date", "workspace")
PRODUCT_FIELDS = ("model", "prec", "product", "key", "calls", "offers", "rule_us", "best_us", "repeat", "diff", "ws",
                  "rule", "best")
KEY_RE = re.compile(r"^[A-Za-z0-9_.]+$")
GPU_RE = re.compile(r"^[A-Za-z0-9 _.()/-]+$")  # a device name that is a C string literal as it stands


class ProbeError(ValueError):
    pass


def _fields(line, lineno, required):
    try:
        words = shlex.split(line)[1:]
    except ValueError as e:
        raise ProbeError(f"line {lineno}: {e}")
    out = {}
    for w in words:
        name, eq, value = w.partition("=")
        if not eq:
            raise ProbeError(f"line {lineno}: '{w}' is not name=value")
        out[name] = value
    missing = [f for f in required if f not in out]
    if missing:
        raise ProbeError(f"line {lineno}: missing {', '.join(missing)}")
    return out


def _config(text, lineno):
    parts = text.split(":")
    if len(parts) != len(CONFIG_FIELDS) or not all(re.fullmatch(r"-?\d+", p) for p in parts):
        raise ProbeError(f"line {lineno}: config '{text}' is not {len(CONFIG_FIELDS)} integers joined by ':'")
    return tuple(int(p) for p in parts)


def _number(fields, name, lineno, kind=float):
    """A field's finite number: a nan or inf time or difference would pass every comparison of the
    filter (nan > x is false) and put its product in the table."""
    try:
        value = kind(fields[name])
    except ValueError:
        value = math.nan
    if not math.isfinite(value):
        raise ProbeError(f"line {lineno}: {name}={fields[name]} is not a finite number")
    return value


def parse(text):
    """(env, products) of a probe output: env a dict of the LTPROBE-ENV line, products a list of
    dicts, one a LTPROBE line, with 'line' the line itself."""
    env, products = None, []
    for lineno, line in enumerate(text.splitlines(), 1):
        if line.startswith("LTPROBE-ENV"):
            if env is not None:
                raise ProbeError(f"line {lineno}: a second LTPROBE-ENV line (one probe run a file)")
            env = _fields(line, lineno, ENV_FIELDS)
            if not GPU_RE.match(env["gpu"]):
                raise ProbeError(f"line {lineno}: gpu '{env['gpu']}' has characters other than letters, digits, "
                                 "' _.()/-'")
            env["sms"] = _number(env, "sms", lineno, int)
            env["cublaslt"] = _number(env, "cublaslt", lineno, int)
            env["workspace"] = _number(env, "workspace", lineno, int)
        elif line.startswith("LTPROBE "):
            f = _fields(line, lineno, PRODUCT_FIELDS)
            if not KEY_RE.match(f["key"]):
                raise ProbeError(f"line {lineno}: key '{f['key']}' has characters other than letters, digits, '.', '_'")
            for name in ("rule_us", "best_us", "diff"):
                f[name] = _number(f, name, lineno)
            for name in ("calls", "offers", "repeat", "ws"):
                f[name] = _number(f, name, lineno, int)
            f["rule"], f["best"] = _config(f["rule"], lineno), _config(f["best"], lineno)
            f["line"] = line.strip()
            if any(p["key"] == f["key"] for p in products):
                raise ProbeError(f"line {lineno}: key {f['key']} a second time")
            products.append(f)
    if env is None:
        raise ProbeError("no LTPROBE-ENV line: not the output of bench/lt_algos.cu")
    if env["cc"] != "9.0":
        raise ProbeError(f"measured on compute capability {env['cc']}: this table is for 9.0")
    return env, products


def why_left_out(p, env, min_gain_pct):
    """None when the product's fastest offer enters the table, else the reason it does not."""
    if p["best"] == p["rule"]:
        return "the rule's choice is the fastest offer"
    if p["best_us"] > p["rule_us"] * (1 - min_gain_pct / 100):
        return f"within {min_gain_pct:g} % of the rule's choice (noise)"
    if p["repeat"] != 1:
        return "not bitwise the same output twice"
    if p["diff"] > DIFF_MAX:
        return f"differs from the rule's output by {p['diff']:g} of its largest value"
    if p["best"][CONFIG_FIELDS.index("reduction")] not in DETERMINISTIC_REDUCTIONS:
        return "an unknown reduction scheme"
    if p["ws"] > env["workspace"]:
        return "needs more workspace than the engine's"
    return None


def savings(env, products, min_gain_pct):
    """{(model, prec): µs of product time a step the table saves, as the probe measured it}: over the
    kept products, (rule_us - best_us) times the product's launches a step. The probe's fp8 step has
    the bf16 classifier (it probes no FP8 classifier): the bf16 classifier's products count for both,
    as in the engine below d_model 512; at 120M the engine's fp8 runs the FP8 classifier, which the
    table's bf16 entries do not reach, so that figure is an upper bound. The probe's products run
    alone, on cold operands; in a step at the power limit the gain has been smaller (log #30)."""
    out = {}
    for p in products:
        gain = (p["rule_us"] - p["best_us"]) * p["calls"] if why_left_out(p, env, min_gain_pct) is None else 0.0
        precs = ("bf16", "fp8") if p["product"] == "classifier" and p["prec"] == "bf16" else (p["prec"],)
        for prec in precs:
            out[(p["model"], prec)] = out.get((p["model"], prec), 0.0) + gain
    return out


def _comment(text):
    return text.replace("*/", "* /")


def header(env, products, source, min_gain_pct):
    """The C text of the table."""
    kept = [p for p in products if why_left_out(p, env, min_gain_pct) is None]
    left = [(p, why_left_out(p, env, min_gain_pct)) for p in products if p not in kept]
    out = [
        "/* lt_table_sm90.h: the fixed cuBLASLt algorithms of compute capability 9.0 (lt_table.h), generated",
        f" * by bench/lt_table.py from {_comment(os.path.basename(source))}, the output of bench/lt_algos.cu, measured on",
        f" * {_comment(env['gpu'])} ({env['sms']} multiprocessors), NVIDIA driver {_comment(env['driver'])}, cuBLASLt "
        f"{env['cublaslt']}, CUDA runtime {_comment(env['cudart'])}, {_comment(env['date'])}.",
        f" * An entry: a product whose fastest offer beat the rule's choice by at least {min_gain_pct:g} %, with",
        " * the probe line it came from. Do not edit: run the probe and the generator again. */",
        "#ifndef MICROGPT_CUDA_LT_TABLE_SM90_H",
        "#define MICROGPT_CUDA_LT_TABLE_SM90_H",
        "",
        '#include "lt_table.h"',
        "",
        "/* The table applies only on a GPU of this name (cudaDeviceProp.name: an H100 has the H200's compute",
        " * capability and multiprocessors) and this many multiprocessors, with this cuBLASLt (cublasLtGetVersion). */",
        f'#define LT_TABLE_GPU_NAME "{env["gpu"]}"',
        f"#define LT_TABLE_SM_COUNT {env['sms']}",
        f"#define LT_TABLE_CUBLASLT_VERSION {env['cublaslt']}",
        "",
    ]
    out.append("/* Product time a step the probe's figures save (Σ (rule_us - best_us) × launches a step):")
    out += [f" *   {m} {prec}: {us:.0f} µs" for (m, prec), us in savings(env, products, min_gain_pct).items()]
    out.append(" */")
    if left:
        out.append("/* Left out (the rule stays):")
        out += [f" *   {_comment(p['key'])}: {_comment(why)}" for p, why in left]
        out.append(" */")
    out.append("static const LtTableEntry g_lt_table[] = {")
    for p in kept:
        out.append(f"    /* {_comment(p['line'])} */")
        out.append(f'    {{"{p["key"]}", {", ".join(str(v) for v in p["best"])}}},')
    out += ["    {NULL, 0, 0, 0, 0, 0, 0, 0, 0, 0},", "};", "", "#endif", ""]
    return "\n".join(out)


def write_atomic(path, text):
    d = os.path.dirname(os.path.abspath(path))
    fd, tmp = tempfile.mkstemp(dir=d, prefix=".lt_table.")
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise


def main(argv=None):
    ap = ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("probe_output", help="the output of build/lt_algos")
    ap.add_argument("-o", "--out", default=DEFAULT_OUT, help="the header to write (default: %(default)s)")
    ap.add_argument("--min-gain-pct", type=float, default=3.0,
                    help="least gain over the rule's choice for an entry, %% (default: %(default)s)")
    args = ap.parse_args(argv)
    if not 0 <= args.min_gain_pct < 100:  # also refuses nan, which every gain would pass
        print(f"error: --min-gain-pct {args.min_gain_pct:g} is not from 0 up to 100", file=sys.stderr)
        return 1
    try:
        with open(args.probe_output, encoding="utf-8") as f:
            env, products = parse(f.read())
    except (OSError, UnicodeDecodeError, ProbeError) as e:
        print(f"error: {args.probe_output}: {e}", file=sys.stderr)
        return 1
    if not products:
        print(f"error: {args.probe_output}: no LTPROBE product lines", file=sys.stderr)
        return 1
    text = header(env, products, args.probe_output, args.min_gain_pct)
    try:
        write_atomic(args.out, text)
    except OSError as e:
        print(f"error: {args.out}: {e.strerror or e}", file=sys.stderr)
        return 1
    kept = sum(why_left_out(p, env, args.min_gain_pct) is None for p in products)
    print(f"{args.out}: {kept} of {len(products)} products in the table")
    for (model, prec), us in savings(env, products, args.min_gain_pct).items():
        print(f"  {model} {prec}: {us:.0f} µs of product time a step saved, as probed")
    return 0


if __name__ == "__main__":
    sys.exit(main())
