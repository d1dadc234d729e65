#include "channel_support.hpp"

#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdio>
#include <filesystem>
#include <stdexcept>
#include <thread>

namespace tensorbucket::test {

Child::Child(const std::function<int()>& body) {
  std::fflush(nullptr);  // or the child would print our buffered output again
  pid_ = ::fork();
  if (pid_ == 0) {
    int status = 1;
    try {
      status = body();
    } catch (const std::exception& e) {
      std::fprintf(stderr, "child %d: %s\n", ::getpid(), e.what());
    }
    std::fflush(nullptr);
    ::_exit(status);
  }
}

Child::~Child() {
  if (pid_ > 0 && !waited_) kill_now();
}

void Child::kill_now() {
  ::kill(pid_, SIGKILL);
  int status = 0;
  ::waitpid(pid_, &status, 0);
  waited_ = true;
}

int Child::wait(std::chrono::milliseconds timeout) {
  auto deadline = std::chrono::steady_clock::now() + timeout;
  int status = 0;
  while (::waitpid(pid_, &status, WNOHANG) == 0) {
    if (std::chrono::steady_clock::now() > deadline) {
      ::kill(pid_, SIGKILL);
      ::waitpid(pid_, &status, 0);
      waited_ = true;
      ADD_FAILURE() << "child " << pid_ << " did not finish in time";
      return -SIGKILL;
    }
    std::this_thread::sleep_for(1ms);
  }
  waited_ = true;
  return WIFEXITED(status) ? WEXITSTATUS(status) : -WTERMSIG(status);
}

bool Child::wait_stopped(std::chrono::milliseconds timeout) {
  auto deadline = std::chrono::steady_clock::now() + timeout;
  int status = 0;
  for (;;) {
    auto got = ::waitpid(pid_, &status, WNOHANG | WUNTRACED);
    if (got == pid_) {
      if (WIFSTOPPED(status)) return true;
      waited_ = true;  // it ended
      return false;
    }
    if (std::chrono::steady_clock::now() > deadline) return false;
    std::this_thread::sleep_for(1ms);
  }
}

std::optional<int> Child::poll() {
  int status = 0;
  if (waited_ || ::waitpid(pid_, &status, WNOHANG) != pid_) return std::nullopt;
  waited_ = true;
  return WIFEXITED(status) ? WEXITSTATUS(status) : -WTERMSIG(status);
}

void Child::resume() { ::kill(pid_, SIGCONT); }

Signal::Signal() { EXPECT_EQ(::pipe(fds_), 0); }

Signal::~Signal() {
  ::close(fds_[0]);
  ::close(fds_[1]);
}

bool Signal::send(char byte) { return ::write(fds_[1], &byte, 1) == 1; }

char Signal::receive(std::chrono::milliseconds timeout) {
  pollfd ready{fds_[0], POLLIN, 0};
  char byte = 0;
  if (::poll(&ready, 1, static_cast<int>(timeout.count())) != 1 || ::read(fds_[0], &byte, 1) != 1) return 0;
  return byte;
}

bool Signal::send_int(std::int64_t value) {
  return ::write(fds_[1], &value, sizeof value) == static_cast<ssize_t>(sizeof value);
}

std::optional<std::int64_t> Signal::receive_int(std::chrono::milliseconds timeout) {
  pollfd ready{fds_[0], POLLIN, 0};
  std::int64_t value = 0;
  if (::poll(&ready, 1, static_cast<int>(timeout.count())) != 1 ||
      ::read(fds_[0], &value, sizeof value) != static_cast<ssize_t>(sizeof value)) {
    return std::nullopt;
  }
  return value;
}

pid_t fork_sleeper() {
  pid_t pid = ::fork();
  if (pid == 0) {
    for (;;) ::pause();
  }
  return pid;
}

std::vector<std::string> segments_of(const std::string& channel) {
  std::vector<std::string> found;
  for (const auto& entry : std::filesystem::directory_iterator("/dev/shm")) {
    auto name = entry.path().filename().string();
    if (name == control_name(channel) || name.starts_with(control_name(channel) + ".slot")) {
      found.push_back(name);
    }
  }
  return found;
}

bool wait_for_channel(const std::string& channel) {
  return wait_until([&] {
    try {
      inspect_channel(channel);
      return true;
    } catch (const Error& e) {
      if (e.code() != ErrorCode::ChannelMissing) throw;
      return false;
    }
  });
}

Tampering::Tampering(const std::string& segment) {
  fd_ = ::shm_open(("/" + segment).c_str(), O_RDWR, 0);
  if (fd_ < 0) return;
  struct stat status {};
  if (::fstat(fd_, &status) != 0 || status.st_size == 0) return;
  auto* data = ::mmap(nullptr, static_cast<std::size_t>(status.st_size), PROT_READ | PROT_WRITE,
                      MAP_SHARED, fd_, 0);
  if (data == MAP_FAILED) return;
  bytes_ = {static_cast<std::byte*>(data), static_cast<std::size_t>(status.st_size)};
}

Tampering::~Tampering() {
  if (mapped()) ::munmap(bytes_.data(), bytes_.size());
  if (fd_ >= 0) ::close(fd_);
}

void Tampering::truncate(std::size_t bytes) {
  if (fd_ < 0 || ::ftruncate(fd_, static_cast<off_t>(bytes)) != 0) {
    throw std::runtime_error("cannot truncate the segment");
  }
}

std::string control_name(const std::string& channel) { return "tensorbucket." + channel; }

std::string slot_name(const std::string& channel, std::uint32_t slot) {
  auto prefix = control_name(channel) + ".slot" + std::to_string(slot) + ".";
  std::vector<std::string> found;
  for (const auto& name : segments_of(channel)) {
    if (name.starts_with(prefix)) found.push_back(name);
  }
  if (found.size() != 1) throw std::runtime_error(std::to_string(found.size()) + " segments named " + prefix + "*");
  return found.front();
}

ReceivedBucket next_bucket(Subscriber& subscriber, std::chrono::milliseconds timeout) {
  auto bucket = subscriber.next(timeout);
  if (!bucket) throw std::runtime_error("no bucket arrived on " + subscriber.channel());
  return std::move(*bucket);
}

int hold_a_bucket(const std::string& channel, Signal& holding) {
  auto subscriber = Subscriber::attach(channel, 10s);
  auto bucket = subscriber.next(10s);
  if (!bucket || !holding.send()) return 1;
  for (;;) ::pause();
}

int consume(const std::string& channel, const cli::Workload& workload, std::uint64_t buckets,
            std::chrono::milliseconds pause) {
  auto subscriber = Subscriber::attach(channel, 10s);
  for (std::uint64_t i = 0; i < buckets; ++i) {
    auto bucket = subscriber.next(10s);
    if (!bucket) return 3;
    if (bucket->sequence() != i) return 4;
    if (!cli::check_bucket(bucket->view(), workload.seed, i).empty()) return 5;
    if (pause > 0ms) std::this_thread::sleep_for(pause);
  }
  return 0;
}

}  // namespace tensorbucket::test
