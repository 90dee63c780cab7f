"""The package's one C extension (everything else about the package is in pyproject.toml).

gdn_server/_wire.c does the decode RPCs' per-message wire work: a bf16 step's parse, checks and
digests, and the reply's encoding. It is the only implementation of that work, so installing
needs a C compiler and the Python headers. It is declared here rather than in pyproject.toml,
where setuptools still calls its `ext-modules` table experimental and warns so on every build.
"""
from setuptools import Extension, setup

setup(ext_modules=[Extension(
    "gdn_server._wire", ["gdn_server/_wire.c"],
    extra_compile_args=["-O3", "-Wall", "-Wextra", "-Wno-unused-parameter"],
)])
