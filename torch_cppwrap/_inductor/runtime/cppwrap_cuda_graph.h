// Replaying a CUDA wrapper module's whole graph as one CUDA graph: the state
// machine of cppwrap::cuda::GraphReplay, its replay path (one cuGraphLaunch
// and the copies around it) and the module definition of a replayable graph.
// Built on the driver entry points of cppwrap_cuda.h.
#pragma once

#include <Python.h>

#include <atomic>
#include <cstdint>
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
//   1st call  runs the kernels one by one and notes each input's address;
//   2nd call  captures the graph: torch_cppwrap._inductor.runtime.cuda_graphs
//             .capture sets up torch's side (torch.cuda.graph: the stream's
//             memory pool, a side stream) and this class runs the kernels
//             under it, a warm-up run and the captured one, and installs the
//             graph;
//   then      each call replays it if every input that kept its address on
//             the 2nd call still has it.  The others are copied into buffers
//             the graph owns; the outputs are copied out of the graph's pool
//             into fresh tensors, so what a call returns is the caller's.
//
// A call that cannot replay (an input moved, another stream) runs the kernels
// one by one, as does every call when capture was declined or failed.
class GraphReplay {
 public:
  enum State : int { kWarmup = 0, kCapture = 1, kCapturing = 2, kReady = 3, kOff = 4 };

  GraphReplay(size_t n_inputs, size_t n_outputs)
      : first_ptrs_(n_inputs, nullptr), inputs_(n_inputs), outputs_(n_outputs) {}
  GraphReplay(const GraphReplay&) = delete;
  GraphReplay& operator=(const GraphReplay&) = delete;

  State state() const {
    return static_cast<State>(state_.load(std::memory_order_acquire));
  }

  // Called with the GIL held, before the inputs are unpacked.
  bool should_capture() const {
    return state() == kCapture;
  }

  // Called on every call that ran the kernels one by one.  The first such
  // call notes the inputs' addresses, so the next call can be captured.  Once
  // a graph is installed, two calls in a row that could not replay because
  // the same inputs had moved to the same new addresses (parameters that
  // were replaced, say) have it captured again, a few times at most.
  void observe(const Tensor* const* inputs) {
    const State seen = state();
    if (seen != kWarmup && !(seen == kReady && recaptures_ < kMaxRecaptures)) {
      return;
    }
    std::lock_guard<std::mutex> lock(mutex_);
    if (state() == kWarmup) {
      for (size_t i = 0; i < first_ptrs_.size(); ++i) {
        first_ptrs_[i] = inputs[i]->data_ptr();
      }
      state_.store(kCapture, std::memory_order_release);
      return;
    }
    if (state() != kReady) {
      return;
    }
    bool same = true;
    for (size_t i = 0; i < first_ptrs_.size(); ++i) {
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

  // The 2nd call, with the GIL: captures the graph and installs it.  Returns
  // the call's outputs (a new reference), Py_None (new reference) when the
  // graph was not captured and the call should run the kernels itself, or
  // nullptr with an exception set.
  PyObject* capture(PyObject* args, RunKernels run_kernels) {
    PyObject* replaced = nullptr;
    {
      std::lock_guard<std::mutex> lock(mutex_);
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
    PyObject* result = run_capture(args, run_kernels);
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

  // Replays the graph for one call, the GIL released.  False when this call
  // must run the kernels one by one instead.
  bool replay(const Tensor* const* inputs, Tensor* const* outputs) {
    if (state() != kReady) {
      return false;
    }
    // Held while the copies and the launch are queued, so that two threads'
    // calls cannot interleave on the graph's buffers (the stream orders them),
    // and a new capture cannot swap the graph under this call.
    std::lock_guard<std::mutex> lock(mutex_);
    if (state() != kReady) {
      return false;
    }
    for (size_t i = 0; i < inputs_.size(); ++i) {
      if (!inputs_[i].buffer.defined() && inputs[i]->data_ptr() != inputs_[i].captured) {
        return false;
      }
    }
    // Makes the graph's device current (and its context, on a thread that
    // never used CUDA), as the kernel-by-kernel path does.
    DeviceGuard device_guard(device_);
    void* stream = current_stream(device_);
    if (stream != stream_) {
      return false;
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
    return true;
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

  // Drives the coroutine cuda_graphs.capture(args, first input addresses):
  // at each value it yields (a list of inputs) the kernels run on it, and
  // their outputs are sent back; a failed run is thrown in instead.  Returns
  // what the coroutine returned, or nullptr with an exception set.
  PyObject* run_capture(PyObject* args, RunKernels run_kernels) {
    PyObject* ptrs = PyList_New(static_cast<Py_ssize_t>(first_ptrs_.size()));
    if (ptrs == nullptr) {
      return nullptr;
    }
    for (size_t i = 0; i < first_ptrs_.size(); ++i) {
      PyList_SET_ITEM(ptrs, static_cast<Py_ssize_t>(i), PyLong_FromVoidPtr(first_ptrs_[i]));
    }
    PyObject* helper = PyImport_ImportModule("torch_cppwrap._inductor.runtime.cuda_graphs");
    PyObject* steps = nullptr;
    if (helper != nullptr) {
      steps = PyObject_CallMethod(helper, "capture", "OO", args, ptrs);
      Py_DECREF(helper);
    }
    Py_DECREF(ptrs);
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

}  // namespace cuda
}  // namespace cppwrap

// The module definition of a CUDA graph that may be replayed as one CUDA
// graph: `call` and `cuda_graph_state`.  Expects a
// `cppwrap::cuda::GraphReplay cuda_graph` defined.
#define CPPWRAP_CUDA_DEFINE_GRAPH_MODULE(doc)                                   \
  static PyObject* cppwrap_graph_state(PyObject*, PyObject*) {                  \
    static const char* const names[] = {                                        \
        "warmup", "capture", "capturing", "ready", "off"};                      \
    return PyUnicode_FromString(names[cuda_graph.state()]);                     \
  }                                                                             \
  CPPWRAP_DEFINE_MODULE_WITH_METHODS(                                           \
      doc,                                                                      \
      {"cuda_graph_state", (PyCFunction)cppwrap_graph_state, METH_NOARGS,       \
       "warmup, capture, capturing, ready (replaying) or off."}, )
