"""Where the UCX of the Python that runs this script is: PyPI's build (the `libucx` package of
libucx-cu13, pinned in requirements.txt), which carries headers and shared libraries. Prints
`version<TAB>...` and `prefix<TAB>...` (include/ and lib/ are under it). Exits 1, saying why on
stderr, where that Python has none."""
import os
import sys

try:
    import libucx
except Exception as error:  # noqa: BLE001: a broken package is as good as none here
    sys.exit(f"{sys.executable} cannot import libucx: {error}")

prefix = os.path.dirname(libucx.__file__)
if not os.path.isfile(os.path.join(prefix, "include", "ucp", "api", "ucp.h")):
    sys.exit(f"libucx at {prefix} has no headers")
print(f"version\t{libucx.__version__}")
print(f"prefix\t{prefix}")
