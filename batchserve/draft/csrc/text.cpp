// Text's searches (text.h): an occurrence list walked newest first, each checked backwards.
#include "text.h"

#include <algorithm>

namespace bsd {

void Text::extend(const int32_t* t, size_t n) {
    for (size_t i = 0; i < n; ++i) {
        if (t[i] != kSeparator) at_[t[i]].push_back(static_cast<int32_t>(tok_.size()));
        tok_.push_back(t[i]);
    }
}

void Text::drop_front(size_t first) {
    std::vector<int32_t> rest(tok_.begin() + static_cast<std::ptrdiff_t>(first), tok_.end());
    std::vector<int32_t>().swap(tok_);  // clear() would keep the capacity: release it
    std::unordered_map<int32_t, std::vector<int32_t>>().swap(at_);
    tok_.reserve(rest.size());
    extend(rest.data(), rest.size());
}

void Text::find(const int32_t* key, size_t m, std::vector<int32_t>& ends) const {
    ends.clear();
    auto it = at_.find(key[m - 1]);
    if (it == at_.end()) return;
    const std::vector<int32_t>& ps = it->second;
    for (auto p = ps.rbegin(); p != ps.rend() && ends.size() < kMaxOccurrences; ++p) {
        if (static_cast<size_t>(*p) + 1 < m) break;  // too close to the start: so are the rest
        if (agrees(*p, key, m, m) == m) ends.push_back(*p + 1);
    }
    std::reverse(ends.begin(), ends.end());
}

size_t Text::copy_source(const int32_t* key, size_t n, size_t limit, std::vector<int32_t>& after) const {
    after.clear();
    limit = std::min(limit, n);
    if (limit < 1 || tok_.size() < 2) return 0;
    auto it = at_.find(key[n - 1]);
    if (it == at_.end()) return 0;
    const std::vector<int32_t>& ps = it->second;
    size_t best = 0;
    for (auto p = ps.rbegin(); p != ps.rend(); ++p) {
        if (static_cast<size_t>(*p) + 1 >= tok_.size()) continue;  // no token after it
        const size_t a = agrees(*p, key, n, limit);
        if (a > best) {
            best = a;
            after.clear();
        }
        if (a == best && after.size() < kMaxOccurrences) after.push_back(*p + 1);
        if (best == limit && after.size() == kMaxOccurrences) break;  // nothing can beat these
    }
    std::reverse(after.begin(), after.end());
    return best;
}

void Text::continuation(std::vector<int32_t> after, size_t length, Chain& chain) const {
    chain.clear();
    if (after.empty()) return;
    const size_t from = static_cast<size_t>(after.back());
    const size_t to = std::min(tok_.size(), from + std::min(length, static_cast<size_t>(depth_)));
    for (size_t i = from; i < to; ++i) {
        const int32_t token = tok_[i];
        if (after.size() == 1) {  // one occurrence left: it is the copy, every share 1
            for (size_t j = i; j < to; ++j) chain.emplace_back(tok_[j], 1.0);
            return;
        }
        size_t kept = 0, agree = 0;
        for (int32_t a : after) {
            if (static_cast<size_t>(a) >= tok_.size()) continue;
            ++kept;
            if (tok_[static_cast<size_t>(a)] == token) after[agree++] = a + 1;
        }
        chain.emplace_back(token, static_cast<double>(agree) / static_cast<double>(kept));
        after.resize(agree);
    }
}

size_t Text::bytes() const {
    size_t n = tok_.capacity() * sizeof(int32_t);
    for (const auto& item : at_) n += item.second.capacity() * sizeof(int32_t) + 64;
    return n;
}

}  // namespace bsd
