// TreeBuilder's merging by token path (builder.h).
#include "builder.h"

#include <algorithm>

namespace bsd {

int32_t TreeBuilder::find(int32_t parent, int32_t token) const {
    for (int32_t c = parent < 0 ? root_first_ : first_[static_cast<size_t>(parent)]; c >= 0;
         c = next_[static_cast<size_t>(c)])
        if (tokens[static_cast<size_t>(c)] == token) return c;
    return -1;
}

int32_t TreeBuilder::add(int32_t parent, int32_t token, double prob) {
    const double score = prob * (parent < 0 ? 1.0 : scores[static_cast<size_t>(parent)]);
    int32_t idx = find(parent, token);
    if (idx >= 0) {
        scores[static_cast<size_t>(idx)] = std::max(scores[static_cast<size_t>(idx)], score);
        return idx;
    }
    idx = static_cast<int32_t>(tokens.size());
    tokens.push_back(token);
    parents.push_back(parent);
    scores.push_back(score);
    first_.push_back(-1);
    last_.push_back(-1);
    next_.push_back(-1);
    int32_t& head = parent < 0 ? root_first_ : first_[static_cast<size_t>(parent)];
    int32_t& tail = parent < 0 ? root_last_ : last_[static_cast<size_t>(parent)];
    if (tail >= 0) next_[static_cast<size_t>(tail)] = idx;
    else head = idx;
    tail = idx;
    return idx;
}

void TreeBuilder::add_chain(const std::vector<std::pair<int32_t, double>>& chain) {
    int32_t parent = -1;
    for (const auto& [token, prob] : chain) {
        if (full()) return;
        parent = add(parent, token, prob);
    }
}

void TreeBuilder::finish() {
    for (size_t i = 0; i < tokens.size(); ++i)
        if (parents[i] >= 0) scores[i] = std::min(scores[i], scores[static_cast<size_t>(parents[i])]);
}

}  // namespace bsd
