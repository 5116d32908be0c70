"""Build hook for the optional C fast path of fold's recorders (``fold/_crecord.c``).

Everything else is configured in pyproject.toml.  The extension is optional: where it cannot
be compiled (no C compiler), the install goes on and fold records with its generated Python
recorders, which give the same graphs.
"""

from setuptools import Extension, setup

setup(ext_modules=[Extension("fold._crecord", ["fold/_crecord.c"], optional=True)])
