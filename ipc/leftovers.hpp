// Internal: a dead producer's leftovers, its segments still named in /dev/shm.
#pragma once

#include <string>
#include <string_view>

#include "segment.hpp"

namespace tensorbucket::ipc {

// Removes channel `channel`'s control segment `stale` (opened, with Locks::kKept, under
// `name`) and its slot segments, if its producer is dead. Holds the producer lock meanwhile:
// every remover needs that lock and a new object can only take a free name, so while we hold
// it and `name` still names `stale`, nobody else can remove or replace it. False, removing
// nothing, when a live process holds the lock (its producer, or another remover); true when
// it was removed, or no longer named `stale`.
bool remove_if_dead(std::string_view channel, const std::string& name, const Segment& stale);

}  // namespace tensorbucket::ipc
