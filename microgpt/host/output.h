/* output.h: the two output channels of an engine.
 * stdout carries one JSON object per line for machines (the proxy parses it), flushed after every
 * line so a reader never sees half a record; stderr carries messages for people.
 * Every bad input ends in exactly one "error: ..." line on stderr and exit code 2 (die_input).
 * Every stderr line (error, warning, info) is one line of UTF-8 whatever user text it quotes: its
 * control bytes, and bytes that are no UTF-8, are written as \xNN (put_line).
 * Compiles as C99 and as C++ (nvcc). */
#ifndef MICROGPT_HOST_OUTPUT_H
#define MICROGPT_HOST_OUTPUT_H

#ifndef _POSIX_C_SOURCE
#define _POSIX_C_SOURCE 200809L
#endif
#include <errno.h>
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define EXIT_BAD_INPUT 2 /* unknown/malformed flag, bad shard, bad checkpoint, ... */
#define EXIT_FAILURE_IO 1 /* the machine failed us (disk full, out of memory) */
#define EXIT_DIVERGED 3 /* the loss, gradient norm or state went non-finite; nothing of it was saved */

/* The length (1 to 4) of the well-formed UTF-8 sequence at s, or 0 where the bytes are none
 * (RFC 3629: no overlong form, no surrogate, nothing past U+10FFFF). Reads no byte past a NUL. */
static int utf8_sequence_length(const unsigned char* s) {
    unsigned char lo = 0x80, hi = 0xBF; /* the range of the second byte */
    int n, i;
    if (s[0] < 0x80) return 1;
    if (s[0] >= 0xC2 && s[0] <= 0xDF) n = 2;
    else if (s[0] >= 0xE0 && s[0] <= 0xEF) n = 3;
    else if (s[0] >= 0xF0 && s[0] <= 0xF4) n = 4;
    else return 0;
    if (s[0] == 0xE0) lo = 0xA0;      /* overlong */
    else if (s[0] == 0xED) hi = 0x9F; /* surrogates */
    else if (s[0] == 0xF0) lo = 0x90; /* overlong */
    else if (s[0] == 0xF4) hi = 0x8F; /* past U+10FFFF */
    if (s[1] < lo || s[1] > hi) return 0;
    for (i = 2; i < n; i++)
        if (s[i] < 0x80 || s[i] > 0xBF) return 0;
    return n;
}

/* prefix, then the formatted message, then a newline: one line on stderr, written at once (lines of
 * ranks sharing a stderr do not mix). Messages quote user text (a flag, a glob, a value, a path):
 * its control bytes (below 0x20, and 0x7f) are written as \xNN, so a newline in it cannot split the
 * line (a forged second "error:" line for the proxy, which parses stderr) nor an escape sequence
 * reach a terminal. UTF-8 passes as it is; a byte that starts no well-formed sequence (a flag's
 * value of raw bytes, a sidecar string's lone surrogate) is \xNN too, so every line is UTF-8. A
 * message past 8 KiB is cut and ends in "..." so the cut shows. */
static void put_line(const char* prefix, const char* fmt, va_list ap) {
    static const char hex[] = "0123456789abcdef";
    char msg[8192], out[16 + 4 * sizeof msg + 4]; /* the prefix, each byte as \xNN at most, "...\n" */
    const unsigned char* p;
    size_t k = 0;
    int len, n = vsnprintf(msg, sizeof msg, fmt, ap);
    if (n < 0) snprintf(msg, sizeof msg, "(unprintable message) %s", fmt); /* an encoding error */
    for (; *prefix && k < 16; prefix++) out[k++] = *prefix;
    for (p = (const unsigned char*)msg; *p; p += len) {
        len = utf8_sequence_length(p);
        if (*p < 0x20 || *p == 0x7f || len == 0) {
            out[k++] = '\\';
            out[k++] = 'x';
            out[k++] = hex[*p >> 4];
            out[k++] = hex[*p & 15];
            len = 1;
        } else {
            memcpy(out + k, p, (size_t)len);
            k += (size_t)len;
        }
    }
    if (n >= (int)sizeof msg) {
        memcpy(out + k, "...", 3);
        k += 3;
    }
    out[k++] = '\n';
    fwrite(out, 1, k, stderr);
    fflush(stderr);
}

/* One "error: ..." line on stderr, then exit. Used for every fatal condition. */
static void die_code(int code, const char* fmt, ...) {
    va_list ap;
    fflush(stdout);
    va_start(ap, fmt);
    put_line("error: ", fmt, ap);
    va_end(ap);
    exit(code);
}
#define die_input(...) die_code(EXIT_BAD_INPUT, __VA_ARGS__)
#define die_io(...) die_code(EXIT_FAILURE_IO, __VA_ARGS__)

/* Exit 0 once all that was printed on stdout is written: the answer of --help, --flags-json,
 * --print-config and --layout-json is all there is to them, and a stdout that took none of it
 * (a full disk, > /dev/full) was exit 0 with nothing written. */
static void exit_once_written(void) {
    errno = 0;
    if (fflush(stdout) != 0 || ferror(stdout))
        die_io("cannot write to standard output: %s", strerror(errno ? errno : EIO));
    exit(0);
}

/* A line for people on stderr, escaped as put_line says: no format of the engines holds a newline
 * or tab of its own (the GPU engine's memory plan, a table, is one info() a line). */
static void info(const char* fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    put_line("", fmt, ap);
    va_end(ap);
}

/* One "warning: ..." line on stderr: something was off, the run goes on. */
static void warn(const char* fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    put_line("warning: ", fmt, ap);
    va_end(ap);
}

/* malloc that dies with a clear message instead of returning NULL. */
static void* xmalloc(size_t bytes, const char* what) {
    void* p = malloc(bytes ? bytes : 1);
    if (!p) die_io("out of host memory allocating %zu bytes for %s", bytes, what);
    return p;
}

static void* xcalloc(size_t count, size_t size, const char* what) {
    void* p = calloc(count ? count : 1, size ? size : 1);
    if (!p) die_io("out of host memory allocating %zu bytes for %s", count * size, what);
    return p;
}

/* JSON number text. %.9g round-trips a float bit-exactly; non-finite values are not JSON numbers,
 * so they are written as null (a diverged loss must not make the line unparseable). */
static const char* json_num(char* buf, size_t cap, double x) {
    if (isfinite(x)) snprintf(buf, cap, "%.9g", x);
    else snprintf(buf, cap, "null");
    return buf;
}

/* s as a JSON string (the few we print: names, paths, messages). s is bytes from argv or a file name, not always UTF-8: a byte that starts no
 * well-formed sequence is written as U+FFFD, so every line the engine prints is valid JSON text. */
static void json_put_string(FILE* f, const char* s) {
    const unsigned char* p = (const unsigned char*)s;
    int len;
    fputc('"', f);
    for (; *p; p += len) {
        unsigned char c = *p;
        len = utf8_sequence_length(p);
        if (len == 0) {
            fputs("\\ufffd", f);
            len = 1;
        } else if (c == '"' || c == '\\') fprintf(f, "\\%c", c);
        else if (c == '\n') fputs("\\n", f);
        else if (c == '\t') fputs("\\t", f);
        else if (c < 0x20) fprintf(f, "\\u%04x", c);
        else fwrite(p, 1, (size_t)len, f);
    }
    fputc('"', f);
}

/* The error of the first JSON line that could not be written to stdout (0: none so far). Training
 * goes on past it (its checkpoints are its result, and a step's line is no reason to lose them)
 * but does not end with exit 0 as if its records had been read: train_done says so. */
static int g_stdout_errno = 0;

/* Every JSON line goes through these two so the flush can't be forgotten. */
static void jline_end(void) {
    fputs("}\n", stdout);
    if ((fflush(stdout) != 0 || ferror(stdout)) && !g_stdout_errno) g_stdout_errno = errno ? errno : EIO;
}

/* The end of a line of --generate's or --evaluate's answer (docs/DESIGN.md §16), where stdout is
 * the answer: one that could not be written (a full disk; the reader gone, EPIPE, with SIGPIPE
 * ignored in these modes for it) ends the engine with one error line. Going on would compute
 * answers nobody gets and exit 0 as if they had been given. */
static void answer_line_end(void) {
    jline_end();
    if (ferror(stdout)) die_io("cannot write the answer to standard output (%s)", strerror(errno));
}

/* --generate keeps stdout for its own protocol (docs/DESIGN.md §5a): no events there. */
static int g_quiet_events = 0;

/* {"event":"memory","groups":{...},"total_bytes":N}: engines call this from engine_setup. */
static void emit_memory(const char* const* group_names, const size_t* group_bytes, int n_groups) {
    size_t total = 0;
    int i;
    if (g_quiet_events) return;
    fputs("{\"event\":\"memory\",\"groups\":{", stdout);
    for (i = 0; i < n_groups; i++) {
        if (i) fputc(',', stdout);
        json_put_string(stdout, group_names[i]);
        fprintf(stdout, ":%zu", group_bytes[i]);
        total += group_bytes[i];
    }
    fprintf(stdout, "},\"total_bytes\":%zu", total);
    jline_end();
}

/* {"event":"device_memory","step":s,"bytes":N}: the GPU engine's loop reports first and last step. */
static void emit_device_memory(int step, size_t bytes) {
    fprintf(stdout, "{\"event\":\"device_memory\",\"step\":%d,\"bytes\":%zu", step, bytes);
    jline_end();
}

static void emit_checkpoint(int step, const char* path, const char* reason) {
    fprintf(stdout, "{\"event\":\"checkpoint\",\"step\":%d,\"path\":", step);
    json_put_string(stdout, path);
    fprintf(stdout, ",\"reason\":\"%s\"", reason);
    jline_end();
}

static void emit_exit(int step, const char* reason) {
    fprintf(stdout, "{\"event\":\"exit\",\"step\":%d,\"reason\":\"%s\"", step, reason);
    jline_end();
}

static void emit_polish(int step) {
    fprintf(stdout, "{\"event\":\"polish\",\"step\":%d", step);
    jline_end();
}

/* {"step":s,"val_loss":L[,"val_loss_by_source":{"name":L,...}]}: a source whose loss is NAN (it has
 * no val shards) is left out, and the second part with it when no source has one. */
static void emit_val(int step, double val_loss, const char* const* names, const double* by_source, int n_sources) {
    char b[32];
    int i, first = 1, any = 0;
    fprintf(stdout, "{\"step\":%d,\"val_loss\":%s", step, json_num(b, sizeof b, val_loss));
    for (i = 0; i < n_sources; i++) any |= !isnan(by_source[i]);
    if (any) {
        fputs(",\"val_loss_by_source\":{", stdout);
        for (i = 0; i < n_sources; i++) {
            if (isnan(by_source[i])) continue;
            if (!first) fputc(',', stdout);
            first = 0;
            json_put_string(stdout, names[i]);
            fprintf(stdout, ":%s", json_num(b, sizeof b, by_source[i]));
        }
        fputc('}', stdout);
    }
    jline_end();
}

static void emit_int_array(const int* xs, int n) {
    int i;
    fputc('[', stdout);
    for (i = 0; i < n; i++) fprintf(stdout, i ? ",%d" : "%d", xs[i]);
    fputc(']', stdout);
}

static void emit_sample(int step, int prompt, const int* prompt_tokens, int n_prompt, const int* tokens, int n) {
    fprintf(stdout, "{\"event\":\"sample\",\"step\":%d,\"prompt\":%d,\"prompt_tokens\":", step, prompt);
    emit_int_array(prompt_tokens, n_prompt);
    fputs(",\"tokens\":", stdout);
    emit_int_array(tokens, n);
    jline_end();
}

/* The per-step training record. skipped/loss_scale only appear for loss-scaled (fp16) runs; "arm"
 * (the data source of the micro-batch, a list of one per micro-batch when n_arms > 1) only for runs
 * with data.sources (n_arms 0: none). */
static void emit_step(int step, double loss, double lr, double grad_norm, double ms, double tokens_per_s,
                      long long tokens, const char* phase, int skipped, double loss_scale, int show_scale,
                      const int* arms, int n_arms) {
    char b1[32], b2[32], b3[32], b4[32], b5[32];
    fprintf(stdout, "{\"step\":%d,\"loss\":%s,\"lr\":%s,\"grad_norm\":%s,\"ms\":%s,\"tokens_per_s\":%s,"
                    "\"tokens\":%lld,\"phase\":\"%s\"",
            step, json_num(b1, sizeof b1, loss), json_num(b2, sizeof b2, lr), json_num(b3, sizeof b3, grad_norm),
            json_num(b4, sizeof b4, ms), json_num(b5, sizeof b5, tokens_per_s), tokens, phase);
    if (skipped) fputs(",\"skipped\":true", stdout);
    if (show_scale) fprintf(stdout, ",\"loss_scale\":%s", json_num(b1, sizeof b1, loss_scale));
    if (n_arms == 1) fprintf(stdout, ",\"arm\":%d", arms[0]);
    if (n_arms > 1) {
        fputs(",\"arm\":", stdout);
        emit_int_array(arms, n_arms);
    }
    jline_end();
}

#endif
