// Job authentication between ranks: every connection of a job proves that both ends know the
// job token (CARAVAN_JOB_TOKEN, comm/world.h) before any training message travels on it.
//
// The rendezvous store refuses a process without the token (tcp_store.h: a challenge-response
// in both directions, so neither the token nor a replayable proof travels, and a process that
// took the master's port learns nothing), so a stranger cannot learn where the ranks listen. Gloo's own connections carry no credential, though: a
// process that connected to a rank's listening port while the job wired up could take a
// peer's place. authenticatePeers() closes that gap: over every pair of ranks each side sends
// a fresh 16-byte nonce, then HMAC-SHA256(token, "caravan-peer" | the nonce it received |
// sender rank | receiver rank); the receiver checks it against its own nonce. The token never
// travels, and a proof cannot be replayed to another rank or job.
//
// Threading: a collective over `comm`; the caller's thread only.
#pragma once

#include <cstddef>
#include <string>

#include "comm/communicator.h"

namespace caravan {

// Fills `out` with `n` bytes from the kernel's random source (IoError when it fails).
void randomBytes(void* out, size_t n);
std::string randomBytes(size_t n);

// HMAC-SHA256(key, message): 32 raw bytes.
std::string hmacSha256(const std::string& key, const std::string& message);

// Equal secrets, compared in a time that does not depend on where they differ.
bool sameSecret(const std::string& a, const std::string& b);

// Every rank of `comm` proves the token to every other. PeerError naming the rank whose proof
// is wrong (a process outside the job, or one started with another token).
void authenticatePeers(Communicator& comm, const std::string& token);

}  // namespace caravan
