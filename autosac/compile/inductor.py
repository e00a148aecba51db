"""Inductor's compiled step, run on fake tensors.

Inductor turns each graph into a Python wrapper that allocates every buffer
(``empty_strided_cpu``), calls fused C++ kernels and library kernels that
write into those buffers, takes views (``reinterpret_tensor``), drops each
buffer with ``del`` after its last use, and returns the outputs.  The
wrapper's allocations and frees are the compiled step's memory; the fused
kernels only fill buffers the wrapper made.

:func:`inductor_on_fake_tensors` lets that wrapper run under FakeTensorMode:
its fused kernels are neither compiled nor run, its allocations and views go
through the dispatcher (so the step recorder counts them as it counts any
op), and library kernels (``extern_kernels.mm(..., out=buf)``, fallback aten
ops) run as fake ops.  Inductor compiles with its caches off, and the Python
modules it loads meanwhile are kept apart from its module cache both ways: a
module compiled for real before is not reused (its kernels cannot take fake
tensors), and one whose kernels are stubs is dropped afterwards (a real
compile of the same graph must load real kernels).  A stub called outside
the trace, or handed a real tensor to write, raises instead of skipping the
work.  The stand-ins act only in the thread that opened the block: a real
compile on another thread meanwhile gets inductor's own helpers and kernels.
Inductor's settings that would change the code traced are fixed for the
block (the C++ backend, the Python wrapper, no memory planning, in-process
compilation).
"""

from __future__ import annotations

import sys
import threading
from contextlib import ExitStack, contextmanager
from unittest import mock

import torch
from torch._subclasses.fake_tensor import FakeTensor

__all__ = ["inductor_on_fake_tensors"]


class StubKernelCalledError(RuntimeError):
    """An inductor kernel stubbed for a fake-mode trace was called outside that
    trace, or would have left a real tensor unwritten."""


_tracing_threads: dict[int, int] = {}  # thread -> depth of the inductor_on_fake_tensors blocks it is in


def _in_trace() -> bool:
    return threading.get_ident() in _tracing_threads


def _stub_kernel(argtypes: list[str]):
    """A fused kernel of a fake-mode trace: it would only write into buffers the
    wrapper allocated (its non-``const`` pointer arguments), fake in the trace,
    so it does nothing.  Called outside the trace, or with a real tensor to
    write, it raises: skipping real work silently would be a wrong result."""
    writes = [i for i, t in enumerate(argtypes) if "*" in t and not t.lstrip().startswith("const")]

    def kernel_not_run(*args):
        real = [i for i in writes if i < len(args) and isinstance(args[i], torch.Tensor)
                and not isinstance(args[i], FakeTensor)]
        if not _in_trace() or real:
            raise StubKernelCalledError(
                "autosac: an inductor kernel stubbed for a fake-mode trace was called "
                + ("on a real tensor it should write" if _in_trace() else "outside it")
                + "; call torch._dynamo.reset() and compile again"
            )

    return kernel_not_run


def _per_thread(original, in_trace):
    """``in_trace`` in the tracing thread, ``original`` in any other (a real
    compile running meanwhile on another thread gets real kernels)."""

    def call(*args, **kwargs):
        return (in_trace if _in_trace() else original)(*args, **kwargs)

    return call


def _stubbed_cpp_pybinding(self, argtypes, source_code):
    return _stub_kernel(argtypes)


def _empty_strided_cpu(size, stride, dtype):
    return torch.empty_strided(size, stride, dtype=dtype, device="cpu")


def _reinterpret_tensor(tensor, size, stride, offset_increment):
    """Inductor's view of a buffer: ``offset_increment`` counts from the buffer's own offset."""
    return torch.as_strided(tensor, size, stride, tensor.storage_offset() + offset_increment)


@contextmanager
def _module_cache_apart():
    """Inductor's loaded wrapper modules: none reused inside, none left after."""
    from torch._inductor.codecache import PyCodeCache

    saved_no_attr, saved_modules = PyCodeCache.modules_no_attr, PyCodeCache.modules
    saved_linemaps = dict(PyCodeCache.linemaps)
    saved_sys = dict(sys.modules)
    PyCodeCache.modules_no_attr, PyCodeCache.modules = {}, []
    try:
        yield
    finally:
        loaded = {id(m) for m in PyCodeCache.modules} | {id(m) for m in PyCodeCache.modules_no_attr.values()}
        PyCodeCache.modules_no_attr, PyCodeCache.modules = saved_no_attr, saved_modules
        PyCodeCache.linemaps.clear()
        PyCodeCache.linemaps.update(saved_linemaps)
        for name, mod in list(sys.modules.items()):
            if id(mod) in loaded:
                if name in saved_sys:
                    sys.modules[name] = saved_sys[name]
                else:
                    del sys.modules[name]


@contextmanager
def inductor_on_fake_tensors():
    """Within the block, ``torch.compile(..., backend="inductor")`` compiles
    without building its C++ kernels, and the compiled code runs on fake
    tensors: each allocation, view and library kernel of inductor's wrapper
    runs through the dispatcher; fused kernels are skipped.

    Nothing compiled within the block is usable outside it: call it only to
    trace, with Dynamo's cache entries dropped afterwards (as
    :func:`autosac.compile.compiled_peak` does).

    Example::

        >>> with FakeTensorMode(), inductor_on_fake_tensors():
        ...     torch.compile(model)(fake_batch).sum().backward()
    """
    from torch._inductor import async_compile, compile_fx

    guard_funcs = torch._C._dynamo.guards  # what inductor's wrappers bind their allocation and view helpers to
    compiler = async_compile.AsyncCompile
    with ExitStack() as stack:
        stack.enter_context(_module_cache_apart())
        for owner, name, in_trace in (
            (compiler, "cpp_pybinding", _stubbed_cpp_pybinding),  # the fused C++ kernels a Python wrapper loads
            (guard_funcs, "_empty_strided_cpu", _empty_strided_cpu),
            (guard_funcs, "_reinterpret_tensor", _reinterpret_tensor),
        ):
            stack.enter_context(mock.patch.object(owner, name, _per_thread(getattr(owner, name), in_trace)))
        # caches off: a cached graph would skip the code this traces or load kernels built for real
        # (one by one: force_disable_caches would also warn, and leave a fresh cache directory per trace)
        stack.enter_context(torch._inductor.config.patch(
            fx_graph_cache=False, fx_graph_remote_cache=False, autotune_local_cache=False,
            autotune_remote_cache=False, bundled_autotune_remote_cache=False,
            # the Python wrapper over C++ kernels, compiled in this process, with inductor's default buffers
            cpu_backend="cpp", cpp_wrapper=False, memory_planning=False))
        stack.enter_context(torch._functorch.config.patch(enable_autograd_cache=False,
                                                          enable_remote_autograd_cache=False))
        stack.enter_context(torch._dynamo.config.patch(caching_precompile=False))
        for name, value in (("fx_compile_mode", compile_fx.FxCompileMode.NORMAL), ("fx_compile_async", False),
                            ("fx_compile_progressive", False)):
            stack.enter_context(mock.patch.object(compile_fx, name, value))
        me = threading.get_ident()
        _tracing_threads[me] = _tracing_threads.get(me, 0) + 1
        try:
            yield
        finally:
            _tracing_threads[me] -= 1
            if not _tracing_threads[me]:
                del _tracing_threads[me]
