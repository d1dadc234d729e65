"""Move named torch tensors between processes as verified zero-copy buckets.

A trainer publishes its weights with a Publisher; a server receives them with a Subscriber,
as a Bucket (or a whole Update of several) of read-only tensor views into shared memory, and
loads them into its model with load_into().

Server exports a channel to other hosts, where a Relay (or `tbucket relay`) republishes it
(docs/network.md).

Every timeout is in seconds; None waits without limit. Ctrl+C interrupts any wait, and an
interrupted publish() has published nothing. Threads sharing a Publisher or a Subscriber take
turns. Every error the library raises is a tensorbucket.Error, whose `code` names the rule that
failed; an argument of the wrong type raises TypeError.
"""
import math
import operator
import os
from collections.abc import Iterable, Iterator, Mapping, Sequence
from types import TracebackType
from typing import Literal, Optional, Tuple, TypeVar, Union

import torch

from . import _C
from ._C import (
    ChannelError,
    ChecksumMismatch,
    DeviceError,
    Error,
    InvalidArgument,
    ManifestError,
    NetworkError,
    ProducerGone,
    Timeout,
)

__version__: str = _C.__version__

# Shown where they are caught from: tensorbucket.Timeout, not tensorbucket._C.Timeout.
for _kind in (ChannelError, ChecksumMismatch, DeviceError, Error, InvalidArgument, ManifestError, NetworkError,
              ProducerGone, Timeout):
    _kind.__module__ = __name__
del _kind

__all__ = [
    "Bucket",
    "ChannelError",
    "ChecksumMismatch",
    "DeviceError",
    "Error",
    "InvalidArgument",
    "ManifestError",
    "NetworkError",
    "ProducerGone",
    "Publisher",
    "Relay",
    "Server",
    "Subscriber",
    "Timeout",
    "Update",
    "load_into",
    "save",
]

#: What publish() takes: a mapping {name: tensor} (a state_dict, a Bucket) or (name, tensor)
#: pairs, published in their order.
Tensors = Union[Mapping[str, torch.Tensor], Sequence[Tuple[str, torch.Tensor]]]
#: Where a channel's payloads live: None or "cpu" (host shared memory), "cuda:N" or a
#: torch.device (that GPU).
Device = Union[str, torch.device, None]
#: How a Publisher treats a slow consumer: "block" waits for it, "latest" never does.
Policy = Literal["block", "latest"]

_U32 = 2**32 - 1
_U64 = 2**64 - 1


class _FileMode(int):
    """A permission mode that shows as one: 0o600, not 384."""

    def __repr__(self) -> str:
        return oct(self)


def _error(kind: type[Error], message: str) -> Error:
    """An instance of one of tensorbucket's errors, as the bindings make them."""
    error = kind(message)
    error.code = kind.__name__
    error.details = ""
    return error


def _type_name(value: object) -> str:
    """int, str; numpy.bool for what is not a builtin."""
    kind = type(value)
    return kind.__name__ if kind.__module__ == "builtins" else f"{kind.__module__}.{kind.__qualname__}"


# The checks below run on every publish() and next(): an int or a float is let through by its
# type alone, before the slower general case (numpy scalars, 0-d tensors).
def _integer(name: str, value: object, low: int, high: int) -> int:
    if type(value) is not int:
        if isinstance(value, bool):
            raise TypeError(f"{name} must be an int, not bool")
        try:
            value = operator.index(value)  # type: ignore[arg-type]  # what has __index__
        except TypeError:
            raise TypeError(f"{name} must be an int, not {_type_name(value)}") from None
    if value < low:
        raise _error(InvalidArgument, f"{name} must be >= {low}, not {value}")
    if value > high:
        raise _error(InvalidArgument, f"{name} must be <= {high}, not {value}")
    return value


def _seconds(name: str, value: object) -> Optional[float]:
    if value is None:
        return None
    if type(value) is not float and type(value) is not int:
        if isinstance(value, bool) or not hasattr(type(value), "__float__"):
            raise TypeError(f"{name} must be seconds (an int or a float) or None, not {_type_name(value)}")
    try:
        return float(value)  # type: ignore[arg-type]  # negative or NaN: InvalidArgument from _C
    except OverflowError:
        return math.inf  # an int past any float: no limit, as any timeout past ~32 years


def _text(name: str, value: object) -> str:
    if not isinstance(value, str):
        raise TypeError(f"{name} must be a str, not {_type_name(value)}")
    return value


def _path(name: str, value: object) -> bytes:
    """A path as the system takes it (bytes as they are; str and os.PathLike as os.fsencode
    makes them, so a name that is not UTF-8 still reaches the file)."""
    if not isinstance(value, (str, bytes, os.PathLike)):
        raise TypeError(f"{name} must be a path (str, bytes or os.PathLike), not {_type_name(value)}")
    return os.fsencode(value)


def _flag(name: str, value: object) -> bool:
    if isinstance(value, bool):
        return value
    if _type_name(value) in ("numpy.bool", "numpy.bool_"):
        return bool(value)  # numpy's, as the bindings took it
    raise TypeError(f"{name} must be True or False, not {_type_name(value)}")


class Publisher:
    """The producer of a channel: publishes named tensors as verified buckets.

    Each publish() copies the tensors straight into a free slot of shared memory (or of one
    GPU's memory), with a manifest of their names, dtypes and shapes that every consumer
    checks before it sees a tensor. A context manager: leaving it closes the channel and
    removes its segments (close(): drain() first to hand over every bucket).

    channel: the channel's name, as Subscribers and `tbucket` name it.
    slots: buckets in flight at once, each as large as the largest published so far.
    min_consumers: releases each bucket needs before its slot is reused: once the slots are
        full, publish() waits for that many consumers (0: it never waits for one).
    max_consumers: consumers that may attach at once.
    checksum: hash every payload, and have consumers check it.
    mode: the segments' permissions (0o600: this user only).
    device: where payloads live: None or "cpu" (host shared memory), or "cuda:N" or a
        torch.device (that GPU; publish() then takes tensors on it).
    policy: "block" (lossless: publish() waits for a slow consumer) or "latest" (publish()
        never waits for one; it skips to the newest whole update), which needs
        slots >= (max_consumers + 1) * update_buckets.
    update_buckets: the most buckets one update has (only "latest" reserves slots for it).

    Raises ChannelError (ChannelExists) when a live producer owns the name already, and
    InvalidArgument for a bad name or option.
    """

    def __init__(
        self,
        channel: str,
        slots: int = 2,
        min_consumers: int = 1,
        max_consumers: int = 8,
        checksum: bool = False,
        mode: int = _FileMode(0o600),
        device: Device = None,
        policy: Policy = "block",
        update_buckets: int = 1,
    ) -> None:
        self._impl = _C.Publisher(
            _text("channel", channel),
            _integer("slots", slots, 0, _U32),
            _integer("min_consumers", min_consumers, 0, _U32),
            _integer("max_consumers", max_consumers, 0, _U32),
            _flag("checksum", checksum),
            _integer("mode", mode, 0, 0o777),
            device,
            _text("policy", policy),
            _integer("update_buckets", update_buckets, 0, _U32),
        )

    def publish(
        self,
        tensors: Tensors,
        version: int = 0,
        bucket_index: int = 0,
        bucket_count: int = 1,
        groups: Optional[Mapping[str, Sequence[str]]] = None,
        timeout: Optional[float] = 10.0,
    ) -> None:
        """Publish tensors as one bucket, copied straight into a free slot.

        tensors: a mapping {name: tensor} or (name, tensor) pairs. On a CUDA channel, tensors
            on its device, copied after the work queued so far on torch's current stream.
        version: the caller's number for what this is (a training step).
        bucket_index, bucket_count: this bucket's place in an update split into several;
            an update's buckets are published in order, index 0 first.
        groups: {group: [member, ...]}: names that consumers must receive together.
        timeout: how long to wait for a free slot. Timeout then names the consumer that held
            it back (pid, bucket, since when), or says that none is attached; nothing was
            published.

        Raises ManifestError or InvalidArgument for tensors that cannot be published (naming
        the entry), and publishes nothing. A small publish may find that halfway through its
        copy: it then leaves empty the slot it was writing, which held only an older bucket
        that every consumer was done with (never the newest update).
        """
        self._impl.publish(
            tensors,
            _integer("version", version, 0, _U64),
            _integer("bucket_index", bucket_index, 0, _U32),
            _integer("bucket_count", bucket_count, 0, _U32),
            groups,
            _seconds("timeout", timeout),
        )

    def publish_file(
        self,
        paths: Union[str, bytes, "os.PathLike[str]", Sequence[Union[str, bytes, "os.PathLike[str]"]]],
        version: Optional[int] = None,
        bucket_bytes: int = 0,
        timeout: Optional[float] = 10.0,
    ) -> int:
        """Publish safetensors files as one update, each read once straight into the slots.

        paths: one file, or several: their tensors make one update, in order.
        version: the update's; None takes the first file's "tensorbucket.version" metadata
            (what save() writes), else 0.
        bucket_bytes: 0 publishes one bucket per file; otherwise each file's tensors are split,
            in file order, into buckets of at most this many bytes (a larger tensor alone).
        timeout: how long each bucket waits for a free slot. Timeout then says what it waited
            for; the update stays unfinished (consumers of whole updates never see it).

        Every file's header is checked before anything is published: a file that is not
        safetensors, or has a dtype tensorbucket does not carry, raises ManifestError naming the
        entry; one that cannot be read raises Error (SystemError). Returns the buckets published.
        """
        if isinstance(paths, (str, bytes, os.PathLike)):
            paths = [paths]
        if not isinstance(paths, Iterable):
            raise TypeError(f"paths must be a path or a sequence of paths, not {_type_name(paths)}")
        files = [_path("paths", path) for path in paths]
        if not files:
            raise _error(InvalidArgument, "publish_file needs at least one file")
        return self._impl.publish_file(
            files,
            None if version is None else _integer("version", version, 0, _U64),
            _integer("bucket_bytes", bucket_bytes, 0, _U64),
            _seconds("timeout", timeout),
        )

    def drain(self, timeout: Optional[float] = 10.0) -> bool:
        """Wait until consumers released every bucket published; False on timeout."""
        return self._impl.drain(_seconds("timeout", timeout))

    def close(self) -> None:
        """Close the channel and remove its segments; consumers then see ProducerGone. A
        bucket a consumer had not yet begun to receive is lost with its segment: drain()
        first to hand over every bucket published. A publish() or drain() waiting in another
        thread raises InvalidArgument."""
        self._impl.close()

    @property
    def published(self) -> int:
        """Buckets published so far."""
        return self._impl.published

    @property
    def incarnation(self) -> int:
        """Random, new for each Publisher of a channel name: sequences count within one."""
        return self._impl.incarnation

    @property
    def policy(self) -> str:
        """"block" or "latest"."""
        return self._impl.policy

    def __enter__(self) -> "Publisher":
        return self

    def __exit__(
        self,
        kind: Optional[type[BaseException]],
        error: Optional[BaseException],
        traceback: Optional[TracebackType],
    ) -> None:
        self.close()


_Held = TypeVar("_Held", bound="_Received")


class _Received(Mapping[str, torch.Tensor]):
    """What Bucket and Update share: a read-only mapping {name: tensor} of zero-copy views,
    each made on first access, and a handle on the slots they live in."""

    __slots__ = ("_impl", "__weakref__")

    def __init__(self, impl: Union[_C.Bucket, _C.Update]) -> None:
        self._impl = impl

    # Compared and hashed by identity, as a handle: a Mapping's == would compare the tensors.
    __eq__ = object.__eq__
    __hash__ = object.__hash__

    def __getitem__(self, name: str) -> torch.Tensor:
        if type(name) is not str:
            raise KeyError(name)
        return self._impl[name]

    def __len__(self) -> int:
        return len(self._impl)

    def __iter__(self) -> Iterator[str]:
        return iter(self._impl.keys())

    def __contains__(self, name: object) -> bool:
        return name in self._impl

    def tensors(self) -> dict[str, torch.Tensor]:
        """Every view at once, as a dict {name: tensor}."""
        return self._impl.tensors()

    @property
    def version(self) -> int:
        """The version it was published with."""
        return self._impl.version

    @property
    def sequence(self) -> int:
        """The number of its (first) bucket among those its producer published, from 0."""
        return self._impl.sequence

    @property
    def incarnation(self) -> int:
        """The incarnation of the producer that published it."""
        return self._impl.incarnation

    @property
    def publish_start_ns(self) -> int:
        """When the producer began publishing it (an update: its first bucket), as
        time.monotonic_ns() counts."""
        return self._impl.publish_start_ns

    @property
    def published_ns(self) -> int:
        """When it became visible to consumers (an update: its last bucket), as
        time.monotonic_ns() counts."""
        return self._impl.published_ns

    @property
    def received_ns(self) -> int:
        """When it was handed over, as time.monotonic_ns() counts: received_ns -
        publish_start_ns is its latency."""
        return self._impl.received_ns

    def release(self) -> None:
        """Give its slots back, once no view taken from it lives; a second release() raises
        InvalidArgument. On a CUDA channel, after the work queued so far on torch's current
        stream."""
        self._impl.release()

    @property
    def released(self) -> bool:
        """Whether release() was called (for a bucket of an update, also the update's)."""
        return self._impl.released

    def __enter__(self: _Held) -> _Held:
        return self

    def __exit__(
        self,
        kind: Optional[type[BaseException]],
        error: Optional[BaseException],
        traceback: Optional[TracebackType],
    ) -> None:
        if not self._impl.released:  # the block may have released it already
            self.release()


class Bucket(_Received):
    """A verified bucket: a read-only mapping {name: tensor} of zero-copy views.

    Made by Subscriber.next(). Each view is made on first access, and is mapped read-only:
    writing through one faults (SIGSEGV); clone() to modify. The bucket's slot stays leased
    until release() (or the end of a `with` block) and until no view taken from it lives.
    """

    __slots__ = ()
    _impl: _C.Bucket

    @property
    def bucket_index(self) -> int:
        """Its place in its update, from 0."""
        return self._impl.bucket_index

    @property
    def bucket_count(self) -> int:
        """How many buckets its update has."""
        return self._impl.bucket_count

    def __repr__(self) -> str:
        held = "released" if self.released else f"{len(self)} tensors"
        return (f"<tensorbucket.Bucket version={self.version} bucket_index={self.bucket_index} "
                f"bucket_count={self.bucket_count}, {held}>")


class Update(_Received):
    """A whole update: every bucket of one version, and a read-only mapping {name: tensor}
    over all of them.

    Made by Subscriber.next_update() and Subscriber.updates(). Its slots stay leased until
    release() (or the end of a `with` block) and until no view taken from it lives.
    """

    __slots__ = ("_buckets",)
    _impl: _C.Update

    def __init__(self, impl: _C.Update) -> None:
        super().__init__(impl)
        self._buckets = tuple(Bucket(bucket) for bucket in impl.buckets)

    @property
    def buckets(self) -> tuple[Bucket, ...]:
        """Its buckets, in order."""
        return self._buckets

    @property
    def bucket_count(self) -> int:
        """How many buckets it has."""
        return len(self._buckets)

    def __repr__(self) -> str:
        held = ", released" if self.released else ""
        return f"<tensorbucket.Update version={self.version}, {self.bucket_count} buckets{held}>"


class Subscriber:
    """A consumer of a channel: receives its buckets, or whole updates, verified, as
    zero-copy tensor views.

    Attaches to the channel's live producer, waiting up to `timeout` for one; a dead
    producer's leftovers are removed, never attached to (ChannelError ChannelMissing when none
    came). A context manager: leaving it stops receiving.

    device: "cpu" or "cuda" to refuse a channel whose payloads live elsewhere (ChannelError);
        None takes either.
    follow: after ProducerGone, go on with the channel's next producer.
    whole_updates: a subscriber that attaches in the middle of an update starts at the next
        one (False: it takes every bucket still held).
    """

    def __init__(
        self,
        channel: str,
        timeout: Optional[float] = 10.0,
        device: Device = None,
        follow: bool = False,
        whole_updates: bool = True,
    ) -> None:
        self._follow = _flag("follow", follow)
        self._impl = _C.Subscriber(_text("channel", channel), _seconds("timeout", timeout), device,
                                   self._follow, _flag("whole_updates", whole_updates))

    def next(self, timeout: Optional[float] = 10.0, expected: Optional[Tensors] = None) -> Optional[Bucket]:
        """The next bucket, verified; None when none arrived within timeout.

        A CUDA channel's views are CUDA tensors, ready on torch's current stream.
        expected: the model's state_dict (or its tensors); the bucket must match its names,
            dtypes and shapes, or one bucket of a split update a part of them (ManifestError
            ManifestMismatch otherwise, its `details` listing every difference).

        Raises ProducerGone once the producer closed or died and every bucket it published
        was received, and ManifestError for a bucket that fails verification (skipped).
        """
        bucket = self._impl.next(_seconds("timeout", timeout), expected)
        return None if bucket is None else Bucket(bucket)

    def next_update(self, timeout: Optional[float] = 10.0,
                    expected: Optional[Tensors] = None) -> Optional[Update]:
        """The next whole update (every bucket of one version, leased), verified; None when
        none was complete within timeout (the buckets taken so far wait for the next call).

        Needs a channel with at least as many slots as an update has buckets. expected: as
        for next(), against the whole update.
        """
        update = self._impl.next_update(_seconds("timeout", timeout), expected)
        return None if update is None else Update(update)

    def updates(self, timeout: Optional[float] = None,
                expected: Optional[Tensors] = None) -> Iterator[Update]:
        """Iterate over whole updates until the producer is gone (with follow: without end).

        Each update is released when the loop asks for the next; the last one, and one the
        loop breaks out with, stay held until released or dropped. Timeout when none came
        within timeout (None: no limit).
        """
        return self._updates(_seconds("timeout", timeout), expected)

    def _updates(self, timeout: Optional[float], expected: Optional[Tensors]) -> Iterator[Update]:
        previous: Optional[Update] = None
        while True:
            if previous is not None:
                if not previous.released:  # the loop's body may have
                    previous.release()
                previous = None
            try:
                update = self.next_update(timeout, expected)
            except ProducerGone:
                if self._follow:
                    continue  # the next call waits for the next producer
                return
            if update is None:
                raise _error(Timeout, f"no whole update arrived within {timeout} s")
            previous = update
            yield update

    @property
    def incarnation(self) -> int:
        """The incarnation of the producer attached to now."""
        return self._impl.incarnation

    @property
    def policy(self) -> str:
        """The channel's overflow policy: "block" or "latest"."""
        return self._impl.policy

    def close(self) -> None:
        """Stop receiving; a next() waiting in another thread raises InvalidArgument. The
        channel is left once every bucket and view from this subscriber is gone."""
        self._impl.close()

    def __enter__(self) -> "Subscriber":
        return self

    def __exit__(
        self,
        kind: Optional[type[BaseException]],
        error: Optional[BaseException],
        traceback: Optional[TracebackType],
    ) -> None:
        self.close()


class Server:
    """Exports a channel to other hosts over UCX, as `tbucket serve` does: each bucket goes to
    the relays that proved they hold the shared token (`tbucket relay` republishes it into a
    channel on their host). An ordinary consumer of the channel, which follows it across
    producer restarts. A context manager: leaving it disconnects every relay.

    Buckets are sent while serve() runs, in this thread or another one; in between, the channel
    and its relays wait (a relay that waits past peer_timeout is dropped, and reconnects).

    channel: the local channel to export; waits up to `timeout` for its producer.
    listen: "ADDRESS:PORT" ("[ADDRESS]:PORT" for IPv6), an address of this host; there is no
        default, so that weights are never served on every interface by accident. Port 0 picks
        a free one (see `address`).
    token_file: the shared secret, 16-4096 bytes, in a file of this user that neither group nor
        others may read (0600): ChannelError PermissionDenied otherwise.
    peer_timeout: a relay that takes no bucket within this is dropped (plus its size at
        10 MB/s), so a slow or dead host holds the channel at most that long.
    max_peers: relays served at once (1 to 1024); more are refused until one leaves.
    window: buckets sent to a relay before it acknowledged the first of them.

    Raises InvalidArgument for a bad address or option, NetworkError when the address cannot
    be bound (not this host's, or the port is taken), ChannelError when no producer came, and
    Error when this build has no network side (tensorbucket was built without UCX).
    """

    def __init__(
        self,
        channel: str,
        listen: str,
        token_file: Union[str, bytes, "os.PathLike[str]"],
        *,
        peer_timeout: float = 10.0,
        max_peers: int = 16,
        window: int = 2,
        timeout: Optional[float] = 10.0,
    ) -> None:
        if not hasattr(_C, "Server"):
            raise _error(Error, "this build of tensorbucket has no network side: build it where UCX and "
                         "OpenSSL are: PyPI's libucx-cu13 in this Python, and libssl-dev (docs/network.md)")
        seconds = _seconds("peer_timeout", peer_timeout)
        if seconds is None:
            raise TypeError("peer_timeout must be seconds (an int or a float), not None")
        self._impl = _C.Server(
            _text("channel", channel),
            _text("listen", listen),
            _path("token_file", token_file),
            seconds,
            _integer("max_peers", max_peers, 1, _U32),
            _integer("window", window, 1, _U32),
            _seconds("timeout", timeout),
        )

    def serve(self, duration: Optional[float] = None) -> None:
        """Serve for `duration` seconds (None: until close() from another thread, or Ctrl+C).
        While another thread serves, this one waits its turn within the same duration.

        Problems with one relay are logged to stderr and drop that relay only; a local bucket
        that fails its checks is logged and skipped. Raises what else Subscriber.next() raises
        for the local channel, but for ProducerGone: the server waits for the channel's next
        producer. InvalidArgument in a child forked from the serving process.
        """
        self._impl.serve(_seconds("duration", duration))

    def close(self) -> None:
        """Disconnect every relay and leave the channel; a serve() in another thread returns.

        In a forked child, only let go of the server: its links are the parent's.
        """
        self._impl.close()

    @property
    def address(self) -> str:
        """What it listens on, "ADDRESS:PORT", the port resolved."""
        return self._impl.address

    @property
    def peers(self) -> int:
        """Relays that proved the token and are served now (as of at most 50 ms ago while serve() runs)."""
        return self._impl.peers

    @property
    def buckets_served(self) -> int:
        """Buckets sent to at least one relay so far."""
        return self._impl.buckets_served

    def __enter__(self) -> "Server":
        return self

    def __exit__(
        self,
        kind: Optional[type[BaseException]],
        error: Optional[BaseException],
        traceback: Optional[TracebackType],
    ) -> None:
        self.close()


class Relay:
    """Receives a channel that a Server exports on another host and republishes every bucket,
    verified (the manifest's rules and the payload's hash), into a channel of this host, in
    order, as `tbucket relay` does: the servers here use Subscriber unchanged. A context
    manager: leaving it drops the link and closes the local channel.

    Buckets are relayed while relay() runs, in this thread or another one. A link that breaks
    (the Server gone, a silent or hostile peer, local consumers that took no slot within
    `timeout`) is made again, 100 ms later doubling up to 2 s, and the relay resumes at the next
    whole update; what happens is logged to stderr.

    connect: the Server's "HOST:PORT" ("[ADDRESS]:PORT" for IPv6).
    channel: the served channel's name: a Server that serves another is refused.
    token_file: the shared secret, as Server takes it.
    local: the local channel's name (None: the served channel's).
    slots, min_consumers, max_consumers, policy, update_buckets: the local channel's, as
        Publisher takes them.
    timeout: how long a local publish waits for a slot before the link is dropped and made
        again (None: as long as it takes; 0: one try), and, held between 1 and 5 s, a connect.
        Ctrl+C is seen after such a wait; close() from another thread ends it at once.
    idle_timeout: silence (not even the Server's heartbeat) after which the link counts as dead.
    max_bucket_bytes: the largest payload accepted; a larger one is refused before any memory
        is taken for it.

    Raises ChannelError (ChannelExists) when a live producer owns the local name already,
    InvalidArgument for a bad name or option, and Error when this build has no network side.
    """

    def __init__(
        self,
        connect: str,
        channel: str,
        token_file: Union[str, bytes, "os.PathLike[str]"],
        *,
        local: Optional[str] = None,
        slots: int = 2,
        min_consumers: int = 1,
        max_consumers: int = 8,
        policy: Policy = "block",
        update_buckets: int = 1,
        timeout: Optional[float] = 10.0,
        idle_timeout: float = 5.0,
        max_bucket_bytes: int = 64 << 30,
    ) -> None:
        if not hasattr(_C, "Relay"):
            raise _error(Error, "this build of tensorbucket has no network side: build it where UCX and "
                         "OpenSSL are: PyPI's libucx-cu13 in this Python, and libssl-dev (docs/network.md)")
        idle = _seconds("idle_timeout", idle_timeout)
        if idle is None:
            raise TypeError("idle_timeout must be seconds (an int or a float), not None")
        self._impl = _C.Relay(
            _text("connect", connect),
            _text("channel", channel),
            _path("token_file", token_file),
            "" if local is None else _text("local", local),
            _integer("slots", slots, 0, _U32),
            _integer("min_consumers", min_consumers, 0, _U32),
            _integer("max_consumers", max_consumers, 0, _U32),
            _text("policy", policy),
            _integer("update_buckets", update_buckets, 0, _U32),
            _seconds("timeout", timeout),
            idle,
            _integer("max_bucket_bytes", max_bucket_bytes, 0, _U64),
        )

    def relay(self, duration: Optional[float] = None, buckets: int = 0) -> int:
        """Relay for `duration` seconds (None: until close() from another thread, or Ctrl+C,
        which a local publish waiting for a slot delays up to `timeout`), or until `buckets` more
        were republished (0: no limit); return how many were.

        Raises what trying again cannot mend: NetworkError (Unauthorized) while no Server has let
        it in yet, ChannelError (ChannelMissing) when the Server serves another channel;
        NetworkError when UCX in this process makes no worker any more (docs/network.md);
        before the first connection, every error but a NetworkError that says the Server is not
        there.
        """
        return self._impl.relay(_seconds("duration", duration), _integer("buckets", buckets, 0, _U64))

    def drain(self, timeout: Optional[float] = 10.0) -> bool:
        """Wait until the local consumers released every bucket; False at `timeout`."""
        return self._impl.drain(_seconds("timeout", timeout))

    def close(self) -> None:
        """Drop the link and close the local channel; a relay() in another thread returns."""
        self._impl.close()

    @property
    def local_channel(self) -> str:
        """The local channel's name."""
        return self._impl.local_channel

    @property
    def buckets_relayed(self) -> int:
        """Buckets republished so far (as of at most 50 ms ago while relay() runs)."""
        return self._impl.buckets_relayed

    def __enter__(self) -> "Relay":
        return self

    def __exit__(
        self,
        kind: Optional[type[BaseException]],
        error: Optional[BaseException],
        traceback: Optional[TracebackType],
    ) -> None:
        self.close()


def load_into(module: Union[torch.nn.Module, Mapping[str, torch.Tensor]],
              tensors: Union[Bucket, Update, Tensors]) -> None:
    """Copy tensors into a module's parameters and buffers, as strictly as load_state_dict.

    module: a torch.nn.Module, or its state_dict(keep_vars=True), built once (cheaper for a
        server that loads every step).
    tensors: a Bucket (one bucket of a split update loads into the part of module it names),
        a whole Update, or a mapping {name: tensor}.

    Every problem is checked before anything is copied: ManifestError ManifestMismatch leads
    with the counts and the first few names, and lists them all in its `details`.
    """
    if isinstance(tensors, (Bucket, Update)):
        _C.load_into(module, tensors._impl)
    else:
        _C.load_into(module, tensors)


def save(received: Union[Bucket, Update], path: Union[str, bytes, "os.PathLike[str]"]) -> None:
    """Write a received Bucket, or a whole Update, as one safetensors file at `path`.

    Its tensors lie in the buckets' order; its metadata carries "tensorbucket.version" and
    "tensorbucket.bucket_count" (and "tensorbucket.bucket_index" for one bucket of a split
    update), as strings. safetensors.torch.load_file reads it, and Publisher.publish_file
    publishes it again. A device bucket's bytes are copied to the host first. The file is
    written beside `path` and renamed over it, so a failure leaves nothing behind; it takes the
    mode of the file it replaces, else 0666 less the umask.

    Raises ManifestError (BadName) for a name that is not UTF-8, and Error (SystemError) when
    the file cannot be written.
    """
    if not isinstance(received, (Bucket, Update)):
        raise TypeError(f"received must be a tensorbucket.Bucket or Update, not {_type_name(received)}")
    _C.save(received._impl, _path("path", path))
