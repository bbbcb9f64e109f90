"""ccalloc switched on by a variable, with no change to the program.

The package installs `ccalloc_torch.pth` into site-packages. Python runs its one line at the
start of every interpreter (unless started with -S or -I); with CCALLOC_ENABLE=1 in the
environment it calls enable() below, and otherwise does nothing (no import beyond `os`).

enable() does not import torch: importing torch takes a second or more, and a process that
never uses it (a shell tool, a data worker) must not pay for it. It puts a finder at the head
of sys.meta_path that waits for the program's own `import torch` and installs ccalloc as
soon as torch's module has run, before the program's next line, and so before its first CUDA
use. Installing makes no CUDA call and reads no allocator variable (ccalloc reads them when
PyTorch initializes CUDA), so a process may still set PYTORCH_CUDA_ALLOC_CONF or fork after
it. Every process that inherits the variable is covered: torchrun's ranks, multiprocessing's
spawned and forked workers, subprocesses.

CuPy is covered the same way: at the program's `import cupy`, once CuPy's module has run,
ccalloc becomes CuPy's allocator too (ccalloc_torch/cupy.py), so that both frameworks share
one cache.

When ccalloc cannot be installed (its libraries are missing, CUDA was initialized during
torch's import, ...) the hook says why on stderr, once, and the framework's own allocator
stays in place: it never breaks `import torch` or `import cupy`.
"""

import importlib.abc
import os
import sys

VARIABLE = "CCALLOC_ENABLE"


def wanted():
    """Whether the environment asks for ccalloc (CCALLOC_ENABLE=1 exactly)."""
    return os.environ.get(VARIABLE, "") == "1"


def _say(message):
    try:
        sys.stderr.write("ccalloc: " + message + "\n")
        sys.stderr.flush()
    except Exception:  # noqa: BLE001  (no stderr: nothing to tell)
        pass


def _install_as(install, role, stays):
    """Runs `install` (ccalloc as `role`); on failure says why and that `stays` stays in
    place, and returns None: the framework's import must go on whatever happened."""
    try:
        how = install()
    except Exception as e:  # noqa: BLE001  (whatever it is, the import must go on)
        _say(f"{VARIABLE}=1, but ccalloc was not installed as {role}: "
             f"{type(e).__name__}: {e}. {stays} stays in place.")
        return None
    if os.environ.get("CCALLOC_ENABLE_VERBOSE", "") == "1":
        _say(f"installed as {role} ({how}) in process {os.getpid()}")
    return how


def _install():
    """Installs ccalloc as torch's CUDA allocator; on failure says why and leaves torch's."""
    def install():
        import ccalloc_torch
        return ccalloc_torch.install()
    return _install_as(install, "PyTorch's CUDA allocator", "PyTorch's own allocator")


def _install_cupy():
    """Installs ccalloc as CuPy's allocator; on failure says why and leaves CuPy's pool."""
    def install():
        from ccalloc_torch import cupy as ccalloc_cupy
        return ccalloc_cupy.install()
    return _install_as(install, "CuPy's allocator", "CuPy's own memory pool")


# The modules whose import installs ccalloc, and what it installs there.
_HOOKS = {"torch": lambda: _install(), "cupy": lambda: _install_cupy()}


class _AfterModule(importlib.abc.Loader):
    """Runs a module with its own loader, then `after()`; anything else goes to that loader
    (get_source, is_package, resources...)."""

    def __init__(self, inner, after):
        self._inner = inner
        self._after = after

    def create_module(self, spec):
        return self._inner.create_module(spec)

    def exec_module(self, module):
        # The module's own loader from the start, so that nothing sees this one afterwards.
        module.__loader__ = self._inner
        if getattr(module, "__spec__", None) is not None:
            module.__spec__.loader = self._inner
        self._inner.exec_module(module)
        self._after()

    def __getattr__(self, name):
        return getattr(self._inner, name)


class _TorchImportFinder(importlib.abc.MetaPathFinder):
    """Finds `torch` (and `cupy`) as the rest of sys.meta_path would, with a loader that
    installs ccalloc once the module has run; forgets each name at its first import and
    removes itself once both have been imported."""

    def __init__(self, pending=None):
        self.pending = set(_HOOKS) if pending is None else set(pending)

    def find_spec(self, fullname, path=None, target=None):
        if fullname not in self.pending:
            return None
        self.pending.discard(fullname)
        if not self.pending:
            _remove_finder()
        # The others search without this finder (a nested lookup of the same name would
        # otherwise come back here).
        finders = [f for f in sys.meta_path if not isinstance(f, _TorchImportFinder)]
        # The spec the import would have found without this finder: the others, in order.
        spec = None
        for finder in finders:
            find = getattr(finder, "find_spec", None)
            if find is not None and (spec := find(fullname, path, target)) is not None:
                break
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec  # not here, or a loader we cannot follow: import it untouched
        spec.loader = _AfterModule(spec.loader, _HOOKS[fullname])
        return spec


def _remove_finder():
    sys.meta_path[:] = [f for f in sys.meta_path if not isinstance(f, _TorchImportFinder)]


def enable():
    """Installs ccalloc now into torch and CuPy where they are imported already, else at
    their import."""
    if not wanted():
        return
    pending = []
    for name, install in _HOOKS.items():
        if name in sys.modules:
            install()
        else:
            pending.append(name)
    if pending and not any(isinstance(f, _TorchImportFinder) for f in sys.meta_path):
        sys.meta_path.insert(0, _TorchImportFinder(pending))
