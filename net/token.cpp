// The shared token and the proofs made with it.
#include <fcntl.h>
#include <openssl/crypto.h>
#include <openssl/evp.h>
#include <openssl/hmac.h>
#include <sys/random.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <string>

#include "base/text.hpp"
#include "tensorbucket/error.hpp"
#include "tensorbucket/net.hpp"
#include "door.hpp"

namespace tensorbucket::net {

using text::fail;
using text::Quoted;

std::string read_token_file(const std::string& path) {
  constexpr std::size_t kMin = 16, kMax = 4096;
  auto denied = [&](const auto&... why) { fail(ErrorCode::PermissionDenied, "token file ", Quoted{path}, ' ', why...); };
  int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NOFOLLOW | O_NONBLOCK);
  if (fd < 0 && (errno == ENOENT || errno == ENOTDIR)) {  // a wrong path, not a permission
    fail(ErrorCode::InvalidArgument, "token file ", Quoted{path}, " does not exist");
  }
  if (fd < 0) denied("cannot be opened: ", std::strerror(errno));
  struct Closer {
    int fd;
    ~Closer() { ::close(fd); }
  } closer{fd};
  struct stat info {};
  if (::fstat(fd, &info) != 0) denied("cannot be read: ", std::strerror(errno));
  if (!S_ISREG(info.st_mode)) denied("is not a regular file");
  if (info.st_uid != ::geteuid()) denied("belongs to uid ", info.st_uid, ", not to us");
  if ((info.st_mode & 077) != 0) {
    char mode[8];
    std::snprintf(mode, sizeof mode, "%04o", static_cast<unsigned>(info.st_mode & 07777));
    denied("has mode ", mode, ": group and others must have no access (chmod 600)");
  }
  std::string token(kMax + 1, '\0');
  std::size_t size = 0;
  while (size < token.size()) {
    auto got = ::read(fd, token.data() + size, token.size() - size);
    if (got < 0 && errno == EINTR) continue;
    if (got < 0) denied("cannot be read: ", std::strerror(errno));
    if (got == 0) break;
    size += static_cast<std::size_t>(got);
  }
  token.resize(size);
  if (token.ends_with('\n')) token.pop_back();
  if (token.size() < kMin || token.size() > kMax) {
    fail(ErrorCode::InvalidArgument, "token file ", Quoted{path}, " holds ", token.size(), " bytes; a token has ", kMin,
         " to ", kMax);
  }
  return token;
}

namespace detail {

void random_bytes(void* into, std::size_t size) {
  auto* bytes = static_cast<std::uint8_t*>(into);
  while (size > 0) {
    auto got = ::getrandom(bytes, size, 0);
    if (got < 0 && errno == EINTR) continue;
    if (got < 0) fail(ErrorCode::SystemError, "getrandom: ", std::strerror(errno));
    bytes += got;
    size -= static_cast<std::size_t>(got);
  }
}

namespace {

Digest proof(std::string_view label, std::string_view token, const Nonce& nonce, std::uint64_t key) {
  std::string message(label);
  message.append(reinterpret_cast<const char*>(nonce.data()), nonce.size());
  message.append(reinterpret_cast<const char*>(&key), sizeof key);
  Digest digest{};
  unsigned length = 0;
  if (HMAC(EVP_sha256(), token.data(), static_cast<int>(token.size()),
           reinterpret_cast<const unsigned char*>(message.data()), message.size(), digest.data(), &length) == nullptr ||
      length != digest.size()) {
    throw Error(ErrorCode::SystemError, "HMAC-SHA256 failed");
  }
  return digest;
}

}  // namespace

Digest client_proof(std::string_view token, const Nonce& server_nonce, std::uint64_t key) {
  return proof("tensorbucket peer proof", token, server_nonce, key);
}

Digest server_proof(std::string_view token, const Nonce& peer_nonce, std::uint64_t key) {
  return proof("tensorbucket server proof", token, peer_nonce, key);
}

bool same_digest(const Digest& a, const Digest& b) noexcept { return CRYPTO_memcmp(a.data(), b.data(), a.size()) == 0; }

}  // namespace detail
}  // namespace tensorbucket::net
