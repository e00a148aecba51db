"""The native pack_downcast op and the downcast gather: bitwise equal to casting
each tensor with PyTorch, in fake mode too, over real gloo processes."""

import json
import os
import select
import shutil
import subprocess
import sys
import textwrap
import warnings
from pathlib import Path

import pytest
import torch
from suite import gloo_group, run_ranks
from torch._subclasses.fake_tensor import FakeTensorMode

from autosac.zero3 import native, ops
from autosac.zero3.ops import GATHER

DTYPES = [torch.bfloat16, torch.float16]


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int16)


def _reference(tensors, dtype):
    return torch.cat([t.reshape(-1) for t in tensors]).to(dtype)


def _special_values() -> torch.Tensor:
    f32 = torch.float32
    ties = torch.tensor([0x3F808000, 0x3F818000, 0x3F80C000, 0x477FF000, 0x477FE000], dtype=torch.int32).view(f32)
    return torch.cat([
        torch.tensor([0.0, -0.0, 1.0, -1.5, 65504.0, 65520.0, 1e9, -1e9, 1e-40, -1e-45, 5.96e-8, 3e-8,
                      float("inf"), float("-inf"), float("nan"), -float("nan")]),
        ties,  # halfway cases: round to even
        torch.tensor([0x7F800001, 0x7FC00001, 0xFFFFFFFF - 2**32], dtype=torch.int64).to(torch.int32).view(f32),
    ])


def test_the_native_op_builds_here():
    assert native.available(), native._state["reason"]


@pytest.mark.parametrize("dtype", DTYPES)
def test_pack_downcast_is_bitwise_a_cast_of_each_tensor(dtype):
    torch.manual_seed(0)
    tensors = [_special_values(), torch.randn(1000, 37) * 1e3, torch.empty(0), torch.randn(3, 5).t(),
               torch.randn(7, 1, 2)[:, :, 1], torch.randn(()), *(torch.randn(i * 17 + 1) for i in range(100))]
    out = ops.pack_downcast(tensors, dtype)
    assert out.dtype == dtype and out.shape == (sum(t.numel() for t in tensors),)
    assert torch.equal(_bits(out), _bits(_reference(tensors, dtype)))
    assert torch.equal(_bits(ops._fallback(tensors, dtype, None)), _bits(out))  # the fallback gives the same bits


@pytest.mark.parametrize("dtype", DTYPES)
def test_pack_downcast_splits_work_across_threads_at_any_shard_boundary(dtype):
    """Ranges of the parallel loop start inside shards and run over many."""
    torch.manual_seed(1)
    sizes = [1, 70_001, 3, 0, 131_071, 65_536, 5, 200_000]
    tensors = [torch.randn(n) for n in sizes]
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        out = ops.pack_downcast(tensors, dtype)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(_bits(out), _bits(_reference(tensors, dtype)))


@pytest.mark.parametrize("dtype", DTYPES)
def test_pack_downcast_writes_into_a_given_buffer(dtype):
    torch.manual_seed(2)
    tensors = [torch.randn(300_001), _special_values(), torch.randn(17, 3).t()]
    total = sum(t.numel() for t in tensors)
    buffer = torch.full((total + 10,), 7.0, dtype=dtype)
    out = ops.pack_downcast(tensors, dtype, out=buffer[5:-5])
    assert out.data_ptr() == buffer[5:].data_ptr()
    assert torch.equal(_bits(buffer[5:-5]), _bits(_reference(tensors, dtype)))
    assert (buffer[:5] == 7).all() and (buffer[-5:] == 7).all()  # nothing written outside
    fallback = torch.empty(total, dtype=dtype)
    ops._fallback(tensors, dtype, fallback)
    assert torch.equal(_bits(fallback), _bits(out))


@pytest.mark.parametrize("out, match", [
    (torch.empty(11, dtype=torch.bfloat16), "of 10 elements"),
    (torch.empty(10, dtype=torch.float16), "bfloat16 tensor of 10"),
    (torch.empty(20, dtype=torch.bfloat16)[::2], "non-contiguous"),
    (torch.empty(2, 5, dtype=torch.bfloat16), "1-D"),
    (torch.empty(10, dtype=torch.bfloat16, device="meta"), "out is on meta"),
])
def test_a_wrong_out_buffer_is_refused_before_anything_is_written(out, match):
    before = out.clone() if not out.is_meta else None
    with pytest.raises(ValueError, match=match):
        ops.pack_downcast([torch.randn(4), torch.randn(6)], torch.bfloat16, out=out)
    if before is not None:
        assert torch.equal(_bits(out.contiguous()), _bits(before.contiguous()))


def test_pack_downcast_traces_in_fake_mode_and_on_meta():
    with FakeTensorMode():
        out = ops.pack_downcast([torch.empty(4, 5), torch.empty(3)], torch.bfloat16)
    assert out.shape == (23,) and out.dtype == torch.bfloat16
    meta = torch.ops.autosac.pack_downcast([torch.empty(8, device="meta")], torch.float16)
    assert meta.shape == (8,) and meta.dtype == torch.float16 and meta.is_meta


@pytest.mark.parametrize("bad, dtype, error, match", [
    (torch.ones(3), torch.bfloat16, TypeError, "list of tensors"),
    ([torch.ones(3), 1.0], torch.bfloat16, TypeError, "found a float"),
    ([torch.ones(3, dtype=torch.float64)], torch.bfloat16, ValueError, "must be float32"),
    ([torch.ones(3)], torch.float32, ValueError, "bfloat16 or torch.float16"),
    ([torch.ones(3), torch.ones(2, device="meta")], torch.bfloat16, ValueError, "more than one device"),
])
def test_pack_downcast_bad_input_is_one_clear_error(bad, dtype, error, match):
    with pytest.raises(error, match=match):
        ops.pack_downcast(bad, dtype)


def test_an_empty_list_packs_to_an_empty_buffer():
    empty = ops.pack_downcast([], torch.bfloat16)
    assert empty.shape == (0,) and empty.dtype == torch.bfloat16
    out = torch.empty(0, dtype=torch.float16)
    assert ops.pack_downcast([], torch.float16, out=out) is out
    with pytest.raises(ValueError, match="empty 1-D"):
        ops.pack_downcast([], torch.bfloat16, out=torch.empty(3, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="bfloat16 or torch.float16"):
        ops.pack_downcast([], torch.float32)


def test_without_a_build_the_fallback_runs_after_one_warning(monkeypatch, tmp_path):
    monkeypatch.setattr(native, "SOURCES", tmp_path)  # no sources: cannot build
    monkeypatch.setattr(native, "_state", {"loaded": False, "reason": None, "warned": False})
    tensors = [torch.randn(100), torch.randn(3, 3)]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        a = ops.pack_downcast(tensors, torch.bfloat16)
        b = ops.pack_downcast(tensors, torch.bfloat16)
    said = [str(w.message) for w in caught if "autosac" in str(w.message)]
    assert len(said) == 1 and "native sources not found" in said[0] and "PyTorch fallback" in said[0]
    assert torch.equal(_bits(a), _bits(_reference(tensors, torch.bfloat16))) and torch.equal(_bits(a), _bits(b))
    with pytest.raises(native.NativeBuildError, match="native sources not found"):
        native.build()


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc not installed")
def test_the_cuda_kernel_compiles(tmp_path):
    src = native.SOURCES / "pack_downcast_cuda.cu"
    done = subprocess.run(["nvcc", "-std=c++17", "-c", str(src), "-o", str(tmp_path / "k.o")],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]


def _gather_worker(rank, world, port):
    import torch.distributed as dist

    with gloo_group(rank, world, port):
        torch.manual_seed(rank)
        shards = [torch.randn(4, 3) * 100, torch.randn(7), torch.randn(2, 2, 2), _special_values()]
        handed = []  # bytes handed to the collective, counted at its input
        real = getattr(dist, GATHER)

        def counting(output, input, *args, **kwargs):
            handed.append(input.numel() * input.element_size())
            return real(output, input, *args, **kwargs)

        setattr(dist, GATHER, counting)
        try:
            fused = ops.allgather_downcast(shards, torch.bfloat16)
            fp32 = [torch.empty(world * s.numel()) for s in shards]
            for s, out in zip(shards, fp32):
                getattr(dist, GATHER)(out, s.reshape(-1).contiguous())
        finally:
            setattr(dist, GATHER, real)
        assert ops.allgather_downcast([], torch.bfloat16) == []  # nothing to gather: no collective
        fused_bytes, fp32_bytes = handed[0], sum(handed[1:])
        assert fused_bytes * 2 == fp32_bytes
        for s, got, ref in zip(shards, fused, fp32):
            assert got.shape == (world, *s.shape) and got.dtype == torch.bfloat16
            expect = ref.view(world, *s.shape).to(torch.bfloat16)
            assert torch.equal(got.view(torch.int16), expect.view(torch.int16))
        assert torch.equal(fused[0][rank].view(torch.int16), shards[0].to(torch.bfloat16).view(torch.int16))


@pytest.mark.parametrize("world", [2, 3])
def test_allgather_downcast_equals_gather_then_cast_with_half_the_bytes(world):
    native.available()  # build once here, not in every rank
    run_ranks(_gather_worker, world)


def test_allgather_downcast_needs_a_process_group():
    with pytest.raises(RuntimeError, match="init_process_group"):
        ops.allgather_downcast([torch.ones(3)], torch.bfloat16)


def test_build_native_from_the_cli(capsys, monkeypatch, tmp_path):
    from autosac.cli import main

    assert main(["build-native"]) == 0
    assert "native pack_downcast built (CPU" in capsys.readouterr().out
    monkeypatch.setattr(native, "SOURCES", tmp_path)
    monkeypatch.setattr(native, "_state", {"loaded": False, "reason": None, "warned": False})
    assert main(["build-native"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("autosac: error: native sources not found")


# -- the build cache: a killed build's lock, a planted library ---------------------------------------------

# Run in a fresh process: cpp_extension's ninja step stands in as ninja decides
# (an existing library is up to date; else the library this session built is
# "linked"), so no compiler runs; HANG=1 stops the build midway, inside its locks.
_STUB = textwrap.dedent("""
    import os, shutil, sys, time
    from torch.utils import cpp_extension

    def ninja(name, build_directory, **kwargs):
        print("building", flush=True)
        if os.environ.get("HANG"):
            time.sleep(600)
        lib = os.path.join(build_directory, name + ".so")
        if not os.path.exists(lib):
            shutil.copy(os.environ["REAL_LIB"], lib)

    cpp_extension._write_ninja_file_and_build_library = ninja
    from autosac.zero3 import native
""")


def _env(cache: Path, **extra) -> dict:
    real = Path(native.build())  # this session's build, made by the real compiler
    return {**os.environ, "AUTOSAC_CACHE_DIR": str(cache), "REAL_LIB": str(real / f"{real.name}.so"), **extra}


def _run(code: str, cache: Path, **extra) -> subprocess.CompletedProcess:
    try:
        return subprocess.run([sys.executable, "-c", _STUB + textwrap.dedent(code)], env=_env(cache, **extra),
                              capture_output=True, text=True, timeout=60)
    except subprocess.TimeoutExpired:
        pytest.fail("the native build hung (waited over 60 s)")


def _start_hanging_build(cache: Path) -> subprocess.Popen:
    """A build stopped midway (compiling), holding whatever locks a build holds."""
    proc = subprocess.Popen([sys.executable, "-c", _STUB + "native.build()"], env=_env(cache, HANG="1"),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    ready, _, _ = select.select([proc.stdout], [], [], 60)
    if not ready or proc.stdout.readline().strip() != "building":
        proc.kill()
        pytest.fail(f"the build did not start: {proc.communicate()[1][-2000:]}")
    return proc


def test_a_build_killed_midway_is_redone_not_waited_on(tmp_path):
    cache = tmp_path / "cache"
    killed = _start_hanging_build(cache)
    killed.kill()
    killed.communicate()
    where = cache / "native" / Path(native.build()).name
    assert (where / "lock").exists()  # cpp_extension's FileBaton lock, left behind
    done = _run("print(native.available())", cache)
    assert done.stdout.split()[-1:] == ["True"], done.stderr[-2000:]
    for d in (cache, cache / "native", where):
        assert d.stat().st_mode & 0o777 == 0o700, d
    # the finished build is loaded as it is, nothing compiled
    again = _run("cpp_extension._write_ninja_file_and_build_library = None\nprint(native.available())", cache)
    assert again.stdout.split() == ["True"], again.stderr[-2000:]


def test_a_build_in_progress_is_waited_on_for_a_bounded_time(tmp_path):
    cache = tmp_path / "cache"
    holder = _start_hanging_build(cache)
    try:
        done = _run("""
            try:
                native.build()
            except native.NativeBuildError as e:
                print(e)
        """, cache, AUTOSAC_NATIVE_LOCK_TIMEOUT="0.5")
    finally:
        holder.kill()
        holder.communicate()
    said = done.stdout.strip().splitlines()
    lock = cache.resolve() / "native" / f"{Path(native.build()).name}.lock"
    assert len(said) == 1 and f"pid {holder.pid}" in said[0] and str(lock) in said[0], done.stdout + done.stderr[-2000:]


def _plant(cache: Path, forge: bool) -> Path:
    """A copy of a finished build whose library is replaced by one that leaves a
    marker file when loaded; ``forge``: its manifest rewritten to match."""
    real = Path(native.build())
    where = cache / "native" / real.name
    shutil.copytree(real, where, ignore=shutil.ignore_patterns("lock"))  # file times kept: ninja sees it built
    for d in (cache, cache / "native", where):
        d.chmod(0o700)
    marker = cache.parent / "marker"
    src = cache.parent / "planted.c"
    src.write_text(f'#include <stdio.h>\n__attribute__((constructor)) static void planted(void) '
                   f'{{ FILE *f = fopen("{marker}", "w"); if (f) fclose(f); }}\n')
    lib = where / f"{real.name}.so"
    subprocess.run(["gcc", "-shared", "-fPIC", "-o", str(lib), str(src)], check=True, timeout=60)
    if forge:
        import hashlib

        manifest = where / "manifest.json"
        entry = json.loads(manifest.read_text()) if manifest.exists() else {}
        entry["sha256"] = hashlib.sha256(lib.read_bytes()).hexdigest()
        manifest.write_text(json.dumps(entry))
    return marker


@pytest.mark.skipif(shutil.which("gcc") is None, reason="gcc not installed")
def test_a_planted_library_is_rebuilt_not_loaded(tmp_path):
    cache = tmp_path / "cache"
    marker = _plant(cache, forge=False)
    done = _run("print(native.available())", cache)
    assert not marker.exists()
    assert done.stdout.split()[-1:] == ["True"], done.stderr[-2000:]
    assert "does not match the SHA-256 recorded when it was built; building it again" in done.stderr


def _unsafe(how: str, cache: Path) -> str:
    where = next((cache / "native").iterdir())
    if how == "group-writable cache":
        cache.chmod(0o770)
        return "group-writable"
    if how == "world-writable build":
        where.chmod(0o707)
        return "world-writable"
    if how == "owned by another user":
        os.chown(where, 4242, -1)
        return "owned by uid 4242"
    cache.parent.chmod(0o777)  # a folder above the cache: anyone may replace the cache there
    return f"{cache.parent} is world-writable"


@pytest.mark.skipif(shutil.which("gcc") is None, reason="gcc not installed")
@pytest.mark.parametrize("how", ["group-writable cache", "world-writable build", "owned by another user",
                                 "world-writable folder above"])
def test_a_build_others_could_have_written_is_not_loaded(tmp_path, how):
    if how == "owned by another user" and os.geteuid() != 0:
        pytest.skip("chown needs root")
    base = tmp_path / "shared"
    base.mkdir()
    cache = base / "cache"
    marker = _plant(cache, forge=True)
    why = _unsafe(how, cache)
    try:
        done = _run("print(native.available())", cache)
    finally:
        base.chmod(0o700)
    assert not marker.exists()
    assert done.stdout.split() == ["False"], done.stderr[-2000:]
    said = [line for line in done.stderr.splitlines() if "autosac:" in line]
    assert len(said) == 1 and why in said[0] and "PyTorch fallback" in said[0], done.stderr[-2000:]


# -- the CUDA kernel: compiled here with nvcc, run where there is a GPU ---------------------------------------

def _nvcc(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["nvcc", "-std=c++17", "-O3", "-arch=sm_90", "-Xcompiler", "-Wall,-Wextra", *args],
                          capture_output=True, text=True, timeout=300)


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc not installed")
def test_the_cuda_kernel_compiles_without_warnings_and_reads_its_table_in_place(tmp_path):
    """The shard table is the kernel's argument: copied to a stack frame per thread it would cost bandwidth."""
    done = _nvcc("-Xptxas", "-v", "-c", str(native.SOURCES / "pack_downcast_cuda.cu"), "-o", str(tmp_path / "k.o"))
    assert done.returncode == 0, done.stderr[-2000:]
    assert "warning" not in done.stderr.lower(), done.stderr[-2000:]
    frames = [line.strip() for line in done.stderr.splitlines() if "stack frame" in line]
    assert len(frames) == 2 and all(f.startswith("0 bytes stack frame, 0 bytes spill") for f in frames), frames


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc not installed")
def test_the_standalone_cuda_check_compiles(tmp_path):
    """benchmarks/pack_downcast_cuda_check.cu (run on a GPU host) includes the kernel's source."""
    check = native.SOURCES.parent / "benchmarks" / "pack_downcast_cuda_check.cu"
    done = _nvcc("-DAUTOSAC_PACK_MAX_GRID=3", "-c", str(check), "-o", str(tmp_path / "c.o"))
    assert done.returncode == 0 and "warning" not in done.stderr.lower(), done.stderr[-2000:]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtype", DTYPES)
def test_the_cuda_kernel_is_bitwise_at_every_alignment_and_size(dtype):
    """Sources at every 4-byte offset, outputs at every 2-byte offset, sizes around the vector width (4)
    and the chunk (4096), strided tensors, and more tensors than one launch takes."""
    if not native.has_cuda_kernel():
        pytest.skip("the native op was built without its CUDA kernel")
    torch.manual_seed(4)
    tensors = [_special_values().cuda()]
    for i, n in enumerate((0, 1, 2, 3, 5, 7, 33, 1025, 4095, 4096, 4097, 4099, 8193, 12291, 100_003)):
        tensors.append((torch.randn(n + 4, device="cuda") * 1e3)[i % 4: i % 4 + n])
    tensors += [torch.randn(37, 129, device="cuda").t(), torch.randn(5, 2, device="cuda")[:, 1]]
    tensors += [torch.randn(int(n), device="cuda") for n in torch.randint(0, 50, (300,))]
    ref = _bits(_reference(tensors, dtype))
    total = ref.numel()
    for shift in range(4):
        buffer = torch.full((total + 8,), 7.0, dtype=dtype, device="cuda")
        ops.pack_downcast(tensors, dtype, out=buffer[shift: shift + total])
        assert torch.equal(_bits(buffer[shift: shift + total]), ref), shift
        assert (buffer[:shift] == 7).all() and (buffer[shift + total:] == 7).all()  # nothing written outside
    assert torch.equal(_bits(ops.pack_downcast(tensors, dtype)), ref)


def test_a_cuda_torch_without_a_gpu_builds_the_cpu_op_unless_told_the_architectures(monkeypatch):
    """PyTorch's extension builder fails (IndexError) on CUDA sources where no
    GPU is visible and ``TORCH_CUDA_ARCH_LIST`` is unset: a CUDA build of
    torch on a login node, or torch 2.11's wheel on this machine."""
    from torch.utils import cpp_extension

    monkeypatch.setattr(torch.version, "cuda", "13.0")
    monkeypatch.setattr(cpp_extension, "CUDA_HOME", "/usr/local/cuda")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.delenv("TORCH_CUDA_ARCH_LIST", raising=False)
    assert not native._with_cuda()
    monkeypatch.setenv("TORCH_CUDA_ARCH_LIST", "9.0")
    assert native._with_cuda()
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.delenv("TORCH_CUDA_ARCH_LIST")
    assert native._with_cuda()
