#include "process.hpp"

#include <pthread.h>
#include <signal.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <fstream>
#include <sstream>
#include <string>

namespace tensorbucket::ipc {
namespace {

struct StatFields {
  char state = '?';
  std::uint64_t start_time = 0;
};

// Fields after the command name, which sits in parentheses and may itself contain spaces or
// parentheses: parse from the last ')'.
bool read_stat(std::int32_t pid, StatFields& fields) {
  std::ifstream file("/proc/" + std::to_string(pid) + "/stat");
  std::string line;
  if (!std::getline(file, line)) return false;
  auto close = line.rfind(')');
  if (close == std::string::npos) return false;
  std::istringstream rest(line.substr(close + 1));
  rest >> fields.state;  // field 3
  std::string skip;
  for (int field = 4; field < 22; ++field) rest >> skip;
  rest >> fields.start_time;  // field 22
  return static_cast<bool>(rest);
}

}  // namespace

ProcessId current_process() {
  ProcessId id{static_cast<std::int32_t>(::getpid()), 0, 0};
  StatFields fields;
  if (read_stat(id.pid, fields)) id.start_time = fields.start_time;
  return id;
}

namespace {
std::atomic<std::uint64_t> forks_seen{0};  // in this process and its ancestors
void count_fork() { forks_seen.fetch_add(1, std::memory_order_relaxed); }
}  // namespace

Owner::Owner() : pid_(static_cast<std::int32_t>(::getpid())) {
  static const int registered = ::pthread_atfork(nullptr, nullptr, count_fork);
  static_cast<void>(registered);
  forks_ = forks_seen.load(std::memory_order_relaxed);
}

bool Owner::forked() const noexcept { return forks_seen.load(std::memory_order_relaxed) != forks_; }

bool is_alive(const ProcessId& id) {
  if (id.pid <= 0) return false;
  if (::kill(id.pid, 0) != 0 && errno != EPERM) return false;
  StatFields fields;
  if (!read_stat(id.pid, fields)) return false;
  return fields.start_time == id.start_time && fields.state != 'Z' && fields.state != 'X';
}

}  // namespace tensorbucket::ipc
