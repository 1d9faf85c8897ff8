// TreeBuilder: a draft tree accumulated by token path, so several matches merge into one tree.
// Node scores are path probabilities: a node's probability given its parent times the parent's.
// The bodies are in builder.cpp.
#pragma once

#include <cstddef>
#include <cstdint>
#include <utility>
#include <vector>

namespace bsd {

class TreeBuilder {
public:
    explicit TreeBuilder(size_t budget) : budget_(budget) {}

    bool full() const { return tokens.size() >= budget_; }
    size_t budget() const { return budget_; }
    bool empty() const { return tokens.empty(); }

    // The child of `parent` (-1: the root) carrying `token`, or -1.
    int32_t find(int32_t parent, int32_t token) const;
    // Add (or find) the node; `prob` is its probability given its parent. Reached again from
    // another match, a node keeps the more confident estimate.
    int32_t add(int32_t parent, int32_t token, double prob);
    // A path from the root, (token, probability given the previous) per step, while there is room.
    void add_chain(const std::vector<std::pair<int32_t, double>>& chain);
    // A later match can raise a parent's score above its children's: keep children at or below.
    void finish();

    std::vector<int32_t> tokens;
    std::vector<int32_t> parents;  // -1: a child of the root
    std::vector<double> scores;

private:
    size_t budget_;
    std::vector<int32_t> first_, last_, next_;  // children lists, in insertion order
    int32_t root_first_ = -1, root_last_ = -1;
};

}  // namespace bsd
