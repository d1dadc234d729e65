"""The backend in an offline vllm.LLM (engine core and worker in processes of their own, each
loading tensorbucket through its entry point), driven by the trainer engine in this process
through LLMClient: what each update generates, against HuggingFace on the same weights."""
import os
import time

import pytest
import torch
from conftest import PROMPTS, engine_args, generate, llama, reference, same_generation

import tensorbucket
from tensorbucket.vllm import BACKEND, LLMClient, TrainerEngine, TrainerInitInfo

from vllm.distributed.weight_transfer.base import ModuleSource, ParamMeta, WeightSource


class Tensors(WeightSource):
    """A source of the given tensors, in order: part of a model, or a name it does not have."""

    def __init__(self, tensors: dict[str, torch.Tensor]) -> None:
        self.tensors = tensors

    def metadata(self) -> list[ParamMeta]:
        return [ParamMeta(name, tensor.dtype, tuple(tensor.shape)) for name, tensor in self.tensors.items()]

    def __iter__(self):
        return iter(self.tensors.items())


@pytest.fixture(scope="module")
def llm(model_dir):
    from vllm import LLM

    engine = LLM(**engine_args(model_dir))
    yield engine
    engine.llm_engine.engine_core.shutdown()


@pytest.fixture
def channel(request):
    return f"tbvllm-{os.getpid()}-{request.node.name}"[:60]


def trainer(llm, source, channel, **options) -> TrainerEngine:
    return TrainerEngine.trainer_init(TrainerInitInfo(rank=0, channel=channel, **options), client=LLMClient(llm),
                                      source=source)


def test_a_full_update_generates_what_huggingface_generates_with_the_same_weights(llm, channel):
    assert generate(llm) == generate(llm)  # greedy: the comparison below can tell
    same_generation(generate(llm), reference(llama(0)))
    new = llama(1)
    engine = trainer(llm, ModuleSource(new), channel)
    engine.send_weights(version=41)
    same_generation(generate(llm), reference(new))
    assert llm.get_weight_version() == "41"
    engine.shutdown()


def test_a_partial_update_replaces_one_tensor_and_keeps_the_others(llm, channel):
    base, head = llama(2), llama(3).lm_head.weight.detach()
    engine = trainer(llm, ModuleSource(base), channel)
    engine.send_weights()
    engine.shutdown()
    engine = trainer(llm, Tensors({"lm_head.weight": head}), channel)
    engine.send_weights()
    with torch.no_grad():
        base.lm_head.weight.copy_(head)
    same_generation(generate(llm), reference(base))
    engine.shutdown()


def test_twenty_updates_in_a_row_each_generate_as_their_weights(llm, channel):
    model = llama(4)
    engine = trainer(llm, ModuleSource(model), channel)
    for step in range(20):
        with torch.no_grad():  # a training step: every parameter moves, in place
            for parameter in model.parameters():
                parameter.add_(torch.randn_like(parameter) * 0.05)
        engine.send_weights()
        same_generation(generate(llm), reference(model))
        assert llm.get_weight_version() == str(step)
    engine.shutdown()


# Whole, and streamed through two slots in small buckets: there the worker fails while the
# trainer waits for a slot, which its failure must end at once, not at the trainer's timeout.
@pytest.mark.parametrize("options", [{}, {"bucket_bytes": 64 << 10, "slots": 2, "timeout": 120.0}])
def test_a_name_the_model_does_not_have_is_refused_by_name_and_the_next_update_is_served(llm, channel, options):
    good = llama(5)
    tensors = {}
    for name, tensor in good.state_dict().items():  # in layer order, as a source yields them
        tensors[name] = tensor
        if name == "model.layers.1.mlp.down_proj.weight":
            tensors["model.layers.1.mlp.bogus.weight"] = torch.ones(4)
    engine = trainer(llm, Tensors(tensors), channel, **options)
    start = time.monotonic()
    with pytest.raises(Exception, match="(?s)loading update 0 from channel .*model.layers.1.mlp.bogus"):
        engine.send_weights()
    assert time.monotonic() - start < 30
    generate(llm)  # the worker still serves: what the failed update did not finish kept its weights
    engine.shutdown()
    engine = trainer(llm, ModuleSource(good), channel)
    engine.send_weights()
    same_generation(generate(llm), reference(good))
    engine.shutdown()


def test_under_latest_a_consumer_holding_an_update_holds_nothing_back(llm, channel):
    model = llama(6)
    engine = trainer(llm, ModuleSource(model), channel, policy="latest", max_consumers=2)
    with tensorbucket.Subscriber(channel, timeout=10) as slow:
        engine.send_weights()
        held = slow.next_update(timeout=10)  # and never released while the trainer goes on
        for _ in range(6):
            with torch.no_grad():
                for parameter in model.parameters():
                    parameter.add_(0.01)
            engine.send_weights()
            same_generation(generate(llm), reference(model))
        assert held is not None and held.version == 0
        held.release()
    engine.shutdown()


def test_under_block_a_stalled_consumer_times_the_update_out_by_name_and_the_trainer_goes_on(llm, channel):
    model = llama(7)
    engine = trainer(llm, ModuleSource(model), channel, timeout=2.0)
    stalled = tensorbucket.Subscriber(channel, timeout=10)
    with pytest.raises(tensorbucket.Timeout, match=f"waiting for consumer pid {os.getpid()}"):
        for _ in range(3):  # one slot, the update's one bucket: the second update finds it unread
            engine.send_weights()
    stalled.close()
    engine.send_weights()  # on a new incarnation of the channel, which the workers were told of
    same_generation(generate(llm), reference(model))
    engine.shutdown()


def test_an_update_info_the_worker_refuses_leaves_it_serving_the_weights_it_had(llm, channel):
    model = llama(8)
    engine = trainer(llm, ModuleSource(model), channel)
    engine.send_weights()
    with pytest.raises(tensorbucket.InvalidArgument, match="version must be an integer from 0"):
        engine.send_weights(version=-1)
    client = LLMClient(llm)
    client.start_weight_update()  # every layer is put aside for the update
    with pytest.raises(Exception, match="Invalid update_info"):
        client.update_weights({"version": 1})
    with pytest.raises(Exception, match="'whole' must be bool"):
        client.start_weight_update()
        client.update_weights({"version": 1, "bucket_count": 1, "producers": {}, "whole": "yes"})
    same_generation(generate(llm), reference(model))  # each failed update gave the layers back
    engine.send_weights()
    same_generation(generate(llm), reference(model))
    engine.shutdown()


def test_a_channel_missing_or_elsewhere_is_refused_at_init(llm, channel):
    client = LLMClient(llm)
    with pytest.raises(Exception, match="ChannelMissing"):
        client.init_weight_transfer_engine({"channel": channel, "device": "cpu", "timeout": 0.5})
    with tensorbucket.Publisher(channel):
        with pytest.raises(Exception, match="LocationMismatch"):
            client.init_weight_transfer_engine({"channel": channel, "device": "cuda", "timeout": 0.5})
    with pytest.raises(Exception, match="must name either 'channel' or 'channels'"):
        client.init_weight_transfer_engine({"device": "cpu", "timeout": 0.5})


def test_registration_is_idempotent_and_an_untested_vllm_is_refused_with_the_range(monkeypatch):
    import vllm
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory

    import tensorbucket.vllm as backend

    backend.register()
    backend.register()
    assert BACKEND in WeightTransferEngineFactory._registry
    monkeypatch.setattr(vllm, "__version__", "0.40.1")
    with pytest.raises(RuntimeError, match="tested with vLLM >= 0.32, < 0.33, not vLLM 0.40.1"):
        backend._Refused()
    monkeypatch.setenv("TENSORBUCKET_VLLM_ANY_VERSION", "1")
    assert backend._untested_vllm() is None


def test_a_fused_layer_sent_in_part_is_refused_and_the_engine_serves_what_it_had(llm, channel):
    """vLLM fuses q, k and v (and gate and up) into one layer: one part alone used to be
    processed with the others uninitialized (NaN logprobs), reported as a success."""
    base = llama(5)
    engine = trainer(llm, ModuleSource(base), channel)
    engine.send_weights()
    engine.shutdown()
    part = llama(6).model.layers[0].self_attn.q_proj.weight.detach()
    engine = trainer(llm, Tensors({"model.layers.0.self_attn.q_proj.weight": part}), channel)
    with pytest.raises(Exception, match="only part of 1 fused layers .'model.layers.0.self_attn.qkv_proj'"):
        engine.send_weights()
    engine.shutdown()
    same_generation(generate(llm), reference(base))


def test_a_session_a_dead_trainer_left_open_keeps_serving(llm, channel):
    """A trainer that dies after start_weight_update leaves the session open: the model used to
    sit on the meta device until finish, and the engine died at its next request."""
    base = llama(7)
    engine = trainer(llm, ModuleSource(base), channel)
    engine.send_weights()
    engine.shutdown()
    llm.start_weight_update()
    same_generation(generate(llm), reference(base))
    llm.finish_weight_update(None)
    same_generation(generate(llm), reference(base))


def test_tied_embeddings_reach_the_head(tmp_path, channel):
    """With tied embeddings, HF's named_parameters() (ModuleSource) names the shared tensor once,
    as the embedding; vLLM keeps its own copy of the head, which kept the old weights."""
    from vllm import LLM

    llama(0, tie=True).save_pretrained(tmp_path)
    llm = LLM(**engine_args(tmp_path))
    try:
        new = llama(8, tie=True)
        assert "lm_head.weight" not in dict(new.named_parameters())
        engine = trainer(llm, ModuleSource(new), channel)
        engine.send_weights()
        engine.shutdown()
        same_generation(generate(llm), reference(new))
    finally:
        llm.llm_engine.engine_core.shutdown()
