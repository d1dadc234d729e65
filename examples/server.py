"""A server that loads every whole update into its own copy of the model, strictly, and checks
it against a replay of the training. It ends when the trainer is done; with --follow it goes on
with a restarted trainer instead (stop it with Ctrl+C).

PYTHONPATH=build/python .venv/bin/python examples/server.py CHANNEL [--follow]
"""
import sys

import torch

import tensorbucket
from model import Training

channel, follow = sys.argv[1], "--follow" in sys.argv[2:]
server = Training()  # the same architecture, untrained until the first update
weights = server.model.state_dict(keep_vars=True)  # once
replay = Training()  # what the trainer's weights must be, for the check

with tensorbucket.Subscriber(channel, timeout=30, follow=follow) as subscriber:
    last = None
    for update in subscriber.updates(timeout=60):
        with update:
            tensorbucket.load_into(weights, update)  # strict: every name, dtype and shape must match
        assert last is None or update.version > last, (last, update.version)
        last = update.version
        replay.advance_to(update.version + 1)
        for name, tensor in replay.model.state_dict().items():
            assert torch.equal(weights[name], tensor), (update.version, name)
        print(f"version {update.version}: {len(weights)} tensors in {update.bucket_count} buckets "
              f"loaded and equal", flush=True)
