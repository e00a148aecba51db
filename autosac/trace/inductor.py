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
the trace raises instead of skipping the work.
"""

from __future__ import annotations

import sys
from contextlib import ExitStack, contextmanager
from unittest import mock

import torch

__all__ = ["inductor_on_fake_tensors"]


class StubKernelCalledError(RuntimeError):
    """An inductor kernel stubbed for a fake-mode trace was called outside that trace."""


_tracing = 0  # depth of inductor_on_fake_tensors blocks now open


def _kernel_not_run(*args, **kwargs):
    """A fused kernel of a fake-mode trace: it would only write into buffers
    the wrapper allocated, so in the trace it does nothing.  Outside the trace
    it raises: skipping real work silently would be a wrong result."""
    if not _tracing:
        raise StubKernelCalledError(
            "autosac: an inductor kernel stubbed for a fake-mode trace was called outside it; "
            "call torch._dynamo.reset() and compile again"
        )


def _stub_kernel_source(self, *args, **kwargs):
    return _kernel_not_run


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
    :func:`autosac.trace.compiled_peak` does).

    Example::

        >>> with FakeTensorMode(), inductor_on_fake_tensors():
        ...     torch.compile(model)(fake_batch).sum().backward()
    """
    from torch._inductor import async_compile

    guard_funcs = torch._C._dynamo.guards  # what inductor's wrappers bind their allocation and view helpers to
    with ExitStack() as stack:
        stack.enter_context(_module_cache_apart())
        stack.enter_context(mock.patch.object(async_compile.AsyncCompile, "cpp_pybinding", _stub_kernel_source))
        stack.enter_context(mock.patch.object(async_compile.AsyncCompile, "cpp", _stub_kernel_source))
        stack.enter_context(mock.patch.object(guard_funcs, "_empty_strided_cpu", _empty_strided_cpu))
        stack.enter_context(mock.patch.object(guard_funcs, "_reinterpret_tensor", _reinterpret_tensor))
        # caches off: a cached graph would skip the code this traces or load kernels built for real
        # (one by one: force_disable_caches would also warn, and leave a fresh cache directory per trace)
        stack.enter_context(torch._inductor.config.patch(
            fx_graph_cache=False, fx_graph_remote_cache=False, autotune_local_cache=False,
            autotune_remote_cache=False, bundled_autotune_remote_cache=False,
            cpp_wrapper=False, memory_planning=False))
        stack.enter_context(torch._functorch.config.patch(enable_autograd_cache=False,
                                                          enable_remote_autograd_cache=False))
        global _tracing
        _tracing += 1
        try:
            yield
        finally:
            _tracing -= 1
