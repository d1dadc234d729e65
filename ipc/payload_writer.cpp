#include "payload_writer.hpp"

#include <cstring>
#include <vector>

#include "base/text.hpp"
#include "tensorbucket/header.hpp"

namespace tensorbucket::ipc {

using text::fail;
using text::Quoted;

namespace {

DeviceAddress address(const void* p) { return reinterpret_cast<DeviceAddress>(p); }

}  // namespace

PayloadWriter::PayloadWriter(std::optional<int> device) : device_(device) {
  if (device_) release_waits_.emplace(*device_);
}

void PayloadWriter::begin(ControlBlock& control, int locks, std::uint32_t s, std::uint32_t slot_count,
                          std::span<const ManifestEntry> entries, std::span<std::byte> payload, bool padding_zeroed,
                          DeviceStream stream) {
  padding_zeroed_ = padding_zeroed;
  if (!device_) return;
  DeviceScope scope(*device_);
  stream_ = stream;
  release_waits_->wait(control, locks, s, slot_count, stream);
  if (padding_zeroed) return;
  const auto& api = device_api();
  detail::for_each_gap(entries, payload.size(), [&](std::uint64_t offset, std::uint64_t bytes) {
    check_device(api.zero(address(payload.data()) + offset, bytes, stream), "cuMemsetD8Async");
  });
}

void PayloadWriter::zero_padding(std::span<const ManifestEntry> entries, std::span<std::byte> payload,
                                 bool streaming) const {
  if (device_ || padding_zeroed_) return;  // begin() zeroed it on the device; else still zero
  detail::for_each_gap(entries, payload.size(), [&](std::uint64_t offset, std::uint64_t bytes) {
    detail::zero_bytes(payload.data() + offset, bytes, streaming);
  });
}

void PayloadWriter::write_bucket(const BucketBuilder& bucket, std::span<std::byte> payload,
                                 detail::NearEnd& near_end) const {
  if (!device_) return detail::pack(bucket, payload, &near_end);
  const auto& entries = bucket.manifest().entries;
  auto sources = bucket.entry_sources();
  std::vector<DeviceCopy> copies;
  copies.reserve(entries.size());
  for (std::size_t i = 0; i < entries.size(); ++i) {
    if (entries[i].byte_length == 0) continue;
    if (sources[i] == nullptr) {
      fail(ErrorCode::InvalidArgument, "entry ", Quoted{entries[i].name},
           " was declared for in-place writing; write it through a reservation instead");
    }
    copies.push_back({address(payload.data() + entries[i].byte_offset), address(sources[i]), entries[i].byte_length});
  }
  DeviceScope scope(*device_);
  copy_batch(copies.data(), copies.size(), stream_);
}

void PayloadWriter::write_entry(std::span<std::byte> to, const void* from, detail::EntryCopier& host) const {
  if (!device_) return host.copy(to, static_cast<const std::byte*>(from));
  DeviceCopy copy{address(to.data()), address(from), to.size()};
  DeviceScope scope(*device_);
  check_device(device_api().copy(&copy, 1, stream_), "cuMemcpyAsync");
}

void PayloadWriter::write_entries(std::span<const std::span<std::byte>> to, std::span<const void* const> sources,
                                  detail::EntryCopier& host) const {
  if (!device_) {
    for (std::size_t i = 0; i < sources.size(); ++i) {
      if (sources[i] != nullptr) host.copy(to[i], static_cast<const std::byte*>(sources[i]));
    }
    return;
  }
  std::vector<DeviceCopy> copies;
  copies.reserve(sources.size());
  for (std::size_t i = 0; i < sources.size(); ++i) {
    if (sources[i] == nullptr || to[i].empty()) continue;
    copies.push_back({address(to[i].data()), address(sources[i]), to[i].size()});
  }
  DeviceScope scope(*device_);
  copy_batch(copies.data(), copies.size(), stream_);
}

PayloadWriter::Hash PayloadWriter::hash(std::span<const std::byte> payload) const {
  if (!device_) return {xxh3(payload), false};
  return {device_block_hash(*device_, address(payload.data()), payload.size(), stream_), true};
}

std::optional<DeviceScope> PayloadWriter::scope() const {
  return device_ ? std::optional<DeviceScope>(std::in_place, *device_) : std::nullopt;
}

}  // namespace tensorbucket::ipc
