// torch_cppwrap's runtime extension: the one translation unit that includes the
// heavy libtorch headers.  It is built once per torch version and exports a
// table of C functions (cppwrap_api.h) through a capsule, so the per-graph
// wrapper modules stay light to compile.
#include "cppwrap_api.h"

#include <ATen/Context.h>
#include <ATen/EmptyTensor.h>
#include <ATen/core/Tensor.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/core/ivalue.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_strided.h>
#include <ATen/ops/scalar_tensor.h>
#include <ATen/record_function.h>
#include <c10/core/Allocator.h>
#include <c10/core/CPUAllocator.h>
#include <c10/core/DeviceGuard.h>
#include <c10/core/TensorImpl.h>
#include <c10/core/impl/LocalDispatchKeySet.h>
#include <torch/csrc/Exceptions.h>
#include <torch/csrc/autograd/python_variable.h>

#if __has_include(<torch/csrc/shim_exception_state.h>)
#include <torch/csrc/shim_exception_state.h>
#define CPPWRAP_SHIM_RECORDS_ERRORS 1
#else
#define CPPWRAP_SHIM_RECORDS_ERRORS 0
#endif

#include <atomic>
#include <cstdint>
#include <cstdlib>
#include <exception>
#include <memory>
#include <mutex>
#include <new>
#include <sstream>
#include <string>
#include <thread>
#include <typeinfo>
#include <utility>
#include <vector>

#include "cppwrap_dtypes.h"

// libtorch_cuda's since torch 2.12 (ATen/cuda/CUDAContextLight.h, which needs
// CUDA's headers): drops the cuBLAS and cuBLASLt workspaces kept for one
// stream.  Declared weak, so that this extension loads where it is missing
// (torch 2.11, CPU builds), and reached through libtorch_python's
// dependencies on a CUDA build.
struct CUstream_st;
namespace at::cuda {
[[gnu::weak]] void clearCublasWorkspacesForStream(CUstream_st* stream);
}  // namespace at::cuda

static_assert(sizeof(at::Tensor) == sizeof(void*), "slot layout");
static_assert(alignof(at::Tensor) == alignof(void*), "slot layout");

// Every code of cppwrap_dtypes.h against c10's enum of that name.
#define CPPWRAP_CHECK_CODE(group, name, type, value) \
  static_assert(cppwrap::group::name == static_cast<int32_t>(c10::type::value));
CPPWRAP_CHECK_CODE(dtype, kUInt8, ScalarType, Byte)
CPPWRAP_CHECK_CODE(dtype, kInt8, ScalarType, Char)
CPPWRAP_CHECK_CODE(dtype, kInt16, ScalarType, Short)
CPPWRAP_CHECK_CODE(dtype, kInt32, ScalarType, Int)
CPPWRAP_CHECK_CODE(dtype, kInt64, ScalarType, Long)
CPPWRAP_CHECK_CODE(dtype, kFloat16, ScalarType, Half)
CPPWRAP_CHECK_CODE(dtype, kFloat32, ScalarType, Float)
CPPWRAP_CHECK_CODE(dtype, kFloat64, ScalarType, Double)
CPPWRAP_CHECK_CODE(dtype, kComplex32, ScalarType, ComplexHalf)
CPPWRAP_CHECK_CODE(dtype, kComplex64, ScalarType, ComplexFloat)
CPPWRAP_CHECK_CODE(dtype, kComplex128, ScalarType, ComplexDouble)
CPPWRAP_CHECK_CODE(dtype, kBool, ScalarType, Bool)
CPPWRAP_CHECK_CODE(dtype, kBFloat16, ScalarType, BFloat16)
CPPWRAP_CHECK_CODE(dtype, kFloat8_e5m2, ScalarType, Float8_e5m2)
CPPWRAP_CHECK_CODE(dtype, kFloat8_e4m3fn, ScalarType, Float8_e4m3fn)
CPPWRAP_CHECK_CODE(dtype, kFloat8_e5m2fnuz, ScalarType, Float8_e5m2fnuz)
CPPWRAP_CHECK_CODE(dtype, kFloat8_e4m3fnuz, ScalarType, Float8_e4m3fnuz)
CPPWRAP_CHECK_CODE(dtype, kUInt16, ScalarType, UInt16)
CPPWRAP_CHECK_CODE(dtype, kUInt32, ScalarType, UInt32)
CPPWRAP_CHECK_CODE(dtype, kUInt64, ScalarType, UInt64)
CPPWRAP_CHECK_CODE(device, kCPU, DeviceType, CPU)
CPPWRAP_CHECK_CODE(device, kCUDA, DeviceType, CUDA)
CPPWRAP_CHECK_CODE(device, kMeta, DeviceType, Meta)
CPPWRAP_CHECK_CODE(layout, kStrided, Layout, Strided)
CPPWRAP_CHECK_CODE(memory_format, kContiguous, MemoryFormat, Contiguous)
CPPWRAP_CHECK_CODE(memory_format, kPreserve, MemoryFormat, Preserve)
CPPWRAP_CHECK_CODE(memory_format, kChannelsLast, MemoryFormat, ChannelsLast)
CPPWRAP_CHECK_CODE(memory_format, kChannelsLast3d, MemoryFormat, ChannelsLast3d)
#undef CPPWRAP_CHECK_CODE

namespace {

// The last failure on this thread: its message, and the exception itself
// when there was one, until the wrapper takes it (take_exception) to raise
// it as its own Python type.
thread_local std::string last_error_message;
thread_local std::exception_ptr last_exception;

int fail(const std::string& message) {
  last_error_message = message;
  last_exception = nullptr;
  return -1;
}

// Records the exception being handled; `context` prefixes its message.
int fail_with_current(const std::string& context = "") {
  try {
    throw;
  } catch (const c10::Error& e) {
    fail(context + e.what_without_backtrace());
  } catch (const std::exception& e) {
    fail(context + e.what());
  } catch (...) {
    fail(context + "unknown C++ exception");
  }
  last_exception = std::current_exception();
  return -1;
}

// Runs `body`, turning any C++ exception into a -1 and a stored failure.
template <typename F>
int guarded(F&& body) {
  try {
    body();
    return 0;
  } catch (...) {
    return fail_with_current();
  }
}

at::Tensor& tensor_at(void* slot) {
  return *static_cast<at::Tensor*>(slot);
}
const at::Tensor& tensor_at(const void* slot) {
  return *static_cast<const at::Tensor*>(slot);
}

std::string int_list(const int64_t* values, int64_t n) {
  std::ostringstream out;
  out << "[";
  for (int64_t i = 0; i < n; ++i) {
    out << (i ? ", " : "");
    if (values[i] < 0) {
      out << "*";
    } else {
      out << values[i];
    }
  }
  out << "]";
  return out.str();
}

const char* last_error() {
  return last_error_message.c_str();
}

// torch.Tensor -> at::Tensor with python_variable.h's inline functions,
// which read the tensor where the Python object keeps it.  torch's pybind11
// caster (torch/csrc/utils/pybind.h) would take a fifth off this file's build,
// but converts out of line with a reference taken and dropped: about 0.08 us
// more per input on every call of a graph.
int unpack(PyObject* obj, void* slot, const char* what) {
  if (!THPVariable_Check(obj)) {
    PyErr_Format(
        PyExc_TypeError,
        "compiled graph expected a Tensor for %s, got %s",
        what,
        Py_TYPE(obj)->tp_name);
    return -1;
  }
  new (slot) at::Tensor(THPVariable_Unpack(obj));
  return 0;
}

int borrow(PyObject* obj, void* slot, const char* what) {
  if (!THPVariable_Check(obj)) {
    return unpack(obj, slot, what);  // raises the TypeError
  }
  // The bits of an at::Tensor are its TensorImpl pointer; copying them takes
  // no reference, which is the point.
  static_assert(sizeof(at::Tensor) == sizeof(c10::TensorImpl*));
  const at::Tensor& tensor = THPVariable_Unpack(obj);
  *static_cast<c10::TensorImpl**>(slot) = tensor.unsafeGetTensorImpl();
  return 0;
}

PyObject* wrap(void* slot) {
  at::Tensor& t = tensor_at(slot);
  PyObject* result = THPVariable_Wrap(std::move(t));
  t.~Tensor();
  return result;
}

void release(void* slot) {
  tensor_at(slot).~Tensor();
}

void copy(const void* src, void* dst) {
  new (dst) at::Tensor(tensor_at(src));
}

void adopt(AtenTensorHandle handle, void* dst) {
  auto* owned = reinterpret_cast<at::Tensor*>(handle);
  new (dst) at::Tensor(std::move(*owned));
  delete owned;
}

// Small CPU buffers skip the default CPU allocator's bookkeeping.  That
// allocator asks posix_memalign for 64-byte alignment (a slow path of glibc
// that bypasses its per-thread cache) and reports each block to the memory
// profiler through a mutex-guarded table; for a buffer of a few bytes that is
// most of the ~220 ns an empty tensor costs.  Here the block comes from plain
// malloc, padded by the alignment and aligned by hand, and the tensor is built
// directly.  The storage keeps the default allocator, so resize_ and friends
// behave as for any CPU tensor.  Only taken while the default CPU allocator is
// installed and the profiler is not recording memory, so both still see every
// allocation they would have seen.
constexpr size_t kSmallBufferBytes = 64 * 1024;
constexpr uintptr_t kCpuAlignment = 64;  // what c10's alloc_cpu guarantees

void free_small_buffer(void* raw) {
  std::free(raw);
}

bool small_cpu_buffer(
    c10::IntArrayRef size,
    c10::IntArrayRef stride,
    c10::ScalarType scalar_type,
    void* dst) {
  const auto dtype = c10::scalarTypeToTypeMeta(scalar_type);
  const size_t nbytes = at::detail::computeStorageNbytes(size, stride, dtype.itemsize());
  c10::Allocator* allocator = c10::GetCPUAllocator();
  if (nbytes == 0 || nbytes > kSmallBufferBytes ||
      allocator != c10::GetDefaultCPUAllocator() || c10::memoryProfilingEnabled()) {
    return false;
  }
  void* raw = std::malloc(nbytes + kCpuAlignment - 1);
  if (raw == nullptr) {
    return false;  // let the default allocator raise its out-of-memory error
  }
  void* data = reinterpret_cast<void*>(
      (reinterpret_cast<uintptr_t>(raw) + kCpuAlignment - 1) & ~(kCpuAlignment - 1));
  c10::Storage storage(
      c10::Storage::use_byte_size_t(),
      nbytes,
      c10::DataPtr(data, raw, free_small_buffer, c10::Device(c10::DeviceType::CPU)),
      allocator,
      /*resizable=*/true);
  auto tensor = at::detail::make_tensor<c10::TensorImpl>(
      std::move(storage), c10::DispatchKeySet(c10::DispatchKey::CPU), dtype);
  // Always: a new TensorImpl has size [0], not the 0-d shape of `{}`.
  tensor.unsafeGetTensorImpl()->set_sizes_and_strides(size, stride);
  new (dst) at::Tensor(std::move(tensor));
  return true;
}

// Device buffers straight from the allocator ATen gave the last one, as the
// Python wrapper's empty_strided_cuda makes them: no dispatcher, no
// RecordFunction.  The allocator is learnt from a buffer made through the
// dispatcher (the first of the process, and any made while the fast path is
// off), so it is the one ATen's own empty_strided uses for the device type;
// PyTorch refuses to swap a device allocator once it has allocated.  Off
// while deterministic algorithms fill new memory, which only the ATen
// operator does.
std::atomic<c10::Allocator*> learnt_cuda_allocator{nullptr};

bool deterministic_fill() {
  const auto& context = at::globalContext();
  return context.deterministicAlgorithms() && context.deterministicFillUninitializedMemory();
}

at::Tensor empty_strided_device(
    c10::IntArrayRef size,
    c10::IntArrayRef stride,
    c10::ScalarType scalar_type,
    c10::Device device) {
  const bool is_cuda = device.type() == c10::DeviceType::CUDA;
  c10::Allocator* allocator = is_cuda ? learnt_cuda_allocator.load() : nullptr;
  if (allocator != nullptr && !deterministic_fill()) {
    // The caching allocator serves the current device.
    c10::DeviceGuard guard(device);
    return at::detail::empty_strided_generic(
        size, stride, allocator, c10::DispatchKeySet(c10::DispatchKey::CUDA), scalar_type);
  }
  at::Tensor made = at::empty_strided(
      size, stride, at::TensorOptions().dtype(scalar_type).device(device));
  if (is_cuda) {
    learnt_cuda_allocator.store(made.storage().allocator());
  }
  return made;
}

int empty_strided(
    int64_t ndim,
    const int64_t* sizes,
    const int64_t* strides,
    int32_t dtype,
    int32_t device_type,
    int32_t device_index,
    void* dst) {
  return guarded([&] {
    c10::IntArrayRef size(sizes, ndim);
    c10::IntArrayRef stride(strides, ndim);
    auto scalar_type = static_cast<c10::ScalarType>(dtype);
    auto device_kind = static_cast<c10::DeviceType>(device_type);
    if (device_kind == c10::DeviceType::CPU) {
      if (small_cpu_buffer(size, stride, scalar_type, dst)) {
        return;
      }
      new (dst) at::Tensor(at::detail::empty_strided_cpu(size, stride, scalar_type));
    } else {
      new (dst) at::Tensor(empty_strided_device(
          size, stride, scalar_type, c10::Device(device_kind, device_index)));
    }
  });
}

// An alias of `src`'s storage with new sizes, strides and offset, made without
// the dispatcher or autograd: the C++ counterpart of reinterpret_tensor.
int reinterpret(
    const void* src,
    int64_t ndim,
    const int64_t* sizes,
    const int64_t* strides,
    int64_t storage_offset,
    void* dst) {
  return guarded([&] {
    const at::Tensor& self = tensor_at(src);
    auto alias = at::detail::make_tensor<c10::TensorImpl>(
        c10::TensorImpl::VIEW, c10::Storage(self.storage()), self.key_set(), self.dtype());
    alias.unsafeGetTensorImpl()->set_sizes_and_strides(
        c10::IntArrayRef(sizes, ndim), c10::IntArrayRef(strides, ndim), storage_offset);
    new (dst) at::Tensor(std::move(alias));
  });
}

int view_dtype(const void* src, int32_t dtype, void* dst) {
  return guarded([&] {
    new (dst) at::Tensor(tensor_at(src).view(static_cast<c10::ScalarType>(dtype)));
  });
}

void* data_ptr(const void* slot) {
  return tensor_at(slot).data_ptr();
}

int64_t dim(const void* slot) {
  return tensor_at(slot).dim();
}

const int64_t* sizes(const void* slot) {
  return tensor_at(slot).sizes().data();
}

const int64_t* strides(const void* slot) {
  return tensor_at(slot).strides().data();
}

int check_tensor(
    const void* slot,
    const char* name,
    int32_t dtype,
    int32_t device_type,
    int32_t device_index,
    int64_t ndim,
    const int64_t* expected_sizes,
    const int64_t* expected_strides) {
  const at::Tensor& t = tensor_at(slot);
  if (!t.defined()) {
    // An optional output that the op did not produce (multi-head attention's
    // weights without need_weights): torch 2.14 and later ask for its layout
    // all the same, and there is none to check.  A graph input is never
    // undefined.
    return 0;
  }
  if (device_type >= 0) {
    // A kernel reads the data behind data_ptr(): a meta tensor has none, a
    // tensor on another device has it where the kernel cannot look.
    const c10::Device actual = t.device();
    const auto expected_type = static_cast<c10::DeviceType>(device_type);
    const bool indexed = expected_type != c10::DeviceType::CPU;
    // A 0-d CPU tensor may stand where a device tensor was traced: ATen ops
    // take CPU scalars beside device tensors, and attention's saved RNG state
    // (philox seed and offset) is one whatever its fake tensor said.  (A CPU
    // tensor has no index, so the second test passes it too.)
    if ((actual.type() != expected_type && !(actual.is_cpu() && t.dim() == 0)) ||
        (indexed && actual.has_index() && actual.index() != device_index)) {
      const c10::Device expected(
          expected_type, indexed ? static_cast<c10::DeviceIndex>(device_index) : -1);
      return fail(
          std::string(name) + ": expected a tensor on " + expected.str() +
          " but got one on " + actual.str() +
          " (the graph was compiled for another device)");
    }
  }
  if (dtype >= 0 && static_cast<int32_t>(t.scalar_type()) != dtype) {
    return fail(
        std::string(name) + ": expected dtype " +
        c10::toString(static_cast<c10::ScalarType>(dtype)) + " but got " +
        c10::toString(t.scalar_type()) +
        " (the graph was compiled for another dtype)");
  }
  if (ndim < 0) {
    return 0;
  }
  bool ok = t.dim() == ndim;
  auto actual_sizes = t.sizes();
  auto actual_strides = t.strides();
  for (int64_t i = 0; ok && i < ndim; ++i) {
    // A stride is only meaningful for a dimension with more than one element,
    // and in a tensor with at least one (torch 2.14 and later check empty op
    // outputs too); numel() is asked only where a stride differs.
    ok = (expected_sizes[i] < 0 || expected_sizes[i] == actual_sizes[i]) &&
        (expected_strides[i] < 0 || actual_sizes[i] <= 1 ||
         expected_strides[i] == actual_strides[i] || t.numel() == 0);
  }
  if (!ok) {
    return fail(
        std::string(name) + ": expected size " +
        int_list(expected_sizes, ndim) + " and stride " +
        int_list(expected_strides, ndim) + " but got size " +
        int_list(actual_sizes.data(), t.dim()) + " and stride " +
        int_list(actual_strides.data(), t.dim()));
  }
  return 0;
}

int scalar_to_tensor_long(int64_t value, void* dst) {
  return guarded([&] { new (dst) at::Tensor(at::scalar_tensor(value, at::kLong)); });
}

int scalar_to_tensor_double(double value, void* dst) {
  return guarded([&] { new (dst) at::Tensor(at::scalar_tensor(value, at::kDouble)); });
}

int scalar_to_tensor_complex(double real, double imag, void* dst) {
  return guarded([&] {
    new (dst) at::Tensor(
        at::scalar_tensor(c10::complex<double>(real, imag), at::kComplexDouble));
  });
}

int item_long(const void* slot, int64_t* out) {
  return guarded([&] { *out = tensor_at(slot).item<int64_t>(); });
}

int item_double(const void* slot, double* out) {
  return guarded([&] { *out = tensor_at(slot).item<double>(); });
}

// ---- boxed calls ----

// A graph module finds each op once and keeps the handle for the process's
// life.  An op defined by a library that goes away (torch.library's scoped
// libraries, as in PyTorch's tests) leaves the dispatcher, and a module loaded
// again from the FX graph cache may call it after it is defined anew.  The
// handle follows the dispatcher rather than pin the op's entry there (a pinned
// entry outlives the Python op object its Python-dispatcher cache points at,
// and the op defined anew then crashed the process): a listener marks the
// handles of an op whose definition goes, and the next call finds the op again
// by name, refusing a schema other than the one the graph was compiled for.
struct OpHandle {
  explicit OpHandle(const c10::OperatorHandle& found)
      : schema(found.schema()), op(found) {}

  const c10::FunctionSchema schema;
  c10::OperatorHandle op;  // read only while `stale` is false
  std::atomic<bool> stale{false};
};

// Every handle made.  Never freed, nor the list: the modules holding the
// handles stay loaded, and libraries still deregister ops, calling the
// listener, while the process's static objects are destroyed at exit.
struct OpHandles {
  std::mutex mutex;
  std::vector<OpHandle*> all;
};

OpHandles& op_handles() {
  static auto* handles = new OpHandles();
  return *handles;
}

class StaleOpHandles final : public c10::OpRegistrationListener {
 public:
  void onOperatorRegistered(const c10::OperatorHandle& /*op*/) override {}
  // Called while the op is still in the dispatcher, before its entry goes.
  void onOperatorDeregistered(const c10::OperatorHandle& op) override {
    auto& handles = op_handles();
    std::lock_guard<std::mutex> lock(handles.mutex);
    for (OpHandle* handle : handles.all) {
      if (handle->schema.operator_name() == op.operator_name()) {
        handle->stale.store(true, std::memory_order_release);
      }
    }
  }
};

void* find_op(const char* name, const char* overload) {
  try {
    auto& dispatcher = c10::Dispatcher::singleton();
    static const auto* listening = new c10::RegistrationHandleRAII(
        dispatcher.addRegistrationListener(std::make_unique<StaleOpHandles>()));
    (void)listening;
    auto handle = std::make_unique<OpHandle>(dispatcher.findSchemaOrThrow(name, overload));
    auto& handles = op_handles();
    std::lock_guard<std::mutex> lock(handles.mutex);
    handles.all.push_back(handle.get());
    return handle.release();
  } catch (const std::exception& e) {
    fail(e.what());
    return nullptr;
  }
}

// The op to call through `handle`, found again if its definition went since;
// null, with the failure recorded, if it is gone or has another schema now.
const c10::OperatorHandle* current_op(OpHandle& handle) {
  if (C10_LIKELY(!handle.stale.load(std::memory_order_acquire))) {
    return &handle.op;
  }
  const auto& name = handle.schema.operator_name();
  auto found = c10::Dispatcher::singleton().findSchema(name);
  std::ostringstream problem;
  if (!found) {
    problem << name << " is no longer defined (its library went away after "
            << "this graph was compiled)";
  } else if (!(found->schema() == handle.schema)) {
    problem << name << " was defined again as `" << found->schema()
            << "`, not as `" << handle.schema
            << "`, which this graph was compiled for";
  } else {
    std::lock_guard<std::mutex> lock(op_handles().mutex);
    handle.op = *found;
    handle.stale.store(false, std::memory_order_release);
    return &handle.op;
  }
  fail(problem.str());
  return nullptr;
}

using Stack = std::vector<c10::IValue>;

Stack& stack_at(void* stack) {
  return *static_cast<Stack*>(stack);
}

// Every BoxedCall owns its stack from construction to finish: a boxed op may
// run Python that calls another compiled graph on this thread, whose boxed
// calls must not touch the stack of the call still in progress.  Finished
// stacks are kept per thread, with their capacity, for the next call.
thread_local std::vector<std::unique_ptr<Stack>> free_stacks;

void* stack_new() {
  try {
    if (free_stacks.empty()) {
      return new Stack();
    }
    Stack* stack = free_stacks.back().release();
    free_stacks.pop_back();
    return stack;
  } catch (const std::bad_alloc&) {
    fail("out of memory for a dispatcher call's arguments");
    return nullptr;
  }
}

void stack_free(void* s) {
  std::unique_ptr<Stack> stack(static_cast<Stack*>(s));
  stack->clear();  // the op's results: freed here, not at the next call
  try {
    free_stacks.push_back(std::move(stack));
  } catch (const std::bad_alloc&) {
    // Not kept: `stack` deletes it.
  }
}

void push_none(void* s) {
  stack_at(s).emplace_back();
}
void push_tensor(void* s, const void* slot) {
  if (slot == nullptr) {
    stack_at(s).emplace_back();
  } else {
    stack_at(s).emplace_back(tensor_at(slot));
  }
}
void push_int(void* s, int64_t v) {
  stack_at(s).emplace_back(v);
}
void push_double(void* s, double v) {
  stack_at(s).emplace_back(v);
}
void push_complex(void* s, double real, double imag) {
  stack_at(s).emplace_back(c10::complex<double>(real, imag));
}
void push_bool(void* s, int32_t v) {
  stack_at(s).emplace_back(static_cast<bool>(v));
}
void push_string(void* s, const char* v) {
  stack_at(s).emplace_back(std::string(v));
}
void push_dtype(void* s, int32_t v) {
  stack_at(s).emplace_back(static_cast<c10::ScalarType>(v));
}
void push_layout(void* s, int32_t v) {
  stack_at(s).emplace_back(static_cast<c10::Layout>(v));
}
void push_memory_format(void* s, int32_t v) {
  stack_at(s).emplace_back(static_cast<c10::MemoryFormat>(v));
}
void push_device(void* s, int32_t type, int32_t index) {
  stack_at(s).emplace_back(
      c10::Device(static_cast<c10::DeviceType>(type), static_cast<c10::DeviceIndex>(index)));
}
void push_int_list(void* s, const int64_t* v, int64_t n) {
  stack_at(s).emplace_back(std::vector<int64_t>(v, v + n));
}
void push_double_list(void* s, const double* v, int64_t n) {
  stack_at(s).emplace_back(std::vector<double>(v, v + n));
}
void push_bool_list(void* s, const int32_t* v, int64_t n) {
  c10::List<bool> values;
  for (int64_t i = 0; i < n; ++i) {
    values.push_back(v[i] != 0);
  }
  stack_at(s).emplace_back(std::move(values));
}
void push_tensor_list(void* s, const void* const* slots, int64_t n, int32_t optional) {
  if (optional) {
    c10::List<std::optional<at::Tensor>> values;
    for (int64_t i = 0; i < n; ++i) {
      values.push_back(
          slots[i] ? std::optional<at::Tensor>(tensor_at(slots[i])) : std::nullopt);
    }
    stack_at(s).emplace_back(std::move(values));
  } else {
    std::vector<at::Tensor> values;
    values.reserve(n);
    for (int64_t i = 0; i < n; ++i) {
      values.push_back(tensor_at(slots[i]));
    }
    stack_at(s).emplace_back(std::move(values));
  }
}

int call_boxed(void* op, void* s) {
  auto& handle = *static_cast<OpHandle*>(op);
  try {
    const c10::OperatorHandle* current = current_op(handle);
    if (current == nullptr) {
      return -1;
    }
    current->callBoxed(stack_at(s));
    return 0;
  } catch (...) {
    // The op's own exception is kept: a custom op's ValueError, or
    // linalg's LinAlgError, reaches Python as itself.
    return fail_with_current(handle.schema.name() + ": ");
  }
}

int call_boxed_below_autograd(void* op, void* s) {
  c10::impl::ExcludeDispatchKeyGuard no_autograd(c10::autograd_dispatch_keyset);
  return call_boxed(op, s);
}

int result_tensor(void* s, int64_t i, int64_t j, void* dst) {
  return guarded([&] {
    const c10::IValue& value = stack_at(s).at(i);
    if (j < 0) {
      new (dst) at::Tensor(value.isNone() ? at::Tensor() : value.toTensor());
    } else {
      new (dst) at::Tensor(value.toTensorList().get(j));
    }
  });
}

void* record_begin(const char* name) {
  // With no profiler (or other observer) on, as in nearly every call, no
  // RecordFunction is made: that is what RECORD_FUNCTION's check saves too.
  auto callbacks = at::getStepCallbacksUnlessEmpty(at::RecordScope::FUNCTION);
  if (C10_LIKELY(!callbacks.has_value())) {
    return nullptr;
  }
  // Callbacks that are there make the record active.
  auto guard = std::make_unique<at::RecordFunction>(std::move(*callbacks));
  guard->before(name);
  return guard.release();
}

void record_end(void* guard) {
  delete static_cast<at::RecordFunction*>(guard);
}

void take_exception(void* dst) {
  *static_cast<std::exception_ptr*>(dst) = std::exchange(last_exception, nullptr);
}

// Raises `src` as torch's Python bindings would (the GIL is held): a Python
// exception that crossed C++ comes back as itself, a c10 error of a specific
// kind as its Python type (ValueError, IndexError, torch.linalg.LinAlgError,
// torch.OutOfMemoryError, ...).  Returns -1 for a plain RuntimeError, whose
// message the caller knows better (it names the op).
int raise_exception(const void* src) {
  const auto& exception = *static_cast<const std::exception_ptr*>(src);
  if (!exception) {
    return -1;
  }
  try {
    std::rethrow_exception(exception);
  } catch (const torch::PyTorchError&) {
  } catch (const python_error&) {
  } catch (const pybind11::error_already_set&) {
  } catch (const c10::Error& e) {
    if (typeid(e) == typeid(c10::Error)) {
      return -1;
    }
  } catch (...) {
    return -1;
  }
  torch::translate_exception_to_python(exception);
  return PyErr_Occurred() ? 0 : -1;
}

// What the C shim recorded about its last failure on this thread (it returns
// only an error code): empty when the exception it caught said nothing, null
// where this torch does not record it.
const char* shim_error() {
#if CPPWRAP_SHIM_RECORDS_ERRORS
  return torch::csrc::shim::details::get_torch_exception_what_without_backtrace().c_str();
#else
  return nullptr;
#endif
}

// The CUDA graphs' shared pool (see cppwrap_api.h): `pool_taken` is set by
// the one eager run that holds it, `pool_replays` counts the replays being
// queued.  Each side announces itself, then looks at the other (both
// sequentially consistent), so they cannot both go ahead.
std::atomic<bool> pool_taken{false};
std::atomic<int64_t> pool_replays{0};

int32_t graph_pool_try_share() {
  if (pool_taken.load()) {
    return 0;
  }
  pool_replays.fetch_add(1);
  if (pool_taken.load()) {
    pool_replays.fetch_sub(1);
    return 0;
  }
  return 1;
}

void graph_pool_unshare() {
  pool_replays.fetch_sub(1);
}

int32_t graph_pool_take() {
  bool expected = false;
  if (!pool_taken.compare_exchange_strong(expected, true)) {
    return 0;
  }
  // A replay queues a few copies and one launch: this wait is short, and the
  // replays do not need the GIL this thread may hold.
  while (pool_replays.load() != 0) {
    std::this_thread::yield();
  }
  return 1;
}

void graph_pool_give() {
  pool_taken.store(false);
}

// ---- Outputs lent out of a CUDA graph's pool (cppwrap_cuda_graph.h) ----
// A lent storage points at a graph's pool block without owning it.  Its
// DataPtr's context is a PoolLoan, which holds the block's own storage: the
// block stays allocated, so no later capture or warm-up is given it, for as
// long as anything holds the lent storage.
struct PoolLoan {
  c10::intrusive_ptr<c10::StorageImpl> block;
  const void* lender;
};

void end_loan(void* loan) {
  delete static_cast<PoolLoan*>(loan);
}

// Every loan not yet taken back, with the device and stream its pool serves
// (the default stream has one handle on every device) and the epoch of its
// lender's capture.  A graph captured before that epoch may have been given
// the lent block as scratch memory (it was free then), so its replay takes
// the loan back first.
struct LoanRecord {
  const void* stream;
  int32_t device;
  int64_t epoch;
  c10::weak_intrusive_ptr<c10::StorageImpl> lent;
};
std::mutex loans_mutex;
std::vector<LoanRecord> loans;
std::atomic<int64_t> last_epoch{0};

int64_t pool_epoch() {
  return ++last_epoch;
}

at::Tensor lend(const at::Tensor& self, const void* lender, const void* stream, int64_t epoch) {
  c10::StorageImpl* block = self.storage().unsafeGetStorageImpl();
  c10::DataPtr data(
      block->mutable_data(),
      new PoolLoan{c10::intrusive_ptr<c10::StorageImpl>::reclaim_copy(block), lender},
      end_loan,
      block->device());
  // Resizable, with the device's allocator, as any storage: a resize_
  // moves it to memory of its own, which ends the loan.
  auto lent = c10::make_intrusive<c10::StorageImpl>(
      c10::StorageImpl::use_byte_size_t(), block->nbytes(), std::move(data),
      c10::GetAllocator(block->device_type()), /*resizable=*/true);
  auto tensor = at::detail::make_tensor<c10::TensorImpl>(
      c10::Storage(lent), self.key_set(), self.dtype());
  tensor.unsafeGetTensorImpl()->set_sizes_and_strides(
      self.sizes(), self.strides(), self.storage_offset());
  {
    std::lock_guard<std::mutex> lock(loans_mutex);
    loans.push_back(
        {stream, block->device().index(), epoch,
         c10::weak_intrusive_ptr<c10::StorageImpl>(lent)});
  }
  return tensor;
}

int pool_lend(const void* pool, const void* lender, const void* stream, int64_t epoch, void* dst) {
  return guarded([&] { new (dst) at::Tensor(lend(tensor_at(pool), lender, stream, epoch)); });
}

int pool_reclaim(
    int32_t device, const void* stream, int64_t epoch, PoolCopy copy, void* context) {
  return guarded([&] {
    std::lock_guard<std::mutex> lock(loans_mutex);
    size_t kept = 0;
    for (size_t i = 0; i < loans.size(); ++i) {
      LoanRecord& record = loans[i];
      if (record.stream != stream || record.device != device || record.epoch < epoch) {
        if (!record.lent.expired()) {
          if (kept != i) {
            loans[kept] = std::move(record);
          }
          ++kept;
        }
        continue;
      }
      c10::intrusive_ptr<c10::StorageImpl> lent = record.lent.lock();
      if (!lent || lent->data_ptr().get_deleter() != &end_loan) {
        // Nothing holds it (the block is its graph's alone again), or it has
        // memory of its own now (a resize_, a set_).
        continue;
      }
      // Still held: its bytes move to fresh memory, copied there (on the
      // stream, before the replay) while the loan still keeps the block.
      const size_t nbytes = lent->nbytes();
      at::Tensor fresh = at::empty(
          {static_cast<int64_t>(nbytes)},
          at::TensorOptions().dtype(at::kByte).device(lent->device()));
      c10::DataPtr memory = fresh.storage().unsafeGetStorageImpl()->set_data_ptr(
          c10::DataPtr(nullptr, lent->device()));
      if (nbytes > 0 && copy(context, memory.get(), lent->data(), nbytes) != 0) {
        throw std::runtime_error("copying it out of the pool failed");
      }
      lent->set_data_ptr_noswap(std::move(memory));  // ends the loan
    }
    loans.erase(loans.begin() + static_cast<std::ptrdiff_t>(kept), loans.end());
  });
}

const void* pool_lender(const void* slot) {
  const at::Tensor& self = tensor_at(slot);
  if (!self.has_storage()) {
    return nullptr;
  }
  const c10::DataPtr& data = self.storage().data_ptr();
  if (data.get_deleter() != &end_loan) {
    return nullptr;
  }
  return static_cast<const PoolLoan*>(data.get_context())->lender;
}

// ---- random generators' state ----

at::Generator default_generator(int32_t device_type, int32_t device_index) {
  return at::globalContext().defaultGenerator(c10::Device(
      static_cast<c10::DeviceType>(device_type),
      static_cast<c10::DeviceIndex>(device_index)));
}

int get_rng_state(int32_t device_type, int32_t device_index, void* dst) {
  return guarded([&] {
    at::Generator generator = default_generator(device_type, device_index);
    std::lock_guard<std::mutex> lock(generator.mutex());
    new (dst) at::Tensor(generator.get_state());
  });
}

int set_rng_state(int32_t device_type, int32_t device_index, const void* src) {
  return guarded([&] {
    at::Generator generator = default_generator(device_type, device_index);
    // set_state reads the bytes of a contiguous tensor (torch.cuda's
    // set_rng_state hands it a contiguous copy).
    at::Tensor state = tensor_at(src).contiguous();
    std::lock_guard<std::mutex> lock(generator.mutex());
    generator.set_state(state);
  });
}

const CppwrapApi api_table = {
    CPPWRAP_API_VERSION,
    static_cast<int32_t>(sizeof(at::Tensor)),
    last_error,
    unpack,
    wrap,
    release,
    copy,
    adopt,
    empty_strided,
    reinterpret,
    view_dtype,
    data_ptr,
    dim,
    sizes,
    strides,
    check_tensor,
    scalar_to_tensor_long,
    scalar_to_tensor_double,
    item_long,
    item_double,
    find_op,
    stack_new,
    push_none,
    push_tensor,
    push_int,
    push_double,
    push_bool,
    push_string,
    push_dtype,
    push_layout,
    push_memory_format,
    push_device,
    push_int_list,
    push_double_list,
    push_bool_list,
    push_tensor_list,
    call_boxed,
    call_boxed_below_autograd,
    result_tensor,
    record_begin,
    record_end,
    borrow,
    stack_free,
    take_exception,
    raise_exception,
    shim_error,
    scalar_to_tensor_complex,
    push_complex,
    graph_pool_try_share,
    graph_pool_unshare,
    graph_pool_take,
    graph_pool_give,
    pool_epoch,
    pool_lend,
    pool_reclaim,
    pool_lender,
    get_rng_state,
    set_rng_state,
};

}  // namespace

// The module holds the table (in a capsule that generated modules import) and
// its version.  pybind11 comes with torch's headers, included above.
PYBIND11_MODULE(_C, m) {
  m.doc() = "torch_cppwrap's runtime: the C API that generated wrapper modules call.";
  m.attr("_api") = pybind11::capsule(
      const_cast<CppwrapApi*>(&api_table), CPPWRAP_API_CAPSULE);
  m.attr("API_VERSION") = CPPWRAP_API_VERSION;
  m.def(
      "pool_lender",
      [](pybind11::handle obj) {
        if (!THPVariable_Check(obj.ptr())) {
          throw pybind11::type_error("pool_lender takes a tensor");
        }
        const at::Tensor& t = THPVariable_Unpack(obj.ptr());
        return reinterpret_cast<uintptr_t>(pool_lender(&t));
      },
      "Which CUDA graph (GraphReplay) lent `t`'s memory out of its pool; 0 "
      "where none did.");
  m.def("pool_epoch", pool_epoch, "A new capture's epoch (see pool_lend).");
  const bool drops_workspaces = &at::cuda::clearCublasWorkspacesForStream != nullptr;
  m.attr("DROPS_CUBLAS_WORKSPACES") = drops_workspaces;
  m.def(
      "drop_cublas_workspaces",
      [drops_workspaces](uintptr_t stream) {
        if (drops_workspaces) {
          at::cuda::clearCublasWorkspacesForStream(reinterpret_cast<CUstream_st*>(stream));
        }
      },
      "Drops the cuBLAS(Lt) workspaces that libtorch keeps for `stream` (a "
      "cudaStream_t) alone, leaving other streams' to the threads that use "
      "them; does nothing where DROPS_CUBLAS_WORKSPACES is False (torch "
      "before 2.12, or without CUDA).");
  m.def(
      "pool_lend",
      [](pybind11::handle obj, uintptr_t lender, uintptr_t stream, int64_t epoch) {
        if (!THPVariable_Check(obj.ptr())) {
          throw pybind11::type_error("pool_lend takes a tensor");
        }
        return pybind11::reinterpret_steal<pybind11::object>(THPVariable_Wrap(lend(
            THPVariable_Unpack(obj.ptr()), reinterpret_cast<const void*>(lender),
            reinterpret_cast<const void*>(stream), epoch)));
      },
      "`t`'s memory (a block of the CUDA graphs' pool served on `stream`) on "
      "a storage of its own, lent by `lender` (0: by no graph, a warm-up) at "
      "`epoch`: replays of graphs captured at that epoch or before move it "
      "out of the pool, while held, before they overwrite it.");
}
