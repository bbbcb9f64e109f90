// A generic data tree: what a pickle or JSON file holds (None, bool, int, float, str,
// list, tuple, dict). It keeps everything a file says, so a snapshot read and written
// again loses nothing, and containers are shared, so a list referenced twice in a pickle
// (its memo) stays one object and is written once.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <utility>
#include <variant>
#include <vector>

namespace ccalloc::io {

class Value;
using List = std::vector<Value>;
// Dict entries in file order. Keys are usually strings; pickle allows other keys.
using Dict = std::vector<std::pair<Value, Value>>;

class Value {
 public:
  struct None {
    bool operator==(const None&) const = default;
  };
  // A tuple is a list that is written back as a tuple.
  struct Tuple {
    List items;
  };
  using ListPtr = std::shared_ptr<List>;
  using TuplePtr = std::shared_ptr<Tuple>;
  using DictPtr = std::shared_ptr<Dict>;
  using Storage = std::variant<None, bool, std::int64_t, double, std::string, ListPtr, TuplePtr,
                               DictPtr>;

  Value() = default;
  Value(None) {}                                                  // NOLINT
  Value(bool b) : v_(b) {}                                        // NOLINT
  Value(std::int64_t i) : v_(i) {}                                // NOLINT
  Value(int i) : v_(std::int64_t{i}) {}                           // NOLINT
  Value(double d) : v_(d) {}                                      // NOLINT
  Value(std::string s) : v_(std::move(s)) {}                      // NOLINT
  Value(const char* s) : v_(std::string(s)) {}                    // NOLINT
  Value(ListPtr l) : v_(std::move(l)) {}                          // NOLINT
  Value(TuplePtr t) : v_(std::move(t)) {}                         // NOLINT
  Value(DictPtr d) : v_(std::move(d)) {}                          // NOLINT

  static Value list(List items = {}) { return Value(std::make_shared<List>(std::move(items))); }
  static Value tuple(List items = {}) {
    return Value(std::make_shared<Tuple>(Tuple{std::move(items)}));
  }
  static Value dict(Dict items = {}) { return Value(std::make_shared<Dict>(std::move(items))); }

  bool is_none() const { return std::holds_alternative<None>(v_); }
  bool is_bool() const { return std::holds_alternative<bool>(v_); }
  bool is_int() const { return std::holds_alternative<std::int64_t>(v_); }
  bool is_float() const { return std::holds_alternative<double>(v_); }
  bool is_string() const { return std::holds_alternative<std::string>(v_); }
  bool is_list() const { return std::holds_alternative<ListPtr>(v_); }
  bool is_tuple() const { return std::holds_alternative<TuplePtr>(v_); }
  bool is_dict() const { return std::holds_alternative<DictPtr>(v_); }

  // Accessors throw FormatError naming the expected and the actual kind.
  bool as_bool() const;
  std::int64_t as_int() const;
  double as_number() const;  // int or float
  const std::string& as_string() const;
  const List& as_list() const;  // a list or a tuple
  const Dict& as_dict() const;
  List& mutable_list();
  Dict& mutable_dict();

  // The value for a string key of a dict, or nullptr (linear search: dicts are small).
  const Value* find(std::string_view key) const;
  // As find(), but throws FormatError naming the missing key.
  const Value& at(std::string_view key) const;

  const Storage& storage() const { return v_; }
  // The identity of a shared container (for memo sharing), or nullptr for scalars.
  const void* identity() const;
  std::string_view kind_name() const;

  // Deep equality (containers compared by contents; int 1 != float 1.0 != bool true).
  bool operator==(const Value& other) const;

 private:
  Storage v_;
};

}  // namespace ccalloc::io
