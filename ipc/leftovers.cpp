#include "leftovers.hpp"

#include <algorithm>
#include <initializer_list>

#include "control.hpp"
#include "ipc/os/liveness.hpp"
#include "base/text.hpp"
#include "tensorbucket/channel.hpp"

namespace tensorbucket::ipc {

namespace {

// The control block of `segment`, when it has room for one.
ControlBlock* control_of(const Segment& segment) {
  return segment.size() >= sizeof(ControlBlock) ? reinterpret_cast<ControlBlock*>(segment.data()) : nullptr;
}

bool closed_by_remover(const Segment& segment) {
  auto* control = control_of(segment);
  return control != nullptr &&
         atomic(control->closed).load(std::memory_order_acquire) == static_cast<std::uint16_t>(Closed::kByRemover);
}

}  // namespace

Holder holder_of(const std::string& name, const Segment& segment) {
  // In this order: a remover takes its byte before the producer's and lets go of it after, so a
  // producer's byte held, then the remover's free, means the producer's own, unless the removal
  // ended in between (which marked the block and unlinked the name). A remover's byte held is
  // kRemover here, where it means "look again" (an attacher polls); consumers already attached
  // judge the producer by its byte and the remover's mark alone (see remove_if_dead()).
  if (!held_by_other(segment.descriptor(), kProducerLockByte)) return Holder::kNobody;
  if (held_by_other(segment.descriptor(), kRemoverLockByte) || closed_by_remover(segment) || !segment.named(name)) {
    return Holder::kRemover;
  }
  return Holder::kProducer;
}

Holder remove_if_dead(std::string_view channel, const std::string& name, const Segment& stale) {
  struct Locked {  // let go of when it goes
    int fd;
    off_t byte;
    ~Locked() { unlock(fd, byte); }
  };
  if (!try_lock(stale.descriptor(), kRemoverLockByte)) return Holder::kRemover;
  Locked remover{stale.descriptor(), kRemoverLockByte};
  if (!try_lock(stale.descriptor(), kProducerLockByte)) return Holder::kProducer;
  Locked producer{stale.descriptor(), kProducerLockByte};  // let go of before the remover's byte
  if (!stale.named(name)) return Holder::kNobody;  // removed or replaced meanwhile: not ours to remove
  // Its consumers take this for their producer's death, before its names go: not the
  // remover's byte, which every remover takes first, also one that then finds a live producer
  // (a `tbucket rm` refused, a second producer of the name).
  if (auto* control = control_of(stale)) {
    atomic(control->closed).store(static_cast<std::uint16_t>(Closed::kByRemover), std::memory_order_release);
    futex_bump_and_wake(control->consumer_wake);
  }
  remove_names(channel, name, stale);
  return Holder::kNobody;
}

void remove_names(std::string_view channel, const std::string& name, const Segment& stale) {
  if (auto* control = control_of(stale)) {
    // The dead producer may have died growing a slot, between creating one epoch and
    // unlinking the previous, or making its first, before the control block named it:
    // remove the neighbours too.
    auto first = epoch_base(atomic(control->incarnation).load(std::memory_order_relaxed)) + 1;
    auto slots = std::min<std::uint32_t>(atomic(control->slot_count).load(std::memory_order_relaxed), kMaxSlots);
    for (std::uint32_t s = 0; s < slots; ++s) {
      auto epoch = atomic(control->slots[s].segment_epoch).load(std::memory_order_relaxed);
      if (epoch == 0) epoch = first;
      for (auto e : {epoch - 1, epoch, epoch + 1}) {
        if (e != 0) Segment::remove_if_ours(slot_segment_name(channel, s, e));
      }
    }
  }
  Segment::remove(name);
}

}  // namespace tensorbucket::ipc

namespace tensorbucket {

void remove_channel(std::string_view channel, bool force) {
  ipc::validate_channel_name(channel);
  auto name = ipc::control_segment_name(channel);
  auto stale = ipc::Segment::open(name, 0, true, ipc::Locks::kKept);
  if (!stale) text::fail(ErrorCode::ChannelMissing, "channel ", text::Quoted{channel}, " does not exist");
  if (force) return ipc::remove_names(channel, name, *stale);
  switch (ipc::remove_if_dead(channel, name, *stale)) {
    case ipc::Holder::kNobody: return;
    case ipc::Holder::kRemover:
      text::fail(ErrorCode::ChannelExists, "channel ", text::Quoted{channel}, " is being removed by another process");
    case ipc::Holder::kProducer:
      text::fail(ErrorCode::ChannelExists, "channel ", text::Quoted{channel},
                 " has a live producer; stop it (or --force, see tbucket rm --help)");
  }
}

}  // namespace tensorbucket
