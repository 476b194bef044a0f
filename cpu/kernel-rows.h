// The kernels of one architecture's vector extensions, as rows of (required features, tables).
//
// cpu/x86/kernel-rows.c and cpu/arm/kernel-rows.c each define iq_cpu_kernel_rows (the build
// compiles the folder of the target only; cpu/kernel-rows-none.c has no rows), lowest first.
// For a set of features, the rows whose required features are all in it apply in order: a
// weight type's function from the last such row that has it (NULL: the row below's, at last
// the scalar table), the vec and InnerQ tables whole from the last row that has one.
// vec_dot_type always comes from the scalar table, since every row reads the same activations.
#pragma once

#include "iq-cpu.h"
#include "qcache.h"
#include "vec.h"

#ifdef __cplusplus
extern "C" {
#endif

struct iq_cpu_kernel_row {
    iq_cpu_features needs;
    const struct iq_cpu_type_traits * quants;  // indexed by weight type, or NULL
    const struct iq_vec_fns * vec;             // or NULL
    const struct iq_innerq_kernels * innerq;   // or NULL
};

extern const struct iq_cpu_kernel_row iq_cpu_kernel_rows[];
extern const int iq_cpu_kernel_rows_count;

static inline bool iq_cpu_row_fits(const struct iq_cpu_kernel_row * row, iq_cpu_features f) {
    return (row->needs & ~f) == 0;
}

// The vec or InnerQ family's table for the features f, lowered to the machine's: table(row) of
// the last row that fits and has one (table returns NULL where the row has none), else scalar.
static inline const void * iq_cpu_kernel_rows_best(iq_cpu_features f,
                                                   const void * (*table)(const struct iq_cpu_kernel_row * row),
                                                   const void * scalar) {
    f &= iq_cpu_features_detect();
    const void * best = scalar;
    for (int i = 0; i < iq_cpu_kernel_rows_count; i++) {
        const struct iq_cpu_kernel_row * r = &iq_cpu_kernel_rows[i];
        const void * t = table(r);
        best = t != NULL && iq_cpu_row_fits(r, f) ? t : best;
    }
    return best;
}

#ifdef __cplusplus
}
#endif
