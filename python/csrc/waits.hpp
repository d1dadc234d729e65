// Waiting without the GIL, in turns, interruptibly: what every call that may wait (publish,
// drain, next) goes through, and what keeps the interpreter's exit and fork() safe.
#pragma once

#include <pybind11/pybind11.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <type_traits>
#include <utility>

#include "base/text.hpp"
#include "tensorbucket/deadline.hpp"
#include "tensorbucket/error.hpp"

namespace tensorbucket::python {

namespace py = pybind11;

// Raised by a wait that ended at its timeout (a publish() that found no free slot);
// becomes tensorbucket.Timeout with `message`.
struct WaitTimeout {
  std::string message;
};

using Clock = std::chrono::steady_clock;

// How Python writes a float: 0.5, -1.0, nan.
inline std::string as_text(double seconds) { return py::str(py::float_(seconds)); }

// A limit of `seconds` (above 0, at most 1e9) in whole milliseconds, rounded up; InvalidArgument
// naming the argument otherwise.
inline std::chrono::milliseconds limit_in_ms(double seconds, const char* name) {
  if (!(seconds > 0 && seconds <= 1e9)) {
    text::fail(ErrorCode::InvalidArgument, name, " must be seconds above 0 and at most 1e9, not ", as_text(seconds));
  }
  return std::chrono::ceil<std::chrono::milliseconds>(std::chrono::duration<double>(seconds));
}

// Threads outside the GIL in this module, and the interpreter's exit. From the moment Python
// starts shutting down, a thread that takes the GIL back ends with pthread_exit, which from
// inside pybind11's noexcept gil_scoped_release destructor aborts the whole process: a
// server's daemon thread waiting in next() did that at every exit (exit 134). So an atexit
// hook, which runs while the interpreter is still whole, has every such thread park once its
// current work ends (a wait asks PyWait within Deadline::kAskEvery, or a copy): it sleeps
// without the GIL until the process is gone. The hook waits until all of them are parked or
// back.
class OutsideGil {
 public:
  // Runs work() without the GIL; at exit, parks instead of returning. Called with the GIL.
  template <class Work>
  static auto run(Work&& work) {
    Counted counted;  // left only once the GIL is back (destroyed last)
    py::gil_scoped_release unlocked;
    struct ParkAtExit {
      ~ParkAtExit() {  // runs before `unlocked` takes the GIL back
        if (!exiting) return;
        ++parked;
        for (;;) std::this_thread::sleep_for(std::chrono::hours(1));
      }
    } park;
    return work();
  }

  // The atexit hook's part, with the GIL: from now on threads park, and this returns once
  // every thread outside the GIL parked or came back. Later calls raise at once.
  static void park_all() {
    exiting = true;  // with the GIL: no call starts meanwhile
    py::gil_scoped_release unlocked;  // those waiting to take the GIL back take it meanwhile
    while (outside != parked) std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }

  // Whether the interpreter is exiting: a thread outside the GIL must not take it back then,
  // but end its work, and park.
  static bool exiting_now() noexcept { return exiting; }

  // In a forked child, whose only thread is the one that forked (holding the GIL): the
  // parent's other threads were counted but are not there to park.
  static void forget_other_threads() {
    outside = 0;
    parked = 0;
  }

 private:
  static inline std::atomic<bool> exiting = false;
  static inline std::atomic<int> outside = 0;
  static inline std::atomic<int> parked = 0;

  struct Counted {
    Counted() {
      if (exiting) throw Error(ErrorCode::InvalidArgument, "the interpreter is exiting");
      ++outside;
    }
    ~Counted() { --outside; }
  };
};

// A wait of `seconds` from now (None, inf, or more than 1e9: no limit; a negative or NaN
// timeout, which would end every wait at once, is InvalidArgument), run without the GIL. Its
// Deadline is interrupted by the interpreter's exit, by the `closing` flag a call passes (a
// close() from another thread), and by Python's signal handlers: every Deadline::kAskEvery of
// waiting it takes the GIL and runs them, and what one raised (Ctrl+C's KeyboardInterrupt) is
// raised once the call returns, whatever it returned or threw. Made with the GIL, by the call
// that waits; not moved (its Deadline refers to it).
class PyWait {
 public:
  explicit PyWait(std::optional<double> seconds) : deadline_(Deadline::never()) {
    if (seconds && !(*seconds >= 0)) {
      text::fail(ErrorCode::InvalidArgument, "timeout must be seconds >= 0, or None for no limit, not ",
                 as_text(*seconds));
    }
    if (seconds && *seconds <= 1e9) deadline_ = Deadline::after(std::chrono::duration<double>(*seconds));
    deadline_.unless([this] { return interrupted(); });
  }
  PyWait(const PyWait&) = delete;
  PyWait& operator=(const PyWait&) = delete;

  // Messages name the limit as Python wrote it ("within 0.5 s").
  PyWait& in_seconds(std::optional<double> seconds) {
    if (seconds) deadline_.described_as(as_text(*seconds) + " s");
    return *this;
  }

  // call(deadline) without the GIL; `closing` also ends its wait.
  template <class Call>
  auto run(Call&& call, const std::atomic<bool>* closing = nullptr) {
    closing_ = closing;
    try {
      if constexpr (std::is_void_v<decltype(call(deadline_))>) {
        OutsideGil::run([&] { call(deadline_); });
        raise_if_signalled();
      } else {
        auto result = OutsideGil::run([&] { return call(deadline_); });
        raise_if_signalled();
        return result;
      }
    } catch (const py::error_already_set&) {
      throw;
    } catch (...) {
      raise_if_signalled();
      throw;
    }
  }

 private:
  // Asked without the GIL, by the thread that waits.
  bool interrupted() {
    if (signalled_ || OutsideGil::exiting_now() || (closing_ != nullptr && closing_->load())) return true;
    py::gil_scoped_acquire gil;  // the interpreter is whole: its exit parks us first (OutsideGil)
    signalled_ = PyErr_CheckSignals() != 0;  // the exception stays set until raise_if_signalled()
    return signalled_;
  }
  void raise_if_signalled() {
    if (std::exchange(signalled_, false)) throw py::error_already_set();
  }

  Deadline deadline_;
  const std::atomic<bool>* closing_ = nullptr;
  bool signalled_ = false;
};

// How long a new channel waits for another process removing a dead producer's leftovers
// under its name (Publisher::create), in seconds; Ctrl+C ends the wait sooner.
inline constexpr double kRemovalWait = 10;

// Forks of this process so far, as its child counts them: bumped in every child
// (pthread_atfork, registered at import).
inline std::atomic<std::uint64_t> forks_seen = 0;

inline void after_fork_in_child() {
  ++forks_seen;
  OutsideGil::forget_other_threads();
}

// A C++ Publisher or Subscriber serves one thread at a time (channel.hpp), and its wrapper gives
// up the GIL while it waits and copies, which lets another thread in: each call takes a turn
// first. A child forked while a thread of the parent had the turn inherits it taken, by a
// thread the child does not have: there calls go straight on, to the C++ handle, which refuses
// them (and, closing, touches nothing shared). A flag under a mutex, waited for on a condition
// variable, rather than a std::timed_mutex: that one waits in pthread_mutex_clocklock, which
// ThreadSanitizer (gcc 12's) does not intercept, so a TSan run saw neither the turns nor what
// they order, and reported an unlock of a mutex it had never seen locked.
struct Turns {
  std::mutex mutex;
  std::condition_variable given_back;
  bool taken = false;  // guarded by mutex
  std::thread::id holder;  // the thread that took it; guarded by mutex
  std::uint64_t forks = forks_seen;  // when the handle was made
  // Set by close() before it takes its turn: a call waiting in another thread sees it (PyWait)
  // and ends, where close() would otherwise wait behind it (for ever with None).
  std::atomic<bool> closing = false;
};

// A turn held, given back when destroyed; empty in a forked child (see Turns).
class Turn {
 public:
  Turn() = default;
  explicit Turn(Turns& turns) : turns_(&turns) {}
  Turn(Turn&& other) noexcept : turns_(std::exchange(other.turns_, nullptr)) {}
  Turn& operator=(Turn&&) = delete;
  ~Turn() {
    if (turns_ == nullptr) return;
    {
      std::lock_guard lock(turns_->mutex);
      turns_->taken = false;
      turns_->holder = {};
    }
    turns_->given_back.notify_one();
  }

 private:
  Turns* turns_ = nullptr;
};

// InvalidArgument when this thread holds the turn already: a call made from inside another on
// the same handle (Python code that a tensor's copy_ or a __del__ runs mid-publish) would wait
// for itself, for ever without a timeout.
inline void refuse_reentry(Turns& turns) {
  if (turns.forks != forks_seen) return;
  std::lock_guard lock(turns.mutex);
  if (turns.taken && turns.holder == std::this_thread::get_id()) {
    text::fail(ErrorCode::InvalidArgument,
               "called from inside another call on the same handle, in the same thread (Python code that a "
               "tensor or a __del__ ran while that call was under way); nothing was done");
  }
}

// The turn, waited for within `wait`; none, with nothing done, when its deadline passed first.
// Taken at once when free, without giving up the GIL. See refuse_reentry().
inline std::optional<Turn> take_turn(Turns& turns, PyWait& wait) {
  if (turns.forks != forks_seen) return Turn();  // in a forked child: see Turns
  refuse_reentry(turns);
  auto take = [&](const Deadline& deadline) {
    for (;;) {
      {
        std::unique_lock lock(turns.mutex);
        auto now = Clock::now();
        if (turns.taken && !deadline.passed(now)) {
          turns.given_back.wait_for(lock, deadline.next_sleep(Deadline::kAskEvery, now));
        }
        if (!turns.taken) {
          turns.taken = true;
          turns.holder = std::this_thread::get_id();
          return true;
        }
      }
      // Asked without the lock: the question may take the GIL, which a thread giving its turn
      // back (~Turn, with the mutex) holds.
      if (deadline.passed() || deadline.interrupted()) return false;
    }
  };
  if (take(Deadline(std::chrono::milliseconds(0))) || wait.run(take)) return std::optional<Turn>(std::in_place, turns);
  return std::nullopt;
}
inline Turn take_turn(Turns& turns) {
  PyWait forever(std::nullopt);
  return std::move(*take_turn(turns, forever));  // none only past a deadline
}

// close()'s turn: announced first (see Turns::closing), then taken.
inline Turn take_last_turn(Turns& turns) {
  refuse_reentry(turns);
  turns.closing = true;
  return take_turn(turns);
}

}  // namespace tensorbucket::python
