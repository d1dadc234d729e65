// The tbucket command line as scripts use it: real exec'd processes, exit statuses, what they
// print, and no segment left behind. The binary's path comes in TBUCKET.
#include <gtest/gtest.h>

#include <fcntl.h>
#include <pty.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/resource.h>
#include <sys/statvfs.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <optional>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "../tools/workload.hpp"
#include "ipc/control.hpp"
#include "support.hpp"

namespace tensorbucket {
namespace {

using namespace std::chrono_literals;

// The /dev/shm names of channel `channel`'s slot segments (their epochs start from the
// producer's incarnation).
std::vector<std::string> slot_segments(const std::string& channel) {
  std::vector<std::string> found;
  for (const auto& entry : std::filesystem::directory_iterator("/dev/shm")) {
    auto name = entry.path().filename().string();
    if (name.starts_with("tensorbucket." + channel + ".slot")) found.push_back(name);
  }
  return found;
}

std::string read_file(const std::string& path) {
  std::ifstream file(path);
  std::stringstream text;
  text << file.rdbuf();
  return text.str();
}

// `tbucket args...` running, its stdout and stderr going to files.
class Tbucket {
 public:
  explicit Tbucket(std::vector<std::string> args) {
    static int runs = 0;
    auto base = std::filesystem::temp_directory_path() /
                ("tbcli-" + std::to_string(::getpid()) + "-" + std::to_string(runs++));
    out_ = base.string() + ".out";
    err_ = base.string() + ".err";
    const char* binary = std::getenv("TBUCKET");
    std::fflush(nullptr);
    pid_ = ::fork();
    if (pid_ == 0) {
      ::signal(SIGPIPE, SIG_DFL);  // as a shell's pipeline has it; a test runner may ignore it
      ::dup2(::open(out_.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0600), 1);
      ::dup2(::open(err_.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0600), 2);
      std::vector<char*> argv{const_cast<char*>(binary)};
      for (auto& arg : args) argv.push_back(arg.data());
      argv.push_back(nullptr);
      ::execv(binary, argv.data());
      ::_exit(127);
    }
  }
  Tbucket(const Tbucket&) = delete;
  Tbucket& operator=(const Tbucket&) = delete;
  ~Tbucket() {
    if (!status_) {
      ::kill(pid_, SIGKILL);
      finish();
    }
    std::filesystem::remove(out_);
    std::filesystem::remove(err_);
  }

  // The exit status (128 + signal when killed by one); kills it after `timeout`.
  int finish(std::chrono::milliseconds timeout = 60s) {
    if (status_) return *status_;
    auto deadline = std::chrono::steady_clock::now() + timeout;
    int status = 0;
    while (::wait4(pid_, &status, WNOHANG, &usage_) == 0) {
      if (std::chrono::steady_clock::now() > deadline) {
        ADD_FAILURE() << "tbucket did not finish in time";
        ::kill(pid_, SIGKILL);
        ::wait4(pid_, &status, 0, &usage_);
        break;
      }
      std::this_thread::sleep_for(1ms);
    }
    status_ = WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
    return *status_;
  }
  // Its peak resident memory in KiB, once finished: its own, not that of every child of the test.
  long max_rss_kib() const { return usage_.ru_maxrss; }
  bool running() {
    siginfo_t info{};
    return !status_ && ::waitid(P_PID, static_cast<id_t>(pid_), &info, WEXITED | WNOHANG | WNOWAIT) == 0 &&
           info.si_pid == 0;
  }
  // Waits (bounded) until its SIGINT, SIGTERM and SIGPIPE handlers are in place: a signal sent
  // before would kill it with the same status a clean stop exits with.
  bool handles_stop_signals() {
    return test::wait_until([&] {
      std::ifstream status("/proc/" + std::to_string(pid_) + "/status");
      for (std::string line; std::getline(status, line);) {
        if (!line.starts_with("SigCgt:")) continue;
        auto caught = std::stoull(line.substr(7), nullptr, 16);
        return (caught >> (SIGTERM - 1) & 1) && (caught >> (SIGINT - 1) & 1) && (caught >> (SIGPIPE - 1) & 1);
      }
      return false;
    });
  }
  void signal(int number) { ::kill(pid_, number); }
  pid_t pid() const { return pid_; }
  std::string out() const { return read_file(out_); }
  std::string err() const { return read_file(err_); }

 private:
  pid_t pid_ = -1;
  std::optional<int> status_;
  rusage usage_{};  // of the finished process (wait4)
  std::string out_, err_;
};

int run(std::vector<std::string> args) { return Tbucket(std::move(args)).finish(); }

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
  std::string channel = test::channel_for_this_test("tbcli");
};

// A usage error is exit status 2 and one line on stderr that says what was wrong.
void expect_usage_error(std::vector<std::string> args, const std::string& named) {
  Tbucket tbucket(args);
  EXPECT_EQ(tbucket.finish(), 2) << args[0];
  auto err = tbucket.err();
  EXPECT_EQ(std::count(err.begin(), err.end(), '\n'), 1) << err;
  EXPECT_NE(err.find(named), std::string::npos) << err;
}

TEST_F(Cli, ProducerAndVerifyingConsumersExitZero) {
  Tbucket first({"consume", "--channel", channel, "--buckets", "50", "--verify", "--json"});
  Tbucket second({"consume", "--channel", channel, "--buckets", "50", "--verify"});
  EXPECT_EQ(run({"produce", "--channel", channel, "--buckets", "50", "--tensors", "6",
                 "--tensor-bytes", "2048", "--consumers", "2", "--checksum", "--in-place"}),
            0);
  EXPECT_EQ(first.finish(), 0);
  EXPECT_EQ(second.finish(), 0);
  auto lines = first.out();
  EXPECT_EQ(std::count(lines.begin(), lines.end(), '\n'), 50);
  EXPECT_NE(lines.find("{\"index\":49,\"version\":49,\"entries\":6,\"bytes\":12288,"), std::string::npos) << lines;
  EXPECT_EQ(lines.find("\"ok\":false"), std::string::npos) << lines;
}

TEST_F(Cli, ConsumerOfWholeUpdatesPrintsOneLinePerUpdate) {
  Tbucket consumer({"consume", "--channel", channel, "--updates", "--buckets", "5", "--verify", "--json"});
  EXPECT_EQ(run({"produce", "--channel", channel, "--buckets", "20", "--update-buckets", "4", "--slots", "4",
                 "--tensors", "3", "--tensor-bytes", "512"}),
            0);
  EXPECT_EQ(consumer.finish(), 0) << consumer.err();
  auto lines = consumer.out();
  EXPECT_EQ(std::count(lines.begin(), lines.end(), '\n'), 5) << lines;
  EXPECT_NE(lines.find("{\"version\":4,\"buckets\":4,\"first_index\":16,\"incarnation\":"), std::string::npos) << lines;
  EXPECT_EQ(lines.find("\"ok\":false"), std::string::npos) << lines;
}

TEST_F(Cli, LatestProducerNeverWaitsForASlowConsumer) {
  expect_usage_error({"produce", "--channel", channel, "--policy", "newest"}, "newest");
  // Too few slots for the rule: refused before anything is created.
  Tbucket refused({"produce", "--channel", channel, "--policy", "latest", "--slots", "2"});
  EXPECT_EQ(refused.finish(), 2);
  EXPECT_NE(refused.err().find("needs slots >= (max_consumers + 1) x update_buckets = 9"), std::string::npos)
      << refused.err();
  // A consumer that holds its first update while the producer publishes all 200 buckets, which
  // a `block` channel would stop at its 6th.
  Tbucket producer({"produce", "--channel", channel, "--policy", "latest", "--slots", "6", "--max-consumers", "2",
                    "--update-buckets", "2", "--buckets", "200", "--interval-ms", "1"});
  auto subscriber = Subscriber::attach(channel, 10s);
  auto held = subscriber.next_update(10s);
  ASSERT_TRUE(held.has_value());
  auto deadline = std::chrono::steady_clock::now() + 30s;
  while (inspect_channel(channel).published < 200 && std::chrono::steady_clock::now() < deadline) {
    std::this_thread::sleep_for(5ms);
  }
  EXPECT_EQ(inspect_channel(channel).published, 200u);
  EXPECT_EQ(cli::check_bucket(held->buckets()[0].view(), 1, held->first_sequence()), "");  // never overwritten
  held.reset();
  auto newest = subscriber.next_update(10s);  // lets the producer's final drain end
  ASSERT_TRUE(newest.has_value());
  EXPECT_EQ(newest->version(), 99u);
  newest.reset();
  EXPECT_EQ(producer.finish(), 0) << producer.err();
}

TEST_F(Cli, FollowingConsumerGoesOnWithTheNextProducer) {
  Tbucket consumer({"consume", "--channel", channel, "--updates", "--follow", "--buckets", "6", "--verify"});
  EXPECT_EQ(run({"produce", "--channel", channel, "--buckets", "6", "--update-buckets", "2", "--slots", "2"}), 0);
  EXPECT_EQ(run({"produce", "--channel", channel, "--buckets", "6", "--update-buckets", "2", "--slots", "2"}), 0);
  EXPECT_EQ(consumer.finish(), 0) << consumer.err();
  auto lines = consumer.out();
  EXPECT_EQ(std::count(lines.begin(), lines.end(), '\n'), 6) << lines;
  EXPECT_NE(consumer.err().find("waiting for its next producer"), std::string::npos) << consumer.err();
}

TEST_F(Cli, ListShowsEveryChannelAndRmRemovesOnlyADeadProducersLeftovers) {
  auto dead = "tbcli-dead-" + std::to_string(::getpid());
  Tbucket killed({"produce", "--channel", dead, "--buckets", "100", "--timeout-ms", "60000"});
  ASSERT_TRUE(test::wait_until([&] {
    try {
      return inspect_channel(dead).published == 2;  // both slots filled: it waits for a consumer
    } catch (const Error&) {
      return false;  // not there yet
    }
  }, 10s));
  killed.signal(SIGKILL);
  EXPECT_EQ(killed.finish(), 128 + SIGKILL);
  auto publisher = Publisher::create(channel);

  Tbucket text({"list"});
  ASSERT_EQ(text.finish(), 0);
  auto pid = std::to_string(::getpid());
  EXPECT_NE(text.out().find(channel + ": producer pid " + pid + " alive, incarnation "), std::string::npos) << text.out();
  EXPECT_NE(text.out().find(dead + ": producer pid "), std::string::npos) << text.out();
  EXPECT_NE(text.out().find(" dead (leftovers: tbucket rm removes them)"), std::string::npos) << text.out();
  Tbucket json({"list", "--json"});
  ASSERT_EQ(json.finish(), 0);
  EXPECT_NE(json.out().find("{\"channel\":\"" + channel + "\",\"producer_pid\":" + pid + ",\"producer_alive\":true,"),
            std::string::npos) << json.out();

  Tbucket watch({"inspect", "--channel", dead, "--watch", "--interval-ms", "50"});  // ends at once
  EXPECT_EQ(watch.finish(), 4);
  EXPECT_NE(watch.out().find(" of channel " + dead + " is gone; its leftovers stay until `tbucket rm " + dead + "`"),
            std::string::npos) << watch.out();

  EXPECT_EQ(run({"rm", channel}), 6);  // a live producer's: refused
  auto named = [](const std::string& name) { return std::filesystem::exists("/dev/shm/tensorbucket." + name); };
  EXPECT_TRUE(named(channel));
  EXPECT_EQ(run({"rm", dead}), 0);
  EXPECT_FALSE(named(dead));
  EXPECT_EQ(slot_segments(dead), std::vector<std::string>{});
  EXPECT_EQ(run({"rm", dead}), 6);  // nothing left
  EXPECT_EQ(run({"rm", channel, "--force"}), 0);
  EXPECT_FALSE(named(channel));
  publisher.close();  // its names are gone: it leaves alone whatever holds them now
}

TEST_F(Cli, DeviceOptionsAreCheckedAndAHostConsumerOfADeviceChannelIsRefused) {
  expect_usage_error({"produce", "--channel", channel, "--device", "gpu0"}, "'gpu0' is not 'host', 'cuda' or 'cuda:N'");
  expect_usage_error({"consume", "--channel", channel, "--device", "cuda:x"}, "'cuda:x'");
  auto publisher = Publisher::create(channel);
  Tbucket consumer({"consume", "--channel", channel, "--device", "cuda", "--timeout-ms", "50"});
  EXPECT_EQ(consumer.finish(), 6);
  EXPECT_NE(consumer.err().find("LocationMismatch: channel '" + channel + "' carries its payloads in host memory"),
            std::string::npos)
      << consumer.err();
}

// Where the CUDA driver is missing (CI), a device channel is exit 7 and one line saying so.
TEST_F(Cli, DeviceChannelWithoutCudaExitsSeven) {
  Tbucket producer({"produce", "--channel", channel, "--device", "cuda:0", "--buckets", "1", "--timeout-ms", "50"});
  auto status = producer.finish();
  if (status != 7 && producer.err().find("CudaUnavailable") == std::string::npos) {
    GTEST_SKIP() << "this machine has CUDA: tbucket produce --device exited " << status;
  }
  EXPECT_EQ(status, 7);
  auto err = producer.err();
  EXPECT_EQ(std::count(err.begin(), err.end(), '\n'), 1) << err;
  EXPECT_NE(err.find("tbucket: CudaUnavailable: no CUDA driver in this process"), std::string::npos) << err;
  // And the device benchmark, whose consumer it forked first is not left behind.
  Tbucket bench({"bench", "--device", "cuda:0", "--repeats", "5"});
  EXPECT_EQ(bench.finish(), 7);
  EXPECT_NE(bench.err().find("CudaUnavailable"), std::string::npos) << bench.err();
}

TEST_F(Cli, MissingChannelExitsSix) {
  EXPECT_EQ(run({"consume", "--channel", channel, "--timeout-ms", "50"}), 6);
}

TEST_F(Cli, LiveChannelNameExitsSix) {
  auto publisher = Publisher::create(channel);
  Tbucket producer({"produce", "--channel", channel, "--buckets", "1"});
  EXPECT_EQ(producer.finish(), 6);
  EXPECT_NE(producer.err().find("live process pid " + std::to_string(::getpid())), std::string::npos)
      << producer.err();
}

// A channel whose every consumer record is taken is a channel problem too, as in Python
// (tensorbucket.ChannelError): the status follows the code's family (family_of).
TEST_F(Cli, FullChannelExitsSix) {
  PublisherOptions options;
  options.max_consumers = 1;
  auto publisher = Publisher::create(channel, options);
  auto holder = Subscriber::attach(channel, 1s);
  Tbucket consumer({"consume", "--channel", channel, "--timeout-ms", "500"});
  EXPECT_EQ(consumer.finish(), 6);
  EXPECT_NE(consumer.err().find("ChannelFull"), std::string::npos) << consumer.err();
}

// A symbolic link where a segment would be is never followed, and is a channel problem.
TEST_F(Cli, SymbolicLinkAtTheChannelNameExitsSix) {
  auto link = "/dev/shm/tensorbucket." + channel;
  std::filesystem::create_symlink("/tmp/nothing-" + channel, link);
  for (std::vector<std::string> args : {std::vector<std::string>{"produce", "--channel", channel},
                                        {"consume", "--channel", channel, "--timeout-ms", "50"},
                                        {"inspect", "--channel", channel}}) {
    Tbucket tbucket(args);
    EXPECT_EQ(tbucket.finish(), 6) << args[0];
    EXPECT_NE(tbucket.err().find("symbolic link"), std::string::npos) << tbucket.err();
  }
  std::filesystem::remove(link);
}

TEST_F(Cli, BadUsageExitsTwoWithOneLine) {
  expect_usage_error({"produce"}, "--channel is required");
  expect_usage_error({"produce", "--channel", "no/slashes"}, "no/slashes");
  expect_usage_error({"frobnicate"}, "unknown command 'frobnicate'");
  expect_usage_error({"produce", "--channel", channel, "--tensor-bytes", "abc"},
                     "'abc' is not a whole number");
  // CLI11 names a missing file as given: its newline is escaped.
  expect_usage_error({"publish-file", "--channel", channel, "no\nsuch.safetensors"}, "no\\x0asuch.safetensors");
}

// Negative numbers used to wrap around (--timeout-ms -1 waited for ever, --interval-ms -5
// slept for ever), numbers past 2^64 were taken, and --tensor-bytes 13 became 8.
TEST_F(Cli, NumbersOutsideTheirRangeExitTwo) {
  expect_usage_error({"consume", "--channel", channel, "--timeout-ms", "-1"}, "'-1'");
  expect_usage_error({"produce", "--channel", channel, "--interval-ms", "-5"}, "'-5'");
  expect_usage_error({"produce", "--channel", channel, "--seed", "-1"}, "'-1'");
  expect_usage_error({"produce", "--channel", channel, "--seed", "18446744073709551616"},
                     "'18446744073709551616'");
  expect_usage_error({"produce", "--channel", channel, "--tensor-bytes", "13"}, "a multiple of 8");
  expect_usage_error({"produce", "--channel", channel, "--slots", "17"}, "from 1 to 16");
  expect_usage_error({"consume", "--channel", channel, "--buckets", "1e3"}, "'1e3'");
  expect_usage_error({"demo", "--layers", "0"}, "from 1 to 256");
  expect_usage_error({"bench", "--repeats", "-50"}, "'-50'");
  expect_usage_error({"bench", "--tensor-bytes", "1048584"}, "1048576");
  expect_usage_error({"bench", "--tensor-bytes", "1000", "--device", "cuda:0"}, "excludes");
}

// A leading zero is a decimal digit: CLI11 read "010" as octal 8 once the range check passed.
TEST_F(Cli, NumbersWithLeadingZerosAreDecimal) {
  Tbucket produce({"produce", "--channel", channel, "--buckets", "010", "--tensors", "1", "--tensor-bytes", "0104",
                   "--consumers", "0", "--quiet"});
  EXPECT_EQ(produce.finish(), 0) << produce.err();
  EXPECT_NE(produce.out().find("published 10 buckets"), std::string::npos) << produce.out();
}

// One size, as the peer sweep runs it: the copy and in-place figures, each saying what it times.
TEST_F(Cli, BenchAtOneSizeGivesTheCopyAndInPlaceFigures) {
  Tbucket bench({"bench", "--json", "--tensor-bytes", "64", "--repeats", "5"});
  ASSERT_EQ(bench.finish(), 0) << bench.err();
  auto out = bench.out();
  EXPECT_NE(out.find("{\"name\":\"copy 1000 x 64 B\""), std::string::npos) << out;
  EXPECT_NE(out.find("{\"name\":\"in-place 1000 x 64 B\""), std::string::npos) << out;
  EXPECT_NE(out.find("\"baseline\":\"memcpy of the same"), std::string::npos) << out;
  EXPECT_NE(out.find("\"measures\":\"commit() -> the consumer holds verified views; every entry was written"),
            std::string::npos) << out;
  EXPECT_EQ(out.find("\"measured\":false"), std::string::npos) << out;
  EXPECT_EQ(std::count(out.begin(), out.end(), '{'), 2) << out;
  // "ok" says whether the figure met its target: the copy's is a ratio to memcpy, which a
  // handoff of 64 KiB (microseconds of overhead over a memcpy of nanoseconds) misses; the
  // in-place figure has none here.
  EXPECT_NE(out.find("\"target\":\"<= 1.3x\",\"measures\":\"publish() start"), std::string::npos) << out;
  auto copy_ratio = std::stod(out.substr(out.find("\"ratio\":") + 8));
  EXPECT_GT(copy_ratio, 1.3) << out;
  EXPECT_NE(out.find("\"ok\":false"), std::string::npos) << out;
  EXPECT_NE(out.find("\"target\":\"\",\"measures\":\"commit()"), std::string::npos) << out;
  EXPECT_NE(out.find("\"ok\":null"), std::string::npos) << out;
}

// The notification figures stand beside the host's own floor, measured in the same run: a bare
// word in shared memory polled, a bare futex wake. Without it a VM's slow wake-up read as ours.
TEST_F(Cli, BenchNotificationsStandBesideTheHostsFloor) {
  Tbucket bench({"bench", "--json", "--repeats", "5"});
  ASSERT_EQ(bench.finish(), 0) << bench.err();
  auto out = bench.out();
  EXPECT_EQ(out.find("\"measured\":false"), std::string::npos) << out;
  auto row = [&](const std::string& name) {
    auto at = out.find("{\"name\":\"" + name + "\"");
    return at == std::string::npos ? std::string() : out.substr(at, out.find('}', at) - at);
  };
  auto number = [](const std::string& row, const std::string& field) {
    auto at = row.find("\"" + field + "\":");
    return at == std::string::npos ? -1.0 : std::stod(row.substr(at + field.size() + 3));
  };
  for (auto [name, floor] : {std::pair{"notify, consumer spinning", "a bare shared word polled"},
                             std::pair{"notify, consumer asleep", "a bare futex wake"}}) {
    auto figure = row(name);
    ASSERT_FALSE(figure.empty()) << out;
    EXPECT_NE(figure.find(std::string("\"baseline\":\"") + floor + "\""), std::string::npos) << figure;
    EXPECT_GT(number(figure, "baseline_us"), 0) << figure;
    EXPECT_GT(number(figure, "ratio"), 0) << figure;
    EXPECT_NE(figure.find("baseline: a word"), std::string::npos) << figure;  // the legend says what it times
  }
}

// Before, a bucket past the format's payload limit failed as a bad bucket (exit 5).
TEST_F(Cli, BucketPastThePayloadLimitIsAUsageError) {
  expect_usage_error({"produce", "--channel", channel, "--tensors", "300", "--tensor-bytes",
                      "1099511627776"},
                     "past the limit");
}

// Before, the copy path allocated the whole bucket in private memory first, and only then
// found that shared memory could not hold it: std::bad_alloc, or the OOM killer.
TEST_F(Cli, BucketLargerThanSharedMemoryFailsBeforeAllocatingIt) {
  struct statvfs filesystem {};
  ASSERT_EQ(::statvfs("/dev/shm", &filesystem), 0);
  auto shm_bytes = filesystem.f_blocks * filesystem.f_frsize;
  auto tensor_bytes = std::uint64_t{1} << 30;
  auto tensors = shm_bytes / tensor_bytes + 2;
  Tbucket producer({"produce", "--channel", channel, "--buckets", "1", "--tensors", std::to_string(tensors),
                "--tensor-bytes", std::to_string(tensor_bytes)});
  EXPECT_EQ(producer.finish(), 1);
  EXPECT_NE(producer.err().find("free"), std::string::npos) << producer.err();
  EXPECT_LT(producer.max_rss_kib(), 1 << 20) << "KiB at the most";
}

TEST_F(Cli, NoConsumerExitsThreeAfterItsTimeout) {
  Tbucket producer({"produce", "--channel", channel, "--buckets", "3", "--slots", "1", "--timeout-ms", "100"});
  EXPECT_EQ(producer.finish(), 3);
  EXPECT_NE(producer.err().find("waiting for a consumer (none is attached) to release bucket 0"), std::string::npos)
      << producer.err();
}

// The producer's Timeout names the consumer that holds it back.
TEST_F(Cli, ProducerTimeoutNamesTheConsumerHoldingIt) {
  Tbucket producer({"produce", "--channel", channel, "--buckets", "3", "--slots", "1", "--timeout-ms", "300"});
  auto subscriber = Subscriber::attach(channel, 10s);
  auto bucket = subscriber.next(10s);
  ASSERT_TRUE(bucket.has_value());
  EXPECT_EQ(producer.finish(), 3);
  auto err = producer.err();
  EXPECT_NE(err.find("consumer pid " + std::to_string(::getpid())), std::string::npos) << err;
  EXPECT_NE(err.find("still holds bucket 0"), std::string::npos) << err;
}

TEST_F(Cli, ConsumerWantingMoreThanWasPublishedExitsFour) {
  Tbucket consumer({"consume", "--channel", channel, "--buckets", "5"});
  EXPECT_EQ(run({"produce", "--channel", channel, "--buckets", "2"}), 0);
  EXPECT_EQ(consumer.finish(), 4);
}

TEST_F(Cli, FlippedPayloadByteExitsFive) {
  cli::Workload workload{.tensors = 2, .tensor_bytes = 64};
  auto publisher = Publisher::create(channel, {.payload_checksum = true});
  ASSERT_TRUE(publisher.publish(cli::make_bucket(workload, 0).builder, 1s));
  auto slots = slot_segments(channel);
  ASSERT_EQ(slots.size(), 1u);
  int fd = ::shm_open(("/" + slots.front()).c_str(), O_RDWR, 0);
  ASSERT_GE(fd, 0);
  auto* mapped = ::mmap(nullptr, 4096, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  ::close(fd);
  ASSERT_NE(mapped, MAP_FAILED);
  static_cast<std::byte*>(mapped)[10] ^= std::byte{1};
  ::munmap(mapped, 4096);
  EXPECT_EQ(run({"consume", "--channel", channel, "--buckets", "1"}), 5);
}

// A generation past every bucket in the only slot: the consumer gives up at its timeout.
// Before, it skipped a bucket per turn of a loop that never looked at the time (or signals).
TEST_F(Cli, ConsumerFacingAbsurdGenerationsExitsThreeAtItsTimeout) {
  cli::Workload workload{.tensors = 2, .tensor_bytes = 64};
  auto publisher = Publisher::create(channel, {.slots = 1});
  ASSERT_TRUE(publisher.publish(cli::make_bucket(workload, 0).builder, 1s));
  int fd = ::shm_open(("/tensorbucket." + channel).c_str(), O_RDWR, 0);
  ASSERT_GE(fd, 0);
  auto* mapped = ::mmap(nullptr, sizeof(ipc::ControlBlock), PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  ::close(fd);
  ASSERT_NE(mapped, MAP_FAILED);
  auto& control = *static_cast<ipc::ControlBlock*>(mapped);
  ipc::atomic(control.slots[0].generation).store(std::uint64_t{1} << 62);
  Tbucket consumer({"consume", "--channel", channel, "--timeout-ms", "300"});
  EXPECT_EQ(consumer.finish(20s), 3) << consumer.err();
  ::munmap(mapped, sizeof(ipc::ControlBlock));
}

// A process removing a dead producer's leftovers (a `tbucket rm` stopped with Ctrl+Z, say)
// holds the name; a new producer waits for it, and a stop signal ends that wait. Before, it
// waited 10 s regardless, then blamed other producers for the name.
TEST_F(Cli, AStopSignalEndsAProducersWaitForAnotherRemover) {
  Tbucket dead({"produce", "--channel", channel, "--buckets", "100", "--interval-ms", "1000", "--consumers", "0"});
  auto control = "/dev/shm/tensorbucket." + channel;
  ASSERT_TRUE(test::wait_until([&] { return std::filesystem::exists(control); }));
  ASSERT_TRUE(dead.handles_stop_signals());  // created by now
  dead.signal(SIGKILL);
  EXPECT_EQ(dead.finish(), 128 + SIGKILL);
  int fd = ::open(control.c_str(), O_RDWR);
  ASSERT_GE(fd, 0);
  for (off_t byte : {ipc::kRemoverLockByte, ipc::kProducerLockByte}) {  // as a remover takes them
    struct flock range{};
    range.l_type = F_WRLCK;
    range.l_whence = SEEK_SET;
    range.l_start = byte;
    range.l_len = 1;
    ASSERT_EQ(::fcntl(fd, F_OFD_SETLK, &range), 0);
  }
  auto start = std::chrono::steady_clock::now();
  Tbucket producer({"produce", "--channel", channel, "--buckets", "1", "--consumers", "0"});
  ASSERT_TRUE(producer.handles_stop_signals());
  std::this_thread::sleep_for(200ms);
  producer.signal(SIGINT);
  EXPECT_EQ(producer.finish(), 128 + SIGINT) << producer.err();
  EXPECT_LT(std::chrono::steady_clock::now() - start, 5s);
  EXPECT_EQ(producer.err(), "tbucket: stopped by signal 2; no channel was created\n");
  ::close(fd);  // as a remover that ended without removing
  EXPECT_EQ(run({"rm", channel}), 0);
}

TEST_F(Cli, TerminatedProducerRemovesItsSegments) {
  // SIGPIPE (a reader of its output gone) stops it as SIGTERM does.
  for (int stop : {SIGTERM, SIGPIPE}) {
    SCOPED_TRACE(strsignal(stop));
    Tbucket producer({"produce", "--channel", channel, "--buckets", "100", "--timeout-ms", "30000"});
    auto control = "/dev/shm/tensorbucket." + channel;
    ASSERT_TRUE(test::wait_until([&] { return std::filesystem::exists(control); }));
    ASSERT_TRUE(producer.handles_stop_signals());
    producer.signal(stop);
    EXPECT_EQ(producer.finish(), 128 + stop);
    // 128 + signal from its handler, not from the default action: it says so, and it cleaned up.
    auto said = "stopped by signal " + std::to_string(stop) + "; channel closed";
    EXPECT_NE(producer.err().find(said), std::string::npos) << producer.err();
    EXPECT_FALSE(std::filesystem::exists(control));
  }
}

TEST_F(Cli, ConsumerWhoseReaderLeftStopsCleanly) {
  // `tbucket consume --follow | head -1`: once head is gone, the next line raises SIGPIPE.
  auto publisher = Publisher::create(channel, {.slots = 2, .min_consumers = 0});
  int pipe_ends[2];
  ASSERT_EQ(::pipe(pipe_ends), 0);
  std::fflush(nullptr);
  pid_t pid = ::fork();
  if (pid == 0) {
    ::signal(SIGPIPE, SIG_DFL);  // as a shell's pipeline has it; a test runner may ignore it
    ::dup2(pipe_ends[1], 1);
    ::close(pipe_ends[0]);
    ::close(pipe_ends[1]);
    const char* binary = std::getenv("TBUCKET");
    ::execl(binary, binary, "consume", "--channel", channel.c_str(), "--follow", "--json", nullptr);
    ::_exit(127);
  }
  ::close(pipe_ends[1]);
  ASSERT_TRUE(publisher.publish(cli::make_bucket({.tensors = 1, .tensor_bytes = 64}, 0).builder, 5s));
  char first = 0;
  ASSERT_EQ(::read(pipe_ends[0], &first, 1), 1);  // its first line came
  ::close(pipe_ends[0]);
  int status = 0;
  bool stopped = false;
  auto reap = [&] { return stopped = stopped || ::waitpid(pid, &status, WNOHANG) == pid; };
  for (std::uint64_t version = 1; version < 200 && !reap(); ++version) {
    publisher.publish(cli::make_bucket({.tensors = 1, .tensor_bytes = 64}, version).builder, 100ms);
    std::this_thread::sleep_for(10ms);
  }
  if (!test::wait_until(reap)) {
    ::kill(pid, SIGKILL);
    ::waitpid(pid, &status, 0);
    FAIL() << "the consumer went on writing into a pipe nobody reads";
  }
  ASSERT_TRUE(WIFEXITED(status)) << "killed by signal " << WTERMSIG(status) << " instead of stopping";
  EXPECT_EQ(WEXITSTATUS(status), 128 + SIGPIPE);
}

TEST_F(Cli, TerminatedConsumerStopsWaitingForTheChannel) {
  Tbucket consumer({"consume", "--channel", channel, "--timeout-ms", "20000"});
  ASSERT_TRUE(consumer.handles_stop_signals());
  consumer.signal(SIGTERM);
  EXPECT_EQ(consumer.finish(), 128 + SIGTERM);  // not 6 (ChannelMissing) 20 s later
  EXPECT_NE(consumer.err().find("stopped by signal 15"), std::string::npos) << consumer.err();
}

TEST_F(Cli, LongestTimeoutWaitsWithoutLimit) {
  // 2^64 - 1 ms overflowed the deadline into the past: the consumer gave up at once.
  Tbucket consumer({"consume", "--channel", channel, "--timeout-ms", "18446744073709551615"});
  ASSERT_TRUE(consumer.handles_stop_signals());
  std::this_thread::sleep_for(300ms);
  EXPECT_TRUE(consumer.running()) << "exited " << consumer.finish() << ": " << consumer.err();
  consumer.signal(SIGTERM);
  EXPECT_EQ(consumer.finish(), 128 + SIGTERM);
  EXPECT_NE(consumer.err().find("stopped by signal 15"), std::string::npos) << consumer.err();
}

TEST_F(Cli, InspectShowsTheChannel) {
  cli::Workload workload{.tensors = 2, .tensor_bytes = 64, .update_buckets = 2};
  auto publisher = Publisher::create(channel, {.slots = 3});
  auto subscriber = Subscriber::attach(channel, 1s);
  ASSERT_TRUE(publisher.publish(cli::make_bucket(workload, 0).builder, 1s));
  auto bucket = subscriber.next(1s);
  ASSERT_TRUE(bucket.has_value());
  ASSERT_TRUE(publisher.publish(cli::make_bucket(workload, 1).builder, 1s));
  ASSERT_TRUE(publisher.publish(cli::make_bucket(workload, 2).builder, 1s));
  auto pid = std::to_string(::getpid());

  Tbucket json({"inspect", "--channel", channel, "--json"});
  ASSERT_EQ(json.finish(), 0);
  auto text = json.out();
  for (const auto& expected :
       {"\"channel\":\"" + channel + "\"", std::string("\"slots\":3,\"max_consumers\":8,\"min_consumers\":1"),
        "\"producer\":{\"pid\":" + pid + ",\"incarnation\":", std::string(",\"pid_elsewhere\":false,\"alive\":true}"),
        std::string("\"location\":\"host\",\"policy\":\"block\",\"update_buckets\":1"),
        std::string("\"epoch\":1,\"payload_capacity\":"), std::string("\"published\":3,\"updates\":2"),
        std::string("{\"slot\":0,\"generation\":2,\"bucket\":0,"),
        std::string("\"version\":0,\"bucket_index\":0,\"bucket_count\":2,\"published_ns\":"),
        "\"consumers\":[{\"record\":0,\"pid\":" + pid + ",\"pid_elsewhere\":false,\"alive\":true,"
        "\"next_bucket\":1,\"lag_buckets\":2,\"lag_updates\":2,\"held_slots\":1}]",
        std::string("\"newest_manifest\":{\"version\":1,\"bucket_index\":0,\"bucket_count\":2,\"entries\":2,")}) {
    EXPECT_NE(text.find(expected), std::string::npos) << expected << " not in " << text;
  }

  Tbucket plain({"inspect", "--channel", channel});
  ASSERT_EQ(plain.finish(), 0);
  text = plain.out();
  EXPECT_NE(text.find("producer   pid " + pid + ", incarnation "), std::string::npos) << text;
  EXPECT_NE(text.find(", alive, 3 buckets published, 2 updates begun"), std::string::npos) << text;
  EXPECT_NE(text.find("policy block, up to 1 buckets per update"), std::string::npos) << text;
  EXPECT_NE(text.find("bucket 0 (version 0, bucket index 0 of 2)"), std::string::npos) << text;
  EXPECT_NE(text.find("payloads   in host shared memory"), std::string::npos) << text;
  EXPECT_NE(text.find("epoch 1, 4096 payload bytes"), std::string::npos) << text;
  // Counted from 0, as in the JSON.
  EXPECT_NE(text.find("newest     version 1, bucket index 0 of 2, 2 entries"), std::string::npos) << text;
  EXPECT_NE(text.find("consumer   record 0: pid " + pid + ", alive, next bucket 1, 2 buckets and 2 updates behind, "
                      "leases 0x1"),
            std::string::npos) << text;
  EXPECT_EQ(run({"inspect", "--channel", channel + "-missing"}), 6);
}

TEST_F(Cli, InspectWatchShowsRatesLagsAndLeasesUntilTheChannelIsGone) {
  cli::Workload workload{.tensors = 2, .tensor_bytes = 64};
  std::optional<Publisher> publisher(Publisher::create(channel, {.slots = 3}));
  auto subscriber = Subscriber::attach(channel, 1s);
  ASSERT_TRUE(publisher->publish(cli::make_bucket(workload, 0).builder, 1s));
  auto held = subscriber.next(1s);
  ASSERT_TRUE(held.has_value());

  Tbucket watch({"inspect", "--channel", channel, "--watch", "--interval-ms", "50"});
  auto refreshes = [&] {
    auto out = watch.out();
    return std::count(out.begin(), out.end(), '\n') / 2;  // a channel line and a consumer line each
  };
  ASSERT_TRUE(test::wait_until([&] { return refreshes() >= 2; }));
  ASSERT_TRUE(publisher->publish(cli::make_bucket(workload, 1).builder, 1s));
  ASSERT_TRUE(test::wait_until([&] { return watch.out().find(": 2 buckets, 2 updates published; ") != std::string::npos; }));
  publisher.reset();  // closes: its names go
  EXPECT_EQ(watch.finish(), 0) << watch.err();
  auto out = watch.out();
  // The first refresh has no rates: nothing to compare with yet.
  EXPECT_NE(out.find(" " + channel + ": 1 buckets, 1 updates published; producer pid " + std::to_string(::getpid()) +
                     " alive; 1 consumers\n"),
            std::string::npos) << out;
  EXPECT_NE(out.find(": 1 buckets, 1 updates published; 0.0 buckets/s, 0.0 MiB/s; producer pid "), std::string::npos)
      << out;
  EXPECT_NE(out.find("  consumer record 0, pid " + std::to_string(::getpid()) +
                     ", alive: 1 buckets and 1 updates behind, holds bucket 0 (published "),
            std::string::npos) << out;
  EXPECT_NE(out.find("channel " + channel + " is gone\n"), std::string::npos) << out;
  EXPECT_EQ(run({"inspect", "--channel", channel, "--watch", "--json"}), 2);
}

// A consumer killed with SIGKILL leaves its record until the producer frees it: --watch counts
// the consumers alive, as `list` does (it counted the record), and shows the record as gone.
TEST_F(Cli, InspectWatchCountsOnlyLiveConsumers) {
  cli::Workload workload{.tensors = 2, .tensor_bytes = 64};
  std::optional<Publisher> publisher(Publisher::create(channel, {.slots = 1}));
  Tbucket consumer({"consume", "--channel", channel, "--buckets", "100", "--timeout-ms", "30000"});
  ASSERT_TRUE(publisher->publish(cli::make_bucket(workload, 0).builder, 10s));  // into the free slot
  ASSERT_TRUE(publisher->publish(cli::make_bucket(workload, 1).builder, 10s));  // once the consumer released 0
  consumer.signal(SIGKILL);
  EXPECT_EQ(consumer.finish(), 128 + SIGKILL);
  Tbucket watch({"inspect", "--channel", channel, "--watch", "--interval-ms", "50"});
  ASSERT_TRUE(test::wait_until([&] { return watch.out().find(", gone: ") != std::string::npos; })) << watch.out();
  publisher.reset();  // closes: its names go
  EXPECT_EQ(watch.finish(), 0) << watch.err();
  auto out = watch.out();
  EXPECT_NE(out.find(" alive; 0 consumers\n  consumer record 0, pid " + std::to_string(consumer.pid()) + ", gone: "),
            std::string::npos)
      << out;
  EXPECT_EQ(out.find(" alive; 1 consumers\n"), std::string::npos) << out;
}

TEST_F(Cli, HelpShowsEveryDefaultAndUnit) {
  Tbucket help({"produce", "--help"});
  ASSERT_EQ(help.finish(), 0);
  auto text = help.out();
  for (const char* expected : {"--slots UINT:1..16=2 ", "--timeout-ms UINT=10000 ", "in milliseconds",
                               "--policy TEXT:{block,latest}=block\n", "--tensor-bytes UINT:8..1099511627776=4096\n",
                               "Bytes per tensor", "--quiet"}) {
    EXPECT_NE(text.find(expected), std::string::npos) << expected << " not in " << text;
  }
  Tbucket version({"--version"});
  ASSERT_EQ(version.finish(), 0);
  EXPECT_EQ(version.out().rfind("tbucket ", 0), 0u) << version.out();
}

// `args` with stderr on a terminal (a pseudo-terminal's), stdout to a file: what it drew there.
std::string stderr_on_a_terminal(std::vector<std::string> args) {
  int terminal = -1, side = -1;
  if (::openpty(&terminal, &side, nullptr, nullptr, nullptr) != 0) return "openpty failed";
  const char* binary = std::getenv("TBUCKET");
  std::fflush(nullptr);
  pid_t pid = ::fork();
  if (pid == 0) {
    ::dup2(::open("/dev/null", O_WRONLY), 1);
    ::dup2(side, 2);
    std::vector<char*> argv{const_cast<char*>(binary)};
    for (auto& arg : args) argv.push_back(arg.data());
    argv.push_back(nullptr);
    ::execv(binary, argv.data());
    ::_exit(127);
  }
  ::close(side);
  std::string drawn;
  char chunk[512];
  for (ssize_t n; (n = ::read(terminal, chunk, sizeof chunk)) > 0;) drawn.append(chunk, static_cast<std::size_t>(n));
  ::close(terminal);  // read() ends with EIO once the child, the last holder of its side, is gone
  int status = 0;
  ::waitpid(pid, &status, 0);
  return WIFEXITED(status) && WEXITSTATUS(status) == 0 ? drawn : "exit status " + std::to_string(status);
}

TEST_F(Cli, ProgressIsDrawnOnATerminalOnlyAndNotWithQuiet) {
  std::vector<std::string> produce{"produce", "--channel", channel, "--buckets", "3", "--consumers", "0",
                                   "--tensors", "2", "--tensor-bytes", "1048576", "--interval-ms", "600"};
  auto drawn = stderr_on_a_terminal(produce);
  EXPECT_NE(drawn.find("tbucket produce: 3 buckets, 6.0 MiB in "), std::string::npos) << drawn;
  EXPECT_NE(drawn.find("buckets/s, "), std::string::npos) << drawn;
  produce.push_back("--quiet");
  EXPECT_EQ(stderr_on_a_terminal(produce), "");
  // Not a terminal: nothing but the result, on stdout.
  produce.pop_back();
  Tbucket logged(produce);
  EXPECT_EQ(logged.finish(), 0);
  EXPECT_EQ(logged.err(), "");
  EXPECT_NE(logged.out().find("published 3 buckets, 6.0 MiB"), std::string::npos) << logged.out();
}

TEST_F(Cli, DemoSaysInPlainWordsWhatWasTriedAndRefused) {
  Tbucket demo({"demo", "--layers", "1"});
  ASSERT_EQ(demo.finish(), 0) << demo.err();
  auto out = demo.out();
  for (const char* expected : {"what a consumer must refuse, and does:\n",
                               "  the manifest of the bucket, without its payload:\n    refused, MissingPayload: ",
                               "    refused, ChecksumMismatch: ", "median ", " over 3 buckets", "demo ok\n"}) {
    EXPECT_NE(out.find(expected), std::string::npos) << expected << " not in " << out;
  }
  EXPECT_EQ(out.find("seed 0"), std::string::npos) << out;
  EXPECT_EQ(out.find("p99"), std::string::npos) << out;  // 3 samples have none
}

}  // namespace
}  // namespace tensorbucket
