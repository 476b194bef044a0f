// Command-line parsing shared by innerq-cli and the tools: a cursor over argv, numbers and
// lists with full validation, the KV-cache flags, and the one-line error messages.
//
// Usage errors (a missing value, a number that doesn't parse or is out of range, an unknown
// flag) print "PROG: error: ..." on stderr and exit with status 2; runtime errors are
// reported with args_fail_status, which prints innerq_last_error() and returns 1.
#pragma once

#include "innerq.h"

#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>

typedef struct args {
    const char * prog;  // program name used in messages, e.g. "innerq-cli"
    int argc;
    char ** argv;
    int i;              // index of the flag being parsed
} args;

args args_init(const char * prog, int argc, char ** argv);
// The flag at the cursor, advancing past it; NULL when argv is exhausted.
const char * args_next_flag(args * a);

// Prints "PROG: error: MESSAGE" and exits with status 2.
#if defined(__GNUC__)
__attribute__((noreturn, format(printf, 2, 3)))
#endif
void args_usage_error(const args * a, const char * fmt, ...);
// Whether flag is spelled one of the two ways (short may be NULL).
bool args_is(const char * flag, const char * short_name, const char * long_name);
// The end of every tool's chain of flags: flag is unknown (or a stray word); a usage error.
#if defined(__GNUC__)
__attribute__((noreturn))
#endif
void args_unknown(const args * a, const char * flag);
// A usage error "no WHAT given" unless value is set.
void args_require(const args * a, const void * value, const char * what);
// Prints "PROG: error: WHAT: innerq_last_error()" (or without WHAT when it is NULL) and
// returns 1, the exit status of a runtime error.
int args_fail_status(const char * prog, const char * what);

// The value of the flag just read (the next argv entry), advancing past it.
const char * args_value(args * a);
// The value as a number in [lo, hi]; anything else is a usage error naming the flag.
int32_t args_int(args * a, int32_t lo, int32_t hi);
float args_float(args * a, float lo, float hi);
// A seed: a non-negative integer, or -1 for "from the clock" (0xFFFFFFFF).
uint64_t args_seed(args * a);
// A comma-separated list ("128,512"), each element in [lo, hi]. Returns the count; *out is
// malloc'ed (free it).
int args_int_list(args * a, int32_t lo, int32_t hi, int32_t ** out);
// A comma-separated list of names. Returns the count; *out is one malloc'ed block holding
// the pointers and the strings (free(*out) frees all).
int args_str_list(args * a, char *** out);

// Strict conversions (the whole string, no overflow, finite); false if s isn't one.
bool args_parse_int(const char * s, int32_t * out);
bool args_parse_float(const char * s, float * out);

// -m/--model, -ngl/--n-gpu-layers and --no-mmap; false if flag is none of them.
bool args_model_flag(args * a, const char * flag, const char ** model, innerq_model_params * mp);
// -t/--threads, -c/--ctx-size and -b/--batch-size into p; false if flag is none of them.
bool args_context_flag(args * a, const char * flag, innerq_context_params * p);
// -o/--output md|json; false if flag is not it.
bool args_output_flag(args * a, const char * flag, bool * json);
// The InnerQ knobs (--kv-group, --kv-sink, --kv-recent, --no-kv-hybrid, --no-kv-norm,
// --no-kv-debias, --no-kv-norm-pairs, --kv-rot, --no-kv-rot, --no-kv-search, --kv-bits,
// --kv-layer-bits), applied to p; false if flag is none of them.
bool args_innerq_flag(args * a, const char * flag, innerq_context_params * p);
// --kv-k, --kv-v, --kv (one name each: --kv names keys and values) and the InnerQ knobs.
bool args_kv_flag(args * a, const char * flag, innerq_context_params * p);

// --kv, --kv-k, --kv-v as comma-separated lists (innerq-bench, innerq-attn-bench).
typedef struct args_kv_lists {
    char ** kv, ** kv_k, ** kv_v;  // NULL: not given
    int n_kv, n_kv_k, n_kv_v;
} args_kv_lists;
// The three list flags and the InnerQ knobs (into p); false if flag is none of them.
bool args_kv_list_flag(args * a, const char * flag, args_kv_lists * l, innerq_context_params * p);
// The (keys, values) names to run: each --kv name, or every --kv-k x --kv-v combination (one
// side alone names both: its partner is NULL), or one pair of NULLs (the default cache).
// Each pair is checked with p's knobs (a usage error names the bad one). Returns the count;
// *out is malloc'ed [count][2].
int args_kv_pairs(const args * a, const args_kv_lists * l, const innerq_context_params * p, const char * (**out)[2]);
// How one side of a cache pair is reported: a name given for one side names both, and none
// is the default preset "innerq".
const char * args_kv_name(const char * side, const char * other);
// "offloaded N/M layers to the GPU: weights ... on the GPU, ... on the CPU" (llama.cpp's count:
// the output layer is one more).
void args_offload(const innerq_model * model, char * buf, size_t size);
// "KV cache X MiB, B bits per element at n_ctx N (...)": the context's cache memory, everything
// included (innerq_context_kv_memory), in buf.
void args_kv_memory(innerq_context * ctx, char * buf, size_t size);
// A usage error (exit 2) unless innerq_context_params_check accepts p: a bad cache type or
// knob is reported before any model is loaded.
void args_check_context(const args * a, const innerq_context_params * p);
// Help lines of the KV-cache flags, for each tool's --help; lists: --kv-k / --kv-v / --kv take
// comma-separated lists (innerq-bench).
void args_print_kv_help(FILE * f, bool lists);

// The whole file (any bytes), malloc'ed, for -f FILE; at most innerq_max_text_bytes(), so
// that /dev/zero or a pipe that never ends is an error, not a process that grows until the
// kernel kills it. NULL after printing "PROG: error: cannot read 'PATH': why".
char * args_read_file(const char * prog, const char * path, size_t * len);
