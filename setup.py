"""Build hook for the optional C fast paths of recording: fold's recorders
(``fold/_crecord.c``) and autobatch's lazy calls (``fold/_clazy.c``).

Everything else is configured in pyproject.toml.  The extensions are optional: where they
cannot be compiled (no C compiler), the install goes on and fold records with its Python
code, which gives the same graphs.
"""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension("fold._crecord", ["fold/_crecord.c"], optional=True),
        Extension("fold._clazy", ["fold/_clazy.c"], optional=True),
    ]
)
