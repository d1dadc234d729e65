"""What meson needs to build against the torch of the Python that runs this script: one
`key<TAB>value` a line (version, cuda, cxx11_abi, include, lib; folders joined by ':').
Exits 1, saying why on stderr, where that Python has no torch."""
import sys

try:
    import torch
    from torch.utils import cpp_extension
except Exception as error:  # noqa: BLE001: a broken torch is as good as none here
    sys.exit(f"{sys.executable} cannot import torch: {error}")

fields = {
    "version": torch.__version__.split("+")[0],
    "full_version": torch.__version__,
    "cuda": torch.version.cuda or "",
    "cxx11_abi": str(int(torch._C._GLIBCXX_USE_CXX11_ABI)),
    "include": ":".join(cpp_extension.include_paths()),
    "lib": ":".join(cpp_extension.library_paths()),
}
for key, value in fields.items():
    print(f"{key}\t{value}")
