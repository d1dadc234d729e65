// When a wait ends: at a point in time or never, and, if the caller asks, as soon as it is
// interrupted.
//
// Every call that may wait takes one (Publisher::publish/reserve/drain, Subscriber::attach/
// next/next_update, the calls of net.hpp). A duration converts to one implicitly, so
// `publish(bucket, 100ms)` waits up to 100 ms from the call: zero or less looks once, and
// milliseconds::max() (anything from 1e9 s, ~32 years) never ends, as Deadline::never().
//
// A wait sleeps in short slices (it rechecks its peers' liveness between them) and, between
// two, asks `interrupted` (at most every kAskEvery): once it says true, the wait ends as its
// timeout would, with nothing done, and the deadline stays interrupted. That is how a signal, a close() from another thread or an
// interpreter's exit stop a long wait, without the caller slicing it.
//
// Thread safety: a Deadline is used by one wait at a time (it remembers when it last asked).
#pragma once

#include <algorithm>
#include <chrono>
#include <functional>
#include <string>
#include <utility>

namespace tensorbucket {

class Deadline {
 public:
  using Clock = std::chrono::steady_clock;

  // The longest a wait runs without asking `interrupted` again.
  static constexpr std::chrono::milliseconds kAskEvery{50};
  // From this timeout on (1e9 s, ~32 years, Python's limit too), a wait never ends.
  static constexpr std::chrono::seconds kForever{1'000'000'000};

  // `timeout` from now (after()). Implicit: a wait takes a timeout where it takes a Deadline.
  template <class Rep, class Period>
  Deadline(std::chrono::duration<Rep, Period> timeout) : Deadline(after(timeout)) {}  // NOLINT(google-explicit-constructor)

  template <class Rep, class Period>
  static Deadline after(std::chrono::duration<Rep, Period> timeout) {
    auto now = Clock::now();
    if (!(timeout > timeout.zero())) return Deadline(now, now, std::chrono::milliseconds(0));  // NaN included
    if (std::chrono::duration<double>(timeout) >= kForever) return never();
    return Deadline(now, now + std::chrono::ceil<Clock::duration>(timeout),
                    std::chrono::ceil<std::chrono::milliseconds>(timeout));
  }
  static Deadline never() {
    return Deadline(Clock::now(), Clock::time_point::max(), std::chrono::milliseconds::max());
  }

  // This deadline, ending also once `interrupted()` returns true (asked as the header says).
  Deadline& unless(std::function<bool()> interrupted) & {
    interrupted_ = std::move(interrupted);
    return *this;
  }
  Deadline unless(std::function<bool()> interrupted) && { return std::move(unless(std::move(interrupted))); }

  // How messages name the limit, e.g. "0.5 s" where the caller counts in seconds; by default
  // the timeout in milliseconds ("500 ms").
  Deadline& described_as(std::string limit) & {
    description_ = std::move(limit);
    return *this;
  }
  Deadline described_as(std::string limit) && { return std::move(described_as(std::move(limit))); }

  Clock::time_point at() const noexcept { return at_; }
  bool never_ends() const noexcept { return at_ == Clock::time_point::max(); }
  bool passed(Clock::time_point now = Clock::now()) const noexcept { return now >= at_; }

  // Whether the caller asked the wait to end: true from the first time `interrupted` said so;
  // until then it is called once kAskEvery passed since the deadline was made or last asked
  // (else false), so that a wait that ends sooner never calls it. Its exceptions propagate.
  bool interrupted(Clock::time_point now = Clock::now()) const {
    if (now < next_ask_) return said_true_;
    next_ask_ = now + kAskEvery;
    return ask();
  }
  // The same, asking now: for the predicate of a deadline made from this one, whose own
  // interrupted() already keeps the pace (two paces in a row would make the wait longer).
  bool ask() const {
    if (!said_true_ && interrupted_) said_true_ = interrupted_();
    return said_true_;
  }

  // The next sleep of a wait that rechecks at least every `longest`: what is left, and no
  // longer than until `interrupted` is due to be asked again. Zero when both are now.
  Clock::duration next_sleep(Clock::duration longest, Clock::time_point now = Clock::now()) const {
    auto until = std::min(at_, interrupted_ ? std::max(next_ask_, now) : Clock::time_point::max());
    return std::clamp<Clock::duration>(until - now, Clock::duration::zero(), longest);
  }

  // What is left, rounded up to whole milliseconds; milliseconds::max() when it never ends.
  std::chrono::milliseconds left(Clock::time_point now = Clock::now()) const {
    if (never_ends()) return std::chrono::milliseconds::max();
    return std::max(std::chrono::ceil<std::chrono::milliseconds>(at_ - now), std::chrono::milliseconds(0));
  }

  // The limit as messages say it ("within 500 ms"): the description, else the timeout.
  std::string limit() const {
    if (!description_.empty()) return description_;
    if (never_ends()) return "no limit";
    return std::to_string(timeout_.count()) + " ms";
  }

 private:
  Deadline(Clock::time_point now, Clock::time_point at, std::chrono::milliseconds timeout)
      : at_(at), timeout_(timeout), next_ask_(now + kAskEvery) {}

  Clock::time_point at_;
  std::chrono::milliseconds timeout_;  // as asked, for limit()
  std::function<bool()> interrupted_;
  mutable Clock::time_point next_ask_;
  mutable bool said_true_ = false;
  std::string description_;
};

}  // namespace tensorbucket
