"""The optional native loops (tsukimi/transfer/_native.c, loaded by tsukimi/transfer/native.py).
Everything else is in pyproject.toml. `optional=True`: without a C compiler the install still
succeeds and tsukimi runs its Python code instead."""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension("tsukimi.transfer._native", ["tsukimi/transfer/_native.c"], optional=True, extra_compile_args=["-O2"])
    ]
)
