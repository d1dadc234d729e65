#include "fault_guard.hpp"

#include <signal.h>
#include <sys/mman.h>
#include <unistd.h>

#include <atomic>
#include <cstdint>
#include <mutex>
#include <utility>

namespace tensorbucket::ipc {
namespace {

// A fixed table, so the handler reads it without locks or allocation. `state` publishes an
// entry: its bounds are written before it turns kActive (release), and read after the
// handler sees kActive (acquire).
enum : std::uint32_t { kFree = 0, kTaken, kActive };
struct Range {
  std::atomic<std::uint32_t> state{kFree};
  std::atomic<std::uint32_t> damaged{0};
  std::uintptr_t begin = 0;
  std::uintptr_t end = 0;
  bool writable = false;
};
constexpr int kRanges = 1024;
Range ranges[kRanges];

struct sigaction previous {};
std::uintptr_t page_bytes = 4096;  // read once, before the handler is installed

void pass_on(int signal, siginfo_t* info, void* context) {
  if (previous.sa_flags & SA_SIGINFO) {
    previous.sa_sigaction(signal, info, context);
  } else if (previous.sa_handler == SIG_DFL || previous.sa_handler == SIG_IGN) {
    // The faulting access runs again when we return, and faults again: to the default action.
    ::signal(signal, SIG_DFL);
  } else {
    previous.sa_handler(signal);
  }
}

void on_sigbus(int signal, siginfo_t* info, void* context) {
  auto address = reinterpret_cast<std::uintptr_t>(info->si_addr);
  for (auto& range : ranges) {
    if (range.state.load(std::memory_order_acquire) != kActive) continue;
    if (address < range.begin || address >= range.end) continue;
    auto from = address / page_bytes * page_bytes;
    int protection = range.writable ? PROT_READ | PROT_WRITE : PROT_READ;
    // The rest of the range at once: a truncation cuts everything past the new end.
    void* mapped = ::mmap(reinterpret_cast<void*>(from), range.end - from, protection,
                          MAP_FIXED | MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (mapped == MAP_FAILED) break;
    range.damaged.store(1, std::memory_order_release);
    return;
  }
  pass_on(signal, info, context);
}

void install_handler() {
  page_bytes = static_cast<std::uintptr_t>(::sysconf(_SC_PAGESIZE));
  struct sigaction action {};
  action.sa_sigaction = on_sigbus;
  action.sa_flags = SA_SIGINFO | SA_ONSTACK;
  sigemptyset(&action.sa_mask);
  ::sigaction(SIGBUS, &action, &previous);
}

}  // namespace

GuardedRange::GuardedRange(void* begin, std::size_t bytes, bool writable) noexcept {
  if (bytes == 0) return;
  static std::once_flag installed;
  std::call_once(installed, install_handler);
  for (int i = 0; i < kRanges; ++i) {
    auto expected = static_cast<std::uint32_t>(kFree);
    if (!ranges[i].state.compare_exchange_strong(expected, kTaken, std::memory_order_acquire)) continue;
    ranges[i].begin = reinterpret_cast<std::uintptr_t>(begin);
    ranges[i].end = ranges[i].begin + bytes;
    ranges[i].writable = writable;
    ranges[i].damaged.store(0, std::memory_order_relaxed);
    ranges[i].state.store(kActive, std::memory_order_release);
    index_ = i;
    return;
  }
}

GuardedRange::GuardedRange(GuardedRange&& other) noexcept : index_(std::exchange(other.index_, -1)) {}

GuardedRange& GuardedRange::operator=(GuardedRange&& other) noexcept {
  if (this != &other) {
    reset();
    index_ = std::exchange(other.index_, -1);
  }
  return *this;
}

GuardedRange::~GuardedRange() { reset(); }

void GuardedRange::reset() noexcept {
  if (index_ < 0) return;
  ranges[std::exchange(index_, -1)].state.store(kFree, std::memory_order_release);
}

bool GuardedRange::damaged() const noexcept {
  return index_ >= 0 && ranges[index_].damaged.load(std::memory_order_acquire) != 0;
}

}  // namespace tensorbucket::ipc
