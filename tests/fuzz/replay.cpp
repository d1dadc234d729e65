// Replays a fuzz target's seed corpus as a plain test, in builds without libFuzzer (gcc, the
// sanitizer run): every seed must give the outcome its folder's EXPECTED file names for it
// ("<file> <outcome>" per line), and every file must have one, so a seed that stops
// exercising what it was made for fails here. Run with --print to write out what each gives.
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <map>
#include <string>
#include <vector>

#include "fuzz_target.hpp"

int main(int argc, char** argv) {
  bool print = argc == 3 && std::strcmp(argv[1], "--print") == 0;
  if (argc != 2 && !print) {
    std::fprintf(stderr, "usage: %s [--print] CORPUS_FOLDER\n", argv[0]);
    return 2;
  }
  std::filesystem::path folder = argv[argc - 1];
  std::map<std::string, std::string> expected;
  std::ifstream list(folder / "EXPECTED");
  for (std::string name, outcome; list >> name && std::getline(list >> std::ws, outcome);) {
    expected[name] = outcome;
  }
  int inputs = 0, wrong = 0;
  for (const auto& entry : std::filesystem::directory_iterator(folder)) {
    auto name = entry.path().filename().string();
    if (name == "EXPECTED") continue;
    std::ifstream file(entry.path(), std::ios::binary);
    std::vector<char> bytes(std::istreambuf_iterator<char>(file), {});
    auto outcome = fuzz_outcome(reinterpret_cast<const std::uint8_t*>(bytes.data()), bytes.size());
    ++inputs;
    if (print) {
      std::printf("%s %s\n", name.c_str(), outcome.c_str());
      continue;
    }
    auto found = expected.find(name);
    if (found == expected.end()) {
      std::printf("%s: no expected outcome (it gives \"%s\")\n", name.c_str(), outcome.c_str());
      ++wrong;
    } else if (found->second != outcome) {
      std::printf("%s: gives \"%s\", expected \"%s\"\n", name.c_str(), outcome.c_str(), found->second.c_str());
      ++wrong;
    }
    if (found != expected.end()) expected.erase(found);
  }
  if (print) return 0;
  for (const auto& [name, outcome] : expected) {
    std::printf("%s: expected \"%s\", but there is no such seed\n", name.c_str(), outcome.c_str());
    ++wrong;
  }
  std::printf("replayed %d inputs, %d not as expected\n", inputs, wrong);
  return inputs > 0 && wrong == 0 ? 0 : 1;
}
