"""The one compiled piece: the episode log's record diff (gymrpc/store/_fields.c).

Optional: without a C compiler the build still succeeds, and the store uses its pure-Python twin.
"""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension("gymrpc.store._fields", ["gymrpc/store/_fields.c"], optional=True, extra_compile_args=["-O2"])
    ]
)
