// The C ABI between torch_cppwrap's runtime extension (built once per torch
// version, against the full libtorch headers) and the wrapper modules that
// Inductor generates (built per graph, against this header, Python.h and the
// AOTI C shim only).  Keeping this boundary in plain C is what lets generated
// modules compile in about a second: they never see an ATen header.
//
// A "slot" is 8 bytes of storage that holds one at::Tensor, constructed and
// destroyed only by the runtime.  Generated code owns slots through
// cppwrap::Tensor (cppwrap_runtime.h) and hands their address to the C shim as
// an AtenTensorHandle, which is an at::Tensor* by definition.
#pragma once

#include <Python.h>
#include <stdint.h>

#include <torch/csrc/inductor/aoti_torch/c/shim.h>

// Bumped whenever CppwrapApi changes, so that a graph module built against
// another table refuses to load instead of calling the wrong entry.
#define CPPWRAP_API_VERSION 11
#define CPPWRAP_API_CAPSULE "torch_cppwrap._C._api"

#ifdef __cplusplus
extern "C" {
#endif

// Queues a copy of `bytes` from `from` to `to` on the current stream; 0, or
// -1 on failure.
typedef int (*PoolCopy)(void* context, void* to, const void* from, size_t bytes);

typedef struct CppwrapApi {
  int32_t version;
  int32_t tensor_size;  // sizeof(at::Tensor); must equal sizeof(void*)

  // Message of the last failed call on this thread (never null).
  const char* (*last_error)(void);

  // --- Python boundary; the GIL must be held. ---
  // Copies the tensor held by `obj` into `slot` (a reference count bump, no
  // allocation).  Returns 0, or -1 with a Python TypeError set.
  int (*unpack)(PyObject* obj, void* slot, const char* what);
  // Moves the tensor out of `slot` into a Python tensor (a new reference);
  // the same Python object comes back if the tensor already has one.
  PyObject* (*wrap)(void* slot);

  // --- Slots; no GIL needed.  int-returning calls give 0 or -1 + last_error.
  void (*release)(void* slot);
  void (*copy)(const void* src, void* dst);
  void (*adopt)(AtenTensorHandle handle, void* dst);  // steals a shim handle
  int (*empty_strided)(
      int64_t ndim,
      const int64_t* sizes,
      const int64_t* strides,
      int32_t dtype,
      int32_t device_type,
      int32_t device_index,
      void* dst);
  int (*reinterpret)(
      const void* src,
      int64_t ndim,
      const int64_t* sizes,
      const int64_t* strides,
      int64_t storage_offset,
      void* dst);
  int (*view_dtype)(const void* src, int32_t dtype, void* dst);
  void* (*data_ptr)(const void* slot);
  int64_t (*dim)(const void* slot);
  const int64_t* (*sizes)(const void* slot);
  const int64_t* (*strides)(const void* slot);
  // Checks the device (if device_type >= 0; the index only where the tensor
  // has one), dtype (if >= 0), rank (if ndim >= 0), sizes and strides
  // (entries < 0 are not checked) of a graph input, or of an op's output
  // (assert_size_stride; an undefined one passes); the error begins with
  // `name` and says what was expected and found.
  int (*check_tensor)(
      const void* slot,
      const char* name,
      int32_t dtype,
      int32_t device_type,
      int32_t device_index,
      int64_t ndim,
      const int64_t* sizes,
      const int64_t* strides);
  int (*scalar_to_tensor_long)(int64_t value, void* dst);
  int (*scalar_to_tensor_double)(double value, void* dst);
  int (*item_long)(const void* slot, int64_t* out);
  int (*item_double)(const void* slot, double* out);

  // --- Boxed calls through the dispatcher, for ops without a C shim. ---
  // Each call site keeps its op handle in a static; find_op returns null and
  // sets last_error if the op does not exist.
  void* (*find_op)(const char* name, const char* overload);
  // An empty argument stack, owned by the caller until stack_free; null (and
  // last_error) when out of memory.
  void* (*stack_new)(void);
  void (*push_none)(void* stack);
  void (*push_tensor)(void* stack, const void* slot);
  void (*push_int)(void* stack, int64_t value);
  void (*push_double)(void* stack, double value);
  void (*push_bool)(void* stack, int32_t value);
  void (*push_string)(void* stack, const char* value);
  void (*push_dtype)(void* stack, int32_t dtype);
  void (*push_layout)(void* stack, int32_t layout);
  void (*push_memory_format)(void* stack, int32_t memory_format);
  void (*push_device)(void* stack, int32_t device_type, int32_t device_index);
  void (*push_int_list)(void* stack, const int64_t* values, int64_t n);
  void (*push_double_list)(void* stack, const double* values, int64_t n);
  void (*push_bool_list)(void* stack, const int32_t* values, int64_t n);
  // `slots` may contain nulls, which become None (for Tensor?[]).
  void (*push_tensor_list)(
      void* stack, const void* const* slots, int64_t n, int32_t optional);
  int (*call_boxed)(void* op, void* stack);
  // call_boxed with the autograd keys excluded, for ops of a graph that
  // AOTAutograd has already differentiated: an autograd kernel written in
  // Python (every functional collective has one) is skipped, so the call
  // neither takes the GIL nor runs Python.
  int (*call_boxed_below_autograd)(void* op, void* stack);
  // Results of the last call_boxed, by return position (and list position).
  int (*result_tensor)(void* stack, int64_t i, int64_t j, void* dst);

  // --- Profiler: a RecordFunction scope named after the graph. ---
  void* (*record_begin)(const char* name);
  void (*record_end)(void* guard);

  // Like unpack, but puts the tensor in `slot` without taking a reference:
  // the caller keeps `obj` alive while it uses the slot, and forgets the slot
  // instead of releasing it.  The GIL must be held.
  int (*borrow)(PyObject* obj, void* slot, const char* what);

  // Gives back a stack from stack_new, dropping what is left on it (the
  // results of its call).
  void (*stack_free)(void* stack);

  // --- The exception behind a failure, for C++ callers only: `dst` and
  // `src` are std::exception_ptr* (the same compiler builds both sides). ---
  // Moves the exception of the last failed call on this thread (null if it
  // threw none) into `dst`.
  void (*take_exception)(void* dst);
  // Sets the Python error for `src` as torch's bindings would, keeping its
  // Python type; returns 0, or -1 (nothing set) where that type would only be
  // RuntimeError.  The GIL must be held.
  int (*raise_exception)(const void* src);
  // The message the C shim recorded for its last failure on this thread
  // (empty if the exception it caught had none), or null where this torch
  // records none.
  const char* (*shim_error)(void);

  // --- Complex numbers (a Scalar argument, or a Tensor one given a
  // number): the C shim has no type for them. ---
  int (*scalar_to_tensor_complex)(double real, double imag, void* dst);
  void (*push_complex)(void* stack, double real, double imag);

  // --- The memory pool that CUDA graphs share (cuda_graphs.py); no GIL
  // needed.  Between replays a graph's scratch memory is free in the pool,
  // so an eager run in the pool (the warm-up before a capture) may be given
  // it; the two must not be queued at once.  A replay holds the pool shared
  // while it queues its work and never waits for it: 0 means an eager run
  // holds it, and the call launches kernel by kernel instead. ---
  int32_t (*graph_pool_try_share)(void);
  void (*graph_pool_unshare)(void);
  // Takes the pool for an eager run, once the replays being queued are
  // queued; 0, with nothing taken, if another eager run holds it (on this
  // thread too: a graph run inside another's warm-up).
  int32_t (*graph_pool_take)(void);
  void (*graph_pool_give)(void);

  // --- Outputs a replayed graph lends out of its pool instead of copying
  // them (cppwrap_cuda_graph.h); no GIL needed. ---
  // A new capture's epoch: later captures get greater ones.
  int64_t (*pool_epoch)(void);
  // `dst` gets `pool` (an output in the memory pool of the graphs replayed
  // on `stream`) on a storage of its own that keeps the pool block allocated
  // while anything holds it.  `lender` names the graph, `epoch` its capture.
  int (*pool_lend)(
      const void* pool, const void* lender, const void* stream, int64_t epoch, void* dst);
  // Before a graph of `epoch` replays on `stream` of `device`: takes back
  // every loan of its pool from a capture of that epoch or later, whose block
  // may be this graph's memory.  A lent storage still held moves to fresh
  // memory from the caching allocator on the current stream, after
  // `copy(context, to, from, bytes)` has queued the copy of its bytes there.
  int (*pool_reclaim)(
      int32_t device, const void* stream, int64_t epoch, PoolCopy copy, void* context);
  // The graph that lent the memory of the tensor in `slot`, or null.
  const void* (*pool_lender)(const void* slot);

  // --- The default random generator of a device (the current one where
  // `device_index` < 0), under its lock, as torch.get_rng_state() and
  // torch.set_rng_state() (torch.cuda's for CUDA) read and set it: for
  // activation checkpointing's run_and_save_rng_state and run_with_rng_state.
  // `dst` gets the state (a CPU byte tensor); `src` holds one. ---
  int (*get_rng_state)(int32_t device_type, int32_t device_index, void* dst);
  int (*set_rng_state)(int32_t device_type, int32_t device_index, const void* src);
} CppwrapApi;

#ifdef __cplusplus
}  // extern "C"
#endif
