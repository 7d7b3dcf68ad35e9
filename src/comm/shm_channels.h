// ShmChannels: point-to-point send/recv between the ranks of one host, through rings in a
// ShmCommunicator's shared-memory segment (shm_communicator.h makes the segment and calls this).
//
// Every ordered pair of ranks (src, dst), src == dst too, has one ring: a byte stream of
// `ringBytes` bytes that src writes and dst reads, with a head (bytes written) and a tail (bytes
// read) on their own cache lines. A message is a 16-byte header (tag, bytes) and its payload,
// padded to 16 bytes so that a header never wraps; a payload larger than the ring streams
// through it. Each rank has one progress thread (started at its first send or recv) that writes
// its queued sends (per destination, in issue order) and reads every ring into this rank: a
// message goes straight into the oldest recv posted for its (src, tag), or into a buffer that a
// later recv of that (src, tag) takes. So messages of one (src, tag) arrive in the order sent,
// and a rank may post its recvs in another order than the sends were issued across tags (as
// with Gloo). A send the ring has room for is written by the caller at issue (no hand-off), and
// a thread waiting for a Work moves bytes itself while they move and for 200 us after (no
// wake-up of the waiter by the progress thread). Writers publish the head, readers the tail, at
// least every 64 KiB, so a large message is read while it is being written. Messages that
// arrive before their recv are buffered without a bound.
//
// Doorbells: each rank has a futex word in the segment. Whoever writes into a ring rings its
// reader's; whoever reads rings the writer's (room was made); a local send/recv rings its own
// rank's. A progress thread with nothing to move sleeps on its own word.
//
// Completion: a send completes when its last byte is in the ring (its receiver may not have read
// it yet: a message outlives the sender's communicator); a recv when the payload is in its
// tensor. A recv whose tensor has another size than the message is a bug in the caller
// (final, like a peer failure: the stream's framing would be lost otherwise).
//
// Failures (PeerError, final for the whole communicator: ShmFailure, communicator.h): a
// pending operation fails when its peer's process exited or the peer closed its communicator
// (a recv once the peer's ring is drained, so a message sent before exiting still arrives), when
// the peer gave up (the segment's failure word), and when a wait times out; the progress thread
// checks every 20 ms while anything is pending. Every later operation is refused.
//
// Threading: send/recv from one thread at a time per communicator (communicator.h); Works may
// be waited from any thread and may outlive this object. The destructor writes the sends already
// issued (for at most the timeout), fails the recvs still posted, marks this rank closed, joins.
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <exception>
#include <functional>
#include <memory>
#include <mutex>
#include <string>

#include <ATen/ATen.h>

#include "comm/comm_util.h"
#include "comm/communicator.h"

namespace caravan::comm {

// What a shared-memory communicator's Works share with it (a Work may outlive it): the first
// failure, and the word that tells its threads to give up on what they wait in.
struct ShmFailure {
  FailureLatch latch;
  std::atomic<bool> abandon{false};
  void fail(const std::string& message) {
    latch.set(message);
    abandon = true;
  }
};

// A shared-memory operation's Work: whoever runs the operation finishes it once (the first
// outcome stays); a wait that reaches its deadline first decides it: PeerError "<what> through
// shared memory did not complete within <timeout>", final for the communicator (`failure`).
class ShmOutcomeWork : public Work {
 public:
  ShmOutcomeWork(std::string what, std::shared_ptr<ShmFailure> failure)
      : what_(std::move(what)), failure_(std::move(failure)) {}
  void finish(std::exception_ptr error);
  bool isCompleted() override;
  // When a wait of `timeout` from now ends (at least 1 ms; at most a year, so it cannot overflow).
  static std::chrono::steady_clock::time_point deadlineFor(std::chrono::milliseconds timeout);

 protected:
  // Waits until finished or `deadline`; a timeout decides it as above, then calls
  // onTimeout(message) (not under this Work's lock) and throws. Rethrows a failure.
  void awaitUntil(std::chrono::steady_clock::time_point deadline, std::chrono::milliseconds timeout,
                  const std::function<void(const std::string&)>& onTimeout = {});

 private:
  std::string what_;
  std::shared_ptr<ShmFailure> failure_;
  std::mutex mutex_;
  std::condition_variable wake_;
  bool done_ = false;
  std::exception_ptr error_;
};

// The process `pid` is gone, or a zombie its parent has not reaped yet (it will never answer).
bool processExited(int64_t pid);

// One rank's doorbell, in the segment (one cache line each).
struct alignas(64) ShmDoorbell {
  std::atomic<uint32_t> seq;       // bumped by whoever has news for this rank (a futex word)
  std::atomic<uint32_t> sleeping;  // its progress thread sleeps on `seq`
  std::atomic<uint32_t> closed;    // its communicator was destroyed
  std::atomic<uint32_t> gaveUp;    // its send/recv failed for good (the segment's failure word
                                   // keeps only the first rank that gave up)
};

class ShmChannels {
 public:
  // Where the channels live in the segment and who the ranks are.
  struct Layout {
    int rank = 0, size = 1;
    char* rings = nullptr;              // bytesFor(size, ringBytes) bytes, zeroed by the creator
    int64_t ringBytes = 0;              // a multiple of 64, at least 64
    ShmDoorbell* bells = nullptr;       // one per rank, zeroed by the creator
    std::function<int64_t(int)> pidOf;  // 0 until rank r mapped the segment
    const std::atomic<int64_t>* failedWord = nullptr;  // 0, or 1 + the rank that gave up
    std::function<int(int)> global;                    // a rank's number in messages
  };
  // `giveUp(message)`: the communicator's own way to fail (its latch and the failure word).
  ShmChannels(Layout layout, std::chrono::milliseconds timeout, std::shared_ptr<ShmFailure> failure,
              std::function<void(const std::string&)> giveUp);
  ~ShmChannels();
  ShmChannels(const ShmChannels&) = delete;
  ShmChannels& operator=(const ShmChannels&) = delete;

  // The segment bytes the rings of `size` ranks take with rings of `ringBytes`.
  static int64_t bytesFor(int size, int64_t ringBytes);

  // As Communicator::send/recv (arguments already checked by the caller).
  WorkPtr send(const at::Tensor& tensor, int dst, int tag);
  WorkPtr recv(const at::Tensor& tensor, int src, int tag);

 private:
  struct Impl;
  std::shared_ptr<Impl> impl_;  // shared with waiters that move bytes meanwhile (weakly)
};

}  // namespace caravan::comm
