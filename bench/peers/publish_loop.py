"""Publishes the same 1000 tensors to a subscriber in this process for a few seconds and prints
the median time of publish(): a steady load for a profiler, and the quickest way to compare two
builds of the module (run each a few times, alternating).

PYTHONPATH=build/python /usr/bin/python3 bench/peers/publish_loop.py [floats per tensor] [seconds]
"""
import os
import statistics
import sys
import time

import torch

import tensorbucket


def main():
    numel = int(sys.argv[1]) if len(sys.argv) > 1 else 256  # 1 KiB of float32
    seconds = float(sys.argv[2]) if len(sys.argv) > 2 else 3
    torch.set_num_threads(1)
    tensors = {f"t{i}": torch.full((numel,), float(i)) for i in range(1000)}
    channel = f"tbloop-{os.getpid()}"
    with tensorbucket.Publisher(channel, slots=2) as publisher:
        subscriber = tensorbucket.Subscriber(channel, timeout=5)
        times, version = [], 0
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            start = time.perf_counter_ns()
            publisher.publish(tensors, version=version)
            times.append(time.perf_counter_ns() - start)
            subscriber.next(timeout=5).release()
            version += 1
    print(f"1000 x {numel * 4} B: publish median {statistics.median(times) / 1000:.1f} us "
          f"over {len(times)} publishes")


if __name__ == "__main__":
    main()
