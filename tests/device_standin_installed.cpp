// Linked into a test build of tbucket (tests/meson.build): installs the host stand-in of the
// CUDA driver (device_standin.hpp) before main(), so that the CLI's device channels
// (--device cuda:N) run end to end where there is no GPU, as the library's device channel
// tests do.
#include "device_standin.hpp"

namespace {
const bool installed = (tensorbucket::test::StandIn::install(), true);
}  // namespace
