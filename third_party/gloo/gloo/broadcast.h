/**
 * Copyright (c) 2018-present, Facebook, Inc.
 * All rights reserved.
 *
 * This source code is licensed under the BSD-style license found in the
 * LICENSE file in the root directory of this source tree.
 */

#pragma once

#include "gloo/context.h"
#include "gloo/transport/unbound_buffer.h"

namespace gloo {

class BroadcastOptions {
 public:
  explicit BroadcastOptions(const std::shared_ptr<Context>& context)
      : context(context), timeout(context->getTimeout()) {}

  template <typename T>
  void setInput(std::unique_ptr<transport::UnboundBuffer> buf) {
    this->elements = buf->size / sizeof(T);
    this->elementSize = sizeof(T);
    this->in = std::move(buf);
  }

  template <typename T>
  void setInput(T* ptr, size_t elements_2) {
    this->elements = elements_2;
    this->elementSize = sizeof(T);
    this->in = context->createUnboundBuffer(ptr, elements_2 * sizeof(T));
  }

  template <typename T>
  void setOutput(std::unique_ptr<transport::UnboundBuffer> buf) {
    this->elements = buf->size / sizeof(T);
    this->elementSize = sizeof(T);
    this->out = std::move(buf);
  }

  template <typename T>
  void setOutput(T* ptr, size_t elements_2) {
    this->elements = elements_2;
    this->elementSize = sizeof(T);
    this->out = context->createUnboundBuffer(ptr, elements_2 * sizeof(T));
  }

  void setRoot(int root_2) {
    this->root = root_2;
  }

  void setTag(uint32_t tag_2) {
    this->tag = tag_2;
  }

  void setTimeout(std::chrono::milliseconds timeout_2) {
    this->timeout = timeout_2;
  }

 protected:
  std::shared_ptr<Context> context;

  // Broadcast has an optional input buffer for the root.
  std::unique_ptr<transport::UnboundBuffer> in;

  // Broadcast has a mandatory output buffer for all ranks.
  std::unique_ptr<transport::UnboundBuffer> out;

  // Number of elements.
  size_t elements = 0;

  // Number of bytes per element.
  size_t elementSize = 0;

  // Rank of process to broadcast from.
  int root = -1;

  // Tag for this operation.
  // Must be unique across operations executing in parallel.
  uint32_t tag = 0;

  // End-to-end timeout for this operation.
  std::chrono::milliseconds timeout;

  friend void broadcast(BroadcastOptions&);
};

void broadcast(BroadcastOptions& opts);

} // namespace gloo
