// One look at a list of tensors, for RDT weight sync's trainer side
// (sglang/srt/ray/rdt/transport/tensor_scan.py builds and loads this file).
//
// An update of an MoE model hands the client thousands of tensors; before any
// byte moves it needs each one's address, size, dtype, device, contiguity and
// shape. Read through Python that is a lookup per tensor and field (about
// 2 ms for 3072 tensors); read here it is one call over the list.
#include <Python.h>
#include <torch/csrc/autograd/python_variable.h>

#include <cstdint>
#include <exception>
#include <vector>

namespace {

// The Python types scanned here: torch.Tensor and torch.nn.Parameter exactly.
// Anything else (a subclass with its own behaviour, a non-tensor) is left to
// the caller's Python path.
PyTypeObject* plain_types[2] = {nullptr, nullptr};

PyObject* set_types(PyObject*, PyObject* args) {
  PyObject* tensor = nullptr;
  PyObject* parameter = nullptr;
  if (!PyArg_ParseTuple(args, "O!O!", &PyType_Type, &tensor, &PyType_Type, &parameter)) {
    return nullptr;
  }
  Py_INCREF(tensor);
  Py_INCREF(parameter);
  plain_types[0] = reinterpret_cast<PyTypeObject*>(tensor);
  plain_types[1] = reinterpret_cast<PyTypeObject*>(parameter);
  Py_RETURN_NONE;
}

// How many items ahead the scan asks for the memory it will read: the list's
// item (the Python object), then its TensorImpl, then its StorageImpl (each
// found through the one before). A trainer's tensors are scattered over its
// heap and were not touched since it made them: read one after the other, each
// tensor waits for three cache misses in a row; asked for ahead, they overlap
// (3072 such tensors: 570 -> 250 us on the 2-core CI box, a trainer's cold heap).
constexpr Py_ssize_t kAheadObject = 16;
constexpr Py_ssize_t kAheadImpl = 10;
constexpr Py_ssize_t kAheadStorage = 5;

inline bool plain(PyObject* obj) {
  PyTypeObject* type = Py_TYPE(obj);
  return type == plain_types[0] || type == plain_types[1];
}

// Ask for what the scan of the items ahead of item i will read (reading only
// the pointers that lead there, asked for earlier); nothing for items the scan
// leaves to Python.
inline void ask_ahead(PyObject** items, Py_ssize_t n, Py_ssize_t i) {
  if (i + kAheadObject < n) {
    __builtin_prefetch(items[i + kAheadObject]);
  }
  if (i + kAheadImpl < n && plain(items[i + kAheadImpl])) {
    const char* impl = reinterpret_cast<const char*>(THPVariable_Unpack(items[i + kAheadImpl]).unsafeGetTensorImpl());
    __builtin_prefetch(impl);
    __builtin_prefetch(impl + 64);
    __builtin_prefetch(impl + 128);
  }
  if (i + kAheadStorage < n && plain(items[i + kAheadStorage])) {
    const c10::TensorImpl* impl = THPVariable_Unpack(items[i + kAheadStorage]).unsafeGetTensorImpl();
    if (impl->has_storage()) {
      __builtin_prefetch(impl->unsafe_storage().unsafeGetStorageImpl());
    }
  }
}

template <typename T>
PyObject* as_bytes(const std::vector<T>& v) {
  return PyBytes_FromStringAndSize(reinterpret_cast<const char*>(v.data()),
                                   static_cast<Py_ssize_t>(v.size() * sizeof(T)));
}

// scan(list) -> (ptrs, nbytes, device, dtype, ndim, dims, contiguous): bytes of
// int64 values (contiguous: one byte each; dims: every tensor's sizes, one after
// the other; device: the CUDA ordinal, -1 for host memory; dtype: the
// ScalarType), or the index of the first item that is not a plain strided CPU
// or CUDA tensor of one of the two types above.
PyObject* scan(PyObject*, PyObject* list) {
  if (!PyList_Check(list)) {
    PyErr_SetString(PyExc_TypeError, "scan() takes a list");
    return nullptr;
  }
  if (plain_types[0] == nullptr) {
    PyErr_SetString(PyExc_RuntimeError, "call set_types() before scan()");
    return nullptr;
  }
  const Py_ssize_t n = PyList_GET_SIZE(list);
  std::vector<int64_t> ptrs(n), nbytes(n), device(n), dtype(n), ndim(n), dims;
  std::vector<uint8_t> contiguous(n);
  dims.reserve(static_cast<size_t>(n) * 2);
  try {
    PyObject** items = PySequence_Fast_ITEMS(list);
    for (Py_ssize_t i = 0; i < n; ++i) {
      ask_ahead(items, n, i);
      PyObject* obj = items[i];
      if (!plain(obj)) {
        return PyLong_FromSsize_t(i);
      }
      const at::Tensor& t = THPVariable_Unpack(obj);
      if (t.layout() != c10::kStrided || !t.has_storage() ||
          t.unsafeGetTensorImpl()->has_symbolic_sizes_strides() || !(t.is_cpu() || t.is_cuda())) {
        return PyLong_FromSsize_t(i);
      }
      ptrs[i] = reinterpret_cast<int64_t>(t.data_ptr());
      nbytes[i] = static_cast<int64_t>(t.nbytes());
      device[i] = t.is_cuda() ? t.get_device() : -1;
      dtype[i] = static_cast<int64_t>(t.scalar_type());
      contiguous[i] = t.is_contiguous() ? 1 : 0;
      const auto sizes = t.sizes();
      ndim[i] = static_cast<int64_t>(sizes.size());
      dims.insert(dims.end(), sizes.begin(), sizes.end());
    }
  } catch (const std::exception& e) {
    PyErr_SetString(PyExc_RuntimeError, e.what());
    return nullptr;
  }
  return Py_BuildValue("(NNNNNNN)", as_bytes(ptrs), as_bytes(nbytes), as_bytes(device),
                       as_bytes(dtype), as_bytes(ndim), as_bytes(dims), as_bytes(contiguous));
}

PyMethodDef methods[] = {
    {"set_types", set_types, METH_VARARGS, "set_types(torch.Tensor, torch.nn.Parameter)"},
    {"scan", scan, METH_O, "scan(list) -> arrays as bytes, or the index of an item not scanned"},
    {nullptr, nullptr, 0, nullptr},
};

PyModuleDef module = {PyModuleDef_HEAD_INIT, "sglang_rdt_tensor_scan", nullptr, -1, methods};

}  // namespace

PyMODINIT_FUNC PyInit_sglang_rdt_tensor_scan(void) { return PyModule_Create(&module); }
