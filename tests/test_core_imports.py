"""core/ and proto/ must run on a machine with no torch and no GPU."""

from __future__ import annotations

import subprocess
import sys

BLOCKER = """
import sys
class Blocker:
    def find_spec(self, name, path=None, target=None):
        if name.split('.')[0] in ('torch', 'cupy', 'worker', 'kernels'):
            raise ImportError(f'{name} must not be imported by core')
sys.meta_path.insert(0, Blocker())
import importlib, pkgutil
import core, proto
for package in (core, proto):
    for module in pkgutil.walk_packages(package.__path__, package.__name__ + '.'):
        if not module.name.endswith('__main__'):
            importlib.import_module(module.name)
loaded = [m for m in sys.modules if m.split('.')[0] in ('torch', 'cupy')]
assert not loaded, loaded
print('ok')
"""


def test_core_imports_without_torch_or_cupy():
    result = subprocess.run(
        [sys.executable, "-c", BLOCKER], capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "ok"


def test_blocker_really_blocks():
    probe = BLOCKER.replace("import core, proto", "import torch")
    result = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, timeout=60
    )
    assert result.returncode != 0 and "must not be imported by core" in result.stderr
