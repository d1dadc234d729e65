"""The module that `pip install --no-build-isolation .` put into this environment, not the
build folder's: scripts/test installs it, then runs these with no PYTHONPATH."""
import subprocess
import sys
import sysconfig
import textwrap
from pathlib import Path

import tensorbucket
import torch


def test_the_module_under_test_is_the_installed_one():
    installed = Path(sysconfig.get_paths()["platlib"]).resolve()
    assert Path(tensorbucket.__file__).resolve().parent == installed / "tensorbucket"


# The consumer imports tensorbucket before torch: the installed module finds torch's libraries
# by itself (its rpath), where a build folder's module relied on the path it was built with.
CONSUMER = textwrap.dedent("""
    import sys
    import tensorbucket
    subscriber = tensorbucket.Subscriber(sys.argv[1], timeout=30)
    with subscriber.next(timeout=30) as bucket:
        weight = bucket["weight"]
        print(bucket.version, weight.dtype, tuple(weight.shape), float(weight.sum()))
""")


def test_a_tensor_crosses_two_processes(tmp_path):
    channel = f"tbwheel-{tmp_path.name}"[:64]
    publisher = tensorbucket.Publisher(channel)
    consumer = subprocess.Popen([sys.executable, "-c", CONSUMER, channel], stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True)
    weight = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    publisher.publish({"weight": weight}, version=5, timeout=30)
    out, err = consumer.communicate(timeout=60)
    assert consumer.returncode == 0, err
    assert out.split() == ["5", "torch.float32", "(3,", "4)", "66.0"]
    assert publisher.drain(timeout=30)
    publisher.close()


def test_its_types_install_with_it():
    """A type checker finds them through py.typed (PEP 561)."""
    package = Path(tensorbucket.__file__).parent
    assert (package / "py.typed").is_file() and (package / "_C.pyi").is_file()
    assert Path(tensorbucket._C.__file__).parent == package


def ucx_and_openssl_found():
    """Asked as net/meson.build asks: the UCX this Python imports (PyPI's libucx), else the
    system's through pkg-config; OpenSSL's libcrypto through pkg-config."""
    find_ucx = Path(__file__).resolve().parents[2] / "net" / "find_ucx.py"
    ucx = (subprocess.run([sys.executable, str(find_ucx)], capture_output=True).returncode == 0
           or subprocess.run(["pkg-config", "--exists", "ucx"]).returncode == 0)
    return ucx and subprocess.run(["pkg-config", "--exists", "libcrypto"]).returncode == 0


def test_the_network_side_installs_where_ucx_is(tmp_path):
    """pip's build links the network side into the module where UCX and OpenSSL are found
    (scripts/install-deps installs both): there, a Server starts and listens."""
    found = ucx_and_openssl_found()
    if not found:
        assert not hasattr(tensorbucket._C, "Server")
        return
    token = tmp_path / "token"
    token.write_text("a shared secret of the tests")
    token.chmod(0o600)
    channel = f"tbwheelnet-{tmp_path.name}"[:64]
    with tensorbucket.Publisher(channel, min_consumers=0):
        with tensorbucket.Server(channel, "127.0.0.1:0", token, timeout=10) as server:
            assert server.address.startswith("127.0.0.1:") and not server.address.endswith(":0")
            server.serve(0.1)
            assert server.peers == 0
