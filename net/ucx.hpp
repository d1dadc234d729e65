// Internal: the little of UCX that the network side uses, owned and bounded. One UCP context
// with one worker, driven by one thread; tagged messages only; every wait has a limit.
#pragma once

#include "base/private.hpp"

#include <ucp/api/ucp.h>

#include <chrono>
#include <cstddef>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "socket.hpp"
#include "tensorbucket/error.hpp"

namespace tensorbucket::net::detail {

// The UCX functions the network side calls, from UCX loaded on first use instead of linked:
// as it loads, UCX (1.22) patches the process's mmap and friends, pausing 5 ms for each
// function it patches, which cost every tbucket command and every `import tensorbucket`
// 0.2-0.4 s whether it used the network or not.
struct Ucx {
  decltype(&ucs_status_string) status_string;
  decltype(&ucp_config_read) config_read;
  decltype(&ucp_config_modify) config_modify;
  decltype(&ucp_config_print) config_print;
  decltype(&ucp_config_release) config_release;
  decltype(&ucp_init_version) init_version;  // what ucp_init() calls
  decltype(&ucp_cleanup) cleanup;
  decltype(&ucp_worker_create) worker_create;
  decltype(&ucp_worker_destroy) worker_destroy;
  decltype(&ucp_worker_get_efd) worker_get_efd;
  decltype(&ucp_worker_query) worker_query;
  decltype(&ucp_worker_release_address) worker_release_address;
  decltype(&ucp_worker_progress) worker_progress;
  decltype(&ucp_worker_arm) worker_arm;
  decltype(&ucp_ep_create) ep_create;
  decltype(&ucp_ep_close_nbx) ep_close_nbx;
  decltype(&ucp_tag_send_nbx) tag_send_nbx;
  decltype(&ucp_tag_probe_nb) tag_probe_nb;
  decltype(&ucp_tag_msg_recv_nbx) tag_msg_recv_nbx;
  decltype(&ucp_request_check_status) request_check_status;
  decltype(&ucp_request_cancel) request_cancel;
  decltype(&ucp_request_free) request_free;
};
// Loads UCX (libucp.so.0: one already in the process, else where the build found it) on the
// first call; NetworkError when it cannot, or when its version is older than the headers'.
// Made by the first Worker: what takes a worker, request or endpoint finds it loaded.
const Ucx& ucx();

// NetworkError naming the UCX call and its status.
[[noreturn]] void fail_ucx(std::string_view what, ucs_status_t status);

// NetworkError that trying again in this process cannot mend: UCX cannot make a worker any
// more (UCX 1.22, once it closed a listening socket, refuses every later one with "Element
// already exists"), or closed the one a worker listens on. A relay ends on it instead of
// reconnecting for ever; a supervisor's restart mends it.
struct UcxUnusable : Error {
  using Error::Error;
};

class Worker {
 public:
  // UCX opens listening sockets of its own for its TCP transport, by default on every network
  // interface, and speaks its own protocol there before our handshake. `interface` holds its
  // network devices to that one and the host's RDMA ports, unless its configuration (the
  // environment or a ucx.conf) names the devices itself. `family` (AF_INET6 for a link over
  // IPv6) is the one its TCP transport takes on that interface, unless UCX_TCP_AF_PRIO says:
  // UCX picks IPv4 first, and a server on IPv4 beside a relay on IPv6 writes past the end of
  // UCX's own address buffers (UCX 1.22) instead of connecting.
  explicit Worker(const std::string& interface = {}, sa_family_t family = AF_UNSPEC);
  ~Worker();
  Worker(const Worker&) = delete;
  Worker& operator=(const Worker&) = delete;

  ucp_worker_h get() const noexcept { return worker_; }
  // Where a peer reaches this worker (ucp_ep_create's REMOTE_ADDRESS): sent at the front door.
  std::vector<std::byte> address() const;
  // Runs UCX's progress until it has nothing more to do, or kProgressCalls times (or as many
  // as set_progress_calls() says): a peer that keeps sending must not keep its caller from its
  // other work or its deadlines. True when it did something.
  static constexpr int kProgressCalls = 256;
  bool progress() noexcept;
  // Fewer calls per progress(), down to one for a caller that reads the queue after each:
  // what a peer sends, token or not, then piles up only as far as one call reads. wait()
  // runs progress() too.
  void set_progress_calls(int calls) noexcept { progress_calls_ = calls; }
  // Sleeps until the network has something for this worker, `limit` at most. UCX's wake-up
  // event does not fire for every transport (not for shared memory): callers keep it short.
  void wait(std::chrono::microseconds limit);
  // UcxUnusable once UCX closed a listening socket it opened for this worker. Its TCP
  // transport keeps each connection accepted there until the peer speaks, without a limit,
  // and closes the socket for good when an accept fails (the process out of descriptors):
  // no peer reaches the worker after that, and nothing else says so. Only for a worker made
  // in a process of one thread (`tbucket serve`): else UCX's sockets cannot be told from
  // others made meanwhile, and nothing is looked at.
  // `before_failing` runs first, with nothing thrown yet: it may let go of descriptors (the
  // process is likely out of them, and making the error's words, or a sanitizer's check of
  // it, takes some).
  template <class LetGo>
  void check_listening(LetGo&& before_failing) const {
    if (auto port = closed_listening_port()) {
      before_failing();
      fail_listening_closed(*port);
    }
  }

 private:
  struct Listening {
    int fd;
    ino_t inode;
    std::uint16_t port;
  };
  std::optional<std::uint16_t> closed_listening_port() const;  // of one of listening_ UCX closed
  [[noreturn]] static void fail_listening_closed(std::uint16_t port);
  ucp_context_h context_ = nullptr;
  ucp_worker_h worker_ = nullptr;
  int event_fd_ = -1;
  int progress_calls_ = kProgressCalls;
  std::vector<Listening> listening_;  // UCX's listening sockets, found as the worker was made
};

// The pause between a transfer's progress calls (it moves only in them, in this thread): none
// while they do something, but a yield, since a sleep on the wake-up event there slowed small
// transfers (docs/network.md); once they did nothing for kStillFor (a peer that stopped reading
// or sending), a sleep on that event, 1 ms at most, so that a stalled peer does not keep a core
// busy until a timeout drops it.
class Pace {
 public:
  static constexpr auto kStillFor = std::chrono::milliseconds(10);

  explicit Pace(Worker& worker) noexcept : worker_(worker) {}
  // After a progress call that did something (`moved`) or nothing.
  void after(bool moved);
  // A progress call and the pause after it.
  void step() { after(worker_.progress()); }
  // A new transfer: it counts as moving.
  void restart() noexcept { last_moved_ = Clock::now(); }

 private:
  Worker& worker_;
  Clock::time_point last_moved_ = Clock::now();
};

// A send or receive under way. Destroying one that is not done lets UCX finish and free it: its
// buffer must outlive the worker's progress until done() says so, or until its endpoint was
// closed by force (which ends what is under way on it).
class Request {
 public:
  Request() = default;
  Request(ucp_worker_h worker, ucs_status_ptr_t started, std::string_view what);
  Request(Request&& other) noexcept;
  Request& operator=(Request&& other) noexcept;
  ~Request();

  // True once finished; NetworkError when it finished with an error.
  bool done();
  // True once finished, well or not; UCX no longer touches its buffer.
  bool ended() const noexcept;
  void cancel() noexcept;

 private:
  ucp_worker_h worker_ = nullptr;
  void* request_ = nullptr;  // null when done at once
  std::string what_;
};

// Sends `bytes` tagged `tag` on `ep`.
Request send(ucp_worker_h worker, ucp_ep_h ep, std::span<const std::byte> bytes, ucp_tag_t tag);
// Receives the probed message into `into`, which must hold exactly its length.
Request receive(ucp_worker_h worker, ucp_tag_message_h message, std::span<std::byte> into);
// Takes the next message whose tag matches `tag` under `mask` off the worker's queue, or null.
ucp_tag_message_h probe(ucp_worker_h worker, ucp_tag_t tag, ucp_tag_t mask, std::size_t* length,
                        ucp_tag_t* sender_tag = nullptr) noexcept;
// The tag of the oldest message in the worker's queue, left there; nullopt when it is empty.
std::optional<ucp_tag_t> oldest_tag(ucp_worker_h worker) noexcept;

// An endpoint whose failures (the peer gone, the link reset) set `failed` instead of aborting.
struct Endpoint {
  ucp_ep_h ep = nullptr;
  ucs_status_t failed = UCS_OK;  // set from the worker's progress
};
// An endpoint to the worker whose address a peer sent at the front door, once it proved the
// token: UCX unpacks that address without checking it.
void connect(ucp_worker_h worker, Endpoint& endpoint, std::span<const std::byte> worker_address);
// Closes the endpoint, waiting `limit` at most for UCX to let go of it: at once (pending
// operations end with an error), or with `flush` after what was sent has arrived. The
// Endpoint object must live until this returns.
void close(Worker& worker, Endpoint& endpoint, std::chrono::milliseconds limit, bool flush = false) noexcept;

}  // namespace tensorbucket::net::detail
