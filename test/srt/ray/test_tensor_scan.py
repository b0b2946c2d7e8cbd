"""The tensor scan (transport/tensor_scan.py): the compiled call and the Python
path read the same addresses, sizes, devices, dtypes, shapes and contiguity,
and the extension builds from source into an empty cache."""

import os
import subprocess
import sys

import numpy as np
import pytest
import torch

from sglang.srt.ray.rdt.errors import WeightSyncError
from sglang.srt.ray.rdt.trainer import buckets
from sglang.srt.ray.rdt.transport import tensor_scan

FIELDS = ("ptrs", "nbytes", "device", "dtype", "ndim", "dims", "contiguous")


class Tagged(torch.Tensor):
    """A tensor subclass: scanned through its own Python methods."""


def _mixed():
    base = torch.arange(64, dtype=torch.float32)
    return [
        torch.ones(3, 4, dtype=torch.bfloat16),
        base[5:21],  # a view at an offset
        torch.ones(4, 6, dtype=torch.float16).t(),  # not contiguous
        torch.nn.Parameter(torch.zeros(2, 2, 2)),
        torch.ones(7, requires_grad=True),
        torch.tensor(3, dtype=torch.int64),  # 0-d
        torch.empty(0, 5, dtype=torch.uint8),  # no elements
    ]


def _own(tensors):
    """What each tensor says of itself, attribute by attribute."""
    return {
        "ptrs": [t.data_ptr() for t in tensors],
        "nbytes": [t.nbytes for t in tensors],
        "device": [t.get_device() for t in tensors],
        "shapes": [tuple(t.shape) for t in tensors],
        "dtypes": [t.dtype for t in tensors],
        "contiguous": [t.is_contiguous() for t in tensors],
    }


def _as_own(s):
    return {"ptrs": s.ptrs.tolist(), "nbytes": s.nbytes.tolist(), "device": s.device.tolist(),
            "shapes": s.shapes(), "dtypes": s.dtypes(), "contiguous": s.contiguous.tolist()}


def test_the_native_scan_reads_what_each_tensor_says_of_itself():
    assert tensor_scan.native() is not None, "the extension did not build here (a C++ compiler is on this box)"
    tensors = _mixed()
    native, python = tensor_scan.scan(tensors), tensor_scan._scan_python(tensors)
    assert _as_own(native) == _own(tensors)
    for f in FIELDS:
        assert getattr(native, f).tolist() == getattr(python, f).tolist(), f
    assert native.contiguous.tolist() == [True, True, False, True, True, True, True]
    assert native.dims.tolist() == [3, 4, 16, 6, 4, 2, 2, 2, 7, 0, 5]


def test_a_tensor_subclass_is_read_through_python_and_a_non_tensor_is_named():
    tensors = _mixed()
    tensors.insert(2, torch.arange(6.0).as_subclass(Tagged))
    assert isinstance(tensor_scan.native().scan(tensors), int)  # the call leaves the list to Python
    assert _as_own(tensor_scan.scan(tensors)) == _own(tensors)

    with pytest.raises(tensor_scan.NotATensor) as e:
        tensor_scan.scan([torch.ones(1), torch.ones(2), [1.0, 2.0]])
    assert e.value.index == 2 and "is a list" in str(e.value)
    with pytest.raises(WeightSyncError, match="'b' is a ndarray, not a torch.Tensor"):
        list(buckets.cut({"a": torch.ones(2), "b": np.ones(2)}, buckets.WHOLE))


def test_a_long_list_is_read_whole_and_an_odd_item_anywhere_in_it_is_found():
    # (the scan asks for memory up to 16 items ahead: odd items at every distance from the end)
    tensors = [t for _ in range(6) for t in _mixed()]  # 42 tensors
    native = tensor_scan.native().scan(tensors)
    assert not isinstance(native, int)
    assert _as_own(tensor_scan.scan(tensors)) == _own(tensors)
    for at in (0, 1, 5, 10, 16, 25, 36, 41):
        for odd in ([1.0], torch.arange(3.0).as_subclass(Tagged)):
            items = list(tensors)
            items[at] = odd
            assert tensor_scan.native().scan(items) == at, (at, type(odd))
        with pytest.raises(tensor_scan.NotATensor) as e:
            tensor_scan.scan(tensors[:at] + [None] + tensors[at:])
        assert e.value.index == at


def test_a_part_of_a_scan_and_layout_equality():
    tensors = [torch.ones(2, 3), torch.ones(4), torch.ones(1, 1, 5), torch.ones(6, dtype=torch.int8)]
    s = tensor_scan.scan(tensors)
    part = s.part(1, 3)
    assert part.shapes() == [(4,), (1, 1, 5)] and part.ptrs.tolist() == s.ptrs[1:3].tolist()
    assert s.same_layout(tensor_scan.scan([t.clone() for t in tensors]))
    assert not s.same_layout(tensor_scan.scan([torch.ones(3, 2)] + tensors[1:]))  # same size, other shape
    assert not s.same_layout(tensor_scan.scan(tensors[:3] + [torch.ones(6, dtype=torch.uint8)]))


def _run(code, **env):
    out = subprocess.run([sys.executable, "-c", code], env={**os.environ, **env}, capture_output=True,
                         text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    return out.stdout.strip()


def test_the_extension_builds_into_an_empty_cache_once_and_can_be_turned_off(tmp_path):
    probe = ("import torch; from sglang.srt.ray.rdt.transport import tensor_scan as t; "
             "m = t.native(); s = t.scan([torch.ones(2, 3)]); "
             "print(m is not None, s.shapes())")
    cache = str(tmp_path / "jit")
    assert _run(probe, SGLANG_JIT_CACHE_DIR=cache) == "True [(2, 3)]"
    assert sorted(p.suffix for p in (tmp_path / "jit" / "rdt").iterdir()) == [".lock", ".so"]
    (so,) = (tmp_path / "jit" / "rdt").glob("*.so")
    built = so.stat().st_mtime_ns
    assert _run(probe, SGLANG_JIT_CACHE_DIR=cache) == "True [(2, 3)]"
    assert so.stat().st_mtime_ns == built  # loaded, not built again
    off = tmp_path / "off"
    assert _run(probe, SGLANG_JIT_CACHE_DIR=str(off), SGLANG_RDT_NATIVE_SCAN="0") == "False [(2, 3)]"
    assert not off.exists()
