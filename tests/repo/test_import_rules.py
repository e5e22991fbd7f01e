"""Every import rule of the README's layout section, checked on the source (static) and at
run time.

Statically, every `import` in a package (at any depth, lazy ones included) may name only the
packages of ours its row of the table allows. At run time, `core/`, `proto/` and `common/` load
on a machine with no torch and no GPU: a subprocess that refuses torch, cupy, worker and kernels
imports every one of their modules.
"""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
NAMESPACE = "core_engine"
# The engine's packages, installed as core_engine.<package> (setup.py) from these folders.
PRODUCT_PACKAGES = ("common", "proto", "core", "worker", "kernels", "frontend")
OURS = (*PRODUCT_PACKAGES, "tools", "scripts", "benchmarks", "tests")
# Package -> the packages of ours it may import (itself included).
ALLOWED = {
    "common": {"common"},
    "proto": {"common", "proto"},
    "core": {"common", "proto", "core"},
    "worker": {"common", "proto", "kernels", "worker"},
    "kernels": {"common", "kernels"},
    "frontend": {"common", "proto", "frontend"},
    # Tooling for tests and benchmarks only (kernel resource and SASS analysis, the transformers
    # reference model): it may use the engine, the engine never uses it, and it is not shipped.
    "tools": {"common", "proto", "worker", "kernels", "tools"},
    # The user tools (generate, the GGUF converter) use the engine only.
    "scripts": {"common", "proto", "core", "worker", "kernels", "frontend", "scripts"},
    # Benchmarks use the engine and the tooling, never the tests' helpers.
    "benchmarks": {
        "common",
        "proto",
        "core",
        "worker",
        "kernels",
        "frontend",
        "tools",
        "benchmarks",
    },
    # Tests use the engine and the tooling, never a benchmark as a library (but the tests of
    # the benchmarks, SCRIPT_TESTS).
    "tests": {"common", "proto", "core", "worker", "kernels", "frontend", "tools", "tests"},
}
# Device subpackages of kernels/ that must not import each other: the CPU path loads no CuPy
# or NVRTC code, the CUDA path no C kernel loader.
SEPARATE_KERNEL_PACKAGES = ("kernels.cpu", "kernels.cuda")
# Test folders whose subject is the benchmarks and the user tools themselves.
SCRIPT_TESTS = ("tests/benchmarks/", "tests/e2e/test_gguf_to_bf16.py")
# Third-party packages a package must not import at module level.
FORBIDDEN_AT_IMPORT = {
    "common": {"torch", "cupy", "zmq"},
    "proto": {"torch", "cupy"},
    "core": {"torch", "cupy"},
    "frontend": {"torch", "cupy"},
}
# What an import of one of the engine's packages by its bare name is reported as.
BARE = "bare:"


def package_of(module: str) -> str:
    """The package of ours (or the third-party distribution) an absolute module name names:
    `core_engine.core.x` -> "core"; an engine package by its bare name, which the installed
    engine does not have (`core.x`), -> "bare:core"."""
    parts = module.split(".")
    if parts[0] == NAMESPACE and len(parts) > 1:
        return parts[1]
    if parts[0] in PRODUCT_PACKAGES:
        return BARE + parts[0]
    return parts[0]


def imported_packages(tree: ast.AST, top_level_only: bool = False) -> set[str]:
    """`package_of` each absolute module name `tree` imports."""
    nodes = tree.body if top_level_only else ast.walk(tree)
    names = set()
    for node in nodes:
        if isinstance(node, ast.Import):
            names.update(package_of(alias.name) for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(package_of(node.module))
    return names


def violations(package: str) -> list[str]:
    found = []
    for path in sorted((ROOT / package).rglob("*.py")):
        tree = ast.parse(path.read_text(), str(path))
        allowed = set(ALLOWED[package])
        if package == "tests" and str(path.relative_to(ROOT)).startswith(SCRIPT_TESTS):
            allowed.update({"benchmarks", "scripts"})
        imported = imported_packages(tree)
        for name in sorted(imported & set(OURS) - allowed):
            found.append(f"{path.relative_to(ROOT)} imports {name}")
        for name in sorted(n for n in imported if n.startswith(BARE)):
            found.append(f"{path.relative_to(ROOT)} imports {name} outside {NAMESPACE}")
        forbidden = FORBIDDEN_AT_IMPORT.get(package, set())
        for name in sorted(imported_packages(tree, top_level_only=True) & forbidden):
            found.append(f"{path.relative_to(ROOT)} imports {name} at module level")
    return found


@pytest.mark.parametrize("package", sorted(ALLOWED))
def test_package_imports_only_what_the_architecture_allows(package):
    assert (ROOT / package).is_dir()
    assert violations(package) == []


def imported_modules(tree: ast.AST) -> set[str]:
    """Full absolute module names `tree` imports (`from a.b import c` gives a.b and a.b.c)."""
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module)
            names.update(f"{node.module}.{alias.name}" for alias in node.names)
    return names


def kernel_package_violations() -> list[str]:
    found = []
    for package in SEPARATE_KERNEL_PACKAGES:
        others = [f"{NAMESPACE}.{p}" for p in SEPARATE_KERNEL_PACKAGES if p != package]
        folder = ROOT.joinpath(*package.split("."))
        for path in sorted(folder.rglob("*.py")):
            for module in sorted(imported_modules(ast.parse(path.read_text(), str(path)))):
                if any(module == o or module.startswith(o + ".") for o in others):
                    found.append(f"{path.relative_to(ROOT)} imports {module}")
    return found


def test_cpu_and_cuda_kernels_do_not_import_each_other():
    assert kernel_package_violations() == []


def test_kernel_package_checker_sees_a_cross_import():
    source = "from core_engine.kernels.cuda import backend\nimport core_engine.kernels.cpu.x\n"
    modules = imported_modules(ast.parse(source))
    assert {"core_engine.kernels.cuda.backend", "core_engine.kernels.cpu.x"} <= modules


def test_only_the_engine_is_shipped_and_only_under_its_namespace():
    setup_source = (ROOT / "setup.py").read_text()
    shipped = ast.literal_eval(re.search(r"^PACKAGES = (\(.*?\))$", setup_source, re.M).group(1))
    assert shipped == PRODUCT_PACKAGES  # no tools, scripts, tests or benchmarks
    assert re.search(rf'^NAMESPACE = "{NAMESPACE}"$', setup_source, re.M)


def product_modules() -> dict[str, Path]:
    """Dotted module name (as installed, core_engine.<package>...) -> file, for every module
    of the shipped packages."""
    modules = {}
    for package in PRODUCT_PACKAGES:
        for path in (ROOT / package).rglob("*.py"):
            parts = list(path.relative_to(ROOT).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            modules[".".join([NAMESPACE, *parts])] = path
    return modules


def module_import_graph(modules: dict[str, Path]) -> dict[str, set[str]]:
    """Module -> the modules of ours it imports, lazy imports included; `from pkg import sub`
    counts as importing the submodule `pkg.sub` (not the package's __init__) when it is one."""
    graph = {}
    for name, path in modules.items():
        imported = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                imported.update(alias.name for alias in node.names if alias.name in modules)
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module in modules:
                submodules = [f"{node.module}.{alias.name}" for alias in node.names]
                imported.update(s for s in submodules if s in modules)
                if not all(s in modules for s in submodules):
                    imported.add(node.module)
        graph[name] = imported - {name}
    return graph


def import_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Every group of modules that import each other in a circle (strongly connected
    components of more than one module), each sorted."""
    order: dict[str, int] = {}
    lowest: dict[str, int] = {}
    stack: list[str] = []
    cycles = []

    def visit(module: str) -> None:
        order[module] = lowest[module] = len(order)
        stack.append(module)
        for imported in sorted(graph[module]):
            if imported not in order:
                visit(imported)
                lowest[module] = min(lowest[module], lowest[imported])
            elif imported in stack:
                lowest[module] = min(lowest[module], order[imported])
        if lowest[module] == order[module]:
            component = stack[stack.index(module) :]
            del stack[stack.index(module) :]
            if len(component) > 1:
                cycles.append(sorted(component))

    for module in sorted(graph):
        if module not in order:
            visit(module)
    return cycles


def test_no_module_of_the_engine_imports_itself_in_a_circle():
    assert import_cycles(module_import_graph(product_modules())) == []


def test_cycle_finder_sees_a_circle_through_a_lazy_import():
    graph = {"a.x": {"a.y"}, "a.y": {"a.z"}, "a.z": {"a.x"}, "a.w": {"a.x"}, "b": set()}
    assert import_cycles(graph) == [["a.x", "a.y", "a.z"]]
    tree = ast.parse("def f():\n    from core_engine.worker.x import y\n")
    assert "core_engine.worker.x" in imported_modules(tree)


def test_checker_sees_a_forbidden_import_and_a_bare_engine_name():
    source = (
        "import os\ndef f():\n    from core_engine.worker.worker import Worker\n"
        "from torch import nn\nimport proto.codec\n"
    )
    tree = ast.parse(source)
    assert imported_packages(tree) == {"os", "worker", "torch", "bare:proto"}
    assert imported_packages(tree, top_level_only=True) == {"os", "torch", "bare:proto"}


BLOCKER = """
import sys
class Blocker:
    def find_spec(self, name, path=None, target=None):
        if name.split('.')[0] in ('torch', 'cupy') or name.startswith(
            ('core_engine.worker', 'core_engine.kernels')
        ):
            raise ImportError(f'{name} must not be imported by core')
sys.meta_path.insert(0, Blocker())
import importlib, pkgutil
import core_engine.common as common, core_engine.core as core, core_engine.proto as proto
for package in (common, core, proto):
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
    probe = BLOCKER.replace(
        "import core_engine.common as common, core_engine.core as core, core_engine.proto as proto",
        "import torch",
    )
    result = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, timeout=60
    )
    assert result.returncode != 0 and "must not be imported by core" in result.stderr
