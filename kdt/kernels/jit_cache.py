"""The on-disk cache of compiled kernels: a second run loads them instead of compiling again.

Numba's own ``cache=True`` cannot serve kdt: its cache key hashes a kernel's closure by pickling it
(kdt's kernels are built by factories whose closures hold device functions), it finds code by source
file (the linear kernels are generated source) and it is stamped by the kernel's own file only (a
change to a device function in another module would be missed). So kdt keys every compiled kernel by

- a hash of kdt's kernel sources (every ``kdt/kernels/*.py`` and ``kdt/bf16.py``): any edit there
  invalidates the whole cache;
- the kernel's qualified name, its bytecode and constants, and, recursively, the values its closure
  captured (numbers, strings, dtypes as text; device functions by the same key); a value with no
  stable description (its text holds an address) makes the key unique to this process: a miss, never
  a wrong hit;
- every ``KDT_*`` environment variable (kernel version switches), the kernel's jit options (e.g.
  ``max_registers``), and numba-cuda's own key (the signature, the target architecture, numba-cuda's version).

:func:`install` attaches such a cache to every kdt kernel the first time it compiles (one hook on
numba-cuda's ``CUDADispatcher.compile``; the stored object is numba-cuda's own: PTX and cubin).
Where: ``$KDT_CACHE_DIR``, else ``$XDG_CACHE_HOME/kdt/kernels``, else ``~/.cache/kdt/kernels``.
``KDT_JIT_CACHE=0`` turns it off. Nothing is cached under the CUDA simulator.
"""

from __future__ import annotations

import hashlib
import os
import types
from pathlib import Path

_ROOT = Path(__file__).resolve().parent.parent  # the kdt package


def cache_dir() -> Path:
    if os.environ.get("KDT_CACHE_DIR"):
        return Path(os.environ["KDT_CACHE_DIR"])
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "kdt" / "kernels"


def sources_hash() -> str:
    """sha256 over kdt's kernel sources and the KDT_* environment."""
    h = hashlib.sha256()
    for p in sorted((_ROOT / "kernels").glob("*.py")) + [_ROOT / "bf16.py"]:
        h.update(p.name.encode())
        h.update(p.read_bytes())
    for k in sorted(k for k in os.environ if k.startswith("KDT_") and k not in ("KDT_CACHE_DIR", "KDT_ERR_LOG")):
        h.update(f"{k}={os.environ[k]}".encode())
    return h.hexdigest()


_MAX_DEPTH = 16  # device functions nested deeper than this are keyed by address (the tensor-core kernels nest ~11)


def _describe(v, depth: int = 0) -> str:
    """A stable text for a captured value (see the module docstring)."""
    if depth > _MAX_DEPTH:
        return f"<deep {id(v)}>"
    py = getattr(v, "py_func", None)  # a numba dispatcher (device function or kernel)
    if py is not None:
        return f"dispatcher({function_key(py, depth + 1)})"
    if isinstance(v, types.FunctionType):
        return f"function({function_key(v, depth + 1)})"
    if isinstance(v, (tuple, list)):
        return "(" + ",".join(_describe(x, depth + 1) for x in v) + ")"
    if isinstance(v, dict):
        return "{" + ",".join(f"{k!r}:{_describe(x, depth + 1)}" for k, x in sorted(v.items(), key=str)) + "}"
    if isinstance(v, types.CodeType):
        return _code_key(v)
    return repr(v)  # numbers, strings, dtypes, numba types; anything else carries its address


def _code_key(code: types.CodeType) -> str:
    consts = ",".join(_code_key(c) if isinstance(c, types.CodeType) else repr(c) for c in code.co_consts)
    return hashlib.sha256(code.co_code + repr(code.co_names).encode() + consts.encode()).hexdigest()


def _names(code: types.CodeType) -> set[str]:
    out = set(code.co_names)
    for c in code.co_consts:
        if isinstance(c, types.CodeType):
            out |= _names(c)
    return out


def function_key(py_func, depth: int = 0) -> str:
    """Qualified name, bytecode, captured values and the globals it reads (generated kernels get their
    tile constants as globals) of a Python function."""
    cells = py_func.__closure__ or ()
    captured = ",".join(_describe(c.cell_contents, depth) for c in cells)
    g = py_func.__globals__
    used = ",".join(f"{n}={_describe(g[n], depth + 1)}" for n in sorted(_names(py_func.__code__)) if n in g)
    where = py_func.__module__ or "<generated>"  # (a generated file's name may vary between runs)
    return f"{where}.{py_func.__qualname__}:{_code_key(py_func.__code__)}:{captured}:{used}"


def is_kdt_kernel(py_func) -> bool:
    """A function of kdt's (generated kernels have no module: their file name says kdt)."""
    return (py_func.__module__ or "").startswith("kdt.") or py_func.__code__.co_filename.startswith("<kdt.")


_installed = False


def _options_key(options: dict) -> str:
    """The jit options that change the code (e.g. ``max_registers``) as text for the key."""
    return repr(sorted((k, v) for k, v in options.items() if isinstance(v, (bool, int, float, str, type(None)))))


def install() -> bool:
    """Attach the disk cache to every kdt kernel at its first compile. Returns whether it is on."""
    global _installed
    if _installed:
        return True
    if os.environ.get("KDT_JIT_CACHE", "1") == "0":
        return False
    try:
        from numba.cuda.core.caching import NullCache, _CacheLocator
        from numba.cuda.dispatcher import CUDACache, CUDACacheImpl, CUDADispatcher
    except ImportError:  # a numba-cuda without these internals: compile every run, as before
        return False
    stamp = sources_hash()
    root = cache_dir()

    class Locator(_CacheLocator):
        def __init__(self, key: str):
            self.key = key

        def get_cache_path(self):
            return str(root)

        def get_source_stamp(self):
            return stamp

        def get_disambiguator(self):
            return self.key[:20]

        @classmethod
        def from_function(cls, py_func, py_file):
            return None  # never chosen by numba's own search

    class Impl(CUDACacheImpl):
        def __init__(self, py_func, key: str):  # no search for a source file: kdt's key and folder
            self._lineno = py_func.__code__.co_firstlineno
            self._locator = Locator(key)
            self._filename_base = self.get_filename_base(py_func.__qualname__, "")

    class KdtCache(CUDACache):
        def __init__(self, py_func, options: str = ""):
            self._kdt_key = hashlib.sha256((stamp + function_key(py_func) + options).encode()).hexdigest()
            self._impl_class = lambda f: Impl(f, self._kdt_key)
            super().__init__(py_func)

        def _index_key(self, sig, codegen):
            key = (sig, codegen.magic_tuple(), self._kdt_key)
            if self._launch_config_key is not None:
                key += (("launch_config", self._launch_config_key),)
            return key

    compile_ = CUDADispatcher.compile

    def compile_with_disk_cache(self, sig):
        if type(self._cache) is NullCache and is_kdt_kernel(self.py_func):
            try:
                self._cache = KdtCache(self.py_func, _options_key(self.targetoptions))
            except Exception:  # noqa: BLE001 - e.g. a read-only home: compile without a cache
                pass
        return compile_(self, sig)

    CUDADispatcher.compile = compile_with_disk_cache
    _installed = True
    return True
