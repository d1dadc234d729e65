#include "ipc/os/fault_guard.hpp"

#include <pthread.h>
#include <signal.h>
#include <sys/mman.h>
#include <unistd.h>

#include <atomic>
#include <cstdint>
#include <mutex>
#include <utility>

namespace tensorbucket::ipc {
namespace {

// A fixed table, so that the handler reads it without locks or allocation. Entries change
// under `writers`; the handler reads one as a seqlock: `sequence` is odd while the entry
// changes, and an entry read between two equal even values is whole. Every access is seq_cst
// (no fences, which ThreadSanitizer does not support): a field read that saw a write made
// after the first increment puts that increment before the second read of `sequence`. An
// entry whose bounds are 0 is free.
struct Range {
  std::atomic<std::uint64_t> sequence{0};
  std::atomic<std::uintptr_t> begin{0};
  std::atomic<std::uintptr_t> end{0};
  std::atomic<bool> writable{false};
  std::atomic<bool> inherited{false};
  std::atomic<bool> damaged{false};
};
constexpr int kRanges = 1024;
Range ranges[kRanges];
std::mutex writers;

struct sigaction previous {};
std::uintptr_t page_bytes = 4096;  // read once, before the handler is installed

// Rewrites entry `i` (under `writers`).
void set(int i, std::uintptr_t begin, std::uintptr_t end, bool writable, bool inherited) {
  auto& range = ranges[i];
  range.sequence.fetch_add(1);  // odd: changing
  range.begin.store(begin);
  range.end.store(end);
  range.writable.store(writable);
  range.inherited.store(inherited);
  range.damaged.store(false);
  range.sequence.fetch_add(1);  // even: whole
}

void pass_on(int signal, siginfo_t* info, void* context) {
  if (previous.sa_flags & SA_SIGINFO) {
    previous.sa_sigaction(signal, info, context);
  } else if (previous.sa_handler == SIG_IGN && info->si_code <= 0) {
    // Sent by a process (kill), which the previous disposition ignored. A fault cannot be.
  } else if (previous.sa_handler == SIG_DFL || previous.sa_handler == SIG_IGN) {
    // The default action, now: for a fault, once we return, it would fault again anyway.
    ::signal(signal, SIG_DFL);
    ::raise(signal);
  } else {
    previous.sa_handler(signal);
  }
}

void on_sigbus(int signal, siginfo_t* info, void* context) {
  auto address = reinterpret_cast<std::uintptr_t>(info->si_addr);
  for (auto& range : ranges) {
    auto before = range.sequence.load();
    auto begin = range.begin.load();
    auto end = range.end.load();
    bool writable = range.writable.load();
    if (before % 2 != 0 || range.sequence.load() != before) continue;
    if (info->si_code <= 0 || address < begin || address >= end) continue;
    auto from = address / page_bytes * page_bytes;
    int protection = writable ? PROT_READ | PROT_WRITE : PROT_READ;
    // The rest of the range at once: a truncation cuts everything past the new end.
    void* mapped = ::mmap(reinterpret_cast<void*>(from), end - from, protection,
                          MAP_FIXED | MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (mapped == MAP_FAILED) break;
    range.damaged.store(true);
    return;
  }
  pass_on(signal, info, context);
}

// In a forked child, the ranges it did not inherit are gone from its address space: another
// mapping may come there, whose faults are not ours to hide.
void forget_uninherited() {
  for (int i = 0; i < kRanges; ++i) {
    if (ranges[i].end.load() != 0 && !ranges[i].inherited.load()) set(i, 0, 0, false, false);
  }
  writers.unlock();
}

void install_handler() {
  page_bytes = static_cast<std::uintptr_t>(::sysconf(_SC_PAGESIZE));
  ::pthread_atfork([] { writers.lock(); }, [] { writers.unlock(); }, forget_uninherited);
  struct sigaction action {};
  action.sa_sigaction = on_sigbus;
  action.sa_flags = SA_SIGINFO | SA_ONSTACK;
  sigemptyset(&action.sa_mask);
  ::sigaction(SIGBUS, &action, &previous);
}

}  // namespace

GuardedRange::GuardedRange(void* begin, std::size_t bytes, bool writable, bool inherited) noexcept {
  if (bytes == 0) return;
  static std::once_flag installed;
  std::call_once(installed, install_handler);
  std::lock_guard lock(writers);
  for (int i = 0; i < kRanges; ++i) {
    if (ranges[i].end.load() != 0) continue;
    auto first = reinterpret_cast<std::uintptr_t>(begin);
    set(i, first, first + bytes, writable, inherited);
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
  std::lock_guard lock(writers);
  set(std::exchange(index_, -1), 0, 0, false, false);
}

bool GuardedRange::damaged() const noexcept {
  return index_ >= 0 && ranges[index_].damaged.load();
}

}  // namespace tensorbucket::ipc
