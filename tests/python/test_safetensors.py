"""safetensors files in and out, against the `safetensors` package: files it writes publish
correctly (Publisher.publish_file), files tensorbucket.save() writes it reads back bit for bit,
for every dtype both carry, empty and 0-dim tensors, and a 1 GiB file; hostile headers are
refused naming the entry, and nothing is published."""
import json
import os
import re
import struct
import subprocess
import sys
import time

import pytest
import torch

import tensorbucket

safetensors = pytest.importorskip("safetensors")
from safetensors import safe_open  # noqa: E402
from safetensors.torch import load_file, save_file  # noqa: E402

# Every dtype tensorbucket and safetensors both carry, as torch names it.
DTYPES = [torch.bool, torch.uint8, torch.int8, torch.int16, torch.uint16, torch.int32, torch.uint32, torch.int64,
          torch.uint64, torch.float16, torch.bfloat16, torch.float32, torch.float64, torch.float8_e4m3fn,
          torch.float8_e5m2]


@pytest.fixture
def channel(request):
    name = "".join(c if c.isalnum() else "-" for c in request.node.name)
    return f"tbst-{os.getpid()}-{name}"[:56]  # room for a suffix


def random_tensor(dtype, shape, seed):
    """Every bit pattern of the dtype possible (NaNs included): made as bytes, then viewed."""
    generator = torch.Generator().manual_seed(seed)
    itemsize = torch.empty(0, dtype=dtype).element_size()
    numel = 1
    for dim in shape:
        numel *= dim
    raw = torch.randint(0, 256, (numel * itemsize,), dtype=torch.uint8, generator=generator)
    if dtype == torch.bool:
        return (raw % 2).to(torch.bool).reshape(shape)
    return raw.view(dtype).reshape(shape)


def same_bits(a, b):
    as_bytes = lambda t: t.contiguous().reshape(-1).view(torch.uint8)  # noqa: E731  # 0-dim too
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(as_bytes(a), as_bytes(b))


def every_dtype():
    tensors = {}
    for i, dtype in enumerate(DTYPES):
        name = str(dtype).removeprefix("torch.")
        tensors[f"{name}.matrix"] = random_tensor(dtype, (3, 17), i)
        tensors[f"{name}.scalar"] = random_tensor(dtype, (), 100 + i)
        tensors[f"{name}.empty"] = random_tensor(dtype, (0, 4), 200 + i)
    return tensors


def channel_pair(channel, slots):
    """A Publisher and a Subscriber attached to it, in this thread: with as many slots as the
    update has buckets, the publish waits for nobody, and next_update() takes it after."""
    publisher = tensorbucket.Publisher(channel, slots=slots, min_consumers=0)
    return publisher, tensorbucket.Subscriber(channel, timeout=30)


def test_a_file_the_package_wrote_publishes_bit_for_bit_in_every_dtype(tmp_path, channel):
    tensors = every_dtype()
    save_file(tensors, tmp_path / "model.safetensors", metadata={"format": "pt"})
    expected = load_file(tmp_path / "model.safetensors")
    publisher, subscriber = channel_pair(channel, slots=8)
    with publisher, subscriber:
        assert 1 < publisher.publish_file(tmp_path / "model.safetensors", version=9, bucket_bytes=4096) <= 8
        update = subscriber.next_update(timeout=60)
        assert update.version == 9
        assert sorted(update.keys()) == sorted(expected)
        for name, tensor in expected.items():
            assert same_bits(update[name], tensor), name
        update.release()


def test_a_saved_bucket_and_update_read_back_bit_for_bit_with_their_metadata(tmp_path, channel):
    tensors = every_dtype()
    names = sorted(tensors)
    halves = [{name: tensors[name] for name in names[:20]}, {name: tensors[name] for name in names[20:]}]
    publisher, subscriber = channel_pair(channel, slots=4)
    with publisher, subscriber:
        for index, half in enumerate(halves):
            publisher.publish(half, version=31, bucket_index=index, bucket_count=2, timeout=30)
        update = subscriber.next_update(timeout=60)
        tensorbucket.save(update, tmp_path / "update.safetensors")
        tensorbucket.save(update.buckets[1], str(tmp_path / "second.safetensors"))
        update.release()
    loaded = load_file(tmp_path / "update.safetensors")
    assert sorted(loaded) == names
    for name in names:
        assert same_bits(loaded[name], tensors[name]), name
    with safe_open(tmp_path / "update.safetensors", framework="pt") as f:
        assert f.metadata() == {"tensorbucket.version": "31", "tensorbucket.bucket_count": "2"}
    with safe_open(tmp_path / "second.safetensors", framework="pt") as f:
        assert f.metadata() == {"tensorbucket.version": "31", "tensorbucket.bucket_count": "2",
                                "tensorbucket.bucket_index": "1"}
        assert sorted(f.keys()) == names[20:]
    # and back again: the saved file publishes its version by itself
    publisher, subscriber = channel_pair(channel + "-again", slots=4)
    with publisher, subscriber:
        publisher.publish_file([tmp_path / "update.safetensors"])
        again = subscriber.next_update(timeout=60)
        assert again.version == 31
        assert all(same_bits(again[name], tensors[name]) for name in names)
        again.release()


def test_dtypes_one_side_lacks_are_refused_clearly(tmp_path, channel):
    save_file({"z": torch.ones(3, dtype=torch.complex64)}, tmp_path / "complex.safetensors")
    with tensorbucket.Publisher(channel, min_consumers=0) as publisher:
        with pytest.raises(tensorbucket.ManifestError, match="tensor 'z' has dtype 'C64'") as refused:
            publisher.publish_file(tmp_path / "complex.safetensors")
        assert refused.value.code == "UnsupportedDtype"
        assert publisher.published == 0


def write_raw(path, header, data=b""):
    text = json.dumps(header).encode() if isinstance(header, dict) else header
    path.write_bytes(struct.pack("<Q", len(text)) + text + data)
    return path


@pytest.mark.parametrize("header, data, code, says", [
    ({"w": {"dtype": "F32", "shape": [3], "data_offsets": [0, 8]}}, 8, "BadShape", "'w' is F32 [3], 12 bytes"),
    ({"w": {"dtype": "U8", "shape": [8], "data_offsets": [0, 8]}}, 4, "OutOfBounds", "'w' ends at byte 8"),
    ({"a": {"dtype": "U8", "shape": [4], "data_offsets": [0, 4]},
      "b": {"dtype": "U8", "shape": [2], "data_offsets": [3, 5]}}, 8, "Overlap", "'a' [0, 4) and 'b' [3, 5)"),
    (b'{"w":{"dtype":"U8","shape":[1],"data_offsets":[0,1]},"w":{"dtype":"U8","shape":[1],"data_offsets":[1,2]}}',
     2, "DuplicateName", "entry 'w' appears twice"),
    ({"w": {"dtype": "U8", "shape": [-1], "data_offsets": [0, 0]}}, 0, "BadShape", "negative dim"),
    (b'{"w": {"dtype": "U8"', 0, "HeaderCorrupt", "does not parse"),
])
def test_hostile_headers_are_refused_naming_the_entry_and_publish_nothing(tmp_path, channel, header, data, code, says):
    good = write_raw(tmp_path / "good.safetensors", {"g": {"dtype": "U8", "shape": [2], "data_offsets": [0, 2]}}, b"ab")
    bad = write_raw(tmp_path / "bad.safetensors", header, bytes(data))
    with tensorbucket.Publisher(channel, min_consumers=0) as publisher:
        with pytest.raises(tensorbucket.ManifestError) as refused:
            publisher.publish_file([good, bad])
        assert refused.value.code == code
        assert str(bad) in str(refused.value) and says in str(refused.value), str(refused.value)
        assert publisher.published == 0
        with pytest.raises(tensorbucket.Error, match="cannot open"):
            publisher.publish_file(tmp_path / "absent.safetensors")
        with pytest.raises(TypeError):
            publisher.publish_file(42)  # type: ignore[arg-type]


def test_save_refuses_what_is_not_a_received_bucket(tmp_path):
    with pytest.raises(TypeError, match="Bucket or Update"):
        tensorbucket.save({"w": torch.ones(2)}, tmp_path / "x.safetensors")  # type: ignore[arg-type]
    assert list(tmp_path.iterdir()) == []


_SAVE_AND_WAIT = """
import sys, torch, tensorbucket
channel, path = sys.argv[1:]
with tensorbucket.Publisher(channel) as publisher, tensorbucket.Subscriber(channel, timeout=5) as subscriber:
    publisher.publish({"w": torch.ones(64 << 20, dtype=torch.uint8)}, version=1)
    bucket = subscriber.next(timeout=5)
    print("saving", flush=True)
    tensorbucket.save(bucket, path)
    print("saved", flush=True)
"""


def test_a_save_killed_while_it_writes_leaves_no_file_behind(tmp_path, channel):
    """The file is written unnamed (O_TMPFILE) and named only once whole: a hidden
    '.x.safetensors.tmp-...' of the size written so far used to stay behind each kill."""
    for delay in (0.0, 0.01, 0.03):
        child = subprocess.Popen([sys.executable, "-c", _SAVE_AND_WAIT, channel, str(tmp_path / "x.safetensors")],
                                 stdout=subprocess.PIPE, text=True)
        assert child.stdout.readline() == "saving\n"
        time.sleep(delay)
        child.kill()
        rest = child.communicate()[0]
        left = [entry.name for entry in tmp_path.iterdir()]
        assert left in ([], ["x.safetensors"]), left
        if left:  # the kill came after the rename: the file is whole
            assert rest == "saved\n" or (tmp_path / "x.safetensors").stat().st_size > 64 << 20
            (tmp_path / "x.safetensors").unlink()
    with pytest.raises(tensorbucket.ChannelError, match="ChannelMissing"):  # removes the killed producer's segments
        tensorbucket.Subscriber(channel, timeout=0.01)


def test_a_1_gib_file_round_trips_through_a_channel(tmp_path, channel):
    """16 tensors of 64 MiB, written by the package, published, received, saved, read back."""
    tensors = {f"layer.{i}.weight": random_tensor(torch.bfloat16, (8192, 4096), i) for i in range(16)}
    save_file(tensors, tmp_path / "big.safetensors")
    assert (tmp_path / "big.safetensors").stat().st_size > 1 << 30
    publisher, subscriber = channel_pair(channel, slots=1)
    with publisher, subscriber:
        assert publisher.publish_file(tmp_path / "big.safetensors", version=5, timeout=120) == 1
        update = subscriber.next_update(timeout=120)
        for name, tensor in tensors.items():
            assert same_bits(update[name], tensor), name
        tensorbucket.save(update, tmp_path / "again.safetensors")
        update.release()
    (tmp_path / "big.safetensors").unlink()
    loaded = load_file(tmp_path / "again.safetensors")
    assert sorted(loaded) == sorted(tensors)
    for name, tensor in tensors.items():
        assert same_bits(loaded[name], tensor), name


TBUCKET = os.environ.get("TBUCKET", "")


@pytest.mark.skipif(not TBUCKET, reason="TBUCKET names no tbucket (meson test sets it)")
def test_the_cli_publishes_files_and_saves_updates_per_update_and_per_bucket(tmp_path, channel):
    first = {"a": random_tensor(torch.float32, (64, 64), 1), "s": random_tensor(torch.int64, (), 2)}
    second = {"b": random_tensor(torch.bfloat16, (100,), 3), "e": random_tensor(torch.uint8, (0,), 4)}
    save_file(first, tmp_path / "first.safetensors")
    save_file(second, tmp_path / "second.safetensors")
    saver = subprocess.Popen([TBUCKET, "save", "--channel", channel, str(tmp_path / "out.safetensors"), "--updates", "2",
                              "--timeout-ms", "30000"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    bucketwise = subprocess.Popen([TBUCKET, "save", "--channel", channel, str(tmp_path / "part"), "--per-bucket",
                                   "--timeout-ms", "30000"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    for version, savers in ((4, 2), (5, 1)):  # one publish-file each; the first saver follows
        published = subprocess.run([TBUCKET, "publish-file", "--channel", channel, "--consumers", str(savers), "--slots", "4",
                                    "--version", str(version), "--timeout-ms", "30000",
                                    str(tmp_path / "first.safetensors"), str(tmp_path / "second.safetensors")],
                                   capture_output=True, text=True, timeout=60)
        assert published.returncode == 0, published.stderr
        assert f"published 2 buckets of version {version} from 2 files" in published.stdout
        if version == 4:
            assert bucketwise.wait(timeout=30) == 0
    assert saver.wait(timeout=30) == 0
    assert sorted(p.name for p in tmp_path.glob("out-v*")) == ["out-v4.safetensors", "out-v5.safetensors"]
    assert sorted(p.name for p in tmp_path.glob("part-*")) == ["part-v4-b0.safetensors", "part-v4-b1.safetensors"]
    both = {**first, **second}
    for path in ("out-v4.safetensors", "out-v5.safetensors"):
        loaded = load_file(tmp_path / path)
        assert sorted(loaded) == sorted(both) and all(same_bits(loaded[k], both[k]) for k in both)
    assert sorted(load_file(tmp_path / "part-v4-b1.safetensors")) == ["b", "e"]
    with safe_open(tmp_path / "part-v4-b1.safetensors", framework="pt") as f:
        assert f.metadata()["tensorbucket.bucket_index"] == "1"

    write_raw(tmp_path / "bad.safetensors", {"w": {"dtype": "F32", "shape": [3], "data_offsets": [0, 8]}}, bytes(8))
    refused = subprocess.run([TBUCKET, "publish-file", "--channel", channel, str(tmp_path / "bad.safetensors")],
                             capture_output=True, text=True, timeout=60)
    assert refused.returncode == 5, refused.stderr  # a verification failure
    assert "BadShape" in refused.stderr and "tensor 'w'" in refused.stderr
    assert not os.path.exists(f"/dev/shm/tensorbucket.{channel}")


@pytest.mark.skipif(not TBUCKET, reason="TBUCKET names no tbucket (meson test sets it)")
def test_the_cli_refuses_a_path_it_cannot_save_to_before_it_waits_for_an_update(tmp_path, channel):
    """It waited out its timeout first (with a producer: took an update, and released it)."""
    (tmp_path / "folder").mkdir()
    os.mkfifo(tmp_path / "fifo")
    for path, status, said in ((tmp_path / "folder", 2, "it is a folder"), (tmp_path / "fifo", 2, "it is a FIFO"),
                               (tmp_path / "none" / "x.safetensors", 1, "cannot save in the folder"),
                               (tmp_path / "none" / "x", 1, "cannot save in the folder")):
        start = time.monotonic()
        args = ["--per-bucket"] if path.name == "x" else []
        refused = subprocess.run([TBUCKET, "save", "--channel", channel, str(path), "--timeout-ms", "60000", *args],
                                 capture_output=True, text=True, timeout=60)
        assert (refused.returncode, refused.stdout) == (status, ""), refused.stderr
        assert said in refused.stderr and refused.stderr.count("\n") == 1, refused.stderr
        assert time.monotonic() - start < 30
    # Names with versions in them (OUT-vN.safetensors): OUT itself is not written, its folder counts.
    waited = subprocess.run([TBUCKET, "save", "--channel", channel, str(tmp_path / "folder"), "--updates", "2",
                             "--timeout-ms", "300"], capture_output=True, text=True, timeout=60)
    assert waited.returncode == 6 and "no live producer" in waited.stderr, waited.stderr


def test_paths_may_be_bytes_and_any_other_type_is_a_type_error(tmp_path, channel):
    """A bytes path raised TypeError: 'expected str, bytes or os.PathLike object, not int'."""
    tensors = {"w": random_tensor(torch.float32, (3,), 1)}
    name = os.fsencode(tmp_path) + b"/caf\xe9.safetensors"  # not UTF-8: reached as it is
    save_file(tensors, os.fsdecode(name))
    with tensorbucket.Publisher(channel, min_consumers=0, slots=4) as publisher:
        with tensorbucket.Subscriber(channel, timeout=5) as subscriber:
            assert publisher.publish_file(name) == 1
            with subscriber.next(timeout=5) as bucket:
                tensorbucket.save(bucket, os.fsencode(tmp_path) + b"/again.safetensors")
            assert same_bits(load_file(tmp_path / "again.safetensors")["w"], tensors["w"])
            for paths, said in ((5, "paths must be a path or a sequence of paths, not int"),
                                ([name, 5], "paths must be a path (str, bytes or os.PathLike), not int")):
                with pytest.raises(TypeError, match=re.escape(said)):
                    publisher.publish_file(paths)


def test_an_error_naming_bytes_that_are_not_utf8_is_still_a_tensorbucket_error(tmp_path, channel):
    bad = write_raw(tmp_path / "latin1.safetensors", b'{"caf\xe9": {"dtype": "U8", "shape": [1], "data_offsets": [0, 1]}}',
                    b"x")
    with tensorbucket.Publisher(channel, min_consumers=0) as publisher:
        with pytest.raises(tensorbucket.ManifestError) as refused:
            publisher.publish_file(bad)
        assert refused.value.code == "HeaderCorrupt"
        assert "does not parse" in str(refused.value)
