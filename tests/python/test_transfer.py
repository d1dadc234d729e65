"""Whole weight updates between a trainer and workers (tensorbucket._transfer), as the vLLM
backend runs them, here without vLLM: plain torch modules load what the workers receive, and
host channels stand in for the GPUs of a colocated trainer. tests/vllm runs the same code
inside real vLLM engines."""
import dataclasses
import os
import re
import subprocess
import sys
import threading
import zlib

import pytest
import torch

import tensorbucket
from tensorbucket._transfer import Producer, Route, UpdateInfo, UpdatePublisher, UpdateReceiver, plan_buckets, route


@pytest.fixture
def channel(request):
    name = "".join(c if c.isalnum() or c in "._-" else "-" for c in request.node.name)
    return f"tbtr-{os.getpid()}-{zlib.crc32(name.encode()):08x}-{name}"[:56]  # unique, whatever the parameters


def model(seed):
    torch.manual_seed(seed)
    return torch.nn.Sequential(*[torch.nn.Linear(64, 64) for _ in range(6)])


def groups_of(module):
    """A group per layer, as vLLM's layerwise_groups makes them."""
    groups = {}
    for name in module.state_dict():
        groups.setdefault(name.split(".")[0], []).append(name)
    return list(groups.values())


def publisher_of(channel, module, **options):
    shapes = {name: (tensor.dtype, tuple(tensor.shape)) for name, tensor in module.state_dict().items()}
    settings = dict(device=None, bucket_bytes=40_000, slots=4,  # two layers a bucket: three buckets
                    policy="block", checksum=False,
                    max_consumers=8, timeout=10.0)
    settings.update(options)
    return UpdatePublisher(channel, groups_of(module), shapes, **settings)


def iter_groups(module):
    state = module.state_dict()
    for group in groups_of(module):
        yield group, [state[name] for name in group]


def loader(module):
    """What vLLM's load_weights is to a worker: (name, tensor) pairs copied into the module."""
    targets = module.state_dict(keep_vars=True)

    def load(pairs):
        with torch.no_grad():
            for name, tensor in pairs:
                targets[name].copy_(tensor)

    return load


def send(publisher, module, version, stop=None):
    publisher.publish(version, iter_groups(module), stop or threading.Event())


def info_of(publisher, version=None, **changes):
    """The update info of the update `publisher` publishes next."""
    fields = dict(bucket_count=len(publisher.plan), whole=publisher.whole, version=version,
                  producers={publisher.channel: Producer(publisher.incarnation, publisher.sequence)})
    fields.update(changes)
    return UpdateInfo(**fields)


def receive_beside(receiver, info, module):
    """receive() in a thread, as vLLM's update_weights runs beside the trainer's publish."""
    outcome = {}

    def run():
        try:
            outcome["loaded"] = receiver.receive(info, loader(module))
        except BaseException as error:
            outcome["error"] = error

    thread = threading.Thread(target=run)
    thread.start()
    return thread, outcome


def same(a, b):
    return all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values()))


def test_groups_are_packed_in_order_and_a_large_group_is_a_bucket_alone():
    sizes = {"a": 100, "b": 100, "c": 500, "d": 50, "e": 50}
    assert plan_buckets([["a"], ["b"], ["c"], ["d", "e"]], sizes, 256) == [["a", "b"], ["c"], ["d", "e"]]
    assert plan_buckets([["a", "b", "c"]], sizes, 256) == [["a", "b", "c"]]


@pytest.mark.parametrize("slots", [4, 2])  # the update taken whole; streamed through two slots
def test_a_worker_loads_every_update_bit_exactly(channel, slots):
    trainer, worker = model(1), model(0)
    publisher = publisher_of(channel, trainer, slots=slots)
    assert len(publisher.plan) == 3 and publisher.whole == (slots == 4)
    receiver = UpdateReceiver(route({"channel": channel, "device": "cpu", "timeout": 10}, "cpu"), torch.device("cpu"))
    for version in range(5):
        with torch.no_grad():
            for parameter in trainer.parameters():
                parameter.add_(1)
        thread, outcome = receive_beside(receiver, info_of(publisher, version), worker)
        send(publisher, trainer, version)
        thread.join()
        assert outcome == {"loaded": 12}
        assert same(worker, trainer)
    receiver.close()
    publisher.close()


def test_each_worker_takes_the_channel_of_its_own_device(channel):
    # Two trainer ranks on two GPUs, each publishing its own channel; host channels stand in.
    keys = ["GPU-0a0a0a0a-0000-0000-0000-000000000000", "GPU-0b0b0b0b-0000-0000-0000-000000000000"]
    trainers = [model(1), model(2)]
    publishers = [publisher_of(f"{channel}-{i}", trainers[i]) for i in range(2)]
    init_info = {"channels": {key: p.channel for key, p in zip(keys, publishers)}, "device": "cpu", "timeout": 10}
    producers = {p.channel: Producer(p.incarnation, p.sequence) for p in publishers}
    workers = [model(0), model(0)]
    receivers = [UpdateReceiver(route(init_info, key), torch.device("cpu")) for key in keys]
    assert [r.route.channel for r in receivers] == [p.channel for p in publishers]
    info = UpdateInfo(version=0, bucket_count=3, producers=producers, whole=True)
    threads = [receive_beside(receivers[i], info, workers[i]) for i in range(2)]
    for publisher, trainer in zip(publishers, trainers):
        send(publisher, trainer, 0)
    for thread, outcome in threads:
        thread.join()
        assert outcome == {"loaded": 12}
    assert same(workers[0], trainers[0]) and same(workers[1], trainers[1])
    with pytest.raises(tensorbucket.InvalidArgument, match="names no channel for this worker's device GPU-0c"):
        route(init_info, "GPU-0c0c0c0c-0000-0000-0000-000000000000")
    for endpoint in receivers + publishers:
        endpoint.close()


def test_several_workers_load_one_bucket_each(channel):
    # Tensor-parallel workers of one engine: one channel, every worker takes every bucket.
    trainer = model(1)
    publisher = publisher_of(channel, trainer)
    workers = [model(0) for _ in range(3)]
    receivers = [UpdateReceiver(Route(channel, "cpu", 10.0), torch.device("cpu")) for _ in workers]
    threads = [receive_beside(r, info_of(publisher, 7), w) for r, w in zip(receivers, workers)]
    send(publisher, trainer, 7)
    for thread, outcome in threads:
        thread.join()
        assert outcome == {"loaded": 12}
    assert all(same(worker, trainer) for worker in workers)
    for endpoint in receivers + [publisher]:
        endpoint.close()


@pytest.mark.parametrize("change, message", [
    ({"version": 2}, "holds update 3 of 3 buckets \\(producer incarnation \\d+, sequence 0\\) where update 2 of 3"),
    ({"bucket_count": 2}, "holds update 3 of 3 buckets .* where update 3 of 2 buckets"),
    ("incarnation", "holds update 3 of 3 buckets \\(producer incarnation \\d+, sequence 0\\) where update 3 of 3 "
                    "buckets \\(producer incarnation 12345, sequence 0\\) was announced"),
])
def test_an_update_other_than_the_announced_one_is_refused_and_nothing_loaded(channel, change, message):
    trainer, worker = model(1), model(0)
    publisher = publisher_of(channel, trainer)
    receiver = UpdateReceiver(Route(channel, "cpu", 10.0), torch.device("cpu"))
    info = info_of(publisher, 3)
    if change == "incarnation":
        change = {"producers": {channel: Producer(12345, 0)}}
    send(publisher, trainer, 3)
    with pytest.raises(tensorbucket.ManifestError, match=message):
        receiver.receive(dataclasses.replace(info, **change), loader(worker))
    assert same(worker, model(0))
    receiver.close()
    publisher.close()


@pytest.mark.parametrize("abandoned", [1, 2])  # another version; an earlier try of the same one
def test_an_update_the_trainer_abandoned_is_skipped(channel, abandoned):
    trainer, worker = model(1), model(0)
    publisher = publisher_of(channel, trainer)
    receiver = UpdateReceiver(Route(channel, "cpu", 10.0), torch.device("cpu"))
    send(publisher, model(5), abandoned)  # nobody was told of it
    thread, outcome = receive_beside(receiver, info_of(publisher, 2), worker)
    send(publisher, trainer, 2)
    thread.join()
    assert outcome == {"loaded": 12} and same(worker, trainer)
    receiver.close()
    publisher.close()


def test_a_worker_waits_for_a_stalled_trainer_only_its_timeout(channel):
    trainer, worker = model(1), model(0)
    publisher = publisher_of(channel, trainer)
    receiver = UpdateReceiver(Route(channel, "cpu", 0.3), torch.device("cpu"))
    with pytest.raises(tensorbucket.Timeout, match=f"update 0 on channel '{channel}' was not whole within 0.3 s"):
        receiver.receive(info_of(publisher, 0), loader(worker))
    receiver.close()
    publisher.close()


def test_a_trainer_gone_mid_update_fails_the_update_and_a_new_trainer_is_served(channel):
    trainer, worker = model(1), model(0)
    publisher = publisher_of(channel, trainer, slots=2)  # streamed: bucket 0 is loaded first
    receiver = UpdateReceiver(Route(channel, "cpu", 10.0), torch.device("cpu"))
    thread, outcome = receive_beside(receiver, info_of(publisher, 0), worker)
    state = trainer.state_dict()
    names = publisher.plan[0]
    publisher._publisher.publish({n: state[n] for n in names}, version=0, bucket_index=0, bucket_count=3)
    publisher.close()  # the trainer is gone after its first bucket
    thread.join()
    assert isinstance(outcome["error"], tensorbucket.ProducerGone)
    assert f"the trainer of channel '{channel}' is gone before update 0 was whole" in str(outcome["error"])
    receiver.close()
    successor = publisher_of(channel, trainer)
    receiver = UpdateReceiver(Route(channel, "cpu", 10.0), torch.device("cpu"))
    thread, outcome = receive_beside(receiver, info_of(successor, 0), worker)
    send(successor, trainer, 0)
    thread.join()
    assert outcome == {"loaded": 12} and same(worker, trainer)
    receiver.close()
    successor.close()


def test_what_the_loader_raises_names_the_update_and_the_tensor_and_frees_the_slots(channel):
    trainer = model(1)
    publisher = publisher_of(channel, trainer)
    receiver = UpdateReceiver(Route(channel, "cpu", 10.0), torch.device("cpu"))

    def refuse(pairs):
        for name, _ in pairs:
            if name == "1.weight":
                raise KeyError(f"no parameter {name}")

    for version in range(3):  # more updates than slots: each failed one gave its slots back
        info = info_of(publisher, version)
        send(publisher, trainer, version)
        with pytest.raises(KeyError, match=f"loading update {version} from channel '{channel}' failed at "
                           "'1.weight' \\(tensor 3\\): 'no parameter 1.weight'"):
            receiver.receive(info, refuse)
    receiver.close()
    publisher.close()


@pytest.mark.parametrize("init_info, message", [
    ({"device": "cpu", "timeout": 1}, "must name either 'channel' or 'channels'"),
    ({"channel": "a", "channels": {"cpu": "b"}, "device": "cpu", "timeout": 1}, "either 'channel' or 'channels'"),
    ({"channel": "../x", "device": "cpu", "timeout": 1}, "'../x' is not a channel name"),
    ({"channel": "a", "device": "tpu", "timeout": 1}, "'device' must be \"cpu\" or \"cuda\", not 'tpu'"),
    ({"channel": "a", "device": "cpu", "timeout": -1}, "'timeout' must be seconds above 0, at most 3600, not -1"),
    ({"channel": "a", "device": "cpu", "timeout": 1e9}, "at most 3600, not 1000000000.0"),
    ({"channel": "a", "device": "cpu", "timeout": float("nan")}, "'timeout' must be seconds above 0"),
    ({"channel": 5, "device": "cpu", "timeout": 1}, "5 is not a channel name"),
    ([], "must be a dict, not list"),
])
def test_init_info_is_checked_field_by_field(init_info, message):
    with pytest.raises(tensorbucket.InvalidArgument, match=message):
        route(init_info, "cpu")


def producers(incarnation="5", sequence=0):
    return {"c": {"incarnation": incarnation, "sequence": sequence}}


@pytest.mark.parametrize("update_info, message", [
    ({"version": -1, "bucket_count": 1, "producers": {}, "whole": True}, "'version' must be an integer"),
    ({"version": 1, "bucket_count": 0, "producers": {}, "whole": True}, "'bucket_count' must be an integer from 1"),
    ({"version": 1, "bucket_count": 1, "producers": producers(5), "whole": True}, "must be a decimal string"),
    ({"version": 1, "bucket_count": 1, "producers": producers(str(2**64)), "whole": True}, "64-bit incarnation"),
    ({"version": 1, "bucket_count": 1, "producers": producers("\u00b2"), "whole": True}, "64-bit incarnation"),
    ({"version": 1, "bucket_count": 1, "producers": producers("9" * 5000), "whole": True}, "64-bit incarnation"),
    ({"version": 1, "bucket_count": 1, "producers": producers(sequence=-1), "whole": True}, "'sequence' must be"),
    ({"version": 1, "bucket_count": 1, "producers": {"c": {"incarnation": "5"}}, "whole": True},
     "must be {\"incarnation\": ..., \"sequence\": ...}"),
    ({"version": 1, "bucket_count": 1, "producers": [], "whole": True}, "'producers' must be dict"),
    ({"version": 1, "bucket_count": 1, "producers": {}, "whole": 1}, "'whole' must be bool"),
    ({"version": 1, "bucket_count": 1, "producers": {}, "whole": True, "x": 1}, "unknown fields: x"),
    ({"version": True, "bucket_count": 1, "producers": {}, "whole": True}, "'version' must be an integer"),
])
def test_update_info_is_checked_field_by_field(update_info, message):
    with pytest.raises(tensorbucket.InvalidArgument, match=re.escape(message) if "{" in message else message):
        UpdateInfo.parse(update_info)


def test_update_info_travels_as_json_and_back():
    info = UpdateInfo(version=3, bucket_count=2, producers={"c": Producer(2**64 - 1, 7)}, whole=False)
    assert info.to_json()["producers"] == {"c": {"incarnation": str(2**64 - 1), "sequence": 7}}
    assert UpdateInfo.parse(info.to_json()) == info


def test_a_plan_past_a_channel_s_slots_is_refused_saying_what_to_change(channel):
    with pytest.raises(tensorbucket.InvalidArgument, match="needs 27 slots under the 'latest' policy, and a "
                       "channel has at most 16: raise bucket_bytes or lower max_consumers"):
        publisher_of(channel, model(1), policy="latest", max_consumers=8)


def test_a_worker_of_a_missing_channel_or_another_location_is_refused(channel):
    with pytest.raises(tensorbucket.ChannelError, match="ChannelMissing"):
        UpdateReceiver(Route(channel, "cpu", 0.2), torch.device("cpu"))
    publisher = publisher_of(channel, model(1))
    with pytest.raises(tensorbucket.ChannelError, match="LocationMismatch"):
        UpdateReceiver(Route(channel, "cuda", 0.2), torch.device("cpu"))
    publisher.close()


def test_importing_tensorbucket_imports_no_server_and_the_vllm_module_says_what_it_needs():
    probe = ("import sys, tensorbucket; assert 'vllm' not in sys.modules\n"
             "try:\n    import tensorbucket.vllm\nexcept ImportError as e:\n    print(e)\nelse:\n    print('vllm here')")
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True).stdout
    if "vllm here" not in out:
        assert "tensorbucket.vllm needs vLLM 0.32.x, which this Python does not have" in out


def gpu_here():
    probe = "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)"
    return subprocess.run([sys.executable, "-c", probe], timeout=120).returncode == 0


# The worker engine's device path, without vLLM: a trainer process publishes a CUDA module's
# weights on a device channel, a worker process loads them into its own CUDA module.
DEVICE_PATH = r"""
import sys, threading, torch
sys.path.insert(0, sys.argv[3])
import test_transfer as t
from tensorbucket._transfer import Producer, UpdateInfo, UpdateReceiver, route
role, channel = sys.argv[1], sys.argv[2]
trainer = t.model(1).cuda()
if role == "trainer":
    publisher = t.publisher_of(channel, trainer, device="cuda:0")
    print(publisher.incarnation, flush=True)
    sys.stdin.readline()  # the worker attached
    for version in range(3):
        t.send(publisher, trainer, version)
    assert publisher._publisher.drain(timeout=60)
    publisher.close()
else:
    incarnation = int(sys.stdin.readline())
    worker = t.model(0).cuda()
    receiver = UpdateReceiver(route({"channel": channel, "device": "cuda", "timeout": 60},
                                    str(torch.cuda.get_device_properties(0).uuid)), torch.device("cuda:0"))
    print("attached", flush=True)
    for version in range(3):
        info = UpdateInfo(version=version, bucket_count=3, producers={channel: Producer(incarnation, 3 * version)},
                          whole=True)
        assert receiver.receive(info, t.loader(worker)) == 12
    torch.cuda.synchronize()
    assert t.same(worker, trainer)
    receiver.close()
"""


def test_the_worker_path_loads_a_device_channel_into_a_cuda_module(channel):
    if not gpu_here():
        pytest.skip("no CUDA device here")
    here = os.path.dirname(__file__)
    run = [sys.executable, "-c", DEVICE_PATH]
    trainer = subprocess.Popen(run + ["trainer", channel, here], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    worker = subprocess.Popen(run + ["worker", channel, here], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    worker.stdin.write(trainer.stdout.readline())
    worker.stdin.flush()
    assert worker.stdout.readline() == "attached\n"
    trainer.stdin.write("go\n")
    trainer.stdin.flush()
    assert worker.wait(timeout=180) == 0
    assert trainer.wait(timeout=60) == 0
