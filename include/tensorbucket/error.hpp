// Errors: one enum of failure classes, one exception type that carries it.
//
// Every rejection in tensorbucket throws `tensorbucket::Error`; its `code()` says which
// rule failed and its message names the entry and the offending values. A rejection that
// lists many names (a model's every missing parameter) keeps its message short, a summary
// that leads with the counts, and carries the whole list in `details()`. Expected outcomes
// of waiting (a timeout, no data yet) are return values, never errors.
//
// Thread safety: immutable value types; safe to share.
#pragma once

#include <cstdint>
#include <stdexcept>
#include <string>
#include <string_view>
#include <utility>

namespace tensorbucket {

enum class ErrorCode : std::uint8_t {
  InvalidArgument = 1,  // a caller passed something unusable (too-small buffer, bad bucket index)
  MissingManifest,      // the manifest half of a bucket is absent
  MissingPayload,       // the payload half is absent or shorter than the header says
  HeaderCorrupt,        // bad magic, unknown layout version or flags, impossible sizes
  ManifestCorrupt,      // the manifest bytes do not decode, or exceed a decoding bound
  ChecksumMismatch,     // a manifest or payload hash does not match the header
  UnsupportedDtype,     // a dtype outside the table in dtype.hpp
  BadName,              // an empty or over-long entry or group name
  BadShape,             // negative dim, too many dims, or numel x itemsize != byte_length / overflow
  OutOfBounds,          // an entry's byte range ends past the payload
  Overlap,              // two entries' byte ranges overlap
  Misaligned,           // an entry's offset is not a multiple of kPayloadAlignment
  DuplicateName,        // two entries (or two groups) share a name
  IncompleteGroup,      // a declared group lacks a member, or an entry names a group it is not in
  Unmaterialized,       // an entry has a size but no data (a meta / undefined tensor)
  ManifestMismatch,     // the bucket differs from the consumer's expected manifest
  Torn,                 // the producer rewrote a slot while it was being read
  ProducerGone,         // the producer closed or died and every published bucket was consumed
  ChannelExists,        // a live producer already owns the channel name
  ChannelMissing,       // no channel of that name appeared in time
  PermissionDenied,     // the channel belongs to another user, or its mode forbids access
  ChannelFull,          // every consumer record of the channel is taken
  SystemError,          // the operating system refused (shared memory, mapping, futex)
  CudaUnavailable,      // a device channel needs CUDA, and this process has no driver or no device
  DeviceNotVisible,     // the channel's device (by UUID) is not among this process's devices
  CudaFailed,           // a CUDA driver call failed; the message names the call and its error
  LocationMismatch,     // the channel's payloads live elsewhere than this consumer asked for
  NetworkError,         // a remote peer was unreachable, went silent, dropped the link or broke the protocol
  Unauthorized,         // a remote peer did not prove it holds the shared token
};

// The enumerator's name, e.g. "ChecksumMismatch".
std::string_view to_string(ErrorCode code) noexcept;

// What a caller does about an error, one family per code: the Python exception class, the
// `tbucket` exit status and a subscriber's skipping all follow from it (each may tell a code
// apart within its family, never move it to another).
enum class ErrorFamily : std::uint8_t {
  Usage,         // the caller's own mistake: fix the call
  Verification,  // a bucket failed its checks (docs/format.md) or was torn: skip it, the next may be fine
  ProducerGone,  // nothing more will come
  Channel,       // the channel cannot be used as asked: missing, taken, full, forbidden, elsewhere
  Device,        // CUDA: no driver or device, not this device, or a failed call
  Network,       // a remote peer: unreachable, silent, broken, or without the token
  System,        // the operating system refused
};

// Every code is listed, not a default: a new one must be placed on purpose (the compiler
// names a missing one).
constexpr ErrorFamily family_of(ErrorCode code) noexcept {
  switch (code) {
    case ErrorCode::InvalidArgument: return ErrorFamily::Usage;
    case ErrorCode::MissingManifest:
    case ErrorCode::MissingPayload:
    case ErrorCode::HeaderCorrupt:
    case ErrorCode::ManifestCorrupt:
    case ErrorCode::ChecksumMismatch:
    case ErrorCode::UnsupportedDtype:
    case ErrorCode::BadName:
    case ErrorCode::BadShape:
    case ErrorCode::OutOfBounds:
    case ErrorCode::Overlap:
    case ErrorCode::Misaligned:
    case ErrorCode::DuplicateName:
    case ErrorCode::IncompleteGroup:
    case ErrorCode::Unmaterialized:
    case ErrorCode::ManifestMismatch:
    case ErrorCode::Torn: return ErrorFamily::Verification;
    case ErrorCode::ProducerGone: return ErrorFamily::ProducerGone;
    case ErrorCode::ChannelExists:
    case ErrorCode::ChannelMissing:
    case ErrorCode::PermissionDenied:
    case ErrorCode::ChannelFull:
    case ErrorCode::LocationMismatch: return ErrorFamily::Channel;
    case ErrorCode::CudaUnavailable:
    case ErrorCode::DeviceNotVisible:
    case ErrorCode::CudaFailed: return ErrorFamily::Device;
    case ErrorCode::NetworkError:
    case ErrorCode::Unauthorized: return ErrorFamily::Network;
    case ErrorCode::SystemError: return ErrorFamily::System;
  }
  return ErrorFamily::System;
}

// True for the codes of a bucket that failed its checks or was torn while read. A subscriber
// skips such a bucket; the next one may be fine.
constexpr bool failed_verification(ErrorCode code) noexcept {
  return family_of(code) == ErrorFamily::Verification;
}

class Error : public std::runtime_error {
 public:
  Error(ErrorCode code, const std::string& message, std::string details = {})
      : std::runtime_error(message), code_(code), details_(std::move(details)) {}

  ErrorCode code() const noexcept { return code_; }
  // Every problem, one per line, where the message names only the first few; else empty.
  const std::string& details() const noexcept { return details_; }

 private:
  ErrorCode code_;
  std::string details_;
};

}  // namespace tensorbucket
