// Internal: a dead producer's leftovers, its segments still named in /dev/shm.
#pragma once

#include "base/private.hpp"

#include <string>
#include <string_view>

#include "ipc/os/segment.hpp"

namespace tensorbucket::ipc {

// What holds a channel's name, as seen through `segment` (opened, with Locks::kKept, under
// `name`).
enum class Holder {
  kProducer,  // a live producer: its own lock byte is held, and nobody is removing it
  kRemover,   // someone is removing a dead producer's channel, or just did
  kNobody,    // its producer is dead and nobody is removing it yet
};
Holder holder_of(const std::string& name, const Segment& segment);

// Removes channel `channel`'s control segment `stale` (opened, with Locks::kKept, under
// `name`) and its slot segments, if its producer is dead. Holds the remover's lock byte and
// then the producer's meanwhile (liveness.hpp): every remover needs them, and a new object
// can only take a free name, so while we hold them and `name` still names `stale`, nobody else
// can remove or replace it. kProducer (removing nothing) when a live producer holds it,
// kRemover when another remover is at it, kNobody once it was removed (or was no longer named
// `stale`).
Holder remove_if_dead(std::string_view channel, const std::string& name, const Segment& stale);

// Unlinks channel `channel`'s control segment `stale` (mapped under `name`) and the slot
// segments its control block names, whoever holds them.
void remove_names(std::string_view channel, const std::string& name, const Segment& stale);

}  // namespace tensorbucket::ipc
