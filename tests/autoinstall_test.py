#!/usr/bin/env python3
"""The variable that switches ccalloc on without a code change (ccalloc_torch.pth and
ccalloc_torch/_autoinstall.py), without torch or a GPU: a fake `torch` package stands in, so
the test checks when the hook installs (after torch's module has run, before the program's
next line), that it imports nothing while the variable is unset, that it leaves other
imports and torch's loader alone, and that a failed install is said on stderr once and
never breaks `import torch`. The real install on a GPU: tests/torch/test_lazy_init.py."""

import os
import subprocess
import sys
import tempfile
import textwrap
import unittest

HERE = os.path.dirname(os.path.abspath(__file__))
BINDINGS = os.path.join(HERE, "..", "bindings", "torch")
PTH = os.path.join(BINDINGS, "ccalloc_torch.pth")
sys.path.insert(0, BINDINGS)
from ccalloc_torch import _autoinstall  # noqa: E402

# A torch package whose module body records that it ran, and whose submodule the hook must
# leave alone.
FAKE_TORCH = {
    "torch/__init__.py": "import sys\nsys.modules[__name__].body_ran = True\nfrom . import sub\n",
    "torch/sub.py": "value = 42\n",
}
# And a cupy package: the hook installs ccalloc as its allocator at its import too.
FAKE_CUPY = {"cupy/__init__.py": "import sys\nsys.modules[__name__].body_ran = True\n"}


def write_tree(root, files):
    for name, text in files.items():
        path = os.path.join(root, name)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "w") as f:
            f.write(text)


class HookInProcess(unittest.TestCase):
    def setUp(self):
        self.dir = tempfile.TemporaryDirectory()
        write_tree(self.dir.name, FAKE_TORCH)
        write_tree(self.dir.name, FAKE_CUPY)
        sys.path.insert(0, self.dir.name)
        self.saved_meta_path = list(sys.meta_path)
        self.saved_install = _autoinstall._install
        self.saved_install_cupy = _autoinstall._install_cupy
        self.saved_env = os.environ.get(_autoinstall.VARIABLE)
        self.calls = []

        def fake_install():
            torch = sys.modules["torch"]
            # torch's module has run to its end when ccalloc installs.
            self.calls.append((getattr(torch, "body_ran", False), "torch.sub" in sys.modules))
            return "native"

        def fake_install_cupy():
            self.calls.append(("cupy", getattr(sys.modules["cupy"], "body_ran", False)))
            return "cupy"

        _autoinstall._install = fake_install
        _autoinstall._install_cupy = fake_install_cupy
        for name in ("torch", "torch.sub", "cupy"):
            sys.modules.pop(name, None)

    def tearDown(self):
        sys.meta_path[:] = self.saved_meta_path
        _autoinstall._install = self.saved_install
        _autoinstall._install_cupy = self.saved_install_cupy
        if self.saved_env is None:
            os.environ.pop(_autoinstall.VARIABLE, None)
        else:
            os.environ[_autoinstall.VARIABLE] = self.saved_env
        sys.path.remove(self.dir.name)
        for name in ("torch", "torch.sub", "cupy"):
            sys.modules.pop(name, None)
        self.dir.cleanup()

    def test_installs_once_after_torchs_module_ran(self):
        os.environ[_autoinstall.VARIABLE] = "1"
        _autoinstall.enable()
        _autoinstall.enable()  # a second call adds no second finder
        self.assertEqual(sum(isinstance(f, _autoinstall._TorchImportFinder) for f in sys.meta_path), 1)
        import json  # noqa: F401  (another module: untouched, no install)
        self.assertEqual(self.calls, [])
        import torch
        self.assertEqual(self.calls, [(True, True)])
        self.assertEqual(torch.sub.value, 42)
        # The finder waits for cupy alone now, and torch's loader still answers what its own
        # would.
        finders = [f for f in sys.meta_path if isinstance(f, _autoinstall._TorchImportFinder)]
        self.assertEqual([f.pending for f in finders], [{"cupy"}])
        self.assertIn("body_ran", torch.__spec__.loader.get_source("torch"))
        self.assertNotIsInstance(torch.__loader__, _autoinstall._AfterModule)
        self.assertIs(torch.__loader__, torch.__spec__.loader)
        # cupy's import installs ccalloc there, after its module ran; the finder is gone.
        import cupy  # noqa: F401
        self.assertEqual(self.calls, [(True, True), ("cupy", True)])
        self.assertFalse(any(isinstance(f, _autoinstall._TorchImportFinder) for f in sys.meta_path))

    def test_cupy_first_then_torch(self):
        os.environ[_autoinstall.VARIABLE] = "1"
        _autoinstall.enable()
        import cupy  # noqa: F401
        self.assertEqual(self.calls, [("cupy", True)])
        import torch  # noqa: F401
        self.assertEqual(self.calls, [("cupy", True), (True, True)])
        self.assertFalse(any(isinstance(f, _autoinstall._TorchImportFinder) for f in sys.meta_path))

    def test_torch_already_imported_installs_at_once(self):
        import torch  # noqa: F401
        os.environ[_autoinstall.VARIABLE] = "1"
        _autoinstall.enable()
        self.assertEqual(self.calls, [(True, True)])

    def test_other_values_do_nothing(self):
        for value in ("0", "true", "", "11"):
            os.environ[_autoinstall.VARIABLE] = value
            _autoinstall.enable()
        self.assertFalse(any(isinstance(f, _autoinstall._TorchImportFinder) for f in sys.meta_path))
        import torch  # noqa: F401
        self.assertEqual(self.calls, [])


def hooked_python(base, paths):
    """A virtual environment in `base` whose site-packages holds the shipped .pth, as
    `pip install` leaves it, with `paths` (ccalloc_torch's folder, where torch is) on its
    path ahead of it (.pth files run in name order). Returns its interpreter."""
    venv = os.path.join(base, "venv")
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", venv], check=True)
    python = os.path.join(venv, "bin", "python")
    site_dir = subprocess.run(
        [python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        capture_output=True, text=True, check=True).stdout.strip()
    with open(os.path.join(site_dir, "a_paths.pth"), "w") as f:
        f.write("".join(os.path.abspath(p) + "\n" for p in paths))
    with open(PTH) as src, open(os.path.join(site_dir, "ccalloc_torch.pth"), "w") as dst:
        dst.write(src.read())
    return python


class HookAtInterpreterStart(unittest.TestCase):
    """The shipped .pth in a virtual environment's site-packages."""

    def run_python(self, enable, code):
        with tempfile.TemporaryDirectory() as base:
            write_tree(os.path.join(base, "fake"), FAKE_TORCH)
            python = hooked_python(base, [BINDINGS, os.path.join(base, "fake")])
            # No libccalloc.so there, so install() cannot load one (whichever build folders
            # the repository holds: an instrumented one would not load into this Python).
            empty = os.path.join(base, "no-libraries")
            os.makedirs(empty)
            env = dict(os.environ, CCALLOC_LIBRARY_DIR=empty)
            if enable is None:
                env.pop(_autoinstall.VARIABLE, None)
            else:
                env[_autoinstall.VARIABLE] = enable
            return subprocess.run([python, "-c", code], env=env, capture_output=True,
                                  text=True, timeout=120, cwd=base)

    def test_unset_imports_nothing_of_ccalloc(self):
        r = self.run_python(None, "import sys; import torch; "
                                  "print(sorted(m for m in sys.modules if 'ccalloc' in m))")
        self.assertEqual(r.returncode, 0, r.stderr)
        self.assertEqual(r.stdout.strip(), "[]")
        self.assertEqual(r.stderr, "")

    def test_enabled_hook_waits_for_torch(self):
        r = self.run_python("1", "import sys; print('ccalloc_torch' in sys.modules, "
                                 "'torch' in sys.modules)")
        self.assertEqual(r.returncode, 0, r.stderr)
        self.assertEqual(r.stdout.strip(), "True False")  # hook armed, torch not imported
        self.assertEqual(r.stderr, "")

    def test_failed_install_is_said_once_and_import_torch_goes_on(self):
        # The fake torch has no CUDA allocator to install into: install() fails.
        r = self.run_python("1", "import torch; import torch; print(torch.sub.value)")
        self.assertEqual(r.returncode, 0, r.stderr)
        self.assertEqual(r.stdout.strip(), "42")
        lines = [line for line in r.stderr.splitlines() if line.startswith("ccalloc: ")]
        self.assertEqual(len(lines), 1, r.stderr)
        self.assertIn("CCALLOC_ENABLE=1, but ccalloc was not installed", lines[0])
        self.assertIn("PyTorch's own allocator stays in place", lines[0])


if __name__ == "__main__":
    unittest.main()
