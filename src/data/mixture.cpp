// Mixtures of sources (see sources.h, mixSources).
#include <algorithm>
#include <cmath>
#include <memory>
#include <numeric>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include "core/errors.h"
#include "data/sources.h"

namespace caravan {
namespace {

constexpr int64_t kPeriod = 1024;  // slots in one round of the interleave

// Which source each slot of a period holds and its ordinal among that source's slots.
struct Interleave {
  std::vector<int> source;         // [kPeriod]
  std::vector<int64_t> ordinal;    // [kPeriod]
  std::vector<int64_t> perPeriod;  // slots per period of each source
};

Interleave makeInterleave(const std::vector<MixtureSource>& sources) {
  const double total =
      std::accumulate(sources.begin(), sources.end(), 0.0,
                      [](double a, const MixtureSource& s) { return a + s.weight; });
  // Slots per source: floor of the share, then the largest remainders (ties: the first source).
  const auto n = sources.size();
  Interleave in;
  in.perPeriod.assign(n, 0);
  std::vector<double> remainder(n);
  int64_t given = 0;
  for (size_t s = 0; s < n; ++s) {
    const double exact = sources[s].weight / total * static_cast<double>(kPeriod);
    in.perPeriod[s] = static_cast<int64_t>(std::floor(exact));
    remainder[s] = exact - static_cast<double>(in.perPeriod[s]);
    given += in.perPeriod[s];
  }
  std::vector<size_t> order(n);
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(),
                   [&](size_t a, size_t b) { return remainder[a] > remainder[b]; });
  for (size_t k = 0; given < kPeriod; ++k, ++given) ++in.perPeriod[order[k % n]];
  for (size_t s = 0; s < n; ++s) {
    if (in.perPeriod[s] == 0) {
      throw DataError(fmt::format(
          "data.sources: {} has weight {} of {} in all, less than one sample in {}; raise its "
          "weight or leave it out",
          sources[s].label, sources[s].weight, total, kPeriod));
    }
  }
  // Smooth weighted round robin: each slot goes to the source furthest behind its share.
  std::vector<int64_t> credit(n, 0), taken(n, 0);
  for (int64_t r = 0; r < kPeriod; ++r) {
    size_t best = 0;
    for (size_t s = 0; s < n; ++s) {
      credit[s] += in.perPeriod[s];
      if (credit[s] > credit[best]) best = s;
    }
    credit[best] -= kPeriod;
    in.source.push_back(static_cast<int>(best));
    in.ordinal.push_back(taken[best]++);
  }
  return in;
}

void checkSameExamples(const std::vector<MixtureSource>& sources) {
  const DataShape a = sources.front().splits.train->shape();
  for (const auto& s : sources) {
    const DataShape b = s.splits.train->shape();
    const bool same = a.task == b.task && a.channels == b.channels && a.height == b.height &&
                      a.width == b.width && a.vocabSize == b.vocabSize && a.seqLen == b.seqLen &&
                      a.inputShape == b.inputShape && a.targetShape == b.targetShape &&
                      a.inputType == b.inputType && a.targetType == b.targetType;
    if (!same) {
      throw DataError(fmt::format(
          "data.sources: {} and {} hold different examples ({} data: inputs [{}], {} "
          "classes/vocabulary, against [{}], {}); mix sources of one kind",
          sources.front().label, s.label, b.task == TaskKind::kLanguageModel ? "token" : "array",
          fmt::join(a.inputShape, ", "), std::max(a.numClasses, a.vocabSize),
          fmt::join(b.inputShape, ", "), std::max(b.numClasses, b.vocabSize)));
    }
  }
}

// The training mixture.
class MixtureDataset : public Dataset {
 public:
  MixtureDataset(std::vector<std::shared_ptr<const Dataset>> parts, std::vector<std::string> labels,
                 Interleave interleave, DataShape shape)
      : parts_(std::move(parts)),
        labels_(std::move(labels)),
        in_(std::move(interleave)),
        shape_(std::move(shape)) {
    for (const auto& p : parts_) size_ += p->size();
    for (size_t s = 0; s < parts_.size(); ++s) perEpoch_.push_back(slotsBefore(s, size_));
  }

  std::string name() const override { return "mixture/train"; }
  int64_t size() const override { return size_; }
  DataShape shape() const override { return shape_; }
  Batch get(const std::vector<int64_t>& indices) const override { return getForEpoch(indices, 0); }
  Batch getForEpoch(const std::vector<int64_t>& indices, int64_t epoch) const override {
    std::vector<Batch> rows;
    rows.reserve(indices.size());
    for (int64_t i : indices) {
      CARAVAN_CHECK(i >= 0 && i < size_, "index {} of {}", i, size_);
      const int s = in_.source[i % kPeriod];
      const int64_t k = slotsBefore(s, i);  // this slot's ordinal in its source this epoch
      const int64_t example = (epoch * perEpoch_[s] + k) % parts_[s]->size();
      rows.push_back(parts_[s]->get({example}));
    }
    std::vector<at::Tensor> inputs, targets;
    for (auto& b : rows) {
      inputs.push_back(b.input);
      targets.push_back(b.target);
    }
    return Batch{at::cat(inputs), at::cat(targets)};
  }
  std::vector<std::string> sourceLabels() const override { return labels_; }
  int sourceOf(int64_t index) const override { return in_.source[index % kPeriod]; }

 private:
  // Slots of source s among mixture indices [0, i).
  int64_t slotsBefore(size_t s, int64_t i) const {
    const int64_t periods = i / kPeriod, r = i % kPeriod;
    int64_t n = periods * in_.perPeriod[s];
    // Within the period: the ordinal of the next slot of s at or after r.
    for (int64_t q = r; q < kPeriod; ++q) {
      if (in_.source[q] == static_cast<int>(s)) return n + in_.ordinal[q];
    }
    return n + in_.perPeriod[s];
  }

  std::vector<std::shared_ptr<const Dataset>> parts_;
  std::vector<std::string> labels_;
  Interleave in_;
  DataShape shape_;
  int64_t size_ = 0;
  std::vector<int64_t> perEpoch_;
};

// The sources' test splits one after another.
class ConcatDataset : public Dataset {
 public:
  ConcatDataset(std::vector<std::shared_ptr<const Dataset>> parts, std::vector<std::string> labels)
      : parts_(std::move(parts)), labels_(std::move(labels)) {
    for (const auto& p : parts_) {
      starts_.push_back(size_);
      size_ += p->size();
    }
  }
  std::string name() const override { return "mixture/test"; }
  int64_t size() const override { return size_; }
  DataShape shape() const override { return parts_.front()->shape(); }
  Batch get(const std::vector<int64_t>& indices) const override {
    std::vector<at::Tensor> inputs, targets;
    for (int64_t i : indices) {
      const int s = sourceOf(i);
      Batch b = parts_[s]->get({i - starts_[s]});
      inputs.push_back(b.input);
      targets.push_back(b.target);
    }
    return Batch{at::cat(inputs), at::cat(targets)};
  }
  std::vector<std::string> sourceLabels() const override { return labels_; }
  int sourceOf(int64_t index) const override {
    CARAVAN_CHECK(index >= 0 && index < size_, "index {} of {}", index, size_);
    return static_cast<int>(std::upper_bound(starts_.begin(), starts_.end(), index) -
                            starts_.begin() - 1);
  }

 private:
  std::vector<std::shared_ptr<const Dataset>> parts_;
  std::vector<std::string> labels_;
  std::vector<int64_t> starts_;
  int64_t size_ = 0;
};

}  // namespace

DatasetSplits mixSources(const std::vector<MixtureSource>& sources) {
  CARAVAN_CHECK(!sources.empty(), "no sources to mix");
  checkSameExamples(sources);
  std::vector<std::shared_ptr<const Dataset>> train, test;
  std::vector<std::string> labels;
  DataShape shape = sources.front().splits.train->shape();
  for (const auto& s : sources) {
    train.push_back(s.splits.train);
    test.push_back(s.splits.test);
    labels.push_back(s.label);
    // Classes: as many as the source with the most (a source may lack the highest ids).
    shape.numClasses = std::max(shape.numClasses, s.splits.train->shape().numClasses);
  }
  return DatasetSplits{
      std::make_shared<MixtureDataset>(train, labels, makeInterleave(sources), shape),
      std::make_shared<ConcatDataset>(test, labels)};
}

}  // namespace caravan
