// Each scope's latest finished outputs (never a prompt, never resumed tokens), one Text per
// scope with a separator between two outputs, bounded in tokens per scope: a scope over its bound
// loses its own oldest half, never another scope's outputs. A request whose prompt hashes the same
// as an earlier one of its scope copies that output from its first token on, while its own output
// agrees with it. The bodies are in recent.cpp.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <unordered_map>
#include <vector>

#include "constants.h"
#include "lru.h"
#include "text.h"

namespace bsd {

// (m, chain): the longest suffix of key[0, n) (at most `limit`) found in `text` with a token
// after it and, where m >= kCopyMinMatch, what followed its most recent occurrence
// (kCopyPerMatch tokens per token of match, up to the text's depth, never past a separator).
size_t copy_chain(const Text& text, const int32_t* key, size_t n, size_t limit, Chain& chain,
                  std::vector<int32_t>& scratch);

class Recent {
public:
    Recent(int64_t capacity, int depth) : capacity_(capacity), depth_(depth) {}

    // A request starts (a scope's, else nothing to keep): is its prompt one the scope answered?
    void begin(const std::string& id, const std::string* scope, const int32_t* prompt, size_t n);
    // The request resumed an earlier generation: what it outputs from here is no output of its
    // prompt from the first token, so it is never a repeat source for that prompt.
    void resumed(const std::string& id);
    // The request ended with output[0, n): its scope keeps it (the newest capacity_ - 1 tokens).
    void end(const std::string& id, const int32_t* output, size_t n);
    // The request ended without end() (a failure on the way): forget it.
    void cancel(const std::string& id) { running_.erase(id); }
    // Drop the oldest half of `scope`'s outputs (all of them when it holds one); false: it holds none.
    bool trim_oldest(const std::string& scope);
    void drop(const std::string& scope);

    // (match, chain) for a running request whose text is `own` (its prompt the first
    // `num_prompt` tokens) and whose key is key[0, n): the earlier output of its very prompt
    // while its output agrees (match kMatchCap), else copy_chain over its scope's outputs.
    size_t copy(const std::string& id, const Text& own, const int32_t* key, size_t n, Chain& chain,
                std::vector<int32_t>& scratch);

    std::vector<std::string> scopes() const;  // least recently used first
    size_t bytes() const;
    size_t bytes(const std::string& scope) const {  // O(1): kept as its text changes
        const Kept* kept = scopes_.find(scope);
        return kept == nullptr ? 0 : kept->bytes;
    }
    const Text* text(const std::string& scope) const {
        const Kept* kept = scopes_.find(scope);
        return kept == nullptr ? nullptr : &kept->text;
    }
    int64_t num_tokens() const { return num_tokens_; }  // in every scope's text, separators included

private:
    struct Kept {
        explicit Kept(int depth) : text(depth) {}
        Text text;
        int64_t trimmed = 0;  // tokens dropped off the front: positions count from the first ever kept
        std::unordered_map<uint64_t, int64_t> starts;  // prompt hash -> where its latest output starts
        size_t bytes = 0;  // text.bytes() as of its last change (that sum walks the index)
    };
    struct Running {
        std::string scope;
        uint64_t prompt_hash;
        int64_t num_prompt;
        int64_t repeat;  // where an earlier identical prompt's output starts; -1: none
        bool resumed;    // its output so far came with it: the rest is no output of its prompt alone
    };

    // Drop the oldest half of `scope`'s outputs, or all of them.
    void trim(std::string scope);  // a copy: erasing the scope may free the caller's string

    int64_t capacity_;  // per scope; below 2 (an output and its separator): keep none
    int depth_;         // the longest continuation a copy drafts (own_branch_length)
    int64_t num_tokens_ = 0;
    LruMap<Kept> scopes_;  // least recently used first
    std::unordered_map<std::string, Running> running_;
};

}  // namespace bsd
