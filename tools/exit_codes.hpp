// The tbucket exit statuses, a contract scripts rely on (docs/cli.md, "Exit codes").
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
  switch (family_of(code)) {
    case ErrorFamily::Usage: return kUsage;  // a bad name or option value
    case ErrorFamily::Verification: return kVerificationFailed;
    case ErrorFamily::ProducerGone: return kProducerGone;
    case ErrorFamily::Channel: return kChannelUnavailable;
    case ErrorFamily::Device: return kDeviceError;
    case ErrorFamily::Network: return code == ErrorCode::Unauthorized ? kUnauthorized : kNetworkError;
    case ErrorFamily::System: return kOtherError;
  }
  return kOtherError;
}

}  // namespace tensorbucket::cli
