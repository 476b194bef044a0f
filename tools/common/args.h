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

// The cache types a --kv preset stands for: "innerq" is the reference InnerQ configuration
// (3-bit keys, 2-bit values); any other name is a cache type used for both keys and values.
void args_kv_preset(const char * name, const char ** kv_k, const char ** kv_v);
// If flag is one of the InnerQ knobs (--kv-group, --kv-sink, --kv-recent, --no-kv-hybrid,
// --no-kv-norm), applies it to p, consuming its value, and returns true.
bool args_innerq_flag(args * a, const char * flag, innerq_context_params * p);
// --kv-k, --kv-v, --kv (one value each) and the InnerQ knobs; false if flag is none of them.
bool args_kv_flag(args * a, const char * flag, innerq_context_params * p);
// Help lines of the KV-cache flags, for each tool's --help; lists: --kv-k / --kv-v / --kv take
// comma-separated lists (innerq-bench).
void args_print_kv_help(FILE * f, bool lists);

// The whole file (any bytes), malloc'ed, for -f FILE; NULL with errno set on failure.
char * args_read_file(const char * path, size_t * len);
