// Replaying a CUDA wrapper module's whole graph as one CUDA graph: the state
// machine of cppwrap::cuda::GraphReplay, its replay path (one cuGraphLaunch
// and the copies around it) and the module definition of a replayable graph.
// Built on the driver entry points of cppwrap_cuda.h.
#pragma once

#include <Python.h>

#include <atomic>
#include <cstdint>
#include <initializer_list>
#include <memory>
#include <mutex>
#include <vector>

#include "cppwrap_cuda.h"

namespace cppwrap {
namespace cuda {

// ---- replaying the whole graph as one CUDA graph ----

// A graph whose inputs and outputs are all CUDA tensors of fixed shapes, with
// no host synchronisation, random numbers or input mutation, is captured into
// one CUDA graph and replayed: one cuGraphLaunch instead of a launch per
// kernel.  The life of one:
//
//   1st call  warms up: torch_cppwrap._inductor.runtime.cuda_graphs.warm_up
//             runs the kernels (this class runs them at its `yield`) on the
//             capture stream, allocating from the memory pool the capture
//             will use, and notes each input's address;
//   2nd call  captures the graph: cuda_graphs.capture sets up torch's side
//             (torch.cuda.graph, the pool, the capture stream) and this class
//             runs the kernels under it, a warm-up run and the captured one,
//             and installs the graph;
//   then      each call replays it if every input that kept its address on
//             the 2nd call still has it.  The others are copied into buffers
//             the graph owns; the outputs are copied out of the graph's pool
//             into fresh tensors, so what a call returns is the caller's.
//
// Warming up in the pool is what keeps a replayed graph's peak memory at
// reduce-overhead's: the capture reuses the warm-up's memory, where a first
// call in the caching allocator's default pool would have left its own
// intermediates cached beside the pool's.
//
// A call that cannot replay (an input moved, another stream, a warm-up
// holding the pool) runs the kernels one by one, as does every call when
// capture was declined or failed.
class GraphReplay {
 public:
  // kCapturing: a warm-up or a capture is running.
  enum State : int { kWarmup = 0, kCapture = 1, kCapturing = 2, kReady = 3, kOff = 4 };
  // What replay() did: kMissed (an input moved, another stream, or no graph
  // yet) is for observe() to see; kSkipped (a warm-up held the pool, or the
  // kernels run for a warm-up or a capture) is not.
  enum Outcome : int { kReplayed = 0, kMissed = 1, kSkipped = 2 };

  GraphReplay(size_t n_inputs, size_t n_outputs)
      : first_ptrs_(n_inputs, nullptr), inputs_(n_inputs), outputs_(n_outputs) {}
  GraphReplay(const GraphReplay&) = delete;
  GraphReplay& operator=(const GraphReplay&) = delete;

  State state() const {
    return static_cast<State>(state_.load(std::memory_order_acquire));
  }

  // Called with the GIL held, before the inputs are unpacked: whether this
  // call is the warm-up or the capture, which prepare() runs.
  bool should_prepare() const {
    const State now = state();
    return now == kWarmup || now == kCapture;
  }

  // `inputs` (in replay and observe) has one entry per graph input: the
  // tensor, or nullptr for an int input (whose value the graph was captured
  // with; GraphReplays keeps one graph per value).

  // Called on every call that missed a replay and ran the kernels one by
  // one.  In the warm-up state (a first call that did not warm up: another
  // warm-up held the pool) it notes the inputs' addresses, so the next call
  // can be captured.  Once a graph is installed, two calls in a row that
  // could not replay because the same inputs had moved to the same new
  // addresses (parameters that were replaced, say) have it captured again, a
  // few times at most.
  void observe(const Tensor* const* inputs) {
    const State seen = state();
    if (seen != kWarmup && !(seen == kReady && recaptures_ < kMaxRecaptures)) {
      return;
    }
    std::lock_guard<std::mutex> lock(mutex_);
    if (state() == kWarmup) {
      for (size_t i = 0; i < first_ptrs_.size(); ++i) {
        first_ptrs_[i] = inputs[i] != nullptr ? inputs[i]->data_ptr() : nullptr;
      }
      state_.store(kCapture, std::memory_order_release);
      return;
    }
    if (state() != kReady) {
      return;
    }
    bool same = true;
    for (size_t i = 0; i < first_ptrs_.size(); ++i) {
      if (inputs[i] == nullptr) {
        continue;
      }
      void* ptr = inputs[i]->data_ptr();
      if (!inputs_[i].buffer.defined() && ptr != first_ptrs_[i]) {
        same = false;
      }
      first_ptrs_[i] = ptr;
    }
    misses_ = same ? misses_ + 1 : 1;
    if (misses_ >= 2) {
      misses_ = 0;
      ++recaptures_;
      state_.store(kCapture, std::memory_order_release);
    }
  }

  // Runs the graph's kernels one by one on a list of inputs (the module's
  // entry point without a replay): a new reference to the outputs, or nullptr
  // with an exception set.
  using RunKernels = PyObject* (*)(PyObject* args);

  // The 1st and the 2nd call, with the GIL: the warm-up, or the capture and
  // the install.  Returns the call's outputs (a new reference), Py_None (new
  // reference) when the call should run the kernels itself, or nullptr with
  // an exception set.
  PyObject* prepare(PyObject* args, RunKernels run_kernels) {
    if (!api->graph_pool_take()) {
      // Another warm-up or capture holds the pool (maybe the one this call
      // runs inside): this call runs kernel by kernel, a later one prepares.
      return Py_NewRef(Py_None);
    }
    PyObject* outputs = state() == kWarmup ? warm_up(args, run_kernels) : capture(args, run_kernels);
    api->graph_pool_give();
    return outputs;
  }
  // Replays the graph for one call, the GIL released.  Anything but
  // kReplayed: this call must run the kernels one by one instead.
  Outcome replay(const Tensor* const* inputs, Tensor* const* outputs) {
    if (state() != kReady) {
      return kMissed;
    }
    if (!api->graph_pool_try_share()) {
      return kSkipped;
    }
    const PoolShare share;
    // Held while the copies and the launch are queued, so that two threads'
    // calls cannot interleave on the graph's buffers (the stream orders them),
    // and a new capture cannot swap the graph under this call.
    std::lock_guard<std::mutex> lock(mutex_);
    if (state() != kReady) {
      return kMissed;
    }
    for (size_t i = 0; i < inputs_.size(); ++i) {
      if (inputs[i] != nullptr && !inputs_[i].buffer.defined() &&
          inputs[i]->data_ptr() != inputs_[i].captured) {
        return kMissed;
      }
    }
    // Makes the graph's device current (and its context, on a thread that
    // never used CUDA), as the kernel-by-kernel path does.
    DeviceGuard device_guard(device_);
    void* stream = current_stream(device_);
    if (stream != stream_) {
      return kMissed;
    }
    const Driver& d = driver();
    CUstream s = static_cast<CUstream>(stream);
    for (size_t i = 0; i < inputs_.size(); ++i) {
      const Input& in = inputs_[i];
      if (in.buffer.defined() && in.bytes > 0) {
        check(d.memcpy_dtod_async(
                  address(in.buffer.data_ptr()), address(inputs[i]->data_ptr()), in.bytes, s),
              "copying an input into the CUDA graph");
      }
    }
    check(d.graph_launch(exec_, s), "cuGraphLaunch");
    for (size_t i = 0; i < outputs_.size(); ++i) {
      const Output& out = outputs_[i];
      *outputs[i] = empty_strided(
          static_cast<int64_t>(out.sizes.size()), out.sizes.data(), out.strides.data(),
          out.dtype, device::kCUDA, device_);
      if (out.bytes > 0) {
        check(d.memcpy_dtod_async(
                  address(outputs[i]->data_ptr()), address(out.pool.data_ptr()), out.bytes, s),
              "copying an output out of the CUDA graph");
      }
    }
    return kReplayed;
  }

 private:
  // Takes over the graph cuda_graphs.capture made: (graph, exec, device,
  // stream, buffers, captured_ptrs, outputs, sizes).  `buffers[i]` is the
  // buffer input i is copied into, or None where the graph reads the input
  // where it was captured.  False, with an exception set, when it does not fit.
  bool install(PyObject* args) {
    PyObject* graph = nullptr;
    unsigned long long exec = 0;
    int device = 0;
    unsigned long long stream = 0;
    PyObject* buffers = nullptr;
    PyObject* captured = nullptr;
    PyObject* outputs = nullptr;
    PyObject* nbytes = nullptr;
    if (!PyArg_ParseTuple(
            args, "OKiKO!O!O!O!", &graph, &exec, &device, &stream, &PyList_Type, &buffers,
            &PyList_Type, &captured, &PyList_Type, &outputs, &PyList_Type, &nbytes)) {
      return false;
    }
    std::lock_guard<std::mutex> lock(mutex_);
    if (state() != kCapturing) {
      PyErr_SetString(PyExc_RuntimeError, "torch_cppwrap: CUDA graph installed out of turn");
      return false;
    }
    const size_t n_in = inputs_.size();
    const size_t n_out = outputs_.size();
    if (static_cast<size_t>(PyList_GET_SIZE(buffers)) != n_in ||
        static_cast<size_t>(PyList_GET_SIZE(captured)) != n_in ||
        static_cast<size_t>(PyList_GET_SIZE(outputs)) != n_out ||
        static_cast<size_t>(PyList_GET_SIZE(nbytes)) != n_in + n_out) {
      PyErr_SetString(PyExc_ValueError, "torch_cppwrap: CUDA graph install: wrong list sizes");
      return false;
    }
    for (size_t i = 0; i < n_in + n_out; ++i) {
      size_t bytes = PyLong_AsSize_t(PyList_GET_ITEM(nbytes, static_cast<Py_ssize_t>(i)));
      if (PyErr_Occurred()) {
        return false;
      }
      if (i < n_in) {
        inputs_[i].bytes = bytes;
      } else {
        outputs_[i - n_in].bytes = bytes;
      }
    }
    for (size_t i = 0; i < n_in; ++i) {
      PyObject* buffer = PyList_GET_ITEM(buffers, static_cast<Py_ssize_t>(i));
      inputs_[i].captured = PyLong_AsVoidPtr(PyList_GET_ITEM(captured, static_cast<Py_ssize_t>(i)));
      if (PyErr_Occurred()) {
        return false;
      }
      if (buffer != Py_None && api->unpack(buffer, inputs_[i].buffer.slot(), "graph input buffer") != 0) {
        return false;
      }
    }
    for (size_t i = 0; i < n_out; ++i) {
      Output& out = outputs_[i];
      if (api->unpack(PyList_GET_ITEM(outputs, static_cast<Py_ssize_t>(i)), out.pool.slot(), "graph output") != 0) {
        return false;
      }
      const int64_t ndim = api->dim(out.pool.slot());
      out.sizes.assign(out.pool.sizes(), out.pool.sizes() + ndim);
      out.strides.assign(out.pool.strides(), out.pool.strides() + ndim);
      if (aoti_torch_get_dtype(out.pool.get(), &out.dtype) != AOTI_TORCH_SUCCESS) {
        PyErr_SetString(PyExc_RuntimeError, "torch_cppwrap: CUDA graph install: no dtype");
        return false;
      }
    }
    Py_INCREF(graph);
    graph_ = graph;  // capture() released the one this replaces
    exec_ = reinterpret_cast<CUgraphExec>(static_cast<uintptr_t>(exec));
    device_ = device;
    stream_ = reinterpret_cast<void*>(static_cast<uintptr_t>(stream));
    state_.store(kReady, std::memory_order_release);
    return true;
  }

  // Releases the pool's share a replay took, however the replay ends.
  struct PoolShare {
    PoolShare() = default;
    PoolShare(const PoolShare&) = delete;
    PoolShare& operator=(const PoolShare&) = delete;
    ~PoolShare() {
      api->graph_pool_unshare();
    }
  };

  // The 1st call: cuda_graphs.warm_up(args) returns (this call's outputs,
  // the inputs' addresses), or None when the graph is not to be captured.
  PyObject* warm_up(PyObject* args, RunKernels run_kernels) {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      if (state() != kWarmup) {
        return Py_NewRef(Py_None);
      }
      state_.store(kCapturing, std::memory_order_release);
    }
    PyObject* result = run_steps("warm_up", Py_BuildValue("(O)", args), run_kernels);
    // A failed run (a bad input, say) raises as it would have, and the next
    // call warms up again.
    State next = kWarmup;
    PyObject* outputs = nullptr;
    if (result == Py_None) {
      outputs = result;
      next = kOff;
    } else if (result != nullptr) {
      if (!PyTuple_Check(result) || PyTuple_GET_SIZE(result) != 2 ||
          !PyList_Check(PyTuple_GET_ITEM(result, 1)) ||
          static_cast<size_t>(PyList_GET_SIZE(PyTuple_GET_ITEM(result, 1))) != first_ptrs_.size()) {
        PyErr_SetString(PyExc_TypeError, "torch_cppwrap: CUDA graph warm-up returned no (outputs, addresses)");
      } else {
        PyObject* ptrs = PyTuple_GET_ITEM(result, 1);
        for (size_t i = 0; i < first_ptrs_.size(); ++i) {
          first_ptrs_[i] = PyLong_AsVoidPtr(PyList_GET_ITEM(ptrs, static_cast<Py_ssize_t>(i)));
        }
        if (!PyErr_Occurred()) {
          outputs = Py_NewRef(PyTuple_GET_ITEM(result, 0));
          next = kCapture;
        }
      }
      Py_DECREF(result);
    }
    state_.store(next, std::memory_order_release);
    return outputs;
  }

  // The 2nd call: cuda_graphs.capture(args, first input addresses) returns
  // (this call's outputs, what install takes), or None.
  PyObject* capture(PyObject* args, RunKernels run_kernels) {
    PyObject* replaced = nullptr;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      if (state() != kCapture) {
        return Py_NewRef(Py_None);
      }
      state_.store(kCapturing, std::memory_order_release);
      // On a recapture the old graph goes first: what it holds in the
      // stream's memory pool is freed for the new capture instead of being
      // held beside it (twice the memory at the peak).  No replay can start
      // now that the state is not kReady.
      for (Input& in : inputs_) {
        in.buffer.reset();
      }
      for (Output& out : outputs_) {
        out.pool.reset();
      }
      replaced = std::exchange(graph_, nullptr);
      exec_ = nullptr;
    }
    Py_XDECREF(replaced);
    PyObject* ptrs = PyList_New(static_cast<Py_ssize_t>(first_ptrs_.size()));
    if (ptrs == nullptr) {
      state_.store(kOff, std::memory_order_release);
      return nullptr;
    }
    for (size_t i = 0; i < first_ptrs_.size(); ++i) {
      PyList_SET_ITEM(ptrs, static_cast<Py_ssize_t>(i), PyLong_FromVoidPtr(first_ptrs_[i]));
    }
    PyObject* result = run_steps("capture", Py_BuildValue("(ON)", args, ptrs), run_kernels);
    PyObject* outputs = nullptr;
    if (result == Py_None) {
      outputs = result;
    } else if (result != nullptr) {
      // (this call's outputs, what install takes)
      if (!PyTuple_Check(result) || PyTuple_GET_SIZE(result) != 2) {
        PyErr_SetString(PyExc_TypeError, "torch_cppwrap: CUDA graph capture returned no pair");
      } else if (install(PyTuple_GET_ITEM(result, 1))) {
        outputs = Py_NewRef(PyTuple_GET_ITEM(result, 0));
      }
      Py_DECREF(result);
    }
    if (state() != kReady) {
      state_.store(kOff, std::memory_order_release);
    }
    return outputs;
  }

  // Drives the coroutine cuda_graphs.<name>(*call_args) (call_args is a
  // new reference, or nullptr with an exception set): at each value it
  // yields (a list of inputs) the kernels run on it, and their outputs are
  // sent back; a failed run is thrown in instead.  Returns what the
  // coroutine returned, or nullptr with an exception set.
  PyObject* run_steps(const char* name, PyObject* call_args, RunKernels run_kernels) {
    if (call_args == nullptr) {
      return nullptr;
    }
    PyObject* helper = PyImport_ImportModule("torch_cppwrap._inductor.runtime.cuda_graphs");
    PyObject* steps = nullptr;
    if (helper != nullptr) {
      PyObject* coroutine = PyObject_GetAttrString(helper, name);
      if (coroutine != nullptr) {
        steps = PyObject_Call(coroutine, call_args, nullptr);
        Py_DECREF(coroutine);
      }
      Py_DECREF(helper);
    }
    Py_DECREF(call_args);
    if (steps == nullptr) {
      return nullptr;
    }
    PyObject* sent = Py_NewRef(Py_None);
    PyObject* result = nullptr;
    for (;;) {
      PyObject* yielded = nullptr;
      const PySendResult status = PyIter_Send(steps, sent, &yielded);
      Py_DECREF(sent);
      if (status != PYGEN_NEXT) {
        result = yielded;  // the return value, or nullptr on an exception
        break;
      }
      sent = run_kernels(yielded);
      Py_DECREF(yielded);
      if (sent == nullptr) {
        PyObject* type = nullptr;
        PyObject* error = nullptr;
        PyObject* traceback = nullptr;
        PyErr_Fetch(&type, &error, &traceback);
        PyErr_NormalizeException(&type, &error, &traceback);
        if (traceback != nullptr) {
          PyException_SetTraceback(error, traceback);
        }
        PyObject* next = PyObject_CallMethod(steps, "throw", "O", error);
        Py_XDECREF(type);
        Py_XDECREF(error);
        Py_XDECREF(traceback);
        if (next != nullptr) {  // it would go on after a failed run
          Py_DECREF(next);
          PyErr_SetString(PyExc_RuntimeError, "torch_cppwrap: CUDA graph capture outlived a failed run");
        } else if (PyErr_ExceptionMatches(PyExc_StopIteration)) {
          PyErr_Clear();  // it gave up, as it does on any error
          result = Py_NewRef(Py_None);
        }
        break;
      }
    }
    Py_DECREF(steps);
    return result;
  }

  struct Input {
    Tensor buffer;  // defined: the input is copied here before each replay
    void* captured = nullptr;
    size_t bytes = 0;
  };
  struct Output {
    Tensor pool;  // the output as captured, in the graph's memory pool
    std::vector<int64_t> sizes;
    std::vector<int64_t> strides;
    int32_t dtype = 0;
    size_t bytes = 0;
  };

  static CUdeviceptr address(void* ptr) {
    return static_cast<CUdeviceptr>(reinterpret_cast<uintptr_t>(ptr));
  }

  static void check(CUresult status, const char* what) {
    if (status != kSuccess) {
      fail_driver(status, what, "the CUDA graph");
    }
  }

  static constexpr int kMaxRecaptures = 4;

  std::atomic<int> state_{kWarmup};
  std::mutex mutex_;
  int misses_ = 0;
  int recaptures_ = 0;
  std::vector<void*> first_ptrs_;
  std::vector<Input> inputs_;
  std::vector<Output> outputs_;
  PyObject* graph_ = nullptr;  // the torch.cuda.CUDAGraph, which owns exec_ and the pool
  CUgraphExec exec_ = nullptr;
  int32_t device_ = 0;
  void* stream_ = nullptr;
};

// One graph's replays, one per set of sizes.  A graph compiled for dynamic
// shapes is captured once for each set of values that its symbolic sizes
// take, as cudagraph trees record one graph per size, up to `max_graphs`;
// calls with sizes beyond those run kernel by kernel.  The sets are told
// apart by the sizes and strides of the inputs that have symbolic ones, and
// the values of the int inputs (`key_inputs`).  A graph of fixed shapes has
// no key inputs and one replay.  Used with the GIL held.
class GraphReplays {
 public:
  GraphReplays(
      size_t n_inputs,
      size_t n_outputs,
      std::initializer_list<Py_ssize_t> key_inputs,
      size_t max_graphs)
      : n_inputs_(n_inputs), n_outputs_(n_outputs), key_inputs_(key_inputs), max_graphs_(max_graphs) {
    entries_.push_back({{}, std::make_unique<GraphReplay>(n_inputs, n_outputs)});
  }
  GraphReplays(const GraphReplays&) = delete;
  GraphReplays& operator=(const GraphReplays&) = delete;

  // Before the inputs are unpacked: the replay for this call's sizes, or
  // nullptr (the call runs kernel by kernel; a malformed argument list is
  // left for the unpacking to report).
  GraphReplay* select(PyObject* args) {
    if (key_inputs_.empty()) {
      return entries_.front().replay.get();
    }
    std::vector<int64_t>& key = scratch_;
    if (!read_key(args, key)) {
      return nullptr;
    }
    // The first entry is made before any key is known: it takes the first.
    Entry& first = entries_.front();
    if (!first.keyed) {
      first.key = key;
      first.keyed = true;
      return first.replay.get();
    }
    for (Entry& entry : entries_) {
      if (entry.key == key) {
        return entry.replay.get();
      }
    }
    if (entries_.size() >= max_graphs_) {
      return nullptr;
    }
    entries_.push_back({key, std::make_unique<GraphReplay>(n_inputs_, n_outputs_), true});
    return entries_.back().replay.get();
  }

  size_t size() const {
    return entries_.size();
  }
  const GraphReplay& at(size_t i) const {
    return *entries_[i].replay;
  }

 private:
  struct Entry {
    std::vector<int64_t> key;
    std::unique_ptr<GraphReplay> replay;
    bool keyed = false;
  };

  // Each key input's value (an int) or rank, sizes and strides (a tensor).
  bool read_key(PyObject* args, std::vector<int64_t>& key) const {
    key.clear();
    if (!PyList_Check(args)) {
      return false;
    }
    for (Py_ssize_t i : key_inputs_) {
      if (i >= PyList_GET_SIZE(args)) {
        return false;
      }
      PyObject* obj = PyList_GET_ITEM(args, i);
      if (PyLong_Check(obj)) {
        const long long value = PyLong_AsLongLong(obj);
        if (value == -1 && PyErr_Occurred()) {
          PyErr_Clear();
          return false;
        }
        key.push_back(value);
        continue;
      }
      Input probe;
      if (api->borrow(obj, probe.slot(), "graph input") != 0) {
        PyErr_Clear();
        return false;
      }
      probe.set_borrowed();
      const int64_t ndim = api->dim(probe.slot());
      key.push_back(ndim);
      key.insert(key.end(), probe.sizes(), probe.sizes() + ndim);
      key.insert(key.end(), probe.strides(), probe.strides() + ndim);
    }
    return true;
  }

  const size_t n_inputs_;
  const size_t n_outputs_;
  const std::vector<Py_ssize_t> key_inputs_;
  const size_t max_graphs_;
  std::vector<Entry> entries_;  // only ever grows: a selected replay stays put
  std::vector<int64_t> scratch_;
};

}  // namespace cuda
}  // namespace cppwrap

// The module definition of a CUDA graph that may be replayed as one CUDA
// graph: `call`, `cuda_graph_state` and `cuda_graph_states`.  Expects a
// `cppwrap::cuda::GraphReplays cuda_graphs` defined.
#define CPPWRAP_CUDA_DEFINE_GRAPH_MODULE(doc)                                   \
  static const char* cppwrap_graph_state_name(size_t i) {                       \
    static const char* const names[] = {                                        \
        "warmup", "capture", "capturing", "ready", "off"};                      \
    return names[cuda_graphs.at(i).state()];                                    \
  }                                                                             \
  static PyObject* cppwrap_graph_state(PyObject*, PyObject*) {                  \
    return PyUnicode_FromString(cppwrap_graph_state_name(0));                   \
  }                                                                             \
  static PyObject* cppwrap_graph_states(PyObject*, PyObject*) {                 \
    PyObject* states = PyList_New(static_cast<Py_ssize_t>(cuda_graphs.size())); \
    for (size_t i = 0; states != nullptr && i < cuda_graphs.size(); ++i) {      \
      PyList_SET_ITEM(                                                          \
          states, static_cast<Py_ssize_t>(i),                                   \
          PyUnicode_FromString(cppwrap_graph_state_name(i)));                   \
    }                                                                           \
    return states;                                                              \
  }                                                                             \
  CPPWRAP_DEFINE_MODULE_WITH_METHODS(                                           \
      doc,                                                                      \
      {"cuda_graph_state", (PyCFunction)cppwrap_graph_state, METH_NOARGS,       \
       "warmup, capture, capturing, ready (replaying) or off: the first "       \
       "graph's."},                                                             \
      {"cuda_graph_states", (PyCFunction)cppwrap_graph_states, METH_NOARGS,     \
       "The state of each graph captured, one per set of sizes."}, )
