"""How Python users hand weights to another process today, timed like `tbucket bench`, beside
the same handoff through the tensorbucket Python module.

Three peers, each a producer process and a consumer process on one host:
- tensorbucket: Publisher.publish of the tensors; in the consumer, Subscriber.next, which hands
  back a verified Bucket: a mapping whose zero-copy views are made on first access. Timed
  twice: "tensorbucket" stops once the Bucket is in hand, "tensorbucket all views" also makes
  all 1000 views (Bucket.tensors()), as the flat_bucket consumer does;
- state_dict: a torch.multiprocessing queue of a state dict (tensors move to shared memory and
  are pickled as file-descriptor handles on every send);
- flat_bucket: one persistent shared flat buffer, the tensors copied into it, and the metadata
  (name, dtype, shape, offset) sent over a torch.multiprocessing queue; the consumer rebuilds
  views over the buffer.
Latency is CLOCK_MONOTONIC from the producer starting the send to the consumer holding usable
tensors, one isolated handoff at a time (the producer waits for an acknowledgement), the same
clock and protocol as `tbucket bench`. Prints one JSON object per (peer, size).

Run with Debian's Python, which has torch, and the module meson built:
PYTHONPATH=build/python /usr/bin/python3 bench/peers/python_peers.py
"""
import argparse
import functools
import json
import os
import statistics
import sys
import time

import torch
import torch.multiprocessing as mp


def make_tensors(count, tensor_bytes):
    return {f"t{i}": torch.full((tensor_bytes // 4,), float(i), dtype=torch.float32) for i in range(count)}


def state_dict_consumer(queue, results, repeats):
    latencies = []
    for _ in range(repeats):
        start_ns, state = queue.get()
        assert len(state) > 0
        latencies.append((time.monotonic_ns() - start_ns) / 1000)
        del state
        results.put(None)  # acknowledgement
    results.put(latencies)


def state_dict_peer(count, tensor_bytes, repeats):
    tensors = make_tensors(count, tensor_bytes)
    queue, results = mp.Queue(), mp.Queue()
    consumer = mp.Process(target=state_dict_consumer, args=(queue, results, repeats))
    consumer.start()
    for _ in range(repeats):
        start_ns = time.monotonic_ns()
        # A fresh state dict each step, as a trainer sends its current parameters.
        queue.put((start_ns, {name: t.clone() for name, t in tensors.items()}))
        results.get()
    latencies = results.get()
    consumer.join()
    return latencies


def flat_bucket_consumer(buffer, queue, results, repeats):
    latencies = []
    for _ in range(repeats):
        start_ns, metadata = queue.get()
        views = {name: buffer[offset:offset + numel].view(shape)
                 for name, (offset, numel, shape) in metadata.items()}
        assert len(views) > 0
        latencies.append((time.monotonic_ns() - start_ns) / 1000)
        del views
        results.put(None)
    results.put(latencies)


def flat_bucket_peer(count, tensor_bytes, repeats):
    tensors = make_tensors(count, tensor_bytes)
    total = sum(t.numel() for t in tensors.values())
    buffer = torch.empty(total, dtype=torch.float32).share_memory_()
    queue, results = mp.Queue(), mp.Queue()
    consumer = mp.Process(target=flat_bucket_consumer, args=(buffer, queue, results, repeats))
    consumer.start()
    for _ in range(repeats):
        start_ns = time.monotonic_ns()
        metadata, offset = {}, 0
        for name, t in tensors.items():
            buffer[offset:offset + t.numel()].copy_(t.view(-1))
            metadata[name] = (offset, t.numel(), tuple(t.shape))
            offset += t.numel()
        queue.put((start_ns, metadata))
        results.get()
    latencies = results.get()
    consumer.join()
    return latencies


def tensorbucket_consumer(channel, all_views, results, repeats):
    import tensorbucket
    subscriber = tensorbucket.Subscriber(channel, timeout=30)
    latencies = []
    for _ in range(repeats):
        bucket = subscriber.next(timeout=30)
        views = bucket.tensors() if all_views else bucket
        assert len(views) > 0
        # The producer put its start time in the bucket's version.
        latencies.append((time.monotonic_ns() - bucket.version) / 1000)
        del views
        bucket.release()
        results.put(None)
    results.put(latencies)


def tensorbucket_peer(count, tensor_bytes, repeats, all_views=False):
    import tensorbucket
    tensors = make_tensors(count, tensor_bytes)
    channel = f"tbpeer-{os.getpid()}-{tensor_bytes}-{int(all_views)}"
    publisher = tensorbucket.Publisher(channel, slots=2)
    results = mp.Queue()
    consumer = mp.Process(target=tensorbucket_consumer, args=(channel, all_views, results, repeats))
    consumer.start()
    for _ in range(repeats):
        publisher.publish(tensors, version=time.monotonic_ns(), timeout=30)
        results.get()
    latencies = results.get()
    consumer.join()
    publisher.close()
    return latencies


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeats", type=int, default=20)
    args = parser.parse_args()
    mp.set_start_method("spawn")
    torch.set_num_threads(1)
    peers = [("state_dict", state_dict_peer), ("flat_bucket", flat_bucket_peer)]
    try:
        import tensorbucket  # noqa: F401  (built by meson; on PYTHONPATH)
        peers[:0] = [("tensorbucket", tensorbucket_peer),
                     ("tensorbucket all views", functools.partial(tensorbucket_peer, all_views=True))]
    except ImportError:
        print("tensorbucket module not importable: set PYTHONPATH to build/python", file=sys.stderr)
    for name, peer in peers:
        for label, tensor_bytes, repeats in (("1000 x 1 KiB", 1024, args.repeats),
                                             ("1000 x 256 KiB", 256 * 1024, max(3, args.repeats // 5))):
            latencies = peer(1000, tensor_bytes, repeats + 1)[1:]  # the first pays for start-up
            print(json.dumps({"peer": name, "size": label, "median_us": statistics.median(latencies),
                              "repeats": repeats}), flush=True)


if __name__ == "__main__":
    main()
