"""The CUDA build under test: $INNERQ_LIB when it was built with CUDA, else build-cuda/'s
libinnerq_test.so (a build with INNERQ_BUILD_TESTS: the internals exported).

GPU tests skip where that library is missing, was built without CUDA, or sees no device
(CI compiles the CUDA tree but has no GPU).

Kernel variants: a test that runs its cases again with a kernel forced (the f32 attention of
prompt batches, one decode attention kernel or another) runs them in a subprocess whose
environment holds VARIANTS_ENV (variants_env); cuda_api sets them through iq_cuda_set_variant
(cuda/ops.h), which only the test library exports: the shipped library reads no switch.
"""
from __future__ import annotations

import os
from functools import lru_cache
from pathlib import Path

import cffi
import numpy as np
import pytest

from conftest import ROOT


@lru_cache(maxsize=None)
def _probe() -> tuple[str | None, str]:
    candidates = [os.environ.get("INNERQ_LIB"), str(ROOT / "build-cuda" / "libinnerq_test.so")]
    ffi = cffi.FFI()
    ffi.cdef("int32_t innerq_cuda_device_count(void);")
    for p in candidates:
        if p and Path(p).is_file():
            n = ffi.dlopen(p).innerq_cuda_device_count()
            if n > 0:
                return p, ""
            why = "built without CUDA" if n < 0 else "no CUDA device"
            if p == candidates[-1] or not candidates[-1] or not Path(candidates[-1]).is_file():
                return None, f"{p}: {why}"
    return None, "no CUDA build (build-cuda/libinnerq_test.so)"


def cuda_lib_path() -> str:
    """The CUDA library, or the test is skipped."""
    p, why = _probe()
    if p is None:
        pytest.skip(why)
    return p


# Declarations of the CUDA tests' cffi interfaces beyond test_ops.CDEF / QUANT_LAYER.
CUDA_CDEF = """
    iq_backend * iq_backend_cuda_init(int device);
    int iq_cuda_set_variant(const char * name, int value);
    int iq_backend_synchronize(iq_backend * be);
    bool iq_tensor_copy(struct iq_tensor * dst, const struct iq_tensor * src);
    void iq_attention_set_decode_semantics(struct iq_tensor * attention, bool on);
"""


VARIANTS_ENV = "INNERQ_TEST_CUDA_VARIANTS"
VARIANT_VALUES = {"dp4a": 1, "mma": 2}  # cuda/ops.h IQ_QATTN_*


def variants_env(**variants) -> dict[str, str]:
    """The environment of a subprocess whose CUDA library runs with these variants, e.g.
    variants_env(qattn="mma", qw_win=1) (names: struct iq_cuda_variants in cuda/ops.h)."""
    return {**os.environ, VARIANTS_ENV: ",".join(f"{k}={v}" for k, v in variants.items())}


def _set_variants(ffi, lib) -> None:
    for item in filter(None, os.environ.get(VARIANTS_ENV, "").split(",")):
        name, value = item.split("=")
        v = VARIANT_VALUES[value] if value in VARIANT_VALUES else int(value)
        assert lib.iq_cuda_set_variant(name.encode(), v) == 0, ffi.string(lib.iq_error_get()).decode()


def cuda_api(cdef: str):
    """(ffi, lib) of the CUDA library with cdef + CUDA_CDEF declared and the kernel variants of
    VARIANTS_ENV set; skips without a GPU."""
    ffi = cffi.FFI()
    ffi.cdef(cdef + CUDA_CDEF)
    lib = ffi.dlopen(cuda_lib_path())
    _set_variants(ffi, lib)
    return ffi, lib


def gpu_backend(api):
    """A module fixture's body: the CUDA backend of device 0, freed after the module."""
    ffi, lib = api
    be = lib.iq_backend_cuda_init(0)
    assert be != ffi.NULL, ffi.string(lib.iq_error_get()).decode()
    yield be
    lib.iq_backend_free(be)


def cpu_backend(api):
    """A module fixture's body: the CPU backend with 2 threads, freed after the module."""
    _, lib = api
    be = lib.iq_backend_cpu_init(2)
    yield be
    lib.iq_backend_free(be)


# The tensor-core attention (cuda/attention-fa.cuh, "Accuracy": prompt batches of 64 query
# vectors and more, and every batch over an f16 cache at head_dim 64 / 128) takes f16 operands,
# q, k, v and the probabilities each rounded once, with f32 sums: it is held to f32 results
# within FA_ATOL of the values' scale (the largest |v| it averages; the worst seen on an H100 was
# 4e-4 of it). The f32 kernels keep atol 2e-5, rtol 1e-4.
FA_ATOL = 2e-3


def assert_attention_close(got, want, fa: bool, vmax: float, err_msg: str = "") -> None:
    """got (a GPU attention's output) against an f32 result: the tensor-core kernel's bound where
    it ran (fa), the f32 kernel's otherwise."""
    if fa:
        np.testing.assert_allclose(got, want, rtol=0, atol=FA_ATOL * vmax, err_msg=err_msg)
    else:
        np.testing.assert_allclose(got, want, atol=2e-5, rtol=1e-4, err_msg=err_msg)
