"""Publishing a 1 GiB safetensors checkpoint from a warm page cache, beside one read() of the
same file into a pre-faulted buffer: the most any reader of the file could do.

    PYTHONPATH=build/python .venv/bin/python bench/safetensors_file.py [--rounds 7] [--dir DIR]

The file (written once with the safetensors package, just over 1 GiB in bf16 tensors of a
transformer's shapes) is read once before the rounds, so every round reads from the page cache.
Each round, interleaved, in the same process:
- read(): os.readv of the whole file, one read() call, into a page-aligned 1 GiB buffer whose
  pages were touched first;
- publish_file, reused slot: Publisher.publish_file into a channel whose one slot already
  exists (its pages mapped): what a server seeding itself again, or a second checkpoint, costs;
- publish_file, new channel: a fresh Publisher each time, so its slot is created and first
  touched during the publish: what `tbucket publish-file` costs once;
- new shm pages alone: posix_fallocate of as many fresh /dev/shm bytes, the kernel's share of
  that new slot (allocating and zeroing its pages), with nothing read.
No consumer is attached (min_consumers=0): publish_file returns once the bucket is visible.
Prints each round, the medians, and ours / read() for each; the load average before and after
says whether the machine was quiet.
"""
import argparse
import mmap
import os
import statistics
import sys
import tempfile
import time

import torch
from safetensors.torch import save_file

import tensorbucket

GIB = 1 << 30


def checkpoint(path):
    """~1 GiB of a decoder's weights: embeddings, then layers of attention and MLP, in bf16."""
    hidden, inter, vocab = 2048, 5632, 16000
    tensors = {"embed.weight": torch.empty(vocab, hidden, dtype=torch.bfloat16)}
    layer = 0
    while sum(t.numel() * 2 for t in tensors.values()) < GIB:
        for name, shape in (("q", (hidden, hidden)), ("k", (hidden // 4, hidden)), ("v", (hidden // 4, hidden)),
                            ("o", (hidden, hidden)), ("up", (inter, hidden)), ("gate", (inter, hidden)),
                            ("down", (hidden, inter)), ("norm", (hidden,))):
            tensors[f"layers.{layer}.{name}.weight"] = torch.empty(shape, dtype=torch.bfloat16)
        layer += 1
    for i, tensor in enumerate(tensors.values()):
        tensor.view(torch.int16).copy_(torch.randint(-32768, 32767, tensor.shape, dtype=torch.int16,
                                                     generator=torch.Generator().manual_seed(i)))
    save_file(tensors, path)
    return len(tensors)


def read_all(path, buffer):
    fd = os.open(path, os.O_RDONLY)
    try:
        start = time.perf_counter()
        got = os.readv(fd, [buffer])
        seconds = time.perf_counter() - start
    finally:
        os.close(fd)
    assert got == len(buffer), got
    return seconds


def allocate_shm(size):
    """The kernel's part of a new slot alone: fresh /dev/shm pages of `size` bytes, allocated and
    zeroed (posix_fallocate), nothing read into them."""
    name = f"/dev/shm/tbbench-st-alloc-{os.getpid()}"
    fd = os.open(name, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        start = time.perf_counter()
        os.posix_fallocate(fd, 0, size)
        return time.perf_counter() - start
    finally:
        os.close(fd)
        os.unlink(name)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--dir", default=None, help="where to write the file (default: the temp folder)")
    args = parser.parse_args()

    with tempfile.TemporaryDirectory(dir=args.dir) as folder:
        path = os.path.join(folder, "checkpoint.safetensors")
        count = checkpoint(path)
        size = os.path.getsize(path)
        # Page-aligned, every page touched: a pre-faulted buffer. (A bytearray or a numpy array,
        # 16 bytes past a page boundary, read at a third of the speed here.)
        view = mmap.mmap(-1, size)
        for at in range(0, size, 4096):
            view[at] = 1
        read_all(path, view)  # the page cache warm
        print(f"file: {size / GIB:.3f} GiB, {count} tensors; load average before: {os.getloadavg()[0]:.2f}")

        channel = f"tbbench-st-{os.getpid()}"
        reused = tensorbucket.Publisher(channel + "-kept", slots=1, min_consumers=0)
        reused.publish_file(path)  # the slot made and touched once
        figures = {"read()": [], "publish_file, reused slot": [], "publish_file, new channel": [],
                   "new shm pages alone": []}
        for round_ in range(args.rounds):
            figures["read()"].append(read_all(path, view))
            start = time.perf_counter()
            reused.publish_file(path, timeout=60)
            figures["publish_file, reused slot"].append(time.perf_counter() - start)
            with tensorbucket.Publisher(f"{channel}-{round_}", slots=1, min_consumers=0) as fresh:
                start = time.perf_counter()
                fresh.publish_file(path, timeout=60)
                figures["publish_file, new channel"].append(time.perf_counter() - start)
            figures["new shm pages alone"].append(allocate_shm(size))
            print(f"round {round_ + 1}: " + ", ".join(f"{name} {size / seconds[-1] / 1e6:.0f} MB/s"
                                                     for name, seconds in figures.items()), flush=True)
        reused.close()

    medians = {name: size / statistics.median(seconds) / 1e6 for name, seconds in figures.items()}
    print(f"load average after: {os.getloadavg()[0]:.2f}")
    for name, rate in medians.items():
        ratio = rate / medians["read()"]
        print(f"median {name}: {rate:.0f} MB/s" + ("" if name == "read()" else f", {ratio:.2f}x read()"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
