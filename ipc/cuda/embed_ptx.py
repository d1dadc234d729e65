"""Writes a C++ source that holds a PTX file as the string kBlockHashPtx (ipc/meson.build)."""
import sys

ptx = open(sys.argv[1], encoding="ascii").read()
assert ")ptx\"" not in ptx
with open(sys.argv[2], "w", encoding="ascii") as out:
    out.write("// Generated from block_hash.cu by nvcc -ptx and embed_ptx.py.\n")
    out.write('#include "ipc/cuda/cuda_driver.hpp"\n')
    out.write("namespace tensorbucket::ipc::cuda {\n")
    out.write('extern const char* const kBlockHashPtx = R"ptx(' + ptx + ')ptx";\n')
    out.write("}  // namespace tensorbucket::ipc::cuda\n")
