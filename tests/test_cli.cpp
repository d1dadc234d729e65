// The tbucket command line as scripts use it: real exec'd processes, exit statuses, and no
// segment left behind. The binary's path comes in TBUCKET.
#include <gtest/gtest.h>

#include <fcntl.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <string>
#include <thread>
#include <vector>

#include "../tools/workload.hpp"
#include "support.hpp"

namespace tensorbucket {
namespace {

using namespace std::chrono_literals;

// Starts `tbucket args...` with stdout and stderr to /dev/null.
pid_t spawn(std::vector<std::string> args) {
  const char* binary = std::getenv("TBUCKET");
  std::fflush(nullptr);
  pid_t pid = ::fork();
  if (pid == 0) {
    int null = ::open("/dev/null", O_WRONLY);
    ::dup2(null, 1);
    ::dup2(null, 2);
    std::vector<char*> argv{const_cast<char*>(binary)};
    for (auto& arg : args) argv.push_back(arg.data());
    argv.push_back(nullptr);
    ::execv(binary, argv.data());
    ::_exit(127);
  }
  return pid;
}

int wait_for(pid_t pid) {
  int status = 0;
  ::waitpid(pid, &status, 0);
  return WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
}

int run(std::vector<std::string> args) { return wait_for(spawn(std::move(args))); }

class Cli : public ::testing::Test {
 protected:
  void SetUp() override {
    if (std::getenv("TBUCKET") == nullptr) GTEST_FAIL() << "TBUCKET must name the tbucket binary";
  }
  void TearDown() override {
    for (const auto& entry : std::filesystem::directory_iterator("/dev/shm")) {
      EXPECT_FALSE(entry.path().filename().string().starts_with("tensorbucket." + channel))
          << entry.path() << " was left behind";
    }
  }
  std::string channel = "tbcli-" + std::to_string(::getpid()) + "-" +
                        ::testing::UnitTest::GetInstance()->current_test_info()->name();
};

TEST_F(Cli, ProducerAndVerifyingConsumersExitZero) {
  auto first = spawn({"consume", "--channel", channel, "--buckets", "50", "--verify", "--json"});
  auto second = spawn({"consume", "--channel", channel, "--buckets", "50", "--verify"});
  EXPECT_EQ(run({"produce", "--channel", channel, "--buckets", "50", "--tensors", "6",
                 "--tensor-bytes", "2048", "--consumers", "2", "--checksum", "--in-place"}),
            0);
  EXPECT_EQ(wait_for(first), 0);
  EXPECT_EQ(wait_for(second), 0);
}

TEST_F(Cli, MissingChannelExitsSix) {
  EXPECT_EQ(run({"consume", "--channel", channel, "--timeout-ms", "50"}), 6);
}

TEST_F(Cli, LiveChannelNameExitsSix) {
  auto publisher = Publisher::create(channel);
  EXPECT_EQ(run({"produce", "--channel", channel, "--buckets", "1"}), 6);
}

TEST_F(Cli, BadUsageExitsTwo) {
  EXPECT_EQ(run({"produce"}), 2);
  EXPECT_EQ(run({"produce", "--channel", "no/slashes"}), 2);
}

TEST_F(Cli, NoConsumerExitsThreeAfterItsTimeout) {
  EXPECT_EQ(run({"produce", "--channel", channel, "--buckets", "3", "--slots", "1",
                 "--timeout-ms", "100"}),
            3);
}

TEST_F(Cli, ConsumerWantingMoreThanWasPublishedExitsFour) {
  auto consumer = spawn({"consume", "--channel", channel, "--buckets", "5"});
  EXPECT_EQ(run({"produce", "--channel", channel, "--buckets", "2"}), 0);
  EXPECT_EQ(wait_for(consumer), 4);
}

TEST_F(Cli, FlippedPayloadByteExitsFive) {
  cli::Workload workload{.tensors = 2, .tensor_bytes = 64};
  auto publisher = Publisher::create(channel, {.payload_checksum = true});
  ASSERT_TRUE(publisher.publish(cli::make_bucket(workload, 0).builder, 1s));
  int fd = ::shm_open(("/tensorbucket." + channel + ".slot0.1").c_str(), O_RDWR, 0);
  ASSERT_GE(fd, 0);
  auto* byte = static_cast<std::byte*>(::mmap(nullptr, 4096, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0));
  ::close(fd);
  byte[10] ^= std::byte{1};
  ::munmap(byte, 4096);
  EXPECT_EQ(run({"consume", "--channel", channel, "--buckets", "1"}), 5);
}

TEST_F(Cli, TerminatedProducerRemovesItsSegments) {
  auto producer = spawn({"produce", "--channel", channel, "--buckets", "100", "--timeout-ms", "30000"});
  auto control = "/dev/shm/tensorbucket." + channel;
  for (int i = 0; i < 500 && !std::filesystem::exists(control); ++i) std::this_thread::sleep_for(2ms);
  ASSERT_TRUE(std::filesystem::exists(control));
  ::kill(producer, SIGTERM);
  EXPECT_EQ(wait_for(producer), 128 + SIGTERM);
}

TEST_F(Cli, TerminatedConsumerStopsWaitingForTheChannel) {
  auto consumer = spawn({"consume", "--channel", channel, "--timeout-ms", "20000"});
  std::this_thread::sleep_for(200ms);  // past installing its handlers, into the wait
  ::kill(consumer, SIGTERM);
  EXPECT_EQ(wait_for(consumer), 128 + SIGTERM);  // not 6 (ChannelMissing) 20 s later
}

TEST_F(Cli, LongestTimeoutWaitsWithoutLimit) {
  // 2^64 - 1 ms overflowed the deadline into the past: the consumer gave up at once.
  auto consumer = spawn({"consume", "--channel", channel, "--timeout-ms", "18446744073709551615"});
  std::this_thread::sleep_for(300ms);
  ::kill(consumer, SIGTERM);
  EXPECT_EQ(wait_for(consumer), 128 + SIGTERM);  // still waiting, not 6 (ChannelMissing)
}

TEST_F(Cli, InspectShowsTheChannel) {
  cli::Workload workload{.tensors = 2, .tensor_bytes = 64};
  auto publisher = Publisher::create(channel);
  ASSERT_TRUE(publisher.publish(cli::make_bucket(workload, 0).builder, 1s));
  EXPECT_EQ(run({"inspect", "--channel", channel, "--json"}), 0);
  EXPECT_EQ(run({"inspect", "--channel", channel + "-missing"}), 6);
}

}  // namespace
}  // namespace tensorbucket
