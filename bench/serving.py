"""Serving figures: what a slow server costs the trainer under each overflow policy, and how
long a server that joins a running trainer waits for its first whole update.

  .venv/bin/python bench/serving.py [--updates N] [--joins N]

The trainer (this process) runs a loop of "step" (a sleep standing in for compute) then one
update of 2 buckets (32 tensors of 128 KiB each, 8 MiB in all); a server process takes whole
updates (next_update) and holds each for a while (a sleep standing in for loading it into an
inference engine). Figures are medians (and p90) over the updates of one run.

- publish time per update (both buckets), with no server, a fast one, and one that needs
  500 ms per update, under `block` and `latest`;
- a late joiner: from Subscriber() to holding its first whole update (4 buckets), while the
  trainer publishes one update every 20 ms, under `block` (beside a server that keeps up) and
  `latest`.
"""
import argparse
import statistics
import subprocess
import sys
import time

import torch

import tensorbucket

STEP_S = 0.05  # the trainer's compute between updates
SERVER = """
import sys, time, tensorbucket
channel, hold_s = sys.argv[1], float(sys.argv[2])
with tensorbucket.Subscriber(channel, timeout=30) as subscriber:
    print("attached", flush=True)
    for update in subscriber.updates(timeout=30):
        time.sleep(hold_s)
"""
JOINER = """
import sys, time, tensorbucket
start = time.monotonic_ns()
with tensorbucket.Subscriber(sys.argv[1], timeout=30) as subscriber:
    update = subscriber.next_update(timeout=30)
    held = time.monotonic_ns()
    print(held - start, update.bucket_count, flush=True)
"""


def percentile(values, fraction):
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(fraction * len(ordered)))]


def update_tensors(buckets, tensors_per_bucket=16, elements=32 * 1024):
    return [{f"b{b}.t{t}": torch.randn(elements) for t in range(tensors_per_bucket)} for b in range(buckets)]


def start_server(channel, hold_s):
    server = subprocess.Popen([sys.executable, "-c", SERVER, channel, str(hold_s)], stdout=subprocess.PIPE, text=True)
    assert server.stdout.readline() == "attached\n"
    return server


def publish_times(policy, server_hold_s, updates):
    """Publish time of each update, in ms; None for server_hold_s: no server."""
    channel = f"bench-serving-{policy}-{server_hold_s}"
    parts = update_tensors(2)
    options = dict(slots=4, max_consumers=1, update_buckets=2) if policy == "latest" else dict(slots=2)
    times = []
    with tensorbucket.Publisher(channel, policy=policy, min_consumers=0 if server_hold_s is None else 1,
                                **options) as publisher:
        server = start_server(channel, server_hold_s) if server_hold_s is not None else None
        for version in range(updates):
            time.sleep(STEP_S)
            start = time.perf_counter()
            for index, part in enumerate(parts):
                publisher.publish(part, version=version, bucket_index=index, bucket_count=2, timeout=60)
            times.append((time.perf_counter() - start) * 1e3)
        publisher.drain(timeout=60)
    if server:
        server.wait(timeout=60)
    return times


def join_times(policy, joins):
    """From Subscriber() to a whole update in hand, in ms, for `joins` joiners one after another."""
    channel = f"bench-joining-{policy}"
    parts = update_tensors(4, tensors_per_bucket=4)
    options = dict(slots=8, max_consumers=1, update_buckets=4) if policy == "latest" else dict(slots=4)
    waits = []
    with tensorbucket.Publisher(channel, policy=policy, min_consumers=0, **options) as publisher:
        steady = start_server(channel, 0) if policy == "block" else None
        version = 0
        for _ in range(joins):
            joiner = subprocess.Popen([sys.executable, "-c", JOINER, channel], stdout=subprocess.PIPE, text=True)
            while joiner.poll() is None:
                for index, part in enumerate(parts):
                    publisher.publish(part, version=version, bucket_index=index, bucket_count=4, timeout=60)
                version += 1
                time.sleep(0.02)
            wait_ns, buckets = joiner.stdout.read().split()
            assert int(buckets) == 4
            waits.append(int(wait_ns) / 1e6)
        publisher.close()
    if steady:
        steady.wait(timeout=60)
    return waits


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--updates", type=int, default=30)
    parser.add_argument("--joins", type=int, default=10)
    args = parser.parse_args()
    print(f"torch {torch.__version__}; trainer step {STEP_S * 1e3:.0f} ms, update 2 x 16 x 128 KiB; "
          f"{args.updates} updates, {args.joins} joins")
    print(f"{'publish time per update (ms)':44} {'p50':>8} {'p90':>8}")
    for policy, hold in (("latest", None), ("block", 0.0), ("latest", 0.0), ("block", 0.5), ("latest", 0.5)):
        times = publish_times(policy, hold, args.updates)
        who = "no server" if hold is None else f"server holding each update {hold * 1e3:.0f} ms"
        print(f"  {policy:7} {who:35} {statistics.median(times):8.2f} {percentile(times, 0.9):8.2f}")
    print(f"{'late joiner: Subscriber() -> whole update (ms)':44} {'p50':>8} {'p90':>8}")
    for policy in ("block", "latest"):
        waits = join_times(policy, args.joins)
        print(f"  {policy:7} {'4-bucket updates every ~20 ms':35} {statistics.median(waits):8.2f} "
              f"{percentile(waits, 0.9):8.2f}")


if __name__ == "__main__":
    main()
