"""Time of iq_qblock_quantize's searched mode on one 64 x 64 block, 3 bits (keys on the key levels,
values uniform): the scalar search (iq-qcache-math.h) against the active CPU features' vector
search (cpu/qsearch-lanes.h), medians of 5 loops of 200 blocks. Needs the test library
(build/libinnerq_test.so, or INNERQ_LIB); INNERQ_ISA=avx2 times the AVX2 kernels on an AVX-512
machine. docs/BENCHMARKS.md "The searched quantizer in vectors".

    python3 tools/qsearch_time.py
"""
import sys
import time
from pathlib import Path

import cffi
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from conftest import lib_path  # noqa: E402
from innerq_ffi import load  # noqa: E402

SEARCH, KEY_LEVELS = 3, 4  # IQ_QUANT_SEARCH, IQ_QBLOCK_LEVELS


def per_block(lib, ffi, rows, out, axis, fmt, reps=200):
    r, o = ffi.cast("iq_fp16_t *", ffi.from_buffer(rows)), ffi.cast("uint8_t *", ffi.from_buffer(out))
    t = []
    for _ in range(5):
        t0 = time.perf_counter()
        for _ in range(reps):
            lib.iq_qblock_quantize(r, axis, 3, 64, 64, SEARCH, ffi.NULL, fmt, o)
        t.append((time.perf_counter() - t0) / reps * 1e6)
    return sorted(t)[2]


def main():
    ffi, lib = load()
    cpu = cffi.FFI()
    cpu.cdef("void iq_cpu_install_qsearch(void);")
    cl = cpu.dlopen(lib_path())
    rows = np.random.default_rng(0).standard_normal((64, 64)).astype(np.float16)
    out = np.zeros(8192, np.uint8)
    for name, axis, fmt in (("keys K3 (key levels)", 0, KEY_LEVELS), ("values V3", 1, 0)):
        lib.iq_qblock_set_search(ffi.NULL)
        s = per_block(lib, ffi, rows, out, axis, fmt)
        cl.iq_cpu_install_qsearch()
        v = per_block(lib, ffi, rows, out, axis, fmt)
        lib.iq_qblock_set_search(ffi.NULL)
        print(f"{name}: scalar {s:.1f} us, vector {v:.1f} us a block of 64 x 64 ({s / v:.2f}x)")


if __name__ == "__main__":
    main()
