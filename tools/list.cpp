#include <cstdio>
#include <sstream>

#include "commands.hpp"
#include "exit_codes.hpp"

namespace tensorbucket::cli {
namespace {

// One channel's line: what inspect_channel() says of it, or why it could not.
struct Listed {
  std::string name;
  std::optional<ChannelInfo> info;
  std::string problem;  // the error's code and message, when there is no info
};

std::size_t live_consumers(const ChannelInfo& info) {
  std::size_t live = 0;
  for (const auto& consumer : info.consumers) live += consumer.alive ? 1 : 0;
  return live;
}

// `text` as the inside of a JSON string.
std::string json_escaped(const std::string& text) {
  std::string out;
  for (char c : text) {
    if (c == '"' || c == '\\') out += '\\';
    if (static_cast<unsigned char>(c) < 0x20) {
      char escape[8];
      std::snprintf(escape, sizeof escape, "\\u%04x", c);
      out += escape;
      continue;
    }
    out += c;
  }
  return out;
}

std::string producer_state(const ChannelInfo& info) {
  return info.producer_alive ? (info.closed ? "closing" : "alive") : "dead (leftovers: tbucket rm removes them)";
}

}  // namespace

int run_list(const ListOptions& options) {
  std::vector<Listed> listed;
  for (auto& name : list_channels()) {
    Listed entry{name, std::nullopt, ""};
    try {
      entry.info = inspect_channel(name);
    } catch (const Error& e) {
      entry.problem = std::string(to_string(e.code())) + ": " + e.what();
    }
    listed.push_back(std::move(entry));
  }
  if (options.json) {
    std::ostringstream out;
    out << "[";
    for (std::size_t i = 0; i < listed.size(); ++i) {
      const auto& entry = listed[i];
      out << (i ? "," : "") << "{\"channel\":\"" << json_escaped(entry.name) << "\"";
      if (entry.info) {
        const auto& info = *entry.info;
        out << ",\"producer_pid\":" << info.producer_pid << ",\"producer_alive\":" << (info.producer_alive ? "true" : "false")
            << ",\"incarnation\":" << info.producer_incarnation << ",\"policy\":\"" << info.policy
            << "\",\"slots\":" << info.slots << ",\"consumers\":" << live_consumers(info)
            << ",\"max_consumers\":" << info.max_consumers << ",\"published\":" << info.published;
      } else {
        out << ",\"problem\":\"" << json_escaped(entry.problem) << "\"";
      }
      out << "}";
    }
    out << "]";
    std::printf("%s\n", out.str().c_str());
    return kOk;
  }
  if (listed.empty()) std::printf("no channels\n");
  for (const auto& entry : listed) {
    if (!entry.info) {
      std::printf("%s: %s\n", entry.name.c_str(), entry.problem.c_str());
      continue;
    }
    const auto& info = *entry.info;
    std::printf("%s: producer pid %d %s, incarnation %016llx, %s, %u slots, %zu of %u consumers, %llu buckets published\n",
                entry.name.c_str(), info.producer_pid, producer_state(info).c_str(),
                static_cast<unsigned long long>(info.producer_incarnation), info.policy.c_str(), info.slots,
                live_consumers(info), info.max_consumers, static_cast<unsigned long long>(info.published));
  }
  return kOk;
}

int run_remove(const RemoveOptions& options) {
  remove_channel(options.channel, options.force);
  std::printf("removed %s\n", options.channel.c_str());
  return kOk;
}

}  // namespace tensorbucket::cli
