"""A server that loads every update into its own copy of the model, strictly.

PYTHONPATH=build/python .venv/bin/python examples/server.py CHANNEL STEPS
"""
import sys

import torch

import tensorbucket
from model import TinyNet, weights_at

channel, steps = sys.argv[1], int(sys.argv[2])
model = TinyNet()
subscriber = tensorbucket.Subscriber(channel, timeout=30)
for step in range(steps):
    update = {}
    while True:
        bucket = subscriber.next(timeout=30)
        assert bucket is not None, "no bucket within 30 s"
        assert bucket.version == step, (bucket.version, step)
        with bucket:
            update.update((name, tensor.clone()) for name, tensor in bucket.items())
        if bucket.bucket_index + 1 == bucket.bucket_count:
            break
    tensorbucket.load_into(model, update)  # strict: every name, dtype and shape must match
    for name, tensor in weights_at(step).items():
        assert torch.equal(model.state_dict()[name], tensor), (step, name)
    print(f"step {step}: {len(update)} tensors loaded and equal", flush=True)
