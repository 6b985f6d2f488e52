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
#include <new>
#include <vector>

#include "cppwrap_cuda.h"

namespace cppwrap {
namespace cuda {

// ---- replaying the whole graph as one CUDA graph ----

// A graph whose inputs and outputs are all CUDA tensors of fixed shapes, with
// no host synchronisation or input mutation, is captured into one CUDA graph
// and replayed: one cuGraphLaunch instead of a launch per kernel.  The life
// of one:
//
//   1st call  warms up: torch_cppwrap._inductor.runtime.cuda_graphs.warm_up
//             runs the kernels (this class runs them at its `yield`) on the
//             capture stream, allocating from the memory pool the capture
//             will use, lends the outputs, and notes each input's address;
//   2nd call  captures the graph: cuda_graphs.capture sets up torch's side
//             (torch.cuda.graph, the pool, the capture stream) and this class
//             runs the kernels under it, a warm-up run and the captured one;
//             the graph is replayed, its outputs lent, and it is installed;
//   then      each call replays it if every input that kept its address on
//             the 2nd call still has it.  The others are copied into buffers
//             the graph owns.  The outputs are lent: tensors on the graph's
//             pool memory, on storages of their own (api->pool_lend).  The
//             next replay takes the memory back; an output still held then
//             moves to fresh memory first (a copy), so what a call returned
//             stays the caller's.  A training step's activations, which the
//             backward uses once and drops, are never copied: the backward
//             graph reads them where the forward lent them (it is captured
//             again to do so once it sees lent inputs).  Outputs that share
//             memory are lent once and stay views of one another; an output
//             that is (a view of) an input is returned as (that view of)
//             the caller's input.
//
// A graph that draws random numbers from the CUDA generator (dropout) is
// replayed through torch.cuda.CUDAGraph.replay, which first advances the
// generator's offset as the kernels run one by one would have; a replay then
// draws new numbers, the ones a call kernel by kernel would have drawn.  That
// needs the GIL, so such a replay holds the pool whole (see replay()).
//
// Warming up in the pool, and lending what the first two calls return, is
// what keeps a replayed graph's peak memory at reduce-overhead's: the
// capture reuses the warm-up's memory, where a first call in the caching
// allocator's default pool would have left its own intermediates cached
// beside the pool's, and no output is copied out of the pool.
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

  GraphReplay(size_t n_inputs, size_t n_outputs, bool draws_random)
      : draws_random_(draws_random),
        first_ptrs_(n_inputs, nullptr),
        inputs_(n_inputs),
        outputs_(n_outputs) {}
  GraphReplay(const GraphReplay&) = delete;
  GraphReplay& operator=(const GraphReplay&) = delete;
  // With the GIL (its module is being freed).  What a replay lent stays
  // with its holders: each loan keeps its block.
  ~GraphReplay() {
    Py_XDECREF(graph_);
  }

  State state() const {
    return static_cast<State>(state_.load(std::memory_order_acquire));
  }

  // What became of the calls since the module loaded: replayed; missed (a
  // graph was installed, but an input had moved or the call ran on another
  // stream, so it ran kernel by kernel); graphs captured again; calls whose
  // inputs a warm-up or capture declined.
  struct Stats {
    int64_t replays;
    int64_t missed;
    int64_t recaptures;
    int64_t declines;
  };
  Stats stats() const {
    return {replays_.load(), missed_.load(), recaptures_.load(), declines_.load()};
  }

  // Called with the GIL held, before the inputs are unpacked: whether this
  // call is the warm-up or the capture, which prepare() runs.
  bool should_prepare() const {
    const State now = state();
    return now == kWarmup || now == kCapture;
  }

  // Whether a call with `args` (with the GIL) is for the graph this replay
  // was warmed up for: its anchor, the first parameter (or buffer) among the
  // inputs, is where it was then.  Graphs of the same code (a model's
  // identical blocks, compiled apart) share one module, and so its replays:
  // each set of parameters gets one of its own (GraphReplays::select).
  bool fits(PyObject* args) const {
    const State now = state();
    const int anchor = anchor_.load(std::memory_order_acquire);
    if ((now != kCapture && now != kReady) || anchor < 0 || !PyList_Check(args) ||
        anchor >= PyList_GET_SIZE(args)) {
      return true;
    }
    cppwrap::Input probe;
    if (api->borrow(PyList_GET_ITEM(args, anchor), probe.slot(), "graph input") != 0) {
      PyErr_Clear();
      return true;  // left for the unpacking to report
    }
    probe.set_borrowed();
    return probe.data_ptr() == anchor_ptr_.load(std::memory_order_acquire);
  }

  // `inputs` (in replay and observe) has one entry per graph input: the
  // tensor, or nullptr for an int input (whose value the graph was captured
  // with; GraphReplays keeps one graph per value).

  // Called on every call that missed a replay and ran the kernels one by
  // one.  In the warm-up state (a first call that did not warm up: another
  // warm-up held the pool) it notes the inputs' addresses, so the next call
  // can be captured; not once a warm-up has declined a call's inputs (they
  // may be unfit again), so that a later call warms up.  Once a graph is
  // installed, two calls in a row that could not replay because the same
  // inputs had moved to the same new addresses (parameters that were
  // replaced, say) have it captured again, a few times at most.
  void observe(const Tensor* const* inputs) {
    const State seen = state();
    if (!(seen == kWarmup && declines_.load() == 0) &&
        !(seen == kReady && recaptures_ < kMaxRecaptures)) {
      return;
    }
    std::lock_guard<std::mutex> lock(mutex_);
    if (state() == kWarmup) {
      if (declines_.load() != 0) {
        return;
      }
      for (size_t i = 0; i < first_ptrs_.size(); ++i) {
        first_ptrs_[i] = inputs[i] != nullptr ? inputs[i]->data_ptr() : nullptr;
      }
      note_anchor();
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
      note_anchor();
      state_.store(kCapture, std::memory_order_release);
    }
  }

  // Runs the graph's kernels one by one on a list of inputs (the module's
  // entry point without a replay): a new reference to the outputs, or nullptr
  // with an exception set.
  using RunKernels = PyObject* (*)(PyObject* module, PyObject* args);

  // The 1st and the 2nd call, with the GIL: the warm-up, or the capture and
  // the install.  Returns the call's outputs (a new reference), Py_None (new
  // reference) when the call should run the kernels itself, or nullptr with
  // an exception set.
  PyObject* prepare(PyObject* module, PyObject* args, RunKernels run_kernels) {
    if (!api->graph_pool_take()) {
      // Another warm-up or capture holds the pool (maybe the one this call
      // runs inside): this call runs kernel by kernel, a later one prepares.
      return Py_NewRef(Py_None);
    }
    const Kernels kernels{module, run_kernels};
    PyObject* outputs = state() == kWarmup ? warm_up(args, kernels) : capture(args, kernels);
    api->graph_pool_give();
    return outputs;
  }
  // Replays the graph for one call, the GIL released.  Anything but
  // kReplayed: this call must run the kernels one by one instead.
  Outcome replay(const Tensor* const* inputs, Tensor* const* outputs) {
    if (state() != kReady) {
      return kMissed;
    }
    if (draws_random_) {
      // CUDAGraph.replay needs the GIL and lets it go while it launches.  A
      // thread that took it then may be waiting, GIL held, for the pool's
      // shares to end (graph_pool_take); so this replay takes the GIL first
      // and the pool whole, and other graphs' calls meanwhile run kernel by
      // kernel instead of waiting.
      const GilHold gil;
      if (!api->graph_pool_take()) {
        return kSkipped;
      }
      const PoolHold take(api->graph_pool_give);
      return queue(inputs, outputs);
    }
    if (!api->graph_pool_try_share()) {
      return kSkipped;
    }
    const PoolHold share(api->graph_pool_unshare);
    return queue(inputs, outputs);
  }

 private:
  // Queues one replay on the current stream: the inputs' copies, the copies
  // out of the pool of held outputs it would overwrite, the launch; then
  // lends its outputs.  The caller holds the pool (a share, or whole).
  Outcome queue(const Tensor* const* inputs, Tensor* const* outputs) {
    // Held while the copies and the launch are queued, so that two threads'
    // calls cannot interleave on the graph's buffers (the stream orders them),
    // and a new capture cannot swap the graph under this call.
    std::lock_guard<std::mutex> lock(mutex_);
    if (state() != kReady) {
      return kMissed;
    }
    bool lent_inputs_copied = false;
    for (size_t i = 0; i < inputs_.size(); ++i) {
      if (inputs[i] == nullptr) {
        continue;
      }
      if (!inputs_[i].buffer.defined()) {
        if (inputs[i]->data_ptr() != inputs_[i].captured) {
          ++missed_;
          return kMissed;
        }
      } else if (inputs_[i].scalar && !on_cuda(*inputs[i])) {
        ++missed_;
        return kMissed;  // a CPU tensor where the capture had a CUDA one
      } else if (recaptures_ < kMaxRecaptures && !lent_inputs_copied) {
        const void* lender = api->pool_lender(inputs[i]->slot());
        lent_inputs_copied = lender != nullptr && lender != this;
      }
    }
    // Makes the graph's device current (and its context, on a thread that
    // never used CUDA), as the kernel-by-kernel path does.
    DeviceGuard device_guard(device_);
    void* stream = current_stream(device_);
    if (stream != stream_) {
      ++missed_;
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
    // What this graph's last replay lent, and what graphs captured after it
    // lent, may be where it writes: what is still held moves out of the
    // pool first.
    reclaim_loans(d, s);
    if (draws_random_) {
      replay_with_generator();
    } else {
      check(d.graph_launch(exec_, s), "cuGraphLaunch");
    }
    for (Group& group : groups_) {
      lend(group.pool, group.lent);
    }
    for (size_t i = 0; i < outputs_.size(); ++i) {
      const Output& out = outputs_[i];
      const int64_t ndim = static_cast<int64_t>(out.sizes.size());
      switch (out.source) {
        case Output::kOwn:
          lend(out.pool, *outputs[i]);
          break;
        case Output::kGroup: {
          const Group& group = groups_[out.index];
          *outputs[i] = reinterpret_tensor(
              group.lent, ndim, out.sizes.data(), out.strides.data(), group.base + out.offset);
          break;
        }
        case Output::kInput:
          *outputs[i] = inputs[out.index]->clone_ref();
          break;
        case Output::kInputView: {
          const Tensor& input = *inputs[out.index];
          int64_t base = 0;
          CPPWRAP_CHECK_SHIM(nullptr, aoti_torch_get_storage_offset(input.get(), &base));
          *outputs[i] = reinterpret_tensor(input, ndim, out.sizes.data(), out.strides.data(), base + out.offset);
          break;
        }
      }
    }
    for (Group& group : groups_) {
      group.lent.reset();  // the outputs hold it now
    }
    ++replays_;
    if (lent_inputs_copied && recaptures_ < kMaxRecaptures) {
      // Inputs that another graph lent (a forward's activations, saved for
      // this backward) lie where that graph's pool keeps them, call after
      // call: a capture now reads them there instead of copying them.  (This
      // graph was captured on inputs that were not lent: its forward ran
      // kernel by kernel then, say.)
      for (size_t i = 0; i < inputs_.size(); ++i) {
        first_ptrs_[i] = inputs[i] != nullptr ? inputs[i]->data_ptr() : nullptr;
      }
      note_anchor();
      ++recaptures_;
      state_.store(kCapture, std::memory_order_release);
    }
    return kReplayed;
  }

  // Hands out `pool` (an output as captured) on a storage of its own, which
  // a later replay takes back (reclaim_loans), instead of a copy.
  void lend(const Tensor& pool, Tensor& dst) {
    if (api->pool_lend(pool.slot(), this, stream_, epoch_, dst.slot()) != 0) {
      fail_runtime("lending an output of the CUDA graph");
    }
  }

  // Takes back the loans this replay may overwrite; the copies of those still
  // held are queued on `s` before the graph.
  void reclaim_loans(const Driver& d, CUstream s) {
    struct Queue {
      const Driver& d;
      CUstream s;
    } queue{d, s};
    const PoolCopy copy = [](void* context, void* to, const void* from, size_t bytes) {
      const Queue& q = *static_cast<const Queue*>(context);
      return q.d.memcpy_dtod_async(address(to), address(const_cast<void*>(from)), bytes, q.s) ==
              kSuccess
          ? 0
          : -1;
    };
    if (api->pool_reclaim(device_, stream_, epoch_, copy, &queue) != 0) {
      fail_runtime("moving held outputs out of the CUDA graphs' pool");
    }
  }

  // Replays through torch.cuda.CUDAGraph.replay, which advances the CUDA
  // generator's offsets by what the graph draws before it launches the graph
  // on the current stream (replay_prologue).  With the GIL.
  void replay_with_generator() {
    PyObject* done = PyObject_CallMethod(graph_, "replay", nullptr);
    if (done != nullptr) {
      Py_DECREF(done);
      return;
    }
    PyObject* type = nullptr;
    PyObject* error = nullptr;
    PyObject* traceback = nullptr;
    PyErr_Fetch(&type, &error, &traceback);
    PyObject* text = error != nullptr ? PyObject_Str(error) : nullptr;
    const char* utf8 = text != nullptr ? PyUnicode_AsUTF8(text) : nullptr;
    std::string message = utf8 != nullptr ? utf8 : "unknown error";
    PyErr_Clear();
    Py_XDECREF(text);
    Py_XDECREF(type);
    Py_XDECREF(error);
    Py_XDECREF(traceback);
    throw Error("torch.cuda.CUDAGraph.replay failed for the CUDA graph: " + message);
  }

  // Takes over the graph cuda_graphs.capture made: (graph, exec, device,
  // stream, buffers, captured, input_bytes, outputs, groups, epoch).  `buffers[i]`
  // is the buffer input i is copied into, or None where the graph reads the
  // input where it was captured (`captured[i]`).  Each output is (source,
  // tensor, index, offset, bytes); see Output.  Each group is (a flat view
  // of pool memory that several outputs share, its bytes).  `epoch` is the
  // capture's (api->pool_epoch), which the capturing call's loans of the
  // outputs carry.  False, with an exception set, when it does not fit.
  bool install(PyObject* args) {
    PyObject* graph = nullptr;
    unsigned long long exec = 0;
    int device = 0;
    unsigned long long stream = 0;
    PyObject* buffers = nullptr;
    PyObject* captured = nullptr;
    PyObject* input_bytes = nullptr;
    PyObject* outputs = nullptr;
    PyObject* groups = nullptr;
    long long epoch = 0;
    if (!PyArg_ParseTuple(
            args, "OKiKO!O!O!O!O!L", &graph, &exec, &device, &stream, &PyList_Type, &buffers,
            &PyList_Type, &captured, &PyList_Type, &input_bytes, &PyList_Type, &outputs,
            &PyList_Type, &groups, &epoch)) {
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
        static_cast<size_t>(PyList_GET_SIZE(input_bytes)) != n_in ||
        static_cast<size_t>(PyList_GET_SIZE(outputs)) != n_out) {
      PyErr_SetString(PyExc_ValueError, "torch_cppwrap: CUDA graph install: wrong list sizes");
      return false;
    }
    for (size_t i = 0; i < n_in; ++i) {
      Input& in = inputs_[i];
      PyObject* buffer = PyList_GET_ITEM(buffers, static_cast<Py_ssize_t>(i));
      in.captured = PyLong_AsVoidPtr(PyList_GET_ITEM(captured, static_cast<Py_ssize_t>(i)));
      in.bytes = PyLong_AsSize_t(PyList_GET_ITEM(input_bytes, static_cast<Py_ssize_t>(i)));
      if (PyErr_Occurred()) {
        return false;
      }
      in.scalar = false;
      if (buffer != Py_None) {
        if (api->unpack(buffer, in.buffer.slot(), "graph input buffer") != 0) {
          return false;
        }
        in.scalar = api->dim(in.buffer.slot()) == 0;
      }
    }
    groups_.clear();
    groups_.resize(static_cast<size_t>(PyList_GET_SIZE(groups)));
    for (size_t i = 0; i < groups_.size(); ++i) {
      Group& group = groups_[i];
      PyObject* pool = nullptr;
      Py_ssize_t bytes = 0;  // what the group spans; a replay lends it whole
      if (!PyArg_ParseTuple(PyList_GET_ITEM(groups, static_cast<Py_ssize_t>(i)), "On", &pool, &bytes) ||
          api->unpack(pool, group.pool.slot(), "graph output group") != 0) {
        return false;
      }
      if (aoti_torch_get_storage_offset(group.pool.get(), &group.base) != AOTI_TORCH_SUCCESS) {
        PyErr_SetString(PyExc_RuntimeError, "torch_cppwrap: CUDA graph install: a group has no storage offset");
        return false;
      }
    }
    for (size_t i = 0; i < n_out; ++i) {
      Output& out = outputs_[i];
      int source = 0;
      PyObject* tensor = nullptr;
      Py_ssize_t index = 0;
      long long offset = 0;
      Py_ssize_t bytes = 0;  // what a kOwn output spans; a replay lends it whole
      Tensor probe;
      if (!PyArg_ParseTuple(
              PyList_GET_ITEM(outputs, static_cast<Py_ssize_t>(i)), "iOnLn", &source, &tensor, &index,
              &offset, &bytes) ||
          api->unpack(tensor, probe.slot(), "graph output") != 0) {
        return false;
      }
      out.offset = static_cast<int64_t>(offset);
      const bool from_input = source == Output::kInput || source == Output::kInputView;
      const bool known = (source == Output::kOwn) ||
          (source == Output::kGroup && index >= 0 && static_cast<size_t>(index) < groups_.size()) ||
          (from_input && index >= 0 && static_cast<size_t>(index) < n_in &&
           inputs_[static_cast<size_t>(index)].captured != nullptr);  // a tensor input
      if (!known) {
        PyErr_SetString(PyExc_ValueError, "torch_cppwrap: CUDA graph install: unknown output source");
        return false;
      }
      out.source = static_cast<Output::Source>(source);
      out.index = static_cast<size_t>(index);
      const int64_t ndim = api->dim(probe.slot());
      out.sizes.assign(probe.sizes(), probe.sizes() + ndim);
      out.strides.assign(probe.strides(), probe.strides() + ndim);
      if (source == Output::kOwn) {
        out.pool = std::move(probe);  // what each replay lends
      }
    }
    Py_INCREF(graph);
    graph_ = graph;  // capture() released the one this replaces
    exec_ = reinterpret_cast<CUgraphExec>(static_cast<uintptr_t>(exec));
    device_ = device;
    stream_ = reinterpret_cast<void*>(static_cast<uintptr_t>(stream));
    epoch_ = static_cast<int64_t>(epoch);
    state_.store(kReady, std::memory_order_release);
    return true;
  }

  // Gives back what a replay took of the pool (a share, or the whole),
  // however the replay ends.
  struct PoolHold {
    explicit PoolHold(void (*give_back)()) : give_back_(give_back) {}
    PoolHold(const PoolHold&) = delete;
    PoolHold& operator=(const PoolHold&) = delete;
    ~PoolHold() {
      give_back_();
    }
    void (*give_back_)();
  };

  // The module's kernels one by one, as prepare() was given them.
  struct Kernels {
    PyObject* module;
    RunKernels run;
  };

  // Holds the GIL in a block of a call that released it.
  struct GilHold {
    GilHold() : state_(PyGILState_Ensure()) {}
    GilHold(const GilHold&) = delete;
    GilHold& operator=(const GilHold&) = delete;
    ~GilHold() {
      PyGILState_Release(state_);
    }
    PyGILState_STATE state_;
  };

  // The 1st call: cuda_graphs.warm_up(args) returns (this call's outputs,
  // the inputs' addresses, the anchor's index or -1); None when the graph is
  // not to be captured; or False when not on this call's inputs (a later
  // call warms up instead).
  PyObject* warm_up(PyObject* args, const Kernels& kernels) {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      if (state() != kWarmup) {
        return Py_NewRef(Py_None);
      }
      state_.store(kCapturing, std::memory_order_release);
    }
    PyObject* result = run_steps("warm_up", Py_BuildValue("(O)", args), kernels);
    // A failed run (a bad input, say) raises as it would have, and the next
    // call warms up again.
    State next = kWarmup;
    PyObject* outputs = nullptr;
    if (result == Py_None) {
      outputs = result;
      next = kOff;
    } else if (result == Py_False) {
      Py_DECREF(result);
      outputs = Py_NewRef(Py_None);
      next = give_up() ? kOff : kWarmup;
    } else if (result != nullptr) {
      if (!PyTuple_Check(result) || PyTuple_GET_SIZE(result) != 3 ||
          !PyList_Check(PyTuple_GET_ITEM(result, 1)) ||
          static_cast<size_t>(PyList_GET_SIZE(PyTuple_GET_ITEM(result, 1))) != first_ptrs_.size()) {
        PyErr_SetString(
            PyExc_TypeError, "torch_cppwrap: CUDA graph warm-up returned no (outputs, addresses, anchor)");
      } else {
        PyObject* ptrs = PyTuple_GET_ITEM(result, 1);
        for (size_t i = 0; i < first_ptrs_.size(); ++i) {
          first_ptrs_[i] = PyLong_AsVoidPtr(PyList_GET_ITEM(ptrs, static_cast<Py_ssize_t>(i)));
        }
        const long anchor = PyLong_AsLong(PyTuple_GET_ITEM(result, 2));
        anchor_.store(
            anchor >= 0 && static_cast<size_t>(anchor) < first_ptrs_.size() ? static_cast<int>(anchor) : -1,
            std::memory_order_release);
        note_anchor();
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

  // The 2nd call: cuda_graphs.capture(args, first input addresses, whether
  // the graph draws random numbers) returns (this call's outputs, what
  // install takes), or None, or False as warm_up does.
  PyObject* capture(PyObject* args, const Kernels& kernels) {
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
      for (Group& group : groups_) {
        group.pool.reset();
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
    PyObject* result = run_steps(
        "capture",
        Py_BuildValue(
            "(ONOK)", args, ptrs, draws_random_ ? Py_True : Py_False,
            static_cast<unsigned long long>(reinterpret_cast<uintptr_t>(this))),
        kernels);
    PyObject* outputs = nullptr;
    if (result == Py_None) {
      outputs = result;
    } else if (result == Py_False) {
      Py_DECREF(result);
      outputs = Py_NewRef(Py_None);
      state_.store(give_up() ? kOff : kCapture, std::memory_order_release);
    } else if (result != nullptr) {
      // (this call's outputs, what install takes)
      if (!PyTuple_Check(result) || PyTuple_GET_SIZE(result) != 2) {
        PyErr_SetString(PyExc_TypeError, "torch_cppwrap: CUDA graph capture returned no pair");
      } else if (install(PyTuple_GET_ITEM(result, 1))) {
        outputs = Py_NewRef(PyTuple_GET_ITEM(result, 0));
      }
      Py_DECREF(result);
    }
    if (state() != kReady && state() != kCapture) {
      state_.store(kOff, std::memory_order_release);
    }
    return outputs;
  }

  // Where the anchor is (first_ptrs_ changed), for fits().  With mutex_
  // held, or the GIL in a warm-up.
  void note_anchor() {
    const int anchor = anchor_.load(std::memory_order_acquire);
    anchor_ptr_.store(anchor >= 0 ? first_ptrs_[static_cast<size_t>(anchor)] : nullptr, std::memory_order_release);
  }

  // After a warm-up or capture declined this call's inputs (a CPU tensor
  // where the graph was traced with a CUDA one, as attention's RNG state is
  // outside a capture): whether to stop trying, after a few.
  bool give_up() {
    return ++declines_ >= kMaxDeclines;
  }

  // Drives the coroutine cuda_graphs.<name>(*call_args) (call_args is a
  // new reference, or nullptr with an exception set): at each value it
  // yields (a list of inputs) the kernels run on it, and their outputs are
  // sent back; a failed run is thrown in instead.  Returns what the
  // coroutine returned, or nullptr with an exception set.
  PyObject* run_steps(const char* name, PyObject* call_args, const Kernels& kernels) {
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
      sent = kernels.run(kernels.module, yielded);
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
    size_t bytes = 0;  // from its first element to just past its last
    // 0-d: the one kind of input that may come as a CPU tensor (attention's
    // RNG state when its forward was not replayed), which a replay cannot
    // copy from; each replay looks.
    bool scalar = false;
  };
  // Where a replay's output comes from (cuda_graphs._output_sources decides).
  struct Output {
    enum Source : int {
      kOwn = 0,  // lent out of `pool`, memory the output alone uses
      kGroup = 1,  // a view of group `index`'s loan, at element `offset`
      kInputView = 2,  // a view of input `index`, `offset` elements from its data
      kInput = 3,  // input `index` itself
    };
    Source source = kOwn;
    Tensor pool;  // kOwn: the output as captured, in the graph's memory pool
    size_t index = 0;
    int64_t offset = 0;
    std::vector<int64_t> sizes;
    std::vector<int64_t> strides;
  };
  // Pool memory that several outputs share (or one that is not dense): each
  // replay lends it once, and those outputs are views of the loan.
  struct Group {
    Tensor pool;  // a flat view of the memory, in the graph's pool
    Tensor lent;  // this replay's loan of `pool`, until the outputs hold it
    int64_t base = 0;  // `pool`'s storage offset, in elements
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
  static constexpr int kMaxDeclines = 8;

  const bool draws_random_;
  std::atomic<int> state_{kWarmup};
  std::mutex mutex_;
  int misses_ = 0;
  std::atomic<int> recaptures_{0};
  std::atomic<int> declines_{0};
  std::atomic<int64_t> replays_{0};
  std::atomic<int64_t> missed_{0};
  std::vector<void*> first_ptrs_;
  // The first parameter's index among the inputs (-1: none), from the
  // warm-up, and its address then; see fits().
  std::atomic<int> anchor_{-1};
  std::atomic<void*> anchor_ptr_{nullptr};
  std::vector<Input> inputs_;
  std::vector<Output> outputs_;
  std::vector<Group> groups_;
  PyObject* graph_ = nullptr;  // the torch.cuda.CUDAGraph, which owns exec_ and the pool
  CUgraphExec exec_ = nullptr;
  int32_t device_ = 0;
  void* stream_ = nullptr;
  int64_t epoch_ = 0;  // its capture's, among all graphs' (api->pool_epoch)
};

// One graph's replays, one per set of sizes and of parameters.  A graph
// compiled for dynamic shapes is captured once for each set of values that
// its symbolic sizes take, as cudagraph trees record one graph per size, up
// to `max_graphs`; calls with sizes beyond those run kernel by kernel.  The
// sets are told apart by the sizes and strides of the inputs that have
// symbolic ones, and the values of the int inputs (`key_inputs`).  Graphs
// of the same code share a module (the code cache loads it once): each set
// of parameters it runs on is captured apart, within the same bound.  Used
// with the GIL held.
class GraphReplays {
 public:
  GraphReplays(
      size_t n_inputs,
      size_t n_outputs,
      std::initializer_list<Py_ssize_t> key_inputs,
      size_t max_graphs,
      bool draws_random)
      : n_inputs_(n_inputs),
        n_outputs_(n_outputs),
        key_inputs_(key_inputs),
        max_graphs_(max_graphs),
        draws_random_(draws_random) {
    entries_.push_back({{}, make_replay()});
  }
  GraphReplays(const GraphReplays&) = delete;
  GraphReplays& operator=(const GraphReplays&) = delete;

  // Before the inputs are unpacked: the replay for this call's sizes and
  // parameters, or nullptr (the call runs kernel by kernel; a malformed
  // argument list is left for the unpacking to report).
  GraphReplay* select(PyObject* args) {
    std::vector<int64_t>& key = scratch_;
    if (!key_inputs_.empty() && !read_key(args, key)) {
      return nullptr;
    }
    // The first entry is made before any key is known: it takes the first.
    Entry& first = entries_.front();
    if (!first.keyed) {
      first.key = key;
      first.keyed = true;
      return first.replay.get();
    }
    // Mostly the first entry of this key; another where the same code runs
    // on other parameters (see GraphReplay::fits).
    GraphReplay* same_sizes = nullptr;
    for (Entry& entry : entries_) {
      if (entry.key == key) {
        if (entry.replay->fits(args)) {
          return entry.replay.get();
        }
        if (same_sizes == nullptr) {
          same_sizes = entry.replay.get();
        }
      }
    }
    if (entries_.size() >= max_graphs_) {
      // Beyond the bound: the first of these sizes captures again once
      // the same parameters come twice in a row (GraphReplay::observe).
      return same_sizes;
    }
    entries_.push_back({key, make_replay(), true});
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

  std::unique_ptr<GraphReplay> make_replay() const {
    return std::make_unique<GraphReplay>(n_inputs_, n_outputs_, draws_random_);
  }

  const size_t n_inputs_;
  const size_t n_outputs_;
  const std::vector<Py_ssize_t> key_inputs_;
  const size_t max_graphs_;
  const bool draws_random_;
  std::vector<Entry> entries_;  // only ever grows: a selected replay stays put
  std::vector<int64_t> scratch_;
};

// A graph module's replays, in its state (made by its exec slot).
inline GraphReplays& graph_replays(PyObject* module) {
  return *static_cast<GraphReplays*>(module_state(module).device);
}

// The exec slot of a replayable graph's module: its replays are its own.
template <GraphReplays* (*make)()>
int exec_graph_module(PyObject* module) {
  ModuleState& state = module_state(module);
  try {
    state.device = make();
  } catch (const std::bad_alloc&) {
    PyErr_NoMemory();
    return -1;
  }
  state.release_device = [](void* replays) { delete static_cast<GraphReplays*>(replays); };
  return 0;
}

inline const char* graph_state_name(const GraphReplay& replay) {
  static const char* const names[] = {"warmup", "capture", "capturing", "ready", "off"};
  return names[replay.state()];
}

// The module's cuda_graph_state(): the first graph's.
inline PyObject* graph_state(PyObject* module, PyObject*) {
  return PyUnicode_FromString(graph_state_name(graph_replays(module).at(0)));
}

// The module's cuda_graph_states(): one per set of sizes.
inline PyObject* graph_states(PyObject* module, PyObject*) {
  const GraphReplays& replays = graph_replays(module);
  PyObject* states = PyList_New(static_cast<Py_ssize_t>(replays.size()));
  for (size_t i = 0; states != nullptr && i < replays.size(); ++i) {
    PyList_SET_ITEM(states, static_cast<Py_ssize_t>(i), PyUnicode_FromString(graph_state_name(replays.at(i))));
  }
  return states;
}

// The module's cuda_graph_stats(): each graph's state and GraphReplay::Stats.
inline PyObject* graph_stats(PyObject* module, PyObject*) {
  const GraphReplays& replays = graph_replays(module);
  PyObject* all = PyList_New(static_cast<Py_ssize_t>(replays.size()));
  for (size_t i = 0; all != nullptr && i < replays.size(); ++i) {
    const GraphReplay::Stats s = replays.at(i).stats();
    PyObject* one = Py_BuildValue(
        "{s:s,s:L,s:L,s:L,s:L}", "state", graph_state_name(replays.at(i)), "replays",
        static_cast<long long>(s.replays), "missed", static_cast<long long>(s.missed),
        "recaptures", static_cast<long long>(s.recaptures), "declines",
        static_cast<long long>(s.declines));
    if (one == nullptr) {
      Py_DECREF(all);
      return nullptr;
    }
    PyList_SET_ITEM(all, static_cast<Py_ssize_t>(i), one);
  }
  return all;
}

}  // namespace cuda
}  // namespace cppwrap

// The module definition of a CUDA graph that may be replayed as one CUDA
// graph: `call`, `cuda_graph_state`, `cuda_graph_states` and
// `cuda_graph_stats`.  `make_replays` makes each module's GraphReplays.
#define CPPWRAP_CUDA_DEFINE_GRAPH_MODULE(doc, make_replays)                     \
  static PyModuleDef_Slot cppwrap_module_slots[] = {                            \
      {Py_mod_exec,                                                             \
       reinterpret_cast<void*>(cppwrap::cuda::exec_graph_module<make_replays>)}, \
      {0, nullptr}};                                                            \
  CPPWRAP_DEFINE_MODULE_WITH_SLOTS(                                             \
      doc,                                                                      \
      cppwrap_module_slots,                                                     \
      {"cuda_graph_state", (PyCFunction)cppwrap::cuda::graph_state, METH_NOARGS, \
       "warmup, capture, capturing, ready (replaying) or off: the first "       \
       "graph's."},                                                             \
      {"cuda_graph_states", (PyCFunction)cppwrap::cuda::graph_states,           \
       METH_NOARGS, "The state of each graph captured, one per set of sizes."}, \
      {"cuda_graph_stats", (PyCFunction)cppwrap::cuda::graph_stats, METH_NOARGS, \
       "Each graph's state and counts of calls replayed, missed, captured "     \
       "again and declined (GraphReplay::Stats)."}, )
