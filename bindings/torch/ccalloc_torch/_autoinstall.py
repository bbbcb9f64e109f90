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

When ccalloc cannot be installed (its libraries are missing, CUDA was initialized during
torch's import, ...) the hook says why on stderr, once, and PyTorch's own allocator stays in
place: it never breaks `import torch`.
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


def _install():
    """Installs ccalloc as torch's CUDA allocator; on failure says why and leaves torch's."""
    try:
        import ccalloc_torch
        how = ccalloc_torch.install()
    except Exception as e:  # noqa: BLE001  (whatever it is, import torch must go on)
        _say(f"{VARIABLE}=1, but ccalloc was not installed as PyTorch's CUDA allocator: "
             f"{type(e).__name__}: {e}. PyTorch's own allocator stays in place.")
        return None
    if os.environ.get("CCALLOC_ENABLE_VERBOSE", "") == "1":
        _say(f"installed as PyTorch's CUDA allocator ({how}) in process {os.getpid()}")
    return how


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
    """Finds `torch` as the rest of sys.meta_path would, with a loader that installs
    ccalloc once torch's module has run; removes itself at that first import."""

    def find_spec(self, fullname, path=None, target=None):
        if fullname != "torch":
            return None
        _remove_finder()
        # The spec the import would have found without this finder: the others, in order.
        spec = None
        for finder in list(sys.meta_path):
            find = getattr(finder, "find_spec", None)
            if find is not None and (spec := find(fullname, path, target)) is not None:
                break
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec  # no torch here, or one we cannot follow: import it untouched
        spec.loader = _AfterModule(spec.loader, _install)
        return spec


def _remove_finder():
    sys.meta_path[:] = [f for f in sys.meta_path if not isinstance(f, _TorchImportFinder)]


def enable():
    """Installs ccalloc now if torch is imported already, else at torch's import."""
    if not wanted():
        return
    if "torch" in sys.modules:
        _install()
        return
    if not any(isinstance(f, _TorchImportFinder) for f in sys.meta_path):
        sys.meta_path.insert(0, _TorchImportFinder())
