"""Internal: a whole weight update over a channel, trainer to inference workers, without vLLM.

tensorbucket.vllm plugs this into vLLM's weight-transfer API; the GPU check drives the same
receive path against a plain torch module. The control plane is JSON: what the trainer tells
the workers (init info, update info) is dicts of strings, numbers and booleans, and a worker
checks every field before it uses one, as it checks every bucket (docs/vllm.md).

- The trainer plans its update once, from its source's groups (a decoder layer each) and their
  sizes: groups are packed in order into buckets of at most `bucket_bytes` (a larger group is
  a bucket alone), so a layer never straddles two buckets.
- Each update is one version: its buckets, published in order, then taken by every worker. An
  update that fits the slots is taken whole (every bucket verified and leased before anything is
  loaded); a larger one streams, a bucket at a time, released once loaded.
"""
import math
import re
import threading
import time
import traceback
from collections.abc import Callable, Generator, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Optional

import torch

from . import Bucket, Error, InvalidArgument, ManifestError, ProducerGone, Publisher, Subscriber, Timeout, Update, _error

#: A weight loader: vLLM's model.load_weights, or any callable that takes (name, tensor) pairs.
Load = Callable[[Iterable[tuple[str, torch.Tensor]]], Any]

_ALIGNMENT = 256  # entries are packed at 256-byte offsets (docs/format.md)
_MOST_SLOTS = 16  # a channel's slots (ipc/control.hpp, kMaxSlots)
#: The longest wait init info may ask a worker for, in seconds: a worker's wait holds its engine.
LONGEST_WAIT = 3600
_CHANNEL = re.compile(r"[A-Za-z0-9_-][A-Za-z0-9._-]{0,63}")
_U64 = 2**64 - 1


def device_key(device: torch.device) -> str:
    """What a device is called in init info: a CUDA device by its UUID, as vLLM's IPC backend
    keys its handles (what CUDA_VISIBLE_DEVICES cannot change); the host "cpu"."""
    if device.type == "cuda":
        index = device.index if device.index is not None else torch.cuda.current_device()
        return str(torch.cuda.get_device_properties(index).uuid)
    return device.type


# -- The control plane's fields, checked: they come from another process, over HTTP maybe.

def _field(info: Mapping[str, Any], name: str, kind: type, what: str) -> Any:
    value = info.get(name)
    if type(value) is not kind:
        raise _error(InvalidArgument, f"{what}: '{name}' must be {kind.__name__}, not {type(value).__name__}")
    return value


def _channel_name(value: object, what: str) -> str:
    if type(value) is not str or not _CHANNEL.fullmatch(value):
        raise _error(InvalidArgument, f"{what}: {value!r} is not a channel name (1-64 of A-Z a-z 0-9 . _ -)")
    return value


def _count(value: object, what: str, low: int = 0, high: int = _U64) -> int:
    if type(value) is not int or not low <= value <= high:
        raise _error(InvalidArgument, f"{what} must be an integer from {low} to {high}, not {value!r}")
    return value


def _incarnation(value: object, what: str) -> int:
    # A decimal string: 64 bits, more than a JSON number holds exactly everywhere.
    if type(value) is not str or not (value.isascii() and value.isdigit() and len(value) <= 20) or int(value) > _U64:
        raise _error(InvalidArgument, f"{what} must be a decimal string of a 64-bit incarnation, not {value!r}")
    return int(value)


@dataclass(frozen=True)
class Route:
    """What a worker attaches to: its channel, where the channel's payloads live, how long a
    wait may take."""

    channel: str
    device: str  # "cpu" or "cuda"
    timeout: float


def route(init_info: Mapping[str, Any], key: str) -> Route:
    """The channel a worker on the device called `key` takes (device_key()): the one channel
    the init info names, or, where it names one per device ("channels": {key: channel}), its
    device's."""
    what = "tensorbucket init info"
    if not isinstance(init_info, Mapping):
        raise _error(InvalidArgument, f"{what} must be a dict, not {type(init_info).__name__}")
    channel, channels = init_info.get("channel"), init_info.get("channels")
    if (channel is None) == (channels is None):
        raise _error(InvalidArgument, f"{what} must name either 'channel' or 'channels' (one per device)")
    if channels is not None:
        if not isinstance(channels, Mapping) or not channels:
            raise _error(InvalidArgument, f"{what}: 'channels' must map device keys to channel names")
        if key not in channels:
            raise _error(InvalidArgument, f"{what} names no channel for this worker's device {key} "
                         f"(it names {', '.join(sorted(map(str, channels)))})")
        channel = channels[key]
    device = _field(init_info, "device", str, what)
    if device not in ("cpu", "cuda"):
        raise _error(InvalidArgument, f"{what}: 'device' must be \"cpu\" or \"cuda\", not {device!r}")
    timeout = init_info.get("timeout")
    if not isinstance(timeout, (int, float)) or isinstance(timeout, bool) or not 0 < timeout <= LONGEST_WAIT:
        raise _error(InvalidArgument, f"{what}: 'timeout' must be seconds above 0, at most {LONGEST_WAIT}, "
                     f"not {timeout!r}")
    return Route(_channel_name(channel, f"{what}: its channel"), device, float(timeout))


@dataclass(frozen=True)
class Producer:
    """A channel's producer as an update announces it: its incarnation, and the sequence (the
    count of buckets it published before) of the update's first bucket."""

    incarnation: int
    sequence: int


@dataclass(frozen=True)
class UpdateInfo:
    """One update as the trainer announces it: its version, how many buckets it has, each
    channel's producer, and whether the workers take it whole."""

    version: int
    bucket_count: int
    producers: Mapping[str, Producer]
    whole: bool

    def to_json(self) -> dict[str, Any]:
        return {"version": self.version, "bucket_count": self.bucket_count,
                "producers": {channel: {"incarnation": str(producer.incarnation), "sequence": producer.sequence}
                              for channel, producer in self.producers.items()},
                "whole": self.whole}

    @staticmethod
    def parse(info: Mapping[str, Any]) -> "UpdateInfo":
        what = "tensorbucket update info"
        if not isinstance(info, Mapping):
            raise _error(InvalidArgument, f"{what} must be a dict, not {type(info).__name__}")
        unknown = set(info) - {"version", "bucket_count", "producers", "whole"}
        if unknown:
            raise _error(InvalidArgument, f"{what} has unknown fields: {', '.join(sorted(map(str, unknown)))}")
        producers = {}
        for channel, producer in _field(info, "producers", dict, what).items():
            where = f"{what}: the producer of {channel!r}"
            if not isinstance(producer, Mapping) or set(producer) != {"incarnation", "sequence"}:
                raise _error(InvalidArgument, f"{where} must be {{\"incarnation\": ..., \"sequence\": ...}}")
            producers[_channel_name(channel, f"{what}: 'producers'")] = Producer(
                _incarnation(producer["incarnation"], f"{where}: 'incarnation'"),
                _count(producer["sequence"], f"{where}: 'sequence'"))
        return UpdateInfo(
            version=_count(info.get("version"), f"{what}: 'version'"),
            bucket_count=_count(info.get("bucket_count"), f"{what}: 'bucket_count'", 1, 2**32 - 1),
            producers=producers,
            whole=_field(info, "whole", bool, what),
        )


# -- The trainer's side.

def _padded_bytes(dtype: torch.dtype, shape: Sequence[int]) -> int:
    size = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    return (size + _ALIGNMENT - 1) // _ALIGNMENT * _ALIGNMENT


def plan_buckets(groups: Sequence[Sequence[str]], sizes: Mapping[str, int], bucket_bytes: int) -> list[list[str]]:
    """Groups packed in order into buckets of at most `bucket_bytes` (a larger group alone):
    the names of each bucket."""
    buckets: list[list[str]] = []
    filled = bucket_bytes  # no open bucket yet
    for group in groups:
        size = sum(sizes[name] for name in group)
        if not group:
            continue
        if filled + size > bucket_bytes:
            buckets.append([])
            filled = 0
        buckets[-1] += group
        filled += size
    return buckets


class UpdatePublisher:
    """A trainer's channel and its plan: publishes each update's groups as its buckets.

    groups: the source's groups of names, in the order iteration yields them.
    shapes: each name's (dtype, shape), as the source declares them.
    """

    def __init__(self, channel: str, groups: Sequence[Sequence[str]],
                 shapes: Mapping[str, tuple[torch.dtype, Sequence[int]]], *, device: Optional[str],
                 bucket_bytes: int, slots: int, policy: str, checksum: bool, max_consumers: int,
                 timeout: float) -> None:
        sizes = {name: _padded_bytes(dtype, shape) for name, (dtype, shape) in shapes.items()}
        self.plan = plan_buckets(groups, sizes, bucket_bytes)
        if not self.plan:
            raise _error(InvalidArgument, "the weight source has no tensors to send")
        buckets = len(self.plan)
        if policy not in ("block", "latest"):
            raise _error(InvalidArgument, f"policy must be \"block\" or \"latest\", not {policy!r}")
        if policy == "latest":
            # The newest whole update for each consumer, and one being written.
            slots = max(slots, (max_consumers + 1) * buckets)
        elif buckets <= slots:
            # An update is taken, and loaded, before the next one is published: its own buckets
            # are all the slots it needs. Each slot then always holds the same bucket of the
            # plan, and is sized once (a slot that held a small bucket and later a large one
            # would be made again, its pages zeroed and mapped afresh on both sides).
            slots = buckets
        if slots > _MOST_SLOTS:
            raise _error(InvalidArgument, f"an update of {buckets} buckets of at most {bucket_bytes} bytes needs {slots} "
                         f"slots under the {policy!r} policy, and a channel has at most {_MOST_SLOTS}: raise "
                         f"bucket_bytes{' or lower max_consumers' if policy == 'latest' else ''}")
        self.whole = buckets <= slots
        self.timeout = timeout
        self.channel = channel
        self.device = "cuda" if device is not None and torch.device(device).type == "cuda" else "cpu"
        self._options: dict[str, Any] = dict(slots=slots, max_consumers=max_consumers, checksum=checksum,
                                             device=device, policy=policy,
                                             update_buckets=buckets if policy == "latest" else 1)
        self._publisher: Optional[Publisher] = Publisher(channel, **self._options)
        self._closing = threading.Lock()

    @property
    def incarnation(self) -> int:
        assert self._publisher is not None
        return self._publisher.incarnation

    @property
    def closed(self) -> bool:
        return self._publisher is None

    @property
    def sequence(self) -> int:
        """The sequence the next bucket will have: the buckets published so far."""
        assert self._publisher is not None
        return self._publisher.published

    def reopen(self) -> None:
        """The channel again, under a new producer incarnation: after close(), which ended an
        update its consumers were waiting for."""
        self._publisher = Publisher(self.channel, **self._options)

    def publish(self, version: int, groups: Iterator[tuple[Sequence[str], Sequence[torch.Tensor]]],
                stop: threading.Event) -> None:
        """Publishes every bucket of the plan as update `version`, from `groups` as the source
        yields them (checked against the plan). Once `stop` is set (the workers failed: nobody
        takes the rest) it publishes no more, but still takes what the source yields: its
        gathers are collectives the trainer's other ranks take part in."""
        count = len(self.plan)
        pending: dict[str, torch.Tensor] = {}
        for index, names in enumerate(self.plan):
            while len(pending) < len(names):
                try:
                    group_names, tensors = next(groups)
                except StopIteration:
                    raise _error(ManifestError, f"the weight source ended before bucket {index} of {count}: "
                                 f"it yielded fewer tensors than its metadata() declares") from None
                for name, tensor in zip(group_names, tensors):
                    pending[name] = _materialized(tensor)
            if list(pending) != names:
                raise _error(ManifestError, f"bucket {index} of update {version} should hold {_some(names)} "
                             f"but the weight source yielded {_some(list(pending))}: its iteration must "
                             "follow its metadata()")
            publisher = self._publisher
            if stop.is_set() or publisher is None:
                drain(groups)
                return
            publisher.publish(pending, version=version, bucket_index=index, bucket_count=count,
                              timeout=self.timeout)
            pending = {}

    def close(self) -> None:
        """Closes the channel: its consumers get ProducerGone once they took what was published.
        Safe from any thread (the trainer's closes it from the one that waits for the workers)."""
        with self._closing:
            publisher, self._publisher = self._publisher, None
        if publisher is not None:
            publisher.close()


def drain(groups: Iterator[Any]) -> None:
    """Takes whatever the source still yields, publishing nothing."""
    for _ in groups:
        pass


def _materialized(tensor: torch.Tensor) -> torch.Tensor:
    # An FSDP DTensor gathered into a full one (vLLM's materialize_full_tensor), plain tensors as
    # they are; detached, and contiguous, which publish() copies from.
    full_tensor = getattr(tensor, "full_tensor", None)
    if callable(full_tensor):
        tensor = full_tensor()
    tensor = tensor.detach()
    return tensor if tensor.is_contiguous() else tensor.contiguous()


def _some(names: Sequence[str]) -> str:
    shown = ", ".join(repr(name) for name in names[:3])
    return f"[{shown}{', ...' if len(names) > 3 else ''}] ({len(names)} names)"


# -- The worker's side.

class UpdateReceiver:
    """A worker's subscription: takes each announced update and loads it.

    Attached once to its route's channel (waiting up to its timeout for the trainer). Not
    thread-safe: vLLM calls a worker's engine from one thread.
    """

    def __init__(self, route: Route, device: torch.device) -> None:
        self.route = route
        self.device = device
        self._subscriber = Subscriber(route.channel, timeout=route.timeout, device=route.device)

    def receive(self, info: UpdateInfo, load: Load) -> int:
        """Takes the update `info` announces, verified (every bucket's version, place, producer
        incarnation and sequence), and feeds its zero-copy views to `load`; returns the tensors
        loaded. Buckets are released once loaded, also when `load` raises."""
        producer = info.producers.get(self.route.channel)
        if producer is None:
            raise _error(InvalidArgument, f"update {info.version} names no producer for this worker's "
                         f"channel '{self.route.channel}'")
        if info.whole:
            with self._due(info, producer, None) as update:
                self._check_device(update)
                return _loaded(load, update.items(), info, None, self.route.channel)
        loaded = 0
        for index in range(info.bucket_count):
            with self._due(info, producer, index) as bucket:
                self._check_device(bucket)
                loaded += _loaded(load, bucket.items(), info, index, self.route.channel)
        return loaded

    def close(self) -> None:
        self._subscriber.close()

    def _due(self, info: UpdateInfo, producer: Producer, index: Optional[int]) -> Any:
        """The whole update (index None), or its bucket `index`, as announced, within the
        route's timeout. What its producer published before the announced update (an update
        its trainer abandoned, one of an earlier try of the same version) is skipped; anything
        else is refused, released first."""
        deadline = time.monotonic() + self.route.timeout
        sequence = producer.sequence + (index or 0)
        while True:
            left = max(0.0, deadline - time.monotonic())
            try:
                got: Any = (self._subscriber.next_update(timeout=left) if index is None
                            else self._subscriber.next(timeout=left))
            except ProducerGone as gone:
                raise self._gone(info, gone) from None
            if got is None:
                raise self._late(info, index)
            if got.incarnation == producer.incarnation and got.sequence < sequence and index in (None, 0):
                got.release()
                continue
            place = (got.incarnation, got.sequence, got.version, got.bucket_count,
                     got.bucket_index if index is not None else None)
            if place != (producer.incarnation, sequence, info.version, info.bucket_count, index):
                got.release()
                raise _error(ManifestError, f"channel '{self.route.channel}' holds {_described(*place)} where "
                             f"{_described(producer.incarnation, sequence, info.version, info.bucket_count, index)} "
                             "was announced (a trainer that restarts initializes the transfer again)")
            return got

    def _check_device(self, received: Mapping[str, torch.Tensor]) -> None:
        first = next(iter(received.values()), None)
        if self.route.device == "cuda" and first is not None and first.device != self.device:
            raise _error(InvalidArgument, f"channel '{self.route.channel}' holds its payloads on {first.device}, "
                         f"not on this worker's {self.device}: name one channel per device ('channels')")

    def _gone(self, info: UpdateInfo, gone: ProducerGone) -> Error:
        return _error(ProducerGone, f"the trainer of channel '{self.route.channel}' is gone before update "
                      f"{info.version} was whole ({gone}); a new trainer initializes the transfer again")

    def _late(self, info: UpdateInfo, index: Optional[int]) -> Error:
        part = "whole" if index is None else f"at bucket {index} of {info.bucket_count}"
        return _error(Timeout, f"update {info.version} on channel '{self.route.channel}' was not {part} within "
                      f"{self.route.timeout:g} s: its trainer stalled or died without closing the channel")


def _described(incarnation: int, sequence: int, version: int, count: int, index: Optional[int]) -> str:
    what = f"update {version} of {count} buckets" if index is None else f"bucket {index} of {count} of update {version}"
    return f"{what} (producer incarnation {incarnation}, sequence {sequence})"


def _loaded(load: Load, tensors: Iterable[tuple[str, torch.Tensor]], info: UpdateInfo, index: Optional[int],
            channel: str) -> int:
    """Feeds `tensors` to `load`; what it raises is raised again, of the same type where that
    can be made, with the update, the bucket and the tensor it came at."""
    seen: list[str] = []

    def watched() -> Generator[tuple[str, torch.Tensor], None, None]:
        for name, tensor in tensors:
            seen.append(name)
            yield name, tensor

    pairs = watched()
    try:
        load(pairs)
    except Exception as failure:
        # The frames the failure passed through hold views (the loader's, vLLM's): cleared, so
        # that the slots go back when the bucket is released, not when the error is forgotten.
        pairs.close()
        traceback.clear_frames(failure.__traceback__)
        where = "" if index is None else f", bucket {index} of {info.bucket_count}"
        at = f" at '{seen[-1]}' (tensor {len(seen)})" if seen else ""
        message = f"loading update {info.version} from channel '{channel}'{where} failed{at}: {failure}"
        try:
            surfaced = type(failure)(message)
        except Exception:
            surfaced = RuntimeError(message)
        raise surfaced from failure
    return len(seen)
