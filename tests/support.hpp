// Shared helpers for the GoogleTest suites.
#pragma once

#include <gtest/gtest.h>

#include <chrono>
#include <cstdint>
#include <functional>
#include <optional>
#include <random>
#include <span>
#include <string>
#include <vector>

#include "tensorbucket/tensorbucket.hpp"

namespace tensorbucket::test {

// Runs `action`, which must throw Error with `code`; returns the message for further checks.
template <class Action>
std::string expect_error(ErrorCode code, Action&& action) {
  try {
    action();
  } catch (const Error& error) {
    EXPECT_EQ(to_string(error.code()), to_string(code)) << error.what();
    return error.what();
  }
  ADD_FAILURE() << "expected Error(" << to_string(code) << "), nothing was thrown";
  return {};
}

// Opens a bucket that must be rejected with `code`, and checks that no view came out.
inline std::string expect_rejected(ErrorCode code, std::span<const std::byte> frame,
                                   std::span<const std::byte> payload,
                                   const VerifyOptions& options = {}) {
  std::optional<BucketView> view;
  auto message = expect_error(code, [&] { view.emplace(BucketView::open(frame, payload, options)); });
  EXPECT_FALSE(view.has_value());
  return message;
}

// A random bucket and the source bytes its builder points at.
struct RandomBucket {
  std::vector<std::vector<std::byte>> sources;
  BucketBuilder builder;
};

// Every dtype, scalars and zero-size dims, long and non-ASCII names, groups; up to
// `max_entries` entries (exactly that many when `exact`).
RandomBucket make_random_bucket(std::mt19937_64& rng, std::size_t max_entries, bool exact = false);

// Polls `condition` every millisecond for at most `timeout`; its last answer. For tests that
// wait for something another process does: a bounded wait, never a fixed sleep.
bool wait_until(const std::function<bool()>& condition,
                std::chrono::milliseconds timeout = std::chrono::seconds(10));

// "<prefix>-<pid>-<test name>", made a valid channel name (at most 64 characters, no '/').
std::string channel_for_this_test(const std::string& prefix);

// TB_FUZZ_SEED / TB_FUZZ_ITERS, or the given defaults: fixed unless someone explores.
std::uint64_t fuzz_seed(std::uint64_t fallback);
std::uint64_t fuzz_iterations(std::uint64_t fallback);

}  // namespace tensorbucket::test
