// Shared by the channel suites: peers as forked processes, the segments a channel leaves in
// /dev/shm, and write access to shared memory as a faulty or hostile process has it.
#pragma once

#include <gtest/gtest.h>

#include <sys/types.h>

#include <chrono>
#include <cstdint>
#include <functional>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "../tools/workload.hpp"
#include "ipc/control.hpp"
#include "support.hpp"
#include "tensorbucket/tensorbucket.hpp"

namespace tensorbucket::test {

using namespace std::chrono_literals;

// A forked process running `body`; its return value is the exit status. An exception in the
// child is printed and exits 1; a child still running when this is destroyed is killed.
class Child {
 public:
  explicit Child(const std::function<int()>& body);
  Child(const Child&) = delete;
  Child& operator=(const Child&) = delete;
  ~Child();
  void kill_now();
  // The exit status, or -signal; gives up (killing the child, and failing the test) after
  // `timeout`.
  int wait(std::chrono::milliseconds timeout = 60s);
  // Waits (bounded) until the child stopped itself with SIGSTOP; false if it ended or took
  // longer than `timeout`.
  bool wait_stopped(std::chrono::milliseconds timeout = 30s);
  // The exit status (or -signal) once the child ended; nullopt while it runs.
  std::optional<int> poll();
  void resume();
  pid_t pid() const { return pid_; }

 private:
  pid_t pid_ = -1;
  bool waited_ = false;
};

// One byte at a time through a pipe, between a test and its children. receive() gives up
// after `timeout`, so a peer that died before sending fails the test instead of hanging it.
class Signal {
 public:
  Signal();
  Signal(const Signal&) = delete;
  Signal& operator=(const Signal&) = delete;
  ~Signal();
  bool send(char byte = 'x');
  char receive(std::chrono::milliseconds timeout = 30s);  // 0 when nothing came
  bool send_int(std::int64_t value);
  std::optional<std::int64_t> receive_int(std::chrono::milliseconds timeout = 30s);
  int read_end() const { return fds_[0]; }

 private:
  int fds_[2] = {-1, -1};
};

// Forks a child that sleeps until killed, and returns its pid: a forked worker that outlives
// the process that made it.
pid_t fork_sleeper();

// The names in /dev/shm that belong to `channel`.
std::vector<std::string> segments_of(const std::string& channel);

// Waits until a producer finished creating `channel`: its segment can exist, still unsized,
// for a moment before the channel does.
bool wait_for_channel(const std::string& channel);

// A channel named after the test, and a check that none of its segments is left behind.
class ChannelTest : public ::testing::Test {
 protected:
  std::string channel = channel_for_this_test("tb");
  void TearDown() override { EXPECT_EQ(segments_of(channel), std::vector<std::string>{}); }
};

// A shared-memory object mapped read-write, as any process of our uid may map it.
class Tampering {
 public:
  explicit Tampering(const std::string& segment);  // its name in /dev/shm
  Tampering(const Tampering&) = delete;
  Tampering& operator=(const Tampering&) = delete;
  ~Tampering();
  bool mapped() const { return bytes_.data() != nullptr; }
  std::span<std::byte> bytes() const { return bytes_; }
  ipc::ControlBlock& control() const { return *reinterpret_cast<ipc::ControlBlock*>(bytes_.data()); }
  // ftruncate, from this process's descriptor.
  void truncate(std::size_t bytes);

 private:
  int fd_ = -1;
  std::span<std::byte> bytes_;
};

std::string control_name(const std::string& channel);
// The name of slot `slot`'s segment, which must exist (its epoch starts from the producer's
// incarnation: see epoch_base()).
std::string slot_name(const std::string& channel, std::uint32_t slot);

// The next bucket, or an exception (which the test reports) when none comes.
ReceivedBucket next_bucket(Subscriber& subscriber, std::chrono::milliseconds timeout = 10s);

// A consumer's body that attaches, takes the next bucket, says so through `holding`, and holds
// it until killed: a consumer that dies holding a lease.
int hold_a_bucket(const std::string& channel, Signal& holding);

// Receives `buckets` buckets in order, checking every byte; the exit status says how it went.
int consume(const std::string& channel, const cli::Workload& workload, std::uint64_t buckets,
            std::chrono::milliseconds pause = 0ms);

}  // namespace tensorbucket::test
