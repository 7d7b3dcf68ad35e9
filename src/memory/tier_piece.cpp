// A few tensors as views of one blob that lives on a tier (see tier_piece.h).
#include "memory/tier_piece.h"

#include <cstring>

#include <torch/torch.h>

#include "core/align.h"
#include "core/errors.h"

namespace caravan {

namespace {

at::Storage newBlob(Tier& tier, int64_t bytes) {
  return at::Storage(at::Storage::use_byte_size_t(), bytes, tier.allocateHost(bytes),
                     /*allocator=*/nullptr, /*resizable=*/false);
}

}  // namespace

TierPiece::TierPiece(Tier& tier, std::vector<at::Tensor> members, MemoryTracker* tracker,
                     MemoryCategory category)
    : tier_(tier), members_(std::move(members)), tracker_(tracker), category_(category) {
  for (const auto& m : members_) {
    CARAVAN_CHECK(
        m.defined() && m.scalar_type() == at::kFloat && m.is_contiguous() && m.device().is_cpu(),
        "a tier piece holds contiguous float32 CPU tensors");
    offsets_.push_back(bytes_);
    shapes_.push_back(m.sizes().vec());
    bytes_ += alignUp(static_cast<int64_t>(m.nbytes()), kTensorAlign);
  }
  bytes_ = std::max<int64_t>(bytes_, kTensorAlign);
  at::Storage blob = newBlob(tier_, bytes_);
  slot_ = tier_.allocate(bytes_);
  for (size_t k = 0; k < members_.size(); ++k) {
    std::memcpy(static_cast<char*>(blob.mutable_data()) + offsets_[k], members_[k].data_ptr(),
                members_[k].nbytes());
  }
  attach(blob);
  blob_ = blob;
  if (tracker_ != nullptr) tracker_->add(category_, bytes_);
  std::lock_guard<std::mutex> lock(mutex_);
  startWriteLocked();
}

TierPiece::~TierPiece() {
  {
    std::unique_lock<std::mutex> lock(mutex_);
    cv_.wait(lock, [&] { return !reading_ && writes_ == 0; });
    if (static_cast<bool>(blob_) && tracker_ != nullptr) tracker_->add(category_, -bytes_);
  }
  if (slot_ >= 0) tier_.free(slot_);
}

void TierPiece::attach(const at::Storage& blob) {
  torch::NoGradGuard noGrad;
  for (size_t k = 0; k < members_.size(); ++k) {
    at::Tensor view = at::empty({0}, at::kFloat);
    view.set_(blob, offsets_[k] / static_cast<int64_t>(sizeof(float)), shapes_[k],
              c10::contiguous_strides(shapes_[k]));
    members_[k].set_data(view);
  }
}

void TierPiece::detachIfIdleLocked() {
  if (pins_ > 0 || prefetched_ || !static_cast<bool>(blob_) || !tierCurrent_ || writes_ > 0) return;
  torch::NoGradGuard noGrad;
  for (auto& m : members_) m.set_data(at::empty({0}, at::kFloat));
  blob_ = at::Storage();
  if (tracker_ != nullptr) tracker_->add(category_, -bytes_);
}

void TierPiece::startReadLocked() {
  if (static_cast<bool>(blob_) || reading_) return;
  reading_ = true;
  tier_.submitRead([this] {
    at::Storage blob;
    std::string error;
    try {
      blob = newBlob(tier_, bytes_);
      tier_.load(slot_, blob.mutable_data(), bytes_);
    } catch (const std::exception& e) {
      error = e.what();
    }
    std::lock_guard<std::mutex> lock(mutex_);
    reading_ = false;
    try {
      if (!error.empty()) throw IoError(error);
      attach(blob);
      blob_ = blob;
      if (tracker_ != nullptr) tracker_->add(category_, bytes_);
    } catch (const std::exception& e) {
      tier_.fail(e.what());
    }
    cv_.notify_all();
  });
}

void TierPiece::startWriteLocked() {
  if (queuedVersion_ == version_) return;  // these bytes are on their way already
  queuedVersion_ = version_;
  ++writes_;
  const int64_t version = version_;
  at::Storage blob = blob_;
  tier_.submitWrite([this, blob, version] {
    std::string error;
    try {
      tier_.store(slot_, blob.data(), bytes_);
    } catch (const std::exception& e) {
      error = e.what();
    }
    std::lock_guard<std::mutex> lock(mutex_);
    --writes_;
    try {
      if (!error.empty()) throw IoError(error);
      if (version == version_) tierCurrent_ = true;
      detachIfIdleLocked();  // current, or spent while it was written
    } catch (const std::exception& e) {
      tier_.fail(e.what());
    }
    cv_.notify_all();
  });
}

void TierPiece::prefetch() {
  std::lock_guard<std::mutex> lock(mutex_);
  prefetched_ = true;  // in memory already (a write pending): kept there
  startReadLocked();
}

void TierPiece::acquire() {
  std::unique_lock<std::mutex> lock(mutex_);
  ++pins_;
  prefetched_ = false;
  startReadLocked();
  cv_.wait(lock, [&] { return static_cast<bool>(blob_) || (!reading_ && tier_.failed()); });
  if (!static_cast<bool>(blob_)) {
    --pins_;
    lock.unlock();
    tier_.check();
    throw IoError("memory tier: a piece could not be read back");
  }
}

void TierPiece::acquireToOverwrite() {
  std::unique_lock<std::mutex> lock(mutex_);
  ++pins_;
  prefetched_ = false;
  cv_.wait(lock, [&] { return !reading_; });
  if (!static_cast<bool>(blob_)) {
    at::Storage blob = newBlob(tier_, bytes_);
    attach(blob);
    blob_ = blob;
    if (tracker_ != nullptr) tracker_->add(category_, bytes_);
  }
  ++version_;  // what the tier holds is not these bytes any more
  tierCurrent_ = false;
}

void TierPiece::release(Release how) {
  std::lock_guard<std::mutex> lock(mutex_);
  CARAVAN_CHECK(pins_ > 0 && static_cast<bool>(blob_), "a tier piece released without acquire");
  --pins_;
  if (how == Release::kChanged) {
    ++version_;
    tierCurrent_ = false;
  } else if (how == Release::kSpent) {
    ++version_;  // a write in flight does not make the tier "current" again
    tierCurrent_ = true;
  }
  if (pins_ == 0 && !tierCurrent_) startWriteLocked();
  detachIfIdleLocked();
}

void TierPiece::waitWritten() {
  std::unique_lock<std::mutex> lock(mutex_);
  cv_.wait(lock, [&] { return writes_ == 0 || tier_.failed(); });
  lock.unlock();
  tier_.check();
}

}  // namespace caravan
