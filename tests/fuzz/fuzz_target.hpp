// What a fuzz target made of one input, in a line: the libFuzzer entry point throws it away,
// the corpus replay (replay.cpp) compares it with what each seed is expected to give.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

std::string fuzz_outcome(const std::uint8_t* data, std::size_t size);
