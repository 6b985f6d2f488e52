"""OpInfo conformance sweep: PyTorch's OpInfo database through torch.compile
with cpp_wrapper=True, compiled output compared with eager.

    python benchmarks/opinfo_sweep.py --compare --jobs 2 --out sweep.json
    python benchmarks/opinfo_sweep.py --wrapper ours --ops abs,add,max --samples 3
    python benchmarks/opinfo_sweep.py --compare --start 0 --stop 150 --out s.json

For every entry of ``torch.testing._internal.common_methods_invocations.op_db``
(CPU, float32, or the op's first supported dtype when float32 is not one) the
first ``--samples`` sample inputs are run eagerly and through
``torch.compile(fullgraph=False)`` with ``cpp_wrapper=True`` and the FX graph
cache off (``torch._dynamo.reset()`` before each sample), and the results, and
inputs mutated in place, are compared with ``torch.testing.assert_close``.
Ops with random or uninitialised output (``empty*``, ``rand*``, ``normal``,
``bernoulli``, dropout, ... and any op whose eager output differs between two
runs on the same inputs) are compared by structure, shape and dtype only.

``--wrapper ours`` imports torch_cppwrap in the worker, ``--wrapper upstream``
never imports it (Inductor's own C++ wrapper); ``--compare`` runs both.  Ops
run in worker subprocesses, one op at a time, so that a segfault or an abort
is recorded as ``crash`` for that op, and an op that runs past ``--timeout`` as
``timeout``; the worker is then restarted and the sweep goes on.

Each op is classified as

    pass      compiled output matches eager on every sample run
    mismatch  compiled output differs from eager (first differing sample)
    error     compiling or running raised (exception type and first line kept)
    crash     the worker process died (signal or exit code kept)
    timeout   the op ran past --timeout seconds
    skip      no sample input, no dtype supported on CPU, or eager itself raised

Progress goes to stderr; the summary (a markdown table in --compare mode) to
stdout, and with --out to FILE.json (every op's record) and FILE.md.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import itertools
import json
import os
import selectors
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from typing import Any

WRAPPERS = ("ours", "upstream")
STATUSES = ("pass", "mismatch", "error", "crash", "timeout", "skip")
FAILURES = ("mismatch", "error", "crash", "timeout")

# Ops whose output is random or uninitialised memory: compared by structure,
# shape and dtype only.  Matched against the last dotted component of the op's
# name (``nn.functional.dropout`` -> ``dropout``) as a prefix.
NONDETERMINISTIC_PREFIXES = (
    "empty",
    "new_empty",
    "rand",
    "bernoulli",
    "normal",
    "uniform",
    "multinomial",
    "cauchy",
    "exponential",
    "geometric",
    "log_normal",
    "poisson",
    "dropout",
    "dropout2d",
    "dropout3d",
    "alpha_dropout",
    "feature_alpha_dropout",
    "rrelu",
    "gumbel_softmax",
    "fractional_max_pool",
    "_flash_attention_forward",
    "_efficient_attention_forward",
)

# Preference order for the dtype an op runs with.
DTYPE_ORDER = (
    "float32",
    "float64",
    "int64",
    "int32",
    "int16",
    "int8",
    "uint8",
    "bool",
    "complex64",
    "complex128",
    "bfloat16",
    "float16",
)


def op_key(op: Any) -> str:
    """``name`` or ``name.variant_test_name``, e.g. ``max.reduction_with_dim``."""
    return f"{op.name}.{op.variant_test_name}" if op.variant_test_name else op.name


def load_op_db() -> list[Any]:
    from torch.testing._internal.common_methods_invocations import op_db

    return list(op_db)


def select_ops(
    ops: list[tuple[str, str]],
    names: list[str] | None,
    start: int | None,
    stop: int | None,
) -> list[str]:
    """``ops``: (key, name) in op_db order.  Slices by --start/--stop, then
    keeps --ops: exact keys, or an op name that selects all of its variants."""
    chosen = ops[start:stop]
    if not names:
        return [key for key, _ in chosen]
    wanted = set(names)
    known = {key for key, _ in chosen} | {name for _, name in chosen}
    unknown = sorted(wanted - known)
    if unknown:
        raise SystemExit(f"opinfo_sweep: not in the selected op_db slice: {unknown}")
    return [key for key, name in chosen if key in wanted or name in wanted]


# --------------------------------------------------------------------------
# The worker: runs one op at a time, in a process of its own.
# --------------------------------------------------------------------------


def _first_line(text: str, limit: int = 300) -> str:
    for line in text.strip().splitlines():
        if line.strip():
            return line.strip()[:limit]
    return ""


def _describe_exception(exc: BaseException) -> dict[str, Any]:
    info: dict[str, Any] = {
        "error_type": type(exc).__name__,
        "error": _first_line(str(exc)),
    }
    inner = getattr(exc, "inner_exception", None) or exc.__cause__
    if inner is not None and inner is not exc:
        info["cause"] = f"{type(inner).__name__}: {_first_line(str(inner))}"
    # The innermost frame in torch_cppwrap, when the failure passed through it.
    for frame in reversed(traceback.extract_tb(exc.__traceback__)):
        if "torch_cppwrap" in frame.filename:
            info["where"] = (
                f"{frame.filename.split('torch_cppwrap', 1)[-1]}:{frame.lineno}"
            )
            break
    return info


def _is_nondeterministic(op: Any) -> bool:
    if getattr(op, "has_nondeterministic_output", False):
        return True
    if getattr(op, "skip_correctness_check_compile_vs_eager", False):
        return True
    base = op.name.rsplit(".", 1)[-1]
    return base.startswith(NONDETERMINISTIC_PREFIXES)


def _pick_dtype(op: Any) -> Any:
    import torch

    supported = op.supported_dtypes("cpu")
    if not supported:
        return None
    for name in DTYPE_ORDER:
        dtype = getattr(torch, name)
        if dtype in supported:
            return dtype
    return sorted(supported, key=str)[0]


def _clone(value: Any) -> Any:
    import torch

    if isinstance(value, torch.Tensor):
        return value.detach().clone().requires_grad_(value.requires_grad)
    if isinstance(value, (list, tuple)):
        items = [_clone(v) for v in value]
        if hasattr(value, "_fields"):  # namedtuple
            return type(value)(*items)
        try:
            return type(value)(items)
        except TypeError:
            return tuple(items)
    if isinstance(value, dict):
        return {k: _clone(v) for k, v in value.items()}
    return value


def _compare_meta(actual: Any, expected: Any) -> None:
    """Structure, shapes and dtypes only (for random/uninitialised output)."""
    import torch
    from torch.utils._pytree import tree_flatten

    a_leaves, a_spec = tree_flatten(actual)
    e_leaves, e_spec = tree_flatten(expected)
    if a_spec != e_spec:
        raise AssertionError(f"output structure differs: {a_spec} vs {e_spec}")
    for i, (a, e) in enumerate(zip(a_leaves, e_leaves, strict=True)):
        if isinstance(e, torch.Tensor):
            if not isinstance(a, torch.Tensor):
                raise AssertionError(
                    f"output {i}: {type(a).__name__}, expected a tensor"
                )
            if a.shape != e.shape or a.dtype != e.dtype:
                raise AssertionError(
                    f"output {i}: {tuple(a.shape)} {a.dtype}, "
                    f"expected {tuple(e.shape)} {e.dtype}"
                )
        elif type(a) is not type(e):
            raise AssertionError(
                f"output {i}: {type(a).__name__}, expected {type(e).__name__}"
            )


def _compare_values(actual: Any, expected: Any) -> None:
    import torch

    try:
        torch.testing.assert_close(actual, expected, equal_nan=True)
    except AssertionError:
        raise
    except Exception as exc:  # types assert_close cannot compare (str, ...)
        if type(actual) is not type(expected):
            raise AssertionError(
                f"{type(actual).__name__} returned, expected {type(expected).__name__}"
            ) from exc
        if repr(actual) != repr(expected):
            raise AssertionError(f"{actual!r} != {expected!r}") from exc


def _same(a: Any, b: Any) -> bool:
    try:
        _compare_values(a, b)
    except Exception:
        return False
    return True


def _grad_inputs(args: Any, kwargs: Any) -> list[Any]:
    import torch

    leaves = [*args, *kwargs.values()]
    flat = [v for x in leaves for v in (x if isinstance(x, (list, tuple)) else [x])]
    return [v for v in flat if isinstance(v, torch.Tensor) and v.requires_grad]


def _with_grads(fn: Any) -> Any:
    """fn's outputs, then the gradients of the sum of its floating outputs
    with respect to the inputs that require grad (None where unused)."""
    import torch

    def forward_backward(*args: Any, **kwargs: Any) -> Any:
        out = fn(*args, **kwargs)
        flat = out if isinstance(out, (list, tuple)) else [out]
        loss = [
            o.sum()
            for o in flat
            if isinstance(o, torch.Tensor) and o.requires_grad and o.is_floating_point()
        ]
        inputs = _grad_inputs(args, kwargs)
        if not loss or not inputs:
            return out, ()
        grads = torch.autograd.grad(sum(loss), inputs, allow_unused=True)
        return out, grads

    return forward_backward


def run_sample(
    op: Any, sample: Any, *, wrapper: str, dynamic: bool = False, backward: bool = False
) -> dict[str, Any]:
    """Runs one sample eagerly and compiled; returns status and details."""
    import torch
    from torch._inductor import config
    from torch._inductor.utils import run_and_get_code

    fn_op = op.op

    def fn(*args: Any, **kwargs: Any) -> Any:
        return fn_op(*args, **kwargs)

    # With --backward, the compiled forward runs and autograd runs the
    # compiled backward graph, both generated by the wrapper under test.
    compiled_fn = torch.compile(fn, fullgraph=False, dynamic=dynamic or None)
    if backward:
        fn, compiled_fn = _with_grads(fn), _with_grads(compiled_fn)

    args = (sample.input, *sample.args)
    kwargs = dict(sample.kwargs)

    # Eager, twice with different seeds: output that differs between the two
    # runs is random (or uninitialised) and compared by shape and dtype only.
    try:
        torch.manual_seed(0)
        e_args, e_kwargs = _clone(args), _clone(kwargs)
        expected = fn(*e_args, **e_kwargs)
        torch.manual_seed(1)
        again = fn(*_clone(args), **_clone(kwargs))
    except Exception as exc:
        return {"status": "skip", "note": "eager raised", **_describe_exception(exc)}
    nondet = _is_nondeterministic(op) or not _same(again, expected)

    torch._dynamo.reset()
    c_args, c_kwargs = _clone(args), _clone(kwargs)
    compiled = compiled_fn
    try:
        torch.manual_seed(0)
        with config.patch(cpp_wrapper=True, fx_graph_cache=False):
            actual, sources = run_and_get_code(compiled, *c_args, **c_kwargs)
    except Exception as exc:
        return {
            "status": "error",
            "nondeterministic": nondet,
            **_describe_exception(exc),
        }
    finally:
        torch._dynamo.reset()

    ours = sum("from torch_cppwrap._inductor.codecache import" in s for s in sources)
    record: dict[str, Any] = {
        "graphs": len(sources),
        "ours_graphs": ours,
        "nondeterministic": nondet,
    }
    if wrapper == "upstream" and ours:
        raise RuntimeError("upstream worker generated torch_cppwrap code")
    try:
        if nondet:
            _compare_meta(actual, expected)
            _compare_meta((c_args, c_kwargs), (e_args, e_kwargs))
        else:
            _compare_values(actual, expected)
            # Inputs mutated in place must match too.
            _compare_values((c_args, c_kwargs), (e_args, e_kwargs))
    except AssertionError as exc:
        lines = [ln.strip() for ln in str(exc).splitlines() if ln.strip()]
        return {
            **record,
            "status": "mismatch",
            "error_type": "AssertionError",
            "error": " | ".join(lines[:2])[:300],
        }
    return {**record, "status": "pass"}


def run_op(
    op: Any,
    *,
    samples: int,
    wrapper: str,
    dynamic: bool = False,
    backward: bool = False,
) -> dict[str, Any]:
    import torch

    start = time.perf_counter()
    dtype = _pick_dtype(op)
    record: dict[str, Any] = {"dtype": str(dtype).replace("torch.", "")}
    if dtype is None:
        return {**record, "status": "skip", "note": "no dtype supported on CPU"}
    if backward and not (op.supports_autograd and dtype.is_floating_point):
        return {**record, "status": "skip", "note": "no autograd for this op"}
    try:
        torch.manual_seed(0)
        inputs = list(
            itertools.islice(
                op.sample_inputs("cpu", dtype, requires_grad=backward), samples
            )
        )
    except Exception as exc:
        return {
            **record,
            "status": "skip",
            "note": "sample_inputs raised",
            **_describe_exception(exc),
        }
    if not inputs:
        return {**record, "status": "skip", "note": "no sample input"}

    graphs = ours = 0
    nondet = False
    result: dict[str, Any] = {"status": "skip"}
    for i, sample in enumerate(inputs):
        result = run_sample(
            op, sample, wrapper=wrapper, dynamic=dynamic, backward=backward
        )
        graphs += result.pop("graphs", 0)
        ours += result.pop("ours_graphs", 0)
        nondet |= result.pop("nondeterministic", False)
        if result["status"] in FAILURES:
            result["sample"] = i
            break
    # Samples on which eager raised are skipped; the op passes if any other did.
    record.update(result)
    record.update(
        samples=len(inputs),
        graphs=graphs,
        ours_graphs=ours,
        nondeterministic=nondet,
        seconds=round(time.perf_counter() - start, 2),
    )
    return record


def _unseeded(op: Any, *args: Any, **kwargs: Any) -> Any:
    return op(*args, **kwargs)


def _unwrap_set_seed() -> None:
    """OpInfos of random ops call ``wrapper_set_seed(op, ...)``, which reseeds
    inside ``freeze_rng_state()``: Dynamo cannot trace that and compiles no
    graph at all.  Their output is compared by shape and dtype only, so the
    worker calls the op directly instead."""
    for name, module in list(sys.modules.items()):
        if name.startswith("torch.testing._internal") and hasattr(
            module, "wrapper_set_seed"
        ):
            module.wrapper_set_seed = _unseeded


def worker_main(args: argparse.Namespace) -> int:
    """Reads op keys on stdin, writes one JSON record per op on the protocol
    pipe (the original stdout); everything else printed goes to stderr."""
    proto = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)
    sys.stdout = sys.stderr

    import torch

    torch.set_num_threads(args.threads)
    if args.wrapper == "ours":
        import torch_cppwrap

        if not torch_cppwrap.is_patched():
            raise SystemExit("torch_cppwrap did not patch Inductor")
        # Measure our wrapper, not its fallback to the Python wrapper.
        torch_cppwrap.config.strict = True
    elif "torch_cppwrap" in sys.modules:
        raise SystemExit("upstream worker: torch_cppwrap is imported")
    ops = {op_key(op): op for op in load_op_db()}
    _unwrap_set_seed()

    def send(obj: dict[str, Any]) -> None:
        proto.write(json.dumps(obj) + "\n")
        proto.flush()

    send({"event": "ready", "pid": os.getpid()})
    for line in sys.stdin:
        key = line.strip()
        if not key:
            continue
        if key == "quit":
            break
        print(f"=== {key}", file=sys.stderr, flush=True)
        try:
            record = run_op(
                ops[key],
                samples=args.samples,
                wrapper=args.wrapper,
                dynamic=args.dynamic,
                backward=args.backward,
            )
        except Exception as exc:  # a bug in this script, not in a wrapper
            record = {"status": "error", "note": "sweep", **_describe_exception(exc)}
        if args.wrapper == "upstream" and "torch_cppwrap" in sys.modules:
            raise SystemExit("upstream worker: torch_cppwrap got imported")
        send({"event": "result", "op": key, **record})
    return 0


# --------------------------------------------------------------------------
# The driver: schedules ops over worker processes, records, reports.
# --------------------------------------------------------------------------


class Slot:
    """One worker process at a time, running one op at a time."""

    def __init__(self, index: int, log_dir: str, args: argparse.Namespace) -> None:
        self.index = index
        self.args = args
        self.log_path = os.path.join(log_dir, f"worker{index}.log")
        self.proc: subprocess.Popen[bytes] | None = None
        self.wrapper: str | None = None
        self.ready = False
        self.op: str | None = None  # in flight, or waiting for the worker
        self.deadline = 0.0
        self.started = 0.0
        self.buffer = b""
        self.done = 0  # ops run by the current process
        self.log_offset = 0

    def start(self, wrapper: str) -> None:
        self.wrapper = wrapper
        env = dict(os.environ)
        env.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")
        env["OMP_NUM_THREADS"] = str(self.args.threads)
        env.pop("TORCHINDUCTOR_FX_GRAPH_CACHE", None)
        cmd = [
            sys.executable,
            os.path.abspath(__file__),
            "--worker",
            "--wrapper",
            wrapper,
            "--samples",
            str(self.args.samples),
            "--threads",
            str(self.args.threads),
            *(["--dynamic"] if self.args.dynamic else []),
            *(["--backward"] if self.args.backward else []),
        ]
        with open(self.log_path, "ab") as log:
            log.write(f"\n##### {wrapper} worker started {time.ctime()}\n".encode())
            self.proc = subprocess.Popen(
                cmd,
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=log,
                env=env,
                start_new_session=True,  # its own group: a timeout kills g++ too
                cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
            )
        self.ready = False
        self.buffer = b""
        self.done = 0
        self.deadline = time.monotonic() + self.args.startup_timeout

    def send(self, key: str) -> None:
        assert self.proc is not None and self.proc.stdin is not None
        self.op = key
        self.started = time.monotonic()
        self.deadline = self.started + self.args.timeout
        self.log_offset = os.path.getsize(self.log_path)
        self.proc.stdin.write(key.encode() + b"\n")
        self.proc.stdin.flush()

    def stop(self, kill: bool = False) -> int | None:
        proc, self.proc = self.proc, None
        self.ready = False
        if proc is None:
            return None
        if kill:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
        else:
            with contextlib.suppress(BrokenPipeError, OSError):
                assert proc.stdin is not None
                proc.stdin.write(b"quit\n")
                proc.stdin.close()
        try:
            return proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            return proc.wait()

    def log_tail(self) -> str:
        """The last meaningful line the worker wrote while on the current op."""
        try:
            with open(self.log_path, "rb") as f:
                f.seek(self.log_offset)
                text = f.read().decode(errors="replace")
        except OSError:
            return ""
        lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
        lines = [ln for ln in lines if not ln.startswith("===")]
        return lines[-1][:300] if lines else ""


def _describe_exit(rc: int | None) -> str:
    if rc is None:
        return "worker exited"
    if rc < 0:
        try:
            return f"killed by {signal.Signals(-rc).name}"
        except ValueError:
            return f"killed by signal {-rc}"
    return f"worker exited with code {rc}"


class Sweep:
    def __init__(self, args: argparse.Namespace, keys: list[str], wrappers: list[str]):
        self.args = args
        self.keys = keys
        self.wrappers = wrappers
        self.queues = {w: collections.deque(keys) for w in wrappers}
        self.results: dict[str, dict[str, Any]] = {w: {} for w in wrappers}
        self.total = len(keys) * len(wrappers)
        self.t0 = time.monotonic()
        self.startup_failures = collections.Counter[str]()

    # -- scheduling --------------------------------------------------------

    def _next_wrapper(self, slot: Slot, busy: collections.Counter[str]) -> str | None:
        if slot.wrapper and self.queues[slot.wrapper] and slot.proc is not None:
            return slot.wrapper
        remaining = [w for w in self.wrappers if self.queues[w]]
        if not remaining:
            return None
        # The wrapper with the most ops left per worker already on it.
        return max(remaining, key=lambda w: len(self.queues[w]) / (1 + busy[w]))

    def run(self) -> None:
        log_dir = tempfile.mkdtemp(prefix="opinfo_sweep_")
        print(
            f"opinfo_sweep: {len(self.keys)} ops x {', '.join(self.wrappers)}, "
            f"{self.args.jobs} job(s); worker logs in {log_dir}",
            file=sys.stderr,
        )
        slots = [Slot(i, log_dir, self.args) for i in range(self.args.jobs)]
        # Spread the first workers over the wrappers.
        for i, slot in enumerate(slots):
            slot.wrapper = self.wrappers[i % len(self.wrappers)]
        sel = selectors.DefaultSelector()
        try:
            while True:
                self._assign(slots, sel)
                active = [s for s in slots if s.proc is not None and s.op is not None]
                if not active:
                    if all(not q for q in self.queues.values()):
                        break
                    continue
                timeout = max(0.0, min(s.deadline for s in active) - time.monotonic())
                for sel_key, _ in sel.select(timeout=min(timeout, 5.0)):
                    self._read(sel_key.data, sel)
                now = time.monotonic()
                for slot in active:
                    if (
                        slot.proc is not None
                        and slot.op is not None
                        and now > slot.deadline
                    ):
                        self._timeout(slot, sel)
        finally:
            for slot in slots:
                if slot.proc is not None:
                    with contextlib.suppress(Exception):
                        sel.unregister(slot.proc.stdout)
                    slot.stop()
            self.write()

    def _assign(self, slots: list[Slot], sel: selectors.BaseSelector) -> None:
        for slot in slots:
            if slot.op is not None:
                continue
            busy = collections.Counter(s.wrapper for s in slots if s.op is not None)
            wrapper = self._next_wrapper(slot, busy)
            if wrapper is None:
                if slot.proc is not None:
                    sel.unregister(slot.proc.stdout)
                    slot.stop()
                continue
            recycle = slot.done >= self.args.ops_per_worker
            if slot.proc is not None and (wrapper != slot.wrapper or recycle):
                sel.unregister(slot.proc.stdout)
                slot.stop()
            if slot.proc is None:
                slot.start(wrapper)
                sel.register(slot.proc.stdout, selectors.EVENT_READ, slot)
            slot.op = self.queues[wrapper].popleft()
            if slot.ready:
                slot.send(slot.op)
            # else: sent once the worker says it is ready (see _read)

    def _read(self, slot: Slot, sel: selectors.BaseSelector) -> None:
        assert slot.proc is not None and slot.proc.stdout is not None
        chunk = os.read(slot.proc.stdout.fileno(), 65536)
        if not chunk:
            self._crash(slot, sel)
            return
        slot.buffer += chunk
        while b"\n" in slot.buffer:
            line, slot.buffer = slot.buffer.split(b"\n", 1)
            msg = json.loads(line)
            if msg["event"] == "ready":
                slot.ready = True
                self.startup_failures[slot.wrapper or ""] = 0
                if slot.op is not None:
                    slot.send(slot.op)
            elif msg["event"] == "result":
                key = msg.pop("op")
                del msg["event"]
                slot.op = None
                slot.done += 1
                self._record(slot.wrapper or "", key, msg)

    def _crash(self, slot: Slot, sel: selectors.BaseSelector) -> None:
        assert slot.proc is not None
        sel.unregister(slot.proc.stdout)
        was_ready = slot.ready
        rc = slot.stop(kill=True)
        key, slot.op = slot.op, None
        if not was_ready:
            wrapper = slot.wrapper or ""
            self.startup_failures[wrapper] += 1
            tail = slot.log_tail()
            if self.startup_failures[wrapper] >= 3:
                raise SystemExit(
                    f"opinfo_sweep: the {wrapper} worker failed to start 3 times "
                    f"({_describe_exit(rc)}: {tail}); see {slot.log_path}"
                )
            if key is not None:  # try the op again in a new worker
                self.queues[wrapper].appendleft(key)
            return
        if key is None:
            return
        record = {
            "status": "crash",
            "error_type": _describe_exit(rc),
            "error": slot.log_tail(),
            "seconds": round(time.monotonic() - slot.started, 2),
        }
        self._record(slot.wrapper or "", key, record)

    def _timeout(self, slot: Slot, sel: selectors.BaseSelector) -> None:
        assert slot.proc is not None
        sel.unregister(slot.proc.stdout)
        was_ready = slot.ready
        slot.stop(kill=True)
        key, slot.op = slot.op, None
        if not was_ready:
            raise SystemExit(
                f"opinfo_sweep: the {slot.wrapper} worker did not start within "
                f"{self.args.startup_timeout}s; see {slot.log_path}"
            )
        if key is not None:
            self._record(
                slot.wrapper or "",
                key,
                {
                    "status": "timeout",
                    "error_type": "Timeout",
                    "error": f"ran past {self.args.timeout}s; last log line: "
                    + slot.log_tail(),
                    "seconds": round(time.monotonic() - slot.started, 2),
                },
            )

    # -- recording and reporting --------------------------------------------

    def _record(self, wrapper: str, key: str, record: dict[str, Any]) -> None:
        self.results[wrapper][key] = record
        done = sum(len(r) for r in self.results.values())
        elapsed = time.monotonic() - self.t0
        eta = elapsed / done * (self.total - done)
        detail = ""
        if record["status"] in FAILURES:
            detail = f"  {record.get('error_type', '')}: {record.get('error', '')}"[
                :110
            ]
        print(
            f"[{done:4d}/{self.total}] {wrapper:8s} {key:40s} "
            f"{record['status']:8s} {record.get('seconds', 0):6.1f}s  "
            f"eta {eta / 60:5.1f}m{detail}",
            file=sys.stderr,
            flush=True,
        )
        if self.args.out and done % 10 == 0:
            self.write()

    def meta(self) -> dict[str, Any]:
        import torch

        return {
            "torch": torch.__version__,
            "python": sys.version.split()[0],
            "wrappers": self.wrappers,
            "ops": len(self.keys),
            "start": self.args.start,
            "stop": self.args.stop,
            "selected": self.args.ops,
            "samples": self.args.samples,
            "step": self.args.step,
            "dynamic": self.args.dynamic,
            "backward": self.args.backward,
            "jobs": self.args.jobs,
            "threads": self.args.threads,
            "timeout_s": self.args.timeout,
            "wall_s": round(time.monotonic() - self.t0, 1),
            "date": time.strftime("%Y-%m-%d %H:%M:%S"),
            "git": _git_describe(),
        }

    def write(self) -> None:
        if not self.args.out:
            return
        data = {
            "meta": self.meta(),
            "counts": {w: counts(self.results[w]) for w in self.wrappers},
            "results": {
                w: {k: self.results[w][k] for k in self.keys if k in self.results[w]}
                for w in self.wrappers
            },
        }
        tmp = self.args.out + ".tmp"
        with open(tmp, "w") as f:
            json.dump(data, f, indent=1)
        os.replace(tmp, self.args.out)


def _git_describe() -> str | None:
    """The commit the workers imported torch_cppwrap from (``-dirty`` when
    the working tree had changes when the sweep ended)."""
    try:
        return (
            subprocess.run(
                ["git", "describe", "--always", "--dirty"],
                cwd=os.path.dirname(os.path.abspath(__file__)),
                capture_output=True,
                text=True,
                timeout=30,
            ).stdout.strip()
            or None
        )
    except (OSError, subprocess.SubprocessError):
        return None


def counts(results: dict[str, dict[str, Any]]) -> dict[str, int]:
    c = collections.Counter(r["status"] for r in results.values())
    return {s: c.get(s, 0) for s in STATUSES}


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("`", "'")


def _error_text(record: dict[str, Any]) -> str:
    text = f"{record.get('error_type', '')}: {record.get('error', '')}".strip(": ")
    if record.get("cause") and record.get("cause") not in text:
        text += f" (cause: {record['cause']})"
    if record.get("where"):
        text += f" [at torch_cppwrap{record['where']}]"
    return text


def report(
    meta: dict[str, Any], results: dict[str, dict[str, Any]], keys: list[str]
) -> str:
    wrappers = [w for w in WRAPPERS if w in results]
    span = f"op_db[{meta.get('start') or 0}:{meta.get('stop') or ''}]"
    if meta.get("selected"):
        span += " selected with --ops"
    if meta.get("step", 1) > 1:
        span += f", every {meta['step']}th"
    modes = [m for m in ("dynamic", "backward") if meta.get(m)]
    lines = [
        f"## OpInfo sweep: torch {meta['torch']}, {meta['ops']} ops ({span}), "
        f"{meta['samples']} sample(s) per op, CPU" + "".join(f", {m}" for m in modes),
        "",
        f"Wall time {meta['wall_s'] / 60:.1f} min with {meta['jobs']} job(s); "
        f"torch_cppwrap at {meta.get('git') or 'unknown commit'}.",
        "",
        "| wrapper | " + " | ".join(STATUSES) + " | total |",
        "|---|" + "---:|" * (len(STATUSES) + 1),
    ]
    for w in wrappers:
        c = counts(results[w])
        lines.append(
            f"| {w} | "
            + " | ".join(str(c[s]) for s in STATUSES)
            + f" | {len(results[w])} |"
        )
    if "ours" in results:
        no_graph = sum(
            1
            for r in results["ours"].values()
            if r["status"] == "pass" and not r.get("graphs")
        )
        lines += [
            "",
            f"{no_graph} of our passes compiled no Inductor graph (nothing to wrap).",
        ]
    if len(wrappers) == 2:
        ours, up = results["ours"], results["upstream"]
        both = [k for k in keys if k in ours and k in up]
        regressions = [
            k
            for k in both
            if up[k]["status"] == "pass" and ours[k]["status"] in FAILURES
        ]
        fixes = [
            k
            for k in both
            if ours[k]["status"] == "pass" and up[k]["status"] in FAILURES
        ]
        both_fail = [
            k
            for k in both
            if ours[k]["status"] in FAILURES and up[k]["status"] in FAILURES
        ]
        lines += ["", f"### Pass upstream, fail ours ({len(regressions)})", ""]
        if regressions:
            lines += ["| op | ours | our error |", "|---|---|---|"]
            lines += [
                f"| `{k}` | {ours[k]['status']} | {_cell(_error_text(ours[k]))} |"
                for k in regressions
            ]
        else:
            lines.append("None.")
        lines += ["", f"### Pass ours, fail upstream ({len(fixes)})", ""]
        if fixes:
            lines += ["| op | upstream | upstream error |", "|---|---|---|"]
            lines += [
                f"| `{k}` | {up[k]['status']} | {_cell(_error_text(up[k]))} |"
                for k in fixes
            ]
        else:
            lines.append("None.")
        lines += ["", f"### Fail both ({len(both_fail)})", ""]
        if both_fail:
            lines += ["| op | ours | upstream | our error |", "|---|---|---|---|"]
            lines += [
                f"| `{k}` | {ours[k]['status']} | {up[k]['status']} | "
                f"{_cell(_error_text(ours[k]))} |"
                for k in both_fail
            ]
        else:
            lines.append("None.")
    else:
        (w,) = wrappers
        failed = [
            k for k in keys if k in results[w] and results[w][k]["status"] in FAILURES
        ]
        lines += ["", f"### Failures ({len(failed)})", ""]
        if failed:
            lines += ["| op | status | error |", "|---|---|---|"]
            lines += [
                f"| `{k}` | {results[w][k]['status']} | {_cell(_error_text(results[w][k]))} |"
                for k in failed
            ]
        else:
            lines.append("None.")
    return "\n".join(lines) + "\n"


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description="Run PyTorch's OpInfo database through torch.compile with "
        "cpp_wrapper=True and compare with eager.",
    )
    g = p.add_mutually_exclusive_group()
    g.add_argument(
        "--wrapper",
        choices=WRAPPERS,
        default="ours",
        help="ours: import torch_cppwrap; upstream: Inductor's own C++ wrapper",
    )
    g.add_argument("--compare", action="store_true", help="run both wrappers")
    p.add_argument(
        "--ops", help="comma-separated op names (all variants) or name.variant keys"
    )
    p.add_argument(
        "--step", type=int, default=1, help="every STEP-th op of the slice (default 1)"
    )
    p.add_argument("--dynamic", action="store_true", help="compile with dynamic=True")
    p.add_argument(
        "--backward",
        action="store_true",
        help="inputs require grad; compare the gradients too (compiled backward)",
    )
    p.add_argument("--start", type=int, help="first index into op_db")
    p.add_argument("--stop", type=int, help="index into op_db to stop before")
    p.add_argument(
        "--samples", type=int, default=1, help="sample inputs per op (default 1)"
    )
    p.add_argument("--jobs", type=int, default=1, help="worker processes (default 1)")
    p.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch/OpenMP threads per worker (default 1)",
    )
    p.add_argument(
        "--timeout", type=float, default=300, help="seconds per op before it is killed"
    )
    p.add_argument("--startup-timeout", type=float, default=600, help=argparse.SUPPRESS)
    p.add_argument(
        "--ops-per-worker",
        type=int,
        default=100,
        help="restart a worker after this many ops (default 100)",
    )
    p.add_argument(
        "--out", help="write every op's record to this JSON file (and a .md)"
    )
    p.add_argument("--md", help="markdown report file (default: --out with .md)")
    p.add_argument(
        "--list", action="store_true", help="print the selected op keys and exit"
    )
    p.add_argument(
        "--report", metavar="JSON", help="print the report of a finished sweep"
    )
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if min(args.jobs, args.samples, args.threads, args.step) < 1:
        p.error("--jobs, --samples, --threads and --step must be at least 1")
    return args


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    if args.worker:
        return worker_main(args)
    if args.report:
        with open(args.report) as f:
            data = json.load(f)
        keys = list(dict.fromkeys(k for r in data["results"].values() for k in r))
        sys.stdout.write(report(data["meta"], data["results"], keys))
        return 0

    print("opinfo_sweep: loading op_db ...", file=sys.stderr, flush=True)
    ops = load_op_db()
    names = [n.strip() for n in args.ops.split(",") if n.strip()] if args.ops else None
    keys = select_ops(
        [(op_key(op), op.name) for op in ops], names, args.start, args.stop
    )[:: args.step]
    if args.list:
        print("\n".join(keys))
        return 0
    if not keys:
        raise SystemExit("opinfo_sweep: no op selected")
    wrappers = list(WRAPPERS) if args.compare else [args.wrapper]
    sweep = Sweep(args, keys, wrappers)
    try:
        sweep.run()
    except KeyboardInterrupt:
        print("opinfo_sweep: interrupted; reporting what finished", file=sys.stderr)
    text = report(sweep.meta(), sweep.results, keys)
    sys.stdout.write(text)
    md = args.md or (os.path.splitext(args.out)[0] + ".md" if args.out else None)
    if md:
        with open(md, "w") as f:
            f.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
