// LruMap: a string-keyed map that remembers use order (Python's OrderedDict with move_to_end):
// iteration runs least recently used first; find, touch, add and erase are O(1).
#pragma once

#include <iterator>
#include <list>
#include <string>
#include <unordered_map>
#include <utility>

namespace bsd {

template <class V>
class LruMap {
public:
    using Item = std::pair<std::string, V>;

    V* find(const std::string& key) {
        auto it = index_.find(key);
        return it == index_.end() ? nullptr : &it->second->second;
    }
    const V* find(const std::string& key) const {
        auto it = index_.find(key);
        return it == index_.end() ? nullptr : &it->second->second;
    }
    // Moves `key` to the most recently used end (nothing if absent).
    void touch(const std::string& key) {
        auto it = index_.find(key);
        if (it != index_.end()) items_.splice(items_.end(), items_, it->second);
    }
    // A new entry at the most recently used end; `key` must be absent.
    template <class... Args>
    V& add(const std::string& key, Args&&... args) {
        items_.emplace_back(std::piecewise_construct, std::forward_as_tuple(key),
                            std::forward_as_tuple(std::forward<Args>(args)...));
        index_[key] = std::prev(items_.end());
        return items_.back().second;
    }
    bool erase(const std::string& key) {
        auto it = index_.find(key);
        if (it == index_.end()) return false;
        items_.erase(it->second);
        index_.erase(it);
        return true;
    }
    size_t size() const { return items_.size(); }
    const std::list<Item>& items() const { return items_; }  // least recently used first
    std::list<Item>& items() { return items_; }

private:
    std::list<Item> items_;
    std::unordered_map<std::string, typename std::list<Item>::iterator> index_;
};

}  // namespace bsd
