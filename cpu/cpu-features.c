// Which vector extensions the kernels may use: read once (cpuid on x86, the HWCAP bits on
// aarch64), lowered by INNERQ_ISA or iq_cpu_features_set(), never raised above the machine's.
#include "iq-cpu.h"

#include "iq.h"

#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#if defined(__x86_64__) || defined(__i386__)
#include <cpuid.h>

static uint64_t iq_xgetbv0(void) {
    uint32_t lo, hi;
    __asm__ volatile("xgetbv" : "=a"(lo), "=d"(hi) : "c"(0));
    return ((uint64_t) hi << 32) | lo;
}

static iq_cpu_features iq_cpu_features_read(void) {
    unsigned a, b, c, d;
    if (!__get_cpuid(1, &a, &b, &c, &d)) {
        return 0;
    }
    const bool fma = c & (1u << 12), osxsave = c & (1u << 27), f16c = c & (1u << 29);
    if (!osxsave || !__get_cpuid_count(7, 0, &a, &b, &c, &d)) {
        return 0;
    }
    // The OS must save the vector registers too: ymm state (XCR0 bits 1-2), and for
    // AVX-512 the opmask and zmm state (bits 5-7).
    const uint64_t xcr0 = iq_xgetbv0();
    const bool avx2 = b & (1u << 5), bmi2 = b & (1u << 8);
    if (!avx2 || !bmi2 || !fma || !f16c || (xcr0 & 0x6) != 0x6) {
        return 0;
    }
    iq_cpu_features f = IQ_CPU_AVX2;
    const bool avx512 = (b & (1u << 16)) && (b & (1u << 17)) && (b & (1u << 30)) && (b & (1u << 31));
    if (avx512 && (xcr0 & 0xe0) == 0xe0) {
        f |= IQ_CPU_AVX512;
        f |= c & (1u << 11) ? IQ_CPU_AVX512_VNNI : 0;
        f |= c & (1u << 8) ? IQ_CPU_GFNI : 0;
    }
    return f;
}
#elif defined(__aarch64__) && defined(__linux__)
#include <sys/auxv.h>

// The bits of the Linux uapi's asm/hwcap.h (named here: older C libraries lack the newer ones).
#define IQ_HWCAP_ASIMD (1ul << 1)
#define IQ_HWCAP_ASIMDDP (1ul << 20)
#define IQ_HWCAP2_I8MM (1ul << 13)

static iq_cpu_features iq_cpu_features_read(void) {
    const unsigned long hw = getauxval(AT_HWCAP), hw2 = getauxval(AT_HWCAP2);
    if (!(hw & IQ_HWCAP_ASIMD)) {
        return 0;
    }
    iq_cpu_features f = IQ_CPU_NEON;
    if (hw & IQ_HWCAP_ASIMDDP) {
        f |= IQ_CPU_DOTPROD;
        f |= hw2 & IQ_HWCAP2_I8MM ? IQ_CPU_I8MM : 0;
    }
    return f;
}
#else
static iq_cpu_features iq_cpu_features_read(void) { return 0; }
#endif

// The INNERQ_ISA levels: each names the features its kernels may use, best feature last.
static const struct {
    const char * name;
    iq_cpu_features features, key;
} iq_cpu_levels[] = {
    {"scalar", 0, 0},
    {"avx2", IQ_CPU_AVX2, IQ_CPU_AVX2},
    {"avx512", IQ_CPU_AVX2 | IQ_CPU_AVX512 | IQ_CPU_AVX512_VNNI | IQ_CPU_GFNI, IQ_CPU_AVX512},
    {"neon", IQ_CPU_NEON, IQ_CPU_NEON},
    {"dotprod", IQ_CPU_NEON | IQ_CPU_DOTPROD, IQ_CPU_DOTPROD},
    {"i8mm", IQ_CPU_NEON | IQ_CPU_DOTPROD | IQ_CPU_I8MM, IQ_CPU_I8MM},
};
#define IQ_CPU_LEVELS ((int) (sizeof(iq_cpu_levels) / sizeof(iq_cpu_levels[0])))

static iq_cpu_features iq_cpu_have;
static atomic_uint iq_cpu_current;
static pthread_once_t iq_cpu_once = PTHREAD_ONCE_INIT;

static void iq_cpu_features_init(void) {
    iq_cpu_have = iq_cpu_features_read();
    iq_cpu_features f = iq_cpu_have;
    const char * env = getenv("INNERQ_ISA");
    if (env != NULL && *env != '\0') {
        int want = -1;
        for (int i = 0; i < IQ_CPU_LEVELS; i++) {
            want = strcmp(env, iq_cpu_levels[i].name) == 0 ? i : want;
        }
        if (want < 0) {
            fprintf(stderr, "innerq: INNERQ_ISA=%s is not one of scalar, avx2, avx512, neon, dotprod, i8mm; using %s\n",
                    env, iq_cpu_features_name(f));
        } else {
            f &= iq_cpu_levels[want].features;
        }
    }
    atomic_store(&iq_cpu_current, f);
}

iq_cpu_features iq_cpu_features_detect(void) {
    pthread_once(&iq_cpu_once, iq_cpu_features_init);
    return iq_cpu_have;
}

iq_cpu_features iq_cpu_features_active(void) {
    pthread_once(&iq_cpu_once, iq_cpu_features_init);
    return atomic_load(&iq_cpu_current);
}

const char * iq_cpu_features_name(iq_cpu_features f) {
    const char * name = "scalar";
    for (int i = 1; i < IQ_CPU_LEVELS; i++) {
        name = f & iq_cpu_levels[i].key ? iq_cpu_levels[i].name : name;
    }
    return name;
}

bool iq_cpu_features_set(iq_cpu_features f) {
    const iq_cpu_features have = iq_cpu_features_detect();
    if ((f & ~have) != 0) {
        iq_error_set("this CPU does not support the %s kernels (best: %s)", iq_cpu_features_name(f & ~have),
                     iq_cpu_features_name(have));
        return false;
    }
    atomic_store(&iq_cpu_current, f);
    return true;
}
