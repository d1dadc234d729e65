#include "tensorbucket/error.hpp"

namespace tensorbucket {

std::string_view to_string(ErrorCode code) noexcept {
  switch (code) {
    case ErrorCode::InvalidArgument: return "InvalidArgument";
    case ErrorCode::MissingManifest: return "MissingManifest";
    case ErrorCode::MissingPayload: return "MissingPayload";
    case ErrorCode::HeaderCorrupt: return "HeaderCorrupt";
    case ErrorCode::ManifestCorrupt: return "ManifestCorrupt";
    case ErrorCode::ChecksumMismatch: return "ChecksumMismatch";
    case ErrorCode::UnsupportedDtype: return "UnsupportedDtype";
    case ErrorCode::BadName: return "BadName";
    case ErrorCode::BadShape: return "BadShape";
    case ErrorCode::OutOfBounds: return "OutOfBounds";
    case ErrorCode::Overlap: return "Overlap";
    case ErrorCode::Misaligned: return "Misaligned";
    case ErrorCode::DuplicateName: return "DuplicateName";
    case ErrorCode::IncompleteGroup: return "IncompleteGroup";
    case ErrorCode::Unmaterialized: return "Unmaterialized";
    case ErrorCode::ManifestMismatch: return "ManifestMismatch";
    case ErrorCode::Torn: return "Torn";
    case ErrorCode::ProducerGone: return "ProducerGone";
    case ErrorCode::ChannelExists: return "ChannelExists";
    case ErrorCode::ChannelMissing: return "ChannelMissing";
    case ErrorCode::PermissionDenied: return "PermissionDenied";
    case ErrorCode::ChannelFull: return "ChannelFull";
    case ErrorCode::SystemError: return "SystemError";
    case ErrorCode::NetworkError: return "NetworkError";
    case ErrorCode::Unauthorized: return "Unauthorized";
    case ErrorCode::CudaUnavailable: return "CudaUnavailable";
    case ErrorCode::DeviceNotVisible: return "DeviceNotVisible";
    case ErrorCode::CudaFailed: return "CudaFailed";
    case ErrorCode::LocationMismatch: return "LocationMismatch";
  }
  return "Unknown";
}

}  // namespace tensorbucket
