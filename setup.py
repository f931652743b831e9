"""Only the native part of the build: the cpu_int4 kernels as a plain C shared library (loaded with
ctypes, no Python API). Everything else is declared in pyproject.toml."""
import hashlib
from pathlib import Path

from setuptools import Extension, setup

SRC = "plugins/cpu_int4/csrc/glmi4.c"
SHA = hashlib.sha256(Path(SRC).read_bytes()).hexdigest()   # lets the loader tell a stale build

setup(ext_modules=[Extension(
    "glmcore_plugins.cpu_int4._glmi4", sources=[SRC], define_macros=[("GLMI4_SRC_SHA", f'"{SHA}"')],
    extra_compile_args=["-O3", "-std=c11", "-pthread"],   # no -march: fast paths chosen at run time
    extra_link_args=["-pthread"], libraries=["m"], optional=True)])
