// Recent outputs (recent.h): kept per scope as requests end, trimmed oldest first, copied from.
#include "recent.h"

#include <algorithm>
#include <cstring>

namespace bsd {

namespace {

uint64_t hash_tokens(const int32_t* t, size_t n) {
    uint64_t h = 0x9e3779b97f4a7c15ULL ^ n;
    for (size_t i = 0; i < n; ++i) {
        h ^= static_cast<uint32_t>(t[i]);
        h *= 0x100000001b3ULL;
        h ^= h >> 29;
    }
    return h;
}

}  // namespace

size_t copy_chain(const Text& text, const int32_t* key, size_t n, size_t limit, Chain& chain,
                  std::vector<int32_t>& scratch) {
    chain.clear();
    const size_t m = text.copy_source(key, n, limit, scratch);
    if (m < kCopyMinMatch) return m;
    text.continuation(scratch, kCopyPerMatch * m, chain);
    for (size_t i = 0; i < chain.size(); ++i) {
        if (chain[i].first == kSeparator) {
            chain.resize(i);
            break;
        }
    }
    return m;
}

void Recent::begin(const std::string& id, const std::string* scope, const int32_t* prompt, size_t n) {
    if (scope == nullptr || capacity_ < 2) return;
    const uint64_t h = hash_tokens(prompt, n);
    const Kept* kept = scopes_.find(*scope);
    int64_t repeat = -1;
    if (kept != nullptr) {
        auto it = kept->starts.find(h);
        if (it != kept->starts.end()) repeat = it->second;
    }
    running_[id] = Running{*scope, h, static_cast<int64_t>(n), repeat, false};
}

void Recent::resumed(const std::string& id) {
    auto it = running_.find(id);
    if (it != running_.end()) it->second.resumed = true;
}

void Recent::end(const std::string& id, const int32_t* output, size_t n) {
    auto it = running_.find(id);
    if (it == running_.end()) return;
    const Running run = it->second;
    running_.erase(it);
    if (n == 0) return;
    Kept* kept = scopes_.find(run.scope);
    if (kept == nullptr) kept = &scopes_.add(run.scope, depth_);
    scopes_.touch(run.scope);
    const size_t keep = std::min(n, static_cast<size_t>(capacity_ - 1));  // one output never outgrows the bound
    output += n - keep;
    if (!run.resumed) kept->starts[run.prompt_hash] = kept->trimmed + static_cast<int64_t>(kept->text.size());
    kept->text.extend(output, keep);
    kept->text.extend(&kSeparator, 1);
    num_tokens_ += static_cast<int64_t>(keep) + 1;
    kept->bytes = kept->text.bytes();
    // Its own oldest outputs go: the newest (at most capacity_ tokens) always stays.
    while ((kept = scopes_.find(run.scope)) != nullptr && static_cast<int64_t>(kept->text.size()) > capacity_)
        trim(run.scope);
}

bool Recent::trim_oldest(const std::string& scope) {
    if (scopes_.find(scope) == nullptr) return false;
    trim(scope);
    return true;
}

void Recent::drop(const std::string& scope) {
    const Kept* kept = scopes_.find(scope);
    if (kept == nullptr) return;
    num_tokens_ -= static_cast<int64_t>(kept->text.size());
    scopes_.erase(scope);
}

size_t Recent::copy(const std::string& id, const Text& own, const int32_t* key, size_t n, Chain& chain,
                    std::vector<int32_t>& scratch) {
    chain.clear();
    auto it = running_.find(id);
    if (it == running_.end()) return 0;
    Running& run = it->second;
    const Kept* kept = scopes_.find(run.scope);
    if (kept == nullptr) return 0;
    if (run.repeat >= 0) {
        const int64_t start = run.repeat - kept->trimmed;
        const size_t done = own.size() - static_cast<size_t>(run.num_prompt);
        const size_t size = kept->text.size();
        if (start >= 0 && static_cast<size_t>(start) + done <= size &&
            std::memcmp(kept->text.data() + start, own.data() + run.num_prompt, done * sizeof(int32_t)) == 0) {
            const size_t from = static_cast<size_t>(start) + done;
            for (size_t i = from; i < size && i < from + static_cast<size_t>(depth_); ++i) {
                if (kept->text.at(i) == kSeparator) break;
                chain.emplace_back(kept->text.at(i), 1.0);
            }
            if (!chain.empty()) return kMatchCap;
        }
        // Diverged, trimmed away or ended: an output only grows, so it never copies it again.
        run.repeat = -1;
    }
    return copy_chain(kept->text, key, n, static_cast<size_t>(kMatchCap), chain, scratch);
}

std::vector<std::string> Recent::scopes() const {
    std::vector<std::string> out;
    for (const auto& item : scopes_.items()) out.push_back(item.first);
    return out;
}

size_t Recent::bytes() const {
    size_t n = 0;
    for (const auto& item : scopes_.items()) n += item.second.bytes;
    return n;
}

void Recent::trim(std::string scope) {
    Kept* kept = scopes_.find(scope);
    std::vector<size_t> ends;  // where each output's separator is
    for (size_t i = 0; i < kept->text.size(); ++i)
        if (kept->text.at(i) == kSeparator) ends.push_back(i);
    const size_t cut = ends.size() > 1 ? ends[ends.size() / 2 - 1] + 1 : kept->text.size();
    num_tokens_ -= static_cast<int64_t>(cut);
    if (cut >= kept->text.size()) {
        scopes_.erase(scope);
        return;
    }
    kept->text.drop_front(cut);
    kept->bytes = kept->text.bytes();
    kept->trimmed += static_cast<int64_t>(cut);
    for (auto it = kept->starts.begin(); it != kept->starts.end();) {
        if (it->second < kept->trimmed) it = kept->starts.erase(it);
        else ++it;
    }
}

}  // namespace bsd
