// TcpStore server and client (see tcp_store.h).
//
// Wire format (integers little-endian): frame = u32 length + payload.
//   request  = u8 op, then the op's fields
//   response = u8 status (0 ok, 1 timed out, 2 refused, 3 error + message), then fields
// Strings and byte arrays travel as u32 length + bytes, numbers as i64. A connection starts with
// the hello, a challenge-response on the job token in both directions (Server::serve); nothing
// else is served before it succeeded.
// Sockets are non-blocking; every read and write waits in poll() with a deadline.
#include "comm/tcp_store.h"

#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <climits>
#include <condition_variable>
#include <cstring>
#include <list>
#include <mutex>
#include <optional>
#include <stdexcept>
#include <thread>
#include <unordered_map>

#include <fmt/format.h>

#include "comm/auth.h"
#include "comm/comm_util.h"
#include "comm/communicator.h"
#include "core/errors.h"

namespace caravan {
namespace {

using Clock = std::chrono::steady_clock;
using Bytes = std::vector<uint8_t>;
using std::chrono::milliseconds;

enum class Op : uint8_t {
  kHello = 1,
  kSet,
  kGet,
  kAdd,
  kCompareSet,
  kCheck,
  kWait,
  kNumKeys,
  kDelete
};
enum class Status : uint8_t { kOk = 0, kTimeout = 1, kRefused = 2, kError = 3 };
constexpr uint32_t kStoreMagic = 0x32565243;  // "CRV2"
constexpr size_t kNonceBytes = 16;
// What each side's proof covers: HMAC-SHA256(token, label | the other side's nonce).
constexpr const char* kServerProof = "caravan-store-server|";
constexpr const char* kClientProof = "caravan-store-client|";
constexpr uint32_t kMaxFrame = 1u << 30;
// Before the token is checked a stranger may not make the server allocate: the hello is small.
constexpr uint32_t kMaxHello = 4096;
// Connections served at once (each has a thread); more are closed at once.
constexpr size_t kMaxConnections = 4096;

class Writer {
 public:
  Writer& u8(uint8_t v) {
    buf_.push_back(v);
    return *this;
  }
  Writer& op(Op o) { return u8(static_cast<uint8_t>(o)); }
  Writer& status(Status s) { return u8(static_cast<uint8_t>(s)); }
  Writer& u32(uint32_t v) {
    for (int i = 0; i < 4; ++i) buf_.push_back(static_cast<uint8_t>(v >> (8 * i)));
    return *this;
  }
  Writer& i64(int64_t v) {
    const auto u = static_cast<uint64_t>(v);
    for (int i = 0; i < 8; ++i) buf_.push_back(static_cast<uint8_t>(u >> (8 * i)));
    return *this;
  }
  Writer& blob(const uint8_t* p, size_t n) {
    u32(static_cast<uint32_t>(n));
    buf_.insert(buf_.end(), p, p + n);
    return *this;
  }
  Writer& blob(const Bytes& b) { return blob(b.data(), b.size()); }
  Writer& str(const std::string& s) {
    return blob(reinterpret_cast<const uint8_t*>(s.data()), s.size());
  }
  Writer& strs(const std::vector<std::string>& v) {
    u32(static_cast<uint32_t>(v.size()));
    for (const auto& s : v) str(s);
    return *this;
  }
  const Bytes& data() const { return buf_; }

 private:
  Bytes buf_;
};

// Malformed input throws std::runtime_error (the server then drops that client).
class Reader {
 public:
  explicit Reader(Bytes b) : b_(std::move(b)) {}
  uint8_t u8() {
    need(1);
    return b_[pos_++];
  }
  uint32_t u32() {
    need(4);
    uint32_t v = 0;
    for (int i = 0; i < 4; ++i) v |= static_cast<uint32_t>(b_[pos_++]) << (8 * i);
    return v;
  }
  int64_t i64() {
    need(8);
    uint64_t v = 0;
    for (int i = 0; i < 8; ++i) v |= static_cast<uint64_t>(b_[pos_++]) << (8 * i);
    return static_cast<int64_t>(v);
  }
  Bytes blob() {
    const uint32_t n = u32();
    need(n);
    Bytes out(b_.begin() + pos_, b_.begin() + pos_ + n);
    pos_ += n;
    return out;
  }
  std::string str() {
    Bytes b = blob();
    return std::string(b.begin(), b.end());
  }
  std::vector<std::string> strs() {
    const uint32_t n = u32();
    std::vector<std::string> out;
    for (uint32_t i = 0; i < n; ++i) out.push_back(str());
    return out;
  }

 private:
  void need(size_t n) {
    if (b_.size() - pos_ < n) throw std::runtime_error("truncated store message");
  }
  Bytes b_;
  size_t pos_ = 0;
};

enum class Io { kOk, kTimeout, kClosed, kError };

// Waits until `fd` is ready for `events` (or reports an error/hang-up) or `deadline` passed.
bool pollUntil(int fd, short events, Clock::time_point deadline) {
  for (;;) {
    const auto left = std::chrono::duration_cast<milliseconds>(deadline - Clock::now()).count();
    pollfd p{fd, events, 0};
    const int rc = ::poll(&p, 1, static_cast<int>(std::clamp<int64_t>(left, 0, INT_MAX)));
    if (rc > 0) return true;
    if (rc < 0 && errno != EINTR) return true;  // let the read/write report it
    if (rc == 0 && left <= 0) return false;
  }
}

Io sendAll(int fd, const uint8_t* p, size_t n, Clock::time_point deadline) {
  while (n > 0) {
    const ssize_t k = ::send(fd, p, n, MSG_NOSIGNAL);
    if (k > 0) {
      p += k;
      n -= static_cast<size_t>(k);
      continue;
    }
    if (k < 0 && errno == EINTR) continue;
    if (k < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) {
      if (!pollUntil(fd, POLLOUT, deadline)) return Io::kTimeout;
      continue;
    }
    return (errno == EPIPE || errno == ECONNRESET) ? Io::kClosed : Io::kError;
  }
  return Io::kOk;
}

Io recvAll(int fd, uint8_t* p, size_t n, Clock::time_point deadline) {
  while (n > 0) {
    const ssize_t k = ::recv(fd, p, n, 0);
    if (k > 0) {
      p += k;
      n -= static_cast<size_t>(k);
      continue;
    }
    if (k == 0) return Io::kClosed;
    if (errno == EINTR) continue;
    if (errno == EAGAIN || errno == EWOULDBLOCK) {
      if (!pollUntil(fd, POLLIN, deadline)) return Io::kTimeout;
      continue;
    }
    return errno == ECONNRESET ? Io::kClosed : Io::kError;
  }
  return Io::kOk;
}

Io sendFrame(int fd, const Bytes& payload, Clock::time_point deadline) {
  Bytes frame(payload.size() + 4);
  for (int i = 0; i < 4; ++i) frame[i] = static_cast<uint8_t>(payload.size() >> (8 * i));
  if (!payload.empty()) std::memcpy(frame.data() + 4, payload.data(), payload.size());
  return sendAll(fd, frame.data(), frame.size(), deadline);
}

Io recvFrame(int fd, Bytes* payload, Clock::time_point deadline, uint32_t maxBytes = kMaxFrame) {
  uint8_t header[4];
  Io r = recvAll(fd, header, 4, deadline);
  if (r != Io::kOk) return r;
  uint32_t n = 0;
  for (int i = 0; i < 4; ++i) n |= static_cast<uint32_t>(header[i]) << (8 * i);
  if (n > maxBytes) return Io::kError;
  payload->resize(n);
  return recvAll(fd, payload->data(), n, deadline);
}

void setSocketOptions(int fd) {
  int one = 1;
  ::setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
}

std::string quoteKeys(const std::vector<std::string>& keys) {
  std::string out;
  for (size_t i = 0; i < keys.size() && i < 3; ++i) out += (i ? ", '" : "'") + keys[i] + "'";
  if (keys.size() > 3) out += fmt::format(" and {} more", keys.size() - 3);
  return out;
}

Clock::time_point deadlineAfter(milliseconds d) { return Clock::now() + d; }

}  // namespace

// ---------------------------------------------------------------------------------------------
// The keys. Shared by the server's client threads and rank 0's own calls.
class TcpStore::State {
 public:
  void set(const std::string& key, Bytes value) {
    std::lock_guard<std::mutex> lock(mutex_);
    keys_[key] = std::move(value);
    changed_.notify_all();
  }

  // The value, or nullopt when `deadline` passed (or the store shut down) first.
  std::optional<Bytes> get(const std::string& key, Clock::time_point deadline) {
    std::unique_lock<std::mutex> lock(mutex_);
    changed_.wait_until(lock, deadline, [&] { return stopping_ || keys_.count(key) > 0; });
    auto it = keys_.find(key);
    if (it == keys_.end()) return std::nullopt;
    return it->second;
  }

  bool wait(const std::vector<std::string>& keys, Clock::time_point deadline) {
    std::unique_lock<std::mutex> lock(mutex_);
    return changed_.wait_until(lock, deadline, [&] { return stopping_ || hasAll(keys); }) &&
           hasAll(keys);
  }

  int64_t add(const std::string& key, int64_t delta) {
    std::lock_guard<std::mutex> lock(mutex_);
    int64_t value = 0;
    auto it = keys_.find(key);
    if (it != keys_.end()) {
      const std::string text(it->second.begin(), it->second.end());
      size_t used = 0;
      try {
        value = std::stoll(text, &used);
      } catch (const std::exception&) {
        used = 0;
      }
      if (used == 0 || used != text.size()) {
        throw std::runtime_error(fmt::format("store key '{}' does not hold an integer", key));
      }
    }
    value += delta;
    const std::string text = std::to_string(value);
    keys_[key] = Bytes(text.begin(), text.end());
    changed_.notify_all();
    return value;
  }

  Bytes compareSet(const std::string& key, const Bytes& expected, const Bytes& desired) {
    std::lock_guard<std::mutex> lock(mutex_);
    auto it = keys_.find(key);
    if (it == keys_.end()) {
      if (!expected.empty()) return expected;
      keys_[key] = desired;
      changed_.notify_all();
      return desired;
    }
    if (it->second == expected) {
      it->second = desired;
      changed_.notify_all();
    }
    return it->second;
  }

  bool check(const std::vector<std::string>& keys) {
    std::lock_guard<std::mutex> lock(mutex_);
    return hasAll(keys);
  }

  int64_t numKeys() {
    std::lock_guard<std::mutex> lock(mutex_);
    return static_cast<int64_t>(keys_.size());
  }

  bool erase(const std::string& key) {
    std::lock_guard<std::mutex> lock(mutex_);
    return keys_.erase(key) > 0;
  }

  // Wakes every waiter; waits then fail as timed out.
  void stop() {
    std::lock_guard<std::mutex> lock(mutex_);
    stopping_ = true;
    changed_.notify_all();
  }

 private:
  bool hasAll(const std::vector<std::string>& keys) const {
    return std::all_of(keys.begin(), keys.end(), [&](const auto& k) { return keys_.count(k); });
  }

  std::mutex mutex_;
  std::condition_variable changed_;
  std::unordered_map<std::string, Bytes> keys_;
  bool stopping_ = false;
};

// ---------------------------------------------------------------------------------------------
namespace {

// The port of an IPv4 or IPv6 socket address.
int portOf(const sockaddr_storage& a) {
  return ntohs(a.ss_family == AF_INET6 ? reinterpret_cast<const sockaddr_in6*>(&a)->sin6_port
                                       : reinterpret_cast<const sockaddr_in*>(&a)->sin_port);
}

}  // namespace

class TcpStore::Server {
 public:
  Server(std::shared_ptr<State> state, const std::string& host, int port, int listenFd,
         std::string token, milliseconds timeout)
      : state_(std::move(state)), token_(std::move(token)), timeout_(timeout) {
    if (listenFd >= 0) {
      adopt(listenFd, host, port);
    } else {
      listen(host, port);
    }
    int pipeFds[2];
    if (::pipe2(pipeFds, O_CLOEXEC | O_NONBLOCK) != 0) {
      ::close(listenFd_);
      throw IoError(fmt::format("cannot create a pipe for the store server: {}",
                                std::strerror(errno)));
    }
    wakeRead_ = pipeFds[0];
    wakeWrite_ = pipeFds[1];
    acceptThread_ = std::thread([this] { acceptLoop(); });
  }

  ~Server() {
    const char byte = 1;
    [[maybe_unused]] ssize_t ignored = ::write(wakeWrite_, &byte, 1);
    acceptThread_.join();
    state_->stop();
    std::lock_guard<std::mutex> lock(connsMutex_);
    for (auto& c : conns_) ::shutdown(c->fd, SHUT_RDWR);
    for (auto& c : conns_) {
      c->thread.join();
      ::close(c->fd);
    }
    ::close(listenFd_);
    ::close(wakeRead_);
    ::close(wakeWrite_);
  }

  int port() const { return port_; }

 private:
  struct Conn {
    int fd = -1;
    std::thread thread;
    std::atomic<bool> finished{false};
  };

  void listen(const std::string& host, int port) {
    addrinfo hints{};
    hints.ai_family = AF_UNSPEC;
    hints.ai_socktype = SOCK_STREAM;
    hints.ai_flags = AI_PASSIVE | AI_NUMERICSERV;
    addrinfo* list = nullptr;
    const std::string service = std::to_string(port);
    const int gai = ::getaddrinfo(host.empty() ? nullptr : host.c_str(), service.c_str(), &hints,
                                  &list);
    if (gai != 0) {
      throw ConfigError(fmt::format("rank 0 cannot listen on {}:{}: {}; set MASTER_ADDR to an "
                                    "address of this host",
                                    host, port, ::gai_strerror(gai)));
    }
    std::string lastError = "no address";
    for (addrinfo* a = list; a != nullptr; a = a->ai_next) {
      const int fd = ::socket(a->ai_family, a->ai_socktype | SOCK_NONBLOCK | SOCK_CLOEXEC,
                              a->ai_protocol);
      if (fd < 0) {
        lastError = std::strerror(errno);
        continue;
      }
      int one = 1;
      ::setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
      if (::bind(fd, a->ai_addr, a->ai_addrlen) == 0 && ::listen(fd, SOMAXCONN) == 0) {
        sockaddr_storage bound{};
        socklen_t len = sizeof(bound);
        ::getsockname(fd, reinterpret_cast<sockaddr*>(&bound), &len);
        port_ = portOf(bound);
        listenFd_ = fd;
        break;
      }
      lastError = std::strerror(errno);
      ::close(fd);
    }
    ::freeaddrinfo(list);
    if (listenFd_ < 0) {
      throw ConfigError(fmt::format("rank 0 cannot listen on {}:{} for the rendezvous store: {}; "
                                    "pick a free MASTER_PORT (another job may hold this one) and "
                                    "check that MASTER_ADDR is an address of this host",
                                    host, port, lastError));
    }
  }

  // Serves on `fd`, a socket the launcher bound and listens on (it keeps its own copy, so the
  // port stays taken until the job ends): checked to listen at host:port, made non-blocking and
  // close-on-exec like a socket of our own.
  void adopt(int fd, const std::string& host, int port) {
    int listening = 0;
    socklen_t size = sizeof(listening);
    sockaddr_storage bound{};
    socklen_t len = sizeof(bound);
    const bool ok = ::getsockopt(fd, SOL_SOCKET, SO_ACCEPTCONN, &listening, &size) == 0 &&
                    listening == 1 &&
                    ::getsockname(fd, reinterpret_cast<sockaddr*>(&bound), &len) == 0 &&
                    (bound.ss_family == AF_INET || bound.ss_family == AF_INET6);
    const int boundPort = ok ? portOf(bound) : 0;
    if (!ok || (port != 0 && boundPort != port)) {
      throw ConfigError(
          fmt::format("descriptor {} (CARAVAN_STORE_FD) is not a socket listening on {}:{}; unset "
                      "CARAVAN_STORE_FD (caravan train --workers sets it for its rank 0 only)",
                      fd, host, port));
    }
    ::fcntl(fd, F_SETFD, FD_CLOEXEC);
    ::fcntl(fd, F_SETFL, ::fcntl(fd, F_GETFL) | O_NONBLOCK);
    listenFd_ = fd;
    port_ = boundPort;
  }

  void acceptLoop() {
    for (;;) {
      pollfd fds[2] = {{listenFd_, POLLIN, 0}, {wakeRead_, POLLIN, 0}};
      const int rc = ::poll(fds, 2, -1);  // woken by the destructor through wakeRead_
      if (rc < 0 && errno == EINTR) continue;
      if (fds[1].revents != 0 || rc < 0) return;
      const int fd = ::accept4(listenFd_, nullptr, nullptr, SOCK_NONBLOCK | SOCK_CLOEXEC);
      if (fd < 0) continue;
      setSocketOptions(fd);
      std::lock_guard<std::mutex> lock(connsMutex_);
      reapFinished();
      if (conns_.size() >= kMaxConnections) {
        ::close(fd);
        continue;
      }
      auto conn = std::make_unique<Conn>();
      conn->fd = fd;
      Conn* c = conn.get();
      conns_.push_back(std::move(conn));
      c->thread = std::thread([this, c] {
        serve(c->fd);
        // The client sees the end at once (a refused stranger too); the fd is closed by reap.
        ::shutdown(c->fd, SHUT_RDWR);
        c->finished = true;
      });
    }
  }

  // Joins the threads of clients that left. Caller holds connsMutex_.
  void reapFinished() {
    for (auto it = conns_.begin(); it != conns_.end();) {
      if ((*it)->finished) {
        (*it)->thread.join();
        ::close((*it)->fd);
        it = conns_.erase(it);
      } else {
        ++it;
      }
    }
  }

  void serve(int fd) {
    Bytes request;
    // A connection that does not introduce itself within the timeout is dropped.
    if (recvFrame(fd, &request, deadlineAfter(timeout_), kMaxHello) != Io::kOk) return;
    // The hello: [kHello, magic, client nonce] -> [ok, server nonce, server proof], then
    // [kHello, client proof] -> [ok | refused]. Neither side sends the token or a proof it could
    // replay, and a client learns nothing from a process that does not know the token.
    try {
      Reader hello(std::move(request));
      const bool wellFormed =
          hello.u8() == static_cast<uint8_t>(Op::kHello) && hello.u32() == kStoreMagic;
      const std::string clientNonce = wellFormed ? hello.str() : std::string();
      Writer challenge;
      if (clientNonce.size() != kNonceBytes) {
        challenge.status(Status::kRefused);
        sendFrame(fd, challenge.data(), deadlineAfter(timeout_));
        return;
      }
      const std::string serverNonce = randomBytes(kNonceBytes);
      challenge.status(Status::kOk).str(serverNonce).str(
          hmacSha256(token_, kServerProof + clientNonce));
      if (sendFrame(fd, challenge.data(), deadlineAfter(timeout_)) != Io::kOk) return;
      if (recvFrame(fd, &request, deadlineAfter(timeout_), kMaxHello) != Io::kOk) return;
      Reader answer(std::move(request));
      const bool ok = answer.u8() == static_cast<uint8_t>(Op::kHello) &&
                      sameSecret(answer.str(), hmacSha256(token_, kClientProof + serverNonce));
      Writer reply;
      reply.status(ok ? Status::kOk : Status::kRefused);
      if (sendFrame(fd, reply.data(), deadlineAfter(timeout_)) != Io::kOk || !ok) return;
    } catch (const std::exception&) {
      return;
    }
    for (;;) {
      // Idle clients wait here until they send or leave; the destructor shuts the socket down.
      if (recvFrame(fd, &request, Clock::time_point::max()) != Io::kOk) return;
      Writer reply;
      try {
        handle(Reader(std::move(request)), &reply);
      } catch (const std::exception& e) {
        reply = Writer();
        reply.status(Status::kError).str(e.what());
      }
      if (sendFrame(fd, reply.data(), deadlineAfter(timeout_)) != Io::kOk) return;
    }
  }

  void handle(Reader in, Writer* out) {
    const auto op = static_cast<Op>(in.u8());
    switch (op) {
      case Op::kSet: {
        std::string key = in.str();
        state_->set(key, in.blob());
        out->status(Status::kOk);
        return;
      }
      case Op::kGet: {
        std::string key = in.str();
        const milliseconds t(in.i64());
        auto value = state_->get(key, deadlineAfter(t));
        if (value) {
          out->status(Status::kOk).blob(*value);
        } else {
          out->status(Status::kTimeout);
        }
        return;
      }
      case Op::kAdd: {
        std::string key = in.str();
        out->status(Status::kOk).i64(state_->add(key, in.i64()));
        return;
      }
      case Op::kCompareSet: {
        std::string key = in.str();
        Bytes expected = in.blob();
        Bytes desired = in.blob();
        out->status(Status::kOk).blob(state_->compareSet(key, expected, desired));
        return;
      }
      case Op::kCheck:
        out->status(Status::kOk).u8(state_->check(in.strs()) ? 1 : 0);
        return;
      case Op::kWait: {
        auto keys = in.strs();
        const milliseconds t(in.i64());
        out->status(state_->wait(keys, deadlineAfter(t)) ? Status::kOk : Status::kTimeout);
        return;
      }
      case Op::kNumKeys:
        out->status(Status::kOk).i64(state_->numKeys());
        return;
      case Op::kDelete:
        out->status(Status::kOk).u8(state_->erase(in.str()) ? 1 : 0);
        return;
      case Op::kHello:
        break;
    }
    throw std::runtime_error("unknown store request");
  }

  std::shared_ptr<State> state_;
  std::string token_;
  milliseconds timeout_;
  int listenFd_ = -1;
  int port_ = 0;
  int wakeRead_ = -1;
  int wakeWrite_ = -1;
  std::mutex connsMutex_;
  std::list<std::unique_ptr<Conn>> conns_;
  std::thread acceptThread_;
};

// ---------------------------------------------------------------------------------------------
class TcpStore::Client {
 public:
  Client(const std::string& host, int port, milliseconds timeout, const std::string& token)
      : where_(fmt::format("{}:{}", host, port)) {
    const auto deadline = deadlineAfter(timeout);
    connect(host, port, timeout, deadline);
    // The hello (see Server::serve): prove the token without sending it, and check that the
    // store knows it too.
    const std::string clientNonce = randomBytes(kNonceBytes);
    Writer hello;
    hello.op(Op::kHello).u32(kStoreMagic).str(clientNonce);
    Reader challenge = call(hello, deadline);
    const auto refused = [this] {
      return ConfigError(fmt::format(
          "the rendezvous store at {} refused this process's job token; start every rank of a "
          "job with the same CARAVAN_JOB_TOKEN (or another job is using this MASTER_PORT)",
          where_));
    };
    if (challenge.u8() != static_cast<uint8_t>(Status::kOk)) throw refused();
    const std::string serverNonce = challenge.str();
    if (!sameSecret(challenge.str(), hmacSha256(token, kServerProof + clientNonce))) {
      throw ConfigError(fmt::format(
          "the process at {} does not know this process's job token: it is another job's "
          "rendezvous store or not a Caravan store; start every rank with the same "
          "CARAVAN_JOB_TOKEN and check MASTER_ADDR/MASTER_PORT",
          where_));
    }
    Writer answer;
    answer.op(Op::kHello).str(hmacSha256(token, kClientProof + serverNonce));
    if (call(answer, deadline).u8() != static_cast<uint8_t>(Status::kOk)) throw refused();
  }

  ~Client() {
    if (fd_ >= 0) ::close(fd_);
  }

  // One request/response exchange; the whole exchange ends by `deadline`.
  Reader call(const Writer& request, Clock::time_point deadline) {
    std::lock_guard<std::mutex> lock(mutex_);
    if (broken_) throw PeerError(*broken_);
    Bytes response;
    Io r = sendFrame(fd_, request.data(), deadline);
    if (r == Io::kOk) r = recvFrame(fd_, &response, deadline);
    if (r != Io::kOk) {
      // The stream is out of step now; every later call fails with the same reason.
      broken_ = r == Io::kTimeout
                    ? fmt::format("the rendezvous store at {} did not answer in time; rank 0 "
                                  "may be overloaded or hung",
                                  where_)
                    : fmt::format("lost the connection to the rendezvous store at {} (rank 0 "
                                  "exited or the network failed)",
                                  where_);
      throw PeerError(*broken_);
    }
    return Reader(std::move(response));
  }

  const std::string& where() const { return where_; }

 private:
  void connect(const std::string& host, int port, milliseconds timeout,
               Clock::time_point deadline) {
    addrinfo hints{};
    hints.ai_family = AF_UNSPEC;
    hints.ai_socktype = SOCK_STREAM;
    hints.ai_flags = AI_NUMERICSERV;
    const std::string service = std::to_string(port);
    std::string lastError = "no attempt";
    auto backoff = milliseconds(20);
    for (;;) {
      addrinfo* list = nullptr;
      const int gai = ::getaddrinfo(host.c_str(), service.c_str(), &hints, &list);
      if (gai == EAI_NONAME || gai == EAI_FAIL || gai == EAI_SERVICE) {
        throw ConfigError(fmt::format("cannot resolve the master address '{}' ({}); check "
                                      "MASTER_ADDR",
                                      host, ::gai_strerror(gai)));
      }
      if (gai != 0) lastError = ::gai_strerror(gai);
      for (addrinfo* a = list; a != nullptr && fd_ < 0; a = a->ai_next) {
        tryConnect(a, deadline, &lastError);
      }
      if (list != nullptr) ::freeaddrinfo(list);
      if (fd_ >= 0) return;
      const auto now = Clock::now();
      if (now >= deadline) {
        throw PeerError(fmt::format(
            "could not reach the rendezvous store at {} within {} (last error: {}); check that "
            "rank 0 is running and listening there (MASTER_ADDR, MASTER_PORT) and that no "
            "firewall blocks the port, or raise fault.rendezvous_timeout",
            where_, comm::formatDuration(timeout), lastError));
      }
      std::this_thread::sleep_for(
          std::min<Clock::duration>(backoff, deadline - now));
      backoff = std::min(backoff * 2, milliseconds(500));
    }
  }

  void tryConnect(const addrinfo* a, Clock::time_point deadline, std::string* lastError) {
    const int fd =
        ::socket(a->ai_family, a->ai_socktype | SOCK_NONBLOCK | SOCK_CLOEXEC, a->ai_protocol);
    if (fd < 0) {
      *lastError = std::strerror(errno);
      return;
    }
    int err = 0;
    if (::connect(fd, a->ai_addr, a->ai_addrlen) != 0) {
      err = errno;
      if (err == EINPROGRESS) {
        if (!pollUntil(fd, POLLOUT, deadline)) {
          err = ETIMEDOUT;
        } else {
          socklen_t len = sizeof(err);
          ::getsockopt(fd, SOL_SOCKET, SO_ERROR, &err, &len);
        }
      }
    }
    if (err != 0) {
      *lastError = std::strerror(err);
      ::close(fd);
      return;
    }
    setSocketOptions(fd);
    fd_ = fd;
  }

  std::string where_;
  int fd_ = -1;
  std::mutex mutex_;
  std::optional<std::string> broken_;
};

// ---------------------------------------------------------------------------------------------
namespace {

// The status byte of a response; kError carries a message.
Status readStatus(Reader& r) {
  const auto s = static_cast<Status>(r.u8());
  if (s == Status::kError) throw InternalError("rendezvous store: " + r.str());
  return s;
}

}  // namespace

TcpStore::TcpStore(const TcpStoreOptions& options)
    : c10d::Store(options.timeout), host_(options.host), port_(options.port) {
  CARAVAN_CHECK(options.timeout.count() > 0, "store timeout must be positive, got {} ms",
                options.timeout.count());
  if (options.isServer) {
    state_ = std::make_shared<State>();
    server_ = std::make_unique<Server>(state_, options.host, options.port, options.listenFd,
                                       options.token, options.timeout);
    port_ = server_->port();
  } else {
    client_ = std::make_unique<Client>(
        options.host, options.port,
        options.connectTimeout.count() > 0 ? options.connectTimeout : options.timeout,
        options.token);
  }
}

TcpStore::~TcpStore() = default;

milliseconds TcpStore::effective(milliseconds timeout) const {
  return timeout == kNoTimeout ? timeout_ : timeout;
}

namespace {

PeerError keyTimeout(const std::vector<std::string>& keys, milliseconds t,
                     const std::string& host, int port) {
  return PeerError(fmt::format("timed out after {} waiting for key{} {} in the rendezvous store at "
                               "{}:{}; a rank did not arrive (check the other ranks' logs)",
                               comm::formatDuration(t), keys.size() == 1 ? "" : "s",
                               quoteKeys(keys), host, port));
}

}  // namespace

void TcpStore::set(const std::string& key, const std::vector<uint8_t>& value) {
  if (state_) return state_->set(key, value);
  Writer w;
  w.op(Op::kSet).str(key).blob(value);
  Reader r = client_->call(w, deadlineAfter(timeout_));
  readStatus(r);
}

std::vector<uint8_t> TcpStore::compareSet(const std::string& key,
                                          const std::vector<uint8_t>& expected,
                                          const std::vector<uint8_t>& desired) {
  if (state_) return state_->compareSet(key, expected, desired);
  Writer w;
  w.op(Op::kCompareSet).str(key).blob(expected).blob(desired);
  Reader r = client_->call(w, deadlineAfter(timeout_));
  readStatus(r);
  return r.blob();
}

std::vector<uint8_t> TcpStore::get(const std::string& key) {
  const milliseconds t = timeout_;
  if (state_) {
    auto value = state_->get(key, deadlineAfter(t));
    if (!value) throw keyTimeout({key}, t, host_, port_);
    return *value;
  }
  Writer w;
  w.op(Op::kGet).str(key).i64(t.count());
  // The server waits up to t; the answer may take one more request timeout to arrive.
  Reader r = client_->call(w, deadlineAfter(t + timeout_));
  if (readStatus(r) == Status::kTimeout) throw keyTimeout({key}, t, host_, port_);
  return r.blob();
}

int64_t TcpStore::add(const std::string& key, int64_t value) {
  if (state_) {
    try {
      return state_->add(key, value);
    } catch (const std::runtime_error& e) {
      throw InternalError(std::string("rendezvous store: ") + e.what());
    }
  }
  Writer w;
  w.op(Op::kAdd).str(key).i64(value);
  Reader r = client_->call(w, deadlineAfter(timeout_));
  readStatus(r);
  return r.i64();
}

bool TcpStore::deleteKey(const std::string& key) {
  if (state_) return state_->erase(key);
  Writer w;
  w.op(Op::kDelete).str(key);
  Reader r = client_->call(w, deadlineAfter(timeout_));
  readStatus(r);
  return r.u8() != 0;
}

bool TcpStore::check(const std::vector<std::string>& keys) {
  if (state_) return state_->check(keys);
  Writer w;
  w.op(Op::kCheck).strs(keys);
  Reader r = client_->call(w, deadlineAfter(timeout_));
  readStatus(r);
  return r.u8() != 0;
}

int64_t TcpStore::getNumKeys() {
  if (state_) return state_->numKeys();
  Writer w;
  w.op(Op::kNumKeys);
  Reader r = client_->call(w, deadlineAfter(timeout_));
  readStatus(r);
  return r.i64();
}

void TcpStore::wait(const std::vector<std::string>& keys) { wait(keys, timeout_); }

void TcpStore::wait(const std::vector<std::string>& keys, const milliseconds& timeout) {
  const milliseconds t = effective(timeout);
  if (state_) {
    if (!state_->wait(keys, deadlineAfter(t))) throw keyTimeout(keys, t, host_, port_);
    return;
  }
  Writer w;
  w.op(Op::kWait).strs(keys).i64(t.count());
  Reader r = client_->call(w, deadlineAfter(t + timeout_));
  if (readStatus(r) == Status::kTimeout) throw keyTimeout(keys, t, host_, port_);
}

}  // namespace caravan
