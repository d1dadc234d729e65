"""Device-channel figures on one GPU, each beside its peer measured in the same run.

  python bench/gpu_handoff.py [--quick]

Prints one table (and the card, driver, torch and CUDA versions); scripts/gpu-check runs it.
A trainer process publishes and a server process receives (spawned: CUDA never meets fork).
Each figure is the median over repeats; every handoff ends when the server's stream finished
the work the figure names (a synchronize on the server's side, after the handoff itself has
none).

- tiny bucket: publish start -> the server's views usable, handles cached (target <= 20 us);
- 1000 x 4 KiB: the same for many small tensors (target <= 50 us);
- 512 MiB of ~170 bf16 tensors: publish start -> the server's parameters loaded (load_into),
  beside the two ways RL stacks do it with torch's public API: one flattened tensor sent as
  one CUDA IPC handle, rebuilt, sliced and loaded with load_state_dict (as sglang's flattened
  buckets), and one handle per tensor (as vLLM's IPC weight transfer) (target <= 1 ms);
- packing 1 GiB into a slot: the publish's copy beside one device-to-device copy of 1 GiB
  (target >= 80 %).
"""
import argparse
import multiprocessing as mp
import statistics
import sys
import time

import torch
from torch.multiprocessing.reductions import reduce_tensor

import tensorbucket

MiB = 1 << 20


def shapes_512mib():
    """~170 bf16 tensors, 512 MiB in all: 42 layers of four 1024 x 1536 matrices, plus norms."""
    shapes = []
    for _ in range(42):
        shapes += [(1024, 1536)] * 4
    shapes += [(1536,)] * 2
    total = sum(torch.Size(s).numel() * 2 for s in shapes)
    shapes.append(((512 * MiB - total) // 2,))
    return shapes


def tensors_of(shapes, dtype, device):
    return {f"t{i}": torch.full(shape, i % 7, dtype=dtype, device=device) for i, shape in enumerate(shapes)}


def server(channel, case, repeats, queue, results):
    torch.cuda.set_device(0)
    stream = torch.cuda.current_stream()
    if case.startswith("peer"):
        shapes = queue.get()
        targets = tensors_of(shapes, torch.bfloat16, "cuda")
        module = torch.nn.Module()
        for name, tensor in targets.items():
            module.register_buffer(name, tensor)
        for _ in range(repeats):
            start_ns, payload = queue.get()
            if case == "peer_flat":
                rebuild, args, offsets = payload
                flat = rebuild(*args)
                loaded = {name: flat[o:o + n].view(s) for name, (o, n, s) in offsets.items()}
            else:
                loaded = {name: rebuild(*args) for name, (rebuild, args) in payload.items()}
            module.load_state_dict(loaded, strict=True)
            stream.synchronize()
            results.put(time.monotonic_ns() - start_ns)
        return
    with tensorbucket.Subscriber(channel, timeout=60, device="cuda") as subscriber:
        targets = None
        for _ in range(repeats):
            bucket = subscriber.next(timeout=60)
            if case == "load":
                if targets is None:
                    targets = {name: torch.empty_like(t) for name, t in bucket.tensors().items()}
                tensorbucket.load_into(targets, bucket)
            stream.synchronize()
            results.put(time.monotonic_ns() - bucket.publish_start_ns)
            bucket.release()


def trainer(channel, case, tensors, repeats, queue, results, pause_s):
    """Publishes `repeats` updates. A peer's updates go one at a time, each waiting for the
    server's figure, which it returns; ours are read from `results` afterwards."""
    if case.startswith("peer"):
        queue.put([tuple(t.shape) for t in tensors.values()])
        samples = []
        for _ in range(repeats):
            torch.cuda.current_stream().synchronize()  # the trainer's step is done
            start_ns = time.monotonic_ns()
            if case == "peer_flat":
                flat = torch.cat([t.reshape(-1) for t in tensors.values()])
                offsets, at = {}, 0
                for name, t in tensors.items():
                    offsets[name] = (at, t.numel(), tuple(t.shape))
                    at += t.numel()
                rebuild, args = reduce_tensor(flat)
                queue.put((start_ns, (rebuild, args, offsets)))
            else:
                queue.put((start_ns, {name: reduce_tensor(t) for name, t in tensors.items()}))
            samples.append(results.get(timeout=120))
        return samples
    with tensorbucket.Publisher(channel, device="cuda:0") as publisher:
        for _ in range(repeats):
            publisher.publish(tensors, timeout=60)
            time.sleep(pause_s)  # lets the server wait in next(), as it does between steps
        publisher.drain(timeout=60)
    return None


def handoff(case, tensors, repeats, pause_s=0.002):
    channel = f"tb-gpu-bench-{case}"
    ctx = mp.get_context("spawn")
    queue, results = ctx.Queue(), ctx.Queue()
    receiver = ctx.Process(target=server, args=(channel, case, repeats, queue, results))
    receiver.start()
    samples = trainer(channel, case, tensors, repeats, queue, results, pause_s)
    if samples is None:
        samples = [results.get(timeout=120) for _ in range(repeats)]
    receiver.join(timeout=60)
    if receiver.exitcode != 0:
        raise SystemExit(f"{case}: the server exited {receiver.exitcode}")
    return samples


def median_us(samples):
    return statistics.median(samples) / 1000 if samples else float("nan")


def packing(gib_tensors, repeats):
    """The publish's copy of 1 GiB beside one device-to-device copy of 1 GiB, host-timed after a
    synchronize; no consumer (min_consumers 0)."""
    flat_source = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    flat_target = torch.empty_like(flat_source)
    stream = torch.cuda.current_stream()
    copies, publishes = [], []
    with tensorbucket.Publisher("tb-gpu-bench-pack", device="cuda:0", min_consumers=0) as publisher:
        publisher.publish(gib_tensors, timeout=60)
        for _ in range(repeats):
            stream.synchronize()
            start = time.perf_counter_ns()
            flat_target.copy_(flat_source)
            stream.synchronize()
            copies.append(time.perf_counter_ns() - start)
            start = time.perf_counter_ns()
            publisher.publish(gib_tensors, timeout=60)
            stream.synchronize()
            publishes.append(time.perf_counter_ns() - start)
    return statistics.median(copies), statistics.median(publishes)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer repeats")
    options = parser.parse_args()
    repeats = 20 if options.quick else 100
    torch.cuda.set_device(0)
    props = torch.cuda.get_device_properties(0)
    print(f"card {props.name} ({props.total_memory / 2**30:.0f} GiB); torch {torch.__version__}; "
          f"torch's CUDA {torch.version.cuda}")

    rows = []
    tiny = {"w": torch.ones(16, device="cuda")}
    rows.append(("tiny bucket, publish -> views usable", median_us(handoff("tiny", tiny, repeats)), "<= 20 us", None))
    small = tensors_of([(1024,)] * 1000, torch.float32, "cuda")
    rows.append(("1000 x 4 KiB, publish -> views usable", median_us(handoff("small", small, repeats)), "<= 50 us",
                 None))
    big = tensors_of(shapes_512mib(), torch.bfloat16, "cuda")
    big_repeats = max(5, repeats // 10)
    ours = median_us(handoff("load", big, big_repeats))
    flat = median_us(handoff("peer_flat", big, big_repeats))
    each = median_us(handoff("peer_each", big, big_repeats))
    rows.append((f"512 MiB, {len(big)} bf16 tensors, publish -> loaded", ours, "<= 1000 us",
                 f"flattened + one handle {flat:.0f} us; a handle per tensor {each:.0f} us"))
    del big
    gib = tensors_of([(64 * MiB,)] * 16, torch.uint8, "cuda")
    copy_ns, publish_ns = packing(gib, max(5, repeats // 10))
    rows.append(("packing 1 GiB (16 x 64 MiB)", publish_ns / 1000, ">= 80 % of one copy",
                 f"one 1 GiB device copy {copy_ns / 1000:.0f} us: packing at {100 * copy_ns / publish_ns:.0f} %"))

    print(f"{'figure':<44} {'median':>12}  {'target':<20} peer (same run)")
    for name, value, target, peer in rows:
        print(f"{name:<44} {value:>9.1f} us  {target:<20} {peer or ''}")


if __name__ == "__main__":
    sys.exit(main())
