#include "tensorbucket/torch.hpp"

#include <ATen/EmptyTensor.h>
#include <ATen/MemoryOverlap.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <cstring>
#include <sstream>

#include "base/text.hpp"

namespace tensorbucket::torch_bridge {

using text::fail;
using text::Quoted;

namespace {

struct Pair {
  DType dtype;
  at::ScalarType type;
};

// Every manifest dtype has a torch dtype (torch 2.3 added the unsigned ones). F8_E4M3 is
// safetensors' name for float8_e4m3fn. Torch dtypes not here (complex, quantized, the fnuz and
// e8m0 float8 variants, float4, sub-byte integers) have no manifest dtype and are refused.
constexpr Pair kPairs[] = {
    {DType::BOOL, at::kBool},      {DType::U8, at::kByte},         {DType::I8, at::kChar},
    {DType::I16, at::kShort},      {DType::U16, at::kUInt16},      {DType::I32, at::kInt},
    {DType::U32, at::kUInt32},     {DType::I64, at::kLong},        {DType::U64, at::kUInt64},
    {DType::F16, at::kHalf},       {DType::BF16, at::kBFloat16},   {DType::F32, at::kFloat},
    {DType::F64, at::kDouble},     {DType::F8_E4M3, at::kFloat8_e4m3fn},
    {DType::F8_E5M2, at::kFloat8_e5m2},
};
static_assert(std::size(kPairs) == kDTypeCount, "a manifest dtype without a torch dtype");

// kPairs by manifest dtype, for what runs once per tensor (the check of every step, each view):
// searching kPairs took a fifth of the check. Undefined where torch has no such dtype.
constexpr auto kScalarTypes = [] {
  std::array<at::ScalarType, kDTypeCount> out{};
  out.fill(at::ScalarType::Undefined);
  for (const auto& pair : kPairs) out[static_cast<std::size_t>(pair.dtype)] = pair.type;
  return out;
}();

// The torch dtype of a manifest dtype; Undefined where torch has none.
at::ScalarType torch_type(DType dtype) {
  auto index = static_cast<std::size_t>(dtype);
  return index < kScalarTypes.size() ? kScalarTypes[index] : at::ScalarType::Undefined;
}

at::Device device_of(PayloadLocation where) {
  static const at::Device host(at::kCPU);  // made once: a Device validates what it is made of
  return where.on_host() ? host : at::Device(at::kCUDA, static_cast<c10::DeviceIndex>(where.device));
}

Shape shape_of(const at::Tensor& tensor) {
  auto sizes = tensor.sizes();
  return Shape(std::span<const std::int64_t>(sizes.data(), sizes.size()));
}

// Whether a tensor reaches past the end of its storage: one whose storage was shrunk under it
// (untyped_storage().resize_(n), as FSDP frees a parameter's) would have a copy read or write
// past the allocation. Nothing to check without a storage, with symbolic sizes, or for a
// wrapper subclass (__torch_dispatch__ over a storage without memory: its bytes come through
// copy_, and its sizes and strides may come from Python).
bool storage_short(const at::Tensor& tensor) {
  const auto& impl = *tensor.unsafeGetTensorImpl();
  const auto& storage = impl.unsafe_storage();
  if (!storage || impl.has_symbolic_sizes_strides() || (impl.is_python_dispatch() && storage.data() == nullptr)) {
    return false;
  }
  if (impl.numel() == 0) return false;
  auto holds = storage.unsafeGetStorageImpl()->sym_nbytes().maybe_as_int();
  if (!holds) return false;
  auto itemsize = impl.itemsize();
  auto offset = static_cast<std::size_t>(impl.storage_offset());
  auto reach = impl.is_contiguous() ? (offset + static_cast<std::size_t>(impl.numel())) * itemsize
                                    : at::detail::computeStorageNbytes(impl.sizes(), impl.strides(), itemsize, offset);
  return reach > static_cast<std::size_t>(*holds);
}

// The key sets of a plain dense CPU tensor, made with inference mode off and on: from this
// torch's own constructor rather than spelled out, since which keys a tensor carries moves
// between torch versions.
const std::array<c10::DispatchKeySet, 2>& plain_cpu_keys() {
  static const std::array<c10::DispatchKeySet, 2> keys = [] {
    std::array<c10::DispatchKeySet, 2> out;
    for (bool inference : {false, true}) {
      c10::InferenceMode mode(inference);
      out[inference ? 1 : 0] = at::detail::empty_cpu({0}, at::kByte).key_set();
    }
    return out;
  }();
  return keys;
}

// The bytes of `tensor` when it is a plain CPU tensor that fits `entry` (its dtype and shape,
// contiguous, within its storage), judged from its fields without a call in the common case:
// the hot loops ask it of every tensor on every step (~0.1 of a Python publish of 1000 x 1 KiB
// went to the general checks). Null for anything else: a key set beyond a plain CPU tensor's
// (another device, a subclass with __torch_dispatch__, lazy negation or conjugation,
// quantized, sparse, nested, functionalized), another dtype or shape, not contiguous, short of
// its storage, no bytes. fits() and plain_bytes() then judge it, as before.
const void* plain_host_bytes(const at::Tensor& tensor, const ManifestEntry& entry) {
  const auto& impl = *tensor.unsafeGetTensorImpl();
  const auto& plain = plain_cpu_keys();
  if ((impl.key_set() != plain[0] && impl.key_set() != plain[1]) || impl.has_symbolic_sizes_strides()) return nullptr;
  auto type = torch_type(entry.dtype);
  if (type == at::ScalarType::Undefined || impl.dtype() != caffe2::TypeMeta::fromScalarType(type)) return nullptr;
  auto sizes = impl.sizes();
  if (sizes.size() != entry.shape.size()) return nullptr;
  for (std::size_t d = 0; d < sizes.size(); ++d) {
    if (sizes[d] != entry.shape[d]) return nullptr;
  }
  if (!impl.is_contiguous()) return nullptr;
  const auto& storage = impl.unsafe_storage();
  if (!storage) return nullptr;
  auto holds = storage.unsafeGetStorageImpl()->sym_nbytes().maybe_as_int();
  auto offset = impl.storage_offset();
  if (!holds || offset > *holds) return nullptr;  // (and the product below cannot wrap)
  // The shape and dtype are the entry's, so its bytes are entry.byte_length.
  auto start = static_cast<std::uint64_t>(offset) * impl.dtype().itemsize();
  if (start + entry.byte_length > static_cast<std::uint64_t>(*holds)) return nullptr;
  const auto* data = static_cast<const char*>(storage.data());
  return data == nullptr ? nullptr : data + start;
}

// The refusals of the header, in one place for both publishing paths. `where`: the channel's
// payload location, where every tensor must be.
void check_sendable(const std::string& name, const at::Tensor& tensor, PayloadLocation where) {
  if (!tensor.defined()) {
    fail(ErrorCode::Unmaterialized, "entry ", Quoted{name}, " is an undefined tensor and has no data");
  }
  if (tensor.is_meta()) {
    fail(ErrorCode::Unmaterialized, "entry ", Quoted{name}, " is a meta tensor and has no data");
  }
  if (tensor.is_quantized()) {
    fail(ErrorCode::UnsupportedDtype, "entry ", Quoted{name}, " is quantized (",
         c10::toString(tensor.scalar_type()), "); send its int representation and scales as a group");
  }
  if (tensor.layout() != at::kStrided) {
    fail(ErrorCode::InvalidArgument, "entry ", Quoted{name}, " has layout ", tensor.layout(),
         "; only strided (dense) tensors can be sent");
  }
  if (tensor.is_nested()) {
    fail(ErrorCode::InvalidArgument, "entry ", Quoted{name},
         " is a nested tensor, which has no one shape; send each of its tensors as an entry");
  }
  if (tensor.device() != device_of(where)) {
    fail(ErrorCode::InvalidArgument, "entry ", Quoted{name}, " is on ", tensor.device().str(), "; the channel's payloads live ",
         where.on_host() ? std::string("in host memory: it sends CPU tensors")
                         : text::message("on ", where.to_string(), ", where its tensors must be"));
  }
  dtype_of(tensor.scalar_type(), name);
  if (storage_short(tensor)) {
    fail(ErrorCode::InvalidArgument, "entry ", Quoted{name}, " (", c10::toString(tensor.scalar_type()), ' ',
         text::Dims{shape_of(tensor)}, ") reaches past the end of its storage, which holds ",
         tensor.storage().nbytes(), " bytes: was the storage resized under it?");
  }
}

void add_groups(BucketBuilder& builder, const std::vector<ManifestGroup>& groups) {
  for (const auto& group : groups) builder.group(group.name, group.members);
}

// Whether a tensor's bytes, read straight from data_ptr(), are its values in row-major order.
// Lazy negation and conjugation leave the stored bytes unresolved.
bool plain_bytes(const at::Tensor& tensor) {
  return tensor.is_contiguous() && !tensor.is_neg() && !tensor.is_conj();
}

// Where a plain tensor's bytes start, as data_ptr() says, without its checks: they took half as
// long as all of fits() (has_storage() is a virtual call). Null for a tensor without storage or
// with storage that holds no memory (a __torch_dispatch__ wrapper subclass), which copy_ then
// reads, or says why it cannot.
const void* storage_bytes(const at::Tensor& tensor) {
  const auto& impl = *tensor.unsafeGetTensorImpl();
  const auto& storage = impl.unsafe_storage();
  const auto* data = storage ? static_cast<const char*>(storage.data()) : nullptr;
  return data == nullptr ? nullptr : data + impl.itemsize() * impl.storage_offset();
}

// A tensor's bytes when they are its values in CPU memory, readable as they are; else null.
const void* dense_bytes(const at::Tensor& tensor) {
  bool dense = tensor.is_cpu() && tensor.layout() == at::kStrided && plain_bytes(tensor);
  return dense ? storage_bytes(tensor) : nullptr;
}

// Whether a target can take a memmove and a version bump instead of copy_: dense, and no
// __torch_dispatch__ (which would not see the write).
bool takes_bytes(const at::Tensor& target) {
  return dense_bytes(target) != nullptr && !target.unsafeGetTensorImpl()->is_python_dispatch();
}

// Writes `bytes`, the row-major values of a tensor of target's dtype and shape, into target,
// and bumps its version as copy_ does (so autograd still sees the change): copy_'s dispatch
// took ~0.4 us a tensor, most of loading 1000 small ones. Inference targets are refused
// beforehand outside InferenceMode, so the bump cannot throw halfway. The caller checked
// takes_bytes(target).
void write_bytes(const at::Tensor& target, const void* bytes) {
  std::memmove(const_cast<void*>(storage_bytes(target)), bytes, target.nbytes());  // may alias
  target.unsafeGetTensorImpl()->bump_version();
}

// target.copy_(source) for two tensors of one dtype and shape.
void copy_into(const at::Tensor& target, const at::Tensor& source) {
  const auto* bytes = dense_bytes(source);
  if (bytes != nullptr && takes_bytes(target)) {
    write_bytes(target, bytes);
  } else {
    target.copy_(source);
  }
}

// Whether tensors[i] has the name, dtype and shape of targets[i], for every i: what a server
// receives for its own model, which then needs neither manifests nor an index by name to load.
// UnsupportedDtype as manifest_of() for a target.
bool lined_up(const NamedTensors& targets, const NamedTensors& tensors) {
  if (targets.size() != tensors.size()) return false;
  for (std::size_t i = 0; i < targets.size(); ++i) {
    const auto& [name, target] = targets[i];
    dtype_of(target.scalar_type(), name);
    if (tensors[i].first != name || tensors[i].second.scalar_type() != target.scalar_type() ||
        tensors[i].second.sizes() != target.sizes()) {
      return false;
    }
  }
  return true;
}

// The same for a bucket's entries.
bool lined_up(const NamedTensors& targets, const Manifest& manifest) {
  const auto& entries = manifest.entries;
  if (targets.size() != entries.size()) return false;
  for (std::size_t i = 0; i < targets.size(); ++i) {
    const auto& [name, target] = targets[i];
    if (entries[i].name != name || entries[i].dtype != dtype_of(target.scalar_type(), name) ||
        target.sizes() != c10::IntArrayRef(entries[i].shape)) {
      return false;
    }
  }
  return true;
}

void let_go(void* hold);

// Whether a tensor is a view of a received bucket (view_of() with a hold): read-only shared
// memory, where a write kills the process.
bool is_received_view(const at::Tensor& tensor) {
  const auto& storage = tensor.unsafeGetTensorImpl()->unsafe_storage();
  return storage && storage.data_ptr().get_deleter() == &let_go;
}

// Whether some elements of a tensor share memory (an expand(), a stride of 0): copy_ into one
// throws, after the targets before it were loaded.
bool overlaps_itself(const at::Tensor& tensor) {
  try {
    return at::has_internal_overlap(tensor) == at::MemOverlap::Yes;
  } catch (...) {
    return false;  // a subclass's strides may come from Python: copy_ then judges
  }
}

// Refuses, naming them all, targets that cannot be loaded: copy_ into a meta tensor does
// nothing (a module built on the meta device would seem loaded and still hold nothing); into
// an inference tensor outside InferenceMode, or one whose elements overlap, it throws, which
// would leave the module half loaded; into a received bucket's view it kills the process.
void check_targets(const NamedTensors& targets) {
  text::Listing empty, inference, short_storage, overlapping, received;
  for (const auto& [name, target] : targets) {
    if (!target.defined() || target.is_meta()) {
      empty.add(Quoted{name});
    } else if (target.is_inference() && !c10::InferenceMode::is_enabled()) {
      inference.add(Quoted{name});
    } else if (storage_short(target)) {
      short_storage.add(Quoted{name});
    } else if (is_received_view(target)) {
      received.add(Quoted{name});
    } else if (overlaps_itself(target)) {
      overlapping.add(Quoted{name});
    }
  }
  text::fail_if_listed(ErrorCode::Unmaterialized, "cannot load into meta or undefined tensors",
                       {{"tensors", &empty}}, "; they have no memory: materialize the module first");
  text::fail_if_listed(ErrorCode::InvalidArgument, "cannot load into inference tensors outside inference mode",
                       {{"tensors", &inference}}, "; load under torch.inference_mode(), or build the module outside it");
  text::fail_if_listed(ErrorCode::InvalidArgument, "cannot load into tensors that reach past the end of their storage",
                       {{"tensors", &short_storage}}, "; was their storage resized under them (freed)?");
  text::fail_if_listed(ErrorCode::InvalidArgument, "cannot load into views of a received bucket",
                       {{"tensors", &received}}, "; they are read-only shared memory: load into tensors of your own");
  text::fail_if_listed(ErrorCode::InvalidArgument, "cannot load into tensors whose elements share memory",
                       {{"tensors", &overlapping}}, " (an expand(), a stride of 0): each would take several values");
}

// The check pass chases pointers through each tensor's TensorImpl and StorageImpl, and 1000
// tensors' metadata does not stay in cache while their bytes stream past: it asks for the
// lines of tensor i + kAhead (its TensorImpl), and of i + kAhead / 2 (its StorageImpl, whose
// address is in the TensorImpl asked for before), while it checks tensor i.
constexpr std::size_t kAhead = 16;

void prefetch_impl(const at::Tensor& tensor) {
  const auto* impl = reinterpret_cast<const char*>(tensor.unsafeGetTensorImpl());
  for (std::size_t line = 0; line < sizeof(c10::TensorImpl); line += 64) __builtin_prefetch(impl + line);
}

void prefetch_storage(const at::Tensor& tensor) {
  __builtin_prefetch(tensor.unsafeGetTensorImpl()->unsafe_storage().unsafeGetStorageImpl());
}

}  // namespace

// What the views of one bucket hold on to: the bucket (and its lease) until the last of them,
// and whoever makes them, let go. Counted by hand, as a view's storage holds a plain pointer:
// each view adds one rather than allocating a hold of its own.
struct SharedHold {
  std::atomic<std::size_t> count{1};  // its maker's
  std::shared_ptr<const void> bucket;
};

namespace {

void let_go(void* hold) {
  auto* shared = static_cast<SharedHold*>(hold);
  if (shared->count.fetch_sub(1, std::memory_order_acq_rel) == 1) delete shared;
}

// A tensor over `bytes` of `entry` on `device`, holding `hold` (when not null) until its
// storage dies. Built from its parts rather than through from_blob, which costs ~2x as much
// per tensor (a std::function deleter, a sizes vector, a device guard): a bucket may hold 1000
// entries.
at::Tensor view_of(const ManifestEntry& entry, std::span<const std::byte> bytes, SharedHold* hold,
                   at::Device device = at::kCPU) {
  auto type = scalar_type_of(entry.dtype, entry.name);
  // The memory is the producer's and read-only (header); DataPtr wants a mutable pointer.
  auto* data = const_cast<std::byte*>(bytes.data());
  if (hold != nullptr) hold->count.fetch_add(1, std::memory_order_relaxed);  // the DataPtr lets go, whatever throws
  auto data_ptr = hold != nullptr ? c10::DataPtr(data, hold, &let_go, device) : c10::DataPtr(data, device);
  c10::Storage storage(c10::Storage::use_byte_size_t(), bytes.size(), std::move(data_ptr),
                       /*allocator=*/nullptr, /*resizable=*/false);
  auto key = device.is_cuda() ? c10::DispatchKey::CUDA : c10::DispatchKey::CPU;
  auto tensor = at::detail::make_tensor<c10::TensorImpl>(std::move(storage), c10::DispatchKeySet(key),
                                                         c10::scalarTypeToTypeMeta(type));
  tensor.unsafeGetTensorImpl()->set_sizes_contiguous(
      c10::IntArrayRef(entry.shape.data(), entry.shape.size()));
  return tensor;
}

// copy_into() from a bucket's entry, with a view made only for a target that needs copy_.
void copy_into(const at::Tensor& target, const ManifestEntry& entry, std::span<const std::byte> bytes) {
  if (takes_bytes(target)) {
    write_bytes(target, bytes.data());
  } else {
    target.copy_(view_of(entry, bytes, nullptr));
  }
}

NamedTensors views_of(const BucketView& view, SharedHold* hold) {
  NamedTensors out;
  out.reserve(view.size());
  auto device = device_of(view.location());
  for (std::size_t i = 0; i < view.size(); ++i) {
    const auto& entry = view.manifest().entries[i];
    out.emplace_back(entry.name, view_of(entry, view[i].bytes, hold, device));
  }
  return out;
}

// Loads a device bucket's entries into `targets` (matched to `entries` by index): the targets
// that take bytes (dense, on the bucket's device) by one batched copy on `stream`, the others
// by copy_ from a view.
void load_on_device(const NamedTensors& targets, const BucketView& bucket, const std::vector<std::size_t>& entries,
                    CudaStream stream) {
  auto device = device_of(bucket.location());
  std::vector<CudaCopy> copies;
  copies.reserve(targets.size());
  for (std::size_t t = 0; t < targets.size(); ++t) {
    const auto& target = targets[t].second;
    auto i = entries[t];
    auto bytes = bucket[i].bytes;
    bool takes = target.device() == device && target.layout() == at::kStrided && plain_bytes(target) &&
                 !target.unsafeGetTensorImpl()->is_python_dispatch() && storage_bytes(target) != nullptr;
    if (!takes) {
      target.copy_(view_of(bucket.manifest().entries[i], bytes, nullptr, device));
    } else if (!bytes.empty()) {
      copies.push_back({const_cast<void*>(storage_bytes(target)), bytes.data(), bytes.size()});
      target.unsafeGetTensorImpl()->bump_version();
    }
  }
  copy_on_device(bucket.location().device, copies, stream);
}

}  // namespace

DType dtype_of(at::ScalarType type, const std::string& entry) {
  for (const auto& pair : kPairs) {
    if (pair.type == type) return pair.dtype;
  }
  // Named as Python and C++ write it: torch.complex64 is ComplexFloat.
  fail(ErrorCode::UnsupportedDtype, "entry ", Quoted{entry}, " has dtype torch.",
       std::string(c10::getDtypeNames(type).first), " (", c10::toString(type),
       "), which has no manifest dtype");
}

at::ScalarType scalar_type_of(DType dtype, const std::string& entry) {
  auto type = torch_type(dtype);
  if (type != at::ScalarType::Undefined) return type;
  fail(ErrorCode::UnsupportedDtype, "entry ", Quoted{entry}, " has dtype ", dtype_name(dtype),
       ", which torch ", TORCH_VERSION, " cannot represent");
}

NamedTensors named_tensors(const torch::nn::Module& module) {
  NamedTensors out;
  for (const auto& item : module.named_parameters(true)) out.emplace_back(item.key(), item.value());
  for (const auto& item : module.named_buffers(true)) out.emplace_back(item.key(), item.value());
  return out;
}

TorchBucket make_bucket(const NamedTensors& tensors, std::uint64_t version,
                        std::uint32_t bucket_index, std::uint32_t bucket_count,
                        const std::vector<ManifestGroup>& groups, PayloadLocation where) {
  TorchBucket bucket;
  bucket.builder.version(version).bucket(bucket_index, bucket_count);
  for (const auto& [name, tensor] : tensors) check_sendable(name, tensor, where);
  bucket.storage.reserve(tensors.size());
  // By value, row-major: only bytes are read, so a contiguous tensor (requires_grad or not) is
  // used as it is; others are copied once, outside autograd.
  at::NoGradGuard no_grad;
  for (const auto& [name, tensor] : tensors) {
    auto& stored = bucket.storage.emplace_back(
        plain_bytes(tensor) ? tensor : tensor.resolve_conj().resolve_neg().contiguous());
    bucket.builder.add(name, dtype_of(stored.scalar_type(), name), shape_of(stored),
                       stored.numel() == 0 ? nullptr : stored.data_ptr());
  }
  add_groups(bucket.builder, groups);
  return bucket;
}

BucketBuilder layout_of(const NamedTensors& tensors, std::uint64_t version,
                        std::uint32_t bucket_index, std::uint32_t bucket_count,
                        const std::vector<ManifestGroup>& groups, PayloadLocation where) {
  BucketBuilder layout;
  layout.version(version).bucket(bucket_index, bucket_count);
  for (const auto& [name, tensor] : tensors) {
    check_sendable(name, tensor, where);
    layout.declare(name, dtype_of(tensor.scalar_type(), name), shape_of(tensor));
  }
  add_groups(layout, groups);
  return layout;
}

bool fits(const at::Tensor& tensor, const ManifestEntry& entry, PayloadLocation where) noexcept {
  // A producer asks this of every tensor on every step: the cheap field reads first, and no
  // is_meta() (a meta tensor is on neither the CPU nor a GPU).
  if (!tensor.defined() || tensor.device() != device_of(where) || tensor.is_quantized() ||
      tensor.layout() != at::kStrided) {
    return false;
  }
  // A subclass's sizes may come from Python, and a nested tensor has none: what throws does
  // not fit, and layout_of() then says why.
  try {
    // An inline loop: std::equal becomes a memcmp call, a noticeable share of this at 1000 calls.
    auto sizes = tensor.sizes();
    if (sizes.size() != entry.shape.size()) return false;
    for (std::size_t d = 0; d < sizes.size(); ++d) {
      if (sizes[d] != entry.shape[d]) return false;
    }
    auto type = torch_type(entry.dtype);
    return type != at::ScalarType::Undefined && type == tensor.scalar_type() && !storage_short(tensor);
  } catch (...) {
    return false;
  }
}

bool StagedTensors::add(const at::Tensor& tensor, const ManifestEntry& entry, PayloadLocation where) {
  const void* bytes = where.on_host() && entry.byte_length != 0 ? plain_host_bytes(tensor, entry) : nullptr;
  std::optional<at::Tensor> made;
  if (bytes == nullptr) {
    if (!fits(tensor, entry, where)) return false;
    if (entry.byte_length != 0) bytes = plain_bytes(tensor) ? storage_bytes(tensor) : nullptr;
    if (bytes == nullptr && entry.byte_length != 0 && tensor.unsafeGetTensorImpl()->is_python_dispatch()) {
      // Its copy_ is Python code, which may throw or call back into the publisher: run now,
      // before a slot is reserved, rather than into the slot.
      at::NoGradGuard no_grad;
      made = at::empty(entry.shape, at::TensorOptions().dtype(tensor.scalar_type()).device(device_of(where)));
      made->copy_(tensor.detach());
      bytes = made->data_ptr();
    }
  }
  // Nothing staged when an allocation throws: the vectors stay one entry each.
  auto index = bytes_.size();
  auto held = holds_.size();
  auto fixed = fixed_.size();
  try {
    bytes_.push_back(bytes);
    lengths_.push_back(entry.byte_length);
    if (made) {
      made_.push_back(std::move(*made));
    } else if (bytes != nullptr && hold_ == Hold::Storages) {
      const auto& storage = tensor.unsafeGetTensorImpl()->unsafe_storage();
      holds_.push_back(storage);
      if (storage.resizable()) {
        fixed_.push_back(storage);
        storage.unsafeGetStorageImpl()->set_resizable(false);
      }
    } else if (bytes == nullptr && entry.byte_length != 0) {  // an empty tensor copies nothing
      by_value_.emplace_back(index, tensor);
    }
  } catch (...) {
    if (fixed_.size() > fixed) {
      fixed_.back().unsafeGetStorageImpl()->set_resizable(true);
      fixed_.resize(fixed);
    }
    bytes_.resize(index);
    lengths_.resize(index);
    holds_.resize(held);
    throw;
  }
  return true;
}

bool write_tensor(Reservation& reservation, std::size_t index, const at::Tensor& tensor, const ManifestEntry& entry) {
  auto spans = reservation.entry_spans();
  if (index >= spans.size() || spans[index].size() != entry.byte_length) {
    fail(ErrorCode::ManifestMismatch, "entry ", Quoted{entry.name}, " (", entry.byte_length,
         " bytes) is not entry ", index, " of the reservation, which has ", spans.size(), " entries");
  }
  auto where = reservation.location();
  if (where.on_host() && entry.byte_length != 0) {
    if (const void* bytes = plain_host_bytes(tensor, entry)) {
      reservation.write(index, bytes);
      return true;
    }
  }
  if (!fits(tensor, entry, where)) return false;
  if (entry.byte_length == 0) return true;
  if (const void* bytes = plain_bytes(tensor) ? storage_bytes(tensor) : nullptr) {
    reservation.write(index, bytes);
  } else {  // laid out row-major by copy_, as publish_in_place() does
    at::NoGradGuard no_grad;
    view_of(entry, spans[index], nullptr, device_of(where)).copy_(tensor.detach());
  }
  return true;
}

void StagedTensors::clear() noexcept {
  for (const auto& storage : fixed_) storage.unsafeGetStorageImpl()->set_resizable(true);
  fixed_.clear();
  bytes_.clear();
  lengths_.clear();
  holds_.clear();
  made_.clear();
  by_value_.clear();
}

std::optional<Reservation> write_in_place(Publisher& publisher, const BucketBuilder& layout,
                                          const StagedTensors& staged, const Deadline& deadline,
                                          CudaStream stream) {
  const auto& entries = layout.manifest().entries;
  if (staged.size() != entries.size()) {
    fail(ErrorCode::ManifestMismatch, "layout has ", entries.size(), " entries but ", staged.size(),
         " tensors were staged");
  }
  for (std::size_t i = 0; i < entries.size(); ++i) {  // the copy reads byte_length from each source
    if (staged.lengths_[i] != entries[i].byte_length) {
      fail(ErrorCode::ManifestMismatch, "the tensor staged for entry ", Quoted{entries[i].name}, " has ",
           staged.lengths_[i], " bytes where the layout has ", entries[i].byte_length, ": staged against another layout");
    }
  }
  auto reservation = publisher.reserve(layout, deadline, stream);
  if (!reservation) return std::nullopt;
  auto where = publisher.location();
  reservation->write_all(staged.bytes_);
  if (!staged.by_value_.empty()) {
    // copy_ lays out any strides row-major (and resolves lazy negation), straight into shared
    // memory.
    auto spans = reservation->entry_spans();
    auto device = device_of(where);
    at::NoGradGuard no_grad;
    for (const auto& [i, tensor] : staged.by_value_) view_of(entries[i], spans[i], nullptr, device).copy_(tensor.detach());
  }
  return reservation;
}

bool publish_in_place(Publisher& publisher, const BucketBuilder& layout, const StagedTensors& staged,
                      const Deadline& deadline, CudaStream stream) {
  auto reservation = write_in_place(publisher, layout, staged, deadline, stream);
  if (!reservation) return false;
  // Interrupted during the copy (a Ctrl+C in Python): nothing is published, as for an
  // interrupted wait; the reservation is dropped.
  if (deadline.ask()) return false;
  // This is a publish: its copying is part of the handover, as publish() stamps it.
  reservation->commit(Reservation::HandoverFrom::Reserve);
  return true;
}

bool publish_in_place(Publisher& publisher, const BucketBuilder& layout,
                      std::span<const at::Tensor> tensors, const Deadline& deadline, CudaStream stream) {
  auto where = publisher.location();
  const auto& entries = layout.manifest().entries;
  if (tensors.size() != entries.size()) {
    fail(ErrorCode::ManifestMismatch, "layout has ", entries.size(), " entries but ",
         tensors.size(), " tensors were given");
  }
  // Every tensor checked before anything is reserved.
  StagedTensors staged;
  for (std::size_t i = 0; i < tensors.size(); ++i) {
    if (i + kAhead < tensors.size()) prefetch_impl(tensors[i + kAhead]);
    if (i + kAhead / 2 < tensors.size()) prefetch_storage(tensors[i + kAhead / 2]);
    if (!staged.add(tensors[i], entries[i], where)) {
      fail(ErrorCode::ManifestMismatch, "the tensor for entry ", Quoted{entries[i].name},
           " no longer fits the layout (", entries[i].dtype, ' ', text::Dims{entries[i].shape},
           "): build a new one with layout_of()");
    }
  }
  return publish_in_place(publisher, layout, staged, deadline, stream);
}

bool publish_in_place(Publisher& publisher, const NamedTensors& tensors,
                      const Deadline& deadline, std::uint64_t version,
                      std::uint32_t bucket_index, std::uint32_t bucket_count,
                      const std::vector<ManifestGroup>& groups, CudaStream stream) {
  auto layout = layout_of(tensors, version, bucket_index, bucket_count, groups, publisher.location());
  std::vector<at::Tensor> in_order;
  in_order.reserve(tensors.size());
  for (const auto& named : tensors) in_order.push_back(named.second);
  return publish_in_place(publisher, layout, in_order, deadline, stream);
}

BucketViews::BucketViews(std::shared_ptr<const ReceivedBucket> bucket)
    : bucket_(bucket.get()), device_(device_of(bucket->view().location())), hold_(new SharedHold) {
  hold_->bucket = std::move(bucket);
}

BucketViews::~BucketViews() { let_go(hold_); }

at::Tensor BucketViews::operator[](std::size_t index) const {
  const auto& view = bucket_->view();
  return view_of(view.manifest().entries.at(index), view[index].bytes, hold_, device_);
}

NamedTensors BucketViews::all() const { return views_of(bucket_->view(), hold_); }

NamedTensors tensors(std::shared_ptr<const ReceivedBucket> bucket) { return BucketViews(std::move(bucket)).all(); }

NamedTensors tensors(const BucketView& view) { return views_of(view, nullptr); }

at::Tensor tensor(std::shared_ptr<const ReceivedBucket> bucket, std::size_t index) {
  return BucketViews(std::move(bucket))[index];
}

Manifest manifest_of(const NamedTensors& tensors) {
  Manifest manifest;
  manifest.entries.reserve(tensors.size());
  for (const auto& [name, tensor] : tensors) {
    manifest.entries.push_back({name, dtype_of(tensor.scalar_type(), name), shape_of(tensor), 0, 0, ""});
  }
  return manifest;
}

Manifest expected_manifest(const torch::nn::Module& module) { return manifest_of(named_tensors(module)); }

void load_into(const NamedTensors& targets, const NamedTensors& tensors) {
  check_targets(targets);
  for (const auto& [name, tensor] : tensors) {
    if (tensor.defined() && storage_short(tensor)) {
      fail(ErrorCode::InvalidArgument, "cannot load from tensor ", Quoted{name},
           ": it reaches past the end of its storage; was the storage resized under it (freed)?");
    }
  }
  at::NoGradGuard no_grad;
  if (lined_up(targets, tensors)) {
    for (std::size_t i = 0; i < targets.size(); ++i) copy_into(targets[i].second, tensors[i].second);
    return;
  }
  check_expected(manifest_of(tensors), manifest_of(targets));  // throws before anything is copied
  std::unordered_map<std::string_view, const at::Tensor*> by_name;
  for (const auto& [name, tensor] : tensors) by_name.emplace(name, &tensor);
  for (const auto& [name, target] : targets) copy_into(target, *by_name.at(name));
}

namespace {

// Loads `bucket` into exactly `targets` (checked by the caller).
void load_whole(const NamedTensors& targets, const BucketView& bucket, CudaStream stream) {
  const auto& manifest = bucket.manifest();
  at::NoGradGuard no_grad;
  if (!bucket.location().on_host()) {
    std::vector<std::size_t> entries(targets.size());
    if (lined_up(targets, manifest)) {
      for (std::size_t t = 0; t < targets.size(); ++t) entries[t] = t;
    } else {
      check_expected(manifest, manifest_of(targets));  // throws before anything is copied
      for (std::size_t t = 0; t < targets.size(); ++t) entries[t] = *bucket.position(targets[t].first);
    }
    load_on_device(targets, bucket, entries, stream);
    return;
  }
  if (lined_up(targets, manifest)) {
    for (std::size_t i = 0; i < targets.size(); ++i) {
      copy_into(targets[i].second, manifest.entries[i], bucket[i].bytes);
    }
    return;
  }
  check_expected(manifest, manifest_of(targets));  // throws before anything is copied
  for (const auto& [name, target] : targets) {
    auto i = *bucket.position(name);
    copy_into(target, manifest.entries[i], bucket[i].bytes);
  }
}


// The targets one bucket of a split update loads: those its entries name, in their order.
NamedTensors named_in(const NamedTensors& targets, const BucketView& bucket) {
  NamedTensors part;
  for (const auto& target : targets) {
    if (bucket.position(target.first)) part.push_back(target);
  }
  return part;
}

}  // namespace

void load_into(const NamedTensors& targets, const BucketView& bucket, CudaStream stream) {
  check_targets(targets);
  if (bucket.bucket_count() == 1) return load_whole(targets, bucket, stream);
  load_whole(named_in(targets, bucket), bucket, stream);
}

void load_into(const NamedTensors& targets, const ReceivedUpdate& update, CudaStream stream) {
  check_targets(targets);
  // Everything checked before anything is copied: the buckets together against the targets.
  check_expected(update.manifest(), manifest_of(targets));
  if (update.buckets().size() == 1) return load_whole(targets, update.buckets().front().view(), stream);
  for (const auto& bucket : update.buckets()) load_whole(named_in(targets, bucket.view()), bucket.view(), stream);
}

void load_into(torch::nn::Module& module, const NamedTensors& tensors) {
  load_into(named_tensors(module), tensors);
}
void load_into(torch::nn::Module& module, const BucketView& bucket, CudaStream stream) {
  load_into(named_tensors(module), bucket, stream);
}
void load_into(torch::nn::Module& module, const ReceivedUpdate& update, CudaStream stream) {
  load_into(named_tensors(module), update, stream);
}

}  // namespace tensorbucket::torch_bridge
