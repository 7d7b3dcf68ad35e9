// Job authentication between ranks (see auth.h).
#include "comm/auth.h"

#include <sys/random.h>

#include <cerrno>
#include <cstring>
#include <vector>

#include <fmt/format.h>
#include <openssl/crypto.h>
#include <openssl/evp.h>
#include <openssl/hmac.h>

#include "comm/world.h"
#include "core/errors.h"

namespace caravan {
namespace {

constexpr int kTagNonce = 901;
constexpr int kTagProof = 902;
constexpr size_t kNonceBytes = 16;
constexpr size_t kProofBytes = 32;  // SHA-256

// HMAC-SHA256(token, "caravan-peer" | nonce | from | to).
std::vector<uint8_t> proof(const std::string& token, const uint8_t* nonce, int from, int to) {
  std::string message = "caravan-peer";
  message.append(reinterpret_cast<const char*>(nonce), kNonceBytes);
  message += fmt::format("|{}|{}", from, to);
  const std::string mac = hmacSha256(token, message);
  return std::vector<uint8_t>(mac.begin(), mac.end());
}

at::Tensor bytesTensor(const std::vector<uint8_t>& bytes) {
  at::Tensor t = at::empty({static_cast<int64_t>(bytes.size())}, at::kByte);
  std::memcpy(t.data_ptr<uint8_t>(), bytes.data(), bytes.size());
  return t;
}

}  // namespace

std::string hmacSha256(const std::string& key, const std::string& message) {
  unsigned char out[EVP_MAX_MD_SIZE];
  unsigned int length = 0;
  const unsigned char* ok =
      HMAC(EVP_sha256(), key.data(), static_cast<int>(key.size()),
           reinterpret_cast<const unsigned char*>(message.data()), message.size(), out, &length);
  CARAVAN_CHECK(ok != nullptr && length == kProofBytes, "HMAC-SHA256 failed");
  return std::string(reinterpret_cast<const char*>(out), length);
}

bool sameSecret(const std::string& a, const std::string& b) {
  return a.size() == b.size() && CRYPTO_memcmp(a.data(), b.data(), a.size()) == 0;
}

std::string randomBytes(size_t n) {
  std::string out(n, '\0');
  randomBytes(out.data(), n);
  return out;
}

void randomBytes(void* out, size_t n) {
  size_t got = 0;
  while (got < n) {
    const ssize_t r = ::getrandom(static_cast<char*>(out) + got, n - got, 0);
    if (r < 0 && errno == EINTR) continue;
    if (r <= 0) {
      throw IoError(fmt::format("cannot read the kernel's random source: {}",
                                std::strerror(errno)));
    }
    got += static_cast<size_t>(r);
  }
}

void authenticatePeers(Communicator& comm, const std::string& token) {
  const int me = comm.rank(), size = comm.size();
  if (size < 2) return;
  // Round 1: a fresh nonce to every other rank.
  std::vector<at::Tensor> mine(size), theirs(size);
  std::vector<WorkPtr> work;
  for (int r = 0; r < size; ++r) {
    if (r == me) continue;
    std::vector<uint8_t> nonce(kNonceBytes);
    randomBytes(nonce.data(), nonce.size());
    mine[r] = bytesTensor(nonce);
    theirs[r] = at::empty({static_cast<int64_t>(kNonceBytes)}, at::kByte);
    work.push_back(comm.recv(theirs[r], r, kTagNonce));
    work.push_back(comm.send(mine[r], r, kTagNonce));
  }
  for (auto& w : work) w->wait(comm.timeout());
  work.clear();
  // Round 2: the proof for the nonce each rank sent.
  std::vector<at::Tensor> sent(size), received(size);
  for (int r = 0; r < size; ++r) {
    if (r == me) continue;
    sent[r] = bytesTensor(proof(token, theirs[r].data_ptr<uint8_t>(), me, r));
    received[r] = at::empty({static_cast<int64_t>(kProofBytes)}, at::kByte);
    work.push_back(comm.recv(received[r], r, kTagProof));
    work.push_back(comm.send(sent[r], r, kTagProof));
  }
  for (auto& w : work) w->wait(comm.timeout());
  for (int r = 0; r < size; ++r) {
    if (r == me) continue;
    const std::vector<uint8_t> expected = proof(token, mine[r].data_ptr<uint8_t>(), r, me);
    if (CRYPTO_memcmp(expected.data(), received[r].data_ptr<uint8_t>(), kProofBytes) != 0) {
      throw PeerError(fmt::format(
          "rank {}'s connection to rank {} did not prove the job token: a process outside the "
          "job took its place, or the ranks were started with different {} values; start every "
          "rank with the same token",
          r, me, kJobTokenVariable));
    }
  }
}

}  // namespace caravan
