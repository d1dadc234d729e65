"""Serving semantics from Python, with trainers and servers as processes: whole updates, a late
server, a trainer killed and restarted, and the `latest` policy."""
import os
import pathlib
import signal
import subprocess
import sys
import time

import pytest
import torch

import tensorbucket

EXAMPLES = pathlib.Path(__file__).resolve().parents[2] / "examples"
ENV = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join(filter(None, [str(EXAMPLES), os.environ.get("PYTHONPATH")])))
sys.path.insert(0, str(EXAMPLES))
from model import Training  # noqa: E402


@pytest.fixture
def channel(request):
    name = "".join(c if c.isalnum() or c in "._-" else "-" for c in request.node.name)
    return f"tbpy-{os.getpid()}-{name}"[:64]


def trainer(channel, steps, buckets, first_step=0):
    return subprocess.Popen([sys.executable, str(EXAMPLES / "trainer.py"), channel, str(steps), str(buckets),
                             str(first_step)], env=ENV)


def server(channel, *options):
    return subprocess.Popen([sys.executable, str(EXAMPLES / "server.py"), channel, *options], env=ENV,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def versions(output):
    return [int(line.split()[1].rstrip(":")) for line in output.splitlines() if line.startswith("version ")]


@pytest.mark.parametrize("buckets", [1, 4, 15])
def test_next_update_and_load_into_keep_a_server_bit_identical(channel, buckets):
    """The server (examples/server.py) checks every update against a replay of the training."""
    serving = server(channel)
    training = trainer(channel, 6, buckets)
    assert training.wait(timeout=120) == 0
    output, errors = serving.communicate(timeout=120)
    assert serving.returncode == 0, errors  # and it ended cleanly when the trainer was done
    assert versions(output) == list(range(6)), output
    assert f"in {buckets} buckets loaded and equal" in output


# The examples' server, its imports done, waiting for a line on stdin before it runs.
READY_SERVER = """
import runpy, sys
import torch, tensorbucket, model
print("ready", flush=True)
sys.stdin.readline()
sys.argv = sys.argv[1:]
runpy.run_path(sys.argv[0], run_name="__main__")
"""


# The examples' server, stopping itself (SIGSTOP) as it is about to load update 10: it holds
# that update whole then, every slot of it, so the trainer waits for it.
STOPPING_SERVER = """
import os, runpy, signal, sys
import tensorbucket
load_into = tensorbucket.load_into
def stopping(weights, update):
    if update.version == 10:
        os.kill(os.getpid(), signal.SIGSTOP)
    load_into(weights, update)
tensorbucket.load_into = stopping
sys.argv = sys.argv[1:]
runpy.run_path(sys.argv[0], run_name="__main__")
"""


def stopped(process, timeout=60):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with open(f"/proc/{process.pid}/stat") as stat:
            if stat.read().rsplit(")", 1)[1].split()[0] == "T":
                return True
        time.sleep(0.01)
    return False


def test_a_late_server_joins_at_a_whole_update(channel):
    """The examples' server, started while the trainer is under way (held there by the first
    server, stopped while it holds a whole update, which the trainer waits for)."""
    # The trainer gives a stopped server 30 s (examples/trainer.py): the late server's slow start
    # (importing torch) happens first, so that a loaded machine cannot use them up. The first
    # server stops itself holding a whole update: stopped from outside, it could hold part of one
    # (between releasing one bucket of it and the next), and the late server would then wait for
    # a whole update that the slots it holds keep the trainer from publishing.
    late = subprocess.Popen([sys.executable, "-c", READY_SERVER, str(EXAMPLES / "server.py"), channel], env=ENV,
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert late.stdout.readline() == "ready\n"
    early = subprocess.Popen([sys.executable, "-c", STOPPING_SERVER, str(EXAMPLES / "server.py"), channel], env=ENV,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    training = trainer(channel, 100, 4)
    head = [early.stdout.readline() for _ in range(10)]
    assert stopped(early)
    late.stdin.write("go\n")
    late.stdin.flush()
    head_of_late = late.stdout.readline()
    early.send_signal(signal.SIGCONT)
    assert training.wait(timeout=120) == 0
    seen = {}
    for name, serving, first_lines in (("early", early, head), ("late", late, [head_of_late])):
        output, errors = serving.communicate(timeout=120)
        assert serving.returncode == 0, errors  # every update it loaded was whole and equal
        seen[name] = versions("".join(first_lines) + output)
        assert seen[name] == sorted(set(seen[name])) and seen[name][-1] == 99, output
    assert seen["early"] == list(range(100))
    assert seen["late"][0] >= 10


LATE_SERVER = """
import sys, tensorbucket
with tensorbucket.Subscriber(sys.argv[1], timeout=30) as subscriber:
    print("attached", flush=True)
    for _ in range(4):
        with subscriber.next(timeout=30) as bucket:
            print(bucket.version, bucket.bucket_index, flush=True)
"""


def test_a_server_that_attaches_mid_update_starts_at_the_next_update(channel):
    """The issue's case: it took (1, 3), then (2, 0)..., and applied half of version 1."""
    def publish(version, index):
        publisher.publish({f"w{index}": torch.full((4,), float(version))}, version=version, bucket_index=index,
                          bucket_count=4)

    with tensorbucket.Publisher(channel, slots=2) as publisher:
        early = tensorbucket.Subscriber(channel, timeout=5)
        for bucket in range(7):  # version 0, then version 1 up to its bucket 2
            publish(bucket // 4, bucket % 4)
            early.next(timeout=5).release()
        late = subprocess.Popen([sys.executable, "-c", LATE_SERVER, channel], stdout=subprocess.PIPE, text=True)
        assert late.stdout.readline() == "attached\n"
        for bucket in range(7, 12):
            publish(bucket // 4, bucket % 4)
            early.next(timeout=5).release()
        output, _ = late.communicate(timeout=60)
        assert late.returncode == 0
        assert output.splitlines() == ["2 0", "2 1", "2 2", "2 3"]


def test_a_following_server_goes_on_with_a_restarted_trainer(channel):
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the replay computes as the trainers do (ENV), bit for bit
    try:
        follow_a_restarted_trainer(channel)
    finally:
        torch.set_num_threads(threads)


def follow_a_restarted_trainer(channel):
    first = trainer(channel, 10_000, 2)
    with tensorbucket.Subscriber(channel, timeout=30, follow=True) as subscriber:
        seen = []  # (incarnation, version)
        weights = Training().model.state_dict(keep_vars=True)
        replay = Training()
        gone = 0
        restarted = None
        while not seen or seen[-1][1] < 209:
            try:
                update = subscriber.next_update(timeout=30)
            except tensorbucket.ProducerGone:
                gone += 1
                restarted = trainer(channel, 210, 2, first_step=200)  # from a checkpoint of step 200
                continue
            assert update is not None
            with update:
                tensorbucket.load_into(weights, update)
            seen.append((update.incarnation, update.version))
            if len(seen) == 3:
                first.send_signal(signal.SIGKILL)
            replay.advance_to(update.version + 1)
            assert all(torch.equal(weights[name], tensor) for name, tensor in replay.model.state_dict().items())
        assert first.wait(timeout=30) == -signal.SIGKILL
        assert restarted.wait(timeout=60) == 0
    assert gone == 1
    assert [version for _, version in seen] == sorted(set(version for _, version in seen))  # never back, no replay
    incarnations = [incarnation for incarnation, _ in seen]
    assert len(set(incarnations)) == 2 and incarnations == sorted(incarnations, key=incarnations.index)
    assert [version for incarnation, version in seen if incarnation == incarnations[-1]] == list(range(200, 210))


SLOW_SERVER = """
import sys, time, tensorbucket
seen = []
with tensorbucket.Subscriber(sys.argv[1], timeout=30) as subscriber:
    for update in subscriber.updates(timeout=30):
        assert len(update.buckets) == 2 and [b.bucket_index for b in update.buckets] == [0, 1]
        assert all(b.version == update.version for b in update.buckets)
        assert float(update["w0"][0]) == update.version  # the bytes of that version
        seen.append(update.version)
        time.sleep(0.5)
print(seen)
"""


def test_latest_never_holds_the_trainer_back_for_a_slow_server(channel):
    with tensorbucket.Publisher(channel, policy="latest", slots=4, max_consumers=1, update_buckets=2) as publisher:
        assert publisher.policy == "latest"
        slow = subprocess.Popen([sys.executable, "-c", SLOW_SERVER, channel], stdout=subprocess.PIPE, text=True)
        deadline = time.monotonic() + 30
        while not os.path.exists(f"/dev/shm/tensorbucket.{channel}") and time.monotonic() < deadline:
            time.sleep(0.01)
        time.sleep(0.5)
        for version in range(40):
            for index in range(2):
                tensors = {f"w{index}": torch.full((1000,), float(version))}
                publisher.publish(tensors, version=version, bucket_index=index, bucket_count=2, timeout=0)
            time.sleep(0.05)
        assert publisher.drain(timeout=30)  # the server took the newest update
    output, _ = slow.communicate(timeout=60)
    assert slow.returncode == 0
    seen = eval(output)
    assert seen == sorted(set(seen)) and seen[-1] == 39
    assert len(seen) < 20  # it skipped what it had no time for
