// `tbucket bench`: cross-process handoff figures, each beside a baseline measured in the same
// run. A forked consumer receives every bucket and reports latency percentiles; the producer
// waits for each bucket's release before the next, so every figure is one isolated handoff.
// With --device cuda:N, a device channel's figures: each runs in a child of this process, which
// never touches CUDA itself, and forks its consumer before it does (a process must not fork
// after); a bucket counts as received once its bytes are ready on the consumer's stream
// (ReceivedBucket::wait_ready()).
#include <linux/futex.h>
#include <sys/mman.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <functional>
#include <optional>
#include <string>
#include <thread>
#include <variant>

#include "commands.hpp"
#include "exit_codes.hpp"

namespace tensorbucket::cli {
namespace {

using namespace std::chrono_literals;

double median(std::vector<double> values) {
  std::sort(values.begin(), values.end());
  return values.empty() ? 0 : values[values.size() / 2];
}

double p99(std::vector<double> values) {
  std::sort(values.begin(), values.end());
  return values.empty() ? 0 : values[static_cast<std::size_t>(0.99 * static_cast<double>(values.size() - 1))];
}

enum class Wait { Next, Spin };
// The handoff's start: publish() (commit() in place), the bucket made visible, or the time the
// producer wrote into the bucket's version before it began building it.
enum class Clock { FromPublishStart, FromVisible, FromVersion };

struct Latency {
  double median_us = 0;
  double p99_us = 0;
  bool ok = false;
};

// Runs `consume` in a forked child while this process runs drive(0), drive(1), ... until one
// returns false or `count` ran; `consume` returns its latencies in microseconds, or exits the
// child itself (kTimeout). Their median and p99.
Latency forked(int count, const std::function<std::vector<double>()>& consume, const std::function<bool(int)>& drive) {
  int report[2];
  if (::pipe(report) != 0) return {};
  std::fflush(nullptr);  // or the child would print our buffered output again
  pid_t consumer = ::fork();
  if (consumer == 0) {
    std::vector<double> latencies;
    try {
      latencies = consume();
    } catch (const std::exception& e) {
      std::fprintf(stderr, "tbucket bench: consumer: %s\n", e.what());
      ::_exit(kOtherError);
    }
    double values[2] = {median(latencies), p99(latencies)};
    ::_exit(::write(report[1], values, sizeof values) == sizeof values ? kOk : kOtherError);
  }
  ::close(report[1]);
  if (consumer < 0) {
    ::close(report[0]);
    return {};
  }
  bool driven = true;
  try {
    for (int i = 0; i < count && driven; ++i) driven = drive(i);
  } catch (...) {
    ::kill(consumer, SIGKILL);  // it would wait out its timeouts for a producer that failed
    ::waitpid(consumer, nullptr, 0);
    ::close(report[0]);
    throw;
  }
  // A consumer still waiting for what will not come (a polling one never times out) first.
  if (!driven) ::kill(consumer, SIGKILL);
  double values[2] = {};
  bool reported = ::read(report[0], values, sizeof values) == sizeof values;
  ::close(report[0]);
  int status = 0;
  ::waitpid(consumer, &status, 0);
  return {values[0], values[1], driven && reported && WIFEXITED(status) && WEXITSTATUS(status) == 0};
}

// Forks a consumer of `channel` that takes `count` buckets (the first `warmup` not counted)
// and reports latency; `drive(i)` publishes bucket i in this process.
Latency measure(const std::string& channel, int count, int warmup, Wait wait, Clock clock,
                const std::function<bool(int)>& drive, bool wait_ready = false) {
  auto consume = [&] {
    std::vector<double> latencies;
    auto subscriber = Subscriber::attach(channel, 10s);
    for (int i = 0; i < count; ++i) {
      std::optional<ReceivedBucket> bucket;
      if (wait == Wait::Spin) {
        while (!(bucket = subscriber.try_next())) {
        }
      } else {
        bucket = subscriber.next(10s);
      }
      if (!bucket) ::_exit(kTimeout);
      if (wait_ready) bucket->wait_ready();
      auto from = clock == Clock::FromVisible  ? bucket->published_ns()
                  : clock == Clock::FromVersion ? bucket->view().version()
                                                : bucket->publish_start_ns();
      if (i >= warmup) latencies.push_back(static_cast<double>(monotonic_ns() - from) / 1000);
    }
    return latencies;
  };
  return forked(count, consume, drive);
}

// Median time of `bytes` of memcpy between two pre-faulted buffers.
double memcpy_us(std::size_t bytes, int repeats) {
  std::vector<std::byte> from(bytes, std::byte{1}), to(bytes, std::byte{0});
  std::vector<double> times;
  for (int i = 0; i < repeats; ++i) {
    auto start = monotonic_ns();
    std::memcpy(to.data(), from.data(), bytes);
    times.push_back(static_cast<double>(monotonic_ns() - start) / 1000);
    if (to[bytes / 2] != from[bytes / 2]) return 0;
  }
  return median(times);
}

// A figure's target: its median at most `limit` microseconds, or at most `limit` times its
// baseline's. None where limit is 0.
struct Target {
  enum Kind { Micros, Ratio } kind = Micros;
  double limit = 0;
  std::string text() const {
    if (limit == 0) return {};
    char out[32];
    std::snprintf(out, sizeof out, kind == Ratio ? "<= %gx" : "<= %g us", limit);
    return out;
  }
};
Target at_most_us(double limit) { return {Target::Micros, limit}; }
Target at_most_times(double limit) { return {Target::Ratio, limit}; }

struct Row {
  std::string name;
  Latency latency;
  std::string baseline;
  double baseline_us;  // 0: none
  Target target;
  std::string legend;  // what the figure times, from what to what

  double ratio() const { return baseline_us > 0 ? latency.median_us / baseline_us : 0; }
  // Whether the figure met its target: measured, and within it. Empty without a target.
  std::optional<bool> met() const {
    if (target.limit == 0) return std::nullopt;
    if (!latency.ok) return false;
    return (target.kind == Target::Ratio ? ratio() : latency.median_us) <= target.limit;
  }
};

std::string channel_name() {
  static int figure = 0;
  return "tbbench-" + std::to_string(::getpid()) + "-" + std::to_string(figure++);
}

std::string size_text(std::uint64_t bytes) {
  if (bytes >= (1u << 20) && bytes % (1u << 20) == 0) return std::to_string(bytes >> 20) + " MiB";
  if (bytes >= 1024 && bytes % 1024 == 0) return std::to_string(bytes >> 10) + " KiB";
  return std::to_string(bytes) + " B";
}

// Handoffs of large buckets take long enough that fewer make a stable median: about 4 GiB
// copied per figure, and never fewer than 5.
int repeats_for(std::uint64_t bucket_bytes, int repeats) {
  auto within = static_cast<int>(std::min<std::uint64_t>(repeats, (4ull << 30) / std::max<std::uint64_t>(bucket_bytes, 1)));
  return std::max(5, within);
}

// Copy path: 1000 tensors of `tensor_bytes` each, publish start -> verified views. Rounds run
// back to back (the next starts when the consumer released the last), as the memcpy baseline
// does: a pause between rounds lets this VM's caches go cold (a 1 MiB memcpy after 1 ms idle
// takes 2x one that follows another), and would compare a cold handoff with a hot memcpy.
Row copy_handoff(std::string name, std::uint64_t tensor_bytes, int repeats, Wait wait, Target target) {
  Workload workload{.buckets = 1, .tensors = 1000, .tensor_bytes = tensor_bytes};
  auto bucket = make_bucket(workload, 0);
  auto channel = channel_name();
  auto publisher = Publisher::create(channel);
  auto latency = measure(channel, repeats + 2, 2, wait, Clock::FromPublishStart, [&](int) {
    return publisher.publish(bucket.builder, 10s) && publisher.drain(10s);
  });
  auto bytes = bucket.builder.payload_bytes();
  return {std::move(name), latency, "memcpy of the same " + size_text(bytes), memcpy_us(bytes, repeats), std::move(target),
          "publish() start -> the consumer holds verified views; 1000 tensors copied from private memory by one "
          "kept builder; memcpy: one copy of the same bytes between two warm buffers"};
}

// The loop a trainer writes first: a new builder every step, 1000 add() calls, then publish.
// From the first add() to verified views, beside the kept builder's figure.
Row new_builder_handoff(std::string name, const Row& kept, int repeats) {
  Workload workload{.buckets = 1, .tensors = 1000, .tensor_bytes = 1024};
  auto source = make_bucket(workload, 0);
  auto channel = channel_name();
  auto publisher = Publisher::create(channel);
  auto bytes = tensor_bytes(workload);
  std::vector<std::string> names;
  for (std::uint32_t t = 0; t < workload.tensors; ++t) names.push_back(tensor_name(t));
  auto latency = measure(channel, repeats + 2, 2, Wait::Next, Clock::FromVersion, [&](int) {
    BucketBuilder bucket;
    bucket.version(monotonic_ns());
    for (std::uint32_t t = 0; t < workload.tensors; ++t) {
      auto dtype = tensor_dtype(t);
      bucket.add(names[t], dtype, {static_cast<std::int64_t>(bytes / itemsize(dtype))}, source.tensors[t].data());
    }
    return publisher.publish(bucket, 10s) && publisher.drain(10s);
  });
  return {std::move(name), latency, kept.name, kept.latency.median_us, at_most_times(1.5),
          "first add() of a new builder -> verified views: the builder made, encoded and published every step"};
}

// In-place path: 1000 tensors written into the reserved slot (from private memory, as a
// producer computing them would), then commit -> verified views.
Row in_place_handoff(std::string name, std::uint64_t tensor_bytes, int repeats, Wait wait, Target target) {
  Workload workload{.buckets = 1, .tensors = 1000, .tensor_bytes = tensor_bytes};
  auto layout = make_layout(workload, 0);
  auto source = make_bucket(workload, 0);
  std::vector<const void*> sources;
  for (const auto& tensor : source.tensors) sources.push_back(tensor.data());
  auto channel = channel_name();
  auto publisher = Publisher::create(channel);
  auto latency = measure(channel, repeats + 2, 2, wait, Clock::FromPublishStart, [&](int) {
    auto reservation = publisher.reserve(layout, 10s);
    if (!reservation) return false;
    reservation->write_all(sources);
    reservation->commit();
    return publisher.drain(10s);
  });
  return {std::move(name), latency, "", 0, std::move(target),
          "commit() -> the consumer holds verified views; every entry was written into the slot before commit()"};
}

// The host's floor under a notification, with nothing of tensorbucket's in it: a word in shared
// memory stored by this process -> a forked one that polls it sees it (Wait::Spin), or, asleep
// on it in FUTEX_WAIT, runs again after FUTEX_WAKE (Wait::Next). The same gap before each
// round as the figure it stands under. A VM's wake-up of an idle virtual CPU alone can cost
// more than a target set on bare metal: this says so in the same run. Median microseconds;
// 0 when it could not be measured.
double bare_notification_us(Wait wait, std::chrono::microseconds gap, int repeats) {
  struct Shared {
    std::atomic<std::uint32_t> word{0};   // the round last announced
    std::atomic<std::uint64_t> stamp{0};  // monotonic_ns() just before the store
    std::atomic<std::uint32_t> seen{0};   // the round the consumer last took
  };
  static_assert(std::atomic<std::uint32_t>::is_always_lock_free && sizeof(std::atomic<std::uint32_t>) == 4);
  void* memory = ::mmap(nullptr, sizeof(Shared), PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
  if (memory == MAP_FAILED) return 0;
  auto* shared = new (memory) Shared;
  auto* word = reinterpret_cast<std::uint32_t*>(&shared->word);  // what the futex calls name
  constexpr std::uint64_t kGiveUpNs = 10'000'000'000;
  int count = repeats + 2;  // the first two not counted, as in measure()
  auto consume = [&] {
    std::vector<double> latencies;
    for (std::uint32_t round = 0; round < static_cast<std::uint32_t>(count); ++round) {
      auto give_up = monotonic_ns() + kGiveUpNs;
      while (shared->word.load(std::memory_order_acquire) == round) {
        if (monotonic_ns() > give_up) ::_exit(kTimeout);
        if (wait == Wait::Next) {
          timespec slice{1, 0};
          ::syscall(SYS_futex, word, FUTEX_WAIT, round, &slice, nullptr, 0);
        }
      }
      auto now = monotonic_ns();
      if (round >= 2) latencies.push_back(static_cast<double>(now - shared->stamp.load()) / 1000);
      shared->seen.store(round + 1, std::memory_order_release);
    }
    return latencies;
  };
  auto latency = forked(count, consume, [&](int i) {
    auto round = static_cast<std::uint32_t>(i);
    std::this_thread::sleep_for(gap);
    shared->stamp.store(monotonic_ns());
    shared->word.store(round + 1, std::memory_order_release);
    if (wait == Wait::Next) ::syscall(SYS_futex, word, FUTEX_WAKE, 1, nullptr, nullptr, 0);
    auto give_up = monotonic_ns() + kGiveUpNs;
    while (shared->seen.load(std::memory_order_acquire) != round + 1) {
      if (monotonic_ns() > give_up) return false;
      std::this_thread::yield();
    }
    return true;
  });
  ::munmap(memory, sizeof(Shared));
  return latency.ok ? latency.median_us : 0;
}

// Notification: an empty bucket -> received, with the consumer spinning or asleep. A spinning
// consumer's clock starts when the bucket is made visible; an asleep one's at publish(), before
// the producer wakes it, so that the wake-up is inside the figure. Beside the host's floor.
Row notification(std::string name, Wait wait, std::chrono::microseconds gap, int repeats, Target target) {
  BucketBuilder empty;
  auto channel = channel_name();
  auto publisher = Publisher::create(channel);
  auto clock = wait == Wait::Spin ? Clock::FromVisible : Clock::FromPublishStart;
  auto latency = measure(channel, repeats + 2, 2, wait, clock, [&](int) {
    std::this_thread::sleep_for(gap);  // long enough for the consumer to be spinning / asleep
    return publisher.publish(empty, 10s) && publisher.drain(10s);
  });
  auto floor = bare_notification_us(wait, gap, repeats);
  return {std::move(name), latency,
          wait == Wait::Spin ? "a bare shared word polled" : "a bare futex wake",
          floor, std::move(target),
          wait == Wait::Spin ? "an empty bucket made visible -> the consumer holds it; the consumer polls try_next(); "
                               "baseline: a word in shared memory stored -> a process polling it sees it"
                             : "publish() start of an empty bucket -> the consumer holds it; the consumer waits in "
                               "next(), asleep for " + std::to_string(gap.count()) + " us before (its wake-up included); "
                               "baseline: a word stored and FUTEX_WAKE -> a process asleep on it in FUTEX_WAIT runs "
                               "again, the same gap before"};
}

// A device channel's handoff: publish start -> the consumer's bytes ready, for an empty bucket
// or 1000 tensors of `tensor_bytes` copied from host memory or written in place (the in-place
// figure leaves the slot's bytes as they were: it is the cost of the commit). The publisher
// is made at the first bucket, after the consumer was forked.
Row device_handoff(const char* name, PayloadLocation device, std::uint32_t tensors, std::uint64_t tensor_bytes,
                   bool in_place, int repeats, Target target) {
  Workload workload{.buckets = 1, .tensors = tensors, .tensor_bytes = tensor_bytes};
  auto bucket = make_bucket(workload, 0);
  auto layout = make_layout(workload, 0);
  auto channel = channel_name();
  std::optional<Publisher> publisher;
  auto latency = measure(
      channel, repeats + 2, 2, Wait::Next, Clock::FromPublishStart,
      [&](int) {
        if (!publisher) publisher.emplace(Publisher::create(channel, {.location = device}));
        bool ok = true;
        if (in_place) {
          auto reservation = publisher->reserve(layout, 10s);
          ok = reservation.has_value();
          if (ok) reservation->commit();
        } else {
          ok = publisher->publish(bucket.builder, 10s);
        }
        ok = ok && publisher->drain(10s);
        std::this_thread::sleep_for(1ms);
        return ok;
      },
      true);
  return {name, latency, "", 0, target, ""};  // in_child() sends back the latency alone
}

// `make()` run in a forked child, its latency sent back; the child's exit status when it
// failed (it printed why), which the bench then exits with.
struct InChild {
  Latency latency;
  int status = kOk;
};
InChild in_child(const std::function<Row()>& make) {
  int report[2];
  if (::pipe(report) != 0) return {{}, kOtherError};
  std::fflush(nullptr);
  pid_t child = ::fork();
  if (child == 0) {
    ::close(report[0]);
    int status = kOk;
    try {
      auto row = make();
      if (::write(report[1], &row.latency, sizeof row.latency) != sizeof row.latency) status = kOtherError;
    } catch (const Error& e) {
      std::fprintf(stderr, "tbucket: %s: %s\n", to_string(e.code()).data(), e.what());
      status = exit_code_for(e.code());
    }
    std::fflush(nullptr);
    ::_exit(status);
  }
  ::close(report[1]);
  InChild result;
  bool reported = ::read(report[0], &result.latency, sizeof result.latency) == sizeof result.latency;
  ::close(report[0]);
  int status = 0;
  ::waitpid(child, &status, 0);
  result.status = WIFEXITED(status) ? WEXITSTATUS(status) : kOtherError;
  if (result.status == kOk && !reported) result.status = kOtherError;
  return result;
}

// The device rows, or the exit status of the first that failed to run.
std::variant<std::vector<Row>, int> device_rows(PayloadLocation device, int n) {
  struct Figure {
    const char* name;
    std::uint32_t tensors;
    bool in_place;
    Target target;
    const char* legend;
  };
  std::vector<Row> rows;
  for (auto figure : {
           Figure{"device: empty bucket", 0, false, at_most_us(20),
                  "publish() start -> the consumer's bytes are ready on its stream; 1 ms between rounds"},
           Figure{"device: in-place 1000 x 4 KiB", 1000, true, at_most_us(50),
                  "commit() -> the consumer's bytes are ready; the slot's bytes left as they were (a kernel would "
                  "have written them on the device): the cost of the commit; 1 ms between rounds"},
           Figure{"device: copy 1000 x 4 KiB from host", 1000, false, {},
                  "publish() start -> the consumer's bytes are ready: 1000 host-to-device copies in one batch; "
                  "1 ms between rounds"}}) {
    auto measured = in_child(
        [&] { return device_handoff(figure.name, device, figure.tensors, 4096, figure.in_place, n, figure.target); });
    if (measured.status != kOk) return measured.status;
    rows.push_back({figure.name, measured.latency, "", 0, figure.target, figure.legend});
  }
  return rows;
}

}  // namespace

int run_bench(const BenchOptions& options) {
  auto n = static_cast<int>(options.repeats);
  auto device = PayloadLocation::parse(options.device);
  std::vector<Row> rows;
  if (!device.on_host()) {
    auto measured = device_rows(device, n);
    if (auto* status = std::get_if<int>(&measured)) return *status;
    rows = std::get<std::vector<Row>>(measured);
  }
  if (device.on_host() && options.tensor_bytes != 0) {
    // One size, as the peer sweep (bench/peers/iceoryx_sweep.py) asks for it: the consumer
    // polls try_next(), as the iceoryx peer polls take().
    auto size = "1000 x " + size_text(options.tensor_bytes);
    auto repeats = repeats_for(1000 * options.tensor_bytes, n);
    rows.push_back(copy_handoff("copy " + size, options.tensor_bytes, repeats, Wait::Spin, at_most_times(1.3)));
    rows.push_back(in_place_handoff("in-place " + size, options.tensor_bytes, repeats, Wait::Spin, {}));
  } else if (device.on_host()) {
    rows.push_back(copy_handoff("copy 1000 x 1 KiB", 1024, n, Wait::Next, at_most_times(1.3)));
    rows.push_back(new_builder_handoff("copy 1000 x 1 KiB, new builder", rows.back(), n));
    rows.push_back(copy_handoff("copy 1000 x 4 KiB", 4096, n, Wait::Next, at_most_times(1.3)));
    rows.push_back(copy_handoff("copy 1000 x 256 KiB", 256 * 1024, repeats_for(256'000 << 10, n), Wait::Next,
                                at_most_times(1.3)));
    rows.push_back(in_place_handoff("in-place 1000 x 1 KiB", 1024, n, Wait::Next, at_most_us(100)));
    rows.push_back(in_place_handoff("in-place 1000 x 16 KiB", 16 * 1024, n, Wait::Next, at_most_us(100)));
    rows.push_back(in_place_handoff("in-place 1000 x 256 KiB", 256 * 1024, repeats_for(256'000 << 10, n), Wait::Next,
                                    at_most_us(100)));
    rows.push_back(notification("notify, consumer spinning", Wait::Spin, 1000us, n, at_most_us(0.5)));
    rows.push_back(notification("notify, consumer asleep", Wait::Next, 2000us, n, at_most_us(15)));
  }

  // The exit status says whether every figure was measured; whether a target was met is each
  // figure's "ok" (null without a target), as a noisy machine may miss one any time.
  bool measured = true;
  if (options.json) std::printf("[");
  for (std::size_t i = 0; i < rows.size(); ++i) {
    const auto& row = rows[i];
    measured = measured && row.latency.ok;
    auto met = row.met();
    if (options.json) {
      std::printf("%s{\"name\":\"%s\",\"median_us\":%.2f,\"p99_us\":%.2f,\"baseline\":\"%s\","
                  "\"baseline_us\":%.2f,\"ratio\":%.3f,\"target\":\"%s\",\"measures\":\"%s\",\"measured\":%s,"
                  "\"ok\":%s}",
                  i ? "," : "", row.name.c_str(), row.latency.median_us, row.latency.p99_us,
                  row.baseline.c_str(), row.baseline_us, row.ratio(), row.target.text().c_str(), row.legend.c_str(),
                  row.latency.ok ? "true" : "false", !met ? "null" : *met ? "true" : "false");
    } else {
      std::printf("%-32s median %10.2f us  p99 %10.2f us", row.name.c_str(), row.latency.median_us,
                  row.latency.p99_us);
      if (row.baseline_us > 0) {
        std::printf("  | %s: %.2f us, ratio %.2fx", row.baseline.c_str(), row.baseline_us, row.ratio());
      }
      if (met) std::printf("  (target %s: %s)", row.target.text().c_str(), *met ? "met" : "missed");
      std::printf("%s\n", row.latency.ok ? "" : "  FAILED");
    }
  }
  if (options.json) {
    std::printf("]\n");
  } else {
    std::printf("\nWhat each figure times (medians over the handoffs, each after the last was released):\n");
    for (const auto& row : rows) std::printf("  %s: %s\n", row.name.c_str(), row.legend.c_str());
  }
  return measured ? kOk : kOtherError;
}

}  // namespace tensorbucket::cli
