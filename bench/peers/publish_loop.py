"""Publishes the same 1000 tensors to a subscriber in this process for a few seconds and prints
the median time of publish() (with --views, also of the received bucket's tensors(): all 1000
views made): a steady load for a profiler, and the quickest way to compare two builds of the
module (run each a few times, alternating).

PYTHONPATH=build/python .venv/bin/python bench/peers/publish_loop.py [--numel N] [--seconds S]
    [--parameters] [--views]
"""
import argparse
import os
import statistics
import time

import torch

import tensorbucket


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--numel", type=int, default=256, help="float32 values per tensor")
    parser.add_argument("--seconds", type=float, default=3)
    parser.add_argument("--parameters", action="store_true", help="send nn.Parameters")
    parser.add_argument("--views", action="store_true", help="time each received bucket's tensors() too")
    args = parser.parse_args()
    torch.set_num_threads(1)
    tensors = {f"t{i}": torch.full((args.numel,), float(i)) for i in range(1000)}
    if args.parameters:
        tensors = {name: torch.nn.Parameter(t) for name, t in tensors.items()}
    channel = f"tbloop-{os.getpid()}"
    with tensorbucket.Publisher(channel, slots=2) as publisher:
        subscriber = tensorbucket.Subscriber(channel, timeout=5)
        times, view_times, version = [], [], 0
        end = time.monotonic() + args.seconds
        while time.monotonic() < end:
            start = time.perf_counter_ns()
            publisher.publish(tensors, version=version)
            times.append(time.perf_counter_ns() - start)
            bucket = subscriber.next(timeout=5)
            if args.views:
                start = time.perf_counter_ns()
                views = bucket.tensors()
                view_times.append(time.perf_counter_ns() - start)
                del views
            bucket.release()
            version += 1
    kind = " nn.Parameter" if args.parameters else ""
    views = f", tensors() median {statistics.median(view_times) / 1000:.1f} us" if args.views else ""
    print(f"1000 x {args.numel * 4} B{kind}: publish median {statistics.median(times) / 1000:.1f} us{views} "
          f"over {len(times)} publishes")


if __name__ == "__main__":
    main()
