"""Installs the engine's packages under one namespace, `core_engine.<package>`, while the
repository keeps the design's top-level folders (frontend/, core/, worker/, kernels/, proto/,
common/): generic names such as `proto` would collide with other distributions installed
beside the engine (proto-plus installs a top-level `proto` too). Everything else about the
distribution is in pyproject.toml."""

from setuptools import find_packages, setup

NAMESPACE = "core_engine"
PACKAGES = ("common", "proto", "core", "worker", "kernels", "frontend")
PACKAGE_DATA = {
    "kernels.cpu": ["*.c", "*.h"],
    "kernels.cuda": ["*.cu", "*.cuh"],
    "frontend.openai": ["web/*.html", "web/*.js", "web/*.css"],
}


def installed_packages() -> list[str]:
    """Each package and every subpackage of it, under the namespace."""
    names = []
    for package in PACKAGES:
        names.append(package)
        names.extend(f"{package}.{sub}" for sub in find_packages(where=package))
    return [f"{NAMESPACE}.{name}" for name in names]


setup(
    packages=installed_packages(),
    package_dir={f"{NAMESPACE}.{package}": package for package in PACKAGES},
    package_data={f"{NAMESPACE}.{name}": files for name, files in PACKAGE_DATA.items()},
)
