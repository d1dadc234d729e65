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
  if (failed_verification(code)) return kVerificationFailed;
  switch (code) {
    case ErrorCode::InvalidArgument: return kUsage;  // a bad name or option value
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
    default: return kOtherError;  // ChannelFull, SystemError
  }
}

}  // namespace tensorbucket::cli
