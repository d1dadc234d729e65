"""A trainer that publishes its weights after every step, as an update of BUCKETS buckets.

PYTHONPATH=build/python .venv/bin/python examples/trainer.py CHANNEL STEPS [BUCKETS] [FIRST_STEP]

FIRST_STEP resumes a trainer that died, as from a checkpoint taken after that many steps.
"""
import sys

import tensorbucket
from model import Training, split

channel, steps = sys.argv[1], int(sys.argv[2])
buckets = int(sys.argv[3]) if len(sys.argv) > 3 else 2
first_step = int(sys.argv[4]) if len(sys.argv) > 4 else 0

training = Training()
training.advance_to(first_step)
weights = training.model.state_dict(keep_vars=True)  # once: the model's own tensors
parts = [{name: weights[name] for name in names} for names in split(list(weights), buckets)]
# slots >= buckets: a server holds a whole update at once (Subscriber.next_update()).
with tensorbucket.Publisher(channel, slots=buckets, checksum=True) as publisher:
    for step in range(first_step, steps):
        training.step()  # weights now hold step + 1 steps of training: published as version `step`
        for index, part in enumerate(parts):
            publisher.publish(part, version=step, bucket_index=index, bucket_count=len(parts), timeout=30)
    publisher.drain(timeout=30)
