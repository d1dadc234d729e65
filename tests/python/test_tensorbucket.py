"""The Python module: round trips, inputs, error classes, and a trainer and a server as two
processes (examples/)."""
import collections.abc
import fcntl
import glob
import math
import os
import pathlib
import re
import signal
import struct
import subprocess
import sys
import threading
import time

import pytest
import safetensors.torch
import torch

import tensorbucket

EXAMPLES = pathlib.Path(__file__).resolve().parents[2] / "examples"


# How many threads sleep in a wait on a channel's control block: in next() ("consumer"), in
# publish() or drain() ("producer"). White-box, from ipc/control.hpp (the `sleepers` of
# ControlBlock's consumer_wake and producer_wake), so that a test waits until a thread really
# waits instead of sleeping and hoping it got there. As text, so that the scripts the tests
# below run in other processes carry the same helpers.
SLEEPERS = """
def sleepers(channel, side):
    with open(f"/dev/shm/tensorbucket.{channel}", "rb") as control:
        control.seek({"consumer": 52, "producer": 60}[side])
        return int.from_bytes(control.read(4), "little")

def wait_until(condition, timeout=30):
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise TimeoutError("the condition did not come true in time")
        time.sleep(0.001)
"""
exec(SLEEPERS)


@pytest.fixture
def one_torch_thread():
    """torch runs the work on large tensors (and a nested tensor's copies) on OpenMP threads,
    whose joins ThreadSanitizer does not see: under it, their stack reuse reads as a race."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture
def channel(request):
    name = "".join(c if c.isalnum() or c in "._-" else "-" for c in request.node.name)
    return f"tbpy-{os.getpid()}-{name}"[:64]


def test_round_trips_every_dtype_bit_exactly(channel):
    torch.manual_seed(0)
    sent = {
        "bool": torch.rand(5) > 0.5,
        "u8": torch.randint(0, 255, (4,), dtype=torch.uint8),
        "i8": torch.randint(-128, 127, (4,), dtype=torch.int8),
        "i16": torch.randint(-9, 9, (2, 3), dtype=torch.int16),
        "u16": torch.randint(0, 2**16, (3,)).to(torch.uint16),
        "i32": torch.randint(-9, 9, (3,), dtype=torch.int32),
        "u32": torch.randint(0, 2**32, (3,)).to(torch.uint32),
        "i64": torch.randint(-9, 9, (3,), dtype=torch.int64),
        "u64": torch.randint(0, 2**62, (2,)).to(torch.uint64),
        "f16": torch.randn(4).half(),
        "bf16": torch.randn(4).bfloat16(),
        "f32": torch.randn(2, 2),
        "f64": torch.randn(3, dtype=torch.float64),
        "f8_e4m3": torch.randn(5).to(torch.float8_e4m3fn),
        "f8_e5m2": torch.randn(2, 2).to(torch.float8_e5m2),
        "scalar": torch.tensor(2.5),
        "strided": torch.arange(12.0).reshape(3, 4).t(),
    }
    publisher = tensorbucket.Publisher(channel)
    subscriber = tensorbucket.Subscriber(channel, timeout=5)
    # The second publish goes through the layout the first one kept.
    for version in (3, 4):
        publisher.publish(sent, version=version)
        with subscriber.next(timeout=5) as bucket:
            assert bucket.version == version
            received = bucket.tensors()
            assert list(received) == list(sent)
            for name, tensor in sent.items():
                assert received[name].dtype == tensor.dtype
                assert received[name].shape == tensor.shape
                # As bytes: torch.equal is not defined for every dtype (float8, uint64).
                as_bytes = [t.contiguous().reshape(-1).view(torch.uint8) for t in (received[name], tensor)]
                assert torch.equal(*as_bytes), name


def test_torch_dtypes_without_a_manifest_dtype_are_refused_naming_them(channel):
    publisher = tensorbucket.Publisher(channel)
    subscriber = tensorbucket.Subscriber(channel, timeout=5)
    for dtype in (torch.float8_e4m3fnuz, torch.float8_e5m2fnuz, torch.complex64):
        with pytest.raises(tensorbucket.ManifestError, match="UnsupportedDtype: entry 'odd'") as refused:
            publisher.publish({"fine": torch.ones(2), "odd": torch.zeros(3).to(dtype)})
        assert f"has dtype {dtype} (" in str(refused.value)
    # Nothing was published: the first bucket to arrive is the next good one.
    publisher.publish({"fine": torch.ones(2)}, version=9)
    with subscriber.next(timeout=5) as bucket:
        assert bucket.version == 9


def test_accepts_a_list_of_pairs_and_groups(channel):
    publisher = tensorbucket.Publisher(channel)
    subscriber = tensorbucket.Subscriber(channel, timeout=5)
    publisher.publish([("q.weight", torch.ones(4, dtype=torch.int8)), ("q.scales", torch.ones(1))],
                      groups={"q": ["q.weight", "q.scales"]}, bucket_index=0, bucket_count=2)
    bucket = subscriber.next(timeout=5)
    assert (bucket.bucket_index, bucket.bucket_count) == (0, 2)
    assert set(bucket.tensors()) == {"q.weight", "q.scales"}


def test_pairs_come_in_any_sequence_or_iterable_and_bad_ones_are_named(channel):
    model = torch.nn.Linear(2, 3)
    expected = dict(model.named_parameters())
    publisher = tensorbucket.Publisher(channel)
    subscriber = tensorbucket.Subscriber(channel, timeout=5)
    inputs = [list(expected.items()), tuple(expected.items()),
              [[name, tensor] for name, tensor in expected.items()], model.named_parameters()]
    for version, tensors in enumerate(inputs):
        publisher.publish(tensors, version=version)
        with subscriber.next(timeout=5) as bucket:
            assert list(bucket) == ["weight", "bias"]
            for name, tensor in expected.items():
                assert torch.equal(bucket[name], tensor), (version, name)
    for bad, item_type in [([("w", torch.ones(1), "extra")], "tuple"), (["w"], "str"),
                           ((t for t in [torch.ones(1)]), "Tensor")]:
        with pytest.raises(tensorbucket.Error, match=f"expected \\(name, tensor\\) pairs, not an item of type {item_type}"):
            publisher.publish(bad)
    assert publisher.published == len(inputs)


def test_what_is_not_a_collection_of_named_tensors_is_named(channel):
    """Before, a module, a tensor or None passed as the tensors raised a bare TypeError ("'Linear'
    object is not iterable") or complained about the tensor's rows."""
    publisher = tensorbucket.Publisher(channel)
    for bad, type_name in [(torch.nn.Linear(2, 2), "Linear"), (torch.ones(3), "Tensor"),
                           (None, "NoneType"), (5, "int"), ("w", "str")]:
        with pytest.raises(tensorbucket.Error, match=f"must be a dict {{name: tensor}} or a list of "
                                                     f"\\(name, tensor\\) pairs, not {type_name}"):
            publisher.publish(bad)
    with pytest.raises(tensorbucket.Error, match=r"for a module, pass module.state_dict\(keep_vars=True\)"):
        publisher.publish(torch.nn.Linear(2, 2))
    assert publisher.published == 0


def test_refuses_a_meta_tensor_with_a_manifest_error(channel):
    publisher = tensorbucket.Publisher(channel)
    with pytest.raises(tensorbucket.ManifestError, match="'w' is a meta tensor"):
        publisher.publish({"w": torch.empty(3, device="meta")})
    assert publisher.published == 0


def test_incomplete_group_is_a_manifest_error(channel):
    publisher = tensorbucket.Publisher(channel)
    with pytest.raises(tensorbucket.ManifestError, match="missing member 'q.scales'"):
        publisher.publish({"q.weight": torch.ones(2)}, groups={"q": ["q.weight", "q.scales"]})
    assert publisher.published == 0


def test_publish_without_a_free_slot_raises_timeout(channel):
    publisher = tensorbucket.Publisher(channel, slots=1)
    publisher.publish({"a": torch.ones(1)})
    with pytest.raises(tensorbucket.Timeout):
        publisher.publish({"a": torch.ones(1)}, timeout=0.05)


def test_the_gil_is_free_while_publish_and_next_wait(channel):
    publisher = tensorbucket.Publisher(channel, slots=1)
    subscriber = tensorbucket.Subscriber(channel, timeout=5)
    publisher.publish({"a": torch.ones(1)})
    held = subscriber.next(timeout=5)  # the only slot stays leased: the next publish waits
    ticks = []

    def count_while(wait):
        """Runs wait() while another thread counts milliseconds, which needs the GIL."""
        done = threading.Event()

        def tick():
            while not done.is_set():
                ticks.append(1)
                time.sleep(0.001)

        ticker = threading.Thread(target=tick)
        ticker.start()
        try:
            wait()
        finally:
            done.set()
            ticker.join()

    with pytest.raises(tensorbucket.Timeout):
        count_while(lambda: publisher.publish({"a": torch.ones(1)}, timeout=0.3))
    assert len(ticks) > 50, "another thread could not run while publish() waited"
    held.release()
    ticks.clear()
    count_while(lambda: subscriber.next(timeout=0.3))  # nothing comes: waits the full 0.3 s
    assert len(ticks) > 50, "another thread could not run while next() waited"


def test_tensors_swapped_out_by_another_thread_while_publish_copies_arrive_whole(channel):
    """publish() copies without the GIL; torch.utils.swap_tensors in another thread (what
    nn.Module.to() does to FSDP2 parameters) may swap a tensor out and free its old memory
    meanwhile. The copy holds what it reads: each tensor arrives as its old or its new value,
    whole, and nothing crashes (the sanitizer builds read freed memory as an error)."""
    tensors = {f"t{i}": torch.full((4096,), 1.0) for i in range(200)}
    publisher = tensorbucket.Publisher(channel, slots=2)
    subscriber = tensorbucket.Subscriber(channel, timeout=5)
    done, failures = threading.Event(), []

    def swap():
        try:
            while not done.is_set():
                for tensor in tensors.values():
                    torch.utils.swap_tensors(tensor, torch.full((4096,), 2.0))  # the old one is freed
        except Exception as e:  # swap_tensors refuses a tensor another reference holds
            failures.append(e)

    swapper = threading.Thread(target=swap)
    swapper.start()
    try:
        for version in range(30):
            publisher.publish(tensors, version=version)
            with subscriber.next(timeout=5) as bucket:
                for name, view in bucket.items():
                    assert view[0].item() in (1.0, 2.0), name
                    assert torch.equal(view, torch.full_like(view, view[0].item())), name
    finally:
        done.set()
        swapper.join()
    assert not failures, failures


def test_threads_sharing_a_publisher_or_a_subscriber_take_turns(channel):
    """A C++ handle serves one thread at a time; two threads publishing through one Publisher
    crashed the interpreter before. Every bucket arrives once, whole."""
    per_thread = 150
    publisher = tensorbucket.Publisher(channel, slots=4)
    subscriber = tensorbucket.Subscriber(channel, timeout=5)
    received, torn = [], []

    def produce(k):
        tensors = {f"t{i}": torch.full((64,), float(k)) for i in range(100)}
        for step in range(per_thread):
            publisher.publish(tensors, version=k * per_thread + step, timeout=30)

    def consume():
        try:
            while (bucket := subscriber.next(timeout=30)) is not None:
                with bucket:
                    k = bucket.version // per_thread
                    if not all(torch.equal(t, torch.full((64,), float(k))) for t in bucket.values()):
                        torn.append(bucket.version)
                    received.append(bucket.version)
        except tensorbucket.ProducerGone:
            pass

    producers = [threading.Thread(target=produce, args=(k,)) for k in range(2)]
    consumers = [threading.Thread(target=consume) for _ in range(2)]
    for thread in producers + consumers:
        thread.start()
    for thread in producers:
        thread.join()
    assert publisher.published == 2 * per_thread
    assert publisher.drain(timeout=30)
    publisher.close()
    for thread in consumers:
        thread.join()
    assert sorted(received) == list(range(2 * per_thread))
    assert torn == []


def test_threads_waiting_for_their_turn_past_a_signal_check_do_not_block_each_other(channel):
    """Two threads waiting on one Subscriber in turn, each call longer than the 50 ms between two
    looks at Python's signal handlers: the thread waiting for the turn looks (taking the GIL)
    while the other gives its turn back, and neither may hold what the other needs meanwhile."""
    publisher = tensorbucket.Publisher(channel)
    subscriber = tensorbucket.Subscriber(channel, timeout=5)
    calls = []

    def wait_in_turns():
        for _ in range(15):
            assert subscriber.next(timeout=0.12) is None
            calls.append(1)

    threads = [threading.Thread(target=wait_in_turns, daemon=True) for _ in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    assert not any(thread.is_alive() for thread in threads)
    assert len(calls) == 30
    publisher.close()


@pytest.mark.parametrize("waiting", ["publish", "drain"])
def test_close_from_another_thread_ends_a_waiting_call(channel, waiting):
    """Before, close() waited for its turn behind a publish() or drain() that waited without
    limit for a slot the server held: it never returned."""
    publisher = tensorbucket.Publisher(channel, slots=1)
    subscriber = tensorbucket.Subscriber(channel, timeout=5)
    publisher.publish({"w": torch.ones(4)})
    held = subscriber.next(timeout=5)
    outcome = []

    def wait():
        try:
            if waiting == "publish":
                publisher.publish({"w": torch.ones(4)}, timeout=None)
            else:
                publisher.drain(timeout=None)
            outcome.append("returned")
        except tensorbucket.Error as error:
            outcome.append(str(error))

    waiter = threading.Thread(target=wait)
    waiter.start()
    wait_until(lambda: sleepers(channel, "producer") > 0)
    closer = threading.Thread(target=publisher.close)
    closer.start()
    closer.join(timeout=5)
    closed_in_time = not closer.is_alive()
    held.release()  # lets the old code's waiter, and so its close(), finish
    closer.join()
    waiter.join()
    assert closed_in_time
    assert len(outcome) == 1 and "closed" in outcome[0], outcome
    assert publisher.published == 1
    with pytest.raises(tensorbucket.ProducerGone):
        subscriber.next(timeout=1)


def a_publish_waiting_in_another_thread(channel):
    """A one-slot publisher whose slot a subscriber holds, and a thread that has the
    publisher's turn and waits for that slot in publish(timeout=None). Returns the publisher,
    the held bucket (release it to let the thread finish) and the thread."""
    publisher = tensorbucket.Publisher(channel, slots=1)
    subscriber = tensorbucket.Subscriber(channel, timeout=5)
    publisher.publish({"w": torch.ones(8)})
    held = subscriber.next(timeout=5)
    waiter = threading.Thread(target=lambda: publisher.publish({"w": torch.ones(8)}, timeout=None))
    waiter.start()
    wait_until(lambda: sleepers(channel, "producer") > 0)
    return publisher, held, waiter


def test_published_is_read_without_waiting_for_a_publish(channel):
    """Before, reading it waited for the turn of a publish() waiting in another thread: for
    ever with timeout=None."""
    publisher, held, waiter = a_publish_waiting_in_another_thread(channel)
    counts = []
    reader = threading.Thread(target=lambda: counts.append(publisher.published))
    reader.start()
    reader.join(timeout=5)
    read_in_time = not reader.is_alive()
    held.release()
    waiter.join()
    reader.join()
    assert read_in_time and counts == [1]
    assert publisher.published == 2


def test_a_closed_subscriber_leaves_once_its_views_are_gone(channel):
    """A server that stops reading closes its Subscriber; before, only garbage collection
    detached it."""
    publisher = tensorbucket.Publisher(channel, slots=1, max_consumers=1)
    with tensorbucket.Subscriber(channel, timeout=5) as subscriber:
        publisher.publish({"w": torch.ones(4)})
        w = subscriber.next(timeout=5)["w"]
        waiter_error = []

        def wait():
            try:
                subscriber.next(timeout=None)
            except tensorbucket.Error as error:
                waiter_error.append(str(error))

        waiter = threading.Thread(target=wait)
        waiter.start()
        wait_until(lambda: sleepers(channel, "consumer") > 0)
    waiter.join(timeout=5)
    assert not waiter.is_alive() and len(waiter_error) == 1 and "closed" in waiter_error[0]
    with pytest.raises(tensorbucket.Error, match="closed"):
        subscriber.next(timeout=0)
    # w holds its lease, and so the consumer record, the only one
    with pytest.raises(tensorbucket.Timeout):
        publisher.publish({"w": torch.full((4,), 2.0)}, timeout=0.05)
    with pytest.raises(tensorbucket.ChannelError, match="ChannelFull"):
        tensorbucket.Subscriber(channel, timeout=0)
    assert torch.equal(w, torch.ones(4))
    del w
    publisher.publish({"w": torch.full((4,), 2.0)}, timeout=5)
    with tensorbucket.Subscriber(channel, timeout=0) as fresh:
        assert torch.equal(fresh.next(timeout=5)["w"], torch.full((4,), 2.0))


DAEMON_THREADS_AT_EXIT = """
import sys, threading, time, torch, tensorbucket
""" + SLEEPERS + """
channel = sys.argv[1]
publisher = tensorbucket.Publisher(channel, slots=1)
subscriber = tensorbucket.Subscriber(channel, timeout=5)
full = tensorbucket.Publisher(channel + "-full", slots=1)
full.publish({"w": torch.ones(2)})  # no consumer will ever free its slot

def serve():
    try:
        while (bucket := subscriber.next(timeout=None)) is not None:
            bucket.release()
    except tensorbucket.ProducerGone:  # the publisher closed at exit, before the shutdown
        pass

def wait_for_a_slot():
    try:
        full.publish({"w": torch.ones(2)}, timeout=None)
    except tensorbucket.Error:  # closed at exit
        pass

threading.Thread(target=serve, daemon=True).start()
threading.Thread(target=wait_for_a_slot, daemon=True).start()
publisher.publish({"w": torch.ones(2)})
wait_until(lambda: sleepers(channel, "consumer") > 0 and sleepers(channel + "-full", "producer") > 0)
print("main thread done", flush=True)
"""


def test_the_interpreter_exits_cleanly_around_daemon_threads_that_wait(channel):
    """A server's background thread waits in next(timeout=None) while the main thread ends.
    Before, taking the GIL back during shutdown aborted the process ("terminate called
    without an active exception", exit 134), and the publishers, which Python does not destroy
    while daemon threads reach them, left their segments in /dev/shm."""
    for attempt in range(3):
        name = f"{channel[:50]}{attempt}"
        done = subprocess.run([sys.executable, "-c", DAEMON_THREADS_AT_EXIT, name],
                              capture_output=True, text=True, timeout=60)
        assert done.returncode == 0, done.stderr
        assert done.stdout == "main thread done\n"
        assert [f for f in os.listdir("/dev/shm") if f.startswith(f"tensorbucket.{name}")] == []


FORK_WHILE_A_THREAD_WAITS = """
import os, sys, threading, time, torch, tensorbucket
""" + SLEEPERS + """
publisher = tensorbucket.Publisher(sys.argv[1])
subscriber = tensorbucket.Subscriber(sys.argv[1], timeout=5)

def serve():
    try:
        while (bucket := subscriber.next(timeout=None)) is not None:
            bucket.release()
    except tensorbucket.ProducerGone:
        pass

threading.Thread(target=serve, daemon=True).start()
wait_until(lambda: sleepers(sys.argv[1], "consumer") > 0)
pid = os.fork()
if pid == 0:
    sys.exit(0)  # a normal exit: the atexit hooks run in the child
for _ in range(500):
    done, status = os.waitpid(pid, os.WNOHANG)
    if done:
        print("child exit", os.waitstatus_to_exitcode(status), flush=True)
        break
    time.sleep(0.02)
else:
    os.kill(pid, 9)
    print("child hung", flush=True)
"""


def test_a_child_forked_while_a_thread_waits_exits_cleanly(channel):
    """The exit hook waits for this module's threads outside the GIL to park. Before, a child
    forked while the parent's reader thread waited counted that thread too, which it does not
    have, and hung at exit."""
    done = subprocess.run([sys.executable, "-c", FORK_WHILE_A_THREAD_WAITS, channel],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout == "child exit 0\n"
    assert [f for f in os.listdir("/dev/shm") if f.startswith(f"tensorbucket.{channel}")] == []


def test_a_server_that_never_imports_torch_gets_tensors(channel):
    """Before, the first view crashed a process that had imported tensorbucket alone: torch's
    Python types were not set up."""
    publisher = tensorbucket.Publisher(channel)
    publisher.publish({"w": torch.arange(3.0)})
    server = ("import sys, tensorbucket\n"
              "bucket = tensorbucket.Subscriber(sys.argv[1], timeout=5).next(timeout=5)\n"
              "print(bucket['w'].tolist())\n")
    done = subprocess.run([sys.executable, "-c", server, channel], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout == "[0.0, 1.0, 2.0]\n"


def test_missing_channel_is_a_channel_error(channel):
    with pytest.raises(tensorbucket.ChannelError, match="had no live producer within 0.02 s"):
        tensorbucket.Subscriber(channel, timeout=0.02)


def test_none_waits_without_limit_and_a_bad_timeout_is_refused(channel):
    publisher = tensorbucket.Publisher(channel)
    subscriber = tensorbucket.Subscriber(channel, timeout=None)
    late = threading.Timer(0.2, publisher.publish, ({"a": torch.ones(1)},), {"timeout": None})
    late.start()
    bucket = subscriber.next(timeout=None)  # 0.2 s later, long after the first 50 ms slice
    late.join()
    assert bucket is not None and torch.equal(bucket["a"], torch.ones(1))
    bucket.release()
    assert publisher.drain(timeout=math.inf)
    for bad in (-1, math.nan):
        for wait in (lambda: publisher.publish({"a": torch.ones(1)}, timeout=bad),
                     lambda: publisher.drain(timeout=bad),
                     lambda: subscriber.next(timeout=bad),
                     lambda: tensorbucket.Subscriber(channel, timeout=bad)):
            with pytest.raises(tensorbucket.Error, match="timeout must be seconds >= 0"):
                wait()
    assert publisher.published == 1


def test_ctrl_c_interrupts_every_wait(channel):
    def interrupted(wait):
        """Whether SIGINT 0.2 s into wait() ends it with KeyboardInterrupt before its 20 s."""
        timer = threading.Timer(0.2, os.kill, (os.getpid(), signal.SIGINT))
        start = time.monotonic()
        timer.start()
        try:
            wait()
        except KeyboardInterrupt:
            return time.monotonic() - start < 10
        finally:
            timer.cancel()
        return False

    # A test runner started in the background may have SIGINT ignored: handle it as Python does.
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        publisher = tensorbucket.Publisher(channel, slots=1)
        subscriber = tensorbucket.Subscriber(channel, timeout=5)
        assert interrupted(lambda: subscriber.next(timeout=20))
        publisher.publish({"a": torch.ones(1)})
        held = subscriber.next(timeout=5)  # the only slot stays leased: publish and drain wait
        assert interrupted(lambda: publisher.publish({"a": torch.zeros(1)}, timeout=20))
        assert publisher.published == 1, "an interrupted publish must publish nothing"
        assert interrupted(lambda: publisher.drain(timeout=20))
        assert interrupted(lambda: tensorbucket.Subscriber(channel + "-none", timeout=20))
        held.release()
        assert publisher.drain(timeout=5)
    finally:
        signal.signal(signal.SIGINT, previous)


def test_ctrl_c_ends_a_new_publishers_wait_for_another_remover(channel):
    """A process removing a dead producer's leftovers holds the name's lock bytes, and a new
    Publisher waits for it. Before, that wait held the GIL for 10 s, deaf to Ctrl+C (a stopped
    `tbucket rm`), then blamed other producers."""
    code = f"import os, signal, tensorbucket\np = tensorbucket.Publisher({channel!r})\nos.kill(os.getpid(), signal.SIGKILL)"
    assert subprocess.run([sys.executable, "-c", code], timeout=120).returncode == -signal.SIGKILL
    fd = os.open(f"/dev/shm/tensorbucket.{channel}", os.O_RDWR)
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    timer = threading.Timer(0.2, os.kill, (os.getpid(), signal.SIGINT))
    try:
        for byte in (65, 0):  # as a remover takes them: its own lock byte, then the dead producer's
            fcntl.fcntl(fd, fcntl.F_OFD_SETLK, struct.pack("hhqqi4x", fcntl.F_WRLCK, os.SEEK_SET, byte, 1, 0))
        start = time.monotonic()
        timer.start()
        with pytest.raises(KeyboardInterrupt):
            tensorbucket.Publisher(channel)
        assert time.monotonic() - start < 5
    finally:
        timer.cancel()
        signal.signal(signal.SIGINT, previous)
        os.close(fd)  # lets go of the locks: as a remover that ended without removing
    with tensorbucket.Publisher(channel):
        pass  # the name is free again


class _Interrupted(Exception):
    pass


def _interrupt(signum, frame):
    raise _Interrupted


def test_a_signal_during_the_copy_publishes_nothing(channel):
    """A signal whose handler raises (Ctrl+C's KeyboardInterrupt) that lands while publish()
    copies used to be raised once the call returned, after the bucket was published: the caller
    could not tell. A publish that raises has published nothing; one that returns, its bucket.
    The signal comes at a spread of moments, some after the call (not this test's case)."""
    weights = {"w": torch.ones(16 << 20)}  # 64 MiB: copied without the GIL, for milliseconds
    publisher = tensorbucket.Publisher(channel, slots=2)
    subscriber = tensorbucket.Subscriber(channel, timeout=5)
    publisher.publish(weights, version=0)  # the layout is kept from here on
    subscriber.next(timeout=5).release()
    previous = signal.signal(signal.SIGUSR1, _interrupt)
    raised = 0
    try:
        for version in range(1, 41):
            timer = threading.Timer(0.0005 * version, os.kill, (os.getpid(), signal.SIGUSR1))
            published = publisher.published
            try:
                timer.start()
                try:
                    publisher.publish(weights, version=version)
                    returned = True
                except _Interrupted:
                    returned = False
                timer.join()
                time.sleep(0.001)
            except _Interrupted:
                pass  # the signal came after the call
            raised += not returned
            assert publisher.published == published + returned
            bucket = subscriber.next(timeout=0)
            if returned:
                assert bucket is not None and bucket.version == version
                bucket.release()
            else:
                assert bucket is None, "a publish that raised published its bucket"
    finally:
        signal.signal(signal.SIGUSR1, previous)
    assert raised > 0


def test_closed_producer_is_producer_gone(channel):
    publisher = tensorbucket.Publisher(channel)
    subscriber = tensorbucket.Subscriber(channel, timeout=5)
    publisher.close()
    with pytest.raises(tensorbucket.ProducerGone):
        subscriber.next(timeout=1)


def test_expected_mismatch_lists_every_problem(channel):
    publisher = tensorbucket.Publisher(channel)
    subscriber = tensorbucket.Subscriber(channel, timeout=5)
    publisher.publish({"w": torch.ones(2, 2), "extra": torch.ones(1)})
    with pytest.raises(tensorbucket.ManifestError) as raised:
        subscriber.next(timeout=5, expected={"w": torch.ones(4), "bias": torch.ones(2)})
    for part in ("missing 'bias'", "unexpected 'extra'", "'w' has shape [2, 2], expected [4]"):
        assert part in str(raised.value)
    # The bucket that did not match was skipped: the next call returns the one after it.
    publisher.publish({"w": torch.ones(4), "bias": torch.ones(2)}, version=2)
    assert subscriber.next(timeout=5, expected={"w": torch.ones(4), "bias": torch.ones(2)}).version == 2


def test_views_are_zero_copy_and_hold_the_slot(channel):
    publisher = tensorbucket.Publisher(channel, slots=1)
    subscriber = tensorbucket.Subscriber(channel, timeout=5)
    publisher.publish({"w": torch.ones(8)})
    bucket = subscriber.next(timeout=5)
    w = bucket.tensors()["w"]
    bucket.release()
    with pytest.raises(tensorbucket.Timeout):  # w still holds the lease
        publisher.publish({"w": torch.ones(8)}, timeout=0.05)
    del w
    publisher.publish({"w": torch.ones(8)}, timeout=5)


def test_a_forked_child_can_neither_use_nor_take_down_its_parents_channel(channel):
    publisher = tensorbucket.Publisher(channel, slots=1)
    subscriber = tensorbucket.Subscriber(channel, timeout=5)
    publisher.publish({"w": torch.ones(8)}, version=1)
    bucket = subscriber.next(timeout=5)
    w = bucket["w"]
    pid = os.fork()
    if pid == 0:  # the child: its handles refuse, then it drops them, as its exit would
        refused = 0
        for call in (lambda: publisher.publish({"w": torch.ones(8)}, timeout=0),
                     lambda: subscriber.next(timeout=0)):
            try:
                call()
            except tensorbucket.Error:
                refused += 1
        del w
        bucket.release()
        publisher.close()
        os._exit(0 if refused == 2 else 1)
    assert os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) == 0
    with pytest.raises(tensorbucket.Timeout):  # w still holds the only slot
        publisher.publish({"w": torch.ones(8)}, timeout=0.05)
    assert torch.equal(w, torch.ones(8))
    del w
    bucket.release()
    publisher.publish({"w": torch.full((8,), 2.0)}, version=2)
    assert torch.equal(subscriber.next(timeout=5)["w"], torch.full((8,), 2.0))
    tensorbucket.Subscriber(channel, timeout=0)  # the channel is still there for others


def test_a_child_forked_while_a_call_waits_can_close_its_copy(channel):
    """Before, the child inherited the waiting thread's turn, taken by a thread it does not
    have, and close() (the end of a with-block, say) waited for it for ever."""
    publisher, held, waiter = a_publish_waiting_in_another_thread(channel)
    pid = os.fork()
    if pid == 0:
        publisher.close()
        os._exit(0)
    for _ in range(250):
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            break
        time.sleep(0.02)
    else:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
    held.release()
    waiter.join()
    assert done and os.waitstatus_to_exitcode(status) == 0
    assert publisher.published == 2  # the parent's channel went on


def test_a_bucket_is_a_read_only_mapping_of_lazy_views(channel):
    publisher = tensorbucket.Publisher(channel)
    subscriber = tensorbucket.Subscriber(channel, timeout=5)
    sent = {"a": torch.arange(4.0), "b": torch.ones(2, 3, dtype=torch.int32)}
    publisher.publish(sent, version=9)
    bucket = subscriber.next(timeout=5)
    assert isinstance(bucket, collections.abc.Mapping)
    assert len(bucket) == 2 and list(bucket) == ["a", "b"] and list(bucket.keys()) == ["a", "b"]
    assert "a" in bucket and "nope" not in bucket and 3 not in bucket
    assert bucket["a"] is bucket["a"]  # made once, then kept
    assert torch.equal(bucket["b"], sent["b"])
    assert [name for name, _ in bucket.items()] == ["a", "b"]
    assert all(torch.equal(v, sent[k]) for k, v in zip(bucket.keys(), bucket.values()))
    assert bucket.get("nope") is None and bucket.get("nope", 5) == 5
    with pytest.raises(KeyError, match="nope"):
        bucket["nope"]
    # load_state_dict takes any Mapping, so a Bucket loads as it is.
    model = torch.nn.Linear(3, 2)
    publisher.publish(model.state_dict())
    model_bucket = subscriber.next(timeout=5)
    copy = torch.nn.Linear(3, 2)
    copy.load_state_dict(model_bucket)
    assert torch.equal(copy.weight, model.weight)
    assert "version=0" in repr(model_bucket)
    a = bucket["a"]
    bucket.release()
    assert torch.equal(a, sent["a"])  # a view outlives release(); it holds the lease
    with pytest.raises(tensorbucket.Error, match="released"):
        bucket["b"]
    assert bucket.version == 9  # identity stays readable


def test_each_publish_sends_the_current_tensors_whatever_changed(channel):
    """publish() reuses the layout it kept only when names, dtypes and shapes all match."""
    publisher = tensorbucket.Publisher(channel)
    subscriber = tensorbucket.Subscriber(channel, timeout=5)
    weights = {"w": torch.zeros(4, 2), "b": torch.zeros(2)}
    steps = [
        lambda: weights["w"].add_(1),                          # in place: the kept layout
        lambda: weights.update(w=torch.full((4, 2), 7.0)),     # a new tensor, same layout
        lambda: weights.update(w=torch.ones(2, 4)),            # a new shape
        lambda: weights.update(b=torch.ones(2, dtype=torch.float64)),  # a new dtype
        lambda: weights.update(c=torch.ones(1)),               # one more entry
        lambda: weights.pop("c"),                              # one fewer
        lambda: weights.update(w=torch.arange(8.0).reshape(2, 4).t()),  # strided
        lambda: weights.update(w=torch._neg_view(torch.arange(8.0).reshape(4, 2))),  # lazily negated
    ]
    for version, change in enumerate(steps):
        change()
        publisher.publish(weights, version=version)
        with subscriber.next(timeout=5) as bucket:
            assert bucket.version == version
            assert list(bucket) == list(weights)
            for name, tensor in weights.items():
                assert bucket[name].dtype == tensor.dtype, (version, name)
                assert torch.equal(bucket[name], tensor.resolve_neg()), (version, name)
    renamed = {"w2": weights["w"], "b": weights["b"]}
    publisher.publish(renamed, version=99)
    with subscriber.next(timeout=5) as bucket:
        assert list(bucket) == ["w2", "b"]


def test_a_change_late_in_the_kept_layout_loses_no_bucket(channel):
    """A tensor that no longer fits the kept layout, late in the dict, makes the call lay out
    afresh: the bucket before, not yet read, still arrives, then the new one, whole."""
    weights = {f"w{i}": torch.full((4,), float(i)) for i in range(8)}
    with tensorbucket.Publisher(channel, slots=2) as publisher:
        with tensorbucket.Subscriber(channel, timeout=5) as subscriber:
            publisher.publish(weights, version=0)
            publisher.publish(weights, version=1)
            with subscriber.next(timeout=5) as bucket:
                assert bucket.version == 0
            changed = dict(weights, w7=torch.full((5,), 70.0))
            publisher.publish(changed, version=2, timeout=5)
            for version, sent in ((1, weights), (2, changed)):
                with subscriber.next(timeout=5) as bucket:
                    assert bucket.version == version
                    assert list(bucket) == list(sent)
                    for name, tensor in sent.items():
                        assert torch.equal(bucket[name], tensor), (version, name)
            assert publisher.published == 3


@pytest.mark.parametrize("bad", [None, torch.empty(4, device="meta")], ids=["not a tensor", "meta"])
def test_a_refused_publish_leaves_the_newest_bucket_in_place(channel, bad):
    """A publish of the kept names that is refused claims no slot: the newest bucket, unread in
    the one slot the consumer does not hold, still arrives."""
    weights = {"a": torch.ones(4), "b": torch.full((4,), 2.0)}
    with tensorbucket.Publisher(channel, slots=2, max_consumers=1, policy="latest") as publisher:
        with tensorbucket.Subscriber(channel, timeout=5) as subscriber:
            publisher.publish(weights, version=0)
            held = subscriber.next(timeout=5)
            publisher.publish(weights, version=1)
            with pytest.raises(tensorbucket.Error):
                publisher.publish({"a": torch.ones(4), "b": bad}, version=2)
            held.release()
            with subscriber.next(timeout=5) as bucket:
                assert bucket.version == 1
                assert torch.equal(bucket["b"], weights["b"])
            assert publisher.published == 2


@pytest.mark.parametrize("bad", [None, torch.empty(4, device="meta")], ids=["not a tensor", "meta"])
def test_a_publish_refused_halfway_keeps_the_newest_bucket(channel, bad):
    """A small publish of the kept layout may check each tensor as it copies it, into a slot
    whose bucket is older than the newest: refused late in the dict, it publishes nothing, the
    newest bucket still arrives, and the next publish goes out whole."""
    weights = {f"w{i}": torch.full((4,), float(i)) for i in range(8)}
    with tensorbucket.Publisher(channel, slots=2) as publisher:
        with tensorbucket.Subscriber(channel, timeout=5) as subscriber:
            publisher.publish(weights, version=0)
            publisher.publish(weights, version=1)
            subscriber.next(timeout=5).release()
            with pytest.raises(tensorbucket.Error):
                publisher.publish(dict(weights, w7=bad), version=2)
            assert publisher.published == 2
            publisher.publish(weights, version=2, timeout=5)
            for version in (1, 2):
                with subscriber.next(timeout=5) as bucket:
                    assert bucket.version == version
                    for name, tensor in weights.items():
                        assert torch.equal(bucket[name], tensor), (version, name)


@pytest.mark.parametrize("policy", ["block", "latest"])
def test_a_refused_publish_leaves_the_newest_update_whole(channel, policy):
    """The newest complete update of two buckets stays whole through a refused publish of the
    next update's first bucket: a consumer that joins afterwards still receives all of it."""
    parts = [{"x": torch.ones(4)}, {"y": torch.full((4,), 2.0)}]
    slots = 6 if policy == "latest" else 2
    with tensorbucket.Publisher(channel, slots=slots, max_consumers=2, policy=policy, update_buckets=2) as publisher:
        with tensorbucket.Subscriber(channel, timeout=5) as subscriber:
            for version in range(2):
                for index, part in enumerate(parts):
                    publisher.publish(part, version=version, bucket_index=index, bucket_count=2)
                with subscriber.next_update(timeout=5):
                    pass
            with pytest.raises(tensorbucket.Error):
                publisher.publish({"x": None}, version=2, bucket_index=0, bucket_count=2)
            with tensorbucket.Subscriber(channel, timeout=5) as joiner:
                with joiner.next_update(timeout=5) as update:
                    assert update.version == 1
                    assert torch.equal(update.tensors()["y"], parts[1]["y"])


def test_names_kept_from_bucket_to_bucket_follow_every_change(channel):
    """A subscriber reuses the str of each name from its last bucket of that index: a name
    changed in place, or a bucket of another index, still gets its own names."""
    with tensorbucket.Publisher(channel, slots=2) as publisher:
        with tensorbucket.Subscriber(channel, timeout=5) as subscriber:
            for version, names in enumerate((["a", "b", "c"], ["a", "b", "c"], ["a", "bé", "c"], ["a", "b"])):
                sent = {name: torch.full((2,), float(i)) for i, name in enumerate(names)}
                publisher.publish(sent, version=version)
                with subscriber.next(timeout=5) as bucket:
                    views = bucket.tensors()
                    assert list(views) == names == list(bucket.keys())
                    for name, tensor in sent.items():
                        assert torch.equal(views[name], tensor), (version, name)
                    del views  # its views hold the slot
            parts = [{"x": torch.ones(2)}, {"y": torch.zeros(3), "z": torch.ones(1)}]
            for index, part in enumerate(parts):
                publisher.publish(part, version=9, bucket_index=index, bucket_count=2)
            with subscriber.next_update(timeout=5) as update:
                assert list(update.tensors()) == ["x", "y", "z"]
                assert [list(bucket.tensors()) for bucket in update.buckets] == [["x"], ["y", "z"]]


def test_parameters_and_tensor_subclasses_are_sent_by_value(channel):
    """A trainer's own parameters (named_parameters(), state_dict(keep_vars=True)) and Tensor
    subclasses, wrappers included, go out as their values, on the first publish and through the
    kept layout."""
    class Tagged(torch.Tensor):
        pass

    class Wrapper(torch.Tensor):
        """Holds its values in another tensor: its own storage has no memory."""
        @staticmethod
        def __new__(cls, inner):
            return torch.Tensor._make_wrapper_subclass(cls, inner.shape, dtype=inner.dtype)

        def __init__(self, inner):
            self.held = inner

        @classmethod
        def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
            unwrap = lambda x: x.held if isinstance(x, Wrapper) else x  # noqa: E731
            return func(*map(unwrap, args), **{k: unwrap(v) for k, v in (kwargs or {}).items()})

    model = torch.nn.Linear(3, 2)
    weights = {**dict(model.named_parameters()), "tagged": torch.arange(3.0).as_subclass(Tagged),
               "wrapped": Wrapper(torch.arange(4.0))}
    publisher = tensorbucket.Publisher(channel)
    subscriber = tensorbucket.Subscriber(channel, timeout=5)
    for version in range(3):
        publisher.publish(weights, version=version)
        with subscriber.next(timeout=5) as bucket:
            assert list(bucket) == ["weight", "bias", "tagged", "wrapped"]
            for name, tensor in weights.items():
                assert type(bucket[name]) is torch.Tensor and not bucket[name].requires_grad
                values = tensor.held if isinstance(tensor, Wrapper) else tensor.detach()
                assert torch.equal(bucket[name], values), (version, name)
        with torch.no_grad():  # an optimizer step: in place
            model.weight.add_(1)
            weights["tagged"].mul_(2)
            weights["wrapped"].add_(10)


def test_a_state_dict_built_once_sends_every_steps_weights(channel):
    """The README's trainer: one state_dict(keep_vars=True), published after each optimizer
    step, sends what a fresh state_dict() would hold, batch-norm statistics included."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.BatchNorm1d(3))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    weights = model.state_dict(keep_vars=True)
    publisher = tensorbucket.Publisher(channel)
    subscriber = tensorbucket.Subscriber(channel, timeout=5)
    for step in range(3):
        optimizer.zero_grad()
        model(torch.randn(8, 4)).square().sum().backward()
        optimizer.step()
        publisher.publish(weights, version=step)
        expected = model.state_dict()
        with subscriber.next(timeout=5) as bucket:
            assert list(bucket) == list(expected)
            for name, tensor in expected.items():
                assert torch.equal(bucket[name], tensor), (step, name)
        assert expected["1.num_batches_tracked"].item() == step + 1


def test_a_manifest_changed_in_shared_memory_is_not_delivered(channel):
    """Before, a publisher sending the same layout again wrote only its identity fields into
    the slot and hashed whatever manifest bytes the slot held: a byte that another process
    flipped there ('layer.weight' to 'Layer.weight') was delivered as verified. That bucket is
    refused now, and the next one arrives whole."""
    weights = {"layer.weight": torch.ones(4), "layer.bias": torch.zeros(2)}
    publisher = tensorbucket.Publisher(channel, slots=1)
    subscriber = tensorbucket.Subscriber(channel, timeout=5)
    publisher.publish(weights, version=1)
    subscriber.next(timeout=5).release()
    (segment,) = glob.glob(f"/dev/shm/tensorbucket.{channel}.slot0.*")
    with open(segment, "r+b") as slot:
        slot.seek(slot.read().index(b"layer.weight"))
        slot.write(b"L")
    publisher.publish(weights, version=2)
    with pytest.raises(tensorbucket.ChecksumMismatch):
        subscriber.next(timeout=5)
    publisher.publish(weights, version=3)
    bucket = subscriber.next(timeout=5)
    assert bucket.version == 3
    assert sorted(bucket.keys()) == ["layer.bias", "layer.weight"]


def test_a_value_that_is_not_a_tensor_is_named(channel):
    publisher = tensorbucket.Publisher(channel)
    publisher.publish({"w": torch.ones(2)})
    with pytest.raises(tensorbucket.Error, match="entry 'w' is of type list, not torch.Tensor"):
        publisher.publish({"w": [1.0, 2.0]})
    with pytest.raises(tensorbucket.Error, match="names must be str, not int"):
        publisher.publish({3: torch.ones(2)})
    with pytest.raises(tensorbucket.Error, match=r"name '\\udcff' has no UTF-8 form"):
        publisher.publish({"\udcff": torch.ones(2)})
    assert publisher.published == 1


@pytest.mark.parametrize("groups, message", [
    (["g"], "groups must be a dict {group: [member, ...]}, not list"),
    ({"g": "ab"}, "group 'g': members must be a list or tuple of names, not str"),
    ({"g": ["a", 1]}, "group members must be str, not int"),
    ({1: ["a"]}, "group names must be str, not int"),
])
def test_malformed_groups_are_named(channel, groups, message):
    publisher = tensorbucket.Publisher(channel)
    with pytest.raises(tensorbucket.Error, match=re.escape(message)):
        publisher.publish({"a": torch.ones(1), "b": torch.ones(1)}, groups=groups)
    assert publisher.published == 0


def test_load_into_is_strict_and_copies_nothing_on_mismatch():
    model = torch.nn.Linear(3, 2)
    before = model.weight.clone()
    with pytest.raises(tensorbucket.ManifestError, match="missing 'bias'"):
        tensorbucket.load_into(model, {"weight": torch.zeros(2, 3), "extra": torch.zeros(1)})
    assert torch.equal(model.weight, before)
    tensorbucket.load_into(model, {"weight": torch.zeros(2, 3), "bias": torch.ones(2)})
    assert torch.equal(model.bias, torch.ones(2))


def test_load_into_a_state_dict_built_once(channel):
    """A server may pass its model's state_dict(keep_vars=True), built once, instead of the model:
    the same strict load into the same parameters, without a state_dict() per bucket."""
    trainer, server = torch.nn.Linear(3, 2), torch.nn.Linear(3, 2)
    weights = server.state_dict(keep_vars=True)
    with tensorbucket.Publisher(channel) as publisher, tensorbucket.Subscriber(channel) as subscriber:
        publisher.publish(trainer.state_dict(), version=1)
        with subscriber.next() as bucket:
            tensorbucket.load_into(weights, bucket)
        assert torch.equal(server.weight, trainer.weight) and torch.equal(server.bias, trainer.bias)
        before = server.weight.clone()
        with pytest.raises(tensorbucket.ManifestError, match="missing 'bias'"):
            tensorbucket.load_into(weights, {"weight": torch.zeros(2, 3)})
        # A bucket is loaded from its bytes, as strictly.
        publisher.publish({"weight": torch.zeros(2, 3), "extra": torch.ones(1)}, version=2)
        with subscriber.next() as bucket:
            with pytest.raises(tensorbucket.ManifestError, match="missing 'bias'.*unexpected 'extra'"):
                tensorbucket.load_into(weights, bucket)
        assert torch.equal(server.weight, before)
        with pytest.raises(tensorbucket.Error, match="bucket was released"):
            tensorbucket.load_into(weights, bucket)
    for not_a_model in (42, [("weight", server.weight)]):
        with pytest.raises(tensorbucket.Error, match="module must be a torch.nn.Module or its "
                                                     r"state_dict\(keep_vars=True\), not (int|list)"):
            tensorbucket.load_into(not_a_model, {"weight": torch.zeros(2, 3)})


@pytest.mark.parametrize("source", ["dict", "bucket"])
def test_load_into_a_torch_dispatch_target_goes_through_its_copy(channel, source):
    """Plain tensors are loaded with a memmove; a subclass that handles its own ops is not
    bypassed, whether it loads from tensors or from a bucket's bytes."""
    class Recording(torch.Tensor):
        copies = 0

        @classmethod
        def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
            assert func is torch.ops.aten.copy_.default, func
            cls.copies += 1
            args[0].base.copy_(args[1])
            return args[0]

    base = torch.zeros(3)
    target = Recording._make_subclass(Recording, base)
    target.base = base
    if source == "dict":
        tensorbucket.load_into({"w": target}, {"w": torch.ones(3)})
    else:
        with tensorbucket.Publisher(channel) as publisher, tensorbucket.Subscriber(channel) as subscriber:
            publisher.publish({"w": torch.ones(3)})
            with subscriber.next() as bucket:
                tensorbucket.load_into({"w": target}, bucket)
    assert Recording.copies == 1
    assert torch.equal(base, torch.ones(3))


def test_load_into_an_update_released_by_another_thread_meanwhile_loads_only_that_update(channel, one_torch_thread):
    """load_into() of an Update copies without the GIL. It read the update through a plain
    reference, so a release() from another thread meanwhile gave the slot back under the copy:
    the producer rewrote it, and the target got two versions' bytes."""
    numel = 1 << 26  # 256 MiB: a copy of tens of milliseconds
    with tensorbucket.Publisher(channel, slots=1) as publisher:
        with tensorbucket.Subscriber(channel, timeout=5) as subscriber:
            publisher.publish({"w": torch.full((numel,), 1.0)}, version=1)
            update = subscriber.next_update(timeout=5)
            second = threading.Thread(
                target=lambda: publisher.publish({"w": torch.full((numel,), 2.0)}, version=2, timeout=30))
            second.start()  # waits for the only slot
            target = {"w": torch.zeros(numel)}
            loading = threading.Thread(target=tensorbucket.load_into, args=(target, update))
            loading.start()
            time.sleep(0.005)
            update.release()
            loading.join()
            second.join()
            assert torch.unique(target["w"]).tolist() == [1.0]
            with subscriber.next_update(timeout=5) as after:
                assert after.version == 2


def test_a_finalizer_that_releases_a_bucket_while_its_views_are_made(channel):
    """Making a view's Python object may run the garbage collector, and a finalizer then;
    one that released the bucket emptied the views being filled, and the view made was
    stored past their end (an assertion in this build; elsewhere a lease kept for ever)."""
    import gc

    with tensorbucket.Publisher(channel, slots=1) as publisher:
        with tensorbucket.Subscriber(channel, timeout=5) as subscriber:
            publisher.publish({f"t{i}": torch.ones(4) for i in range(8)}, version=1)
            bucket = subscriber.next(timeout=5)

            class Releaser:
                def __del__(self):
                    bucket.release()

            make_all = bucket._impl.tensors  # bound first: nothing allocated once it runs
            threshold = gc.get_threshold()
            gc.disable()
            gc.set_threshold(1)
            releaser = Releaser()
            releaser.cycle = releaser
            del releaser
            gc.enable()
            try:
                with pytest.raises(tensorbucket.InvalidArgument, match="bucket was released"):
                    make_all()
            finally:
                gc.set_threshold(*threshold)
            gc.collect()
            assert bucket.released
            publisher.publish({f"t{i}": torch.ones(4) for i in range(8)}, version=2, timeout=5)  # the slot came back


@pytest.mark.parametrize("target", ["expanded", "a received view"])
def test_load_into_refuses_a_target_it_cannot_write_by_name(channel, target):
    """An expand()ed target took copy_'s RuntimeError after the targets before it were loaded;
    a received bucket's view is read-only shared memory, and loading into it killed the
    process. Both are refused before anything is copied."""
    with tensorbucket.Publisher(channel, slots=2) as publisher:
        with tensorbucket.Subscriber(channel, timeout=5) as subscriber:
            publisher.publish({"a": torch.full((4,), 1.0), "b": torch.full((4,), 2.0)}, version=1)
            with subscriber.next(timeout=5) as held:
                b = torch.zeros(1).expand(4) if target == "expanded" else held["b"]
                targets = {"a": torch.zeros(4), "b": b}
                publisher.publish({"a": torch.full((4,), 3.0), "b": torch.full((4,), 4.0)}, version=2)
                with subscriber.next(timeout=5) as bucket:
                    message = "tensors whose elements share memory" if target == "expanded" else "views of a received bucket"
                    with pytest.raises(tensorbucket.InvalidArgument, match=f"cannot load into {message}.*'b'"):
                        tensorbucket.load_into(targets, bucket)
                    assert torch.equal(targets["a"], torch.zeros(4))  # nothing copied


def test_a_released_bucket_or_update_says_so_and_a_with_block_may_release_it_first(channel, tmp_path):
    """A Bucket's second release() passed silently where an Update's raised, and len() of
    either still answered; releasing one bucket of an update made names of its other buckets
    unreadable through the update, and then its len(), iteration and load_into() failed."""
    with tensorbucket.Publisher(channel, slots=2) as publisher:
        with tensorbucket.Subscriber(channel, timeout=5) as subscriber:
            publisher.publish({"w": torch.ones(3)}, version=1)
            with subscriber.next(timeout=5) as bucket:
                assert not bucket.released
                bucket.release()
                assert bucket.released
                for read in (len, lambda b: b.release(), lambda b: b["w"]):
                    with pytest.raises(tensorbucket.InvalidArgument, match="^bucket was released$"):
                        read(bucket)
            publisher.publish({"a": torch.ones(2)}, version=2, bucket_index=0, bucket_count=2)
            publisher.publish({"b": torch.full((2,), 2.0)}, version=2, bucket_index=1, bucket_count=2)
            with subscriber.next_update(timeout=5) as update:
                update.buckets[0].release()
                assert torch.equal(update["b"], torch.full((2,), 2.0)) and "b" in update
                with pytest.raises(tensorbucket.InvalidArgument, match="^bucket 0 of this update, which holds 'a', was released$"):
                    update["a"]
                # The rest is the mapping: its names alone, read and loaded as such.
                assert len(update) == 1 and list(update) == ["b"] and "a" not in update
                assert list(update.tensors()) == ["b"]
                target = {"b": torch.zeros(2)}
                tensorbucket.load_into(target, update)
                assert torch.equal(target["b"], torch.full((2,), 2.0))
                with pytest.raises(tensorbucket.ManifestError, match="missing 'a'"):
                    tensorbucket.load_into({"a": torch.zeros(2), "b": torch.zeros(2)}, update)
                # A file of it would not be the whole update its metadata says.
                with pytest.raises(tensorbucket.InvalidArgument, match="^bucket 0 of this update was released: save"):
                    tensorbucket.save(update, tmp_path / "rest.safetensors")
                assert not (tmp_path / "rest.safetensors").exists()
                tensorbucket.save(update.buckets[1], tmp_path / "b.safetensors")
                assert list(safetensors.torch.load_file(tmp_path / "b.safetensors")) == ["b"]
                assert repr(update.buckets[0]).endswith(", released>")
                update.release()
                with pytest.raises(tensorbucket.InvalidArgument, match="^update was released$"):
                    len(update)


def test_load_into_refuses_a_module_on_the_meta_device():
    """Before, it returned as if loaded: copying into a meta tensor does nothing."""
    with pytest.raises(tensorbucket.ManifestError, match="^Unmaterialized: cannot load into meta or undefined tensors \\(2 tensors\\): 'weight', 'bias'; "):
        tensorbucket.load_into(torch.nn.Linear(3, 2, device="meta"),
                               {"weight": torch.zeros(2, 3), "bias": torch.ones(2)})


def test_a_tensor_whose_storage_was_freed_is_refused_by_name(channel):
    """FSDP frees a parameter's bytes with untyped_storage().resize_(0): publishing such a
    tensor read past its allocation (the heap's bytes went to the consumer), and loading into
    one wrote past it. Both are refused, naming the tensor, and nothing is published."""
    weights = {"bias": torch.ones(4), "weight": torch.ones(1 << 18)}
    with tensorbucket.Publisher(channel, slots=2) as publisher:
        with tensorbucket.Subscriber(channel, timeout=5) as subscriber:
            publisher.publish(weights, version=0)
            subscriber.next(timeout=5).release()
            weights["weight"].untyped_storage().resize_(16)
            with pytest.raises(tensorbucket.InvalidArgument, match="'weight'.*reaches past the end of its storage"):
                publisher.publish(weights, version=1)
            assert publisher.published == 1
            with pytest.raises(tensorbucket.InvalidArgument, match="cannot load into tensors that reach past"):
                tensorbucket.load_into(weights, {"bias": torch.zeros(4), "weight": torch.zeros(1 << 18)})


def test_a_storage_being_published_cannot_be_resized_under_the_copy(channel, one_torch_thread):
    """A publish waiting for a slot holds its tensors' storages, and copies from them once one
    is free, without the GIL. Another thread's untyped_storage().resize_(0) (FSDP's) freed the
    bytes under it: the process crashed, or a reallocation sent freed memory. Now that resize
    fails in its own thread, the publish sends the bytes it was given, and the storage is
    resizable again afterwards."""
    weight = torch.arange(1 << 24, dtype=torch.float32)  # 64 MiB: staged, copied without the GIL
    with tensorbucket.Publisher(channel, slots=1) as publisher:
        with tensorbucket.Subscriber(channel, timeout=5) as subscriber:
            publisher.publish({"w": weight}, version=0)
            held = subscriber.next(timeout=5)
            resized = []

            def free_then_release():
                time.sleep(0.3)  # the publish below is waiting by then
                try:
                    weight.untyped_storage().resize_(0)
                    resized.append("resized")
                except RuntimeError as e:
                    resized.append(str(e))
                held.release()

            freeing = threading.Thread(target=free_then_release)
            freeing.start()
            publisher.publish({"w": weight}, version=1, timeout=10)
            freeing.join()
            assert len(resized) == 1 and "not resizable" in resized[0], resized
            with subscriber.next(timeout=5) as bucket:
                assert bucket.version == 1 and torch.equal(bucket["w"], torch.arange(1 << 24, dtype=torch.float32))
    weight.untyped_storage().resize_(0)  # the publish is over: resizable as before
    assert weight.untyped_storage().nbytes() == 0


def test_a_mapping_that_makes_its_tensors_as_it_goes_sends_their_bytes(channel, one_torch_thread):
    """A Mapping whose __getitem__ converts as it is read (a float32 view of float64 master
    weights) makes each tensor in its items() and drops it once walked. A small publish staged
    their bytes without holding them, and consumers got freed memory as a whole bucket."""
    class AsFloat(collections.abc.Mapping):
        def __init__(self, source):
            self.source = source

        def __getitem__(self, name):
            return self.source[name].float()

        def __iter__(self):
            return iter(self.source)

        def __len__(self):
            return len(self.source)

    master = {name: torch.zeros(1 << 16, dtype=torch.float64) for name in "abcd"}  # 1 MiB as float32
    with tensorbucket.Publisher(channel, slots=2) as publisher:
        with tensorbucket.Subscriber(channel, timeout=5) as subscriber:
            for version in range(4):
                for i, tensor in enumerate(master.values()):
                    tensor.fill_(10 * version + i + 1)
                publisher.publish(AsFloat(master), version=version)
                with subscriber.next(timeout=5) as bucket:
                    for i, name in enumerate("abcd"):
                        assert torch.equal(bucket[name], torch.full((1 << 16,), 10.0 * version + i + 1)), (version, name)


@pytest.mark.parametrize("kept", [False, True], ids=["new layout", "kept layout"])
def test_an_object_that_only_claims_to_be_a_tensor_is_refused_by_name(channel, kept):
    """isinstance() asks an object's __class__: a mock with spec=torch.Tensor passes it, and read
    as a tensor it crashed the process."""
    from unittest import mock

    with tensorbucket.Publisher(channel, min_consumers=0) as publisher:
        if kept:
            publisher.publish({"w": torch.ones(3)}, version=0)
        impostor = mock.Mock(spec=torch.Tensor)
        assert isinstance(impostor, torch.Tensor)
        with pytest.raises(tensorbucket.InvalidArgument, match="entry 'w' is of type Mock, not torch.Tensor"):
            publisher.publish({"w": impostor}, version=1)
        assert publisher.published == (1 if kept else 0)


class _CopiedByPython(torch.Tensor):
    """A __torch_dispatch__ wrapper that holds no bytes: its copy_ into `target` is copy(),
    Python code, which fails here."""

    @staticmethod
    def __new__(cls, shape):
        return torch.Tensor._make_wrapper_subclass(cls, shape, dtype=torch.float32)

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        if func is torch.ops.aten.detach.default:
            return args[0]
        if func is torch.ops.aten.copy_.default:
            return cls.copy(args[0])
        raise RuntimeError(f"cannot {func}")

    @classmethod
    def copy(cls, target):
        raise RuntimeError("cannot aten.copy_.default")


@pytest.mark.parametrize("numel", [16, 1 << 21], ids=["small", "8 MiB"])
def test_a_tensor_whose_copy_raises_costs_no_bucket_the_channel_holds(channel, one_torch_thread, numel):
    """With one slot, the copy of a wrapper subclass ran into the reserved slot: when it raised,
    the slot that held the newest update was left empty, and a consumer that came later got
    nothing. Its copy now runs before the slot is reserved."""
    with tensorbucket.Publisher(channel, slots=1, min_consumers=0) as publisher:
        for version in range(3):
            publisher.publish({"a": torch.full((numel,), float(version)), "b": torch.ones(numel)}, version=version)
        with pytest.raises(RuntimeError, match="cannot aten.copy_"):
            publisher.publish({"a": torch.full((numel,), 9.0), "b": _CopiedByPython((numel,))}, version=9)
        assert publisher.published == 3
        with tensorbucket.Subscriber(channel, timeout=5) as late:
            with late.next(timeout=5) as bucket:
                assert bucket.version == 2 and torch.equal(bucket["a"], torch.full((numel,), 2.0))


@pytest.mark.parametrize("inner", ["publish", "close"])
def test_a_call_made_from_inside_a_publish_on_the_same_handle_is_refused(channel, inner):
    """Python code that a tensor's copy_ runs mid-publish (or a __del__) calling the same
    publisher waited for its own turn: close() and publish(timeout=None) for ever."""
    publisher = tensorbucket.Publisher(channel, min_consumers=0)
    seen = []

    class CallsBack(_CopiedByPython):
        @classmethod
        def copy(cls, target):
            try:
                if inner == "publish":
                    publisher.publish({"x": torch.ones(3)}, version=77, timeout=None)
                else:
                    publisher.close()
            except tensorbucket.InvalidArgument as e:
                seen.append(str(e))
            return target.fill_(7.0)

    try:
        publisher.publish({"w": CallsBack((3,))}, version=1, timeout=None)
        assert len(seen) == 1 and "called from inside another call on the same handle" in seen[0], seen
        assert publisher.published == 1
        publisher.publish({"w": torch.ones(3)}, version=2)  # still open, and usable
        assert publisher.published == 2
    finally:
        publisher.close()


@pytest.mark.parametrize("refuses_strides", [False, True], ids=["wrapper", "wrapper without strides"])
def test_a_wrapper_subclass_is_sent_by_value_or_refused_with_its_own_error(channel, refuses_strides):
    """A __torch_dispatch__ wrapper holds no bytes of its own (its storage has none, whatever
    size it claims) and may answer for its sizes and strides from Python: the kept layout's
    check of it neither refuses it for its storage nor lets its error end the process."""
    class Wrapper(torch.Tensor):
        @staticmethod
        def __new__(cls, elem):
            made = torch.Tensor._make_wrapper_subclass(cls, elem.shape, strides=elem.stride(), dtype=elem.dtype,
                                                       storage_size=0, dispatch_sizes_strides_policy="strides")
            made.elem = elem
            return made

        @classmethod
        def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
            if refuses_strides and func.overloadpacket in (torch.ops.aten.is_contiguous, torch.ops.aten.stride):
                raise NotImplementedError(f"Wrapper does not do {func}")
            unwrap = lambda x: x.elem if isinstance(x, Wrapper) else x  # noqa: E731
            return func(*[unwrap(a) for a in args], **{k: unwrap(v) for k, v in (kwargs or {}).items()})

    wrapped = Wrapper(torch.arange(6.0))
    with tensorbucket.Publisher(channel, slots=2) as publisher:
        with tensorbucket.Subscriber(channel, timeout=5) as subscriber:
            publisher.publish({"w": torch.zeros(6)}, version=0)  # the kept layout
            subscriber.next(timeout=5).release()
            if refuses_strides:
                with pytest.raises(NotImplementedError, match="Wrapper does not do"):
                    publisher.publish({"w": wrapped}, version=1)
                assert publisher.published == 1
            else:
                publisher.publish({"w": wrapped}, version=1)
                with subscriber.next(timeout=5) as bucket:
                    assert torch.equal(bucket["w"], torch.arange(6.0))


def test_a_nested_tensor_is_refused_by_name(channel, one_torch_thread):
    """Before, the kept layout's check of a nested tensor ended the process (it has no sizes)."""
    nested = torch.nested.nested_tensor([torch.ones(2), torch.ones(3)])
    with tensorbucket.Publisher(channel, slots=2) as publisher:
        publisher.publish({"w": torch.zeros(3)})
        with pytest.raises(tensorbucket.InvalidArgument, match="entry 'w' is a nested tensor"):
            publisher.publish({"w": nested})
        assert publisher.published == 1


def test_trainer_and_server_processes(channel):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(EXAMPLES), os.environ.get("PYTHONPATH")])))
    server = subprocess.Popen([sys.executable, str(EXAMPLES / "server.py"), channel, "5"], env=env,
                              stdout=subprocess.PIPE, text=True)
    trainer = subprocess.run([sys.executable, str(EXAMPLES / "trainer.py"), channel, "5"], env=env,
                             timeout=120)
    output, _ = server.communicate(timeout=120)
    assert trainer.returncode == 0
    assert server.returncode == 0, output
    assert output.count("loaded and equal") == 5


def test_a_bucket_says_when_it_was_published_on_the_monotonic_clock(channel):
    with tensorbucket.Publisher(channel) as publisher, tensorbucket.Subscriber(channel, timeout=5) as subscriber:
        before = time.monotonic_ns()
        publisher.publish({"w": torch.ones(4)})
        bucket = subscriber.next(timeout=5)
        after = time.monotonic_ns()
        assert before <= bucket.publish_start_ns <= bucket.published_ns <= bucket.received_ns <= after


def test_publish_start_ns_is_taken_before_the_payload_is_copied(channel):
    # publish() copies 64 MiB into the slot: its handover began before that copy, not after it.
    weights = {"w": torch.ones(16 << 20)}
    with tensorbucket.Publisher(channel) as publisher, tensorbucket.Subscriber(channel, timeout=5) as subscriber:
        lead_over_handover = []
        for _ in range(3):  # the least of three, for a machine that may stall between two calls
            before = time.monotonic_ns()
            publisher.publish(weights)
            with subscriber.next(timeout=5) as bucket:
                lead_over_handover.append((bucket.publish_start_ns - before) /
                                          (bucket.published_ns - bucket.publish_start_ns))
        assert min(lead_over_handover) < 1, lead_over_handover


def test_version_is_the_meson_project_version():
    meson_build = (pathlib.Path(__file__).resolve().parents[2] / "meson.build").read_text()
    assert tensorbucket.__version__ == re.search(r"version: '([^']+)'", meson_build).group(1)


def test_errors_are_also_the_builtins_a_python_user_catches(channel):
    assert issubclass(tensorbucket.Timeout, TimeoutError) and issubclass(tensorbucket.Timeout, tensorbucket.Error)
    assert issubclass(tensorbucket.InvalidArgument, ValueError)
    with pytest.raises(ValueError, match="^slots must be 1..16, not 99$") as refused:
        tensorbucket.Publisher(channel, slots=99)
    assert refused.value.code == "InvalidArgument"
    with tensorbucket.Publisher(channel) as publisher, tensorbucket.Subscriber(channel, timeout=5) as subscriber:
        publisher.publish({"w": torch.ones(2)})
        subscriber.next(timeout=5).release()
        publisher.close()
        with pytest.raises(tensorbucket.ProducerGone) as gone:
            subscriber.next(timeout=5)
        assert str(gone.value).startswith("producer of channel") and gone.value.code == "ProducerGone"


def test_a_generator_of_pairs_arrives_whole_when_the_publish_waits(channel):
    """A publish may read its items twice (checked against the kept layout, then staged for a
    wait, or laid out afresh): a generator is read once, into a list."""
    weights = {f"w{i}": torch.full((4,), float(i)) for i in range(3)}
    with tensorbucket.Publisher(channel, slots=1) as publisher:
        with tensorbucket.Subscriber(channel, timeout=5) as subscriber:
            publisher.publish(((name, t) for name, t in weights.items()), version=0)
            held = subscriber.next(timeout=5)
            releaser = threading.Timer(0.2, held.release)
            releaser.start()
            publisher.publish(((name, t + 10) for name, t in weights.items()), version=1, timeout=5)
            releaser.join()
            with subscriber.next(timeout=5) as bucket:
                assert bucket.version == 1
                assert sorted(bucket.keys()) == sorted(weights)
                for name, t in weights.items():
                    assert torch.equal(bucket[name], t + 10), name
            publisher.publish(((name + "x", t) for name, t in weights.items()), version=2, timeout=5)
            with subscriber.next(timeout=5) as bucket:
                assert sorted(bucket.keys()) == sorted(name + "x" for name in weights)


def test_a_publish_timeout_names_what_held_it_back(channel):
    with tensorbucket.Publisher(channel, slots=1) as publisher:
        publisher.publish({"w": torch.ones(2)})
        with pytest.raises(TimeoutError, match=f"no slot of channel '{channel}' came free in time, waiting for a "
                                               r"consumer \(none is attached\)"):
            publisher.publish({"w": torch.ones(2)}, timeout=0.05)
        with tensorbucket.Subscriber(channel, timeout=5) as subscriber:
            held = subscriber.next(timeout=5)
            with pytest.raises(tensorbucket.Timeout, match=f"consumer pid {os.getpid()} .*which still holds bucket 0, "
                                                           r"published \d+\.\d s ago; nothing was published"):
                publisher.publish({"w": torch.ones(2)}, timeout=0.05)
            held.release()
