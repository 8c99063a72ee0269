"""Shared pieces of the kernel modules.

- ``IS_SIM``: True under the CUDA simulator (``NUMBA_ENABLE_CUDASIM=1``). The simulator has no warp
  shuffles, so every reduction has a shared-memory path; kernels pick it with this flag at import.
- bf16 weights are stored as ``uint16`` (the top half of the float32 bit pattern) and widened to
  float32 in registers with :func:`bf16_to_f32`; accumulation is always float32.
- Compiled kernels are cached on disk across runs (:mod:`kdt.kernels.jit_cache`), and numba's front end compiles
  them ~4x faster, to the same PTX (:mod:`kdt.kernels.fast_compile`: top-down inlining, work-list liveness, ...).
- ``PTX_REGISTRY``: ``register_ptx(kernel, signature)`` records a kernel and one signature that CI
  compiles with ``cuda.compile_ptx(..., cc=(9, 0))`` (tests/test_compile_ptx.py), because the
  simulator checks no types.
"""

from __future__ import annotations

import hashlib
import linecache
import os

import numpy as np
from numba import config as _nb_config
from numba import cuda, int32, uint16, uint32

from kdt.bf16 import bf16_bits_to_f32, f32_to_bf16_bits  # noqa: F401  (host side, re-exported)

IS_SIM: bool = bool(_nb_config.ENABLE_CUDASIM)
# kdt's small grids are deliberate (one block per token row, a few blocks per head): Numba's "grid size
# N will likely result in GPU under-utilization" warning fired on most launches and buried the output
# of `kdt bench` / `kdt verify`. Off unless the user asks for it (NUMBA_CUDA_LOW_OCCUPANCY_WARNINGS=1).
if "NUMBA_CUDA_LOW_OCCUPANCY_WARNINGS" not in os.environ:
    _nb_config.CUDA_LOW_OCCUPANCY_WARNINGS = 0

if not IS_SIM:  # compiled kernels kept on disk across runs (kdt.kernels.jit_cache); a faster front end (fast_compile)
    from kdt.kernels import fast_compile, jit_cache

    jit_cache.install()
    fast_compile.install()

WARP = 32

# ldcg1 / ldcg2 / ldcg3: a[i] / a[i, j] / a[i, j, k] through L2 only (ld.global.cg), for data other blocks of the
# same launch wrote (split partials, tickets' results); ldcs3: with the streaming hint (ld.global.cs)
if IS_SIM:  # memory is coherent

    def ldcg1(a, i):
        return a[i]

    def ldcg2(a, i, j):
        return a[i, j]

    def ldcg3(a, i, j, k):
        return a[i, j, k]

    def ldcs3(a, i, j, k):
        return a[i, j, k]

else:
    # the intrinsic behind cuda.ldcg: its @overload wrapper compiles through a device dispatcher that
    # asks the driver for the current device, which the sm_90 compile check (no GPU) cannot answer
    from numba import int64
    from numba.cuda.cache_hints import ldcg_intrinsic

    @cuda.jit(device=True, inline=True)
    def ldcg1(a, i):
        return ldcg_intrinsic(a, (int64(i),))

    @cuda.jit(device=True, inline=True)
    def ldcg2(a, i, j):
        return ldcg_intrinsic(a, (int64(i), int64(j)))

    @cuda.jit(device=True, inline=True)
    def ldcg3(a, i, j, k):
        return ldcg_intrinsic(a, (int64(i), int64(j), int64(k)))

    from numba.cuda.cache_hints import ldcs_intrinsic

    @cuda.jit(device=True, inline=True)
    def ldcs3(a, i, j, k):
        """a[i, j, k] with the streaming hint (ld.global.cs, evict first): weights, read once, so that they do not
        push the activations that every warp of the block re-reads out of L1."""
        return ldcs_intrinsic(a, (int64(i), int64(j), int64(k)))

# ---- programmatic dependent launch (PDL) ---------------------------------------------------------------
# A kernel that calls grid_dependency_wait() as its first statement is launched, inside a captured CUDA graph
# (``pdl_capture``), with programmatic stream serialization: its blocks may be scheduled as soon as every block of
# the kernel before it has passed the same call, and they wait in ``griddepcontrol.wait`` until that kernel has
# finished and its writes are visible. The launch latency and the ramp of each kernel then overlap the tail of the
# one before it instead of following it (each of the AR step's ~300 launches in a graph trails its predecessor by
# ~1 us). Nothing runs before the wait, so the kernels compute exactly what they did. Devices before sm_90 have
# no griddepcontrol: the call compiles to nothing there.
# KDT_PDL=1 (session 25: measured slower, below) or 2 (the default since session 39) turns it on; off (0), the call
# compiles to nothing (the sm_90 PTX of all 146 registered kernels equals that of the code before, mangled names aside).
# Predicted: up to ~1 us less a launch, ~300 us of the Moonlight AR step. Measured (H200, session 25,
# `scripts/profile_graphs.py --preset moonlight-16b-a3b --budget 7 --pdl-ab`, run s25b: the same kernels captured with
# and without PDL in one process, L = 176): the AR step 3019 us with PDL against 2904 without, the oracle chain step
# 7241 / 7198, the target forward at M = 1 3012 / 2892, at M = 8 7229 / 7187: 1-4% slower (why was not measured; a
# guess: the launch_dependents right after the wait keeps the next kernel's blocks resident, waiting, from the start of
# this one). That run's launch hook also failed on kernels loaded from the disk cache (no py_func on numba-cuda's
# _Kernel); it now reads the dispatcher's, not run on the H200.
# KDT_PDL=2 (session 36): the wait alone, no launch_dependents: each block triggers the next kernel's launch
# implicitly as it exits, so the next kernel's blocks are not resident and waiting through this one's run, and only
# its launch and ramp overlap this one's last blocks and their memory flush. Measured (H200, session 39, s39a: the
# same run's programs with and without PDL, KDT_PDL=2, L = 176, us): the AR step 2886.7 / 2901.2, the oracle chain
# step 7186.6 / 7205.6, the target forward at M = 1 2869.8 / 2880.6, at M = 8 7169.4 / 7186.7: 0.2-0.5% faster,
# every program. So the default since session 39 (KDT_PDL=0: off).
PDL_MODE = int(os.environ.get("KDT_PDL", "2") or 0)
if PDL_MODE not in (0, 1, 2):
    raise ValueError(f"KDT_PDL={PDL_MODE}: 0 (off), 1 (wait, then trigger the next launch) or 2 (wait only)")
PDL = PDL_MODE > 0
WAIT_NAME = "grid_dependency_wait"

if IS_SIM:

    def grid_dependency_wait():
        """No-op under the simulator (its blocks run after the previous kernel's anyway)."""

else:
    from llvmlite import ir as _ir
    from numba import types as _nbtypes
    from numba.cuda.extending import intrinsic as _intrinsic

    def _pdl_code() -> bool:
        """Emit griddepcontrol: PDL on and the compile's device sm_90 or newer (the sm_90 compile check, with no
        device, emits it)."""
        if not PDL:
            return False
        try:
            return tuple(cuda.get_current_device().compute_capability) >= (9, 0)
        except Exception:  # noqa: BLE001 - no device (the CPU compile check targets sm_90)
            return True

    @_intrinsic
    def _griddepcontrol(typingctx):
        def codegen(context, builder, sig, args):
            if _pdl_code():  # wait for the kernel before; then (KDT_PDL=1) let the kernel after be scheduled
                ptx = "griddepcontrol.wait;" + ("\n\tgriddepcontrol.launch_dependents;" if PDL_MODE == 1 else "")
                asm = _ir.InlineAsm(_ir.FunctionType(_ir.VoidType(), []), ptx, "~{memory}", side_effect=True)
                builder.call(asm, ())
            return context.get_dummy_value()

        return _nbtypes.none(), codegen

    @cuda.jit(device=True, inline=True)
    def grid_dependency_wait():
        """The kernel before this one (in a PDL launch) has finished and its writes are visible; from here
        (KDT_PDL=1; with KDT_PDL=2 at each block's exit) the kernel after this one may be scheduled (see the PDL
        section)."""
        _griddepcontrol()


def waits_for_grid(py_func) -> bool:
    """The kernel calls grid_dependency_wait() itself (its first statement, by kdt's convention)."""
    return WAIT_NAME in py_func.__code__.co_names


class _PdlHook:
    """numba-cuda launches through cuda.core's ``launch(stream, LaunchConfig(...), kernel, *args)``: while
    ``capturing`` (a graph capture, :func:`pdl_capture`), a kernel that waits for its grid dependency
    (:func:`waits_for_grid`) gets ``programmatic_stream_serialization``."""

    capturing = False
    this = False
    installed: bool | None = None
    launch_on = True  # set_pdl_launch(False): captures launch as before (A/B in one process, same kernels)

    @classmethod
    def install(cls) -> bool:
        if cls.installed is not None:
            return cls.installed
        cls.installed = False
        if IS_SIM or not PDL:
            return False
        try:
            import numba.cuda.dispatcher as nd

            base = nd.LaunchConfig
            base(grid=1, block=1, programmatic_stream_serialization=True)
            call0 = nd._LaunchConfiguration.__call__
        except Exception:  # noqa: BLE001 - a numba-cuda / cuda.core without these: plain launches
            return False

        def config(*a, **kw):
            if cls.this:
                kw["programmatic_stream_serialization"] = True
            return base(*a, **kw)

        def call(lc, *args):  # kernel[grid, block, stream](*args); (a kernel loaded from the disk cache has no
            # py_func: its dispatcher does)
            cls.this = cls.capturing and waits_for_grid(lc.dispatcher.py_func)
            try:
                return call0(lc, *args)
            finally:
                cls.this = False

        nd.LaunchConfig = config
        nd._LaunchConfiguration.__call__ = call
        cls.installed = True
        return True


def pdl_launches() -> bool:
    """Graph captures launch waiting kernels with PDL (on, supported, not switched off)."""
    return _PdlHook.launch_on and _PdlHook.install()


def set_pdl_launch(on: bool) -> bool:
    """Whether later graph captures use PDL (the kernels are the same either way: without it their wait returns
    at once); returns the previous setting. For same-process A/Bs (scripts/profile_graphs.py --pdl-ab)."""
    prev, _PdlHook.launch_on = _PdlHook.launch_on, bool(on)
    return prev


class pdl_capture:  # noqa: N801 - used as a context manager
    """``with pdl_capture():`` the kernels launched (into a graph being captured) that wait for their grid
    dependency are launched with PDL (see the PDL section); a no-op where PDL is off or unsupported."""

    def __enter__(self):
        _PdlHook.capturing = pdl_launches()
        return self

    def __exit__(self, *exc):
        _PdlHook.capturing = False
        return False


# ---- blocks of one launch that wait on other blocks of it -----------------------------------------------------
# (kdt.kernels.moe's kernel AB, kdt.kernels.mla's combine in the attention's launch.) A waiter must never hold a
# slot that a block it waits on needs, whatever order the hardware dispatches blocks in: so a block's role is its
# ticket (sync_ticket, an atomic counter at its start, as CUB's decoupled look-back takes tile ids), and every role
# block a waiter waits on has started and waits on nothing. A flag has SYNC_COPIES copies, one 128-byte line each
# (sync_raise): a waiter polls one copy with an atomic read (a plain or ld.cg load in a loop may be hoisted out of
# it) and SPIN_NS of sleep between polls (sync_poll), so many waiters spread over SYNC_COPIES L2 lines. A writer
# fences (cuda.threadfence) before it raises; a waiter fences after its poll, and reads what other blocks wrote
# through L2 (ldcg*) or through L1 lines that no block of the launch loaded before (L1 starts empty at a launch).
# The last block to pass puts back to zero every word the launch wrote: the sync array is zero between launches.
# The simulator runs blocks one after another, in ticket order: a poll there checks that its flag is up already.
SYNC_LINE = 32  # int32 words of a 128-byte line
SYNC_COPIES = 32  # copies of a flag, one line each
SPIN_NS = 200  # a waiter's sleep between polls


@cuda.jit(device=True, inline=True)
def sync_ticket(sync, word):
    """This block's role index: the next ticket of counter ``sync[word]`` (thread 0 takes it, every thread gets
    it)."""
    v = cuda.shared.array(1, int32)
    if cuda.threadIdx.x == 0:
        v[0] = cuda.atomic.add(sync, word, 1)
    cuda.syncthreads()
    return v[0]


@cuda.jit(device=True, inline=True)
def sync_raise(sync, flag):
    """Every copy of ``flag`` (words flag + c * SYNC_LINE) up (one thread, after the block's writes and a fence)."""
    for c in range(SYNC_COPIES):
        sync[flag + c * SYNC_LINE] = 1


if IS_SIM:

    @cuda.jit(device=True)
    def sync_poll(sync, i):
        if sync[i] == 0:  # blocks run one after another, in ticket order: the flag must be up already
            raise RuntimeError(f"a block waits on sync[{i}], which no earlier block raised")

else:

    @cuda.jit(device=True, inline=True)
    def sync_poll(sync, i):
        """Wait until sync[i] != 0 (one thread; fence after it)."""
        while cuda.atomic.add(sync, i, 0) == 0:
            cuda.nanosleep(SPIN_NS)


# (name, python function of the kernel or device function, signature tuple, is_device)
PTX_REGISTRY: list[tuple[str, object, tuple, bool]] = []


def register_ptx(kernel, signature: tuple, device: bool = False, name: str | None = None) -> None:
    """Record ``kernel`` (a ``cuda.jit`` dispatcher or its py_func) for the sm_90 compile check."""
    fn = getattr(kernel, "py_func", kernel)
    PTX_REGISTRY.append((name or fn.__name__, fn, signature, device))


if IS_SIM:

    @cuda.jit(device=True)
    def bf16_to_f32(u):
        """uint16 bf16 bit pattern -> float32 (simulator path)."""
        return np.array([np.uint32(u) << np.uint32(16)], dtype=np.uint32).view(np.float32)[0]

    @cuda.jit(device=True)
    def f32_bits(v):
        """float32 -> its uint32 bit pattern (simulator path)."""
        return np.array([v], dtype=np.float32).view(np.uint32)[0]

    @cuda.jit(device=True)
    def f32_from_bits(u):
        """Low 32 bits of an integer -> float32 with that bit pattern (simulator path)."""
        return np.array([u], dtype=np.uint64).astype(np.uint32).view(np.float32)[0]

else:
    from numba.cuda import libdevice

    @cuda.jit(device=True, inline=True)
    def bf16_to_f32(u):
        """uint16 bf16 bit pattern -> float32: shift into the high half and reinterpret."""
        return libdevice.int_as_float(int32(u) << 16)

    @cuda.jit(device=True, inline=True)
    def f32_bits(v):
        """float32 -> its uint32 bit pattern."""
        return uint32(libdevice.float_as_int(v))

    @cuda.jit(device=True, inline=True)
    def f32_from_bits(u):
        """Low 32 bits of an integer -> float32 with that bit pattern."""
        return libdevice.int_as_float(int32(u))


@cuda.jit(device=True, inline=True)
def f32_to_bf16(v):
    """float32 -> bf16 bits (uint16), round to nearest even (the device twin of f32_to_bf16_bits)."""
    u = f32_bits(v)
    return uint16((u + uint32(0x7FFF) + ((u >> uint32(16)) & uint32(1))) >> uint32(16))


@cuda.jit(device=True, inline=True)
def f32_identity(x):
    """Loader for float32 weights (the float32 counterpart of bf16_to_f32)."""
    return x


def weight_loader(dtype):
    """Device function that turns one stored weight element into float32."""
    dt = np.dtype(dtype)
    if dt == np.uint16:
        return bf16_to_f32
    if dt == np.float32:
        return f32_identity
    raise TypeError(f"unsupported weight dtype {dt}: kernels take float32 or bf16 (stored as uint16)")


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def device_scalar(v, dtype=np.int64):
    """A one-element device array holding ``v``; a device array is passed through unchanged.
    Kernels that a CUDA graph replays read per-step scalars (e.g. the prefix length L) this way."""
    if isinstance(v, (int, float, np.integer, np.floating)):
        return cuda.to_device(np.array([v], dtype=dtype))
    return v


def gpu_available() -> bool:
    """A real CUDA device (not the simulator) can be used."""
    if IS_SIM:
        return False
    try:
        return bool(cuda.is_available()) and len(cuda.gpus) > 0
    except Exception:  # noqa: BLE001 - no driver, no device
        return False


# ---- generated kernels -----------------------------------------------------------------------------
# Kernels whose per-thread accumulators must stay in registers are written out as Python source with
# every compile-time loop unrolled (Numba/NVVM do not reliably unroll large nests), then cuda.jit-ed.
class Src:
    """Tiny indented-source builder: ``s(line)``; ``with s.block(header):`` indents."""

    def __init__(self):
        self.lines: list[str] = []
        self.depth = 0

    def __call__(self, line: str) -> None:
        self.lines.append("    " * self.depth + line)

    def block(self, line: str):
        self(line)
        return self

    def __enter__(self):
        self.depth += 1

    def __exit__(self, *exc):
        self.depth -= 1

    def text(self) -> str:
        return "\n".join(self.lines) + "\n"


def jit_source(src: str, name: str, namespace: dict, origin: str, **jit_options):
    """exec generated kernel source (``origin``: the generating module, for tracebacks through
    linecache; the file name carries a stable digest of the source) and cuda.jit its function ``name``
    (with ``jit_options``, e.g. max_registers)."""
    filename = f"<{origin} generated {name} {hashlib.sha1(src.encode()).hexdigest()[:12]}>"
    linecache.cache[filename] = (len(src), None, src.splitlines(True), filename)
    ns = dict(namespace)
    ns.setdefault(WAIT_NAME, grid_dependency_wait)
    exec(compile(src, filename, "exec"), ns)  # noqa: S102 - our own generated source
    return cuda.jit(ns[name], **jit_options)


def allow_dynamic_shared(kernel, args, nbytes: int) -> None:
    """Let ``kernel`` (a dispatcher) launched with ``args`` take nbytes of dynamic shared memory: past 48 KB a
    function needs CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES (compiles the kernel for these argument types;
    set once per dispatcher and types). A no-op under the simulator."""
    if IS_SIM or nbytes <= 48 * 1024:
        return
    done = kernel.__dict__.setdefault("_kdt_dyn_shared", {})
    types = tuple(kernel.typeof_pyval(a) for a in args)
    if done.get(types, 0) >= nbytes:
        return
    from numba.cuda.cudadrv.driver import binding, driver

    fn = kernel.compile(types)._codelibrary.get_cufunc()
    attr = binding.CUfunction_attribute.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES
    driver.cuKernelSetAttribute(attr, int(nbytes), fn.handle, fn.device.id)
    done[types] = nbytes
