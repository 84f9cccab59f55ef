// posenc._C: the one Python binding beside the dispatcher (issue 28, benchmarks/NOTES.md
// "The cost of one small call"). Every op reaches Python through torch.ops; this module
// adds direct entries for the modules' decode calls only (add_position, rope), because a
// call through torch.ops parses its arguments against the schema in Python's C API (about
// 1-3 us more than an ATen method's generated binding), which at decode sizes costs as much
// as the kernel.
//
// What the entry does is what torch.ops' entry does, minus the boxing: it declines (returns
// NotImplemented, and the caller uses torch.ops) for anything torch.ops handles in Python
// (a __torch_function__ override or mode: DTensor, tensor subclasses); it calls the same
// operator through the dispatcher (typed), so autograd, dispatch modes, tracing, checks and
// errors are the op's own; it releases the GIL around the call as ATen's bindings do, and
// converts C++ errors and warnings as they do (HANDLE_TH_ERRORS).
//
// It does not link libposenc: the operator is found by name in the dispatcher, so it serves
// whichever libposenc Python loaded (POSENC_LIBRARY included). It is the only part of posenc
// built against Python's C API (one file per Python version); the package runs without it.
#include <Python.h>

#include <ATen/PythonTorchFunctionTLS.h>
#include <torch/csrc/Exceptions.h>
#include <torch/csrc/autograd/python_variable.h>
#include <torch/csrc/jit/frontend/tracer.h>

#include "../ops/common/op_handles.h"

namespace {

PyObject* parameter_type = nullptr;  // torch.nn.Parameter, looked up when the module loads

// A tensor whose __torch_function__ is torch's own: a torch.Tensor, or an nn.Parameter (its
// __torch_function__ is disabled). Subclasses (DTensor, user ones) are left to torch.ops.
bool plain_tensor(PyObject* obj) {
  return THPVariable_CheckExact(obj) || Py_TYPE(obj) == reinterpret_cast<PyTypeObject*>(parameter_type);
}

// Releases the GIL for a scope, as ATen's generated bindings do around a kernel (a large
// eval call takes milliseconds); restored before HANDLE_TH_ERRORS' handlers run.
struct ReleaseGil {
  PyThreadState* state = PyEval_SaveThread();
  ~ReleaseGil() { PyEval_RestoreThread(state); }
};

// What torch.ops would hand to __torch_function__ (a torch function mode: TorchFunctionMode,
// DTensor's) goes through torch.ops; so does a call under torch.jit tracing, for which the
// modules take nn.Module.__call__, whose traced forward records the module's scope. (Dispatch
// modes need nothing: the dispatcher calls below reach their Python key as torch.ops' do.)
bool left_to_torch_ops() {
  return at::impl::torch_function_mode_enabled() || torch::jit::tracer::isTracing();
}

// An exact Python int as int64 (ValueError naming the argument when it does not fit).
bool unpack_int64(PyObject* obj, const char* op, const char* name, int64_t* out) {
  int overflow = 0;
  const long long value = PyLong_AsLongLongAndOverflow(obj, &overflow);
  if (overflow != 0) {
    PyErr_Format(PyExc_ValueError, "posenc.%s: expected %s to fit in a 64-bit integer, got %R", op,
                 name, obj);
    return false;
  }
  if (value == -1 && PyErr_Occurred()) return false;
  *out = value;
  return true;
}

// False, with a TypeError naming the entry's arguments, unless there are `expected` of them.
bool argument_count(const char* entry, const char* names, Py_ssize_t expected, Py_ssize_t got) {
  if (got == expected) return true;
  PyErr_Format(PyExc_TypeError, "posenc._C.%s: expected %zd arguments (%s), got %zd", entry,
               expected, names, got);
  return false;
}

// add_position(x, table, offset, batch_first, p): the op with positions=None.
PyObject* add_position(PyObject* /*module*/, PyObject* const* args, Py_ssize_t nargs) {
  HANDLE_TH_ERRORS
  if (!argument_count("add_position", "x, table, offset, batch_first, p", 5, nargs)) return nullptr;
  PyObject* x = args[0];
  PyObject* table = args[1];
  if (!plain_tensor(x) || !plain_tensor(table) || !PyLong_CheckExact(args[2]) ||
      !PyBool_Check(args[3]) || !PyFloat_CheckExact(args[4]) || left_to_torch_ops()) {
    Py_RETURN_NOTIMPLEMENTED;
  }
  int64_t offset = 0;
  if (!unpack_int64(args[2], "add_position", "offset", &offset)) return nullptr;
  const bool batch_first = args[3] == Py_True;
  const double p = PyFloat_AS_DOUBLE(args[4]);
  const at::Tensor& x_t = THPVariable_Unpack(x);
  const at::Tensor& table_t = THPVariable_Unpack(table);
  at::Tensor out;
  {
    ReleaseGil no_gil;
    out = posenc::ops::add_position_op().call(x_t, table_t, std::nullopt, c10::SymInt(offset),
                                              batch_first, p);
  }
  return THPVariable_Wrap(std::move(out));
  END_HANDLE_TH_ERRORS
}

// posenc::rope called boxed with every argument at its schema default but the ones the
// RoPE modules' decode call sets. The defaults are read from the schema once, so this file
// repeats no default; the names are checked then too.
struct RopeDecodeCall {
  c10::OperatorHandle op;
  std::vector<c10::IValue> stack;  // the schema's defaults, in order (q's slot empty)
  size_t q, k, offset, base, rotary_dim, interleaved, layout;

  static const RopeDecodeCall& get() {
    static const RopeDecodeCall call = [] {
      RopeDecodeCall c{c10::Dispatcher::singleton().findSchemaOrThrow("posenc::rope", "")};
      const auto& arguments = c.op.schema().arguments();
      for (const auto& argument : arguments) {
        c.stack.push_back(argument.default_value().value_or(c10::IValue()));
      }
      auto index = [&](const char* name) {
        const auto found = c.op.schema().argumentIndexWithName(name);
        TORCH_CHECK(found.has_value(), "posenc._C: posenc::rope has no argument ", name);
        return static_cast<size_t>(*found);
      };
      c.q = index("q");
      c.k = index("k");
      c.offset = index("offset");
      c.base = index("base");
      c.rotary_dim = index("rotary_dim");
      c.interleaved = index("interleaved");
      c.layout = index("layout");
      return c;
    }();
    return call;
  }
};

// rope(q, k, offset, base, rotary_dim, interleaved, layout): posenc::rope with positions,
// offsets, cu_seqlens, scaling and sections at their defaults; (q, k or an empty tensor).
PyObject* rope(PyObject* /*module*/, PyObject* const* args, Py_ssize_t nargs) {
  HANDLE_TH_ERRORS
  if (!argument_count("rope", "q, k, offset, base, rotary_dim, interleaved, layout", 7, nargs)) {
    return nullptr;
  }
  const bool has_k = args[1] != Py_None;
  if (!plain_tensor(args[0]) || (has_k && !plain_tensor(args[1])) || !PyLong_CheckExact(args[2]) ||
      !PyFloat_CheckExact(args[3]) || !PyLong_CheckExact(args[4]) || !PyBool_Check(args[5]) ||
      !PyUnicode_CheckExact(args[6]) || left_to_torch_ops()) {
    Py_RETURN_NOTIMPLEMENTED;
  }
  int64_t offset = 0, rotary_dim = 0;
  if (!unpack_int64(args[2], "rope", "offset", &offset) ||
      !unpack_int64(args[4], "rope", "rotary_dim", &rotary_dim)) {
    return nullptr;
  }
  Py_ssize_t layout_size = 0;
  const char* layout = PyUnicode_AsUTF8AndSize(args[6], &layout_size);
  if (layout == nullptr) return nullptr;
  const RopeDecodeCall& call = RopeDecodeCall::get();
  torch::jit::Stack stack = call.stack;
  stack[call.q] = THPVariable_Unpack(args[0]);
  if (has_k) stack[call.k] = THPVariable_Unpack(args[1]);
  stack[call.offset] = offset;
  stack[call.base] = PyFloat_AS_DOUBLE(args[3]);
  stack[call.rotary_dim] = rotary_dim;
  stack[call.interleaved] = args[5] == Py_True;
  stack[call.layout] = std::string(layout, static_cast<size_t>(layout_size));
  {
    ReleaseGil no_gil;
    call.op.callBoxed(stack);
  }
  PyObject* out_q = THPVariable_Wrap(std::move(stack[0]).toTensor());
  PyObject* out_k = THPVariable_Wrap(std::move(stack[1]).toTensor());
  if (out_q == nullptr || out_k == nullptr) {
    Py_XDECREF(out_q);
    Py_XDECREF(out_k);
    return nullptr;
  }
  PyObject* out = PyTuple_New(2);
  if (out == nullptr) {
    Py_DECREF(out_q);
    Py_DECREF(out_k);
    return nullptr;
  }
  PyTuple_SET_ITEM(out, 0, out_q);
  PyTuple_SET_ITEM(out, 1, out_k);
  return out;
  END_HANDLE_TH_ERRORS
}

PyMethodDef methods[] = {
    {"add_position", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(&add_position)),
     METH_FASTCALL,
     "add_position(x, table, offset, batch_first, p): torch.ops.posenc.add_position with "
     "positions=None, or NotImplemented for arguments torch.ops must handle"},
    {"rope", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(&rope)), METH_FASTCALL,
     "rope(q, k, offset, base, rotary_dim, interleaved, layout): torch.ops.posenc.rope with "
     "the other arguments at their defaults, or NotImplemented for arguments torch.ops must "
     "handle"},
    {nullptr, nullptr, 0, nullptr}};

PyModuleDef module_def = {PyModuleDef_HEAD_INIT, "posenc._C",
                          "posenc's direct entries beside torch.ops (see fast_calls.cpp)", -1,
                          methods};

}  // namespace

PyMODINIT_FUNC PyInit__C() {
  PyObject* parameter_module = PyImport_ImportModule("torch.nn.parameter");
  if (parameter_module == nullptr) return nullptr;
  parameter_type = PyObject_GetAttrString(parameter_module, "Parameter");  // kept for good
  Py_DECREF(parameter_module);
  if (parameter_type == nullptr) return nullptr;
  return PyModule_Create(&module_def);
}
