// Which x86 vector extensions the kernels may use: read once from cpuid, lowered by
// INNERQ_ISA=scalar|avx2|avx512 or iq_cpu_isa_set(), never raised above the machine's.
#include "iq-cpu.h"

#include "iq.h"

#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>

#if defined(__x86_64__) || defined(__i386__)
#include <cpuid.h>
#define IQ_X86 1
#endif

struct iq_cpu_features {
    enum iq_cpu_isa best;
    bool avx512_vnni;
    bool avx512_gfni;  // GFNI with AVX-512 (vgf2p8affineqb on zmm)
};

#ifdef IQ_X86
static uint64_t iq_xgetbv0(void) {
    uint32_t lo, hi;
    __asm__ volatile("xgetbv" : "=a"(lo), "=d"(hi) : "c"(0));
    return ((uint64_t) hi << 32) | lo;
}
#endif

static struct iq_cpu_features iq_cpu_features_read(void) {
    struct iq_cpu_features f = {IQ_ISA_SCALAR, false, false};
#ifdef IQ_X86
    unsigned a, b, c, d;
    if (!__get_cpuid(1, &a, &b, &c, &d)) {
        return f;
    }
    const bool fma = c & (1u << 12), osxsave = c & (1u << 27), f16c = c & (1u << 29);
    if (!osxsave || !__get_cpuid_count(7, 0, &a, &b, &c, &d)) {
        return f;
    }
    // The OS must save the vector registers too: ymm state (XCR0 bits 1-2), and for
    // AVX-512 the opmask and zmm state (bits 5-7).
    const uint64_t xcr0 = iq_xgetbv0();
    const bool avx2 = b & (1u << 5), bmi2 = b & (1u << 8);
    if (avx2 && bmi2 && fma && f16c && (xcr0 & 0x6) == 0x6) {
        f.best = IQ_ISA_AVX2;
        const bool avx512 = (b & (1u << 16)) && (b & (1u << 17)) && (b & (1u << 30)) && (b & (1u << 31));
        if (avx512 && (xcr0 & 0xe0) == 0xe0) {
            f.best = IQ_ISA_AVX512;
            f.avx512_vnni = c & (1u << 11);
            f.avx512_gfni = c & (1u << 8);
        }
    }
#endif
    return f;
}

static const char * const iq_cpu_isa_names[IQ_ISA_COUNT] = {"scalar", "avx2", "avx512"};

static struct iq_cpu_features iq_cpu_features;
static atomic_int iq_cpu_isa_current;
static pthread_once_t iq_cpu_isa_once = PTHREAD_ONCE_INIT;

static void iq_cpu_isa_init(void) {
    iq_cpu_features = iq_cpu_features_read();
    enum iq_cpu_isa isa = iq_cpu_features.best;
    const char * env = getenv("INNERQ_ISA");
    if (env != NULL && *env != '\0') {
        int want = -1;
        for (int i = 0; i < IQ_ISA_COUNT; i++) {
            if (strcmp(env, iq_cpu_isa_names[i]) == 0) {
                want = i;
            }
        }
        if (want < 0) {
            fprintf(stderr, "innerq: INNERQ_ISA=%s is not one of scalar, avx2, avx512; using %s\n", env,
                    iq_cpu_isa_names[isa]);
        } else if (want < (int) isa) {
            isa = (enum iq_cpu_isa) want;
        }
    }
    atomic_store(&iq_cpu_isa_current, (int) isa);
}

enum iq_cpu_isa iq_cpu_isa_detect(void) {
    pthread_once(&iq_cpu_isa_once, iq_cpu_isa_init);
    return iq_cpu_features.best;
}

enum iq_cpu_isa iq_cpu_isa_active(void) {
    pthread_once(&iq_cpu_isa_once, iq_cpu_isa_init);
    return (enum iq_cpu_isa) atomic_load(&iq_cpu_isa_current);
}

bool iq_cpu_has_avx512_vnni(void) {
    iq_cpu_isa_detect();
    return iq_cpu_features.avx512_vnni;
}

bool iq_cpu_has_avx512_gfni(void) {
    iq_cpu_isa_detect();
    return iq_cpu_features.avx512_gfni;
}

const char * iq_cpu_isa_name(enum iq_cpu_isa isa) {
    return (int) isa >= 0 && isa < IQ_ISA_COUNT ? iq_cpu_isa_names[isa] : "invalid";
}

bool iq_cpu_isa_set(enum iq_cpu_isa isa) {
    if ((int) isa < 0 || isa > iq_cpu_isa_detect()) {
        iq_error_set("this CPU does not support the %s kernels (best: %s)", iq_cpu_isa_name(isa),
                     iq_cpu_isa_name(iq_cpu_isa_detect()));
        return false;
    }
    atomic_store(&iq_cpu_isa_current, (int) isa);
    return true;
}
