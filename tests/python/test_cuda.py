"""Device channels from Python: CUDA tensors in, CUDA views out, load_into on the GPU.

A trainer and a server run as their own processes, each initialising CUDA itself; the tests
that need a GPU are skipped without one (asked in a child process, so this one never
initialises CUDA). The refusals run everywhere."""
import copy
import os
import subprocess
import sys

import pytest
import torch

import tensorbucket


def gpu_here():
    probe = "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)"
    return subprocess.run([sys.executable, "-c", probe], timeout=120).returncode == 0


GPU = gpu_here()
needs_gpu = pytest.mark.skipif(not GPU, reason="no CUDA device here")


@pytest.fixture
def channel(request):
    name = "".join(c if c.isalnum() or c in "._-" else "-" for c in request.node.name)
    return f"tbcu-{os.getpid()}-{name}"[:64]


def leftovers(channel):
    return [name for name in os.listdir("/dev/shm") if name.startswith(f"tensorbucket.{channel}")]


@pytest.mark.skipif(GPU, reason="this machine has CUDA: the GPU tests cover it")
def test_a_device_channel_without_cuda_is_a_device_error(channel):
    with pytest.raises(tensorbucket.DeviceError, match="CudaUnavailable: no CUDA driver in this process"):
        tensorbucket.Publisher(channel, device="cuda:0")
    assert leftovers(channel) == []


def test_a_device_that_is_no_device_is_refused(channel):
    for device in ["tpu", "cuda:-1", "cuda:x"]:
        with pytest.raises(tensorbucket.Error, match="is not 'host', 'cuda' or 'cuda:N'"):
            tensorbucket.Publisher(channel, device=device)
    assert leftovers(channel) == []


def test_a_subscriber_asking_for_another_location_is_refused(channel):
    with tensorbucket.Publisher(channel, device=torch.device("cpu")) as publisher:
        with pytest.raises(tensorbucket.ChannelError, match="LocationMismatch: .* in host memory, not on a CUDA device"):
            tensorbucket.Subscriber(channel, timeout=1, device="cuda")
        with tensorbucket.Subscriber(channel, timeout=1, device="cpu") as subscriber:
            publisher.publish({"w": torch.ones(3)})
            bucket = subscriber.next(timeout=5)
            assert bucket["w"].device.type == "cpu"


# An exact integer digest of a module's tensors: every byte, weighted by its place. Equal
# digests mean bit-identical tensors, whatever their shapes. The GPU processes below use it,
# and test_the_digest_is_exact_on_cpu_tensors runs it here, so it cannot break unseen.
DIGEST = r"""
def digest(module):
    total = 0
    for tensor in module.state_dict().values():
        data = tensor.detach().reshape(-1).view(torch.uint8).to(torch.int64)
        total += int(data.mul(torch.arange(data.numel(), device=data.device) % 251 + 1).sum())
    return total
"""


def test_the_digest_is_exact_on_cpu_tensors():
    scope = {"torch": torch}
    exec(DIGEST, scope)
    digest = scope["digest"]
    torch.manual_seed(0)
    # 2-D parameters, as the GPU tests' (small: torch's threads would be ThreadSanitizer's noise).
    model = torch.nn.Sequential(torch.nn.Linear(32, 32), torch.nn.BatchNorm1d(32), torch.nn.Linear(32, 10))
    twin = copy.deepcopy(model)
    assert digest(model) == digest(twin)
    with torch.no_grad():
        twin[2].weight.view(-1).view(torch.int32)[100] ^= 1  # one bit of one parameter
    assert digest(model) != digest(twin)


# A trainer (AdamW on CUDA parameters) and a server loading every update into its own CUDA
# model; each step's parameters must be bit-identical on both sides, as the digest says.
TRAINER_AND_SERVER = r"""
import sys, torch, tensorbucket
role, channel, steps, out = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4]

def model():
    torch.manual_seed(0)
    return torch.nn.Sequential(*[torch.nn.Linear(256, 256) for _ in range(8)]).cuda()
""" + DIGEST + r"""
net = model()
with open(out, "w") as log:
    if role == "trainer":
        optimizer = torch.optim.AdamW(net.parameters(), lr=1e-3)
        with tensorbucket.Publisher(channel, device="cuda:0") as publisher:
            try:
                publisher.publish({"cpu": torch.ones(3)})
                raise SystemExit("a CPU tensor was published on a device channel")
            except tensorbucket.Error as e:
                assert "is on cpu" in str(e), e
            for step in range(steps):
                loss = net(torch.randn(64, 256, device="cuda")).square().mean()
                optimizer.zero_grad()
                loss.backward()
                optimizer.step()
                publisher.publish(net.state_dict(), version=step, timeout=60)
                log.write(f"{step} {digest(net)}\n")
            assert publisher.drain(timeout=60)
    else:
        targets = net.state_dict(keep_vars=True)
        with torch.no_grad():
            for p in targets.values():
                p.zero_()
        with tensorbucket.Subscriber(channel, timeout=60, device="cuda") as subscriber:
            for step in range(steps):
                bucket = subscriber.next(timeout=60)
                assert bucket.version == step
                assert all(t.is_cuda for t in bucket.values())
                tensorbucket.load_into(targets, bucket)
                bucket.release()
                log.write(f"{step} {digest(net)}\n")
"""


def run_trainer_and_server(channel, tmp_path, trainer_env=None, steps=20):
    trainer_out, server_out = tmp_path / "trainer.txt", tmp_path / "server.txt"
    server = subprocess.Popen([sys.executable, "-c", TRAINER_AND_SERVER, "server", channel, str(steps),
                               str(server_out)])
    trainer = subprocess.run([sys.executable, "-c", TRAINER_AND_SERVER, "trainer", channel, str(steps),
                              str(trainer_out)], env={**os.environ, **(trainer_env or {})}, timeout=300)
    assert server.wait(timeout=300) == 0
    assert trainer.returncode == 0
    sent, loaded = trainer_out.read_text().splitlines(), server_out.read_text().splitlines()
    assert len(sent) == steps and sent == loaded
    assert leftovers(channel) == []


@needs_gpu
def test_a_server_loads_every_update_of_a_cuda_trainer_bit_identically(channel, tmp_path):
    run_trainer_and_server(channel, tmp_path)


@needs_gpu
def test_tensors_from_expandable_segments_publish(channel, tmp_path):
    run_trainer_and_server(channel, tmp_path, {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}, steps=5)
