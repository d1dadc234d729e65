// The relay: a served channel received and republished, verified, into a local channel.
#include <algorithm>
#include <optional>
#include <set>
#include <thread>

#include "base/text.hpp"
#include "tensorbucket/channel.hpp"
#include "tensorbucket/error.hpp"
#include "tensorbucket/header.hpp"
#include "tensorbucket/net.hpp"
#include "ucx.hpp"

namespace tensorbucket::net {
namespace detail {
namespace {

using namespace std::chrono_literals;
using Clock = std::chrono::steady_clock;
using text::message;
using text::Quoted;

// Payloads from this size on are received straight into a local slot (the in-place path);
// smaller ones into a buffer, then copied, which keeps one builder for a layout sent again.
constexpr std::uint64_t kReceiveInPlaceFrom = 4ull << 20;

// The local producer: republishes each remote bucket, reusing one builder while the layout and
// the receive buffer stay the same (the fast path, as for any producer), or commits the slot a
// large payload was received into.
class Republisher {
 public:
  explicit Republisher(Publisher publisher) : publisher_(std::move(publisher)) {}

  // Where a remote payload goes: a reserved local slot when it is large, the local channel is on
  // the host, and the frame lays its entries out as a local layout would; else nowhere (the
  // remote subscriber's buffer). The frame was not verified yet: a bad one only makes this say
  // nowhere, and next() then rejects it. A reservation waits until `deadline`.
  std::span<std::byte> place(std::uint64_t payload_bytes, std::span<const std::byte> frame, const Deadline& deadline) {
    reservation_.reset();
    if (payload_bytes < kReceiveInPlaceFrom || !publisher_.location().on_host()) return {};
    try {
      auto header = read_header(frame);
      auto manifest = decode_manifest(manifest_bytes(header, frame));
      BucketBuilder layout;
      for (const auto& entry : manifest.entries) layout.declare(entry.name, entry.dtype, entry.shape);
      for (const auto& group : manifest.groups) layout.group(group.name, group.members);
      layout.version(manifest.version).bucket(manifest.bucket_index, manifest.bucket_count);
      const auto& laid = layout.manifest().entries;
      for (std::size_t i = 0; i < laid.size(); ++i) {
        if (laid[i].byte_offset != manifest.entries[i].byte_offset) return {};
      }
      // Exactly: the frame is not verified yet, and a slot grows to what its layout needs, so
      // a frame that declared more would take shared memory past max_bucket_bytes.
      if (layout.payload_bytes() != payload_bytes) return {};
      if (auto reserved = publisher_.reserve(layout, deadline)) reservation_.emplace(std::move(*reserved));
    } catch (const Error&) {
      return {};
    }
    return reservation_ ? reservation_->payload().first(payload_bytes) : std::span<std::byte>();
  }

  // Publishes `view`: commits the slot place() gave, when the view is in it; false when no
  // local slot came free before `deadline`.
  bool publish(const BucketView& view, const Deadline& deadline) {
    if (reservation_ && !view.payload().empty() && view.payload().data() == reservation_->payload().data()) {
      reservation_->commit();
      reservation_.reset();
      return true;
    }
    reservation_.reset();
    if (!layout_ || &layout_->manifest() != &view.manifest() || layout_->payload().data() != view.payload().data()) {
      builder_ = BucketBuilder();
      const auto& manifest = view.manifest();
      for (const auto& entry : manifest.entries) {
        builder_.add(entry.name, entry.dtype, entry.shape, view.payload().data() + entry.byte_offset);
      }
      for (const auto& group : manifest.groups) builder_.group(group.name, group.members);
      layout_ = view;  // keeps the verified layout alive, so its address names it
    }
    builder_.version(view.version()).bucket(view.bucket_index(), view.bucket_count());
    return publisher_.publish(builder_, deadline);
  }

  void abandon() { reservation_.reset(); }
  Publisher& publisher() { return publisher_; }

 private:
  Publisher publisher_;
  BucketBuilder builder_;
  std::optional<BucketView> layout_;
  std::optional<Reservation> reservation_;  // place()'s slot, until published or abandoned
};

}  // namespace

struct RelayState {
  RelayOptions options;
  Republisher republisher;
  std::optional<RemoteSubscriber> remote;
  // What was republished last: a server restarted on a channel that still holds it sends it
  // again, and it must not reach the local consumers twice.
  std::optional<std::pair<std::uint64_t, std::uint64_t>> last;  // (incarnation, sequence)
  bool connected_once = false;
  std::chrono::milliseconds backoff = 100ms;
  Clock::time_point next_try{};  // after a lost link, the next connect waits for this
  // Each reason the link went down is news once, until buckets flow again: a mistyped port or a
  // server not up yet is never silent, and never told every 2 s either.
  std::set<std::string> told;
  RelayStats stats;
  Clock::time_point first{};  // the first bucket's publish

  RelayState(const RelayOptions& relay, Publisher publisher)
      : options(relay), republisher(std::move(publisher)) {}

  bool interrupted() const { return options.interrupted && options.interrupted(); }

  void log(const std::string& line, bool news) {
    if (options.log) options.log(line, news);
  }

  void lost(const std::string& why, bool always_news = false) {
    // Some reasons carry changing figures (a local consumer's pid and wait): held to a bound,
    // the set never grows with an outage that lasts for days.
    if (told.size() >= 64) told.clear();
    bool news = told.insert(why).second || always_news;
    log(message(why, "; reconnecting"), news);
    remote.reset();
    republisher.abandon();
    next_try = Clock::now() + backoff;
    backoff = std::min(backoff * 2, std::chrono::milliseconds(2000));
  }

  // A local wait for a slot: options.timeout from now, unless interrupted.
  Deadline local_wait() const {
    return Deadline::after(options.timeout).unless([this] { return interrupted(); });
  }

  // `deadline`, ending also when options.interrupted says so.
  Deadline or_interrupted(const Deadline& deadline) const {
    auto either = deadline;
    either.unless([this, &deadline] { return interrupted() || deadline.ask(); });
    return either;
  }

  // Connects; false (logged, a retry set) when the link cannot be made now. Throws what trying
  // again cannot mend.
  bool connect() {
    // Each try: the timeout, held between 1 and 5 s, so that a timeout of 0 (a local publish
    // that never waits) still leaves a connect time to answer.
    auto connect_timeout = std::clamp(options.timeout, std::chrono::milliseconds(1000), std::chrono::milliseconds(5000));
    try {
      remote.emplace(RemoteSubscriber::connect(options.connect, options.remote, connect_timeout));
    } catch (const Error& e) {
      fail(e);
      return false;
    }
    log(message("connected to ", options.connect, ", channel ", Quoted{options.remote.channel}, " → local ",
                Quoted{republisher.publisher().channel()}),
        false);
    connected_once = true;
    backoff = 100ms;
    return true;
  }

  // A link that failed, called in the catch block of `e`: rethrown when trying again cannot mend
  // it, else logged and retried.
  void fail(const Error& e) {
    remote.reset();  // a slot a rejected payload was received into is never published: the link goes first
    republisher.abandon();
    // A refused token ends the relay when it was never served: the configuration is wrong. Once
    // served, it tries again: what answers now may be an impostor on the server's port (a
    // refusal comes before the server proved anything), and it must not end the relay.
    bool unauthorized = e.code() == ErrorCode::Unauthorized;
    if ((unauthorized && !connected_once) || e.code() == ErrorCode::InvalidArgument ||
        e.code() == ErrorCode::ChannelMissing || dynamic_cast<const detail::UcxUnusable*>(&e) != nullptr) {
      throw;
    }
    if (!connected_once && e.code() != ErrorCode::NetworkError) throw;
    // A refusal is news every time: it may go on.
    lost(message(to_string(e.code()), ": ", e.what()), unauthorized);
    if (unauthorized) {
      backoff = std::chrono::milliseconds(2000);
      next_try = Clock::now() + backoff;
    }
  }

  // One bucket from the link and republished, waiting until `until`; false when none came.
  bool relay_one(const Deadline& until) {
    auto bucket = remote->next(until, {}, [&](std::uint64_t payload_bytes, std::span<const std::byte> frame) {
      return republisher.place(payload_bytes, frame, local_wait());
    });
    if (!bucket) return false;
    const auto& view = bucket->view();
    std::pair<std::uint64_t, std::uint64_t> id{bucket->incarnation(), bucket->sequence()};
    if (last && last->first == id.first && id.second <= last->second) {
      republisher.abandon();
      return false;
    }
    bool published = false;
    try {
      published = republisher.publish(view, local_wait());
    } catch (const Error& e) {
      // The server sent a bucket out of its update's order: nothing was published.
      if (e.code() != ErrorCode::InvalidArgument) throw;
      lost(message("the server sent a bucket out of order (", e.what(), ")"));
      return false;
    }
    if (!published && interrupted()) {
      // The bucket is gone from the link: a later relay_for() resumes at the next whole update.
      remote.reset();
      republisher.abandon();
      return false;
    }
    if (!published) {
      lost(message("Timeout: no local slot came free within ", options.timeout.count(), " ms; waiting for ",
                   republisher.publisher().waiting_for()));
      return false;
    }
    last = id;
    told.clear();  // buckets flow: a reason the link goes down again is news
    auto now = Clock::now();
    if (stats.buckets++ == 0) {
      first = now;
    } else {
      stats.bytes_after_first += view.payload().size();
      stats.after_first = now - first;
    }
    return true;
  }
};

}  // namespace detail

Relay Relay::create(const RelayOptions& options, const Deadline& wait) {
  if (options.connect.empty()) throw Error(ErrorCode::InvalidArgument, "a relay needs the server's HOST:PORT");
  if (options.remote.channel.empty()) throw Error(ErrorCode::InvalidArgument, "a relay needs the served channel's name");
  if (options.timeout.count() < 0) throw Error(ErrorCode::InvalidArgument, "a relay's timeout must not be negative");
  const auto& local = options.local.empty() ? options.remote.channel : options.local;
  return Relay(std::make_unique<detail::RelayState>(options, Publisher::create(local, options.publisher, wait)));
}

Relay::Relay(std::unique_ptr<detail::RelayState> state)
    : state_(std::move(state)), local_channel_(state_->republisher.publisher().channel()) {}
Relay::Relay(Relay&&) noexcept = default;
Relay& Relay::operator=(Relay&&) noexcept = default;
Relay::~Relay() = default;

std::uint64_t Relay::relay_for(const Deadline& until, std::uint64_t buckets) {
  if (!state_) throw Error(ErrorCode::InvalidArgument, "relay_for() on a closed Relay");
  auto& state = *state_;
  auto waiting = state.or_interrupted(until);
  std::uint64_t relayed = 0;
  while ((buckets == 0 || relayed < buckets) && !state.interrupted()) {  // asked at once: before a connect
    auto now = detail::Clock::now();
    if (waiting.passed(now) || waiting.interrupted(now)) break;
    if (!state.remote) {
      if (now < state.next_try) {
        std::this_thread::sleep_for(waiting.next_sleep(state.next_try - now, now));
        continue;
      }
      if (!state.connect()) continue;
    }
    try {
      relayed += state.relay_one(waiting) ? 1 : 0;
    } catch (const Error& e) {
      state.fail(e);
    }
  }
  return relayed;
}

bool Relay::drain(const Deadline& deadline) {
  if (!state_) return true;
  return state_->republisher.publisher().drain(state_->or_interrupted(deadline));
}

void Relay::disconnect() noexcept {
  if (!state_) return;
  state_->remote.reset();  // the link first: a receive under way may still write into a reserved slot
  state_->republisher.abandon();
}

RelayStats Relay::stats() const noexcept { return state_ ? state_->stats : RelayStats{}; }
const std::string& Relay::local_channel() const noexcept { return local_channel_; }
void Relay::close() noexcept { state_.reset(); }

}  // namespace tensorbucket::net
