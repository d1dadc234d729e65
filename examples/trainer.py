"""A trainer that publishes its weights after every step, as two buckets per update.

PYTHONPATH=build/python .venv/bin/python examples/trainer.py CHANNEL STEPS
"""
import sys

import tensorbucket
from model import split, weights_at

channel, steps = sys.argv[1], int(sys.argv[2])
with tensorbucket.Publisher(channel, slots=2, checksum=True) as publisher:
    for step in range(steps):
        buckets = split(weights_at(step), 2)
        for index, tensors in enumerate(buckets):
            publisher.publish(tensors, version=step, bucket_index=index, bucket_count=len(buckets))
    publisher.drain(timeout=30)
