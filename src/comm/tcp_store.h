// TcpStore: the rendezvous key-value store (a c10d::Store) that rank 0 serves over TCP.
//
// The server (rank 0) listens on exactly `host:port` (the master address: loopback by default,
// all interfaces only if the user says 0.0.0.0) and keeps the keys in memory; its own
// operations use that memory directly. Every other rank connects as a client and retries a
// refused connection until `timeout`, so ranks may start in any order. A client first
// proves the job token (HMAC-SHA256 over the server's fresh nonce) and checks the server's
// proof over its own nonce; the server drops a connection whose proof is wrong. The token
// itself never travels.
//
// Why not c10d::TCPStore: in LibTorch 1.13 its server always binds every interface (there is
// no bind-address option) and reports connection problems through glog lines on stderr. The
// c10d::Store interface is the same, so ProcessGroupGloo rendezvouses through this class.
//
// Semantics follow c10d: get() waits for a missing key; add() keeps the value as a decimal
// string; compareSet() sets `desired` when the current value equals `expected` (a missing key
// counts as equal to an empty `expected`) and returns the value now stored. A timeout of
// kNoTimeout (0) means the store's timeout: nothing here waits forever.
//
// Errors: a master that cannot be reached within the timeout, a lost connection or a timed-out
// wait for keys -> PeerError naming host:port; a port rank 0 cannot bind, an address that does
// not resolve, a listenFd that is not a socket listening on host:port, or a refused token ->
// ConfigError.
//
// Threading: every method may be called from any thread; a client serializes its requests on
// one socket. The server runs one accepting thread plus one thread per connected client, all
// joined by the destructor.
#pragma once

#include <chrono>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include <torch/csrc/distributed/c10d/Store.hpp>

namespace caravan {

struct TcpStoreOptions {
  std::string host = "127.0.0.1";  // server: the address to listen on; client: where to connect
  int port = 29500;                // server: 0 picks a free port (see TcpStore::port())
  bool isServer = false;
  std::chrono::milliseconds timeout{30000};  // every request, default for waits
  // A client's wait for the server to listen; zero: `timeout`.
  std::chrono::milliseconds connectTimeout{0};
  std::string token;  // must match between server and clients; empty is a valid token
  // Server: a socket already listening on host:port, handed over by the process that picked
  // the port (`caravan train --workers`, CARAVAN_STORE_FD): the store serves on it and closes
  // it, and binds nothing itself. -1: bind host:port.
  int listenFd = -1;
};

class TcpStore : public c10d::Store {
 public:
  explicit TcpStore(const TcpStoreOptions& options);
  ~TcpStore() override;
  // c10d::Store::clone() (pure since LibTorch 2.x) asks for a second connection for another
  // thread. Nothing Caravan calls (ProcessGroupGloo included) uses it; a store shared across
  // threads here is one connection under a lock.
  c10::intrusive_ptr<c10d::Store> clone() override {
    TORCH_CHECK(false, "caravan::TcpStore has no clone(): share the one store");
  }

  // The port actually listened on / connected to.
  int port() const { return port_; }
  const std::string& host() const { return host_; }

  void set(const std::string& key, const std::vector<uint8_t>& value) override;
  std::vector<uint8_t> compareSet(const std::string& key, const std::vector<uint8_t>& expected,
                                  const std::vector<uint8_t>& desired) override;
  std::vector<uint8_t> get(const std::string& key) override;
  int64_t add(const std::string& key, int64_t value) override;
  bool deleteKey(const std::string& key) override;
  bool check(const std::vector<std::string>& keys) override;
  int64_t getNumKeys() override;
  void wait(const std::vector<std::string>& keys) override;
  void wait(const std::vector<std::string>& keys,
            const std::chrono::milliseconds& timeout) override;

  class State;   // the keys (server side)
  class Server;  // listening socket and client threads
  class Client;  // one connection to the server

 private:
  std::chrono::milliseconds effective(std::chrono::milliseconds timeout) const;

  std::string host_;
  int port_ = 0;
  std::shared_ptr<State> state_;    // server only
  std::unique_ptr<Server> server_;  // server only
  std::unique_ptr<Client> client_;  // clients only
};

}  // namespace caravan
