"""The Python surface as a user meets it: help(), signatures, the type stubs and a type checker,
argument errors, and error messages."""
import ast
import importlib.util
import inspect
import os
import pathlib
import re
import shutil
import subprocess
import sys
import time

import pytest
import torch

import tensorbucket
from tensorbucket import _C

ROOT = pathlib.Path(__file__).resolve().parents[2]
PACKAGE = pathlib.Path(tensorbucket.__file__).parent
PUBLIC_CLASSES = (tensorbucket.Publisher, tensorbucket.Subscriber, tensorbucket.Bucket, tensorbucket.Update,
                  tensorbucket.Server)


@pytest.fixture
def channel(request):
    name = "".join(c if c.isalnum() or c in "._-" else "-" for c in request.node.name)
    return f"tbpy-{os.getpid()}-{name}"[:64]


def public_members(cls):
    """Its members, and those it inherits from the package's own classes."""
    seen = set()
    for klass in cls.__mro__:
        if klass.__module__ != "tensorbucket":
            continue
        for name, member in vars(klass).items():
            if name not in seen and (not name.startswith("_") or name in ("__init__", "__enter__", "__exit__")):
                seen.add(name)
                yield name, member


def test_every_class_method_and_property_has_a_docstring():
    assert tensorbucket.__doc__ and tensorbucket.load_into.__doc__
    for cls in PUBLIC_CLASSES:
        assert cls.__doc__ and len(cls.__doc__.splitlines()) > 1, cls
        for name, member in public_members(cls):
            if name in ("__enter__", "__exit__"):
                continue
            assert inspect.getdoc(member), f"{cls.__name__}.{name}"


def test_signatures_name_every_type():
    for cls in PUBLIC_CLASSES:
        for name, member in public_members(cls):
            function = member.fget if isinstance(member, property) else member
            signature = inspect.signature(function)
            assert signature.return_annotation is not inspect.Signature.empty, f"{cls.__name__}.{name}"
            for parameter in list(signature.parameters.values())[1:]:  # after self
                assert parameter.annotation is not inspect.Parameter.empty, f"{cls.__name__}.{name}({parameter})"
    publish = str(inspect.signature(tensorbucket.Publisher.publish))
    assert "tensors: Union[collections.abc.Mapping[str, torch.Tensor], " \
           "collections.abc.Sequence[Tuple[str, torch.Tensor]]]" in publish, publish
    assert "timeout: Optional[float] = 10.0" in publish, publish
    created = str(inspect.signature(tensorbucket.Publisher))
    assert created.startswith("(channel: str, slots: int = 2, ") and "mode: int = 0o600" in created, created
    assert "policy: Literal['block', 'latest'] = 'block'" in created, created
    assert str(inspect.signature(tensorbucket.Subscriber.next)).endswith("-> Optional[tensorbucket.Bucket]")


def test_help_shows_the_signature_and_the_words():
    text = subprocess.run([sys.executable, "-c", "import tensorbucket; help(tensorbucket.Publisher)"],
                          capture_output=True, text=True, check=True, env=dict(os.environ, PAGER="cat")).stdout
    assert "publish(self, tensors: Union[" in text and "mode: int = 0o600" in text, text
    assert "Timeout then names the consumer that held" in text, text


def test_bad_argument_types_and_values_are_named():
    with pytest.raises(TypeError, match="^timeout must be seconds \\(an int or a float\\) or None, not str$"):
        tensorbucket.Subscriber("tbpy-never", timeout="5")
    with pytest.raises(TypeError, match="^slots must be an int, not float$"):
        tensorbucket.Publisher("tbpy-never", slots=2.0)
    with pytest.raises(TypeError, match="^checksum must be True or False, not int$"):
        tensorbucket.Publisher("tbpy-never", checksum=1)
    with pytest.raises(TypeError, match="^channel must be a str, not bytes$"):
        tensorbucket.Publisher(b"tbpy-never")


def test_bad_values_raise_value_errors_that_say_the_rule(channel):
    with tensorbucket.Publisher(channel, min_consumers=0) as publisher:
        with pytest.raises(ValueError, match="^version must be >= 0, not -1$") as refused:
            publisher.publish({"w": torch.ones(2)}, version=-1)
        assert isinstance(refused.value, tensorbucket.InvalidArgument) and refused.value.code == "InvalidArgument"
        with pytest.raises(ValueError, match="^bucket_index must be <= 4294967295, not 4294967296$"):
            publisher.publish({"w": torch.ones(2)}, bucket_index=2**32)
        with pytest.raises(ValueError, match="^timeout must be seconds >= 0"):
            publisher.drain(timeout=-1)
        assert publisher.published == 0
    with pytest.raises(ValueError, match="policy"):
        tensorbucket.Publisher(channel, policy="newest")


def test_errors_show_as_tensorbucket_classes_and_say_their_kind_once(channel):
    assert tensorbucket.Timeout.__module__ == "tensorbucket"
    assert issubclass(tensorbucket.Timeout, TimeoutError) and issubclass(tensorbucket.InvalidArgument, ValueError)
    result = subprocess.run([sys.executable, "-c", "import tensorbucket; tensorbucket.Subscriber('tbpy-none', timeout=0)"],
                            capture_output=True, text=True)
    last = result.stderr.strip().splitlines()[-1]
    assert last == "tensorbucket.ChannelError: ChannelMissing: channel 'tbpy-none' had no live producer within 0.0 s", last


def test_a_long_manifest_mismatch_leads_with_a_summary_and_keeps_every_name(channel):
    model = torch.nn.Sequential(*(torch.nn.Linear(8, 8) for _ in range(8)))
    sent = {f"module.{name}": tensor for name, tensor in model.state_dict().items()}  # a DDP prefix
    with pytest.raises(tensorbucket.ManifestError) as mismatch:
        tensorbucket.load_into(model, sent)
    message = str(mismatch.value)
    assert message.startswith("ManifestMismatch: bucket does not match the expected manifest (16 missing, "
                              "16 unexpected): missing '0.weight', '0.bias', '1.weight' and 13 more; "
                              "unexpected 'module.0.weight', "), message
    assert len(message) < 250, message
    details = mismatch.value.details.splitlines()
    assert len(details) == 32 and "missing '7.bias'" in details and "unexpected 'module.7.bias'" in details


def test_inference_tensors_are_refused_with_the_hint_first():
    with torch.inference_mode():
        model = torch.nn.Sequential(*(torch.nn.Linear(4, 4) for _ in range(40)))
    with pytest.raises(tensorbucket.InvalidArgument) as refused:
        tensorbucket.load_into(model, model.state_dict())
    message = str(refused.value)
    assert message.startswith("cannot load into inference tensors outside inference mode (80 tensors): "
                              "'0.weight', '0.bias', '1.weight' and 77 more; load under torch.inference_mode()"), message
    assert len(refused.value.details.splitlines()) == 80


def test_a_received_bucket_and_update_carry_monotonic_timings(channel):
    with tensorbucket.Publisher(channel, min_consumers=0) as publisher, \
            tensorbucket.Subscriber(channel, timeout=5) as subscriber:
        before = time.monotonic_ns()
        publisher.publish({"w": torch.ones(2)}, bucket_count=1)
        with subscriber.next_update(timeout=5) as update:
            after = time.monotonic_ns()
            assert before <= update.publish_start_ns <= update.published_ns <= update.received_ns <= after
            bucket = update.buckets[0]
            assert before <= bucket.publish_start_ns <= bucket.published_ns <= bucket.received_ns <= after


def type_check(*paths):
    """mypy as the project configures it (pyproject.toml), on `paths`; its error lines. Skips
    where mypy is not installed (the project's environment has it; a GPU machine's may not)."""
    if importlib.util.find_spec("mypy") is None:
        pytest.skip(f"mypy is not installed for {sys.executable}")
    env = {key: value for key, value in os.environ.items() if key != "LD_PRELOAD"}  # a sanitizer's runtime
    env["MYPYPATH"] = str(PACKAGE.parent)
    result = subprocess.run([sys.executable, "-m", "mypy", "--config-file", str(ROOT / "pyproject.toml"),
                             "--no-incremental", f"--cache-dir={os.devnull}", "--no-error-summary", "--show-absolute-path", *map(str, paths)],
                            capture_output=True, text=True, env=env, cwd=ROOT)
    assert result.returncode in (0, 1), result.stderr
    return [line for line in result.stdout.splitlines() if ": error: " in line]


MISUSE = '''
import torch
import tensorbucket

publisher = tensorbucket.Publisher("x", slots="2")  # wrong
publisher.publish([torch.ones(2)])  # wrong
publisher.publish({"w": torch.ones(2)}, version=1, timeout=None)
subscriber = tensorbucket.Subscriber("x", follow=True)
bucket = subscriber.next(timeout="5")  # wrong
if bucket is not None:
    version: str = bucket.version  # wrong
    weight: torch.Tensor = bucket["w"]
for update in subscriber.updates():
    tensorbucket.load_into(torch.nn.Linear(2, 2), update)
    tensorbucket.load_into(torch.nn.Linear(2, 2), update.version)  # wrong
'''


def test_the_stubs_type_check_the_package_and_the_examples_and_catch_misuse(tmp_path):
    """The package's own annotations over _C.pyi, strictly; the examples as a user writes them;
    and a user's mistakes, each found on its line."""
    misuse = tmp_path / "misuse.py"
    misuse.write_text(MISUSE)
    errors = type_check(PACKAGE, ROOT / "examples", misuse)
    assert all(line.startswith(str(misuse)) for line in errors), "\n".join(errors)
    wrong = {i + 1 for i, line in enumerate(MISUSE.splitlines()) if line.endswith("# wrong")}
    found = {int(line.split(":")[1]) for line in errors}
    assert found == wrong, "\n".join(errors)


def test_the_stub_of_the_bindings_names_what_they_have():
    """_C.pyi against _C itself: the same classes, and in each the same public members."""
    stub = ast.parse((PACKAGE / "_C.pyi").read_text())
    stubbed = {node.name: {item.name for item in node.body if isinstance(item, ast.FunctionDef)} - {"__init__"}
               for node in stub.body if isinstance(node, ast.ClassDef)}
    runtime = {name: value for name, value in vars(_C).items() if isinstance(value, type)}
    built_without_ucx = set() if hasattr(_C, "Server") else {"Server"}
    assert stubbed.keys() - built_without_ucx == runtime.keys()
    for name, cls in runtime.items():
        if issubclass(cls, BaseException):
            continue
        members = {member for member in vars(cls)
                   if not member.startswith("_") or member in ("__len__", "__contains__", "__getitem__")}
        assert stubbed[name] == members, name
    functions = {node.name for node in stub.body if isinstance(node, ast.FunctionDef)}
    assert functions == {name for name, value in vars(_C).items() if callable(value) and not isinstance(value, type)
                         and not name.startswith("_")}


def test_the_package_ships_its_types():
    assert (PACKAGE / "py.typed").exists() and (PACKAGE / "_C.pyi").exists()
    assert re.fullmatch(r"\d+\.\d+\.\d+", tensorbucket.__version__)


def test_numbers_and_flags_of_numpy_and_torch_are_taken_as_the_bindings_took_them(channel):
    import numpy
    with tensorbucket.Publisher(channel, slots=numpy.int64(2), checksum=numpy.True_, min_consumers=torch.tensor(0)) \
            as publisher:
        publisher.publish({"w": torch.ones(2)}, version=torch.tensor(3), timeout=numpy.float32(5))
        assert publisher.drain(timeout=10**400)  # past any float: no limit
    with pytest.raises(TypeError, match="^checksum must be True or False, not int$"):
        tensorbucket.Publisher(channel, checksum=1)
    with pytest.raises(TypeError, match="^version must be an int, not float$"):
        tensorbucket.Publisher(channel, min_consumers=0).publish({}, version=1.0)


def test_buckets_and_updates_are_handles_compared_by_identity(channel):
    import weakref
    with tensorbucket.Publisher(channel, min_consumers=0) as publisher, \
            tensorbucket.Subscriber(channel, timeout=5) as subscriber:
        publisher.publish({"w": torch.ones(2)})
        publisher.publish({"w": torch.ones(2)})
        first, second = subscriber.next(timeout=5), subscriber.next(timeout=5)
        assert first == first and first != second and len({first, second}) == 2
        assert weakref.ref(first)() is first
        assert first.get(5) is None and first.get("w") is not None and 5 not in first
        first.release()
        second.release()


def test_updates_releases_an_update_when_the_loop_asks_for_the_next_only(channel):
    with tensorbucket.Publisher(channel, min_consumers=0, slots=4) as publisher, \
            tensorbucket.Subscriber(channel, timeout=5) as subscriber:
        with pytest.raises(TypeError, match="^timeout must be seconds"):
            subscriber.updates(timeout="5")  # at the call, not at the first update
        for version in range(3):
            publisher.publish({"w": torch.full((2,), float(version))}, version=version)
        updates = subscriber.updates(timeout=5)
        first = next(updates)
        assert first["w"][0] == 0  # still held
        for update in updates:
            if update.version == 1:
                break
        assert update["w"][0] == 1  # the one the loop broke out with is still held
        with pytest.raises(tensorbucket.InvalidArgument, match="^update was released$"):
            first["w"]  # released when the loop asked for the next
        update.release()


def test_a_dtype_and_shape_mismatch_of_one_tensor_counts_once():
    target = {"w": torch.zeros(4), "b": torch.zeros(2)}
    with pytest.raises(tensorbucket.ManifestError) as mismatch:
        tensorbucket.load_into(target, {"w": torch.zeros(2, dtype=torch.float64), "b": torch.zeros(2)})
    assert str(mismatch.value) == ("ManifestMismatch: bucket does not match the expected manifest (1 mismatched): "
                                   "'w' has dtype F64, expected F32, and shape [2], expected [4]")


@pytest.mark.skipif(shutil.which("readelf") is None, reason="no readelf here")
def test_the_module_uses_the_shared_cpp_runtime_torch_uses():
    # A module with its own copy of libstdc++ (where the compiler links it statically by
    # default) mixes it with torch's shared one: an error message with a number in it crashed.
    dynamic = subprocess.run(["readelf", "--wide", "--dynamic", _C.__file__], capture_output=True, text=True,
                             check=True).stdout
    assert re.search(r"\(NEEDED\).*\[libstdc\+\+\.so", dynamic), dynamic
    symbols = subprocess.run(["readelf", "--wide", "--dyn-syms", _C.__file__], capture_output=True, text=True,
                             check=True).stdout
    # Out-of-line members of libstdc++ itself (never instantiated in our code) must not be ours.
    rows = [line.split() for line in symbols.splitlines()]
    defined = [row[7] for row in rows if len(row) >= 8 and row[0].endswith(":") and row[6] != "UND"]
    private = [name for name in defined if name.startswith(("_ZNSo9_M_insert", "_ZNSt6locale", "_ZNKSt7codecvt"))]
    assert private == [], private[:5]
