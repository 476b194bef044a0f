"""The device registry (src/device.c) through the public enumeration: the CPU is always device
0 with its KV cache defaults; CUDA devices follow where the library can use them; the device type
given to innerq_kv_memory_of picks the device's defaults (tests/test_kv_memory.py checks the
figures)."""
from __future__ import annotations

import pytest

innerq = pytest.importorskip("innerq")
try:
    from innerq._ffi import ffi, lib
except ImportError as e:
    pytest.skip(str(e), allow_module_level=True)


def test_the_cpu_is_device_0():
    devs = innerq.devices()
    cpu = devs[0]
    assert (cpu["type"], cpu["name"], cpu["kv_group"], cpu["kv_align"]) == ("cpu", "CPU", 64, 64)
    assert cpu["memory_total"] >= cpu["memory_free"] >= 0
    assert all(d["type"] == "cpu" for d in devs[:1]) and all(d["type"] == "gpu" for d in devs[1:])


def test_the_gpus_are_the_usable_cuda_devices():
    devs = innerq.devices()
    assert len(devs) == 1 + max(innerq.cuda_device_count(), 0)
    for i, d in enumerate(devs[1:]):
        assert (d["name"], d["kv_group"], d["kv_align"]) == (f"CUDA{i}", 32, 256)
        assert d["memory_total"] > 0 and d["description"]


@pytest.mark.parametrize("i", [-1, "count"])
def test_a_device_out_of_range_is_an_error(i):
    i = lib.innerq_device_count() if i == "count" else i
    info = ffi.new("innerq_device_info *")
    assert lib.innerq_device_get(i, info) == lib.INNERQ_ERR_INVALID_ARGUMENT
    assert "innerq_device_get: device" in ffi.string(lib.innerq_last_error()).decode()
    assert lib.innerq_device_get(0, ffi.NULL) == lib.INNERQ_ERR_INVALID_ARGUMENT
