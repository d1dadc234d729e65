#include "leftovers.hpp"

#include <algorithm>
#include <initializer_list>

#include "control.hpp"
#include "liveness.hpp"

namespace tensorbucket::ipc {

bool remove_if_dead(std::string_view channel, const std::string& name, const Segment& stale) {
  if (!try_lock(stale.descriptor(), kProducerLockByte)) return false;
  if (!stale.named(name)) return true;  // removed or replaced meanwhile: not ours to remove
  if (stale.size() >= sizeof(ControlBlock)) {
    auto* control = reinterpret_cast<ControlBlock*>(stale.data());
    // The dead producer may have died growing a slot, between creating one epoch and
    // unlinking the previous: remove the neighbours too.
    auto slots = std::min<std::uint32_t>(atomic(control->slot_count).load(std::memory_order_relaxed), kMaxSlots);
    for (std::uint32_t s = 0; s < slots; ++s) {
      auto epoch = atomic(control->slots[s].segment_epoch).load(std::memory_order_relaxed);
      for (auto e : {epoch - 1, epoch, epoch + 1}) {
        if (e != 0) Segment::remove(slot_segment_name(channel, s, e));
      }
    }
  }
  Segment::remove(name);
  return true;
}

}  // namespace tensorbucket::ipc
