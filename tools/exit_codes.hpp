// The tbucket exit statuses, a contract scripts rely on (README "Exit codes").
#pragma once

#include "tensorbucket/error.hpp"

namespace tensorbucket::cli {

enum ExitCode : int {
  kOk = 0,
  kOtherError = 1,
  kUsage = 2,
  kTimeout = 3,
  kProducerGone = 4,
  kVerificationFailed = 5,
  kChannelUnavailable = 6,
  kDeviceError = 7,
  kNetworkError = 8,
  kUnauthorized = 9,
};

constexpr int exit_code_for(ErrorCode code) {
  switch (code) {
    case ErrorCode::InvalidArgument: return kUsage;  // a bad name or option value
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
    case ErrorCode::Torn: return kVerificationFailed;
    case ErrorCode::ProducerGone: return kProducerGone;
    case ErrorCode::ChannelExists:
    case ErrorCode::ChannelMissing:
    case ErrorCode::PermissionDenied:
    case ErrorCode::LocationMismatch: return kChannelUnavailable;
    case ErrorCode::CudaUnavailable:
    case ErrorCode::DeviceNotVisible:
    case ErrorCode::CudaFailed: return kDeviceError;
    case ErrorCode::NetworkError: return kNetworkError;
    case ErrorCode::Unauthorized: return kUnauthorized;
    case ErrorCode::ChannelFull:
    case ErrorCode::SystemError: return kOtherError;
  }
  return kOtherError;
}

}  // namespace tensorbucket::cli
